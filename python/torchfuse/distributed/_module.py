"""ShardedDynamicEmbedding / ShardedDynamicEmbeddingBag: a dynamic embedding sharded row-wise by key
over the ranks of a torch.distributed process group."""
import functools
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..dynamic_embedding import DynamicEmbedding, DynamicEmbeddingBag
from ._checkpoint import ShardCheckpointMixin
from ..dynamic_embedding._table import _ops
from ._exchange import PartialPlan, PartialSums, PerId, PooledBags, all_to_all_as, sharded_rows
from ._hash import owner_of


_WIRE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def _comm_pair(name: str, comm_dtype):
    """(forward, backward) wire dtypes from comm_dtype: one dtype for both, or a pair."""
    pair = tuple(comm_dtype) if isinstance(comm_dtype, (tuple, list)) else (comm_dtype, comm_dtype)
    if len(pair) != 2 or any(d not in _WIRE_DTYPES for d in pair):
        raise ValueError(f"{name}: comm_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, or a "
                         f"(forward, backward) pair of them, got {comm_dtype!r}")
    return pair


class ShardedDynamicEmbedding(ShardCheckpointMixin, torch.nn.Module):
    """A :class:`torchfuse.DynamicEmbedding` sharded row-wise over a process group: the rank
    ``torchfuse.distributed.owner_of(key, world_size)`` owns a key (a hash independent of the
    table's bucket hash), and its rows, optimizer state, scores, growth, eviction and host tier live
    only in that rank's table, ``self.local`` (a :class:`torchfuse.DynamicEmbedding`).

    ``forward(ids)`` as DynamicEmbedding's, with each rank's own batch: the rank sorts its distinct
    ids, sends each to its owner (``all_to_all_single``, counts first), the owner finds or inserts
    them (training) or finds them (eval: absent ids read as zeros), and the rows come back. The
    backward sends each distinct id's gradient (its occurrences summed in batch order) to the owner,
    whose table sums the ranks' gradients of a key in rank order and applies its fused optimizer.

    Collective: every rank of the group calls forward, and backward through the output, the same
    number of times in the same order (a rank with no ids still calls them with an empty batch; a
    rank whose loss does not reach the output leaves the others waiting in the exchange).

    Args: as :class:`torchfuse.DynamicEmbedding`, per rank: ``capacity``, ``max_capacity`` and
    ``hbm_budget_bytes`` size each rank's table. ``device`` is this rank's device (NCCL needs CUDA
    tensors, gloo CPU ones). ``process_group``: default the world group. ``owner_rank``: None
    (default) shards row-wise by the shard hash; a rank places the whole table there (TorchRec's
    table-wise sharding: the other ranks' tables stay empty, of 128 slots, and their ids are
    exchanged with that rank as in the row-wise case).

    ``comm_dtype``: the dtype rows and their gradients cross the exchange in, or a (forward, backward)
    pair (TorchRec's quantized communications, QCommsConfig's forward and backward precision). None
    (default): the table's own, and the results equal one device's bit for bit. ``torch.bfloat16`` or
    ``torch.float16`` with an fp32 table halve the rows' and gradients' bytes: the rows arrive rounded
    to it (each rank's own rows too) and each rank's per-id gradient sums leave rounded to it, so
    outputs and updates equal one device's to that rounding. float16 saturates past 65504; bfloat16
    keeps fp32's range.

    ``exchange_log``: set to a list to record each all-to-all as (what, bytes sent to other ranks,
    bytes received, seconds, bytes sent to each rank, bytes received from each rank); timing aligns
    the ranks (a barrier) and synchronizes the device around each exchange.
    """

    _local_cls = DynamicEmbedding

    def __init__(self, embedding_dim: int, capacity: int, *, process_group=None, owner_rank: Optional[int] = None,
                 comm_dtype=None, **options):
        super().__init__()
        name = f"torchfuse.distributed.{type(self).__name__}"
        self._comm = _comm_pair(name, comm_dtype)  # (rows', gradients') wire dtypes
        self.comm_dtype = comm_dtype
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{name}: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if owner_rank is not None and not (isinstance(owner_rank, int) and 0 <= owner_rank < self.world_size):
            raise ValueError(f"{name}: owner_rank must be None (row-wise) or a rank in [0, {self.world_size}), "
                             f"got {owner_rank!r}")
        self.owner_rank = owner_rank
        if owner_rank is not None and owner_rank != self.rank:  # table-wise, elsewhere: holds no key
            capacity = 128  # one bucket of the largest size, so any bucket_size divides it
            options = dict(options, max_capacity=capacity)
        self.local = self._local_cls(embedding_dim, capacity, **options)
        self.exchange_log: Optional[list] = None

    def owner(self, keys: Tensor) -> Tensor:
        """The rank (int64) that owns each key: the shard hash's (``owner_of``), or ``owner_rank``."""
        if self.owner_rank is None:
            return owner_of(keys, self.world_size)
        return torch.full_like(keys, self.owner_rank, dtype=torch.int64)

    # the local table's configuration, read through
    embedding_dim = property(lambda self: self.local.embedding_dim)
    dtype = property(lambda self: self.local.dtype)
    device = property(lambda self: self.local.device)
    capacity = property(lambda self: self.local.capacity, doc="this rank's table's slots")
    max_capacity = property(lambda self: self.local.max_capacity)
    eviction = property(lambda self: self.local.eviction)
    optimizer = property(lambda self: self.local.optimizer)

    # what torchfuse.torchrec's collections read of a table: whether it trains, and _run, whose
    # backward is this module's own autograd (the exchange is collective), so it returns no record
    _trainable = property(lambda self: self.local._trainable)

    def _run(self, need_grad: bool, *args):
        return self.forward(*args), None

    def __len__(self) -> int:
        """Keys in this rank's table."""
        return len(self.local)

    def extra_repr(self) -> str:
        where = "row-wise" if self.owner_rank is None else f"table-wise on rank {self.owner_rank}"
        comm = "" if self.comm_dtype is None else f", comm_dtype={self.comm_dtype}"
        return f"rank={self.rank}, world_size={self.world_size}, {where}{comm}"

    def requires_grad_(self, requires_grad: bool = True):
        self.local.requires_grad_(requires_grad)
        return super().requires_grad_(requires_grad)

    def export(self, batch_size: int = 65536):
        """This rank's ``(keys, values, optimizer_state, scores)``: over all ranks, every key once."""
        return self.local.export(batch_size)

    def drain_evicted(self):
        """What this rank's table evicted (see DynamicEmbedding.drain_evicted)."""
        return self.local.drain_evicted()

    def _sharded_rows(self, flat: Tensor):
        """(rows of the batch's unique ids grouped by owner, their Plan)."""
        need_grad = torch.is_grad_enabled() and self.local._trainable
        lookup = functools.partial(DynamicEmbedding.forward, self.local)  # per-id rows, bag tables too
        return sharded_rows(self.local, lookup, flat, self.owner, self.world_size, self.process_group,
                            need_grad, self.exchange_log, self._comm)

    def _per_id_rows(self, ids) -> Tensor:
        return PerId.apply(*self._sharded_rows(self.local._check_keys(ids)))

    def forward(self, ids: Tensor) -> Tensor:
        return self._per_id_rows(ids).reshape(*ids.shape, self.embedding_dim)


