"""Kernel times of one find_or_insert call at the bench_dynamic_embedding.py protocol (16M slots, load
factor 0.5, 1M distinct keys, 60% present), with torch.profiler; and the call's wall time (median of 5
calls). --norec: the table keeps no eviction record (evicted_record_limit=0).
Usage: python benchmarks/profile_dynemb.py [--dim 8] [--lfs 0.5,0.75] [--norec] [--host]"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torchfuse
import bench_dynamic_embedding as bd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--lfs", default="0.5")
    ap.add_argument("--norec", action="store_true")
    ap.add_argument("--host", action="store_true", help="host-side ops of the call (self CPU time) instead")
    a = ap.parse_args()
    for lf in map(float, a.lfs.split(",")):
        t = torchfuse.DynamicEmbedding(a.dim, 16 * bd.M, device="cuda", eviction="lru", initializer=("constant", 0.0),
                                       evicted_record_limit=0 if a.norec else 1 << 20)
        existing = bd.fill(t, lf, "cuda")
        qs = [torch.unique(bd.batch_60(existing, "cuda")) for _ in range(7)]
        t.find_or_insert(qs[0], unique=True)
        walls = []
        for q in qs[1:6]:
            t.drain_evicted()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t.find_or_insert(q, unique=True)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        walls.sort()
        print(f"dim {a.dim} lf {lf} (table {t.load_factor:.3f}){' no record' if a.norec else ''}: find_or_insert of "
              f"{qs[1].numel()} keys: {walls[2] * 1e3:.3f} ms wall (median of 5)")
        acts = [ProfilerActivity.CPU] if a.host else [ProfilerActivity.CUDA]
        t.drain_evicted()
        with profile(activities=acts) as p:
            t.find_or_insert(qs[6], unique=True)
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="self_cpu_time_total" if a.host else "cuda_time_total", row_limit=14,
                                     max_name_column_width=60))
        del t, existing, qs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
