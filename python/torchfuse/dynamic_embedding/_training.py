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


def apply_batch_gradient(table, version: int, batch, grad):
    """The optimizer step of a forward's batch (slots_id, offsets, weights, mean, perm, seg, slots_u,
    uniq, bag_of, scale) with its output's gradient (version: the table's at the forward)."""
    perm, seg, slots_u, uniq, bag_of, scale = batch[4:10]
    if table._version != version:  # rehashed, evicted or erased since the forward
        slots_u = table._lookup(uniq)
    table._apply_segment_gradient(slots_u, grad.contiguous(), perm, seg, bag_of, scale)


class _Step(torch.autograd.Function):
    """An output the forward's table work computed (rows or bags), hung from `anchor` (a leaf of no
    elements: the tables have no parameters); backward calls step(grad), the optimizer steps of that
    work. Its record travels inside `step`, kept on ctx (none of its tensors is an input that
    requires grad or an output): autograd.Function's per-call cost grows with the number of
    arguments (each is inspected in apply and answered in backward), and a training step from an
    idle GPU waits for that host time."""

    @staticmethod
    def forward(ctx, anchor, step, out):
        ctx.step = step
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.step(grad)
        return None, None, None


def with_step(out, step):
    """`out` with a backward that calls step(grad)."""
    anchor = torch.empty(0, device=out.device, requires_grad=True)
    return _Step.apply(anchor, step, out)
