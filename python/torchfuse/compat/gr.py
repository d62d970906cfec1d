"""Functions with the signatures and semantics of meta-recsys/generative-recommenders' ops, backed by
torchfuse, so existing code can swap them in."""

# ---- jagged tensor ops (concat_2D_jagged, split_2D_jagged) ----


# ---- HSTU attention (hstu_mha) ----
from typing import Optional as _Optional

import torch as _torch

from ..hstu import hstu_attention as _hstu_attention


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
) -> _torch.Tensor:
    """generative-recommenders' ``hstu_mha`` (same signature and semantics), on
    :func:`torchfuse.hstu_attention`. ``sort_by_length`` and ``kernel`` are accepted and ignored (the
    kernels schedule long sequences first themselves). Not supported: ``causal=False`` and dropout in
    training (``dropout_pr > 0`` with ``training=True``): both raise NotImplementedError."""
    if not causal:
        raise NotImplementedError("torchfuse.compat.gr.hstu_mha: only causal=True is implemented")
    if dropout_pr > 0.0 and training:
        raise NotImplementedError(
            f"torchfuse.compat.gr.hstu_mha: attention dropout (dropout_pr={dropout_pr}) is not implemented; "
            "pass dropout_pr=0.0 or training=False"
        )
    return _hstu_attention(q, k, v, seq_offsets, max_seq_len, alpha, num_targets=num_targets,
                           contextual_seq_len=contextual_seq_len, max_attn_len=max_attn_len,
                           min_full_attn_seq_len=min_full_attn_seq_len)
