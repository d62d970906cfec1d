"""A/B of the HSTU forward kernels in one process: the same inputs, each kernel forced through
TORCHFUSE_HSTU_SM90 (0: mma.sync, 1: the sm_90a warp-specialized wgmma kernel with consumer ping-pong,
2: the same without ping-pong), timed in turns, best of `--rounds` rounds. TFLOP/s by the issue's count
(bench_hstu.flops_fwd). Shapes: bench_hstu's five (full length and U[N/2, N]) plus its targets and
window cases. A form may set more variables after a "+": `1+TORCHFUSE_HSTU_FWD_VEC_STORE=0` is the ping-pong
kernel with O written by 4-byte stores. --b2b times back-to-back calls (host hidden) instead of single synced ones.

    python benchmarks/ab_hstu_fwd.py [--envs 0,1,2] [--rounds 3] [--out ab.md] [--b2b]
"""
import argparse
import os
import sys

import torch

import torchfuse
from torchfuse._timing import back_to_back_us, device_time_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hstu as bh  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--envs", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--b2b", action="store_true")
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
    extra = sorted({kv.split("=")[0] for e in envs for kv in e.split("+")[1:]})
    saved = {k: os.environ.get(k) for k in ["TORCHFUSE_HSTU_SM90"] + extra}

    def set_form(e):
        kernel, *sets = e.split("+")
        os.environ["TORCHFUSE_HSTU_SM90"] = kernel
        for k in extra:
            os.environ.pop(k, None)
        for kv in sets:
            k, v = kv.split("=")
            os.environ[k] = v

    for (B, N, D), label, kw in cases:
        c = bh.make_case(B, N, D, **kw)
        fl = bh.flops_fwd(c)
        fn = lambda: torchfuse.hstu_attention(c["q"], c["k"], c["v"], c["offsets"], N, c["alpha"],  # noqa: E731
                                              num_targets=c["nt"], max_attn_len=c["window"], validate=False)
        best = {e: float("inf") for e in envs}
        with torch.no_grad():
            for _ in range(a.rounds):
                for e in envs:
                    set_form(e)
                    t = back_to_back_us(fn) if a.b2b else device_time_us(fn, "cuda", warmup=3, rep=15)
                    best[e] = min(best[e], t)
        tf = {e: fl / (best[e] * 1e-6) / 1e12 for e in envs}
        ratio = max(tf.values()) / tf[envs[0]]
        lines.append(f"| {B}x{N}x{D} | {label} | " + " | ".join(f"{tf[e]:.0f}" for e in envs) + f" | {ratio:.2f} |")
        print(lines[-1], flush=True)
        del c
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TFLOP/s forward, bf16, H = {bh.H}\n\n{text}\n")


if __name__ == "__main__":
    main()
