"""Fused residual add + LayerNorm / RMSNorm: Python entry points and fake kernels.

The compute is ``torch.ops.torchfuse.norm_fwd`` / ``norm_bwd`` (csrc/norm.cpp, kernels/norm_*.c[u]);
norm_fwd's autograd, whose backward is norm_bwd, is registered in C++ (csrc/norm_autograd.cpp).
"""
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.torchfuse)
from ._stats import count

LAYER_NORM, RMS_NORM_LLAMA, RMS_NORM_GEMMA = 0, 1, 2
_RMS_CASTS = {"llama": RMS_NORM_LLAMA, "gemma": RMS_NORM_GEMMA}

_fwd = torch.ops.torchfuse.norm_fwd.default
_infer = torch.ops.torchfuse.add_norm.default
_bwd = torch.ops.torchfuse.norm_bwd.default

NormOutput = Union[Tensor, Tuple[Tensor, Tensor], Tuple[Tensor, Tensor, Tensor]]


def layer_norm(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    residual: Optional[Tensor] = None,
    residual2: Optional[Tensor] = None,
    residual_dtype: Optional[torch.dtype] = None,
    weight2: Optional[Tensor] = None,
    bias2: Optional[Tensor] = None,
) -> NormOutput:
    """LayerNorm over the last dimension, optionally fused with the residual add before it.

    Computes ``s = x + residual (+ residual2)`` with each add rounded in that order, exactly as
    Python's ``x + residual + residual2`` on tensors of those dtypes (so HF GPT-NeoX's
    ``mlp_output + attn_output + hidden_states`` is ``layer_norm(mlp_output, ..., residual=attn_output,
    residual2=hidden_states)``), rounds ``s`` to ``residual_dtype`` (default ``residual.dtype``), and
    returns ``y = (s - mean(s)) / sqrt(var(s) + eps) * weight + bias`` computed in fp32 and rounded
    to ``x.dtype``. ``s`` is read and written once, in one kernel.

    Args:
        x: (..., N) float32, float16 or bfloat16; any leading shape, N from 1 up.
        weight, bias: (N,) or None (no affine); one dtype for all parameters.
        eps: added to the variance; must be > 0.
        residual, residual2: tensors of x's shape, any float dtype, or None.
        residual_dtype: dtype in which ``s`` is kept and returned (e.g. torch.float32 for an fp32
            residual stream under bf16 compute).
        weight2, bias2: a second LayerNorm of the same ``s`` in the same pass (GPT-NeoX's parallel
            residual normalizes one hidden state twice).

    Returns:
        ``y``; ``(y, s)`` with a residual; ``(y, y2)`` with weight2; ``(y, y2, s)`` with both.
        Differentiable in x, residual, residual2, weight, bias, weight2, bias2; weight and bias
        gradients are reduced in fp32 in a fixed order (bitwise reproducible).
    """
    return _norm(x, residual, residual2, weight, bias, weight2, bias2, eps, LAYER_NORM, 0.0, residual_dtype)


def rms_norm(
    x: Tensor,
    weight: Optional[Tensor],
    eps: float = 1e-6,
    residual: Optional[Tensor] = None,
    residual2: Optional[Tensor] = None,
    residual_dtype: Optional[torch.dtype] = None,
    weight2: Optional[Tensor] = None,
    cast: str = "llama",
    weight_offset: float = 0.0,
) -> NormOutput:
    """RMSNorm over the last dimension, optionally fused with the residual add before it.

    ``s`` is formed as in :func:`layer_norm`; with ``r = rsqrt(mean(s.float()**2) + eps)``:

    * ``cast="llama"`` (HF ``LlamaRMSNorm``, Mistral, Qwen2/3):
      ``y = (weight + weight_offset) * (s.float() * r).to(s.dtype)``, the product in the promoted
      dtype of weight and s, then rounded to ``x.dtype``.
    * ``cast="gemma"``: ``y = (s.float() * r * (weight_offset + weight.float())).to(x.dtype)``
      (Gemma uses ``weight_offset=1.0``).

    Returns ``y``, ``(y, s)``, ``(y, y2)`` or ``(y, y2, s)`` as :func:`layer_norm` does.
    """
    norm_type = _RMS_CASTS.get(cast)
    if norm_type is None:
        raise ValueError(f"torchfuse.rms_norm: cast must be 'llama' or 'gemma', got {cast!r}")
    return _norm(x, residual, residual2, weight, None, weight2, None, eps, norm_type, weight_offset, residual_dtype)


