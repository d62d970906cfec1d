"""HSTU's output section (generative-recommenders' ``hstu_compute_output``): entry point, fake kernels,
autograd.

The norm, the multiply by u, the concatenation and the dropout are ``torch.ops.torchfuse.hstu_output_fwd``
/ ``hstu_output_bwd`` (csrc/hstu_output*.cpp, kernels/hstu_output_*): one memory-bound pass each way.
The output projection is a GEMM and goes to cuBLAS / ATen (``torch.addmm``), or, for the few rows of a
serving step without autograd (CUDA, at most 8 rows), to ``skinny_linear`` (the GEMM and the residual in
one kernel). With LayerNorm and no dropout those rows take one kernel for the whole section,
``hstu_output_skinny``: the skinny linear's kernel builds y's rows from attn and u in its prologue, so the
output op's kernel and its y buffer drop out.
"""
from typing import Optional

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.torchfuse)
from ._stats import count
from .skinny_linear import applies as skinny_applies

_fwd = torch.ops.torchfuse.hstu_output_fwd.default
_bwd = torch.ops.torchfuse.hstu_output_bwd.default
_skinny = torch.ops.torchfuse.skinny_linear.default
_fused = torch.ops.torchfuse.hstu_output_skinny.default

_ACTS = {"none": 0, "silu": 1, "sigmoid": 2}
_OP = "torchfuse.hstu_compute_output"


def hstu_compute_output(
    attn: Tensor,
    u: Tensor,
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    eps: float,
    output_weight: Tensor,
    *,
    num_heads: int,
    linear_dim: int,
    dropout_ratio: float,
    training: bool,
    concat_u: bool,
    concat_x: bool,
    mul_u_activation_type: str,
    group_norm: bool,
    silu_u: bool = False,
    recompute_y_in_backward: bool = False,
    seed: Optional[int] = None,
) -> Tensor:
    """generative-recommenders' ``pytorch_hstu_compute_output``: ``x + y @ output_weight`` with y from attn, u.

    With ``n = num_heads * linear_dim`` columns in attn and u (computed in fp32):

    * LayerNorm (``group_norm=False``): ``y = act(u) * LayerNorm(attn)`` over the row (norm_weight,
      norm_bias: (n,)), act by ``mul_u_activation_type`` ('none', 'silu', 'sigmoid'); then
      ``[u', attn, y]`` if concat_u and concat_x, ``[u', y]`` if concat_u alone, ``[attn, y]`` if concat_x
      alone, u' being ``silu(u)`` when silu_u, else u.
    * GroupNorm (``group_norm=True``): u' = ``silu(u)`` when silu_u, else u; ``y = u' * GroupNorm(attn)``
      with one group per head (norm_weight, norm_bias: (num_heads,)); ``[u', attn, y]`` when concat_u and
      concat_x both, else y alone (mul_u_activation_type is not used, as in GR).
    * Dropout (``training`` and ``dropout_ratio > 0``) over that whole concatenation, rounded to attn's
      dtype; ``out = x + y @ output_weight`` (output_weight: (parts * n, E) cast to x's dtype).

    The mask is Philox (counter-based): ``seed=None`` draws from torch's generator (CUDA-graph safe),
    an explicit seed gives the same mask on CPU and CUDA. The backward regenerates it, never stores it.
    ``recompute_y_in_backward`` saves attn and u only and recomputes y for the weight gradient.

    Args:
        attn, u: (L, n); x: (L, E); one float dtype (float32, bfloat16 or float16) for attn, u and x.

    Returns:
        (L, E) in x's dtype; differentiable in attn, u, x, norm_weight, norm_bias and output_weight.
    """
    count("hstu_output_fwd")
    groups, mul_act, cat_act, cu, cx, p = _config(attn, u, x, output_weight, num_heads, linear_dim, dropout_ratio,
                                                  training, concat_u, concat_x, mul_u_activation_type, group_norm,
                                                  silu_u)
    args = (attn, u, x, norm_weight, norm_bias, output_weight, eps, groups, mul_act, cat_act, cu, cx, p, seed,
            recompute_y_in_backward)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (attn, u, x, norm_weight, norm_bias, output_weight)):
        return _HstuComputeOutput.apply(*args)
    if skinny_applies(attn) and groups == 0 and p == 0.0:  # a serving step's few rows, y built in the GEMM's kernel
        count("hstu_output_skinny")
        return _fused(attn, u, x, norm_weight, norm_bias, float(eps), output_weight.to(x.dtype), mul_act, cat_act,
                      cu, cx)
    y = _fwd(attn, u, norm_weight, norm_bias, eps, groups, mul_act, cat_act, cu, cx, p, seed, None)[0]
    if skinny_applies(y):  # a serving step's few rows: the GEMM and the residual in one kernel
        count("skinny_linear")
        return _skinny(y, output_weight.to(x.dtype), None, x)
    return torch.addmm(x, y, output_weight.to(x.dtype))


