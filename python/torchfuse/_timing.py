"""Timing helpers shared by ``python -m torchfuse`` and benchmarks/ (never used by tests)."""
import statistics
import time

import torch


def device_time_us(fn, device, warmup=10, rep=50):
    """Median time of one call in microseconds: CUDA events around each call on a GPU (the host may
    run ahead), a host clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(rep):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
    else:
        for _ in range(rep):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def wall_time_us(fn, device, calls=2000, repeats=5):
    """Wall time per call of back-to-back calls (what decode loops pay: host dispatch + launch),
    the best of several repeats."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best
