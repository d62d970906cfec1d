"""Where a single HSTU backward call's time goes (bf16, causal, full length, H = 4): the kernels of one
call (torch.profiler, CUDA time each) and the call's time measured three ways: one synced call through
autograd (what bench_hstu.py reports), 10 calls back to back between two events (host dispatch hidden
behind the GPU), and the kernels' sum.
    python benchmarks/probe_hstu_bwd.py --shapes 16x1024x128,128x1024x128"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import torchfuse
from torchfuse._timing import back_to_back_us, device_time_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16x1024x128,128x1024x128")
    a = ap.parse_args()
    H = 4
    for shape in a.shapes.split(","):
        B, N, D = (int(x) for x in shape.split("x"))
        L = B * N
        q, k, v = (torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        offsets = torch.arange(0, L + 1, N, device="cuda")
        out = torchfuse.hstu_attention(q, k, v, offsets, N, D ** -0.5, validate=False)
        dout = torch.randn_like(out)
        bwd = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
        fwd = lambda: torchfuse.hstu_attention(q.detach(), k.detach(), v.detach(), offsets, N, D ** -0.5,  # noqa: E731
                                               validate=False)
        flops_f = 2 * H * 2 * D * N * N / 2 * B
        for name, fn, fl in (("fwd", fwd, flops_f), ("bwd", bwd, 2.5 * flops_f)):
            single = device_time_us(fn, "cuda", warmup=3, rep=15)
            b2b = back_to_back_us(fn, rounds=5)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            kern = [(e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]
            ksum = sum(t for _, t in kern)
            print(f"{shape} {name}: single synced call {single:.0f} us ({fl / single / 1e6:.0f} TFLOP/s), "
                  f"back to back {b2b:.0f} us ({fl / b2b / 1e6:.0f}), kernels {ksum:.0f} us ({fl / ksum / 1e6:.0f})")
            for n_, t in sorted(kern, key=lambda x: -x[1]):
                print(f"    {t:8.1f} us  {n_[:110]}")


if __name__ == "__main__":
    main()
