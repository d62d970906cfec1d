"""Functions with the signatures and semantics of ``torch.ops.fbgemm``'s ops, backed by torchfuse."""

# ---- jagged tensor ops ----
from typing import List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from .. import jagged as _jagged  # noqa: E402


def _one_jagged_dim(offsets: List[Tensor], op: str) -> Tensor:
    if len(offsets) != 1:
        raise NotImplementedError(f"torchfuse.compat.fbgemm.{op}: only one jagged dimension is supported, "
                                  f"got {len(offsets)} offsets tensors")
    return offsets[0]


def jagged_to_padded_dense(values: Tensor, offsets: List[Tensor], max_lengths: List[int],
                           padding_value: float = 0.0) -> Tensor:
    """``torch.ops.fbgemm.jagged_to_padded_dense`` for one jagged dimension: values (T, *D) ->
    (B, max_lengths[0], *D), rows past a sample's length = padding_value, rows past max_length dropped."""
    off = _one_jagged_dim(offsets, "jagged_to_padded_dense")
    if len(max_lengths) != 1:
        raise ValueError(f"torchfuse.compat.fbgemm.jagged_to_padded_dense: max_lengths must have one entry per "
                         f"offsets tensor, got {len(max_lengths)}")
    return _jagged.jagged_to_padded_dense(values, off, max_lengths[0], padding_value)


def dense_to_jagged(dense: Tensor, x_offsets: List[Tensor], total_L: Optional[int] = None) -> Tuple[Tensor, List[Tensor]]:
    """``torch.ops.fbgemm.dense_to_jagged``: dense (B, L, *D) -> (values (T, *D), x_offsets), T = total_L
    (default x_offsets[0][-1], a device sync)."""
    off = _one_jagged_dim(x_offsets, "dense_to_jagged")
    return _jagged.dense_to_jagged(dense, off, total_L), x_offsets