def _norm(x, residual, residual2, weight, bias, weight2, bias2, eps, norm_type, weight_offset, residual_dtype):
    count("norm_fwd")
    # Statistics are saved only when a backward can follow: inference allocates y (and s) alone.
    save_stats = torch.is_grad_enabled() and (
        x.requires_grad
        or (residual is not None and residual.requires_grad)
        or (residual2 is not None and residual2.requires_grad)
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
        or (weight2 is not None and weight2.requires_grad)
        or (bias2 is not None and bias2.requires_grad)
    )
    if not save_stats and residual2 is None and weight2 is None and residual_dtype is None:
        # the inference op: same kernel, no Python autograd layer, fewer arguments (decode latency)
        y, s = _infer(x, residual, weight, bias, eps, norm_type, weight_offset)
        return y if residual is None else (y, s)
    # training: the op's autograd is in C++ (csrc/norm_autograd.cpp)
    y, y2, s, _, _ = _fwd(x, residual, residual2, weight, bias, weight2, bias2, eps, norm_type, weight_offset,
                          residual_dtype, save_stats)
    if weight2 is None:
        return y if residual is None else (y, s)
    return (y, y2) if residual is None else (y, y2, s)


# ---- fake (meta) kernels: shapes and dtypes only, for torch.compile and meta tensors ----


@torch.library.register_fake("torchfuse::norm_fwd")
def _norm_fwd_fake(x, residual, residual2, weight, bias, weight2, bias2, eps, norm_type, weight_offset,
                   residual_dtype, save_stats):
    torch._check(x.dim() >= 1 and x.shape[-1] >= 1, lambda: "torchfuse.norm: x needs a non-empty last dimension")
    rows = x.numel() // x.shape[-1]
    none = x.new_empty(0, dtype=torch.float32)
    y = x.new_empty(x.shape)
    y2 = x.new_empty(x.shape) if weight2 is not None else none
    s_dtype = residual_dtype if residual_dtype is not None else (residual.dtype if residual is not None else x.dtype)
    s = x.new_empty(x.shape, dtype=s_dtype) if residual is not None else x.new_empty(0, dtype=torch.float32)
    mean = x.new_empty(rows, dtype=torch.float32) if save_stats and norm_type == LAYER_NORM else none.clone()
    rstd = x.new_empty(rows, dtype=torch.float32) if save_stats else none.clone()
    return y, y2, s, mean, rstd


@torch.library.register_fake("torchfuse::add_norm")
def _add_norm_fake(x, residual, weight, bias, eps, norm_type, weight_offset):
    y, _, s, _, _ = _norm_fwd_fake(x, residual, None, weight, bias, None, None, eps, norm_type, weight_offset, None,
                                   False)
    return y, s


@torch.library.register_fake("torchfuse::layer_norm_with_ones")
def _layer_norm_with_ones_fake(x, weight, bias, eps, save_stats):
    torch._check(x.dim() == 2 and x.shape[1] >= 1, lambda: "torchfuse.layer_norm_with_ones: x must be 2-D")
    rows, cols = x.shape
    stat = (lambda: x.new_empty(rows, dtype=torch.float32)) if save_stats else (
        lambda: x.new_empty(0, dtype=torch.float32))
    return x.new_empty((rows, (cols + 8) // 8 * 8)), stat(), stat()


@torch.library.register_fake("torchfuse::norm_bwd")
def _norm_bwd_fake(dy, dy2, ds, s, mean, rstd, weight, weight2, norm_type, weight_offset, has_bias, has_bias2,
                   x_dtype, residual_dtype, residual2_dtype, weight_grad):
    def none():
        return s.new_empty(0, dtype=torch.float32)

    def param(want):
        return s.new_empty(s.shape[-1], dtype=weight.dtype) if want else none()

    layer = norm_type == LAYER_NORM
    dx = s.new_empty(s.shape, dtype=x_dtype)
    dres = s.new_empty(s.shape, dtype=residual_dtype) if residual_dtype is not None else none()
    dres2 = s.new_empty(s.shape, dtype=residual2_dtype) if residual2_dtype is not None else none()
    has_w, has_w2 = weight is not None, weight2 is not None
    return (dx, dres, dres2, param(weight_grad and has_w), param(weight_grad and has_bias and layer and has_w),
            param(weight_grad and has_w2), param(weight_grad and has_bias2 and layer and has_w2))
