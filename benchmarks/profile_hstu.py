"""One HSTU shape, called a few times (for ncu / nsys): bf16, causal, full-length sequences; the forward,
or with --bwd the backward (torch.autograd.grad on a retained graph, after one forward).
    python benchmarks/profile_hstu.py --B 16 --N 1024 --D 128 [--reps 3] [--bwd]"""
import argparse

import torch

import torchfuse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--N", type=int, default=1024)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bwd", action="store_true")
    a = ap.parse_args()
    L = a.B * a.N
    q, k, v = (torch.randn(L, a.H, a.D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    offsets = torch.arange(0, L + 1, a.N, device="cuda")
    if a.bwd:
        for x in (q, k, v):
            x.requires_grad_()
        out = torchfuse.hstu_attention(q, k, v, offsets, a.N, a.D ** -0.5, validate=False)
        dout = torch.randn_like(out)
        for _ in range(a.reps):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    else:
        for _ in range(a.reps):
            torchfuse.hstu_attention(q, k, v, offsets, a.N, a.D ** -0.5, validate=False)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
