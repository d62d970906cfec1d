"""A DLRM-style sparse step through torchfuse.torchrec.DynamicEmbeddingBagCollection against a static
nn.EmbeddingBag baseline sized to the ids seen (ids remapped to 0..n-1 beforehand).

Step = forward of every table (SUM pooling), a loss on the pooled (B, 26 x dim) output, backward, and
the update: fused SGD inside the dynamic tables' backward; nn.EmbeddingBag(sparse=True) +
torch.optim.SGD for the baseline. Ids: Zipf-distributed over 10^8 values per feature (hashed so hot
ids are spread over the int64 range), one id per feature per sample by default.

    python benchmarks/bench_torchrec.py [--quick] [--batch 16384] [--features 26] [--dim 128] [--out results.md]
"""
import itertools
import sys

import numpy as np
import torch
from types import SimpleNamespace

import torchfuse
from torchfuse import torchrec as tftr

import _common as C


DEV = "cuda"


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
        batches.append(tftr.StandInKJT(keys, values, lengths))
    return keys, batches


def step_time_ms(step, batches):
    """One step's time, the steps cycling through the batches (each one's ids seen in the warm-up)."""
    for b in batches:  # warm-up: first sight of the ids, allocator
        step(b)
    it = itertools.cycle(batches)
    return C.bench_us(lambda: step(next(it))) * 1e-3


def add_args(ap):
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--features", type=int, default=26)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--pooling", type=int, default=1, help="ids per feature per sample")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--universe", type=int, default=10**8)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--lr", type=float, default=0.01)


DEFAULTS = dict(batch=16384, features=26, dim=128, pooling=1, zipf=1.1, universe=10**8, batches=6, lr=0.01)


def run(args):
    for k, v in DEFAULTS.items():  # run_all passes only --quick / --peers
        if not hasattr(args, k):
            setattr(args, k, v)
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

    t_dyn = step_time_ms(dyn_step, batches)
    t_dyn_pt = None if args.quick else step_time_ms(dyn_per_table_step, batches)
    t_static = step_time_ms(static_step, remapped)
    lookups = args.batch * args.features * args.pooling
    rep = C.Report("torchrec", "TorchRec drop-in: DLRM-style sparse training step")
    rep.roofline = "- (a step of several kernels; the table operations' rooflines are in dynamic_embedding)"
    rep.peers = ["static nn.EmbeddingBag(sparse=True) + torch.optim.SGD, sized to the ids seen"]
    rep.notes = [f"batch {args.batch}, {args.features} features, dim {args.dim}, {args.pooling} id(s) per feature, "
                 f"Zipf({args.zipf}) over {args.universe:.0e} ids; ids seen per feature {min(n_seen)}..{max(n_seen)}"]
    rows = [("torchfuse DynamicEmbeddingBagCollection, table-batched (fused SGD)", t_dyn),
            ("torchfuse DynamicEmbeddingBagCollection, one table after another", t_dyn_pt),
            ("static nn.EmbeddingBag(sparse=True) + torch.optim.SGD", t_static)]
    rep.table("Step = forward (SUM pooling), a loss on the pooled output, backward, update.",
              ["path", "step ms", "M lookups/s", "time vs static"],
              [[name, C.fmt(t, 2), C.fmt(None if t is None else lookups / t / 1e3), C.fmt(None if t is None else
                                                                                       t / t_static, 2)]
               for name, t in rows])
    return rep


if __name__ == "__main__":
    sys.exit(C.standalone("torchrec", run, add_args, __doc__))
