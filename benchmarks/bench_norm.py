"""Fused residual add + LayerNorm / RMSNorm, and the plain norms, against eager PyTorch, torch.compile and
Liger-Kernel (when importable), on one GPU.

Large shapes (bf16): kernel time, GB/s over the fewest bytes the op must move, % of the copy bandwidth
measured in the same run. Decode shapes: wall time per call of back-to-back calls (the host's cost),
against eager's add + norm and eager's plain add.

    python benchmarks/bench_norm.py [--quick] [--peers DIR] [--out results.md]

DIR: a folder the liger_kernel package imports from (e.g. Liger-Kernel's wheel unzipped).
"""
import sys

import torch

import torchfuse
from torchfuse import reference

import _common as C

LARGE = [(32768, 4096), (65536, 1024), (16384, 8192)]
DECODE = [((1, 2560), torch.float16), ((8, 4096), torch.bfloat16)]
EPS = 1e-6


def liger_modules(hidden, dtype, path=None):
    """Liger-Kernel's norms at this width: {"rms", "layer", "add+rms"} -> module, those that import
    (from `path` first when given: a folder holding the liger_kernel package)."""
    out = {}
    for key, mod, cls in (("rms", "liger_kernel.transformers.rms_norm", "LigerRMSNorm"),
                          ("layer", "liger_kernel.transformers.layer_norm", "LigerLayerNorm"),
                          ("add+rms", "liger_kernel.transformers.fused_add_rms_norm", "LigerFusedAddRMSNorm")):
        m = C.import_peer(mod, path)
        if m is not None and hasattr(m, cls):
            out[key] = getattr(m, cls)(hidden, eps=EPS).to("cuda", dtype)
    return out


