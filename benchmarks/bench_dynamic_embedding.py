"""Dynamic embedding throughput on the GPU: table operations in 1M-key batches, against a static
F.embedding gather (the upper bound: no hashing) and HierarchicalKV's own benchmark binary (given
--peers DIR holding an executable hkv_bench, built from HierarchicalKV's sources; its table is copied in
as it prints it), and a training step against nn.EmbeddingBag(sparse=True) + torch.optim.SGD / SparseAdam.

Protocol (HierarchicalKV's benchmark): a table of `capacity` slots, max_capacity = capacity, LRU;
filled with distinct random keys to the load factor; each timed call gets 1M keys of which 60% are
in the table and 40% are new (find: 40% misses); an op's time is the median of 5 calls (CUDA events,
L2 flushed) after an untimed one. find returns rows + found flags; find_or_insert returns
rows (inserting the new keys); insert_or_assign writes given rows. The new keys of an inserting call are
erased after it (untimed) below load factor 1, so that each call sees the table at the load factor
named; a full table stays full. Both inserting ops twice: with the table's default eviction record (the
victims' keys, rows, optimizer state and scores copied out for drain_evicted), and with
evicted_record_limit=0 ("no record": evictions only counted), which is what HierarchicalKV's
find_or_insert / insert_or_assign do.

    python benchmarks/bench_dynamic_embedding.py [--quick] [--peers DIR] [--out results.md]
"""
import itertools
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import torchfuse
from torchfuse import optim as tfo

import _common as C

M = 1 << 20
CAPACITY = 16 * M
REPS = 5  # timed calls per table operation, each on fresh keys


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


def timed_us(fn, before=None, after=None):
    return C.calls_us(fn, before, after, REPS, warmup=1)


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
                # five ops below (find, and two inserting ops twice), each REPS + 1 calls
                qs = [torch.unique(batch_60(existing, dev)) for _ in range(5 * (REPS + 1))]
                vals = torch.ones(M, dim, device=dev)
                it = iter(range(len(qs)))
                res = {}
                res["find"] = timed_us(lambda: t.find(qs[next(it)])) * 1e-6
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
                    fi = timed_us(lambda: t.find_or_insert(cur["q"], unique=True), pick, settle) * 1e-6
                    ia = timed_us(lambda: t.insert(cur["q"], vals[: cur["q"].numel()], unique=True), pick, settle) * 1e-6
                    return fi, ia

                res["find_or_insert"], res["insert_or_assign"] = inserting(False)
                res["find_or_insert_norec"], res["insert_or_assign_norec"] = inserting(True)
                row = {"tier": tier, "dim": dim, "lf": lf, "real_lf": real_lf}
                for k, s in res.items():
                    row[k] = n_find / s / 2**30
                rows_out.append(row)
                t = existing = qs = vals = None  # freed before the next table
                torch.cuda.empty_cache()


def static_gather(cap, dims, rows_out):
    for dim in dims:
        w = torch.randn(cap, dim, device="cuda")
        idx = torch.randint(0, cap, (M,), device="cuda")
        s = C.bench_us(lambda: F.embedding(idx, w)) * 1e-6
        rows_out.append({"dim": dim, "gather": M / s / 2**30, "gbs": M * (2 * 4 * dim + 8) / s / 1e9})
        w = None
        torch.cuda.empty_cache()


ZIPF_S = 1.05


def training_step(opt, n_ids, universe, dim, skewed=False, dev="cuda"):
    """(ours, theirs): one training step each over the same n_ids ids in bags of 64 (sum), ids drawn
    from `universe` keys already in our table (uniformly, or Zipf-distributed when skewed):
    torchfuse's DynamicEmbeddingBag with its fused optimizer against nn.EmbeddingBag(sparse=True) +
    torch.optim.SGD / SparseAdam."""
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
    if skewed:  # key index k - 1 for Zipf rank k
        idx = (C.zipf_ranks(n_ids, universe, ZIPF_S, device=dev) - 1).clamp_(0, universe - 1)
    else:
        idx = torch.randint(0, universe, (n_ids,), device=dev)
    ids = keys[idx]

    def ours():
        (bag(ids, offsets) * g).sum().backward()

    def theirs():
        (ref(idx, offsets) * g).sum().backward()
        ropt.step()
        ropt.zero_grad()

    return ours, theirs


def training(n_ids, universe, dim, rows_out):
    for skewed, opt in itertools.product((False, True), ("sgd", "adam")):
        ours, theirs = training_step(opt, n_ids, universe, dim, skewed)
        for fn in (ours, theirs) * 6:  # warm-up: the caching allocator and the clocks settle
            fn()
        t_ours, t_ref = C.bench_us(ours) * 1e-6, C.bench_us(theirs) * 1e-6
        rows_out.append({"ids": f"Zipf({ZIPF_S})" if skewed else "uniform", "opt": opt, "ours_ms": t_ours * 1e3,
                         "ref_ms": t_ref * 1e3})
        ours = theirs = None
        torch.cuda.empty_cache()