def _config(attn, u, x, output_weight, num_heads, linear_dim, dropout_ratio, training, concat_u, concat_x,
            mul_u_activation_type, group_norm, silu_u):
    """GR's flags as the kernels' (groups, mul_act, cat_act, concat_u, concat_x, p), with the checks that
    concern the arguments the kernels never see."""
    for name, t in (("attn", attn), ("u", u), ("x", x), ("output_weight", output_weight)):
        if not isinstance(t, Tensor) or t.dim() != 2:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{_OP}: {name} must be a 2-D tensor, got {got}")
    if attn.dtype != x.dtype or u.dtype != x.dtype:
        raise TypeError(f"{_OP}: attn, u and x must share one dtype, got {attn.dtype}, {u.dtype} and {x.dtype}")
    if not 0.0 <= float(dropout_ratio) < 1.0:
        raise ValueError(f"{_OP}: dropout_ratio must be in [0, 1), got {dropout_ratio}")
    n = attn.shape[1]
    if group_norm:
        if num_heads < 1 or num_heads * linear_dim != n:
            raise ValueError(f"{_OP}: group_norm needs attn's width {n} = num_heads * linear_dim, got num_heads = "
                             f"{num_heads}, linear_dim = {linear_dim}")
        groups, mul_act = num_heads, _ACTS["silu"] if silu_u else _ACTS["none"]
        concat_u = concat_x = bool(concat_u and concat_x)
    else:
        if mul_u_activation_type not in _ACTS:
            raise ValueError(f"{_OP}: mul_u_activation_type must be 'none', 'silu' or 'sigmoid', got "
                             f"{mul_u_activation_type!r}")
        groups, mul_act = 0, _ACTS[mul_u_activation_type]
        concat_u, concat_x = bool(concat_u), bool(concat_x)
    cat_act = _ACTS["silu"] if silu_u else _ACTS["none"]
    k = n * (1 + concat_u + concat_x)
    if x.shape[0] != attn.shape[0]:
        raise ValueError(f"{_OP}: x must have attn's {attn.shape[0]} rows, got {x.shape[0]}")
    if tuple(output_weight.shape) != (k, x.shape[1]):
        raise ValueError(f"{_OP}: output_weight must be ({k}, {x.shape[1]}) (the concatenation's {k} columns by "
                         f"x's width), got {tuple(output_weight.shape)}")
    p = float(dropout_ratio) if training else 0.0
    return groups, mul_act, cat_act, concat_u, concat_x, p


class _HstuComputeOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attn, u, x, w, b, W, eps, groups, mul_act, cat_act, cu, cx, p, seed, recompute):
        y, mean, rstd, rng = _fwd(attn, u, w, b, eps, groups, mul_act, cat_act, cu, cx, p, seed, None)
        out = torch.addmm(x, y, W.to(x.dtype))
        ctx.save_for_backward(attn, u, w, b, W, mean, rstd, rng, None if recompute else y)
        ctx.opts = (eps, groups, mul_act, cat_act, cu, cx, p)
        return out

    @staticmethod
    def backward(ctx, dout):
        attn, u, w, b, W, mean, rstd, rng, y = ctx.saved_tensors
        eps, groups, mul_act, cat_act, cu, cx, p = ctx.opts
        need = ctx.needs_input_grad
        Wc = W.to(dout.dtype)
        dattn = du = dw = db = None
        if need[0] or need[1] or need[3] or need[4]:
            # recompute_y_in_backward: the backward kernel writes the forward's y again as it reads attn and u
            dy = dout @ Wc.t()
            again = y is None and need[5]
            dattn, du, dw, db, y_again = _bwd(dy, attn, u, w, b, mean, rstd, rng, groups, mul_act, cat_act, cu, cx,
                                              p, need[3] or need[4], again)
            if again:
                y = y_again
        dW = None
        if need[5]:
            if y is None:  # the forward's y, mask from its rng state
                y = _fwd(attn, u, w, b, eps, groups, mul_act, cat_act, cu, cx, p, None, rng)[0]
            dW = (y.t() @ dout).to(W.dtype)
        return (dattn if need[0] else None, du if need[1] else None, dout if need[2] else None,
                dw if need[3] else None, db if need[4] else None, dW) + (None,) * 9


