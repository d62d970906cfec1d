"""A/B of find_or_insert's two forms on the bench_dynamic_embedding.py protocol (16M slots, LRU, 1M-key
batches, 60% present, fresh keys per call): step 1 claiming empty slots itself (default) against the
two-step form (TORCHFUSE_DYNEMB_FOI_CLAIM=0: step 1 only probes, step 2 inserts every miss). (Session 8
also tried step 1 listing step 2's keys after its row work: slower at 7 of 9 find_or_insert cases.) Calls of
the two forms alternate on one table, so both see the same load factor drift (+2.5% per call).
Usage: python benchmarks/ab_foi.py [--dims 8,64,128] [--lfs 0.5,0.75,1.0] [--reps 4]"""
import argparse
import os

import torch

import torchfuse
import bench_dynamic_embedding as bd

FORMS = {"two-step": "0", "claim in step 1": "1"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="8,64,128")
    ap.add_argument("--lfs", default="0.5,0.75,1.0")
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args()
    lines = ["| dim | load factor | op | " + " | ".join(FORMS) + " | ratio |", "| ---: | ---: | --- |" + " ---: |" * (len(FORMS) + 1)]
    for dim in map(int, a.dims.split(",")):
        for lf in map(float, a.lfs.split(",")):
            t = torchfuse.DynamicEmbedding(dim, 16 * bd.M, device="cuda", eviction="lru", initializer=("constant", 0.0))
            existing = bd.fill(t, lf, "cuda")
            vals = torch.ones(bd.M, dim, device="cuda")
            ops = {"find_or_insert": lambda q: t.find_or_insert(q, unique=True),
                   "insert_or_assign": lambda q: t.insert(q, vals[: q.numel()], unique=True)}
            for op, fn in ops.items():
                best = {f: float("inf") for f in FORMS}
                for _ in range(a.reps):
                    for form, env in FORMS.items():
                        q = torch.unique(bd.batch_60(existing, "cuda"))
                        os.environ["TORCHFUSE_DYNEMB_FOI_CLAIM"] = env
                        best[form] = min(best[form], bd.timed(lambda: fn(q), reps=1) / q.numel())
                os.environ.pop("TORCHFUSE_DYNEMB_FOI_CLAIM")
                g = {f: 1 / s / 2**30 for f, s in best.items()}
                lines.append(f"| {dim} | {lf:.2f} | {op} | " + " | ".join(f"{v:.3f}" for v in g.values()) +
                             f" | {g['claim in step 1'] / g['two-step']:.2f}x |")
                print(lines[-1], flush=True)
            del t, existing, vals
            torch.cuda.empty_cache()
    print("Gi keys/s, best of", a.reps, "calls per form\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
