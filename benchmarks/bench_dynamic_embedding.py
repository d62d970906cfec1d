"""Dynamic embedding throughput on the GPU: table operations in 1M-key batches against a static
F.embedding gather (the upper bound: no hashing), and a training step against nn.EmbeddingBag
(sparse=True) + torch.optim.SGD / SparseAdam. HierarchicalKV runs as its own binary in the same
device job (benchmarks/run_device_dynemb.sh); its figures are merged into the table there.

Protocol (HierarchicalKV's benchmark): a table of `capacity` slots, max_capacity = capacity, LRU;
filled with distinct random keys to the load factor; each timed call gets 1M keys of which 60% are
in the table and 40% are new (find: 40% misses); best of 3 calls, CUDA-event timed (host syncs
inside a call count). find returns rows + found flags; find_or_insert returns rows (inserting the
new keys); insert_or_assign writes given rows. The new keys of an inserting call are erased after it
(untimed) below load factor 1, so that each call sees the table at the load factor named
(HierarchicalKV's benchmark times one call per fill; without the erase each call adds 2.5% of the
slots); a full table stays full. Both inserting ops twice: with the table's default
eviction record (the victims' keys, rows, optimizer state and scores copied out for drain_evicted),
and with evicted_record_limit=0 ("no record": evictions only counted, the new rows written over the
victims' at once), which is what HierarchicalKV's find_or_insert / insert_or_assign do (they discard
evicted entries; its insert_and_evict is the form that returns them).

Roofline: a find moves at least key (8 B) + the bucket's digests (128 B) + one key sector (32 B)
+ the row read and written (2 * 4 * dim B) per key; GB/s below counts only the rows and the key.

    python benchmarks/bench_dynamic_embedding.py [--quick] [--out results.md]
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F

import torchfuse
from torchfuse import optim as tfo

M = 1 << 20


def timed(fn, reps=3, after=None, before=None):
    """Best of `reps` single calls from an idle GPU, in seconds; before() and after(), untimed, come
    before and after each call."""
    best = float("inf")
    for _ in range(reps):
        if before is not None:
            before()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
        if after is not None:
            after()
    return best


def rand_keys(n, dev):
    return torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, device=dev)


def fill(table, lf, dev):
    target = int(lf * table.capacity)
    inserted = []
    total = 0
    while len(table) < min(target, int(0.995 * table.capacity)) and total < 3 * table.capacity:
        n = min(M, max(target - len(table), M // 16))
        k = rand_keys(n, dev)
        table.insert(k, torch.zeros(n, table.embedding_dim, device=dev), unique=True)
        inserted.append(k)
        total += n
    return torch.cat(inserted)


def batch_60(existing, dev):
    hit = existing[torch.randint(0, existing.numel(), (int(0.6 * M),), device=dev)]
    return torch.cat([hit, rand_keys(M - hit.numel(), dev)])[torch.randperm(M, device=dev)]


def table_ops(cap, dims, lfs, tiers, rows_out):
    dev = "cuda"
    for tier in tiers:
        for dim in dims:
            for lf in lfs:
                budget = None if tier == "hbm" else cap // 2 * dim * 4
                t = torchfuse.DynamicEmbedding(dim, cap, device=dev, eviction="lru", hbm_budget_bytes=budget,
                                               initializer=("constant", 0.0))
                existing = fill(t, lf, dev)
                real_lf = t.load_factor
                # distinct keys per call, as HierarchicalKV's benchmark (no dedup sort on our side)
                # fresh keys for every call: an inserting call would otherwise make the next one all hits
                qs = [torch.unique(batch_60(existing, dev)) for _ in range(15)]
                vals = torch.ones(M, dim, device=dev)
                it = iter(range(15))
                res = {}
                res["find"] = timed(lambda: t.find(qs[next(it)]))
                n_find = qs[0].numel()
                # the caller drains (spills) what each call evicted, untimed, as a trainer would: the
                # record's memory is then reused instead of growing to its limit across the calls
                cur = {}

                def pick():  # the next batch, and which of its keys are new (erased after the call)
                    cur["q"] = qs[next(it)]
                    cur["new"] = cur["q"][~t.contains(cur["q"])]

                def settle():  # a full table stays full (each new key took a victim's slot): no erase
                    t.drain_evicted()
                    if lf < 1.0:
                        t.erase(cur["new"])

                def inserting(norec):
                    t.evicted_record_limit = 0 if norec else 1 << 20
                    fi = timed(lambda: t.find_or_insert(cur["q"], unique=True), before=pick, after=settle)
                    ia = timed(lambda: t.insert(cur["q"], vals[: cur["q"].numel()], unique=True), before=pick,
                               after=settle)
                    return fi, ia

                res["find_or_insert"], res["insert_or_assign"] = inserting(False)
                res["find_or_insert_norec"], res["insert_or_assign_norec"] = inserting(True)
                row = {"tier": tier, "dim": dim, "lf": lf, "real_lf": real_lf}
                for k, s in res.items():
                    row[k] = n_find / s / 2**30
                rows_out.append(row)
                print(f"{tier:9s} dim {dim:3d} lf {lf:.2f} (real {real_lf:.3f}): " +
                      ", ".join(f"{k} {row[k]:.3f} Gi keys/s" for k in res), flush=True)
                del t, existing, qs, vals
                torch.cuda.empty_cache()


def static_gather(cap, dims, rows_out):
    for dim in dims:
        w = torch.randn(cap, dim, device="cuda")
        idx = torch.randint(0, cap, (M,), device="cuda")
        s = timed(lambda: F.embedding(idx, w), reps=5)
        rows_out.append({"dim": dim, "gather": M / s / 2**30, "gbs": M * (2 * 4 * dim + 8) / s / 1e9})
        print(f"static F.embedding gather dim {dim}: {M / s / 2**30:.3f} Gi keys/s ({M * (2 * 4 * dim + 8) / s / 1e9:.0f} GB/s)",
              flush=True)
        del w
        torch.cuda.empty_cache()


def training_step(opt, n_ids, universe, dim, dev="cuda"):
    """(ours, theirs): one training step each over the same n_ids ids in bags of 64 (sum), ids drawn
    from `universe` keys already in our table: torchfuse's DynamicEmbeddingBag with its fused optimizer
    against nn.EmbeddingBag(sparse=True) + torch.optim.SGD / SparseAdam."""
    B = n_ids // 64
    keys = rand_keys(universe, dev)
    offsets = torch.arange(0, n_ids, 64, device=dev)
    g = torch.randn(B, dim, device=dev)
    tf_opt = tfo.SGD(0.01) if opt == "sgd" else tfo.Adam(0.001)
    bag = torchfuse.DynamicEmbeddingBag(dim, 2 * universe, device=dev, optimizer=tf_opt, mode="sum",
                                        initializer=("normal", 0.0, 0.01))
    bag.train()
    with torch.no_grad():
        for i in range(0, universe, M):
            torchfuse.DynamicEmbedding.forward(bag, keys[i:i + M])
    ref = torch.nn.EmbeddingBag(universe, dim, mode="sum", sparse=True).to(dev)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.01) if opt == "sgd" else torch.optim.SparseAdam(ref.parameters())
    idx = torch.randint(0, universe, (n_ids,), device=dev)
    ids = keys[idx]

    def ours():
        (bag(ids, offsets) * g).sum().backward()

    global LAST_STEP  # for host_split_dynemb_train.py
    LAST_STEP = (bag, ids, offsets, g)

    def theirs():
        (ref(idx, offsets) * g).sum().backward()
        ropt.step()
        ropt.zero_grad()

    return ours, theirs


def training(n_ids, universe, dim, rows_out):
    for opt in ("sgd", "adam"):
        ours, theirs = training_step(opt, n_ids, universe, dim)
        for fn in (ours, theirs) * 6:  # warm-up: the caching allocator and the clocks settle
            fn()
        t_ours, t_ref = timed(ours, 5), timed(theirs, 5)
        rows_out.append({"opt": opt, "ours_ms": t_ours * 1e3, "ref_ms": t_ref * 1e3})
        print(f"training step {opt}: {n_ids} ids, dim {dim}: torchfuse {t_ours * 1e3:.2f} ms, "
              f"PyTorch sparse {t_ref * 1e3:.2f} ms, speedup {t_ref / t_ours:.2f}x", flush=True)
        del ours, theirs
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--capacity", type=int, default=16 * M)
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="train,gather,hbm,half_host",
                    help="comma-separated subset of train, gather, hbm, half_host")
    ap.add_argument("--dims", default=None, help="table dims, e.g. 64,128 (default 8,64,128; --quick: fewer)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    dims = [int(d) for d in args.dims.split(",")] if args.dims else [8, 64, 128]
    lfs = [0.5, 0.75, 1.0]
    ops, gathers, train = [], [], []
    t0 = time.time()
    if "train" in parts:
        training(M, 4 * M, 128, train)
    if "gather" in parts:
        static_gather(args.capacity, [128] if args.quick and not args.dims else dims, gathers)
    if "hbm" in parts:
        table_ops(args.capacity, dims, lfs, ["hbm"], ops)
    if "half_host" in parts:
        table_ops(args.capacity, [64, 128] if args.quick and not args.dims else dims,
                  [0.5] if args.quick else lfs, ["half_host"], ops)
    print(f"benchmark wall {time.time() - t0:.0f} s", flush=True)
    lines = ["| tier | dim | load factor | find Gi keys/s | find_or_insert | insert_or_assign "
             "| find_or_insert, no record | insert_or_assign, no record |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in ops:
        lines.append(f"| {r['tier']} | {r['dim']} | {r['lf']:.2f} ({r['real_lf']:.3f}) | {r['find']:.3f} | "
                     f"{r['find_or_insert']:.3f} | {r['insert_or_assign']:.3f} | {r['find_or_insert_norec']:.3f} | "
                     f"{r['insert_or_assign_norec']:.3f} |")
    lines += ["", "| static F.embedding gather dim | Gi keys/s | GB/s (rows in+out) |", "| ---: | ---: | ---: |"]
    lines += [f"| {r['dim']} | {r['gather']:.3f} | {r['gbs']:.0f} |" for r in gathers]
    lines += ["", "| training step (1M ids, dim 128, bags of 64) | torchfuse ms | PyTorch sparse ms | speedup |",
              "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['opt']} | {r['ours_ms']:.2f} | {r['ref_ms']:.2f} | {r['ref_ms'] / r['ours_ms']:.2f}x |" for r in train]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