def rms_norm_eager(x, w):
    """HF LlamaRMSNorm without a residual."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def impls(kind, residual, x, r, w, b, liger):
    """name -> fn() returning the outputs that feed later layers (y, and s with a residual)."""
    if kind == "layer":
        ours = (lambda: torchfuse.layer_norm(x, w, b, eps=EPS, residual=r)) if residual else \
            (lambda: torchfuse.layer_norm(x, w, b, eps=EPS))
        plain = (lambda x_, r_: reference.add_layer_norm(x_, r_, w, b, EPS)) if residual else \
            (lambda x_, r_: torch.nn.functional.layer_norm(x_, (x_.shape[-1],), w, b, EPS))
    else:
        ours = (lambda: torchfuse.rms_norm(x, w, eps=EPS, residual=r)) if residual else \
            (lambda: torchfuse.rms_norm(x, w, eps=EPS))
        plain = (lambda x_, r_: reference.add_rms_norm(x_, r_, w, EPS)) if residual else \
            (lambda x_, r_: rms_norm_eager(x_, w))
    fns = {"torchfuse": ours, "eager": lambda: plain(x, r)}
    if residual:  # the plain norms' peer is Liger; compile's graphs cost the run a minute
        torch._dynamo.reset()  # a fresh compile: past the recompile limit a shape silently runs eager
        compiled = C.compile_fn(plain)
        fns["torch.compile"] = lambda: compiled(x, r)
    key = ("add+" if residual else "") + kind
    if key in liger:
        mod = liger[key]
        fns["Liger"] = (lambda: mod(x, r)) if residual else (lambda: mod(x))
    return fns


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def bench_large(kind, residual, shape, copy_gbs, quick, rows, peers_seen, peer_path=None):
    dtype = torch.bfloat16
    x = torch.randn(shape, device="cuda", dtype=dtype)
    r = torch.randn(shape, device="cuda", dtype=dtype) if residual else None
    w = torch.randn(shape[-1], device="cuda", dtype=dtype)
    b = torch.randn(shape[-1], device="cuda", dtype=dtype) if kind == "layer" else None
    liger = liger_modules(shape[-1], dtype, peer_path)
    peers_seen.update(liger and {"Liger-Kernel"} or set())
    fns = impls(kind, residual, x, r, w, b, liger)
    elem = x.numel() * x.element_size()
    name = ("add + " if residual else "") + ("LayerNorm" if kind == "layer" else "RMSNorm")
    # forward: read x (and r), write y (and s); forward + backward adds reading dy (ds) and the saved
    # input, writing dx (dr is dx)
    fwd_bytes = (4 if residual else 2) * elem
    bwd_bytes = fwd_bytes + (4 if residual else 3) * elem
    t = {}
    with torch.no_grad():
        for n, f in fns.items():
            t[n] = C.bench_us(f, quick)
    rows.append(row(f"{name} fwd", shape, t, fwd_bytes, copy_gbs))

    leaves = [v for v in (x, r, w, b) if v is not None]
    for v in leaves:
        v.requires_grad_(True)
    t = {}
    for n, f in fns.items():
        outs = as_tuple(f())
        grads = [torch.randn_like(o) for o in outs]
        params = [p for p in liger[("add+" if residual else "") + kind].parameters()] if n == "Liger" else []
        ins = leaves if n != "Liger" else [v for v in (x, r) if v is not None] + params

        def step(f=f, grads=grads, ins=ins):
            return torch.autograd.grad(as_tuple(f()), ins, grads)

        t[n] = C.bench_us(step, quick)
    for v in leaves:
        v.requires_grad_(False)
    rows.append(row(f"{name} fwd+bwd", shape, t, bwd_bytes, copy_gbs))


def row(op, shape, t, nbytes, copy_gbs):
    ours = t["torchfuse"]
    gbs = nbytes / (ours * 1e-6) / 1e9
    return [op, f"{shape[0]}x{shape[1]}", C.fmt(ours), C.fmt(t.get("eager")), C.fmt(t.get("torch.compile")),
            C.fmt(t.get("Liger")), f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%", C.ratio(t.get("eager"), ours),
            C.ratio(t.get("torch.compile"), ours), C.ratio(t.get("Liger"), ours)]


def bench_decode(kind, shape, dtype, rows):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(shape[-1], device="cuda", dtype=dtype)
    b = torch.randn_like(w) if kind == "layer" else None
    fns = impls(kind, True, x, r, w, b, {})
    name = "add + " + ("LayerNorm" if kind == "layer" else "RMSNorm")
    with torch.no_grad():
        t = C.wall_us([fns["torchfuse"], fns["eager"], fns["torch.compile"], lambda: x + r])
    rows.append([f"{name} fwd", f"{shape[0]}x{shape[1]} {str(dtype)[6:]}"] + [C.fmt(v) for v in t]
                + [C.ratio(t[1], t[0]), C.ratio(t[2], t[0])])
    # a training step's call at this size: forward + backward through autograd
    for v in (x, w) + ((b,) if b is not None else ()):
        v.requires_grad_(True)
    leaves = [v for v in (x, w, b) if v is not None]

    def fb(f):
        return lambda: torch.autograd.backward([o.float().sum() for o in as_tuple(f())], inputs=leaves)

    t = C.wall_us([fb(fns["torchfuse"]), fb(fns["eager"]), fb(fns["torch.compile"])])
    rows.append([f"{name} fwd+bwd", f"{shape[0]}x{shape[1]} {str(dtype)[6:]}"] + [C.fmt(v) for v in t]
                + ["-", C.ratio(t[1], t[0]), C.ratio(t[2], t[0])])


def run(args):
    rep = C.Report("norm", "Fused residual add + LayerNorm / RMSNorm")
    copy_gbs = C.copy_bandwidth_gbs(args.quick)
    rep.roofline = f"device-to-device copy {copy_gbs:.0f} GB/s (read + write), measured in this run"
    peers = set()
    large = []
    for shape in LARGE[:1] if args.quick else LARGE:
        for kind in ("layer", "rms"):
            for residual in (True, False):
                bench_large(kind, residual, shape, copy_gbs, args.quick, large, peers, args.peers)
                torch.cuda.empty_cache()
    decode = []
    for shape, dt in DECODE:
        for kind in ("layer", "rms"):
            bench_decode(kind, shape, dt, decode)
    rep.peers = ["eager PyTorch", "torch.compile"] + sorted(peers)
    rep.table("Large shapes, bf16: kernel time in us; GB/s over the fewest bytes the op moves; x = their time / ours.",
              ["op", "shape", "torchfuse us", "eager us", "compile us", "Liger us", "torchfuse GB/s", "% of copy",
               "vs eager", "vs compile", "vs Liger"], large)
    rep.table("Decode shapes: wall time per call of back-to-back calls in us (host dispatch + launch).",
              ["op", "shape", "torchfuse", "eager", "compile", "eager plain add", "vs eager", "vs compile"], decode)
    return rep


if __name__ == "__main__":
    sys.exit(C.standalone("norm", run, doc=__doc__))
