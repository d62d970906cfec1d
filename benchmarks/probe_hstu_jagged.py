"""Why a jagged batch costs the sm_90a HSTU forward as much time as a full-length one: the forward's
time (us) on 16 x 4096-ish x 128 (bf16, H = 4, causal) under length layouts that separate the suspects
(sequence starts off the 128-row grid, shorter sequences, inactive query tiles from a larger
max_seq_len), for each kernel (TORCHFUSE_HSTU_SM90 0 / 1 / 2), with the issue's FLOP count.

    python benchmarks/probe_hstu_jagged.py [--d 128]
"""
import argparse
import os

import torch

import torchfuse
from torchfuse._timing import device_time_us

H = 4


def run(lens, msl, d, envs, reps=2):
    lens_t = torch.tensor(lens)
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = lens_t.cumsum(0)
    L = int(offsets[-1])
    q, k, v = (torch.randn(L, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    offsets = offsets.cuda()
    fl = float(sum(2 * H * 2 * d * n * n / 2 for n in lens))
    res = {}
    with torch.no_grad():
        for e in envs:
            os.environ["TORCHFUSE_HSTU_SM90"] = e
            fn = lambda: torchfuse.hstu_attention(q, k, v, offsets, msl, d ** -0.5, validate=False)  # noqa: E731
            res[e] = min(device_time_us(fn, "cuda", warmup=3, rep=15) for _ in range(reps))
    return fl, res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--envs", default="0,1,2")
    ap.add_argument("--only", default=None, help="comma list of layout indices")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    envs = a.envs.split(",")
    g = torch.Generator().manual_seed(0)
    N, h = a.n, a.n // 2
    var = torch.randint(h, N + 1, (16,), generator=g).tolist()
    layouts = [
        (f"16 x {N}, msl {N}", [N] * 16, N),
        (f"16 x {N - 1} (starts off the grid)", [N - 1] * 16, N),
        (f"16 x {3 * N // 4}, msl {3 * N // 4}", [3 * N // 4] * 16, 3 * N // 4),
        (f"16 x {3 * N // 4}, msl {N} (inactive tiles)", [3 * N // 4] * 16, N),
        (f"16 x {N}, msl {2 * N} (half the tiles inactive)", [N] * 16, 2 * N),
        (f"U[{h}, {N}], msl {N}", var, N),
        (f"U[{h}, {N}] rounded to 128", [x // 128 * 128 for x in var], N),
        (f"U[{h}, {N}] sorted descending", sorted(var, reverse=True), N),
        (f"8 x {N} + 8 x {h}", [N] * 8 + [h] * 8, N),
        (f"8 x {h} + 8 x {N}", [h] * 8 + [N] * 8, N),
        (f"16 x {N - 64} (starts on a 64-row grid)", [N - 64] * 16, N),
        (f"16 x {N - 16} (16-row grid)", [N - 16] * 16, N),
        (f"16 x {N - 8} (8-row grid)", [N - 8] * 16, N),
        (f"16 x {N - 2} (2-row grid)", [N - 2] * 16, N),
    ]
    if a.only:
        layouts = [layouts[int(i)] for i in a.only.split(",")]
    print("| lengths | " + " | ".join(f"env {e}: us (TFLOP/s)" for e in envs) + " |")
    print("|---|" + "---:|" * len(envs))
    for name, lens, msl in layouts:
        fl, res = run(lens, msl, a.d, envs, a.reps)
        print(f"| {name} | " + " | ".join(f"{res[e]:.0f} ({fl / res[e] / 1e6:.0f})" for e in envs) + " |", flush=True)


if __name__ == "__main__":
    main()
