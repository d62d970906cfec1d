"""The modules: DynamicEmbedding (per-id rows) and DynamicEmbeddingBag (pooled bags) over a
:class:`DynamicEmbeddingTable`, with their training paths."""
import functools
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._stats import count
from . import _compiled
from ._checkpoint import CheckpointMixin
from ._table import DynamicEmbeddingTable, _ops
from ._training import _Rows, apply_batch_gradient, with_step


class DynamicEmbedding(DynamicEmbeddingTable, CheckpointMixin, torch.nn.Module):
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

    ``torch.compile(fullgraph=True)`` works over the module and models around it, with the same
    results as eager. An eval forward without gradients is traced as the lookup ops. A forward that
    inserts (training mode) or records gradients is one opaque op (dynamic_embedding/_compiled.py): the
    host decisions of an insert (growth, eviction records, a full table's error) run inside it as in
    eager mode, so the compiler fuses the model around the table, not the table step itself. A table
    that grows makes the compiled graph recompile (its state tensors change shape). Per-id weights
    that need their own gradient (DynamicEmbeddingBag) are not supported under torch.compile.
    """

    def __init__(self, embedding_dim: int, capacity: int, *, max_capacity: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device="cuda", eviction: str = "lru",
                 initializer=("normal", 0.0, 0.01), optimizer=None, hbm_budget_bytes: Optional[int] = None,
                 seed: int = 0, max_load_factor: float = 0.75, bucket_size: int = 128,
                 evicted_record_limit: int = 1 << 20):
        super().__init__()
        self._init_table(embedding_dim, capacity, max_capacity=max_capacity, dtype=dtype, device=device,
                         eviction=eviction, initializer=initializer, optimizer=optimizer,
                         hbm_budget_bytes=hbm_budget_bytes, seed=seed, max_load_factor=max_load_factor,
                         bucket_size=bucket_size, evicted_record_limit=evicted_record_limit)
        _compiled.register(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        _compiled.register(self)  # a copy finds itself, not the original, from compiled code

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

    # ---- the forward's table work, shared by eager mode and the compiled op (_compiled.py) ----

    def _compiled_tables(self):
        return [self]

    def _backward(self, record, grad: Tensor):
        """The backward of a _run with need_grad: record = (version, batch)."""
        apply_batch_gradient(self, record[0], record[1], grad)

    def _compiled_out(self, flat: Tensor):
        return (flat.shape[0], self.embedding_dim), self.dtype

    def _run(self, need_grad: bool, flat: Tensor):
        return self._run_rows(need_grad, flat)

    def _run_rows(self, need_grad: bool, flat: Tensor):
        """(rows (n, dim) of the ids `flat`, None) or, with need_grad, (rows, (version, batch)): what
        the backward needs (apply_batch_gradient's batch). (DynamicEmbeddingBag's _run pools.)"""
        if not need_grad:
            if not self.training:
                return self._find(flat)[0], None
            return self._gather(self._segments(flat)[4], self._values, self._values_host), None
        perm, seg, slots_u, uniq, slots_id = self._segments(flat)
        out = self._gather(slots_id, self._values, self._values_host)
        return out, (self._version, (slots_id, None, None, False, perm, seg, slots_u, uniq, None, None))

    def _finish(self, out: Tensor, record) -> Tensor:
        """Eager mode: the output hung from the backward that applies the optimizer."""
        if record is None:
            return out
        return with_step(out, functools.partial(self._backward, record))

    def forward(self, ids: Tensor) -> Tensor:
        count("dynemb_forward")
        flat = self._check_keys(ids)
        need_grad = self._need_grad()
        if torch.compiler.is_compiling() and (self.training or need_grad):
            out = _compiled.forward(self, need_grad, [flat])
        else:
            out = self._finish(*self._run_rows(need_grad, flat))
        return out.reshape(*ids.shape, self.embedding_dim)


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

    def _compiled_out(self, ids: Tensor, offsets: Optional[Tensor] = None,
                      per_sample_weights: Optional[Tensor] = None):
        bags = ids.shape[0] if offsets is None else offsets.shape[0] - (1 if self.include_last_offset else 0)
        return (bags, self.embedding_dim), self.dtype

    def forward(self, ids: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        count("dynemb_bag_forward")
        need_grad = self._need_grad()
        if torch.compiler.is_compiling():
            if per_sample_weights is not None and per_sample_weights.requires_grad and torch.is_grad_enabled():
                raise NotImplementedError("torchfuse.DynamicEmbeddingBag: per_sample_weights that require grad are "
                                          "not supported under torch.compile")
            return _compiled.forward(self, need_grad, [ids, offsets, per_sample_weights])
        return self._finish(*self._run(need_grad, ids, offsets, per_sample_weights))

    def _run(self, need_grad: bool, ids: Tensor, offsets: Optional[Tensor] = None,
             per_sample_weights: Optional[Tensor] = None):
        """The forward's work: (bags, None), or with need_grad (bags, (version, batch))
        (apply_batch_gradient's batch); a gradient for per_sample_weights comes through autograd in
        the bags themselves."""
        name = "torchfuse.DynamicEmbeddingBag"
        if not isinstance(ids, Tensor):
            raise TypeError(f"{name}: ids must be a tensor")
        if offsets is None:
            if ids.dim() != 2:
                raise ValueError(f"{name}: ids must be 2-D (bags, ids per bag) without offsets, got shape {tuple(ids.shape)}")
            B, L = ids.shape
            offsets = torch.arange(B, device=ids.device) * L  # B bags, empty ones too when L = 0
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
                                   per_sample_weights=per_sample_weights.to(rows.dtype),
                                   include_last_offset=incl), None
        w = per_sample_weights.float().contiguous() if per_sample_weights is not None else None
        if not need_grad:
            if self.training:
                slots = self._segments(flat, check_offsets, segs, bad)[4]
            else:
                check_offsets()
                slots = self._lookup(flat)
            return _ops.dynemb_pool(slots, full, w, self._values, self._values_host, mean), None
        if w is not None:
            scale = w
        elif not mean:
            scale = None
        g = self._segments(flat, check_offsets, segs, bad, (full, w, mean))
        perm, seg, slots_u, uniq, slots_id = g[:5]
        # pooled during the insert's host wait (dynemb_find_or_insert_pool), or now
        out = g[5] if len(g) > 5 else _ops.dynemb_pool(slots_id, full, w, self._values, self._values_host, mean)
        return out, (self._version, (slots_id, full, w, mean, perm, seg, slots_u, uniq, bag_of, scale))
