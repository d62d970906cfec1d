"""Where a training step's wall time goes, without a profiler (bench_dynamic_embedding.py's protocol:
1M ids in bags of 64, dim 128, SGD): per phase, the wall time of synced calls (median of --steps) and
the span between CUDA events recorded around it, and the phase's kernel time (torch.profiler, one
call). wall - kernel time is what the phase's host work adds. Usage: python benchmarks/host_split_dynemb_train.py [--opt sgd] [--steps 30]"""
import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import bench_dynamic_embedding as bd


class _Noop(torch.autograd.Function):
    """The same graph shape as the bag's (a tensor out, a Python backward) with no work: its backward
    phase is what the autograd engine, SumBackward and MulBackward cost by themselves."""

    @staticmethod
    def forward(ctx, anchor, out):
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--opt", default="sgd")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    ours, _ = bd.training_step(a.opt, bd.M, 4 * bd.M, 128)
    bag, ids, offsets, g = bd.LAST_STEP  # the step's module and inputs
    for _ in range(5):
        ours()
    rows = {"forward": [], "backward": [], "step": [], "empty sync": [], "backward, no-op Function": []}
    ref_out = bag(ids, offsets).detach()
    gpu = {"forward": [], "backward": [], "step": []}
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); e0.record()
        out = bag(ids, offsets)
        e1.record(); torch.cuda.synchronize()
        rows["forward"].append(time.perf_counter() - t0); gpu["forward"].append(e0.elapsed_time(e1) / 1e3)
        loss = (out * g).sum()
        torch.cuda.synchronize()
        t0 = time.perf_counter(); e0.record()
        loss.backward()
        e1.record(); torch.cuda.synchronize()
        rows["backward"].append(time.perf_counter() - t0); gpu["backward"].append(e0.elapsed_time(e1) / 1e3)
        torch.cuda.synchronize()
        t0 = time.perf_counter(); e0.record()
        ours()
        e1.record(); torch.cuda.synchronize()
        rows["step"].append(time.perf_counter() - t0); gpu["step"].append(e0.elapsed_time(e1) / 1e3)
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        rows["empty sync"].append(time.perf_counter() - t0)
        anchor = torch.empty(0, device=ids.device, requires_grad=True)
        loss = (_Noop.apply(anchor, ref_out) * g).sum()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        rows["backward, no-op Function"].append(time.perf_counter() - t0)
    kernel = {}
    for k in ("forward", "backward"):
        out = bag(ids, offsets)
        loss = (out * g).sum()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            if k == "forward":
                bag(ids, offsets)
            else:
                loss.backward()
            torch.cuda.synchronize()
        kernel[k] = sum(e.self_device_time_total for e in p.key_averages()) / 1e6
        if k == "forward":
            loss.backward()
    kernel["step"] = kernel["forward"] + kernel["backward"]
    print("| phase | wall ms (median) | event span ms (median) | kernel ms |\n|---|---|---|---|")
    for k, v in rows.items():
        ev = f"{statistics.median(gpu[k]) * 1e3:.3f}" if k in gpu else "-"
        kt = f"{kernel[k] * 1e3:.3f}" if k in kernel else "-"
        print(f"| {k} | {statistics.median(v) * 1e3:.3f} | {ev} | {kt} |")


if __name__ == "__main__":
    main()
