"""Functions with the signatures and semantics of meta-recsys/generative-recommenders' ops, backed by
torchfuse, so existing code can swap them in."""

# ---- jagged tensor ops (concat_2D_jagged, split_2D_jagged) ----
from typing import Optional, Tuple  # noqa: E402

from torch import Tensor  # noqa: E402

from .. import jagged as _jagged  # noqa: E402


def concat_2D_jagged(
    max_seq_len: int,
    values_left: Tensor,
    values_right: Tensor,
    max_len_left: Optional[int] = None,
    max_len_right: Optional[int] = None,
    offsets_left: Optional[Tensor] = None,
    offsets_right: Optional[Tensor] = None,
    kernel=None,
    n_prefix_from_right: int = 0,
) -> Tensor:
    """generative_recommenders.ops.jagged_tensors.concat_2D_jagged: per sample ``[left_b; right_b]``
    (offsets None: that side is dense with max_len rows per sample). ``max_seq_len`` and ``kernel``
    are accepted for signature compatibility and not needed (the torchfuse kernel is sized by rows);
    lengths must not exceed the max_len given (GR's contract). ``n_prefix_from_right`` is the Triton
    variant's prefix argument. Returns the concatenated values only, as GR does."""
    values, _ = _jagged.concat_2d_jagged(values_left, offsets_left, values_right, offsets_right, max_len_left,
                                         max_len_right, n_prefix_from_right)
    return values


def split_2D_jagged(
    max_seq_len: int,
    values: Tensor,
    total_len_left: Optional[int] = None,
    total_len_right: Optional[int] = None,
    max_len_left: Optional[int] = None,
    max_len_right: Optional[int] = None,
    offsets_left: Optional[Tensor] = None,
    offsets_right: Optional[Tensor] = None,
    kernel=None,
    n_prefix_to_right: int = 0,
) -> Tuple[Tensor, Tensor]:
    """generative_recommenders.ops.jagged_tensors.split_2D_jagged: the inverse of concat_2D_jagged,
    returning ``(values_left, values_right)``; totals given (or a dense side) means no device sync."""
    return _jagged.split_2d_jagged(values, offsets_left, offsets_right, max_len_left, max_len_right,
                                   n_prefix_to_right, total_len_left, total_len_right)


# ---- HSTU attention (hstu_mha) ----
