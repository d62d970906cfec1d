"""Dynamic embeddings: a hash-table embedding keyed by any int64 that grows, evicts, spills rows to
host memory and trains with a fused optimizer in the backward pass.

The table's state is a set of tensors owned by the module (kernels/dynemb_kernels.h documents the layout):
keys, digests (0 = empty slot, so every int64 is a usable key), scores, values and optimizer state,
indexed by slot. Operations are the internal ops ``torch.ops.torchfuse.dynemb_*`` on those tensors.
"""
from . import _fake  # noqa: F401  (the ops' fake kernels)
from ._module import DynamicEmbedding, DynamicEmbeddingBag
from ._table import DynamicEmbeddingTable

__all__ = ["DynamicEmbedding", "DynamicEmbeddingBag", "DynamicEmbeddingTable"]
