"""Residual add + LayerNorm / RMSNorm, forward and backward, against torchfuse.reference."""
import torch

import torchfuse
from torchfuse import reference

from ._common import bench_row, close

FAMILY = "norm"


def _cases():
    # (name, torchfuse op, reference, takes a bias)
    return [
        ("add+layer_norm", lambda x, r, w, b: torchfuse.layer_norm(x, w, b, residual=r),
         lambda x, r, w, b: reference.add_layer_norm(x, r, w, b), True),
        ("add+rms_norm", lambda x, r, w, b: torchfuse.rms_norm(x, w, residual=r),
         lambda x, r, w, b: reference.add_rms_norm(x, r, w), False),
    ]


def checks(ctx):
    dt, dev = ctx.dtype, ctx.device
    rows, n = 257, 1000  # a ragged row count and a width that is not a power of two
    x = torch.randn(rows, n, device=dev, dtype=dt)
    r = torch.randn(rows, n, device=dev, dtype=dt)
    w = torch.rand(n, device=dev, dtype=dt) + 0.5
    b = torch.randn(n, device=dev, dtype=dt)
    gy, gs = torch.randn(rows, n, device=dev), torch.randn(rows, n, device=dev)
    out = []
    for name, ours, ref, has_bias in _cases():
        ins = {}
        for kind, cast in (("ours", dt), ("lp", dt), ("ref", torch.float64)):
            ins[kind] = [t.detach().to(cast).requires_grad_() for t in (x, r, w, b)]
        res = {"ours": ours(*ins["ours"]), "lp": ref(*ins["lp"]), "ref": ref(*ins["ref"])}
        for i, what in enumerate(("y", "x + residual")):
            out.append(close(f"{name} {what}", res["ours"][i], res["ref"][i], res["lp"][i], 2.0, dt))
        leaves = slice(0, 4 if has_bias else 3)
        grads = {}
        for kind, (y, s) in res.items():
            loss = (y * gy.to(y.dtype)).sum() + (s * gs.to(s.dtype)).sum()
            grads[kind] = torch.autograd.grad(loss, ins[kind][leaves])
        for i, what in enumerate(("dx", "dresidual", "dweight", "dbias")[leaves]):
            out.append(close(f"{name} backward {what}", grads["ours"][i], grads["ref"][i], grads["lp"][i], 5.0, dt))
    return out


def _peer():
    """Liger-Kernel's fused add + RMSNorm, when installed."""
    try:
        from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm
        return "Liger", LigerFusedAddRMSNorm
    except Exception:
        return None, None


def bench(ctx):
    if ctx.device == "cuda":
        shape, dt = ((8192, 4096) if ctx.quick else (32768, 4096)), torch.bfloat16
    else:
        shape, dt = (512, 1024), torch.float32
    x, r = torch.randn(shape, device=ctx.device, dtype=dt), torch.randn(shape, device=ctx.device, dtype=dt)
    w = torch.rand(shape[-1], device=ctx.device, dtype=dt) + 0.5
    peer_name, peer_cls = _peer()
    peer = None
    if peer_cls is not None and ctx.device == "cuda":
        mod = peer_cls(shape[-1], eps=1e-6).to(ctx.device, dt)
        peer = lambda: mod(x, r)  # noqa: E731
    nbytes = 4 * x.numel() * x.element_size()  # read x, residual; write y, x + residual
    with torch.no_grad():
        return bench_row(ctx, FAMILY, "add+rms_norm", shape, dt, lambda: torchfuse.rms_norm(x, w, residual=r),
                         lambda: reference.add_rms_norm(x, r, w), peer, peer_name or "", nbytes=nbytes)
