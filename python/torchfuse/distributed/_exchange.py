"""The all-to-all exchange of a sharded dynamic embedding: ids to their owners, rows back, and in
the backward pass the rows' gradients to the owners, whose tables apply their fused optimizer.

Every step is a fixed function of the ranks' batches: ids are grouped (dynemb_sort_segments), the
distinct ids grouped by owner with a stable sort, exchanged in rank order, and every gradient sum
runs in a fixed order (dynemb_segment_sum per id here, in batch order; the owner's table sums the
ranks' contributions in rank order), and bags are pooled by the single-device kernel (dynemb_pool:
fp32 sums in id order), so the same inputs give the same results run to run on CPU and GPU.
"""
import math
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..dynamic_embedding._table import _ops


def all_to_all(x: Tensor, out_splits: List[int], in_splits: List[int], group, log: Optional[list] = None,
               what: str = "") -> Tensor:
    """torch.distributed.all_to_all_single along dim 0 with uneven splits. log (a list): appends
    (what, bytes sent to other ranks, bytes received from them, seconds, bytes sent to each rank,
    bytes received from each rank), timed from a barrier of the group and a device synchronization to
    a device synchronization after: a measuring aid that stalls the stream and aligns the ranks, so
    that the time is the exchange's own and not a wait for a slower rank's work before it."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    if log is None:
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    dist.barrier(group=group)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    seconds = time.perf_counter() - t0
    rank = dist.get_rank(group)
    row = math.prod(x.shape[1:]) * x.element_size()
    sent = (sum(in_splits) - in_splits[rank]) * row
    recv = (sum(out_splits) - out_splits[rank]) * row
    log.append((what, sent, recv, seconds, [c * row for c in in_splits], [c * row for c in out_splits]))
    return out


def all_to_all_as(x: Tensor, comm_dtype: Optional[torch.dtype], out_splits: List[int], in_splits: List[int], group,
                  log: Optional[list] = None, what: str = "") -> Tensor:
    """all_to_all of rows sent as comm_dtype (rounded to it) and returned in x's dtype; None (or x's own
    dtype) sends x as it is. The rows travel as their bytes (uint8), which every backend moves (gloo has
    no 16-bit integer type, and not every build has its 16-bit floats)."""
    if comm_dtype is None or comm_dtype == x.dtype:
        return all_to_all(x, out_splits, in_splits, group, log, what)
    wire = x.to(comm_dtype).contiguous().view(torch.uint8)
    return all_to_all(wire, out_splits, in_splits, group, log, what).view(comm_dtype).to(x.dtype)


def _owner_counts(sorted_owner: Tensor, world: int) -> Tensor:
    """How many of the owner-sorted entries each rank 0..world-1 owns. No host sync (torch.bincount
    reads the input's min and max on the host on CUDA)."""
    bounds = torch.searchsorted(sorted_owner, torch.arange(world + 1, device=sorted_owner.device))
    return bounds[1:] - bounds[:-1]


class Plan:
    """Where a batch's ids go: its unique ids (in dynemb_sort_segments' order: id order on the CPU,
    the ids' hash order on CUDA) and each id's index into them (inv), the unique ids grouped by
    owner (send_ids = uniq[order]) and the split sizes both ways. Building one exchanges the counts
    (one all-to-all) and reads both split lists and the number of distinct ids on the host at once:
    the grouping (dynemb_sort_segments, as the single-device table groups a batch) pads its distinct
    ids to the batch's length, and the padding, owned by no rank, sorts last and is cut off after
    that read."""

    def __init__(self, flat: Tensor, owner_fn, world: int, group, log=None, comm=(None, None)):
        perm, uniq, seg, self.inv, n_unique = _ops.dynemb_sort_segments(flat)
        n = flat.numel()
        # the padding past n_unique is given owner `world`, after every rank's ids
        owner = torch.where(torch.arange(n, device=flat.device) < n_unique, owner_fn(uniq), world)
        order = torch.argsort(owner, stable=True)
        send_counts = _owner_counts(owner.index_select(0, order), world)
        recv_counts = all_to_all(send_counts, [1] * world, [1] * world, group, log, "counts")
        host = torch.cat([send_counts, recv_counts, n_unique]).tolist()  # the exchange's one host sync
        self.send_splits, self.recv_splits, n_u = host[:world], host[world:2 * world], host[2 * world]
        self.uniq, self.order = uniq[:n_u], order[:n_u]  # the padding's entries are the last n - n_u
        self.send_ids = uniq.index_select(0, self.order)
        # perm: the batch's ids grouped by unique id, batch order within a group (a stable sort's);
        # seg: the groups' bounds
        self._segments = (perm, seg[:n_u + 1])
        self.group, self.log, self.n, self.comm = group, log, n, comm  # (rows', gradients') wire dtypes
        self._pos = None

    def segments(self) -> Tuple[Tensor, Tensor]:
        """(perm, seg), for the backward: the batch's ids grouped by unique id, each group's
        occurrences in batch order (perm), and the groups' bounds (seg, n_unique + 1)."""
        return self._segments

    def positions(self) -> Tensor:
        """Where each unique id's row sits in send order: send_ids[pos[u]] == uniq[u]."""
        if self._pos is None:
            self._pos = torch.empty_like(self.order)
            self._pos[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        return self._pos

    def per_id_sum(self, grad: Tensor, bag_of: Optional[Tensor] = None, scale: Optional[Tensor] = None) -> Tensor:
        """Per unique id (uniq order), fp32: the sum of its occurrences' gradient rows in batch order,
        as one device sums a key's (dynemb_segment_sum: deterministic, no atomics). grad holds a row
        per id, or per bag with bag_of (each id's bag) and scale (each id's factor)."""
        if self.uniq.numel() == 0:
            return grad.new_zeros((0, grad.shape[1]), dtype=torch.float32)
        perm, seg = self.segments()
        return _ops.dynemb_segment_sum(grad.contiguous(), perm, seg, bag_of, scale)


class ShardedRows(torch.autograd.Function):
    """Rows of a batch's unique ids, grouped by owner (plan.send_ids), found or inserted by their
    owners' tables. Backward sends each row's gradient to its owner, whose table sums the ranks'
    gradients of a key in rank order and applies its optimizer (the local module's own backward).
    Collective in both directions: every rank of the group calls forward and backward together."""

    @staticmethod
    def forward(ctx, anchor, local_lookup, plan: Plan):
        recv_ids = all_to_all(plan.send_ids, plan.recv_splits, plan.send_splits, plan.group, plan.log, "ids")
        with torch.enable_grad():
            local_rows = local_lookup(recv_ids)
        ctx.plan, ctx.local_rows = plan, local_rows
        return all_to_all_as(local_rows.detach(), plan.comm[0], plan.send_splits, plan.recv_splits, plan.group,
                             plan.log, "rows")

    @staticmethod
    def backward(ctx, grad):
        plan, local_rows = ctx.plan, ctx.local_rows
        ctx.local_rows = None
        g = all_to_all_as(grad, plan.comm[1], plan.recv_splits, plan.send_splits, plan.group, plan.log, "grads")
        if local_rows.requires_grad:
            torch.autograd.backward(local_rows, g.to(local_rows.dtype))
        return None, None, None


def sharded_rows(local, local_lookup, flat: Tensor, owner_fn, world: int, group, need_grad: bool,
                 log=None, comm=(None, None)) -> Tuple[Tensor, Plan]:
    """(rows of plan.send_ids, plan): the exchange of one batch; owner_fn(keys) gives each key's
    rank. need_grad: build the backward. comm: the rows' and the gradients' dtypes on the wire."""
    plan = Plan(flat, owner_fn, world, group, log, comm)
    if need_grad:
        anchor = torch.empty(0, device=flat.device, requires_grad=True)
        rows = ShardedRows.apply(anchor, local_lookup, plan)
    else:
        recv_ids = all_to_all(plan.send_ids, plan.recv_splits, plan.send_splits, group, log, "ids")
        rows = all_to_all_as(local_lookup(recv_ids), comm[0], plan.send_splits, plan.recv_splits, group, log,
                             "rows")
    return rows, plan


class PerId(torch.autograd.Function):
    """rows grouped by owner -> one row per id of the batch (rows[argsort(order)][inv]); backward:
    each unique id's occurrences summed in batch order (Plan.per_id_sum), regrouped by owner."""

    @staticmethod
    def forward(ctx, rows, plan: Plan):
        ctx.plan = plan
        by_uniq = torch.empty_like(rows)
        by_uniq[plan.order] = rows
        # index_select rather than by_uniq[inv]: the same gather, about 6x faster on the CPU
        return by_uniq.index_select(0, plan.inv)

    @staticmethod
    def backward(ctx, grad):
        # summed in fp32 (as one device sums a key's occurrences), rounded once to the rows' dtype
        plan = ctx.plan
        return plan.per_id_sum(grad).to(grad.dtype).index_select(0, plan.order), None


class PooledBags(torch.autograd.Function):
    """Bags pooled from the rows of their unique ids (grouped by owner) by the single-device table's
    kernel (dynemb_pool: fp32 sums in id order, the mean's division, one rounding to the rows'
    dtype), so a sharded bag equals one device's bit for bit. full: the bags' bounds (n_bags + 1);
    bag_of / scale: each id's bag and factor (its weight, or 1/len for the mean), for the backward.
    Backward: each unique id's gradient, its occurrences' bag gradients times their factors summed in
    batch order (fp32), regrouped by owner; and the weights' gradient."""

    @staticmethod
    def forward(ctx, rows, weights, plan: Plan, full, bag_of, scale, mean: bool):
        pos = plan.positions()
        host = rows.new_empty((0, rows.shape[1]))
        w = weights.detach().float().contiguous() if weights is not None else None
        ctx.plan, ctx.bag_of, ctx.scale = plan, bag_of, scale
        ctx.rows_dtype = rows.dtype
        # the rows are kept only for the weights' gradient (they are the batch's distinct rows)
        ctx.save_for_backward(rows if weights is not None and weights.requires_grad else None, weights)
        return _ops.dynemb_pool(pos, full, w, rows.contiguous(), host, mean, plan.inv)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        rows, weights = ctx.saved_tensors
        grad = grad.contiguous()
        g_rows = g_w = None
        if ctx.needs_input_grad[0]:
            scale = ctx.scale.float().contiguous() if ctx.scale is not None else None
            g_rows = plan.per_id_sum(grad, ctx.bag_of, scale).to(ctx.rows_dtype).index_select(0, plan.order)
        if ctx.needs_input_grad[1]:
            pos = plan.positions()
            g_w = (rows.index_select(0, pos.index_select(0, plan.inv)).float()
                   * grad.index_select(0, ctx.bag_of).float()).sum(1).to(weights.dtype)
        return g_rows, g_w, None, None, None, None, None


class PartialPlan:
    """Per-owner pooling of a batch's bags: every id (not de-duplicated) goes to its owner with its
    bag's index (and weight), grouped by owner with a stable sort, so each owner receives each
    source's ids in bag order. The counts' exchange also carries each rank's number of bags."""

    def __init__(self, flat: Tensor, bag_of: Tensor, weights: Optional[Tensor], n_bags: int, owner_fn, world: int,
                 group, log=None, comm=(None, None)):
        owner = owner_fn(flat)
        order = torch.argsort(owner, stable=True)
        if n_bags >= 2**31:
            raise ValueError(f"torchfuse.distributed: {n_bags} bags in one batch; the exchange sends bag indices as int32")
        self.send_ids = flat.index_select(0, order)
        self.send_bags = bag_of.index_select(0, order).to(torch.int32)  # half the bytes of int64
        self.send_w = weights.index_select(0, order) if weights is not None else None
        counts = _owner_counts(owner.index_select(0, order), world)
        meta = torch.stack([counts, torch.full_like(counts, n_bags)], 1)
        recv_meta = all_to_all(meta, [1] * world, [1] * world, group, log, "counts")
        host = torch.cat([meta.reshape(-1), recv_meta.reshape(-1)]).tolist()  # the one host sync
        self.send_splits, self.recv_splits = host[0:2 * world:2], host[2 * world::2]
        self.src_bags = host[2 * world + 1::2]  # each source rank's number of bags
        self.n_bags, self.world, self.group, self.log, self.comm = n_bags, world, group, log, comm

    def owner_batch(self):
        """(ids, offsets, weights) the owner pools: the sources' bags one after another (source
        rank order), so its partial bags come out grouped by source."""
        dev = self.send_ids.device
        recv_ids = all_to_all(self.send_ids, self.recv_splits, self.send_splits, self.group, self.log, "ids")
        recv_bags = all_to_all(self.send_bags, self.recv_splits, self.send_splits, self.group, self.log, "bags")
        recv_w = None
        if self.send_w is not None:
            recv_w = all_to_all(self.send_w, self.recv_splits, self.send_splits, self.group, self.log, "weights")
        base = torch.tensor([0] + self.src_bags[:-1], device=dev).cumsum(0)
        src = torch.repeat_interleave(torch.arange(self.world, device=dev),
                                      torch.tensor(self.recv_splits, device=dev))
        combined = recv_bags.to(torch.int64) + base[src]  # ascending: bag order within a source, sources in rank order
        offsets = torch.searchsorted(combined, torch.arange(sum(self.src_bags), device=dev))
        return recv_ids, offsets, recv_w


class PartialSums(torch.autograd.Function):
    """(world, bags, dim): owner r's sum of its ids' rows in each of this rank's bags. Backward sends
    each bag's gradient to every owner, whose table expands it to the bag's ids, sums them per key
    and applies its optimizer (its local module's backward)."""

    @staticmethod
    def forward(ctx, anchor, local_pool, plan: PartialPlan):
        ids, offsets, w = plan.owner_batch()
        with torch.enable_grad():
            partial = local_pool(ids, offsets, w)
        ctx.plan, ctx.partial = plan, partial
        back = all_to_all_as(partial.detach(), plan.comm[0], [plan.n_bags] * plan.world, plan.src_bags, plan.group,
                             plan.log, "partial bags")
        return back.view(plan.world, plan.n_bags, partial.shape[1])

    @staticmethod
    def backward(ctx, grad):
        plan, partial = ctx.plan, ctx.partial
        ctx.partial = None
        g = all_to_all_as(grad.reshape(-1, grad.shape[-1]), plan.comm[1], plan.src_bags, [plan.n_bags] * plan.world,
                          plan.group, plan.log, "partial grads")
        if partial.requires_grad:
            torch.autograd.backward(partial, g.to(partial.dtype))
        return None, None, None
