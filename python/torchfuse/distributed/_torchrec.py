"""TorchRec's sharding API for the dynamic-embedding collections: a ModuleSharder, so that
DistributedModelParallel places them through TorchRec's planner, and the sharded module it returns.
Imported only when torchfuse.torchrec.DynamicEmbeddingSharder is first used (it needs torchrec)."""
from typing import Dict, List, Optional, Sequence, Type

import torch
from torch import nn

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import (LazyNoWait, ModuleSharder, NoWait, NullShardedModuleContext, ShardedModule,
                                        ShardingEnv, ShardingType)

from ..torchrec import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection
from ._shard import shard


class ShardedDynamicEmbeddingCollection(ShardedModule):
    """A DynamicEmbedding(Bag)Collection sharded over the sharding environment's process group
    (``torchfuse.distributed.shard`` of the collection) as the plan places each table: row-wise by
    key hash over all ranks, or table-wise on one rank. The KJT stays data-parallel through
    input_dist: each table's exchange sends the distinct ids of the rank's batch to their owners
    (all_to_all_single, grouped by owner) inside compute, and its rows come back there, so
    output_dist has nothing left to move."""

    def __init__(self, module, plan, env: ShardingEnv, device: Optional[torch.device] = None, comm_dtype=None):
        super().__init__()
        pg = env.process_group
        world = env.world_size
        table_wise = {}
        for name, ps in plan.items():
            ranks = sorted(ps.ranks or [])
            if ps.sharding_type == ShardingType.TABLE_WISE.value and len(ranks) == 1:
                table_wise[name] = ranks[0]
            elif ps.sharding_type != ShardingType.ROW_WISE.value or ranks != list(range(world)):
                raise ValueError(f"torchfuse.torchrec.DynamicEmbeddingSharder: table {name!r} was planned as "
                                 f"{ps.sharding_type} on ranks {ps.ranks}; row-wise over all ranks and table-wise "
                                 "on one rank are supported")
        self._unsharded_type = type(module)
        self._inner = shard(module, pg, table_wise, comm_dtype)

    @property
    def unsharded_module_type(self):
        return self._unsharded_type

    def create_context(self):
        return NullShardedModuleContext()

    def input_dist(self, ctx, features):
        return NoWait(NoWait(features))

    def compute(self, ctx, dist_input):
        return self._inner(dist_input)

    def output_dist(self, ctx, output):
        return LazyNoWait(output)


def _wire_dtypes(name: str, registry, pooled: bool):
    """(forward, backward) wire dtypes (None: fp32, the exact exchange) from a TorchRec qcomm codecs
    registry's embeddings all-to-all entry, or None without one."""
    from torchrec.distributed.types import CommOp
    op = (CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL if pooled else CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL).name
    codecs = (registry or {}).get(op)
    if codecs is None:
        return None
    out = []
    for what, codec in (("forward", codecs.forward), ("backward", codecs.backward)):
        dtype = getattr(codec, "quantized_dtype", torch.float32)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name}: qcomm_codecs_registry's {what} precision ({dtype}) is not supported: the "
                             "dynamic tables' exchange takes fp32, fp16 or bf16")
        if getattr(codec, "_loss_scale", None) not in (None, 1.0):
            raise ValueError(f"{name}: qcomm_codecs_registry's {what} loss scale is not supported")
        out.append(None if dtype == torch.float32 else dtype)
    return tuple(out)


class DynamicEmbeddingSharder(ModuleSharder[nn.Module]):
    """TorchRec ``ModuleSharder`` for :class:`torchfuse.torchrec.DynamicEmbeddingBagCollection`
    (default) or, with ``module_type=DynamicEmbeddingCollection``, :class:`DynamicEmbeddingCollection`:

        model = DistributedModelParallel(model, sharders=[DynamicEmbeddingSharder(),
                                                          DynamicEmbeddingSharder(DynamicEmbeddingCollection)])

    The planner sees one parameter per table, (its capacity, embedding_dim) on the meta device, and
    is offered ``sharding_types`` (default row-wise only; add ``"table_wise"`` to let the planner, or
    a ``ParameterConstraints`` of a table, place a table whole on one rank) with the fused kernel.
    Row-wise, the sharded module
    keys rows by the shard hash (``torchfuse.distributed.owner_of``), not by TorchRec's row ranges,
    and each rank's table keeps the collection's per-table capacity; table-wise, the planned rank
    holds the whole table.

    ``qcomm_codecs_registry`` (``torchrec.distributed.fbgemm_qcomm_codec.get_qcomm_codecs_registry``)
    is honoured as TorchRec's own sharders do: the pooled (bags) or sequence (per-id) embeddings'
    all-to-all codecs give the rows' (forward) and gradients' (backward) dtypes on the wire
    (``comm_dtype``); fp32, fp16 and bf16 are supported, other precisions and loss scales refused."""

    def __init__(self, module_type: Type[nn.Module] = DynamicEmbeddingBagCollection, qcomm_codecs_registry=None,
                 sharding_types: Sequence[str] = (ShardingType.ROW_WISE.value,)):
        super().__init__(qcomm_codecs_registry)
        name = "torchfuse.torchrec.DynamicEmbeddingSharder"
        if module_type not in (DynamicEmbeddingBagCollection, DynamicEmbeddingCollection):
            raise TypeError(f"{name}: module_type must be DynamicEmbeddingBagCollection "
                            f"or DynamicEmbeddingCollection, got {module_type!r}")
        self._comm = _wire_dtypes(name, qcomm_codecs_registry, module_type is DynamicEmbeddingBagCollection)
        supported = (ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value)
        types = [getattr(t, "value", t) for t in sharding_types]
        if not types or any(t not in supported for t in types):
            raise ValueError(f"{name}: sharding_types must be a non-empty selection of {supported}, got {sharding_types!r}")
        self._module_type = module_type
        self._sharding_types = types

    @property
    def module_type(self) -> Type[nn.Module]:
        return self._module_type

    def shardable_parameters(self, module) -> Dict[str, nn.Parameter]:
        return {name: nn.Parameter(torch.empty(t.capacity, t.embedding_dim, device="meta"), requires_grad=False)
                for name, t in module.tables.items()}

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(self._sharding_types)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    def shard(self, module, params, env, device=None, module_fqn=None):
        return ShardedDynamicEmbeddingCollection(module, params, env, device, self._comm)
