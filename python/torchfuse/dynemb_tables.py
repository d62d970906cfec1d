"""Table-batched steps over several :class:`torchfuse.DynamicEmbeddingBag` tables (a TorchRec
collection): every phase of a training step (probe, insert, init, touch, pooling, gradient segment
sum, optimizer update) is one launch over all tables, as FBGEMM's table-batched embedding does, instead
of one launch per table; the host syncs per step drop from three per table to two (unique counts,
insert counts; a third only when a table may grow).

Each table keeps its own state and semantics (capacity, growth, eviction, initializer, clock,
optimizer step): the ops take per-table lists (``torch.ops.torchfuse.dynemb_tables_*``, schemas in
csrc/registration.cpp) and the results match one call per table (tests/test_torchrec.py checks it).
"""
import functools
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.torchfuse)
from .dynamic_embedding import DynamicEmbeddingBag
from .dynamic_embedding._table import STATE_FIELDS
from .dynamic_embedding._training import with_step

_FIELDS = len(STATE_FIELDS)
_VALUES = STATE_FIELDS.index("_values")

_ops = torch.ops.torchfuse


def can_batch(tables: Sequence[DynamicEmbeddingBag], weights: Optional[Tensor]) -> bool:
    """Whether `tables` can run as one batch: one device, one row width, one optimizer configuration,
    all trainable or all frozen, and no gradient wanted for per-id weights."""
    t0 = tables[0]
    if not all(isinstance(t, DynamicEmbeddingBag) for t in tables):  # sharded tables exchange their own ids
        return False
    if weights is not None and weights.requires_grad and torch.is_grad_enabled():
        return False
    cfg = t0.optimizer.config()
    return all(t.device == t0.device and t.embedding_dim == t0.embedding_dim and t._trainable == t0._trainable
               and t.optimizer.config() == cfg for t in tables)


def _states(tables) -> List[Tensor]:
    """The tables' state lists one after another: the ops' `tables` argument."""
    return [x for t in tables for x in t._tensors]


def lookup(tables, keys: Tensor, starts: List[int], epochs: Optional[List[int]] = None) -> Tensor:
    """Slots of the keys (-1 where absent), table t reading keys[starts[t]:starts[t + 1]]."""
    return _ops.dynemb_tables_lookup(keys, starts, _states(tables), epochs or [0] * len(tables))


def find_or_insert(tables, keys: Tensor, starts: List[int], tid_of_keys) -> Tensor:
    """Slots of each table's unique keys, inserting the missing ones: DynamicEmbedding._find_or_insert
    for every table at once (tid_of_keys(): each key's table, for the growth check; called only when
    a table may grow)."""
    T = len(tables)
    while True:
        epochs = [t._next_epoch() for t in tables]
        slots = lookup(tables, keys, starts, epochs)
        growable = [i for i, t in enumerate(tables) if t.capacity < t.max_capacity]
        if growable:
            missing = torch.zeros(T, dtype=torch.int64, device=keys.device).index_add_(
                0, tid_of_keys(), (slots < 0).to(torch.int64)).tolist()
            grow = [i for i in growable if missing[i]
                    and tables[i]._size + missing[i] > tables[i].max_load_factor * tables[i].capacity]
            if grow:
                for i in grow:
                    tables[i]._grow()
                continue
        allow = [t.capacity >= t.max_capacity and t.eviction != "none" for t in tables]
        is_new, ev_keys, ev_slots, ev_scores, counts = _ops.dynemb_tables_insert(
            keys, slots, starts, _states(tables), epochs, allow)
        counts = counts.tolist()
        failed = []
        for i, (t, (inserted, n_ev, n_failed)) in enumerate(zip(tables, counts)):
            t._bump("_size", inserted - n_ev)
            if n_ev:
                lo = starts[i]
                t._save_evicted(ev_keys[lo:lo + n_ev], ev_slots[lo:lo + n_ev], ev_scores[lo:lo + n_ev])
            if n_failed:
                failed.append((i, n_failed))
        if any(c[0] for c in counts):
            kinds, a, b = zip(*(t._init_args() for t in tables))
            _ops.dynemb_tables_init(slots, keys, is_new, starts, _states(tables), list(kinds), list(a), list(b),
                                    [t.seed for t in tables])
        if failed:
            for i, n_failed in failed:
                t = tables[i]
                if t.capacity >= t.max_capacity:
                    raise RuntimeError(t._full_message(n_failed))
                t._grow()
            continue
        break
    for t in tables:
        t._bump("_clock")
    _ops.dynemb_tables_touch(_states(tables), slots, starts,
                             [1 if t.eviction == "lfu" else 0 for t in tables], [t._clock for t in tables])
    return slots


