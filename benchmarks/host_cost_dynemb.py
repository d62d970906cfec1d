"""The fixed host cost of one find_or_insert call, piece by piece: calls of one present key on a
16M-slot table (load factor 0.5, dim 8), so the GPU work is a few microseconds and what is left is
the host's. Medians of --calls calls, in us, wall time (perf_counter) of:

  api        t.find_or_insert(q, unique=True): the public call (its op waits for the counts)
  fused      t._find_or_insert_fused(q, True, True): the same without the public wrapper
  op_sync    the dynemb_find_or_insert_sync op alone (arguments built beforehand)
  raw+sync   dynemb_find_or_insert (no wait inside) then torch.cuda.synchronize()
  raw_host   dynemb_find_or_insert's host time with the GPU busy (a sleep kernel ahead): dispatch,
             checks, allocations, launches, no waiting
  empty6     six torch.empty calls on the GPU (the op's output allocations)
  launch     torch.ops.aten.add of two one-element tensors, host time with the GPU busy
  sync_idle  torch.cuda.synchronize() on an idle stream
  pin+sync   a three-element device tensor copied into pinned memory, then a stream sync

    python benchmarks/host_cost_dynemb.py [--calls 300]
"""
import argparse
import statistics
import time

import torch

import torchfuse
import bench_dynamic_embedding as bd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--dim", type=int, default=8)
    a = ap.parse_args()
    t = torchfuse.DynamicEmbedding(a.dim, 16 * bd.M, device="cuda", eviction="lru", initializer=("constant", 0.0))
    existing = bd.fill(t, 0.5, "cuda")
    q = existing[:1].clone()
    ops = torch.ops.torchfuse
    sync_op, raw_op = ops.dynemb_find_or_insert_sync.default, ops.dynemb_find_or_insert.default

    def args():
        return (q, t._keys, t._digests, t._scores, t._marks, t._locks, t._values, t._values_host, t._state,
                t._state_host, t.bucket_size, t._next_epoch(), True, 0, t._bump("_clock"), *t._init_args(), t.seed,
                True)

    def op_sync():
        sync_op(*pa[0])

    def raw_sync():
        raw_op(*pa[0])
        torch.cuda.synchronize()

    def raw():
        raw_op(*pa[0])

    x = torch.ones(1, device="cuda")
    dev_counts = torch.zeros(3, dtype=torch.int64, device="cuda")
    pinned = torch.empty(3, dtype=torch.int64, pin_memory=True)
    stream = torch.cuda.current_stream()

    def pin_sync():
        pinned.copy_(dev_counts, non_blocking=True)
        stream.synchronize()

    pa = [args()]  # the raw ops' arguments, a fresh epoch and clock for each call (built untimed)

    rows = []
    for name, fn, busy in [
        ("api", lambda: t.find_or_insert(q, unique=True), False),
        ("fused", lambda: t._find_or_insert_fused(q, True, True), False),
        ("op_sync", op_sync, False),
        ("raw+sync", raw_sync, False),
        ("raw_host", raw, True),
        ("empty6", lambda: [torch.empty(1 << 20, device="cuda") for _ in range(6)], True),
        ("launch", lambda: torch.ops.aten.add.Tensor(x, x), True),
        ("sync_idle", torch.cuda.synchronize, False),
        ("pin+sync", pin_sync, False),
    ]:
        for _ in range(20):  # warm-up
            fn()
            pa[0] = args()
        torch.cuda.synchronize()
        meds = []
        for _ in range(a.calls):
            if busy:
                torch.cuda._sleep(2_000_000)
            else:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            meds.append((time.perf_counter() - t0) * 1e6)
            pa[0] = args()
            if busy:
                torch.cuda.synchronize()
        rows.append((name, statistics.median(meds), min(meds)))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; one present key per call, {a.calls} calls")
    print("| part | median us | min us |\n| --- | ---: | ---: |")
    for name, m, lo in rows:
        print(f"| {name} | {m:.1f} | {lo:.1f} |")


if __name__ == "__main__":
    main()
