"""The dynamic embedding's table: storage (keys, digests, scores, rows and optimizer state by slot,
layout in kernels/dynemb_kernels.h) and its operations (probe, insert with growth and eviction,
row copies, the optimizer step), as the internal ops ``torch.ops.torchfuse.dynemb_*`` run them.
DynamicEmbedding (the module) is this table plus forward, autograd and checkpoints."""
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from .. import _C  # noqa: F401  (registers torch.ops.torchfuse)
from .. import optim as _optim
from .._stats import count

_ops = torch.ops.torchfuse
_find_or_insert_sync_op = _ops.dynemb_find_or_insert_sync.default  # the overload itself: called ahead of every launch
_find_or_insert_pool_op = _ops.dynemb_find_or_insert_pool.default
_EVICTIONS = ("lru", "lfu", "none")
_INIT_KINDS = {"normal": 1, "uniform": 2, "constant": 3}
_NO_INIT = (0, 0.0, 0.0)  # TF_INIT_NONE: rows left as they are, optimizer state zeroed
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_MAX_EPOCH = 2**31 - 2
# The table's state as the internal ops take it: one list (their `table` argument) of these
# attributes, in this order (csrc/dynemb.h, DynembField). A table-batched op takes its tables' lists
# one after another.
STATE_FIELDS = ("_keys", "_digests", "_scores", "_marks", "_locks", "_values", "_values_host", "_state",
                "_state_host")
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


class DynamicEmbeddingTable:
    """The table's state and operations, mixed into :class:`DynamicEmbedding` (an ``nn.Module``):
    _init_table sets it up; the counters are plain ints (see _bump)."""

    def _init_table(self, embedding_dim: int, capacity: int, *, max_capacity, dtype, device, eviction,
                    initializer, optimizer, hbm_budget_bytes, seed, max_load_factor, bucket_size,
                    evicted_record_limit):
        """Checks the arguments (as DynamicEmbedding documents them) and allocates the table."""
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
        # the list the ops take (STATE_FIELDS), built once per allocation
        self.__dict__["_tensors"] = [getattr(self, f) for f in STATE_FIELDS]

    def _set_tensors(self, tensors: List[Tensor]):
        """The table's state from a list in STATE_FIELDS order (same shapes as the allocation's)."""
        d = self.__dict__
        for f, x in zip(STATE_FIELDS, tensors):
            d[f] = x
        d["_tensors"] = list(tensors)

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
        return _ops.dynemb_lookup(keys, self._tensors, epoch)

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
            return _ops.dynemb_find(keys, self._tensors)
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
        return _ops.dynemb_insert(keys, slots, self._tensors, epoch, allow_evict)

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
        _ops.dynemb_init(slots, keys, mask, self._tensors, *init, self.seed)

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
        args = (keys, self._tensors, epoch, self.eviction != "none", policy, clock, *init, self.seed,
                with_rows and not by_slot, n_valid, abort)
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
            rows = _ops.dynemb_init_gather(slots, keys, is_new, self._tensors, *self._init_args(), self.seed,
                                           torch.argsort(slots))
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
        _ops.dynemb_touch(self._tensors, slots, 1 if self.eviction == "lfu" else 0, self._clock)

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
        _ops.dynemb_segment_update(grad, perm, seg, bag_of, scale, slots, self._tensors, o.code, o.lr, o.eps,
                                   o.betas[0], o.betas[1], o.step_size(self._step))

    def _apply_gradient(self, slots: Tensor, grad: Tensor):
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        self._step += 1
        o = self.optimizer
        _ops.dynemb_update(slots, grad, self._tensors, o.code, o.lr, o.eps, o.betas[0], o.betas[1],
                           o.step_size(self._step))

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
