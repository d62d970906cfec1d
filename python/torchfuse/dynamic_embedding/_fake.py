"""Fake (meta) kernels of the dynamic embedding's ops, for torch.compile and FakeTensor tracing."""
import torch

from .. import _C  # noqa: F401  (registers torch.ops.torchfuse)
from ._table import STATE_FIELDS

# `table` entries (STATE_FIELDS order)
_VALUES = STATE_FIELDS.index("_values")
_STATE = STATE_FIELDS.index("_state")


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
def _lookup_fake(query, table, epoch):
    return query.new_empty(query.shape)


@torch.library.register_fake("torchfuse::dynemb_pool")
def _pool_fake(slots, offsets, weights, rows, rows_host, mean, inv=None):
    return rows.new_empty((offsets.shape[0] - 1, rows.shape[1]))


@torch.library.register_fake("torchfuse::dynemb_segment_sum")
def _segsum_fake(grad, perm, seg, bag_of, scale):
    return grad.new_empty((seg.shape[0] - 1, grad.shape[1]), dtype=torch.float32)


@torch.library.register_fake("torchfuse::dynemb_find")
def _find_fake(query, table):
    rows = table[_VALUES]
    return rows.new_empty((query.shape[0], *rows.shape[1:])), query.new_empty(query.shape)


@torch.library.register_fake("torchfuse::dynemb_gather")
def _gather_fake(slots, rows, rows_host, order=None):
    return rows.new_empty((slots.shape[0], *rows.shape[1:]))


@torch.library.register_fake("torchfuse::dynemb_insert")
def _insert_fake(query, slots, table, epoch, allow_evict):
    n = query.shape[0]
    return (query.new_empty((n,), dtype=torch.uint8), query.new_empty((n,)), query.new_empty((n,)),
            query.new_empty((n,)), query.new_empty((3,)))


@torch.library.register_fake("torchfuse::dynemb_segment_update")
def _segment_update_fake(grad, perm, seg, bag_of, scale, slots, table, opt, lr, eps, beta1, beta2, step_size):
    return None


@torch.library.register_fake("torchfuse::dynemb_find_or_insert_sync")
def _find_or_insert_sync_fake(query, table, epoch, allow_evict, policy, clock, init_kind, a, b, seed, with_rows,
                              n_valid=None, abort=None, keep_evicted=True):
    values, state = table[_VALUES], table[_STATE]
    ctx = torch.library.get_ctx()
    n = query.shape[0] if n_valid is None and abort is None else ctx.new_dynamic_size()  # the keys taken
    n_ev = ctx.new_dynamic_size()
    return (query.new_empty((n,)), values.new_empty((n if with_rows else 0, values.shape[1])),
            query.new_empty((n,), dtype=torch.uint8), query.new_empty((4, n_ev)),
            values.new_empty((n_ev, values.shape[1])), state.new_empty((n_ev, state.shape[1])),
            query.new_empty((5,), device="cpu"))


@torch.library.register_fake("torchfuse::dynemb_find_or_insert_pool")
def _find_or_insert_pool_fake(query, table, epoch, allow_evict, policy, clock, init_kind, a, b, seed, with_rows, n_valid,
                              abort, pool_offsets, pool_inv, pool_weights, pool_mean, keep_evicted=True):
    out = _find_or_insert_sync_fake(query, table, epoch, allow_evict, policy, clock, init_kind, a, b, seed, with_rows,
                                    n_valid, abort, keep_evicted)
    values = table[_VALUES]
    return out + (values.new_empty((pool_offsets.shape[0] - 1, values.shape[1])),)


@torch.library.register_fake("torchfuse::dynemb_touch")
def _touch_fake(table, slots, policy, clock):
    return None


@torch.library.register_fake("torchfuse::dynemb_scatter")
def _scatter_fake(slots, src, rows, rows_host, order=None):
    return None


@torch.library.register_fake("torchfuse::dynemb_init")
def _init_fake(slots, keys, mask, table, init_kind, a, b, seed):
    return None


@torch.library.register_fake("torchfuse::dynemb_init_gather")
def _init_gather_fake(slots, keys, is_new, table, init_kind, a, b, seed, order=None):
    values = table[_VALUES]
    return values.new_empty((slots.shape[0], *values.shape[1:]))


@torch.library.register_fake("torchfuse::dynemb_update")
def _update_fake(slots, grad, table, opt, lr, eps, beta1, beta2, step_size):
    return None
