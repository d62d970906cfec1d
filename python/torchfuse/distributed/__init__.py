"""Dynamic embeddings sharded row-wise by key over torch.distributed (NCCL on GPUs, gloo on CPU).

    torch.distributed.init_process_group("nccl")
    emb = torchfuse.distributed.ShardedDynamicEmbeddingBag(128, 1 << 20, device=f"cuda:{local_rank}")
    pooled = emb(ids, offsets)          # this rank's batch; ids of any rank's keys
    loss.backward()                     # every rank: the rows' owners apply the optimizer

``shard(module)`` turns a single-device DynamicEmbedding(Bag) or a torchfuse.torchrec collection into
its sharded form. docs/design/distributed.md describes the exchange.
"""
from ._hash import SHARD_HASH, owner_of
from ._module import ShardedDynamicEmbedding, ShardedDynamicEmbeddingBag
from ._shard import shard

__all__ = ["ShardedDynamicEmbedding", "ShardedDynamicEmbeddingBag", "shard", "owner_of", "SHARD_HASH"]
