"""A/B of find_or_insert's forms on the bench_dynamic_embedding.py protocol (16M slots, LRU, 1M-key
batches, 60% present, fresh keys per call). Calls of the forms alternate on one table. Sets of forms
(--set):
  claim: step 1 claiming empty slots itself (default) against the two-step form
         (TORCHFUSE_DYNEMB_FOI_CLAIM=0: step 1 only probes, step 2 inserts every miss). (Session 8 also
         tried step 1 listing step 2's keys after its row work: slower at 7 of 9 find_or_insert cases.)
  marks: session 9: eviction reading the bucket's marks (TORCHFUSE_DYNEMB_EVICT_MARKS=1) or not (default:
         the atomicExch on a victim's mark refuses one this call marked). Session 9's "sync" set also
         had the host's wait and the eviction rows in Python after the op; that form is gone, its
         figures are in results/dynemb_h100.md.
  (Session 9 also tried, and dropped: step 2 saving the victims' rows itself into a stage sized by the
  previous call's evictions, 0.93-1.02x at load factors 0.75 and 1.0, within this A/B's spread of about
  +-9%; step 2 numbering its evictions per warp and round instead of per block and round, 0.62-0.73x at
  load factor 1.0, where every step-2 key evicts and the warps' atomics meet on one counter.)
  mapped: session 19: the counts handed to the host by the insert kernel's last block in mapped pinned memory,
         the host spinning on a sequence word (default), against a copy behind the kernels and a stream sync
         (TORCHFUSE_DYNEMB_MAPPED_COUNTS=0).
Each call's evictions are drained after it, untimed (bench_dynamic_embedding.py does the same); the
new keys of each call are erased after it below load factor 1 (bench_dynamic_embedding.py's protocol).
--norec: the table keeps no eviction record (evicted_record_limit=0).
The ratio column is the last form over the first.
Usage: python benchmarks/ab_foi.py [--set marks] [--dims 8,64,128] [--lfs 0.5,0.75,1.0] [--reps 4]"""
import argparse
import os

import torch

import torchfuse
import bench_dynamic_embedding as bd

# form -> environment
FORM_SETS = {
    "claim": {"two-step": {"TORCHFUSE_DYNEMB_FOI_CLAIM": "0"},
              "claim in step 1": {}},
    "marks": {"eviction reads marks": {"TORCHFUSE_DYNEMB_EVICT_MARKS": "1"},
              "no marks": {}},
    "mapped": {"copy + stream sync": {"TORCHFUSE_DYNEMB_MAPPED_COUNTS": "0"},
               "mapped counts": {}},
}
ENV_KEYS = {k for forms in FORM_SETS.values() for env in forms.values() for k in env}


def use(env):
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update(env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="sync", choices=sorted(FORM_SETS))
    ap.add_argument("--dims", default="8,64,128")
    ap.add_argument("--lfs", default="0.5,0.75,1.0")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--norec", action="store_true")
    a = ap.parse_args()
    forms = FORM_SETS[a.set]
    names = list(forms)
    lines = ["| dim | load factor | op | " + " | ".join(names) + " | ratio |",
             "| ---: | ---: | --- |" + " ---: |" * (len(names) + 1)]
    for dim in map(int, a.dims.split(",")):
        for lf in map(float, a.lfs.split(",")):
            t = torchfuse.DynamicEmbedding(dim, 16 * bd.M, device="cuda", eviction="lru", initializer=("constant", 0.0),
                                           evicted_record_limit=0 if a.norec else 1 << 20)
            existing = bd.fill(t, lf, "cuda")
            vals = torch.ones(bd.M, dim, device="cuda")
            ops = {"find_or_insert": lambda q: t.find_or_insert(q, unique=True),
                   "insert_or_assign": lambda q: t.insert(q, vals[: q.numel()], unique=True)}
            for op, fn in ops.items():
                best = {f: float("inf") for f in names}
                for _ in range(a.reps):
                    for name in names:
                        q = torch.unique(bd.batch_60(existing, "cuda"))
                        new = q[~t.contains(q)]
                        use(forms[name])
                        best[name] = min(best[name], bd.timed(lambda: fn(q), reps=1, after=t.drain_evicted) / q.numel())
                        if lf < 1.0:
                            t.erase(new)
                use({})
                g = {f: 1 / s / 2**30 for f, s in best.items()}
                lines.append(f"| {dim} | {lf:.2f} | {op} | " + " | ".join(f"{v:.3f}" for v in g.values()) +
                             f" | {g[names[-1]] / g[names[0]]:.2f}x |")
                print(lines[-1], flush=True)
            del t, existing, vals
            torch.cuda.empty_cache()
    print("Gi keys/s, best of", a.reps, "calls per form\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
