"""shard(module): the sharded form of a single-device dynamic embedding or collection."""
import copy

import torch

from .. import optim as _optim
from ..dynamic_embedding import DynamicEmbedding, DynamicEmbeddingBag
from ._module import ShardedDynamicEmbedding, ShardedDynamicEmbeddingBag


def _options(m: DynamicEmbedding) -> dict:
    return dict(max_capacity=m.max_capacity, dtype=m.dtype, device=m.device, eviction=m.eviction,
                initializer=tuple(m.initializer), optimizer=_optim.from_config(m.optimizer.config()),
                hbm_budget_bytes=m.hbm_budget_bytes, seed=m.seed, max_load_factor=m.max_load_factor,
                bucket_size=m.bucket_size, evicted_record_limit=m.evicted_record_limit)


def shard(module: torch.nn.Module, process_group=None, owner_rank=None, comm_dtype=None) -> torch.nn.Module:
    """The sharded form of `module` over `process_group` (default: the world group), holding the keys
    of `module` that this rank owns (call it on every rank with the same module, e.g. built with the
    same seed or loaded from the same checkpoint):

    - DynamicEmbedding -> ShardedDynamicEmbedding, DynamicEmbeddingBag -> ShardedDynamicEmbeddingBag,
      each rank's table with the module's configuration (capacity per rank);
    - torchfuse.torchrec.DynamicEmbeddingBagCollection / DynamicEmbeddingCollection -> a copy whose
      tables are sharded (one exchange per table; the collection's table-batched path is off).

    owner_rank: None shards row-wise by the shard hash; for one table, a rank places it whole there
    (table-wise); for a collection, a mapping of table names to ranks places those tables table-wise
    (the others row-wise). comm_dtype: the dtype rows and gradients cross the exchange in, or a
    (forward, backward) pair (see ShardedDynamicEmbedding; None: the tables' own, exact). Training
    mode and requires_grad follow the module. The module itself is left unchanged."""
    from ..torchrec import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection
    if isinstance(module, (DynamicEmbeddingBagCollection, DynamicEmbeddingCollection)):
        placed = dict(owner_rank or {})
        unknown = set(placed) - set(module.tables)
        if unknown:
            raise ValueError(f"torchfuse.distributed.shard: owner_rank names tables the collection does not have: "
                             f"{sorted(unknown)}")
        tables = module.tables
        module.tables = torch.nn.ModuleDict()  # not copied: each table is sharded from the original
        try:
            out = copy.deepcopy(module)
        finally:
            module.tables = tables
        out.tables = type(tables)({k: shard(t, process_group, placed.get(k), comm_dtype) for k, t in tables.items()},
                                  tables())
        if hasattr(out, "table_batched"):
            out.table_batched = False
        return out
    if isinstance(module, DynamicEmbeddingBag):
        out = ShardedDynamicEmbeddingBag(module.embedding_dim, module.capacity, mode=module.mode,
                                         include_last_offset=module.include_last_offset,
                                         process_group=process_group, owner_rank=owner_rank, comm_dtype=comm_dtype,
                                         **_options(module))
    elif isinstance(module, DynamicEmbedding):
        out = ShardedDynamicEmbedding(module.embedding_dim, module.capacity, process_group=process_group,
                                      owner_rank=owner_rank, comm_dtype=comm_dtype, **_options(module))
    else:
        raise TypeError("torchfuse.distributed.shard: module must be a DynamicEmbedding, DynamicEmbeddingBag or a "
                        f"torchfuse.torchrec collection, got {type(module).__name__}")
    out.load_resharded([module.state_dict()])
    out.train(module.training)
    out.requires_grad_(module._trainable)
    return out
