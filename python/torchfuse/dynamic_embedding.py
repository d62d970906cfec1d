"""Dynamic embeddings: a hash-table embedding keyed by any int64 that grows, evicts, spills rows to
host memory and trains with a fused optimizer in the backward pass.

The table's state is a set of tensors owned by the module (kernels/dynemb_kernels.h documents the layout):
keys, digests (0 = empty slot, so every int64 is a usable key), scores, values and optimizer state,
indexed by slot. Operations are the internal ops ``torch.ops.torchfuse.dynemb_*`` on those tensors.
"""
import zlib
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.torchfuse)
from . import optim as _optim
from ._stats import count

_ops = torch.ops.torchfuse
_find_or_insert_sync_op = _ops.dynemb_find_or_insert_sync.default  # the overload itself: called ahead of every launch
_find_or_insert_pool_op = _ops.dynemb_find_or_insert_pool.default
_EVICTIONS = ("lru", "lfu", "none")
_INIT_KINDS = {"normal": 1, "uniform": 2, "constant": 3}
_NO_INIT = (0, 0.0, 0.0)  # TF_INIT_NONE: rows left as they are, optimizer state zeroed
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_MAX_EPOCH = 2**31 - 2
_FUSED_FIND_MIN_ROW_BYTES = 512


def _mix64(x: int) -> int:  # tf_mix64 (kernels/dynemb_kernels.h): the key hash
    m = 2**64 - 1
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


# The key an empty slot holds: one that hashes to another bucket (tf_dynemb_table's vacant-key rule),
# so a probe of that bucket can never match it, even against a digest being written beside it.
# _VACANT_B's hash differs from _VACANT_A's in bit 0, so their buckets differ at every bucket count.
_VACANT_A = 0
_VACANT_B = next(k for k in range(1, 64) if (_mix64(k) ^ _mix64(_VACANT_A)) & 1)


