"""The HSTU layer's input section: LayerNorm, one GEMM with bias, SiLU on u, and the split into the
attention's q, k, v. Composed of torchfuse's norm op and ATen's addmm (cuBLAS, bias in its epilogue),
with its own autograd so that the ``recompute_*`` choices decide what the backward keeps. Without
autograd, a serving step's few rows (at most 8, CUDA) take ``skinny_linear``: the norm, the GEMM and
the bias in one kernel.
"""
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.torchfuse)
from ._stats import count
from .norm import LAYER_NORM
from .skinny_linear import applies as skinny_applies

_norm_fwd = torch.ops.torchfuse.norm_fwd.default
_norm_infer = torch.ops.torchfuse.add_norm.default
_norm_bwd = torch.ops.torchfuse.norm_bwd.default
_norm_ones = torch.ops.torchfuse.layer_norm_with_ones.default
_skinny = torch.ops.torchfuse.skinny_linear.default

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def hstu_preprocess(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    eps: float,
    uvqk_weight: Tensor,
    uvqk_bias: Tensor,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    *,
    recompute_normed_x: bool = False,
    recompute_uvqk: bool = False,
    silu_u: bool = True,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """generative-recommenders' ``hstu_compute_uqvk``: with ``H = num_heads``,
    ``u, v, q, k = split(LayerNorm(x) @ uvqk_weight + uvqk_bias, [H*hidden_dim, H*hidden_dim,
    H*attn_dim, H*attn_dim])`` and ``u = SiLU(u)``.

    Args:
        x: (L, E) float32, bfloat16 or float16; L may be 0.
        norm_weight, norm_bias: (E,), the input LayerNorm's affine parameters; ``eps`` > 0.
        uvqk_weight: (E, N) with N = 2 * H * (hidden_dim + attn_dim); uvqk_bias: (N,).
            All parameters in x's dtype (GR's layer casts them with ``.to(x.dtype)``).
        recompute_normed_x: the backward recomputes LayerNorm(x) from x and the saved row statistics
            instead of keeping the normalized rows (L x E less memory, one more norm pass).
        recompute_uvqk: the backward recomputes u's pre-activation (a GEMM over u's columns only)
            instead of keeping it.
        silu_u: False returns u before its SiLU, a view like q, k, v (no pass over u's columns), for an
            output op that applies the SiLU as it reads u (``hstu_compute_output(..., silu_u=True)``).

    Returns:
        ``(u, q, k, v)``: u (L, H * hidden_dim) contiguous (with ``silu_u``); q, k (L, H, attn_dim) and v
        (L, H, hidden_dim) are views into the GEMM's output (no copies), the layout
        :func:`torchfuse.hstu_attention` reads (it copies only rows whose strides are not 16-byte
        aligned). Differentiable in x and the four parameters. Under autocast every input is cast to
        autocast's dtype first (the section runs in it).
    """
    return _preprocess(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, attn_dim, hidden_dim,
                       recompute_normed_x, recompute_uvqk, silu_u, False)


def hstu_preprocess_with_residual(x: Tensor, norm_weight: Tensor, norm_bias: Tensor, eps: float, uvqk_weight: Tensor,
                                  uvqk_bias: Tensor, num_heads: int, attn_dim: int, hidden_dim: int, *,
                                  recompute_normed_x: bool = False, recompute_uvqk: bool = False,
                                  silu_u: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``hstu_preprocess`` and x itself, for the layer's residual (``out = x + y @ W``): training, the
    residual's gradient then comes back to this op's backward and is added to x's inside the LayerNorm's
    backward kernel, where autograd would otherwise add x's two gradients in a kernel of its own."""
    return _preprocess(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, attn_dim, hidden_dim,
                       recompute_normed_x, recompute_uvqk, silu_u, True)


def _preprocess(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, attn_dim, hidden_dim,
                recompute_normed_x, recompute_uvqk, silu_u, with_x):
    """(u, q, k, v), and x last when ``with_x`` (through the autograd Function when it records, so that the
    residual's gradient reaches its backward)."""
    if isinstance(x, Tensor) and x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type):
        # the whole section in autocast's dtype (as its GEMM would be), the backward in the same dtypes
        dt = torch.get_autocast_dtype(x.device.type)
        cast = [t.to(dt) if isinstance(t, Tensor) and t.is_floating_point() else t
                for t in (x, norm_weight, norm_bias, uvqk_weight, uvqk_bias)]
        with torch.autocast(x.device.type, enabled=False):
            out = _preprocess(cast[0], cast[1], cast[2], eps, cast[3], cast[4], num_heads, attn_dim, hidden_dim,
                              recompute_normed_x, recompute_uvqk, silu_u, False)
        return (*out, x) if with_x else out
    count("hstu_preprocess")
    _check(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, attn_dim, hidden_dim)
    args = (x, norm_weight, norm_bias, float(eps), uvqk_weight, uvqk_bias, int(num_heads), int(attn_dim),
            int(hidden_dim), bool(recompute_normed_x), bool(recompute_uvqk), bool(silu_u))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, norm_weight, norm_bias, uvqk_weight, uvqk_bias)):
        return _HSTUPreprocess.apply(*args, bool(with_x))
    if skinny_applies(x):  # a serving step's few rows: norm, GEMM and bias in one kernel
        count("skinny_linear")
        uvqk = _skinny(x, uvqk_weight, uvqk_bias, None, norm_weight, norm_bias, float(eps))
    else:
        normed, _ = _norm_infer(x, None, norm_weight, norm_bias, float(eps), LAYER_NORM, 0.0)
        uvqk = torch.addmm(uvqk_bias, normed, uvqk_weight)
    out = _split(uvqk, num_heads, attn_dim, hidden_dim, silu=bool(silu_u))
    return (*out, x) if with_x else out


