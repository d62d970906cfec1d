"""Where a DLRM-style DynamicEmbeddingBagCollection step spends its time (torch.profiler), for the
bench_torchrec.py shape: per-op CUDA and CPU time of one step, and step time against the number of
tables. Usage: python benchmarks/profile_torchrec.py [--batch 16384] [--features 26]"""
import argparse
import time
from types import SimpleNamespace

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import torchfuse
from torchfuse import torchrec as tftr
import bench_torchrec as bt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--features", type=int, default=26)
    ap.add_argument("--dim", type=int, default=128)
    a = ap.parse_args()
    args = SimpleNamespace(batch=a.batch, features=a.features, dim=a.dim, pooling=1, zipf=1.1, universe=10**8,
                           batches=3)
    keys, batches = bt.make_batches(args, np.random.default_rng(0))
    tables = [SimpleNamespace(name=f"t{i}", embedding_dim=a.dim, num_embeddings=50000, feature_names=[k],
                              pooling="sum") for i, k in enumerate(keys)]
    dyn = tftr.DynamicEmbeddingBagCollection(tables, device="cuda", optimizer=torchfuse.optim.SGD(lr=0.01))

    def step(kjt):
        dyn(kjt).values().square().mean().backward()

    for b in batches:
        step(b)
    torch.cuda.synchronize()
    for part, fn in [("forward only (no grad)", lambda b: dyn(b)), ("forward+backward", step)]:
        ctx = torch.no_grad() if "no grad" in part else torch.enable_grad()
        with ctx:
            t0 = time.perf_counter()
            for b in batches * 3:
                fn(b)
            torch.cuda.synchronize()
        print(f"{part}: {(time.perf_counter() - t0) / (3 * len(batches)) * 1e3:.2f} ms per step")
    # host side: Python's own profiler over a few steps (tottime per function, builtins included; a
    # host sync shows up as the time inside .tolist())
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for b in batches * 2:
        step(b)
    torch.cuda.synchronize()
    pr.disable()
    print(f"cProfile over {2 * len(batches)} steps (host):")
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        step(batches[0])
        torch.cuda.synchronize()
    ka = p.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=50))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))


if __name__ == "__main__":
    main()
