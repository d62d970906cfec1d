"""Timing helpers of ``python -m torchfuse`` (benchmarks/ time with benchmarks/_common.py; tests never time)."""
import statistics
import time

import torch


def event_time_us(fn, before=None):
    """One call of fn() between two CUDA events, in microseconds; before() runs untimed first."""
    if before is not None:
        before()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def device_time_us(fn, device, warmup=10, rep=50):
    """Median time of one call in microseconds: CUDA events around each call on a GPU (the host may
    run ahead), a host clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        times = [event_time_us(fn) for _ in range(rep)]
    else:
        for _ in range(rep):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def back_to_back_us(fn, calls=10, rounds=3, warmup=1, stat=min):
    """Time per call of `calls` back-to-back calls between two CUDA events, `stat` (min, or e.g.
    statistics.median_high) over `rounds` rounds: the GPU stays busy, so host dispatch hides behind it,
    as in a training step (and triton.testing.do_bench)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    def many():
        for _ in range(calls):
            fn()

    return stat([event_time_us(many) / calls for _ in range(rounds)])


def wall_times_us(fns, device, calls=500, rounds=20):
    """Wall time per call of back-to-back calls (what decode loops pay: host dispatch + launch), for
    several functions measured in interleaved rounds (A, B, C, A, B, C, ...), the best round of each: host-side timings drift on a shared machine, and interleaving exposes
    every candidate to the same drift."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for f in fns:
        for _ in range(50):
            f()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, f in enumerate(fns):
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            sync()
            best[i] = min(best[i], (time.perf_counter() - t0) / calls * 1e6)
    return best