def _check(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, H, Da, Dh) -> None:
    def fail(exc, msg):
        raise exc(f"torchfuse.hstu_preprocess: {msg}")

    for name, val in (("num_heads", H), ("attn_dim", Da), ("hidden_dim", Dh)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            fail(ValueError, f"{name} must be an int >= 1, got {val!r}")
    named = (("x", x), ("norm_weight", norm_weight), ("norm_bias", norm_bias), ("uvqk_weight", uvqk_weight),
             ("uvqk_bias", uvqk_bias))
    for name, t in named:
        if not isinstance(t, Tensor):
            fail(TypeError, f"{name} must be a Tensor, got {type(t).__name__}")
    if x.dtype not in _FLOATS:
        fail(TypeError, f"x must be float32, bfloat16 or float16, got {x.dtype}")
    for name, t in named[1:]:
        if t.dtype != x.dtype:
            fail(TypeError, f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
        if t.device != x.device:
            fail(RuntimeError, f"{name} must be on x's device {x.device}, got {t.device}")
    if x.dim() != 2:
        fail(ValueError, f"x must be 2-D (L, E), got shape {tuple(x.shape)}")
    E, N = x.shape[1], 2 * H * (Dh + Da)
    if E < 1:
        fail(ValueError, f"x must have at least one column, got shape {tuple(x.shape)}")
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if tuple(t.shape) != (E,):
            fail(ValueError, f"{name} must be ({E},) for x of shape {tuple(x.shape)}, got {tuple(t.shape)}")
    if tuple(uvqk_weight.shape) != (E, N):
        fail(ValueError, f"uvqk_weight must be (E, 2 * num_heads * (hidden_dim + attn_dim)) = ({E}, {N}), "
                         f"got {tuple(uvqk_weight.shape)}")
    if tuple(uvqk_bias.shape) != (N,):
        fail(ValueError, f"uvqk_bias must be ({N},), got {tuple(uvqk_bias.shape)}")
    if not (isinstance(eps, (int, float)) and 0 < eps < float("inf")):
        fail(ValueError, f"eps must be a positive finite number, got {eps!r}")


def _split(uvqk: Tensor, H: int, Da: int, Dh: int, silu: bool):
    u, v, q, k = torch.split(uvqk, [Dh * H, Dh * H, Da * H, Da * H], dim=1)
    return (F.silu(u) if silu else u), q.view(-1, H, Da), k.view(-1, H, Da), v.view(-1, H, Dh)


def _flat(g: Tensor, like_cols: int, rows: int, ref: Tensor) -> Tensor:
    return ref.new_zeros(rows, like_cols) if g is None else g.reshape(rows, like_cols)


def _joined(dq, dk, dv, L: int, H: int, Da: int, Dh: int, ref: Tensor):
    """The GEMM output's gradient as one (L, N) tensor when dv, dq, dk are views of one buffer laid out as
    v, q, k lie in the GEMM's output (hstu_attention's backward lays its gradients out like its inputs),
    u's columns free for du; None otherwise (and while tracing)."""
    ts = (dv, dq, dk)
    if torch.compiler.is_compiling() or any(type(t) is not Tensor for t in ts) or L < 2:
        return None
    n = 2 * H * (Dh + Da)
    storage = dv.untyped_storage()
    if storage.nbytes() != L * n * ref.element_size():
        return None
    for t, off, d in ((dv, H * Dh, Dh), (dq, 2 * H * Dh, Da), (dk, 2 * H * Dh + H * Da, Da)):
        if (t.untyped_storage().data_ptr() != storage.data_ptr() or t.dtype != ref.dtype or
                t.shape != (L, H, d) or t.stride() != (n, d, 1) or t.storage_offset() != off):
            return None
    return dv.as_strided((L, n), (n, 1), 0)


def _copy_cols(dst: Tensor, src: Tensor) -> None:
    """dst.copy_(src) for a 2-D dst whose rows are strided (a column block of a wider buffer), moved as
    8-byte words where both layouts allow: ATen's copy into a strided destination moves an element per
    load, which for 2-byte elements runs far below the copy bandwidth."""
    if (src.dtype == dst.dtype and src.element_size() == 2 and src.is_contiguous() and dst.stride(1) == 1
            and dst.shape[1] % 4 == 0 and dst.stride(0) % 4 == 0 and dst.storage_offset() % 4 == 0
            and src.storage_offset() % 4 == 0 and dst.data_ptr() % 8 == 0 and src.data_ptr() % 8 == 0):
        dst.view(torch.int64).copy_(src.view(torch.int64))
    else:
        dst.copy_(src)


class _HSTUPreprocess(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, H, Da, Dh, recompute_normed_x,
                recompute_uvqk, silu_u, alias_x=False):
        # with both GEMM parameters trained, the norm writes [LN(x), 1] rows: the backward's one GEMM
        # [LN(x), 1]^T @ d_uvqk then gives the bias gradient with the weight's (no column-sum pass)
        ones = ctx.needs_input_grad[4] and ctx.needs_input_grad[5]
        if ones:
            normed_ones, mean, rstd = _norm_ones(x, norm_weight, norm_bias, eps, True)
            normed = normed_ones[:, :x.shape[1]]
        else:
            normed, _, _, mean, rstd = _norm_fwd(x, None, None, norm_weight, norm_bias, None, None, eps,
                                                 LAYER_NORM, 0.0, None, True)
        uvqk = torch.addmm(uvqk_bias, normed, uvqk_weight)
        u_pre, q, k, v = _split(uvqk, H, Da, Dh, silu=False)
        u = F.silu(u_pre) if silu_u else u_pre
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, uvqk_weight, uvqk_bias,
                              None if recompute_normed_x else (normed_ones if ones else normed),
                              None if recompute_uvqk or not silu_u else u_pre)
        ctx.eps, ctx.dims, ctx.silu_u, ctx.ones = eps, (H, Da, Dh), silu_u, ones
        # alias_x: x again, as the layer's residual: its gradient comes back here and joins the norm's
        # backward in one kernel (norm_bwd's ds) instead of autograd adding x's two gradients
        return (u, q, k, v, x.view_as(x)) if alias_x else (u, q, k, v)

    @staticmethod
    def backward(ctx, du, dq, dk, dv, dres=None):
        x, mean, rstd, norm_weight, norm_bias, uvqk_weight, uvqk_bias, normed, u_pre = ctx.saved_tensors
        H, Da, Dh = ctx.dims
        need = ctx.needs_input_grad
        L = x.shape[0]
        need_dw = need[4] or need[5]
        if normed is None and (need_dw or (ctx.silu_u and u_pre is None and du is not None)):
            normed = (_norm_ones(x, norm_weight, norm_bias, ctx.eps, False)[0] if ctx.ones else
                      _norm_infer(x, None, norm_weight, norm_bias, ctx.eps, LAYER_NORM, 0.0)[0])
        normed_ones, normed = (normed, normed[:, :x.shape[1]]) if ctx.ones and normed is not None else (None, normed)
        if du is None:
            du_pre = None
        elif not ctx.silu_u:
            du_pre = du
        else:
            if u_pre is None:  # only u's columns of the GEMM: the others are not needed here
                u_pre = torch.addmm(uvqk_bias[:H * Dh], normed, uvqk_weight[:, :H * Dh])
            du_pre = torch.ops.aten.silu_backward(du, u_pre)
        # the GEMM output's gradient in its column order: u, v, q, k
        d_uvqk = _joined(dq, dk, dv, L, H, Da, Dh, x)
        if d_uvqk is not None:  # v, q, k's already in place: du into u's columns
            if du_pre is None:
                d_uvqk[:, :H * Dh].zero_()
            else:
                _copy_cols(d_uvqk[:, :H * Dh], du_pre)
        else:
            d_uvqk = torch.cat([_flat(du_pre, H * Dh, L, x), _flat(dv, H * Dh, L, x), _flat(dq, H * Da, L, x),
                                _flat(dk, H * Da, L, x)], dim=1)
        if normed_ones is not None:  # [dW; db] in one GEMM
            dwb = normed_ones.t().mm(d_uvqk)
            d_w, d_b = dwb[:x.shape[1]], dwb[x.shape[1]]
        else:
            d_w = normed.t().mm(d_uvqk) if need[4] else None
            d_b = d_uvqk.sum(0) if need[5] else None
        dx = dnw = dnb = None
        if need[0] or need[1] or need[2]:
            d_normed = d_uvqk.mm(uvqk_weight.t())
            dx, _, _, dnw, dnb, _, _ = _norm_bwd(d_normed, None, dres, x, mean, rstd, norm_weight, None, LAYER_NORM,
                                                 0.0, True, False, x.dtype, None, None, need[1] or need[2])
        return (dx if need[0] else None, dnw if need[1] else None, dnb if need[2] else None, None,
                d_w, d_b, None, None, None, None, None, None, None)
