"""Where the host time of a 1M-key find_or_insert goes (load factor 0.5, dim 8, no evictions): each
form timed from an idle GPU with CUDA events, as bench_dynamic_embedding.py times the public call;
the batch's new keys erased after each call (untimed), so all see the same table. Median / min of
--calls calls, us:

  api         t.find_or_insert(q, unique=True)
  fused       t._find_or_insert_fused(q, True, True): without the public wrapper
  op_sync     the dynemb_find_or_insert_sync op (arguments built beforehand): its wait inside
  raw         dynemb_find_or_insert, no wait: host time to the launches + the GPU's work
  raw+sync    raw, then torch.cuda.current_stream().synchronize()
  raw+poll    raw, then a busy loop on stream.query() (no blocking sync)
  gpu         raw queued behind a sleep kernel: the GPU's work alone

    python benchmarks/host_split_foi.py [--calls 9] [--dim 8] [--lf 0.5]
"""
import argparse
import statistics

import torch

import torchfuse
import bench_dynamic_embedding as bd

M = bd.M


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=9)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--lf", type=float, default=0.5)
    a = ap.parse_args()
    t = torchfuse.DynamicEmbedding(a.dim, 16 * M, device="cuda", eviction="lru", initializer=("constant", 0.0),
                                   evicted_record_limit=0)
    existing = bd.fill(t, a.lf, "cuda")
    ops = torch.ops.torchfuse
    sync_op, raw_op = ops.dynemb_find_or_insert_sync.default, ops.dynemb_find_or_insert.default
    stream = torch.cuda.current_stream()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def args(q):
        return (q, t._keys, t._digests, t._scores, t._marks, t._locks, t._values, t._values_host, t._state,
                t._state_host, t.bucket_size, t._next_epoch(), True, 0, t._bump("_clock"), *t._init_args(), t.seed,
                True)

    def poll():
        while not stream.query():
            pass

    forms = {
        "api": lambda q, a_: t.find_or_insert(q, unique=True),
        "fused": lambda q, a_: t._find_or_insert_fused(q, True, True),
        "op_sync": lambda q, a_: sync_op(*a_),
        "raw": lambda q, a_: raw_op(*a_),
        "raw+sync": lambda q, a_: (raw_op(*a_), stream.synchronize()),
        "raw+poll": lambda q, a_: (raw_op(*a_), poll()),
        "gpu": lambda q, a_: raw_op(*a_),
    }
    res = {k: [] for k in forms}
    for call in range(a.calls + 1):
        for name, fn in forms.items():
            q = torch.unique(bd.batch_60(existing, "cuda"))
            new = q[~t.contains(q)]
            a_ = args(q)
            size = len(t)
            torch.cuda.synchronize()
            if name == "gpu":
                torch.cuda._sleep(2_000_000)
            ev[0].record()
            out = fn(q, a_)
            ev[1].record()
            torch.cuda.synchronize()
            if call:
                res[name].append(ev[0].elapsed_time(ev[1]) * 1e3)
            del out
            t.erase(new)
            # the erase subtracted the new keys; only the public forms had added them: reset either way
            t._size = size
    print(f"{torch.cuda.get_device_name()}: find_or_insert, dim {a.dim}, load factor {a.lf} ({t.load_factor:.3f}), "
          f"1M-key batches, {a.calls} calls: median / min us")
    print("| form | median us | min us |\n| --- | ---: | ---: |")
    for k, v in res.items():
        print(f"| {k} | {statistics.median(v):.1f} | {min(v):.1f} |")


if __name__ == "__main__":
    main()
