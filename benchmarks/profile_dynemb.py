"""Kernel times of one find_or_insert call at the bench_dynamic_embedding.py protocol (16M slots, load
factor 0.5, 1M distinct keys, 60% present), with torch.profiler; and the call's wall time.
Usage: python benchmarks/profile_dynemb.py [--dim 8]"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torchfuse
import bench_dynamic_embedding as bd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--lf", type=float, default=0.5)
    ap.add_argument("--host", action="store_true", help="host-side ops of the call (self CPU time) instead")
    a = ap.parse_args()
    t = torchfuse.DynamicEmbedding(a.dim, 16 * bd.M, device="cuda", eviction="lru", initializer=("constant", 0.0))
    existing = bd.fill(t, a.lf, "cuda")
    qs = [torch.unique(bd.batch_60(existing, "cuda")) for _ in range(4)]
    t.find_or_insert(qs[0], unique=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    t.find_or_insert(qs[1], unique=True)
    torch.cuda.synchronize()
    print(f"dim {a.dim} lf {a.lf}: find_or_insert of {qs[1].numel()} keys: {(time.perf_counter() - t0) * 1e3:.3f} ms wall")
    acts = [ProfilerActivity.CPU] if a.host else [ProfilerActivity.CUDA]
    with profile(activities=acts) as p:
        t.find_or_insert(qs[2], unique=True)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total" if a.host else "cuda_time_total", row_limit=18,
                                 max_name_column_width=60))


if __name__ == "__main__":
    main()
