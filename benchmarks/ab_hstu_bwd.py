"""A/B of the HSTU backward kernels in one process: the same inputs, `torch.ops.torchfuse.hstu_bwd` timed
with TORCHFUSE_HSTU_SM90_BWD=0 (the mma.sync kernel) and =1 (the sm_90a wgmma one where it applies, head
dims up to 256: blocks in one section, TORCHFUSE_HSTU_BWD_SECTION=0, and in L2-sized sections, the default),
in turns, best of `--rounds`; the two kernels' gradients compared (max abs difference, against the
largest gradient), and, with generative-recommenders on the path, its Triton backward timed on the same
inputs. TFLOP/s by the issue's count (2.5x bench_hstu.flops_fwd). Shapes: bench_hstu's five (full length
and U[N/2, N], 16x4096x256 included) plus its targets and window cases; --shapes d256: the head-dim-256
ones only.

    python benchmarks/ab_hstu_bwd.py [--rounds 3] [--out ab_bwd.md] [--no-triton] [--shapes all|first|d256]
"""
import argparse
import os
import sys

import torch

import torchfuse  # noqa: F401
from torchfuse._timing import device_time_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hstu as bh  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--shapes", default="all", choices=["all", "first", "d256"],
                    help="all; 'first' (16x1024x128 full only: a smoke run); 'd256' (the head-dim-256 shapes only)")
    a = ap.parse_args()
    triton_mha = None
    if not a.no_triton:
        try:
            from generative_recommenders.common import set_use_runtime_max_seq_len
            from generative_recommenders.ops.triton import triton_hstu_attention as gr_mod
            set_use_runtime_max_seq_len(True)
            bh.restrict_triton_configs(gr_mod)
            triton_mha = gr_mod.triton_hstu_mha
        except ImportError as e:
            print(f"Triton peer not run: {e}", file=sys.stderr)
    cases = []
    for B, N, D in bh.SHAPES:
        cases.append(((B, N, D), "full", dict(varied=False)))
        cases.append(((B, N, D), "U[N/2,N]", dict(varied=True)))
    # targets last: Triton's backward has stopped with an illegal memory access on jagged rows in some
    # runs (results/hstu_h100.md, session 4), which ends the process
    cases += [((16, 4096, 128), "U[N/2,N], window 256", dict(varied=True, window=256)),
              ((16, 4096, 128), "U[N/2,N], 16 targets", dict(varied=True, targets=16))]
    if a.shapes == "first":
        cases = cases[:1]
    elif a.shapes == "d256":
        cases = [c for c in cases if c[0][2] == 256]
    lines = ["| B x N x D | lengths | mma.sync | wgmma, one section | wgmma, L2 sections | best wgmma / mma.sync | Triton "
             "| best wgmma / Triton | max diff / max |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    envs = {"0": ("0", "0"), "1": ("1", "0"), "s": ("1", "")}  # column: (TORCHFUSE_HSTU_SM90_BWD, _BWD_SECTION)
    names = ("TORCHFUSE_HSTU_SM90_BWD", "TORCHFUSE_HSTU_BWD_SECTION")
    saved = {k: os.environ.get(k) for k in names}

    def set_env(e):
        for k, v in zip(names, envs[e]):
            os.environ[k] = v
    for (B, N, D), label, kw in cases:
        c = bh.make_case(B, N, D, **kw)
        fl = 2.5 * bh.flops_fwd(c)
        q, k, v, offsets, nt, window, alpha = c["q"], c["k"], c["v"], c["offsets"], c["nt"], c["window"], c["alpha"]
        dout = torch.randn_like(v)

        def ours():
            return torch.ops.torchfuse.hstu_bwd(dout, q, k, v, offsets, nt, None, N, alpha, None, 0, window, 0, 1,
                                                False)
        best, grads = {e: float("inf") for e in envs}, {}
        for _ in range(a.rounds):
            for e in envs:
                set_env(e)
                best[e] = min(best[e], device_time_us(ours, "cuda", warmup=2, rep=10))
        for e in ("0", "s"):
            set_env(e)
            grads[e] = ours()[:3]
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(grads["0"], grads["s"]))
        top = max(x.float().abs().max().item() for x in grads["0"])
        t_tri = None
        if triton_mha is not None:
            try:
                for x in (q, k, v):
                    x.requires_grad_(True)
                out = triton_mha(N, alpha, q, k, v, offsets, nt, window, 0)
                t_tri = device_time_us(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), "cuda",
                                       warmup=2, rep=10)
                del out
            except Exception as ex:  # a peer failure must not hide our figures
                print(f"triton failed at {B, N, D, label}: {ex}", file=sys.stderr)
        tf = {e: fl / (best[e] * 1e-6) / 1e12 for e in envs}
        tri = "-" if t_tri is None else f"{fl / (t_tri * 1e-6) / 1e12:.0f}"
        bw = min(best["1"], best["s"])
        tri_r = "-" if t_tri is None else f"{t_tri / bw:.2f}"
        lines.append(f"| {B}x{N}x{D} | {label} | {tf['0']:.0f} | {tf['1']:.0f} | {tf['s']:.0f} | {best['0'] / bw:.2f} "
                     f"| {tri} | {tri_r} | {diff:.1e} / {top:.1e} |")
        print(lines[-1], flush=True)
        del c, q, k, v, dout, grads
        torch.cuda.empty_cache()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TFLOP/s backward (2.5x the "
                    f"forward's FLOPs), bf16, H = {bh.H}\n\n{text}\n")


if __name__ == "__main__":
    main()