def hkv_table(peers):
    """HierarchicalKV's benchmark output, its table lines as printed, or None."""
    exe = os.path.join(peers, "hkv_bench") if peers else None
    if not exe or not os.access(exe, os.X_OK):
        return None
    try:
        out = subprocess.run([exe], capture_output=True, text=True, timeout=150).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"# hkv_bench: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    return [line for line in out.splitlines() if line.startswith("|") or line.startswith("* dim")]


def hkv_rates(lines):
    """{(dim, load factor): {column: Gi keys/s}} from HierarchicalKV's printed tables."""
    rates, dim, cols = {}, None, None
    for line in lines:
        if line.startswith("* dim"):
            dim = int(line.split("=")[1].split(",")[0])
        elif line.startswith("|") and "λ" in line:
            cols = [c.strip() for c in line.strip("|").split("|")]
        elif line.startswith("|") and dim is not None and cols and not line.startswith("|-"):
            vals = [c.strip() for c in line.strip("|").split("|")]
            try:
                rates[(dim, float(vals[0]))] = {c: float(v) for c, v in zip(cols[1:], vals[1:])}
            except ValueError:
                continue
    return rates


def run(args):
    rep = C.Report("dynamic_embedding", "Dynamic embeddings (GPU hash-table embedding)")
    copy_gbs = C.copy_bandwidth_gbs(args.quick)
    rep.roofline = (f"device-to-device copy {copy_gbs:.0f} GB/s (read + write), measured in this run; a find "
                    "moves at least the key, the bucket's digests (128 B), a key sector and the row read and "
                    "written per key")
    dims, lfs = [8, 64, 128], [0.5, 0.75, 1.0]
    train, gathers, ops = [], [], []
    training(M, 4 * M, 128, train)
    static_gather(CAPACITY, [128] if args.quick else dims, gathers)
    table_ops(CAPACITY, dims, [0.5, 1.0] if args.quick else lfs, ["hbm"], ops)
    if not args.quick:
        table_ops(CAPACITY, [64, 128], [0.5], ["half_host"], ops)
    hkv = hkv_table(args.peers)
    rep.peers = ["nn.EmbeddingBag(sparse=True) + torch.optim.SGD / SparseAdam", "static F.embedding gather"] + (
        ["HierarchicalKV (its own benchmark binary, same run)"] if hkv else [])
    rep.notes = [f"table of {CAPACITY // M}M slots, fp32 rows, LRU; 1M-key batches (60% hits); Gi keys/s",
                 f"table operations timed as single calls on fresh keys (CUDA events, L2 flushed): the median of "
                 f"{REPS} after an untimed one; the gather and the training step by the timing above"]
    rep.table("Table operations, Gi keys/s (higher is better); tier half_host: half the rows in mapped host memory.",
              ["tier", "dim", "load factor", "find", "find_or_insert", "insert_or_assign", "find_or_insert, no record",
               "insert_or_assign, no record"],
              [[r["tier"], r["dim"], f"{r['lf']:.2f} ({r['real_lf']:.3f})", f"{r['find']:.3f}",
                f"{r['find_or_insert']:.3f}", f"{r['insert_or_assign']:.3f}", f"{r['find_or_insert_norec']:.3f}",
                f"{r['insert_or_assign_norec']:.3f}"] for r in ops])
    rep.table("Static F.embedding gather over the same slot count (the upper bound: no hashing).",
              ["dim", "Gi keys/s", "GB/s (rows in + out)", "% of copy"],
              [[r["dim"], f"{r['gather']:.3f}", f"{r['gbs']:.0f}", f"{100 * r['gbs'] / copy_gbs:.0f}%"]
               for r in gathers])
    rep.table("Training step: 1M ids in bags of 64 (sum), dim 128, ids from 4M keys (uniform, or Zipf: "
              f"the hottest id {100 * (1 - 2 ** (1 - ZIPF_S)) / (1 - (4 * M) ** (1 - ZIPF_S)):.1f}% of the batch).",
              ["ids", "optimizer", "torchfuse ms", "PyTorch sparse ms", "speedup"],
              [[r["ids"], r["opt"], f"{r['ours_ms']:.2f}", f"{r['ref_ms']:.2f}", f"{r['ref_ms'] / r['ours_ms']:.2f}x"]
               for r in train])
    if hkv:
        theirs = hkv_rates(hkv)
        pairs = [(r, theirs[(r["dim"], r["lf"])]) for r in ops if r["tier"] == "hbm" and (r["dim"], r["lf"]) in theirs]
        rep.table("Against HierarchicalKV (same run): torchfuse's Gi keys/s over HierarchicalKV's (its find, and its "
                  "find_or_insert / insert_or_assign against ours without an eviction record, as its own keep none).",
                  ["dim", "load factor", "find", "find_or_insert", "insert_or_assign"],
                  [[r["dim"], f"{r['lf']:.2f}", f"{r['find'] / h['find']:.2f}x",
                    f"{r['find_or_insert_norec'] / h['find_or_insert']:.2f}x",
                    f"{r['insert_or_assign_norec'] / h['insert_or_assign']:.2f}x"] for r, h in pairs])
        rep.tables.append(("HierarchicalKV's benchmark, as it prints it (same run).", None, hkv))
    return rep


if __name__ == "__main__":
    sys.exit(C.standalone("dynamic_embedding", run, doc=__doc__))