def update(tables, slots: Tensor, grad: Tensor, starts: List[int]):
    """One optimizer step per unique slot of every table (DynamicEmbedding._apply_gradient)."""
    o = tables[0].optimizer
    for t in tables:
        t._bump("_step")
    _ops.dynemb_tables_update(slots, grad, starts, _states(tables), o.code, o.lr, o.eps, o.betas[0], o.betas[1],
                              [t.optimizer.step_size(t._step) for t in tables])


def apply_pooled_gradient(tables, record, grad: Tensor):
    """The backward of pooled bags (pooled_parts' record): one segment sum over every table's unique
    ids, then one fused optimizer update."""
    versions, ustarts, perm, seg, slots_u, uniq, bag_row, scale = record
    D = tables[0].embedding_dim
    g = _ops.dynemb_segment_sum(grad.contiguous().view(-1, D), perm, seg, bag_row, scale)
    if any(t._version != v for t, v in zip(tables, versions)):  # rehashed or evicted since the forward
        slots_u = lookup(tables, uniq, ustarts)
    update(tables, slots_u, g, ustarts)


def pooled(tables, *args, **kwargs) -> Tensor:
    """pooled_parts' bags, with the backward that applies the optimizer when it recorded one."""
    out, record = pooled_parts(tables, *args, **kwargs)
    if record is None:
        return out
    return with_step(out, functools.partial(apply_pooled_gradient, list(tables), record))


