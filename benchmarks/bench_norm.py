"""Fused residual add + LayerNorm / RMSNorm against eager PyTorch and torch.compile, on one GPU.

Large shapes: median kernel time (CUDA events), GB/s over the fewest bytes the op must move, and %
of the device-to-device copy bandwidth measured in the same run. Decode shapes: wall time per call
of back-to-back calls (host dispatch + launch), against eager's add+norm and eager's plain add.

    python benchmarks/bench_norm.py [--quick] [--out results.md]
"""
import argparse
import sys

import torch

import torchfuse
from torchfuse import reference
from torchfuse._timing import device_time_us, wall_times_us

LARGE = [(32768, 4096), (65536, 1024), (16384, 8192)]
DECODE = [((1, 2560), torch.float16), ((8, 4096), torch.bfloat16)]


def copy_bandwidth():
    src = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = device_time_us(lambda: dst.copy_(src), "cuda", warmup=5, rep=20)
    return 2 * src.numel() * 2 / (t * 1e-6) / 1e9  # GB/s, bytes read + written


def fns(kind, x, r, w, b):
    """torchfuse, eager and the function torch.compile gets, each returning (y, s)."""
    if kind == "layer":
        return (lambda: torchfuse.layer_norm(x, w, b, residual=r),
                lambda: reference.add_layer_norm(x, r, w, b),
                reference.add_layer_norm, (x, r, w, b))
    return (lambda: torchfuse.rms_norm(x, w, residual=r),
            lambda: reference.add_rms_norm(x, r, w),
            reference.add_rms_norm, (x, r, w))


def setup(kind, shape, dtype):
    """Random inputs, the three functions to time, and the compiled baseline's arguments."""
    x = torch.randn(shape, device="cuda", dtype=dtype)
    r = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[-1], device="cuda", dtype=dtype)
    b = torch.randn(shape[-1], device="cuda", dtype=dtype) if kind == "layer" else None
    ours, eager, plain, args = fns(kind, x, r, w, b)
    return x, r, w, b, ours, eager, torch.compile(plain), args


def bench_large(kind, shape, dtype, copy_gbs, rows_out):
    x, r, w, b, ours, eager, compiled, args = setup(kind, shape, dtype)
    elem = x.numel() * x.element_size()
    with torch.no_grad():
        for _ in range(3):
            compiled(*args)
        t = [device_time_us(f, "cuda") for f in (ours, eager, lambda: compiled(*args))]
    fwd_bytes = 4 * elem  # read x, residual; write y, s
    rows_out.append((f"add+{kind}_norm fwd", shape, t, fwd_bytes, copy_gbs))

    # forward + backward: y and s both feed later layers, so both get gradients
    for t_ in (x, r, w) + ((b,) if b is not None else ()):
        t_.requires_grad_(True)
    inputs = [t_ for t_ in (x, r, w, b) if t_ is not None]
    gy, gs = torch.randn_like(x), torch.randn_like(x)

    def step(f):
        return lambda: torch.autograd.grad(f(), inputs, (gy, gs))

    for _ in range(3):
        step(lambda: compiled(*args))()
    t = [device_time_us(step(f), "cuda") for f in (ours, eager, lambda: compiled(*args))]
    # fwd: read x, r, write y, s; bwd: read dy, ds, s, write dx (= dresidual, same dtype)
    rows_out.append((f"add+{kind}_norm fwd+bwd", shape, t, 8 * elem, copy_gbs))


def bench_decode(kind, shape, dtype, rows_out):
    x, r, w, b, ours, eager, compiled, args = setup(kind, shape, dtype)
    with torch.no_grad():
        for _ in range(3):
            compiled(*args)
        t = wall_times_us([ours, eager, lambda: compiled(*args), lambda: x + r], "cuda")
    rows_out.append((f"add+{kind}_norm decode", shape, t, None, None))


def fmt_table(large, decode, copy_gbs, device_name):
    lines = [f"device: {device_name}; torch {torch.__version__}; copy bandwidth {copy_gbs:.0f} GB/s (read+write)",
             "",
             "| op | shape (bf16) | torchfuse us | eager us | compile us | torchfuse GB/s | % of copy | vs eager | vs compile |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, shape, (t_tf, t_e, t_c), nbytes, cbw in large:
        gbs = nbytes / (t_tf * 1e-6) / 1e9
        lines.append(f"| {name} | {shape[0]}x{shape[1]} | {t_tf:.1f} | {t_e:.1f} | {t_c:.1f} | {gbs:.0f} | "
                     f"{100 * gbs / cbw:.0f}% | {t_e / t_tf:.2f}x | {t_c / t_tf:.2f}x |")
    lines += ["", "| op | shape | torchfuse us/call | eager add+norm | compile | eager plain add | torchfuse vs plain add |",
              "|---|---|---|---|---|---|---|"]
    for name, shape, (t_tf, t_e, t_c, t_add), _, _ in decode:
        lines.append(f"| {name} | {shape[0]}x{shape[1]} | {t_tf:.1f} | {t_e:.1f} | {t_c:.1f} | {t_add:.1f} | "
                     f"{t_add / t_tf:.2f}x |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one large shape only")
    ap.add_argument("--out", help="also write the table (markdown) here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_norm: needs a CUDA GPU")
        return 1
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    large, decode = [], []
    for kind in ("layer", "rms"):
        for shape in LARGE[:1] if a.quick else LARGE:
            bench_large(kind, shape, torch.bfloat16, copy_gbs, large)
            torch.cuda.empty_cache()
        for shape, dt in DECODE:
            bench_decode(kind, shape, dt, decode)
    table = fmt_table(large, decode, copy_gbs, torch.cuda.get_device_name())
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
