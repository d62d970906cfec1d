"""A/B of find's two GPU paths on the bench_dynamic_embedding.py protocol (16M slots, 1M keys, 60%
present): lookup + gather (rows under 512 bytes by default) against the one-kernel dynemb_find.
Usage: python benchmarks/ab_find.py [--dims 8,64,128] [--lf 0.5]"""
import argparse

import torch

import torchfuse
import torchfuse.dynamic_embedding as de
import bench_dynamic_embedding as bd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="8,64,128")
    ap.add_argument("--lf", type=float, default=0.5)
    a = ap.parse_args()
    default = de._FUSED_FIND_MIN_ROW_BYTES
    for dim in map(int, a.dims.split(",")):
        t = torchfuse.DynamicEmbedding(dim, 16 * bd.M, device="cuda", eviction="lru", initializer=("constant", 0.0))
        existing = bd.fill(t, a.lf, "cuda")
        q = torch.unique(bd.batch_60(existing, "cuda"))
        res = {}
        for name, thr, quarter in [("lookup+gather", 1 << 30, False), ("one kernel", 0, True)]:
            de._FUSED_FIND_MIN_ROW_BYTES, de._QUARTER_FIND = thr, quarter
            res[name] = q.numel() / bd.timed(lambda: t.find(q), reps=5) / 2**30
        de._FUSED_FIND_MIN_ROW_BYTES, de._QUARTER_FIND = default, True
        print(f"find dim {dim} lf {a.lf}: " + ", ".join(f"{k} {v:.3f} Gi keys/s" for k, v in res.items()))
        del t


if __name__ == "__main__":
    main()