def pooled_parts(tables, ids: Tensor, offsets: Tensor, weights: Optional[Tensor], batch: int, features: List[int],
                 means: List[bool], id_starts: Optional[List[int]], feature_table: Tensor, feature_mean: Tensor,
                 pending: Optional[Tensor] = None, on_pending=None, need_grad: Optional[bool] = None):
    """(batch, sum of features[t] * dim) float32: the bags of every table pooled, in TorchRec's
    KeyedTensor layout. ids: every table's ids, table t's at [id_starts[t], id_starts[t + 1]);
    offsets: (sum(features) * batch + 1) bag bounds over ids, ordered (table, feature, sample), already
    validated, or with `pending` (a device int64 vector) not yet: it is read with the first host read
    here and passed to on_pending, which raises on a bad batch before any kernel reads ids through
    the offsets; feature_table, feature_mean: each feature's table index and whether it is
    MEAN-pooled (device tensors of sum(features) entries); id_starts: each table's ids (eval only).
    Returns (bags, None), or with gradients (need_grad, default: grad mode and trainable tables)
    (bags, the record apply_pooled_gradient takes)."""
    tables = list(tables)
    T, n, dev = len(tables), ids.numel(), ids.device
    training = tables[0].training
    if need_grad is None:
        need_grad = torch.is_grad_enabled() and tables[0]._trainable
    if not training:  # eval: no inserts (and no optimizer step)
        slots = lookup(tables, ids, id_starts)
        return _ops.dynemb_tables_pool(slots, offsets, weights, batch, features, _states(tables), means), None
    # Each table's unique ids: a stable sort by id, then by table (ids of one table are contiguous
    # but a feature order may repeat a table, so the table index is sorted on, not assumed).
    ends = offsets[batch::batch].contiguous() if batch else offsets[:0]  # each feature's end in ids
    fid = torch.bucketize(torch.arange(n, device=dev), ends, right=True).clamp_(max=feature_table.numel() - 1)
    tid = feature_table[fid]
    sk, p1 = torch.sort(ids, stable=True)
    st, p2 = torch.sort(tid[p1], stable=True)
    perm, skey = p1[p2], sk[p2]
    new = torch.ones(n, dtype=torch.bool, device=dev)
    if n > 1:
        new[1:] = (skey[1:] != skey[:-1]) | (st[1:] != st[:-1])
    csum = torch.cumsum(new, 0)
    useg = csum - 1
    # table t's unique ids start at the number of new-id flags before its first sorted position (a
    # search over the sorted table indices: an index_add of every flag into T bins serializes on atomics)
    first_pos = torch.searchsorted(st, torch.arange(T + 1, device=dev, dtype=st.dtype))
    host = F.pad(csum, (1, 0))[first_pos]
    if pending is not None:
        host = torch.cat([host, pending])
    host = host.tolist()  # the batch's first host read
    if pending is not None:
        on_pending(host[T + 1:])
    ustarts = host[:T + 1]
    U = ustarts[-1]
    first = torch.full((U,), n, dtype=torch.int64, device=dev).scatter_reduce_(
        0, useg, torch.arange(n, device=dev), "amin")
    uniq = skey[first]
    slots_u = find_or_insert(tables, uniq, ustarts, lambda: st.to(torch.int64)[first])
    slots_id = torch.empty_like(ids)
    slots_id[perm] = slots_u[useg]
    out = _ops.dynemb_tables_pool(slots_id, offsets, weights, batch, features, _states(tables), means)
    if not need_grad:
        return out, None
    seg = F.pad(first, (0, 1), value=n)
    n_bags = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(torch.arange(n_bags, device=dev), lengths, output_size=n)
    bb = max(batch, 1)  # batch 0 has no bags
    n_feat_total = n_bags // bb
    bag_row = (bag % bb) * n_feat_total + bag // bb  # its row in the grad viewed (batch * features, dim)
    scale = weights
    if any(means):  # MEAN tables take no weights (checked by the caller)
        inv = torch.where(feature_mean.repeat_interleave(batch), 1.0 / lengths.clamp(min=1).float(), 1.0)
        scale = inv[bag] if scale is None else scale * inv[bag]
    return out, ([t._version for t in tables], ustarts, perm, seg, slots_u, uniq, bag_row, scale)


# ---- fake kernels (torch.compile / meta tensors) ----

@torch.library.register_fake("torchfuse::dynemb_tables_lookup")
def _tables_lookup_fake(query, starts, tables, epochs):
    return query.new_empty(query.shape)


@torch.library.register_fake("torchfuse::dynemb_tables_insert")
def _tables_insert_fake(query, slots, starts, tables, epochs, allow_evict):
    n = query.shape[0]
    return (query.new_empty((n,), dtype=torch.uint8), query.new_empty((n,)), query.new_empty((n,)),
            query.new_empty((n,)), query.new_empty((len(epochs), 3)))


@torch.library.register_fake("torchfuse::dynemb_tables_init")
def _tables_init_fake(slots, keys, mask, starts, tables, init_kinds, a, b, seeds):
    return None


@torch.library.register_fake("torchfuse::dynemb_tables_touch")
def _tables_touch_fake(tables, slots, starts, policies, clocks):
    return None


@torch.library.register_fake("torchfuse::dynemb_tables_update")
def _tables_update_fake(slots, grad, starts, tables, opt, lr, eps, beta1, beta2, step_sizes):
    return None


@torch.library.register_fake("torchfuse::dynemb_tables_pool")
def _tables_pool_fake(slots, offsets, weights, batch, features, tables, mean):
    rows = tables[_VALUES::_FIELDS]
    cols = sum(f * r.shape[1] for f, r in zip(features, rows))
    return rows[0].new_empty((batch, cols), dtype=torch.float32)
