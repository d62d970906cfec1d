"""Half the rows in pinned host memory: is the row read latency-bound or bound by the order of the
host addresses? HierarchicalKV's hybrid-mode find sorts the value pointers before its copy kernel and
reads 0.44 Gi keys/s at dim 64 (PCIe-bound) against our 0.13 (session 10). One table (16M slots, half
the rows on the host, load factor 0.5, 60% hits), per dim:
  find                      the op as it is (probe + copy by the same quarter warp)
  lookup                    probe only
  gather (batch order)      dynemb_gather of the looked-up slots
  gather (sorted slots)     the same slots sorted: host rows read in address order
  sort + gather + index_copy  what a sorted find would pay on top of the lookup
    python benchmarks/probe_dynemb_host.py [--dims 64,128]"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_dynamic_embedding as bde  # noqa: E402

import torchfuse  # noqa: E402

M = bde.M


def best_us(fn, reps=3):
    return bde.timed(fn, reps) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--capacity", type=int, default=16 * M)
    a = ap.parse_args()
    ops = torch.ops.torchfuse
    for dim in (int(d) for d in a.dims.split(",")):
        cap = a.capacity
        t = torchfuse.DynamicEmbedding(dim, cap, device="cuda", eviction="lru", hbm_budget_bytes=cap // 2 * dim * 4,
                                       initializer=("constant", 0.0))
        existing = bde.fill(t, 0.5, "cuda")
        q = torch.unique(bde.batch_60(existing, "cuda"))
        n = q.numel()
        slots = t._lookup(q)
        perm = torch.argsort(slots)
        ss = slots[perm]
        host = int((slots >= t._values.shape[0]).sum())
        res = {
            "find": best_us(lambda: t.find(q)),
            "lookup": best_us(lambda: t._lookup(q)),
            "gather (batch order)": best_us(lambda: ops.dynemb_gather(slots, t._values, t._values_host)),
            "gather (sorted slots)": best_us(lambda: ops.dynemb_gather(ss, t._values, t._values_host)),
            "argsort": best_us(lambda: torch.argsort(slots)),
        }

        def sorted_find():
            s = t._lookup(q)
            p = torch.argsort(s)
            out = torch.empty(n, dim, device="cuda")
            out.index_copy_(0, p, ops.dynemb_gather(s[p], t._values, t._values_host))
            return out

        res["lookup + sort + gather + index_copy"] = best_us(sorted_find)
        ref, _ = t.find(q)
        assert torch.equal(sorted_find(), ref)
        print(f"dim {dim}: {n} keys, {host} rows on the host ({host * dim * 4 / 2**20:.0f} MiB)")
        for k, us in res.items():
            print(f"  {k:38s} {us:9.0f} us  {n / us * 1e6 / 2**30:6.3f} Gi keys/s")
        del t, existing
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
