"""A DLRM-style sparse step through torchfuse.torchrec.DynamicEmbeddingBagCollection against a static
nn.EmbeddingBag baseline sized to the ids seen (ids remapped to 0..n-1 beforehand).

Step = forward of every table (SUM pooling), a loss on the pooled (B, 26 x dim) output, backward, and
the update: fused SGD inside the dynamic tables' backward; nn.EmbeddingBag(sparse=True) +
torch.optim.SGD for the baseline. Ids: Zipf-distributed over 10^8 values per feature (hashed so hot
ids are spread over the int64 range), one id per feature per sample by default.

    python benchmarks/bench_torchrec.py [--batch 16384] [--features 26] [--dim 128] [--steps 8]
"""
import argparse
import sys
import time

import numpy as np
import torch
from types import SimpleNamespace

import torchfuse
from torchfuse import torchrec as tftr


DEV = "cuda"


class KJT:
    """The KJT interface (torchrec is not needed to run this benchmark)."""

    def __init__(self, keys, values, lengths, offsets):
        self._k, self._v, self._l, self._o = keys, values, lengths, offsets

    def keys(self):
        return self._k

    def values(self):
        return self._v

    def lengths(self):
        return self._l

    def offsets(self):
        return self._o

    def weights_or_none(self):
        return None

    def stride(self):
        return self._l.numel() // len(self._k)


def zipf_ids(rng, n, a, universe):
    """Zipf ranks folded into [0, universe), then scattered over int64 by an odd multiplier."""
    r = rng.zipf(a, n).astype(np.uint64) % np.uint64(universe)
    return (r * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


def make_batches(args, rng):
    keys = [f"f{i}" for i in range(args.features)]
    batches = []
    for _ in range(args.batches):
        per_feature = [zipf_ids(rng, args.batch * args.pooling, args.zipf, args.universe) for _ in keys]
        values = torch.from_numpy(np.concatenate(per_feature)).to(DEV)
        lengths = torch.full((len(keys) * args.batch,), args.pooling, dtype=torch.int64, device=DEV)
        offsets = torch.arange(0, len(keys) * args.batch + 1, device=DEV) * args.pooling
        batches.append(KJT(keys, values, lengths, offsets))
    return keys, batches


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def step_time_ms(step, batches, reps):
    for b in batches:  # warm-up: first sight of the ids, allocator, autotuning
        step(b)
    _sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        for b in batches:
            step(b)
    _sync()
    return (time.perf_counter() - t0) / (reps * len(batches)) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--features", type=int, default=26)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--pooling", type=int, default=1, help="ids per feature per sample")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--universe", type=int, default=10**8)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    keys, batches = make_batches(args, rng)

    # ids seen per feature: sizes the static tables and the dynamic capacity alike
    seen = [torch.unique(torch.cat([b.values()[i * args.batch * args.pooling:(i + 1) * args.batch * args.pooling]
                                    for b in batches])) for i in range(len(keys))]
    n_seen = [int(s.numel()) for s in seen]

    # dynamic: one table per feature, capacity 2x the ids seen
    tables = [SimpleNamespace(name=f"t{i}", embedding_dim=args.dim, num_embeddings=n, feature_names=[k],
                              pooling="sum") for i, (k, n) in enumerate(zip(keys, n_seen))]
    def make_dyn(table_batched):
        return tftr.DynamicEmbeddingBagCollection(tables, device=DEV, optimizer=torchfuse.optim.SGD(lr=args.lr),
                                                  initializer=("uniform", -0.01, 0.01), table_batched=table_batched)

    dyn, dyn_per_table = make_dyn(True), make_dyn(False)

    def dyn_step(kjt):
        out = dyn(kjt).values()
        out.square().mean().backward()

    def dyn_per_table_step(kjt):
        out = dyn_per_table(kjt).values()
        out.square().mean().backward()

    # static: ids remapped to 0..n-1 per feature beforehand (not timed)
    static = torch.nn.ModuleList([torch.nn.EmbeddingBag(n, args.dim, mode="sum", sparse=True,
                                                        include_last_offset=True, device=DEV) for n in n_seen])
    opt = torch.optim.SGD(static.parameters(), lr=args.lr)
    remapped = []
    for b in batches:
        per = []
        for i in range(len(keys)):
            v = b.values()[i * args.batch * args.pooling:(i + 1) * args.batch * args.pooling]
            per.append(torch.searchsorted(seen[i], v))
        remapped.append(per)
    bag_offsets = torch.arange(0, args.batch + 1, device=DEV) * args.pooling

    def static_step(per):
        out = torch.cat([bag(ids, bag_offsets) for bag, ids in zip(static, per)], dim=1)
        opt.zero_grad(set_to_none=True)
        out.square().mean().backward()
        opt.step()

    t_dyn = step_time_ms(dyn_step, batches, args.reps)
    t_dyn_pt = step_time_ms(dyn_per_table_step, batches, args.reps)
    t_static = step_time_ms(static_step, remapped, args.reps)
    lookups = args.batch * args.features * args.pooling
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    rows = [
        ("torchfuse DynamicEmbeddingBagCollection, table-batched (fused SGD)", t_dyn),
        ("torchfuse DynamicEmbeddingBagCollection, one table after another", t_dyn_pt),
        ("static nn.EmbeddingBag(sparse=True) + torch.optim.SGD", t_static),
    ]
    lines = [f"DLRM-style step on {gpu}, torch {torch.__version__}: batch {args.batch}, {args.features} features, "
             f"dim {args.dim}, {args.pooling} id(s) per feature, Zipf({args.zipf}) over {args.universe:.0e} ids; "
             f"ids seen per feature {min(n_seen)}..{max(n_seen)}",
             "", "| path | step ms | M lookups/s | vs static |", "|---|---|---|---|"]
    for name, t in rows:
        lines.append(f"| {name} | {t:.2f} | {lookups / t / 1e3:.1f} | {t / t_static:.2f}x time |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
