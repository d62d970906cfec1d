"""The GEMV of a serving step: ``[LayerNorm(a)] @ weight + bias + residual`` for a few rows of ``a``,
one kernel (``kernels/skinny_linear_cuda.cu``).

Scoring one new event per user runs every layer's projections with M = 1 to 8 rows against weights of
megabytes. Composed of a norm kernel, a cuBLAS GEMM (a split-K GEMM plus its reduction kernel at these
shapes) and a copy of the residual into the output, each step costs three or four launches; here the
norm of the few rows is recomputed by every block that reads a slice of the weight, and the bias and
residual ride in the epilogue.
"""
from typing import Optional

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.torchfuse)
from ._stats import count

MAX_ROWS = 8
_op = torch.ops.torchfuse.skinny_linear.default


def skinny_linear(a: Tensor, weight: Tensor, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None, *,
                  norm_weight: Optional[Tensor] = None, norm_bias: Optional[Tensor] = None,
                  eps: float = 1e-5) -> Tensor:
    """``out = a' @ weight + bias + residual`` with ``a' = LayerNorm(a) * norm_weight + norm_bias`` (rounded
    to a's dtype, as the norm op's output is) when ``norm_weight`` is given, else ``a' = a``.

    Args:
        a: (M, K) with M <= 8; float32, bfloat16 or float16.
        weight: (K, N) in a's dtype (the ``x @ W`` layout: generative-recommenders' weights).
        bias: (N,), residual: (M, N), norm_weight / norm_bias: (K,), all in a's dtype.

    Returns:
        (M, N) in a's dtype: the fp32 sum rounded once, as ``torch.addmm(residual, a', weight)`` rounds.
        Inference only: it has no backward (a ValueError if an input requires grad under autograd).
    """
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad
                                       for t in (a, weight, bias, residual, norm_weight, norm_bias)):
        raise ValueError("torchfuse.skinny_linear: inference only (no backward); call it under torch.no_grad() "
                         "or with inputs that do not require grad")
    count("skinny_linear")
    return _op(a, weight, bias, residual, norm_weight, norm_bias, float(eps))


def applies(a: Tensor) -> bool:
    """Whether a serving step's rows take the skinny kernel: CUDA, 1 to 8 rows, no autograd."""
    return a.is_cuda and 0 < a.shape[0] <= MAX_ROWS


@torch.library.register_fake("torchfuse::skinny_linear")
def _skinny_linear_fake(a, weight, bias=None, residual=None, norm_weight=None, norm_bias=None, eps=1e-5):
    torch._check(a.dim() == 2 and weight.dim() == 2, lambda: "torchfuse.skinny_linear: a and weight must be 2-D")
    torch._check(a.shape[0] <= MAX_ROWS, lambda: f"torchfuse.skinny_linear: a must have at most {MAX_ROWS} rows")
    return a.new_empty((a.shape[0], weight.shape[1]))
