"""Autograd of the dynamic embedding: the rows a forward read, and the table's fused optimizer
applied to them in the backward pass (one backward pass is one optimizer step)."""
import torch

_ops = torch.ops.torchfuse


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
