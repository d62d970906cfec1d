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


def concat_2D_jagged_multirow(
    max_seq_len: int,
    values_left: Tensor,
    values_right: Tensor,
    offsets_left: Optional[Tensor],
    offsets_right: Optional[Tensor],
    max_len_left: int,
    max_len_right: int,
    kernel=None,
) -> Tensor:
    """generative_recommenders.ops.jagged_tensors.concat_2D_jagged_multirow: the same result as
    concat_2D_jagged (GR's variant only launches several rows per program); note its argument order."""
    return concat_2D_jagged(max_seq_len, values_left, values_right, max_len_left, max_len_right, offsets_left,
                            offsets_right)


# GR's multirow variant only launches several rows per program: the same signature and result
split_2D_jagged_multirow = split_2D_jagged


def jagged_dense_bmm_broadcast_add(max_seq_len: int, seq_offsets: Tensor, jagged: Tensor, dense: Tensor, bias: Tensor,
                                   kernel=None) -> Tensor:
    """generative_recommenders.ops.jagged_tensors.jagged_dense_bmm_broadcast_add (``kernel`` ignored):
    :func:`torchfuse.jagged_dense_bmm_broadcast_add`."""
    return _jagged.jagged_dense_bmm_broadcast_add(max_seq_len, seq_offsets, jagged, dense, bias)


# ---- HSTU attention (hstu_mha, delta_hstu_mha) ----
from typing import Optional as _Optional

import torch as _torch

from ..hstu import hstu_attention as _hstu_attention
from ..hstu import hstu_attention_cached as _hstu_attention_cached


def hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: _torch.Tensor,
    k: _torch.Tensor,
    v: _torch.Tensor,
    seq_offsets: _torch.Tensor,
    causal: bool = True,
    dropout_pr: float = 0.0,
    training: bool = True,
    num_targets: _Optional[_torch.Tensor] = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    sort_by_length: bool = False,
    kernel=None,
    enable_tma: bool = False,
) -> _torch.Tensor:
    """generative-recommenders' ``hstu_mha`` (same signature and semantics), on
    :func:`torchfuse.hstu_attention`: any head dims up to 256, and attention dropout (``dropout_pr``
    applied when ``training``, as GR's PyTorch form does, with the mask drawn from torch's generator).
    ``sort_by_length``, ``kernel`` and ``enable_tma`` are accepted and ignored (the kernels schedule long
    sequences first themselves and choose their loads). Not supported: ``causal=False``
    (NotImplementedError, as GR's own kernels)."""
    if not causal:
        raise NotImplementedError("torchfuse.compat.gr.hstu_mha: only causal=True is implemented")
    return _hstu_attention(q, k, v, seq_offsets, max_seq_len, alpha, num_targets=num_targets,
                           contextual_seq_len=contextual_seq_len, max_attn_len=max_attn_len,
                           min_full_attn_seq_len=min_full_attn_seq_len, dropout_p=dropout_pr, training=training)


def delta_hstu_mha(
    max_seq_len: int,
    alpha: float,
    delta_q: _torch.Tensor,
    k: _torch.Tensor,
    v: _torch.Tensor,
    seq_offsets: _torch.Tensor,
    num_targets: _Optional[_torch.Tensor] = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    kernel=None,
    enable_tma: bool = False,
) -> _torch.Tensor:
    """generative-recommenders' ``delta_hstu_mha`` (cached inference: ``delta_q`` holds the last
    ``len(delta_q) // B`` query rows of every sequence), on :func:`torchfuse.hstu_attention_cached`.
    ``kernel`` and ``enable_tma`` are accepted and ignored."""
    return _hstu_attention_cached(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets=num_targets,
                                  contextual_seq_len=contextual_seq_len, max_attn_len=max_attn_len)