def _vacant_keys(slots: Tensor, bucket_size: int, num_buckets: int) -> Tensor:
    """The vacant key of each slot (int64 slots -> int64 keys)."""
    bucket_a = _mix64(_VACANT_A) & (num_buckets - 1)
    return torch.where(slots // bucket_size == bucket_a, _VACANT_B, _VACANT_A)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _check_initializer(init):
    if not isinstance(init, (tuple, list)) or not init or init[0] not in _INIT_KINDS:
        raise ValueError(
            "torchfuse.DynamicEmbedding: initializer must be ('normal', mean, std), ('uniform', lo, hi) or "
            f"('constant', value), got {init!r}"
        )
    kind = init[0]
    want = 2 if kind == "constant" else 3
    if len(init) != want:
        raise ValueError(f"torchfuse.DynamicEmbedding: initializer {kind!r} takes {want - 1} numbers, got {init!r}")
    nums = [float(x) for x in init[1:]]
    if kind == "normal" and nums[1] < 0:
        raise ValueError(f"torchfuse.DynamicEmbedding: normal initializer needs std >= 0, got {nums[1]}")
    return (kind, *nums)


class _Rows(torch.autograd.Function):
    """The table rows of unique keys; backward applies the table's fused optimizer to them."""

    @staticmethod
    def forward(ctx, anchor, table, slots, keys):
        ctx.table = table
        ctx.version = table._version
        ctx.save_for_backward(slots, keys)
        return table._gather(slots, table._values, table._values_host)

    @staticmethod
    def backward(ctx, grad):
        slots, keys = ctx.saved_tensors
        table = ctx.table
        if table._version != ctx.version:  # rehashed, evicted or erased since the forward: find the rows again
            slots = table._lookup(keys)
        table._apply_gradient(slots, grad)
        return None, None, None, None


class _Fused(torch.autograd.Function):
    """Per-id rows (offsets None) or bags pooled straight from the table; backward sums each unique
    id's gradient in a fixed order (dynemb_segment_sum) and applies the optimizer to its row.
    The batch's layout comes as one tuple, kept on ctx (none of its tensors is an input that
    requires grad or an output): autograd.Function's per-call cost grows with the number of
    arguments (each is inspected in apply and answered in backward), and a training step from an
    idle GPU waits for that host time. batch: (slots_id, offsets, weights, mean, perm, seg,
    slots_u, uniq, bag_of, scale), and an eleventh entry when the bags were pooled already (by
    dynemb_find_or_insert_pool, during the insert's host wait): then forward returns it as the
    output (slots_id is None)."""

    @staticmethod
    def forward(ctx, anchor, table, batch):
        slots_id, offsets, weights, mean = batch[:4]
        ctx.table = table
        ctx.version = table._version
        ctx.batch = batch[:10]
        if len(batch) > 10:  # pooled already (dynemb_find_or_insert_pool)
            return batch[10]
        if offsets is None:
            return table._gather(slots_id, table._values, table._values_host)
        return _ops.dynemb_pool(slots_id, offsets, weights, table._values, table._values_host, mean)

    @staticmethod
    def backward(ctx, grad):
        perm, seg, slots_u, uniq, bag_of, scale = ctx.batch[4:]
        table = ctx.table
        if table._version != ctx.version:  # rehashed, evicted or erased since the forward
            slots_u = table._lookup(uniq)
        table._apply_segment_gradient(slots_u, grad.contiguous(), perm, seg, bag_of, scale)
        return None, None, None


class DynamicEmbedding(torch.nn.Module):
    """An embedding table keyed by arbitrary int64 ids, stored in a GPU (or CPU) hash table.

    ``forward(ids)``: int ids of any shape -> ``(*ids.shape, embedding_dim)``. In training mode unseen
    ids are inserted with the initializer; in eval mode they are not inserted and read as zeros.
    Repeated ids in one batch map to one row. The backward sums each unique id's gradient
    (deterministically) and applies ``optimizer`` to its row in place: the table has no
    ``nn.Parameter``; ``requires_grad_(False)`` freezes it. One backward pass is one optimizer step.

    Args:
        embedding_dim: row width.
        capacity: initial number of slots (rounded up to bucket_size times a power of two).
        max_capacity: the table doubles (rehash) up to this many slots while the load factor would
            pass ``max_load_factor`` or a bucket overflows; default: ``capacity`` (no growth).
        dtype: row dtype (float32, bfloat16, float16); optimizer state is float32.
        device: where the table lives.
        eviction: when a full bucket of a table at max_capacity receives a new key: "lru" evicts the
            key of the bucket accessed least recently, "lfu" the least frequently, "none" raises.
            Keys used by the running batch are never evicted by it. Evicted keys and rows are kept in
            a bounded record (:meth:`drain_evicted`) and returned by ``insert(..., return_evicted=True)``.
        initializer: ("normal", mean, std) | ("uniform", lo, hi) | ("constant", v); values are a
            function of (key, seed): the same on every device and in any batch order.
        optimizer: torchfuse.optim.SGD | Adagrad | RowWiseAdagrad | Adam (default SGD(lr=0.01)).
        hbm_budget_bytes: GPU memory for rows (values plus optimizer state); the rows past it live in
            pinned, mapped host memory that the kernels read directly. Keys and scores stay on the GPU.
        seed: initializer seed.
        max_load_factor: growth threshold (default 0.75).
        bucket_size: slots per bucket (power of two, 4..128; default 128, smaller for tiny tables).
        evicted_record_limit: at most this many evicted keys are kept for drain_evicted (oldest dropped,
            counted in ``evicted_dropped``). 0 keeps none: evictions are only counted in
            ``evicted_dropped``, and the kernels write the new keys' rows over the victims' at once (no
            copy of the victims' rows; HierarchicalKV's find_or_insert semantics). ``insert(...,
            return_evicted=True)`` still returns what it evicted.
    """

    def __init__(self, embedding_dim: int, capacity: int, *, max_capacity: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device="cuda", eviction: str = "lru",
                 initializer=("normal", 0.0, 0.01), optimizer=None, hbm_budget_bytes: Optional[int] = None,
                 seed: int = 0, max_load_factor: float = 0.75, bucket_size: int = 128,
                 evicted_record_limit: int = 1 << 20):
        super().__init__()
        name = type(self).__name__
        if not (isinstance(embedding_dim, int) and embedding_dim >= 1):
            raise ValueError(f"torchfuse.{name}: embedding_dim must be a positive int, got {embedding_dim!r}")
        if not (isinstance(capacity, int) and capacity >= 1):
            raise ValueError(f"torchfuse.{name}: capacity must be a positive int, got {capacity!r}")
        if max_capacity is not None and not (isinstance(max_capacity, int) and max_capacity >= capacity):
            raise ValueError(f"torchfuse.{name}: max_capacity must be an int >= capacity ({capacity}), got {max_capacity!r}")
        if dtype not in _DTYPES:
            raise TypeError(f"torchfuse.{name}: dtype must be float32, float16 or bfloat16, got {dtype}")
        if eviction not in _EVICTIONS:
            raise ValueError(f"torchfuse.{name}: eviction must be one of {_EVICTIONS}, got {eviction!r}")
        if not (0.0 < max_load_factor <= 1.0):
            raise ValueError(f"torchfuse.{name}: max_load_factor must be in (0, 1], got {max_load_factor}")
        if bucket_size not in (4, 8, 16, 32, 64, 128):
            raise ValueError(f"torchfuse.{name}: bucket_size must be a power of two in [4, 128], got {bucket_size}")
        optimizer = _optim.SGD(lr=0.01) if optimizer is None else optimizer
        if not isinstance(optimizer, _optim._Fused):
            raise TypeError(f"torchfuse.{name}: optimizer must be a torchfuse.optim optimizer, got {optimizer!r}")
        if hbm_budget_bytes is not None and hbm_budget_bytes < 0:
            raise ValueError(f"torchfuse.{name}: hbm_budget_bytes must be >= 0, got {hbm_budget_bytes}")
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.eviction = eviction
        self.initializer = _check_initializer(initializer)
        self.optimizer = optimizer
        self.hbm_budget_bytes = hbm_budget_bytes
        self.seed = int(seed)
        self.max_load_factor = float(max_load_factor)
        self.bucket_size = max(4, min(bucket_size, _pow2_at_least(capacity)))
        self.evicted_record_limit = int(evicted_record_limit)
        cap = self._round_capacity(capacity)
        self.max_capacity = self._round_capacity(max_capacity) if max_capacity is not None else cap
        self._trainable = True
        self._size = 0
        self._clock = 0      # LRU time: one tick per table operation
        self._epoch = 0      # marks slots used by the running operation (kernels/dynemb_kernels.h)
        self._step = 0       # optimizer steps (Adam's bias correction)
        self._version = 0    # bumped whenever slots move or disappear
        self._evicted: List[Tuple[Tensor, Tensor, Tensor, Tensor]] = []
        self._evicted_count = 0
        self.evicted_dropped = 0
        self._counts_host: Optional[Tensor] = None  # _host_counts' pinned buffer (CUDA tables)
        self._init_cache = None                     # _init_args' (initializer, args)
        self._device = torch.device(device)
        self._allocate(cap, self._device)

    # ---- storage ----

    def _round_capacity(self, c: int) -> int:
        return self.bucket_size * _pow2_at_least(-(-int(c) // self.bucket_size))

    def _state_dim(self) -> int:
        return self.optimizer.state_dim(self.embedding_dim)

    def _hbm_rows(self, cap: int, device: torch.device) -> int:
        if self.hbm_budget_bytes is None:
            return cap
        row_bytes = self.embedding_dim * torch.tensor([], dtype=self.dtype).element_size() + 4 * self._state_dim()
        return min(cap, self.hbm_budget_bytes // row_bytes)

    def _tiered(self, rows_hbm: int, cap: int, cols: int, dtype, device) -> Tuple[Tensor, Tensor]:
        hbm = torch.empty((rows_hbm, cols), dtype=dtype, device=device)
        n_host = cap - rows_hbm
        if device.type == "cuda" and n_host > 0:
            host = _ops.dynemb_host_rows(hbm, n_host, cols, dtype)
        else:  # a CPU table keeps its "host" rows in a second tensor: same addressing, tested on CPU
            host = torch.empty((n_host, cols), dtype=dtype, device=device)
        return hbm, host

    def _allocate(self, cap: int, device: torch.device):
        nb = cap // self.bucket_size
        self._keys = torch.full((cap,), _VACANT_A, dtype=torch.int64, device=device)
        bucket_a = _mix64(_VACANT_A) & (nb - 1)
        self._keys[bucket_a * self.bucket_size:(bucket_a + 1) * self.bucket_size] = _VACANT_B
        self._digests = torch.zeros(cap, dtype=torch.uint8, device=device)
        self._scores = torch.zeros(cap, dtype=torch.int64, device=device)
        self._marks = torch.zeros(cap, dtype=torch.int32, device=device)
        self._locks = torch.zeros(nb, dtype=torch.int32, device=device)
        n_hbm = self._hbm_rows(cap, device)
        self._values, self._values_host = self._tiered(n_hbm, cap, self.embedding_dim, self.dtype, device)
        self._state, self._state_host = self._tiered(n_hbm, cap, self._state_dim(), torch.float32, device)

    @property
    def capacity(self) -> int:
        return self._keys.numel()

    @property
    def device(self) -> torch.device:
        return self._keys.device

    @property
    def load_factor(self) -> float:
        return self._size / self.capacity

    @property
    def hbm_rows(self) -> int:
        """Slots whose rows are in device memory (the rest are in host memory)."""
        return self._values.shape[0]

    def __len__(self) -> int:
        return self._size

    def extra_repr(self) -> str:
        return (f"{self.embedding_dim}, capacity={self.capacity}, max_capacity={self.max_capacity}, size={self._size}, "
                f"dtype={self.dtype}, eviction={self.eviction!r}, optimizer={self.optimizer}")

    def requires_grad_(self, requires_grad: bool = True):
        self._trainable = bool(requires_grad)
        return super().requires_grad_(requires_grad)

    def _apply(self, fn, recurse=True):
        # Device/dtype moves: the state tensors are not buffers (they change size when the table grows).
        super()._apply(fn, recurse)
        probe = fn(torch.zeros(1, dtype=torch.int64, device=self.device))
        if probe.device != self.device:
            self._move_to(probe.device)
        return self

    def _move_to(self, device: torch.device):
        keys, values, state, scores = self._compact()
        self._device = device
        self._rebuild(self.capacity, keys.to(device), values.to(device), state.to(device), scores.to(device))

    # ---- core table operations ----

    def _bump(self, name: str, delta: int = 1) -> int:
        """Adds to a plain int counter (_epoch, _clock, _size, _step, _version) without
        nn.Module.__setattr__, whose parameter/buffer checks cost more than the kernels of a
        table-batched step when paid per table per phase."""
        d = self.__dict__
        d[name] += delta
        return d[name]

    def _next_epoch(self) -> int:
        if self._bump("_epoch") > _MAX_EPOCH:
            self._marks.zero_()
            self._epoch = 1
        return self._epoch

    def _lookup(self, keys: Tensor, epoch: int = 0) -> Tensor:
        return _ops.dynemb_lookup(keys, self._keys, self._digests, self._marks, self.bucket_size, epoch)

    def _host_tier_on_cuda(self) -> bool:
        """A CUDA table with rows in mapped host memory. Its row copies visit rows in slot order
        (argsort(slots) as the gather / scatter op's order): host rows read in batch order are random
        host addresses, which thrash the GPU's translation of host pages (measured on an H100, half
        of 16M rows on the host: 4x slower than the same slots sorted). Pure-HBM tables skip the sort."""
        return self._values.is_cuda and self._values_host.numel() > 0

    def _find(self, keys: Tensor) -> Tuple[Tensor, Tensor]:
        """(rows, slots) of keys, zeros / -1 where absent. Rows of 512 bytes or more: one kernel (probe
        and copy by the same warp); smaller rows: lookup then a gather with several rows per warp,
        which keeps more row reads in flight (measured on the H100: 1.84 against 1.73 Gi keys/s at
        dim 128 fp32, 2.17 against 2.32 at dim 64, 2.52 against 3.52 at dim 8). With 128-slot
        buckets on the GPU the one kernel probes four keys per warp and wins at every width (5.08
        against 3.58 Gi keys/s at dim 8, 3.35 / 2.40 at 64, 2.12 / 1.75 at 128). A table with host
        rows on CUDA: lookup, then a gather in slot order (see _host_tier_on_cuda)."""
        if self._host_tier_on_cuda():
            slots = self._lookup(keys)
            return _ops.dynemb_gather(slots, self._values, self._values_host, torch.argsort(slots)), slots
        if (self.bucket_size == 128 and self._values.is_cuda) or \
                self._values.shape[1] * self._values.element_size() >= _FUSED_FIND_MIN_ROW_BYTES:
            return _ops.dynemb_find(keys, self._keys, self._digests, self._marks, self._values, self._values_host,
                                    self.bucket_size)
        slots = self._lookup(keys)
        return self._gather(slots, self._values, self._values_host), slots

    def _gather(self, slots: Tensor, rows: Tensor, rows_host: Tensor, sorted_slots: bool = False) -> Tensor:
        """Rows (or optimizer state) of slots; host rows on CUDA are read in slot order (sorted_slots:
        the slots are ascending already, no sort needed)."""
        if not sorted_slots and rows_host.numel() > 0 and self._host_tier_on_cuda():
            return _ops.dynemb_gather(slots, rows, rows_host, torch.argsort(slots))
        return _ops.dynemb_gather(slots, rows, rows_host)

    def _scatter(self, slots: Tensor, src: Tensor, rows: Tensor, rows_host: Tensor):
        """rows[slots] = src; host rows on CUDA are written in slot order."""
        if rows_host.numel() > 0 and self._host_tier_on_cuda():
            _ops.dynemb_scatter(slots, src, rows, rows_host, torch.argsort(slots))
        else:
            _ops.dynemb_scatter(slots, src, rows, rows_host)

    def _insert_slots(self, keys: Tensor, slots: Tensor, epoch: int, allow_evict: bool):
        return _ops.dynemb_insert(keys, slots, self._keys, self._digests, self._scores, self._marks, self._locks,
                                  self.bucket_size, epoch, allow_evict)

    def _init_args(self) -> Tuple[int, float, float]:
        """The initializer as the kernels take it: (init_kind code, a, b); b is 0 for a constant. Kept
        while self.initializer compares equal (it is read on every inserting call)."""
        init = self.initializer
        c = self.__dict__.get("_init_cache")
        if c is not None and c[0] == init:
            return c[1]
        kind, *nums = init
        a, b = (list(nums) + [0.0, 0.0])[:2]
        args = (_INIT_KINDS[kind], float(a), float(b))
        self.__dict__["_init_cache"] = (tuple(init), args)
        return args

    def _host_counts(self, counts: Tensor) -> List[int]:
        """An insert's counts [inserted, evicted, failed] on the host: the call's host sync. On the GPU
        the copy goes, queued behind the kernels, into a pinned buffer of the table's, and the host
        waits on the stream: tolist() on the device tensor would copy into pageable memory, which the
        driver stages and copies again once the kernels are done."""
        if not counts.is_cuda:
            return counts.tolist()
        h = self.__dict__.get("_counts_host")
        if h is None:
            h = self.__dict__["_counts_host"] = torch.empty(3, dtype=torch.int64, pin_memory=True)
        h.copy_(counts, non_blocking=True)
        torch.cuda.current_stream(counts.device).synchronize()
        return h.tolist()

    def _init_rows(self, slots: Tensor, keys: Tensor, mask: Optional[Tensor], init: Tuple[int, float, float]):
        _ops.dynemb_init(slots, keys, mask, self._values, self._values_host, self._state, self._state_host,
                         *init, self.seed)

    def _find_or_insert_fused(self, keys: Tensor, touch: bool, with_rows: bool, init_rows: bool = True,
                              n_valid: Optional[Tensor] = None, abort: Optional[Tensor] = None,
                              on_abort: Optional[Callable[[], None]] = None, pool=None,
                              keep_evicted: Optional[bool] = None):
        """_find_or_insert at full capacity (no growth to decide first) in one op: dynemb_find_or_insert_sync
        (probe, insert, init, touch and the rows out in two kernels on the GPU, then the host's wait on
        the counts and, when keys were evicted, the eviction-rows kernel). Returns (slots, is_new,
        evicted or None, rows or None). The GPU idles for what the host does before the kernels are
        launched and after that wait, so all of it but this bookkeeping is in C++. init_rows=False
        leaves new rows unwritten (their optimizer state is still zeroed): for callers that write them
        next. A table with host rows on CUDA and with_rows: the op inserts and touches only; then one
        pass (dynemb_init_gather) initialises the new rows and reads all rows in slot order (see
        _host_tier_on_cuda), with the same results (the initializer is a function of key, seed and
        column). On a table with host rows the op sorts its evictions by victim slot before their row
        work, so the eviction record comes out in slot order.
        n_valid (a one-element device tensor): only the first n_valid[0] keys are taken (a batch
        grouped on the device: one host wait for both). abort (a device flag, e.g. an argument check
        not read yet): when set nothing is touched and on_abort() must raise. The result's fifth
        entry is the number of keys taken. pool (offsets, inv, weights, mean): the batch's bags are
        pooled from the keys' slots too (dynemb_find_or_insert_pool: on CUDA queued before the host's
        wait, so the GPU pools while the host does its bookkeeping); the sixth entry is the bags.
        keep_evicted (default: evicted_record_limit > 0): the victims' rows are copied out before the
        new keys take their slots; False: only counted (evicted_dropped), the third entry is None."""
        if keep_evicted is None:
            keep_evicted = self.evicted_record_limit > 0
        epoch = self._next_epoch()
        policy = (1 if self.eviction == "lfu" else 0) if touch else -1
        clock = self._bump("_clock") if touch else self._clock
        by_slot = with_rows and init_rows and self._host_tier_on_cuda()
        init = self._init_args() if init_rows and not by_slot else _NO_INIT
        args = (keys, self._keys, self._digests, self._scores, self._marks, self._locks, self._values,
                self._values_host, self._state, self._state_host, self.bucket_size, epoch, self.eviction != "none",
                policy, clock, *init, self.seed, with_rows and not by_slot, n_valid, abort)
        pooled = None
        if pool is not None:
            assert not by_slot
            slots, rows, is_new, ev, old_values, old_state, counts, pooled = _find_or_insert_pool_op(
                *args, *pool, keep_evicted)
        else:
            slots, rows, is_new, ev, old_values, old_state, counts = _find_or_insert_sync_op(*args, keep_evicted)
        inserted, n_ev, failed, n_taken, aborted = counts.tolist()
        if aborted:
            if on_abort is not None:
                on_abort()
            raise RuntimeError(f"torchfuse.{type(self).__name__}: find_or_insert aborted by its caller's check")
        if n_taken != keys.numel():
            keys = keys[:n_taken]
        self._bump("_size", inserted - n_ev)
        saved = None
        if n_ev and keep_evicted:  # ev: the op's own (4, n_ev) copy, so its rows are kept as they are
            saved = (ev[0], old_values, old_state, ev[2])
            self._record_evicted(saved)
            self._bump("_version")
        elif n_ev:  # the kernels wrote the new rows over the victims'
            self.evicted_dropped += n_ev
            self._bump("_version")
        if by_slot:  # before a failure raises, as the op's own init would have run
            # is_new covers the keys that took evicted slots too (their old rows saved above); new rows are
            # written and every row read in one slot-ordered pass (nothing written, then read back)
            rows = _ops.dynemb_init_gather(slots, keys, is_new, self._values, self._values_host, self._state,
                                           self._state_host, *self._init_args(), self.seed, torch.argsort(slots))
        if failed:
            raise RuntimeError(self._full_message(failed))
        return slots, is_new, saved, rows if with_rows else None, n_taken, pooled

    def _save_evicted(self, keys: Tensor, slots: Tensor, scores: Tensor):
        """(keys, values, optimizer state, scores) of keys an insert evicted, read before their slots
        are reused, recorded for drain_evicted; bumps the version (slots changed hands)."""
        values = self._gather(slots, self._values, self._values_host)
        state = self._gather(slots, self._state, self._state_host)
        evicted = (keys.clone(), values, state, scores.clone())
        self._record_evicted(evicted)
        self._bump("_version")
        return evicted

    def _full_message(self, failed: int) -> str:
        return (f"torchfuse.{type(self).__name__}: the table is full (capacity {self.capacity} = max_capacity, "
                f"{self._size} keys): {failed} new keys found their bucket full"
                + (" with eviction='none'; raise max_capacity or choose eviction='lru' or 'lfu'"
                   if self.eviction == "none" else
                   " of keys used by this same batch; use smaller batches or a larger max_capacity"))

    def _find_or_insert(self, keys: Tensor, touch: bool = True, init_rows: bool = True,
                        keep_evicted: Optional[bool] = None):
        """Slots of unique `keys`, inserting the missing ones (growing or evicting as configured).
        Returns (slots, is_new uint8, evicted (keys, values, state, scores) or None). init_rows,
        keep_evicted: as _find_or_insert_fused."""
        if self.capacity >= self.max_capacity:
            return self._find_or_insert_fused(keys, touch, False, init_rows, keep_evicted=keep_evicted)[:3]
        evicted = None
        while True:
            epoch = self._next_epoch()
            slots = self._lookup(keys, epoch)
            if self.capacity < self.max_capacity:
                n_missing = int((slots < 0).sum())
                if n_missing and self._size + n_missing > self.max_load_factor * self.capacity:
                    self._grow()
                    continue
            allow_evict = self.capacity >= self.max_capacity and self.eviction != "none"
            is_new, ev_keys, ev_slots, ev_scores, counts = self._insert_slots(keys, slots, epoch, allow_evict)
            inserted, n_ev, failed = self._host_counts(counts)
            self._size += inserted - n_ev
            if n_ev:
                evicted = self._save_evicted(ev_keys[:n_ev], ev_slots[:n_ev], ev_scores[:n_ev])
            if inserted:
                self._init_rows(slots, keys, is_new, self._init_args() if init_rows else _NO_INIT)
            if failed:
                if self.capacity < self.max_capacity:
                    self._grow()
                    continue
                raise RuntimeError(self._full_message(failed))
            break
        if touch:
            self._touch(slots)
        return slots, is_new, evicted

    def _touch(self, slots: Tensor):
        self._clock += 1
        _ops.dynemb_touch(self._scores, slots, 1 if self.eviction == "lfu" else 0, self._clock)

    def _record_evicted(self, ev):
        if self.evicted_record_limit <= 0:
            self.evicted_dropped += ev[0].numel()
            return
        self._evicted.append(ev)
        self._evicted_count += ev[0].numel()
        while self._evicted_count > self.evicted_record_limit:
            old = self._evicted.pop(0)
            self._evicted_count -= old[0].numel()
            self.evicted_dropped += old[0].numel()

    def drain_evicted(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """Keys, rows, optimizer state and scores evicted since the last drain (oldest first), and
        forget them. At most evicted_record_limit keys are kept; ``evicted_dropped`` counts the rest."""
        d = self.device
        if not self._evicted:
            return (torch.empty(0, dtype=torch.int64, device=d),
                    torch.empty(0, self.embedding_dim, dtype=self.dtype, device=d),
                    torch.empty(0, self._state_dim(), dtype=torch.float32, device=d),
                    torch.empty(0, dtype=torch.int64, device=d))
        out = tuple(torch.cat([e[i] for e in self._evicted]) for i in range(4))
        self._evicted, self._evicted_count = [], 0
        return out

    def _compact(self):
        """(keys, values, state, scores) of every occupied slot, in slot order."""
        occ = torch.nonzero(self._digests).squeeze(1)
        return (self._keys[occ], self._gather(occ, self._values, self._values_host, True),
                self._gather(occ, self._state, self._state_host, True), self._scores[occ])

    def _rebuild(self, cap: int, keys: Tensor, values: Tensor, state: Tensor, scores: Tensor):
        """A fresh table of `cap` slots holding exactly these keys (which fit: see _grow)."""
        self._allocate(cap, self._device)
        slots = torch.full_like(keys, -1)
        epoch = self._next_epoch()
        _, _, _, _, counts = self._insert_slots(keys, slots, epoch, False)
        failed = int(counts[2])
        if failed:
            raise RuntimeError(f"torchfuse.{type(self).__name__}: {failed} keys did not fit a table of {cap} slots")
        self._scatter(slots, values, self._values, self._values_host)
        self._scatter(slots, state, self._state, self._state_host)
        self._scores.index_copy_(0, slots, scores)
        self._size = keys.numel()
        self._version += 1

    def _grow(self):
        # Doubling splits each bucket into two (the bucket index gains a bit), so a rehash never
        # overflows a bucket.
        new_cap = min(2 * self.capacity, self.max_capacity)
        self._rebuild(new_cap, *self._compact())

    def _apply_segment_gradient(self, slots: Tensor, grad: Tensor, perm: Tensor, seg: Tensor,
                                bag_of: Optional[Tensor], scale: Optional[Tensor]):
        """The optimizer step of each unique id (slots) with the sum of its occurrences' gradient rows
        (dynemb_segment_sum's arguments), in one op: on CUDA the sums are never written out."""
        self._step += 1
        o = self.optimizer
        _ops.dynemb_segment_update(grad, perm, seg, bag_of, scale, slots, self._values, self._values_host,
                                   self._state, self._state_host, o.code, o.lr, o.eps, o.betas[0], o.betas[1],
                                   o.step_size(self._step))

    def _apply_gradient(self, slots: Tensor, grad: Tensor):
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        self._step += 1
        o = self.optimizer
        _ops.dynemb_update(slots, grad, self._values, self._values_host, self._state, self._state_host, o.code,
                           o.lr, o.eps, o.betas[0], o.betas[1], o.step_size(self._step))

    # ---- checks ----

    def _check_keys(self, keys, what="ids") -> Tensor:
        name = type(self).__name__
        if not isinstance(keys, Tensor):
            raise TypeError(f"torchfuse.{name}: {what} must be a tensor, got {type(keys).__name__}")
        if keys.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"torchfuse.{name}: {what} must be an integer tensor (int64 keys), got {keys.dtype}")
        if keys.device != self.device:
            raise ValueError(f"torchfuse.{name}: {what} must be on the table's device {self.device}, got {keys.device}")
        if keys.dtype == torch.int64 and keys.dim() == 1 and keys.is_contiguous():
            return keys  # what the line below returns (as a view): ahead of every launch, so kept short
        return keys.reshape(-1).to(torch.int64).contiguous()

    # ---- public table API ----

    def find(self, keys: Tensor) -> Tuple[Tensor, Tensor]:
        """``(values, found)``: rows of `keys` (zeros where absent) and a bool mask. Inserts nothing,
        does not change scores."""
        flat = self._check_keys(keys, "keys")
        vals, slots = self._find(flat)
        return vals.reshape(*keys.shape, self.embedding_dim), (slots >= 0).reshape(keys.shape)

    def contains(self, keys: Tensor) -> Tensor:
        flat = self._check_keys(keys, "keys")
        return (self._lookup(flat) >= 0).reshape(keys.shape)

    def find_or_insert(self, keys: Tensor, unique: bool = False) -> Tensor:
        """Rows of `keys`, inserting the absent ones with the initializer (as a training forward
        does, without autograd). ``unique=True`` promises the keys are distinct (skips a sort)."""
        count("dynemb_find_or_insert")
        flat = self._check_keys(keys, "keys")
        uniq, inv = (flat, None) if unique else torch.unique(flat, return_inverse=True)
        if self.capacity >= self.max_capacity:  # rows come out of the insert itself
            rows = self._find_or_insert_fused(uniq, True, True)[3]
        else:
            rows = self._gather(self._find_or_insert(uniq)[0], self._values, self._values_host)
        if inv is not None:
            rows = rows[inv]
        if keys.dim() == 1:  # rows are (n, dim) already; this runs after the host sync
            return rows
        return rows.reshape(*keys.shape, self.embedding_dim)

    def insert(self, keys: Tensor, values: Tensor, scores: Optional[Tensor] = None, return_evicted: bool = False,
               unique: bool = False):
        """Insert or assign rows: ``keys`` (n,) and ``values`` (n, dim). New keys get zeroed optimizer
        state; existing keys keep theirs. Where a key repeats, its last occurrence wins
        (``unique=True`` promises distinct keys and skips that sort). ``scores`` (n,) int64 sets the
        keys' scores (default: the policy's access update). With ``return_evicted`` returns
        (keys, values, optimizer_state, scores) of what was evicted."""
        count("dynemb_insert")
        name = type(self).__name__
        flat = self._check_keys(keys, "keys")
        n = flat.numel()
        if not isinstance(values, Tensor) or values.shape != (n, self.embedding_dim):
            raise ValueError(f"torchfuse.{name}.insert: values must be ({n}, {self.embedding_dim}), got "
                             f"{tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__}")
        if values.device != self.device:
            raise ValueError(f"torchfuse.{name}.insert: values must be on {self.device}, got {values.device}")
        if scores is not None:
            scores = self._check_keys(scores, "scores")
            if scores.numel() != n:
                raise ValueError(f"torchfuse.{name}.insert: scores must have {n} entries, got {scores.numel()}")
        values = values.to(self.dtype)
        uniq, inv = (flat, None) if unique else torch.unique(flat, return_inverse=True)
        if inv is None:
            pass
        elif uniq.numel() != n:  # keep each key's last occurrence
            last = torch.full((uniq.numel(),), -1, dtype=torch.int64, device=self.device)
            last.scatter_reduce_(0, inv, torch.arange(n, device=self.device), "amax")
            values = values[last]
            scores = scores[last] if scores is not None else None
        else:
            values = values[torch.argsort(inv)] if n else values
            scores = scores[torch.argsort(inv)] if scores is not None and n else scores
        values = values.contiguous()  # here, not between the insert's host sync and the scatter's launch
        # new keys' rows are written by the scatter: no initializer pass over them first
        slots, _, evicted = self._find_or_insert(uniq, touch=scores is None, init_rows=False,
                                                 keep_evicted=return_evicted or self.evicted_record_limit > 0)
        self._scatter(slots, values, self._values, self._values_host)
        if scores is not None:
            self._scores.index_copy_(0, slots, scores)
        if return_evicted:
            if evicted is None:
                d = self.device
                evicted = (torch.empty(0, dtype=torch.int64, device=d),
                           torch.empty(0, self.embedding_dim, dtype=self.dtype, device=d),
                           torch.empty(0, self._state_dim(), dtype=torch.float32, device=d),
                           torch.empty(0, dtype=torch.int64, device=d))
            return evicted
        return None

    def erase(self, keys: Tensor) -> int:
        """Remove `keys` (absent ones are ignored); returns how many were removed."""
        flat = self._check_keys(keys, "keys")
        slots = self._lookup(torch.unique(flat))
        found = slots[slots >= 0]
        if found.numel():
            self._digests.index_fill_(0, found, 0)
            self._keys.index_copy_(0, found, _vacant_keys(found, self.bucket_size, self._locks.numel()))
            self._size -= found.numel()
            self._version += 1
        return found.numel()

    def export(self, batch_size: int = 65536) -> Iterator[Tuple[Tensor, Tensor, Tensor, Tensor]]:
        """Yields ``(keys, values, optimizer_state, scores)`` over the occupied slots, scanning
        ``batch_size`` slots at a time (so each batch holds at most batch_size keys)."""
        if batch_size < 1:
            raise ValueError(f"torchfuse.{type(self).__name__}.export: batch_size must be >= 1, got {batch_size}")
        for start in range(0, self.capacity, batch_size):
            occ = torch.nonzero(self._digests[start:start + batch_size]).squeeze(1) + start
            if occ.numel() == 0:
                continue
            yield (self._keys[occ], self._gather(occ, self._values, self._values_host, True),
                   self._gather(occ, self._state, self._state_host, True), self._scores[occ])

    # ---- embedding lookup ----

    def _embed(self, flat: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """(rows, inverse): rows of the batch's unique ids and each id's index into them; inverse None
        when rows are already per id."""
        need_grad = torch.is_grad_enabled() and self._trainable
        if not self.training and not need_grad:
            return self._find(flat)[0], None
        uniq, inv = torch.unique(flat, return_inverse=True)
        slots = self._find_or_insert(uniq)[0] if self.training else self._lookup(uniq)
        if need_grad:
            anchor = torch.empty(0, device=self.device, requires_grad=True)
            rows = _Rows.apply(anchor, self, slots, uniq)
        else:
            rows = self._gather(slots, self._values, self._values_host)
        return rows, inv

    def _segments(self, flat: Tensor, check: Optional[Callable[[], None]] = None, segs=None,
                  bad: Optional[Tensor] = None, pool=None):
        """The batch's segments (dynemb_sort_segments) and their slots: (perm, seg, slots_u, uniq,
        slots_id). perm lists the ids segment by segment (one segment per unique id, batch order
        within it), seg the segments' bounds, slots_u the unique ids' slots (inserted in training
        mode), slots_id each id's slot. check (if given) runs before the table is touched, right after
        the segments' host sync, so a check that reads the device waits on nothing. segs:
        dynemb_sort_segments(flat) when the caller launched it already (so that its own host work
        overlaps the sort on the GPU). bad: check's device flag; with it a training batch into a full
        table waits on the host once, after the insert (see below). pool (offsets, weights, mean), on
        that one-wait path only: the bags pooled too, queued before the wait; then the result has a
        sixth entry, the bags, and slots_id is None."""
        perm, uniq, seg, inv, n_unique = segs if segs is not None else _ops.dynemb_sort_segments(flat)
        if self.training and self.capacity >= self.max_capacity:
            # No growth to decide, so the distinct ids need not be counted on the host first: the
            # grouping and the insert are queued back to back and the host waits once, for both
            # counts. bad rides along as the insert's abort flag: the table stays untouched, and
            # check raises after that wait.
            if pool is not None and not self._host_tier_on_cuda():
                offsets, w, mean = pool
                out = self._find_or_insert_fused(uniq, True, False, n_valid=n_unique, abort=bad, on_abort=check,
                                                 pool=(offsets, inv, w, mean))
                slots_u, n_u = out[0], out[4]
                return perm, seg[:n_u + 1], slots_u, uniq[:n_u], None, out[5]
            out = self._find_or_insert_fused(uniq, True, False, n_valid=n_unique, abort=bad, on_abort=check)
            slots_u, n_u = out[0], out[4]
            return perm, seg[:n_u + 1], slots_u, uniq[:n_u], slots_u[inv]
        n_u = int(n_unique)  # the host sync: growth is decided on the distinct ids
        uniq, seg = uniq[:n_u], seg[:n_u + 1]
        if check is not None:
            check()
        slots_u = self._find_or_insert(uniq)[0] if self.training else self._lookup(uniq)
        return perm, seg, slots_u, uniq, slots_u[inv]

    def _need_grad(self) -> bool:
        return torch.is_grad_enabled() and self._trainable

    def forward(self, ids: Tensor) -> Tensor:
        count("dynemb_forward")
        flat = self._check_keys(ids)
        if not self._need_grad():
            out = self._find(flat)[0] if not self.training else \
                self._gather(self._segments(flat)[4], self._values, self._values_host)
        else:
            perm, seg, slots_u, uniq, slots_id = self._segments(flat)
            anchor = torch.empty(0, device=self.device, requires_grad=True)
            out = _Fused.apply(anchor, self, (slots_id, None, None, False, perm, seg, slots_u, uniq, None, None))
        return out.reshape(*ids.shape, self.embedding_dim)

    # ---- state_dict ----

    def _config(self) -> dict:
        return {
            "embedding_dim": self.embedding_dim, "capacity": self.capacity, "max_capacity": self.max_capacity,
            "dtype": _DTYPES[self.dtype], "eviction": self.eviction, "initializer": tuple(self.initializer),
            "optimizer": self.optimizer.config(), "hbm_budget_bytes": self.hbm_budget_bytes, "seed": self.seed,
            "max_load_factor": self.max_load_factor, "bucket_size": self.bucket_size, "clock": self._clock,
            "step": self._step,
        }

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        tensors = self._compact()
        for k, t in zip(_STATE_NAMES, tensors):
            destination[prefix + k] = t
        cfg = self._config()
        cfg["checksum"] = _checkpoint_checksum(tensors, cfg)
        destination[prefix + "config"] = cfg

    def _checked_checkpoint(self, state_dict, prefix) -> Tuple[dict, int, Tuple[Tensor, ...]]:
        """(config, capacity, (keys, values, optimizer_state, scores)) of a state_dict entry, every
        field checked; ValueError naming what is wrong. Reads nothing of self but its dim and dtype."""
        name = f"torchfuse.{type(self).__name__}"
        cfg = state_dict[prefix + "config"]
        tensors = tuple(state_dict[prefix + k] for k in _STATE_NAMES)
        if not isinstance(cfg, dict):
            raise ValueError(f"{name}: {prefix}config must be a dict, got {type(cfg).__name__}")
        missing = [k for k in _CONFIG_TYPES if k not in cfg]
        if missing:
            raise ValueError(f"{name}: {prefix}config lacks {missing}")
        for k, types in _CONFIG_TYPES.items():
            v = cfg[k]
            if not isinstance(v, types) or isinstance(v, bool):
                raise ValueError(f"{name}: {prefix}config[{k!r}] has the wrong type: {v!r}")
        if cfg["embedding_dim"] != self.embedding_dim:
            raise ValueError(f"{name}: the checkpoint has embedding_dim {cfg['embedding_dim']}, this table "
                             f"{self.embedding_dim}")
        if cfg["dtype"] != _DTYPES[self.dtype]:
            raise ValueError(f"{name}: the checkpoint has rows of dtype {cfg['dtype']}, this table "
                             f"{_DTYPES[self.dtype]}")
        bucket = cfg["bucket_size"]
        if bucket not in (4, 8, 16, 32, 64, 128) or cfg["capacity"] < bucket or cfg["capacity"] % bucket or \
                cfg["capacity"] & (cfg["capacity"] - 1) or cfg["max_capacity"] < cfg["capacity"]:
            raise ValueError(f"{name}: {prefix}config has inconsistent sizes: capacity {cfg['capacity']}, "
                             f"max_capacity {cfg['max_capacity']}, bucket_size {bucket}")
        for k, ok in (("eviction", cfg["eviction"] in _EVICTIONS), ("max_load_factor", 0 < cfg["max_load_factor"] <= 1),
                      ("clock", cfg["clock"] >= 0), ("step", cfg["step"] >= 0),
                      ("hbm_budget_bytes", cfg["hbm_budget_bytes"] is None or cfg["hbm_budget_bytes"] >= 0)):
            if not ok:
                raise ValueError(f"{name}: {prefix}config[{k!r}] is out of range: {cfg[k]!r}")
        try:
            _check_initializer(cfg["initializer"])
            opt = _optim.from_config(cfg["optimizer"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{name}: {prefix}config: {e}") from None
        keys, values, state, scores = tensors
        for k, t in zip(_STATE_NAMES, tensors):
            if not isinstance(t, Tensor):
                raise ValueError(f"{name}: {prefix}{k} must be a tensor, got {type(t).__name__}")
        want = {"keys": torch.int64, "values": self.dtype, "optimizer_state": torch.float32, "scores": torch.int64}
        for k, t in zip(_STATE_NAMES, tensors):
            if t.dtype != want[k]:
                raise ValueError(f"{name}: the checkpoint's {k} are {t.dtype}, this table's {want[k]}")
        n = keys.shape[0] if keys.dim() == 1 else -1
        if (n < 0 or values.shape != (n, self.embedding_dim) or state.shape != (n, opt.state_dim(self.embedding_dim))
                or scores.shape != (n,)):
            raise ValueError(f"{name}: inconsistent state_dict shapes: keys {tuple(keys.shape)}, values "
                             f"{tuple(values.shape)}, optimizer_state {tuple(state.shape)}, scores "
                             f"{tuple(scores.shape)} (embedding_dim {self.embedding_dim}, optimizer "
                             f"{cfg['optimizer'].get('name')})")
        cap = max(cfg["capacity"], bucket * _pow2_at_least(-(-self.capacity // bucket)))
        if n > cap:
            raise ValueError(f"{name}: the checkpoint holds {n} keys, more than its capacity {cap}")
        if "checksum" in cfg:  # absent: a state_dict built or edited by hand
            got = _checkpoint_checksum(tensors, cfg)
            if got != cfg["checksum"]:
                raise ValueError(f"{name}: {prefix}config's checksum does not match the tensors: the checkpoint "
                                 "is corrupted (or was edited: drop config['checksum'] to load an edited one)")
        if n and torch.unique(keys).numel() != n:
            raise ValueError(f"{name}: the checkpoint's keys repeat")
        return cfg, cap, tensors

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = _STATE_NAMES + ("config",)
        if any(prefix + k not in state_dict for k in names):
            missing_keys.extend(prefix + k for k in names if prefix + k not in state_dict)
            return
        # Every check before any change: a checkpoint that fails one leaves the table as it was.
        try:
            cfg, cap, tensors = self._checked_checkpoint(state_dict, prefix)
        except ValueError as e:
            error_msgs.append(str(e))
            return
        before = dict(self.__dict__)  # _rebuild allocates new tensors, so the old ones stay intact
        try:
            self.optimizer = _optim.from_config(cfg["optimizer"])
            self.eviction = cfg["eviction"]
            self.initializer = _check_initializer(cfg["initializer"])
            self.hbm_budget_bytes = cfg["hbm_budget_bytes"]
            self.seed = cfg["seed"]
            self.max_load_factor = float(cfg["max_load_factor"])
            self.bucket_size = cfg["bucket_size"]
            self.max_capacity = max(cfg["max_capacity"], self._round_capacity(self.max_capacity), cap)
            self._clock, self._step = cfg["clock"], cfg["step"]
            d = self.device
            self._rebuild(cap, *(t.to(d).contiguous() for t in tensors))
            self._evicted, self._evicted_count = [], 0
        except Exception as e:
            self.__dict__.clear()
            self.__dict__.update(before)
            error_msgs.append(f"torchfuse.{type(self).__name__}: loading {prefix or 'the table'} failed, the table "
                              f"is unchanged: {e}")


def _checkpoint_checksum(tensors, cfg: dict) -> int:
    """A position-weighted sum (Fletcher's, modulo 2**31 - 1) of the tensors' 16-bit words and a CRC
    of the config: any one changed word or value changes it. Computed on the tensors' device."""
    p = (1 << 31) - 1
    sums = []
    for t in tensors:
        words = t.detach().contiguous().reshape(-1).view(torch.int16).reshape(-1)
        acc = torch.zeros(2, dtype=torch.int64, device=t.device)
        for lo in range(0, words.numel(), _CHECKSUM_CHUNK):
            w = words[lo:lo + _CHECKSUM_CHUNK].to(torch.int64) + 32769  # every word >= 1
            pos = torch.arange(lo, lo + w.numel(), device=w.device) % 65521 + 1
            # per chunk: < 2**22 words of < 2**16, times weights < 2**16: no int64 overflow
            acc = (acc + torch.stack([w.sum(), (w * pos).sum()]) % p) % p
        sums.append(acc)
    s1 = s2 = 0
    for t, (a, b) in zip(tensors, [a.tolist() for a in sums]):
        s1, s2 = (s1 + a) % p, (s2 * 31 + b + t.numel()) % p  # the tensors' order and sizes count too
    fields = repr(sorted((k, v) for k, v in cfg.items() if k != "checksum")).encode()
    return (s2 << 32 | s1) ^ zlib.crc32(fields)


_STATE_NAMES = ("keys", "values", "optimizer_state", "scores")
_CHECKSUM_CHUNK = 1 << 22
_CONFIG_TYPES = {
    "embedding_dim": int, "capacity": int, "max_capacity": int, "dtype": str, "eviction": str,
    "initializer": (tuple, list), "optimizer": dict, "hbm_budget_bytes": (int, type(None)), "seed": int,
    "max_load_factor": (float, int), "bucket_size": int, "clock": int, "step": int,
}


class DynamicEmbeddingBag(DynamicEmbedding):
    """Pooled lookups from a :class:`DynamicEmbedding` table, as ``nn.EmbeddingBag``:
    ``forward(ids, offsets=None, per_sample_weights=None) -> (B, embedding_dim)``.

    ``ids`` 1-D with ``offsets`` (B,) bag starts (or (B+1,) with ``include_last_offset=True``), or
    2-D (B, L) fixed-size bags without offsets. ``mode``: "sum" or "mean" (empty bags give zeros);
    ``per_sample_weights`` (same shape as ids, "sum" only) scale each id's row. Other arguments as
    :class:`DynamicEmbedding`."""

    def __init__(self, embedding_dim: int, capacity: int, *, mode: str = "sum", include_last_offset: bool = False,
                 **kwargs):
        super().__init__(embedding_dim, capacity, **kwargs)
        if mode not in ("sum", "mean"):
            raise ValueError(f"torchfuse.DynamicEmbeddingBag: mode must be 'sum' or 'mean', got {mode!r}")
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    def _config(self) -> dict:
        cfg = super()._config()
        cfg["mode"] = self.mode
        return cfg

    def forward(self, ids: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        count("dynemb_bag_forward")
        name = "torchfuse.DynamicEmbeddingBag"
        if not isinstance(ids, Tensor):
            raise TypeError(f"{name}: ids must be a tensor")
        if offsets is None:
            if ids.dim() != 2:
                raise ValueError(f"{name}: ids must be 2-D (bags, ids per bag) without offsets, got shape {tuple(ids.shape)}")
            B, L = ids.shape
            offsets = torch.arange(0, B * L, max(L, 1), device=ids.device)[:B]
            incl = False
        else:
            if ids.dim() != 1:
                raise ValueError(f"{name}: ids must be 1-D with offsets, got shape {tuple(ids.shape)}")
            incl = self.include_last_offset
        flat = self._check_keys(ids)
        if not isinstance(offsets, Tensor) or offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() != 1:
            raise TypeError(f"{name}: offsets must be a 1-D int32 or int64 tensor")
        if offsets.device != self.device:
            raise ValueError(f"{name}: offsets must be on {self.device}, got {offsets.device}")
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError(f"{name}: per_sample_weights need mode='sum' (as nn.EmbeddingBag)")
            if per_sample_weights.shape != ids.shape or per_sample_weights.device != self.device:
                raise ValueError(f"{name}: per_sample_weights must have the shape {tuple(ids.shape)} and device of ids")
            per_sample_weights = per_sample_weights.reshape(-1)
        n = flat.numel()
        weights_grad = per_sample_weights is not None and per_sample_weights.requires_grad and torch.is_grad_enabled()
        need_grad = self._need_grad()
        # The training paths' sort goes first: the host work below (the offsets' checks, the bags'
        # layout) is then launched while the GPU sorts, not before it starts.
        segs = _ops.dynemb_sort_segments(flat) if (self.training or need_grad) and not weights_grad else None
        if not offsets.numel() and (incl or n):
            raise ValueError(f"{name}: empty offsets with {n} ids")
        mean = self.mode == "mean"
        # One kernel (where ATen would take a dozen ops): the bags' bounds `full` (offsets, then n
        # unless incl), each id's bag, its mean scale and the offsets' check flag `bad`, all defined
        # for any offsets, so the flag can be read after later work is queued. Each id's bag and scale
        # only feed the backward's segment sums: the other paths pool from the bounds alone.
        full, bag_of, scale, bad = _ops.dynemb_bag_layout(offsets.contiguous(), n, incl, mean,
                                                          need_grad and not weights_grad)

        def check_offsets():
            if bool(bad):
                raise ValueError(f"{name}: offsets must start at 0, be non-decreasing and end at most at "
                                 f"len(ids) = {n}" + (" (exactly, with include_last_offset)" if incl else ""))
        if weights_grad:
            check_offsets()
            # gradients for the weights too: PyTorch's embedding_bag on the batch's unique rows
            rows, inv = self._embed(flat)
            if inv is None:
                inv = torch.arange(n, device=self.device)
            return F.embedding_bag(inv, rows, offsets.to(torch.int64), mode=self.mode,
                                   per_sample_weights=per_sample_weights.to(rows.dtype), include_last_offset=incl)
        w = per_sample_weights.float().contiguous() if per_sample_weights is not None else None
        if not need_grad:
            if self.training:
                slots = self._segments(flat, check_offsets, segs, bad)[4]
            else:
                check_offsets()
                slots = self._lookup(flat)
            return _ops.dynemb_pool(slots, full, w, self._values, self._values_host, mean)
        if w is not None:
            scale = w
        elif not mean:
            scale = None
        g = self._segments(flat, check_offsets, segs, bad, (full, w, mean))
        perm, seg, slots_u, uniq, slots_id = g[:5]
        anchor = torch.empty(0, device=self.device, requires_grad=True)
        return _Fused.apply(anchor, self, (slots_id, full, w, mean, perm, seg, slots_u, uniq, bag_of, scale) + g[5:])


@torch.library.register_fake("torchfuse::dynemb_bag_layout")
def _bag_layout_fake(offsets, n, include_last_offset, mean, with_bags=True):
    n_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    i64 = offsets.new_empty((0,), dtype=torch.int64)
    return (i64.new_empty((n_bags + 1,)), i64.new_empty((n if with_bags else 0,)),
            offsets.new_empty((n if mean and with_bags else 0,), dtype=torch.float32),
            offsets.new_empty((1,), dtype=torch.uint8))


@torch.library.register_fake("torchfuse::dynemb_sort_segments")
def _sort_segments_fake(ids):
    n = ids.shape[0]
    return ids.new_empty((n,)), ids.new_empty((n,)), ids.new_empty((n + 1,)), ids.new_empty((n,)), ids.new_empty((1,))


@torch.library.register_fake("torchfuse::dynemb_lookup")
def _lookup_fake(query, keys, digests, marks, bucket_size, epoch):
    return query.new_empty(query.shape)


@torch.library.register_fake("torchfuse::dynemb_pool")
def _pool_fake(slots, offsets, weights, rows, rows_host, mean, inv=None):
    return rows.new_empty((offsets.shape[0] - 1, rows.shape[1]))


@torch.library.register_fake("torchfuse::dynemb_segment_sum")
def _segsum_fake(grad, perm, seg, bag_of, scale):
    return grad.new_empty((seg.shape[0] - 1, grad.shape[1]), dtype=torch.float32)


@torch.library.register_fake("torchfuse::dynemb_find")
def _find_fake(query, keys, digests, marks, rows, rows_host, bucket_size):
    return rows.new_empty((query.shape[0], *rows.shape[1:])), query.new_empty(query.shape)


@torch.library.register_fake("torchfuse::dynemb_gather")
def _gather_fake(slots, rows, rows_host, order=None):
    return rows.new_empty((slots.shape[0], *rows.shape[1:]))


@torch.library.register_fake("torchfuse::dynemb_insert")
def _insert_fake(query, slots, keys, digests, scores, marks, locks, bucket_size, epoch, allow_evict):
    n = query.shape[0]
    return (query.new_empty((n,), dtype=torch.uint8), query.new_empty((n,)), query.new_empty((n,)),
            query.new_empty((n,)), query.new_empty((3,)))


@torch.library.register_fake("torchfuse::dynemb_segment_update")
def _segment_update_fake(grad, perm, seg, bag_of, scale, slots, values, values_host, state, state_host, opt, lr, eps,
                         beta1, beta2, step_size):
    return None


@torch.library.register_fake("torchfuse::dynemb_find_or_insert_sync")
def _find_or_insert_sync_fake(query, keys, digests, scores, marks, locks, values, values_host, state, state_host,
                              bucket_size, epoch, allow_evict, policy, clock, init_kind, a, b, seed, with_rows,
                              n_valid=None, abort=None, keep_evicted=True):
    ctx = torch.library.get_ctx()
    n = query.shape[0] if n_valid is None and abort is None else ctx.new_dynamic_size()  # the keys taken
    n_ev = ctx.new_dynamic_size()
    return (query.new_empty((n,)), values.new_empty((n if with_rows else 0, values.shape[1])),
            query.new_empty((n,), dtype=torch.uint8), query.new_empty((4, n_ev)),
            values.new_empty((n_ev, values.shape[1])), state.new_empty((n_ev, state.shape[1])),
            query.new_empty((5,), device="cpu"))


@torch.library.register_fake("torchfuse::dynemb_find_or_insert_pool")
def _find_or_insert_pool_fake(query, keys, digests, scores, marks, locks, values, values_host, state, state_host,
                              bucket_size, epoch, allow_evict, policy, clock, init_kind, a, b, seed, with_rows,
                              n_valid, abort, pool_offsets, pool_inv, pool_weights, pool_mean, keep_evicted=True):
    out = _find_or_insert_sync_fake(query, keys, digests, scores, marks, locks, values, values_host, state, state_host,
                                    bucket_size, epoch, allow_evict, policy, clock, init_kind, a, b, seed, with_rows,
                                    n_valid, abort, keep_evicted)
    return out + (values.new_empty((pool_offsets.shape[0] - 1, values.shape[1])),)


@torch.library.register_fake("torchfuse::dynemb_touch")
def _touch_fake(scores, slots, policy, clock):
    return None


@torch.library.register_fake("torchfuse::dynemb_scatter")
def _scatter_fake(slots, src, rows, rows_host, order=None):
    return None


@torch.library.register_fake("torchfuse::dynemb_init")
def _init_fake(slots, keys, mask, values, values_host, state, state_host, init_kind, a, b, seed):
    return None


@torch.library.register_fake("torchfuse::dynemb_init_gather")
def _init_gather_fake(slots, keys, is_new, values, values_host, state, state_host, init_kind, a, b, seed, order=None):
    return values.new_empty((slots.shape[0], *values.shape[1:]))


@torch.library.register_fake("torchfuse::dynemb_update")
def _update_fake(slots, grad, values, values_host, state, state_host, opt, lr, eps, beta1, beta2, step_size):
    return None
