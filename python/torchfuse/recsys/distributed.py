"""Data-parallel training of the HSTU recommender over torch.distributed.

Every rank builds the same single-device model (same config and seed) and passes it with a process
group to ``Trainer(..., process_group=pg)``, which calls :func:`distribute`: the dynamic tables are
sharded row-wise (``torchfuse.distributed.shard``) and the dense part (positions, STU stack) is
wrapped in ``DistributedDataParallel``. Each step every rank draws the same global batch's users and
takes its contiguous slice of them, about a world-th of the tokens (:func:`rank_users`, from the
users' lengths: a rank gathers only its own users' items; :func:`split_batch` cuts a built batch
the same way); the negatives
are the same on every rank, and dropout masks are drawn per rank (so with dropout on, N ranks are
one process's run in distribution, not bit for bit).

Why N ranks equal one process on the global batch: the loss is a mean over the global batch's T
rows, so rank r back-propagates its own rows' mean scaled by T_r / T; the sum over ranks of those
gradients is the single-process gradient. The sharded tables' backward already sums a key's
gradients over ranks on its owner; DDP's default hook would average (divide by N), so the dense
gradients are all-reduced with a plain sum instead (:func:`sum_hook`).
"""
import os
from typing import Optional

import torch
import torch.distributed as dist

from .data import Batch

__all__ = ["user_bounds", "split_batch", "rank_users", "distribute", "sum_hook", "threads_per_process"]


def threads_per_process(nproc: int) -> int:
    """Set this process's CPU threads (torch.set_num_threads) to its share of the cores it may run on,
    for ``nproc`` processes on one host (at most torch's default), and return it. Every process otherwise starts one thread per
    core, and their spinning OpenMP pools fight over the cores: a 2-GPU training step of the
    benchmark's recommender took 352 ms so, against 21 ms with one thread per process, its host work
    (the batch's gathers) slowed 30-fold. torchrun sets OMP_NUM_THREADS=1 for the same reason."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    n = max(1, min(torch.get_num_threads(), cores // max(1, nproc)))  # never above torch's default
    torch.set_num_threads(n)
    return n


def user_bounds(offsets: torch.Tensor, world: int) -> list:
    """The ranks' user boundaries in a batch of jagged histories (host ``offsets``, B + 1 entries, B >=
    world): contiguous slices of about T / world tokens each (a rank's step time follows its tokens, and
    the slowest rank sets the step's), each holding at least one user."""
    B = offsets.numel() - 1
    T = int(offsets[-1])
    target = torch.tensor([r * T / world for r in range(1, world)], dtype=torch.float64)
    off = offsets.to(torch.float64)
    hi = torch.searchsorted(off, target).clamp(max=B)
    lo = (hi - 1).clamp(min=0)
    # the user boundary nearest each rank's share
    cuts = torch.where((target - off[lo]) <= (off[hi] - target), lo, hi).tolist()
    bounds = [0]
    for r, c in enumerate(cuts, start=1):
        bounds.append(max(bounds[-1] + 1, min(int(c), B - (world - r))))
    return bounds + [B]


def split_batch(b: Batch, rank: int, world: int) -> Batch:
    """Rank ``rank``'s contiguous slice of the users of ``b`` (host tensors), as :func:`user_bounds`
    cuts it; ``max_len`` is the slice's own. Needs at least ``world`` users."""
    B = b.offsets.numel() - 1
    if B < world:
        raise ValueError(f"split_batch: {B} users for {world} ranks")
    bounds = user_bounds(b.offsets, world)
    lo, hi = bounds[rank], bounds[rank + 1]
    a, e = int(b.offsets[lo]), int(b.offsets[hi])
    offsets = b.offsets[lo:hi + 1] - a
    lengths = offsets[1:] - offsets[:-1]
    return Batch(b.items[a:e], b.targets[a:e] if b.targets.numel() else b.targets, offsets, b.user_ids[lo:hi],
                 int(lengths.max()))


def rank_users(h, users: torch.Tensor, rank: int, world: int, *, max_len: int):
    """(this rank's users, the global batch's tokens): the slice of the global batch's ``users`` that
    :func:`split_batch` gives rank ``rank`` of the batch ``data.window_batch(h, users)``, found from the
    users' lengths alone, so that a rank gathers only its own users' windows."""
    B = users.numel()
    if B < world:
        raise ValueError(f"rank_users: {B} users for {world} ranks")
    n = torch.clamp(h.lengths[users], max=max_len + 1) - 1
    offsets = torch.zeros(B + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(n, 0)
    bounds = user_bounds(offsets, world)
    return users[bounds[rank]:bounds[rank + 1]], int(offsets[-1])


def sum_hook(group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that sums the ranks' gradients (DDP's default averages them)."""
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def distribute(model: torch.nn.Module, process_group, ddp_group: Optional[object] = None,
               comm_dtype=None):
    """Shard ``model``'s dynamic tables over ``process_group`` (in place: ``model.items`` and
    ``model.users`` become ``ShardedDynamicEmbedding``s holding this rank's keys) and return the model
    under ``DistributedDataParallel`` over ``ddp_group`` (default: a new group of the same ranks, so
    that the gradients' all-reduces never interleave with the tables' all-to-alls on one communicator).
    ``comm_dtype``: the tables' rows and gradients on the wire, a dtype or a (forward, backward) pair
    (default: their own dtype, exact). Collective: every rank of the group calls it with the same model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..distributed import shard
    for name in ("items", "users"):
        t = getattr(model, name, None)
        if t is not None:
            setattr(model, name, shard(t, process_group, comm_dtype=comm_dtype))
    if ddp_group is None:
        ddp_group = dist.new_group(ranks=dist.get_process_group_ranks(process_group or dist.group.WORLD))
    dev = model.positions.weight.device
    # gradients as views of DDP's buckets: no copy of each parameter's gradient into its bucket and back,
    # two copies per parameter per step that cost a 16-layer model's host ~14 ms a step on 2 GPUs
    ddp = DDP(model, process_group=ddp_group, device_ids=[dev] if dev.type == "cuda" else None,
              gradient_as_bucket_view=True)
    ddp.register_comm_hook(ddp_group, sum_hook)
    return ddp
