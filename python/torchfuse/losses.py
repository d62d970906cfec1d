"""Sampled softmax loss (generative-recommenders' SampledSoftmaxLoss) as one fused op: Python entry
point, fake kernels and autograd.

The compute is ``torch.ops.torchfuse.sampled_softmax_fwd`` / ``sampled_softmax_bwd``
(csrc/sampled_softmax.cpp, kernels/sampled_softmax*.{h,c,cu}).
"""
from typing import Optional

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.torchfuse)
from ._autograd import function_for
from ._stats import count

_fwd = torch.ops.torchfuse.sampled_softmax_fwd.default
_bwd = torch.ops.torchfuse.sampled_softmax_bwd.default

# Shared negatives: query rows per (rows x R) similarity block; 0 sizes blocks to 64 MiB of float32.
_chunk_rows = 0


def sampled_softmax_loss(
    query: Tensor,
    positive: Tensor,
    negatives: Tensor,
    temperature: float,
    *,
    l2_norm: bool = True,
    eps: float = 1e-6,
    positive_ids: Optional[Tensor] = None,
    negative_ids: Optional[Tensor] = None,
    weights: Optional[Tensor] = None,
) -> Tensor:
    """Sampled softmax loss of generative-recommenders' ``SampledSoftmaxLoss``, fused.

    Per row t (one predicted position): with ``l2_norm``, ``query``, ``positive`` and ``negatives``
    rows are normalised as ``F.normalize(x, dim=-1, eps=eps)`` (``x / max(||x||, eps)``); logits are
    ``pos_t = <q_t, p_t> / temperature`` and ``neg_tr = <q_t, n_r> / temperature``; a negative whose id
    equals the row's positive id is set to -5e4 (GR's value) when ``positive_ids`` and ``negative_ids``
    are given; ``loss_t = logsumexp(pos_t, neg_t*) - pos_t``. Returns ``sum_t w_t loss_t / sum_t w_t``
    (``weights`` default 1: the mean over rows).

    The normalisation, the similarities and the log-sum-exp are one op forward and backward. Shared
    negatives are processed in blocks of query rows (a GEMM per block; only the per-row losses are
    kept for the backward, which recomputes each block), so no (T x R) logits tensor is ever held for
    large T; per-row negatives are read once forward and once backward.

    Args:
        query, positive: (T, D) float32, float16 or bfloat16, one dtype for all three inputs (under
            autocast, any float dtypes: all three are cast to the autocast dtype).
        negatives: (R, D) shared by every row, or (T, R, D) per row.
        temperature: > 0.
        l2_norm: normalise the three inputs first (GR's L2-normalised item and user embeddings).
        eps: the norm's floor, as ``F.normalize``'s.
        positive_ids: (T,) int64/int32 ids of the positives; with ``negative_ids`` ((R,) or (T, R)),
            masks negatives that are the row's positive (sampled negatives may hit it).
        weights: (T,) float, e.g. 0 for padding positions.

    Returns:
        A 0-dim float32 tensor, whatever the inputs' dtype: what GR's loss is under autocast, where
        ``log_softmax`` runs in float32. Logits and the log-sum-exp are computed in float32 (16-bit
        inputs meet in GEMMs with float32 accumulation and results). When the weights sum to 0 (in
        particular T = 0) the loss is 0 with zero gradients, where GR's division gives NaN: an
        empty or fully masked batch then leaves training unharmed.
        Differentiable in query, positive and negatives (gradients in their dtype); ids and weights
        get none.
    """
    count("sampled_softmax_fwd")
    dev = query.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        # as autocast runs GR's similarity matmuls: on the autocast dtype (the gradients come back in
        # each input's own dtype through the casts)
        dt = torch.get_autocast_dtype(dev)
        query, positive, negatives = query.to(dt), positive.to(dt), negatives.to(dt)
    args = (query, positive, negatives, positive_ids, negative_ids, weights, float(temperature), bool(l2_norm),
            float(eps), int(_chunk_rows))
    if torch.is_grad_enabled() and (query.requires_grad or positive.requires_grad or negatives.requires_grad):
        loss, _ = _Function.apply(*args)
    else:
        loss, _ = _fwd(*args)
    return loss


# ---- fake (meta) kernels: shapes and dtypes only, for torch.compile and meta tensors ----


def _check_shapes(query, positive, negatives):
    torch._check(query.dim() == 2, lambda: f"torchfuse.sampled_softmax_loss: query must be (T, D), got {query.shape}")
    torch._check(positive.shape == query.shape,
                 lambda: f"torchfuse.sampled_softmax_loss: positive must have query's shape {query.shape}")
    torch._check(negatives.dim() in (2, 3) and negatives.shape[-1] == query.shape[1],
                 lambda: "torchfuse.sampled_softmax_loss: negatives must be (R, D) or (T, R, D)")


@torch.library.register_fake("torchfuse::sampled_softmax_fwd")
def _fwd_fake(query, positive, negatives, positive_ids, negative_ids, weights, temperature, l2_norm, eps,
              chunk_rows):
    _check_shapes(query, positive, negatives)
    return query.new_empty((), dtype=torch.float32), query.new_empty((query.shape[0],), dtype=torch.float32)


@torch.library.register_fake("torchfuse::sampled_softmax_bwd")
def _bwd_fake(dloss, query, positive, negatives, positive_ids, negative_ids, weights, row_loss, temperature,
              l2_norm, eps, chunk_rows):
    _check_shapes(query, positive, negatives)
    return query.new_empty(query.shape), positive.new_empty(positive.shape), negatives.new_empty(negatives.shape)


# ---- autograd ----


def _setup_context(ctx, inputs, output):
    query, positive, negatives, positive_ids, negative_ids, weights, temperature, l2_norm, eps, chunk_rows = inputs
    _loss, row_loss = output
    ctx.mark_non_differentiable(row_loss)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(query, positive, negatives, positive_ids, negative_ids, weights, row_loss)
    ctx.temperature, ctx.l2_norm, ctx.eps, ctx.chunk_rows = temperature, l2_norm, eps, chunk_rows


def _backward(ctx, dloss, _drow_loss):
    need = ctx.needs_input_grad
    if dloss is None or not (need[0] or need[1] or need[2]):
        return (None,) * 10
    query, positive, negatives, positive_ids, negative_ids, weights, row_loss = ctx.saved_tensors
    dq, dp, dn = _bwd(dloss, query, positive, negatives, positive_ids, negative_ids, weights, row_loss,
                      ctx.temperature, ctx.l2_norm, ctx.eps, ctx.chunk_rows)
    return (dq if need[0] else None, dp if need[1] else None, dn if need[2] else None) + (None,) * 7


torch.library.register_autograd("torchfuse::sampled_softmax_fwd", _backward, setup_context=_setup_context)
_Function = function_for("SampledSoftmaxFunction", _fwd, _setup_context, _backward)
