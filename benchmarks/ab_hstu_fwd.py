"""A/B of the HSTU forward kernels in one process: the same inputs, each kernel forced through
TORCHFUSE_HSTU_SM90 (0: mma.sync, 1: the sm_90a warp-specialized wgmma kernel with consumer ping-pong,
2: the same without ping-pong), timed in turns, best of `--rounds` rounds. TFLOP/s by the issue's count
(bench_hstu.flops_fwd). Shapes: bench_hstu's five (full length and U[N/2, N]) plus its targets and
window cases.

    python benchmarks/ab_hstu_fwd.py [--envs 0,1,2] [--rounds 3] [--out ab.md]
"""
import argparse
import os
import sys

import torch

import torchfuse
from torchfuse._timing import device_time_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hstu as bh  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--envs", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    envs = a.envs.split(",")
    cases = []
    for B, N, D in bh.SHAPES:
        cases.append(((B, N, D), "full", dict(varied=False)))
        cases.append(((B, N, D), "U[N/2,N]", dict(varied=True)))
    cases += [((16, 4096, 128), "U[N/2,N], 16 targets", dict(varied=True, targets=16)),
              ((16, 4096, 128), "U[N/2,N], window 256", dict(varied=True, window=256))]
    names = {"0": "mma.sync", "1": "wgmma ping-pong", "2": "wgmma plain"}
    lines = ["| B x N x D | lengths | " + " | ".join(names.get(e, e) for e in envs) + " | best / mma.sync |",
             "|---|---|" + "---:|" * (len(envs) + 1)]
    saved = os.environ.get("TORCHFUSE_HSTU_SM90")
    for (B, N, D), label, kw in cases:
        c = bh.make_case(B, N, D, **kw)
        fl = bh.flops_fwd(c)
        fn = lambda: torchfuse.hstu_attention(c["q"], c["k"], c["v"], c["offsets"], N, c["alpha"],  # noqa: E731
                                              num_targets=c["nt"], max_attn_len=c["window"], validate=False)
        best = {e: float("inf") for e in envs}
        with torch.no_grad():
            for _ in range(a.rounds):
                for e in envs:
                    os.environ["TORCHFUSE_HSTU_SM90"] = e
                    best[e] = min(best[e], device_time_us(fn, "cuda", warmup=3, rep=15))
        tf = {e: fl / (best[e] * 1e-6) / 1e12 for e in envs}
        ratio = max(tf.values()) / tf[envs[0]]
        lines.append(f"| {B}x{N}x{D} | {label} | " + " | ".join(f"{tf[e]:.0f}" for e in envs) + f" | {ratio:.2f} |")
        print(lines[-1], flush=True)
        del c
    if saved is None:
        os.environ.pop("TORCHFUSE_HSTU_SM90", None)
    else:
        os.environ["TORCHFUSE_HSTU_SM90"] = saved
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TFLOP/s forward, bf16, H = {bh.H}\n\n{text}\n")


if __name__ == "__main__":
    main()
