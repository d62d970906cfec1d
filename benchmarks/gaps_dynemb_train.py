"""Where the GPU idles in one training step (bench_dynamic_embedding.py's protocol: 1M ids in bags of
64, dim 128, SGD): a torch.profiler trace (CPU + CUDA) of a single synced step, then every GPU idle gap
over --min-us between the step's first and last GPU activity, with the host ops running during it.
Profiling inflates host time, so gaps are upper bounds. Usage:
  python benchmarks/gaps_dynemb_train.py [--opt sgd] [--min-us 8] [--trace out.json]"""
import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import bench_dynamic_embedding as bd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--opt", default="sgd")
    ap.add_argument("--min-us", type=float, default=8.0)
    ap.add_argument("--trace", default=None)
    a = ap.parse_args()
    ours, _ = bd.training_step(a.opt, bd.M, 4 * bd.M, 128)
    for _ in range(5):
        ours()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        ours()
        torch.cuda.synchronize()
    path = a.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    p.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    cpu = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
           if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation", "cuda_runtime")]
    t0, t1 = gpu[0][0], max(g[1] for g in gpu)
    busy, gaps, end = 0.0, [], gpu[0][0]
    for s, e, n in gpu:
        if s > end + a.min_us:
            gaps.append((end, s, n))
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    host0 = min(c[0] for c in cpu)
    print(f"host start -> first GPU work {t0 - host0:.0f} us; GPU span {t1 - t0:.0f} us, busy {busy:.0f} us, "
          f"idle {t1 - t0 - busy:.0f} us in {len(gaps)} gaps over {a.min_us} us")
    print("| gap us | at us | next GPU work | host ops during the gap (longest first) |\n|---|---|---|---|")
    for s, e, n in gaps:
        during = sorted(((min(ce, e) - max(cs, s), cn) for cs, ce, cn in cpu if cs < e and ce > s), reverse=True)
        names = ", ".join(f"{cn[:40]} {d:.0f}" for d, cn in during[:6])
        print(f"| {e - s:.0f} | {s - t0:.0f} | {n[:50]} | {names} |")


if __name__ == "__main__":
    main()
