"""HSTU attention, forward and backward with targets, context and a window (max_attn_len), and the
cached form, against torchfuse.reference's port of generative-recommenders' mask and formula."""
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse import reference

from . import hstu_output
from ._common import bench_row, close

FAMILY = "hstu"


def _inputs(dev, dt, B, H, D, max_len):
    lens = torch.randint(0, max_len + 1, (B,))
    lens[0], lens[1], lens[2] = max_len, 0, 1
    off = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(dev, torch.int32)
    L = int(off[-1])
    q, k, v = (torch.randn(L, H, D, device=dev, dtype=dt) for _ in range(3))
    nt = torch.tensor([int(torch.randint(0, n + 1, ())) if n else 0 for n in lens.tolist()], device=dev,
                      dtype=off.dtype)
    return q, k, v, off, nt


def checks(ctx):
    dev, dt = ctx.device, ctx.dtype
    B, H, D, max_len = 6, 2, 64, 90
    q, k, v, off, nt = _inputs(dev, dt, B, H, D, max_len)
    alpha = 1.0 / D ** 0.5
    kw = dict(num_targets=nt, max_attn_len=23, contextual_seq_len=3)
    what = "hstu_attention (targets, window 23, context 3)"
    leaves = {kind: [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
              for kind, cast in (("ours", dt), ("lp", dt), ("ref", torch.float64))}
    res = {"ours": torchfuse.hstu_attention(*leaves["ours"], off, max_len, alpha, **kw)}
    for kind in ("lp", "ref"):
        res[kind] = reference.hstu_attention(*leaves[kind], off, max_len, alpha, **kw)
    out = [close(what, res["ours"], res["ref"], res["lp"], 2.0, dt)]
    dout = torch.randn_like(res["ref"])
    grads = {kind: torch.autograd.grad(res[kind], leaves[kind], dout.to(res[kind].dtype)) for kind in res}
    for i, name in enumerate(("dq", "dk", "dv")):
        out.append(close(f"hstu_attention backward {name}", grads["ours"][i], grads["ref"][i], grads["lp"][i], 5.0, dt))

    Dq = 4  # the last 4 positions of each sequence (some sequences are shorter)
    dq = torch.randn(B * Dq, H, D, device=dev, dtype=dt)
    kw = dict(num_targets=nt, max_attn_len=23)
    got = torchfuse.hstu_attention_cached(dq, k, v, off, max_len, alpha, **kw)
    ref = reference.hstu_attention_cached(dq.double(), k.double(), v.double(), off, max_len, alpha, **kw)
    lp = reference.hstu_attention_cached(dq, k, v, off, max_len, alpha, **kw)
    out.append(close("hstu_attention_cached (last 4 rows)", got, ref, lp, 2.0, dt))
    return out + hstu_output.checks(ctx)


def _eager(q, k, v, idx, mask, B, N, alpha):
    """generative-recommenders' pytorch_hstu_mha: jagged -> padded, dense attention, -> jagged."""
    H = q.shape[1]

    def pad(x):
        o = x.new_zeros(B * N, H, x.shape[-1])
        o[idx] = x
        return o.view(B, N, H, -1).transpose(1, 2)

    p = F.silu(alpha * (pad(q) @ pad(k).transpose(-1, -2))) / N * mask
    return (p @ pad(v)).transpose(1, 2).reshape(B * N, H, -1)[idx]


def _peer():
    try:
        import generative_recommenders.common as grc
        from generative_recommenders.ops.triton.triton_hstu_attention import triton_hstu_mha
        grc.set_use_runtime_max_seq_len(True)
        return triton_hstu_mha
    except Exception:
        return None


def bench(ctx):
    dev = ctx.device
    if dev == "cuda":
        (B, N, D), H, dt = ((8, 1024, 128) if ctx.quick else (16, 4096, 128)), 4, torch.bfloat16
    else:
        (B, N, D), H, dt = (4, 128, 64), 2, torch.float32
    lens = torch.full((B,), N)
    off = torch.arange(0, (B + 1) * N, N, device=dev)
    q, k, v = (torch.randn(B * N, H, D, device=dev, dtype=dt) for _ in range(3))
    alpha = 1.0 / D ** 0.5
    idx = torch.arange(B * N, device=dev)
    mask = torch.ones(N, N, dtype=torch.bool, device=dev).tril()
    flops = float(sum(2 * H * 2 * D * n * n / 2 for n in lens.tolist()))  # the causal half of QK^T and PV
    tri = _peer() if dev == "cuda" else None
    peer = (lambda: tri(N, alpha, q, k, v, off, None, 0, 0)) if tri is not None else None
    with torch.no_grad():
        return bench_row(ctx, FAMILY, "hstu_attention fwd", (B, N, H, D), dt,
                         lambda: torchfuse.hstu_attention(q, k, v, off, N, alpha, validate=False),
                         lambda: _eager(q, k, v, idx, mask, B, N, alpha), peer, "GR Triton", flops=flops)