class ShardedDynamicEmbeddingBag(ShardedDynamicEmbedding):
    """A :class:`torchfuse.DynamicEmbeddingBag` sharded row-wise (see :class:`ShardedDynamicEmbedding`):
    ``forward(ids, offsets=None, per_sample_weights=None) -> (B, embedding_dim)``.

    ``exchange``:

    - ``"rows"`` (default): the rows of the batch's distinct ids come back from their owners and the
      bags are pooled on the rank that asked by the single-device table's kernel (fp32 sums in id
      order), so the outputs equal one device's bit for bit; gradients reach per_sample_weights too.
    - ``"partial_sums"``: every id goes to its owner with its bag's index, each owner pools its part
      of every bag, and the rank adds the owners' partial bags in rank order (then divides for
      "mean"). This moves world_size x bags rows each way instead of the distinct ids' rows: fewer
      bytes for long bags (docs/design/distributed.md). A bag's sum then runs in another order than
      on one device (equal to rounding), and 16-bit tables round each partial bag to their dtype.
      Weights that need gradients take the "rows" exchange.
    """

    _local_cls = DynamicEmbeddingBag

    def __init__(self, embedding_dim: int, capacity: int, *, mode: str = "sum", include_last_offset: bool = False,
                 process_group=None, owner_rank: Optional[int] = None, exchange: str = "rows", **options):
        if exchange not in ("rows", "partial_sums"):
            raise ValueError(f"torchfuse.distributed.{type(self).__name__}: exchange must be 'rows' or 'partial_sums', "
                             f"got {exchange!r}")
        if mode not in ("sum", "mean"):
            raise ValueError(f"torchfuse.distributed.{type(self).__name__}: mode must be 'sum' or 'mean', got {mode!r}")
        # the owners' partial bags are sums; the mean divides their total
        super().__init__(embedding_dim, capacity, process_group=process_group, owner_rank=owner_rank,
                         mode="sum" if exchange == "partial_sums" else mode, include_last_offset=False, **options)
        self.exchange = exchange
        self._mode = mode
        self._include_last_offset = bool(include_last_offset)

    mode = property(lambda self: self._mode)
    include_last_offset = property(lambda self: self._include_last_offset)

    def forward(self, ids: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        name = f"torchfuse.distributed.{type(self).__name__}"
        if not isinstance(ids, Tensor):
            raise TypeError(f"{name}: ids must be a tensor")
        dev = self.device
        if offsets is None:
            if ids.dim() != 2:
                raise ValueError(f"{name}: ids must be 2-D (bags, ids per bag) without offsets, got shape {tuple(ids.shape)}")
            B, L = ids.shape
            offsets = torch.arange(B, device=ids.device) * L
            incl, given = False, False
        else:
            if ids.dim() != 1:
                raise ValueError(f"{name}: ids must be 1-D with offsets, got shape {tuple(ids.shape)}")
            incl, given = self.include_last_offset, True
        flat = self.local._check_keys(ids)
        if not isinstance(offsets, Tensor) or offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() != 1:
            raise TypeError(f"{name}: offsets must be a 1-D int32 or int64 tensor")
        if offsets.device != dev:
            raise ValueError(f"{name}: offsets must be on {dev}, got {offsets.device}")
        n = flat.numel()
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError(f"{name}: per_sample_weights need mode='sum' (as nn.EmbeddingBag)")
            if per_sample_weights.shape != ids.shape or per_sample_weights.device != dev:
                raise ValueError(f"{name}: per_sample_weights must have the shape {tuple(ids.shape)} and device of ids")
            per_sample_weights = per_sample_weights.reshape(-1)
        if not offsets.numel() and (incl or n):
            raise ValueError(f"{name}: empty offsets with {n} ids")
        mean = self._mode == "mean"
        # the bags' bounds (n_bags + 1), the offsets' check flag and, where the partial sums or a
        # backward (the table's or the weights') may use them, each id's bag and mean scale
        with_bags = self.exchange == "partial_sums" or torch.is_grad_enabled()
        full, bag_of, scale, bad = _ops.dynemb_bag_layout(offsets.contiguous(), n, incl, mean, with_bags)
        # a host read, so only for offsets the caller gave (fixed-size bags' are valid by construction)
        if given and bool(bad):
            raise ValueError(f"{name}: offsets must start at 0, be non-decreasing and end at most at "
                             f"len(ids) = {n}" + (" (exactly, with include_last_offset)" if incl else ""))
        if self.exchange == "partial_sums" and not (per_sample_weights is not None and per_sample_weights.requires_grad
                                                    and torch.is_grad_enabled()):
            return self._partial_sums(flat, full[1:] - full[:-1], bag_of, per_sample_weights)
        rows, plan = self._sharded_rows(flat)
        if per_sample_weights is not None:
            scale = per_sample_weights.detach()
        elif not mean:
            scale = None
        # still tied to the rows when this rank has no ids, so that its backward joins the exchange
        return PooledBags.apply(rows, per_sample_weights, plan, full, bag_of, scale, mean)

    def _partial_sums(self, flat: Tensor, lengths: Tensor, bag_of: Tensor, weights: Optional[Tensor]) -> Tensor:
        n_bags = lengths.numel()
        w = weights.to(torch.float32).contiguous() if weights is not None else None
        plan = PartialPlan(flat, bag_of, w, n_bags, self.owner, self.world_size, self.process_group,
                           self.exchange_log, self._comm)
        pool = functools.partial(DynamicEmbeddingBag.forward, self.local)
        if torch.is_grad_enabled() and self.local._trainable:
            anchor = torch.empty(0, device=flat.device, requires_grad=True)
            parts = PartialSums.apply(anchor, pool, plan)
        else:
            parts = _partial_no_grad(pool, plan)
        pooled = parts[0].float()
        for r in range(1, self.world_size):  # the owners' partial bags added in rank order
            pooled = pooled + parts[r].float()
        if self._mode == "mean":
            pooled = pooled / lengths.clamp(min=1).to(torch.float32).unsqueeze(1)
        return pooled.to(self.dtype)


def _partial_no_grad(pool, plan) -> Tensor:
    ids, offsets, w = plan.owner_batch()
    partial = pool(ids, offsets, w)
    back = all_to_all_as(partial, plan.comm[0], [plan.n_bags] * plan.world, plan.src_bags, plan.group, plan.log,
                         "partial bags")
    return back.view(plan.world, plan.n_bags, partial.shape[1])
