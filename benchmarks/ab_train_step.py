"""One-process A/B of the dynamic-embedding training step (bench_dynamic_embedding.py's protocol: 1M
ids in bags of 64, dim 128, ids from 4M keys already in the table): a module switch of
torchfuse.dynamic_embedding toggled between rounds, each round timing single synced steps (median and
best) and a back-to-back run (one sync at the end). A switch named TORCHFUSE_* is an environment
variable that the kernels read at each launch, set to 0 / 1 (or the two --values). Usage:
  python benchmarks/ab_train_step.py --switch _ONE_SYNC [--opt sgd] [--rounds 4] [--steps 20]
  python benchmarks/ab_train_step.py --switch TORCHFUSE_DYNEMB_SORT_HASH_BITS --values 0,32"""
import argparse
import os
import statistics
import time

import torch

import bench_dynamic_embedding as bd
import torchfuse.dynamic_embedding as de


def single(fn, steps):
    ts = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, min(ts) * 1e3


def b2b(fn, steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", default="_ONE_SYNC")
    ap.add_argument("--opt", default="sgd")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--values", default="0,1", help="an environment switch's two values")
    a = ap.parse_args()
    ours, theirs = bd.training_step(a.opt, bd.M, 4 * bd.M, 128)
    for fn in (ours, theirs, ours):
        fn()
    print(f"| round | {a.switch} | median ms | best ms | back-to-back ms |\n|---|---|---|---|---|")
    values = a.values.split(",")
    for r in range(a.rounds):
        for i, v in enumerate((False, True)):
            if a.switch.startswith("TORCHFUSE_"):
                os.environ[a.switch] = values[i]
            else:
                setattr(de, a.switch, v)
            fn = ours
            fn()
            med, best = single(fn, a.steps)
            shown = values[i] if a.switch.startswith("TORCHFUSE_") else int(v)
            print(f"| {r} | {shown} | {med:.3f} | {best:.3f} | {b2b(fn, a.steps):.3f} |", flush=True)
    med, best = single(theirs, a.steps)
    print(f"| PyTorch sparse | - | {med:.3f} | {best:.3f} | {b2b(theirs, a.steps):.3f} |")


if __name__ == "__main__":
    main()