def _dropout_mask(rows: int, cols: int, parts: int, dropout_ratio: float, *, seed: Optional[int] = None,
                  rng_state: Optional[Tensor] = None, device="cpu") -> Tensor:
    """The keep mask (rows, parts * cols) that hstu_output_fwd draws for this seed or rng state: the op
    run on ones with a zero norm weight and a unit bias, so every element is 1 / (1 - p) or 0. For tests."""
    ones = torch.ones(rows, cols, device=device)
    w, b = torch.zeros(cols, device=device), torch.ones(cols, device=device)
    cu, cx = parts == 3, parts >= 2
    y = _fwd(ones, ones, w, b, 1e-5, 0, 0, 0, cu, cx, dropout_ratio, seed, rng_state)[0]
    return y != 0


# ---- fake (meta) kernels: shapes and dtypes only, for torch.compile and meta tensors ----


@torch.library.register_fake("torchfuse::hstu_output_fwd")
def _hstu_output_fwd_fake(attn, u, weight, bias, eps, groups, mul_act, cat_act, concat_u, concat_x, dropout_ratio,
                          seed=None, rng_state=None):
    torch._check(attn.dim() == 2, lambda: f"{_OP}: attn must be 2-D")
    L, n = attn.shape
    y = attn.new_empty((L, n * (1 + int(concat_u) + int(concat_x))))
    mean = attn.new_empty((L, max(groups, 1)), dtype=torch.float32)
    return y, mean, torch.empty_like(mean), attn.new_empty(2, dtype=torch.int64)


@torch.library.register_fake("torchfuse::hstu_output_skinny")
def _hstu_output_skinny_fake(attn, u, x, norm_weight, norm_bias, eps, output_weight, mul_act, cat_act, concat_u,
                             concat_x):
    torch._check(attn.dim() == 2 and x.dim() == 2 and output_weight.dim() == 2,
                 lambda: f"{_OP}: attn, x and output_weight must be 2-D")
    torch._check(attn.shape[0] <= 8, lambda: f"{_OP}: attn must have at most 8 rows for the fused few-row path")
    return x.new_empty((x.shape[0], output_weight.shape[1]))


@torch.library.register_fake("torchfuse::hstu_output_bwd")
def _hstu_output_bwd_fake(dy, attn, u, weight, bias, mean, rstd, rng_state, groups, mul_act, cat_act, concat_u,
                          concat_x, dropout_ratio, weight_grad, recompute_y=False):
    none = attn.new_empty(0, dtype=torch.float32)
    dw = weight.new_empty(weight.shape) if weight_grad else none
    db = bias.new_empty(bias.shape) if weight_grad else none.clone()
    y = attn.new_empty(dy.shape) if recompute_y else none.clone()
    return attn.new_empty(attn.shape), u.new_empty(u.shape), dw, db, y


# ---- autograd of the op itself (torch.ops.torchfuse.hstu_output_fwd called directly) ----


def _setup_context(ctx, inputs, output):
    attn, u, w, b, _eps, groups, mul_act, cat_act, cu, cx, p = inputs[:11]
    _y, mean, rstd, rng = output
    ctx.mark_non_differentiable(mean, rstd, rng)
    ctx.save_for_backward(attn, u, w, b, mean, rstd, rng)
    ctx.opts = (groups, mul_act, cat_act, cu, cx, p)


def _backward(ctx, dy, _dmean, _drstd, _drng):
    attn, u, w, b, mean, rstd, rng = ctx.saved_tensors
    need = ctx.needs_input_grad
    dattn, du, dw, db, _ = _bwd(dy, attn, u, w, b, mean, rstd, rng, *ctx.opts, need[2] or need[3])
    return (dattn if need[0] else None, du if need[1] else None, dw if need[2] else None,
            db if need[3] else None) + (None,) * (len(need) - 4)


torch.library.register_autograd("torchfuse::hstu_output_fwd", _backward, setup_context=_setup_context)
