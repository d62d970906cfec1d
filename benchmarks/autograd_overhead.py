"""Host cost of a differentiable call: each op through its wrapper's autograd.Function
(torchfuse/_autograd.py) against the same op called through torch.library's registered autograd, at
small shapes where the host is the whole cost. Wall time per call of back-to-back calls (forward, and
forward + backward), interleaved rounds, best round.
Usage: python benchmarks/autograd_overhead.py [--device cuda]"""
import argparse

import torch

import torchfuse
from torchfuse._timing import wall_times_us


def cases(dev):
    ops = torch.ops.torchfuse
    x = torch.randn(1, 2560, device=dev, dtype=torch.float16, requires_grad=True)
    r = torch.randn(1, 2560, device=dev, dtype=torch.float16)
    w = torch.ones(2560, device=dev, dtype=torch.float16, requires_grad=True)
    b = torch.zeros(2560, device=dev, dtype=torch.float16, requires_grad=True)
    yield ("add + LayerNorm 1x2560 fp16", (x, w, b),
           lambda: torchfuse.layer_norm(x, w, b, residual=r, eps=1e-5)[0],
           lambda: ops.norm_fwd(x, r, None, w, b, None, None, 1e-5, 0, 0.0, None, True)[0])
    L, H, D = 64, 2, 64
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    q, k, v = (torch.randn(L, H, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    off = torch.tensor([0, 32, 64], device=dev)
    yield ("HSTU 2 x 32 tokens, H=2, D=64", (q, k, v),
           lambda: torchfuse.hstu_attention(q, k, v, off, 32, 0.1, validate=False),
           lambda: ops.hstu_fwd(q, k, v, off, None, None, 32, 0.1, None, 0, 0, 0, 1, 0, False))
    vals = torch.randn(100, 16, device=dev, requires_grad=True)
    jo = torch.tensor([0, 40, 100], device=dev)
    yield ("jagged_to_padded_dense 2 x 50 x 16", (vals,),
           lambda: torchfuse.jagged_to_padded_dense(vals, jo, 60),
           lambda: ops.jagged_to_padded_dense(vals, jo, 60, 0.0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    dev = ap.parse_args().device
    rows = ["| op | fwd: Function us | fwd: registered us | fwd+bwd: Function us | fwd+bwd: registered us |",
            "|---|---:|---:|---:|---:|"]
    for name, ins, mine, reg in cases(dev):
        def fb(f):
            return lambda: torch.autograd.backward(f().float().sum(), inputs=list(ins))
        t = wall_times_us([mine, reg, fb(mine), fb(reg)], dev, calls=200, rounds=10)
        rows.append(f"| {name} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | {t[3]:.1f} |")
        print(rows[-1], flush=True)
    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'CPU'}, torch {torch.__version__}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
