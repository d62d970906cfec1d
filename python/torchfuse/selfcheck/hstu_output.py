"""hstu_compute_output (LayerNorm, [u, attn, y], SiLU, dropout with a fixed seed), forward and attn's
gradient, against torchfuse.reference with the op's own mask."""
import torch

import torchfuse
from torchfuse import reference
from torchfuse.hstu_output import _dropout_mask

from ._common import close


def checks(ctx):
    dev, dt = ctx.device, ctx.dtype
    L, H, D, E, p = 300, 2, 48, 64, 0.1
    kw = dict(num_heads=H, linear_dim=D, dropout_ratio=p, training=True, concat_u=True, concat_x=True,
              mul_u_activation_type="silu", group_norm=False)
    t = [torch.randn(L, H * D), torch.randn(L, H * D), torch.randn(L, E), torch.rand(H * D) + 0.5,
         torch.randn(H * D) * 0.1, torch.randn(3 * H * D, E) / (3 * H * D) ** 0.5]
    mask = _dropout_mask(L, H * D, 3, p, seed=5, device=dev)
    leaves = {kind: [x.to(dev, cast).requires_grad_() for x in t]
              for kind, cast in (("ours", dt), ("lp", dt), ("ref", torch.float64))}
    res = {"ours": torchfuse.hstu_compute_output(*leaves["ours"][:5], 1e-5, leaves["ours"][5], seed=5, **kw)}
    for kind in ("lp", "ref"):
        res[kind] = reference.hstu_compute_output(*leaves[kind][:5], 1e-5, leaves[kind][5], dropout_mask=mask, **kw)
    what = "hstu_compute_output (LayerNorm, [u, attn, y], dropout 0.1)"
    out = [close(what, res["ours"], res["ref"], res["lp"], 2.0, dt)]
    dout = torch.randn_like(res["ref"])
    grads = {kind: torch.autograd.grad(res[kind], leaves[kind][0], dout.to(res[kind].dtype))[0] for kind in res}
    out.append(close("hstu_compute_output backward dattn", grads["ours"], grads["ref"], grads["lp"], 4.0, dt))
    return out
