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


def shard(module: torch.nn.Module, process_group=None) -> torch.nn.Module:
    """The sharded form of `module` over `process_group` (default: the world group), holding the keys
    of `module` that this rank owns (call it on every rank with the same module, e.g. built with the
    same seed or loaded from the same checkpoint):

    - DynamicEmbedding -> ShardedDynamicEmbedding, DynamicEmbeddingBag -> ShardedDynamicEmbeddingBag,
      each rank's table with the module's configuration (capacity per rank);
    - torchfuse.torchrec.DynamicEmbeddingBagCollection / DynamicEmbeddingCollection -> a copy whose
      tables are sharded (one exchange per table; the collection's table-batched path is off).

    Training mode and requires_grad follow the module. The module itself is left unchanged."""
    from ..torchrec import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection
    if isinstance(module, (DynamicEmbeddingBagCollection, DynamicEmbeddingCollection)):
        tables = module.tables
        module.tables = torch.nn.ModuleDict()  # not copied: each table is sharded from the original
        try:
            out = copy.deepcopy(module)
        finally:
            module.tables = tables
        out.tables = type(tables)({k: shard(t, process_group) for k, t in tables.items()}, tables())
        if hasattr(out, "table_batched"):
            out.table_batched = False
        return out
    if isinstance(module, DynamicEmbeddingBag):
        out = ShardedDynamicEmbeddingBag(module.embedding_dim, module.capacity, mode=module.mode,
                                         include_last_offset=module.include_last_offset,
                                         process_group=process_group, **_options(module))
    elif isinstance(module, DynamicEmbedding):
        out = ShardedDynamicEmbedding(module.embedding_dim, module.capacity, process_group=process_group,
                                      **_options(module))
    else:
        raise TypeError("torchfuse.distributed.shard: module must be a DynamicEmbedding, DynamicEmbeddingBag or a "
                        f"torchfuse.torchrec collection, got {type(module).__name__}")
    out.load_resharded([module.state_dict()])
    out.train(module.training)
    out.requires_grad_(module._trainable)
    return out
