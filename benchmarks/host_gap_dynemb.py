"""Where one find_or_insert call's wall time goes beyond its kernels, at the bench_dynamic_embedding.py
protocol (16M slots, 1M distinct keys of which 60% present, from an idle GPU, CUDA-event timed so that
host time the GPU waits on counts). The new keys are erased after each call (untimed), so every call
sees the same load factor. Per call, median / min over the calls, in us:

  api       t.find_or_insert(q, unique=True): what the benchmark times
  gpu       the op's GPU work alone: queued behind a sleep kernel, so no launch waits on the host
  op        the raw op, no host sync: the host's time to the launches plus the GPU work
  +tolist   op, then counts.tolist() (a pageable copy and its sync: the code before this branch)
  +pinned   op, then the counts copied into pinned memory and a wait on the stream (this branch)
  host_op   host time inside the raw op call (dispatch, checks, allocations, launches)

op - gpu is the host time before the first kernel; +tolist - op and +pinned - op the sync's tail;
api - +pinned what the public call adds (its Python, and at a full table the eviction kernel and record). --trace writes a torch.profiler Chrome trace of one api call
and prints its timeline (CPU ops and CUDA runtime calls, kernels, copies and memsets on the GPU; the
profiler adds its own host time to each call).

    python benchmarks/host_gap_dynemb.py [--dim 8] [--lf 0.5] [--calls 9] [--trace t.json]
"""
import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torchfuse
import bench_dynamic_embedding as bd

M = bd.M
_TIMELINE_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "kernel", "gpu_memcpy", "gpu_memset")


def timeline(path, limit=80):
    """One line per event of the trace: start (us from the first event), duration, category, name."""
    with open(path) as f:
        evs = [e for e in json.load(f).get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") in _TIMELINE_CATS]
    if not evs:
        return
    evs.sort(key=lambda e: e["ts"])
    t0 = evs[0]["ts"]
    for e in evs[:limit]:
        print(f"  {e['ts'] - t0:9.1f} {e.get('dur', 0):8.1f}  {e['cat']:12s} {e['name'][:70]}")
    if len(evs) > limit:
        print(f"  ... {len(evs) - limit} more")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--lf", type=float, default=0.5)
    ap.add_argument("--calls", type=int, default=9)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--capacity", type=int, default=16 * M)
    ap.add_argument("--device", default="cuda")  # cpu: a smoke test of the script (torch.cuda stubbed)
    a = ap.parse_args()
    dev = a.device
    t = torchfuse.DynamicEmbedding(a.dim, a.capacity, device=dev, eviction="lru", initializer=("constant", 0.0))
    existing = bd.fill(t, a.lf, dev)
    op = torch.ops.torchfuse.dynemb_find_or_insert.default
    pinned = torch.empty(3, dtype=torch.int64, pin_memory=torch.cuda.is_available())
    stream = torch.cuda.current_stream()

    def query():
        hit = existing[torch.randint(0, existing.numel(), (int(0.6 * M),), device=dev)]
        new = bd.rand_keys(M - hit.numel(), dev)
        return torch.unique(torch.cat([hit, new])), new

    def raw(q):
        epoch = t._next_epoch()
        clock = t._bump("_clock")
        return op(q, t._keys, t._digests, t._scores, t._marks, t._locks, t._values, t._values_host, t._state,
                  t._state_host, t.bucket_size, epoch, True, 0, clock, *t._init_args(), t.seed, True)

    def settle(counts, new):  # the table's size as the api keeps it, then the new keys out again
        ins, n_ev, _ = counts.tolist()
        t._size += ins - n_ev
        t.erase(new)
        torch.cuda.synchronize()

    res = {k: [] for k in ("api", "gpu", "op", "+tolist", "+pinned", "host_op")}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def span():
        return ev[0].elapsed_time(ev[1]) * 1e3

    for call in range(a.calls + 1):  # the first call of each kind warms up
        keep = call > 0
        # api
        q, new = query()
        torch.cuda.synchronize()
        ev[0].record()
        t.find_or_insert(q, unique=True)
        ev[1].record()
        torch.cuda.synchronize()
        if keep:
            res["api"].append(span())
        t.erase(new)
        # gpu alone: the launches queue behind a sleep that outlasts the host's work
        q, new = query()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)
        ev[0].record()
        h0 = time.perf_counter()
        out = raw(q)
        h1 = time.perf_counter()
        ev[1].record()
        torch.cuda.synchronize()
        if keep:
            res["gpu"].append(span())
            res["host_op"].append((h1 - h0) * 1e6)
        settle(out[-1], new)
        del out
        # op, op + tolist, op + pinned
        for kind in ("op", "+tolist", "+pinned"):
            q, new = query()
            torch.cuda.synchronize()
            ev[0].record()
            out = raw(q)
            if kind == "+tolist":
                out[-1].tolist()
            elif kind == "+pinned":
                pinned.copy_(out[-1], non_blocking=True)
                stream.synchronize()
                pinned.tolist()
            ev[1].record()
            torch.cuda.synchronize()
            if keep:
                res[kind].append(span())
            settle(out[-1], new)
            del out
    print(f"dim {a.dim} lf {a.lf} (real {t.load_factor:.3f}), {q.numel()} keys per call, {a.calls} calls: "
          "median / min us")
    for k, v in res.items():
        print(f"  {k:8s} {statistics.median(v):8.1f} / {min(v):8.1f}")
    md = {k: statistics.median(v) for k, v in res.items()}
    print(f"  medians: host before the first kernel (op - gpu) {md['op'] - md['gpu']:.1f}; sync tail: tolist "
          f"{md['+tolist'] - md['op']:.1f}, pinned {md['+pinned'] - md['op']:.1f}; public call extra (api - +pinned: Python, eviction work) "
          f"{md['api'] - md['+pinned']:.1f}; api - gpu {md['api'] - md['gpu']:.1f}")
    if a.trace:
        q, new = query()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            t.find_or_insert(q, unique=True)
            torch.cuda.synchronize()
        p.export_chrome_trace(a.trace)
        print(f"trace: {a.trace} (start us, duration us, category, name)")
        timeline(a.trace)


if __name__ == "__main__":
    main()
