"""Sharded dynamic embeddings over NCCL: one training step (pooled bags of 64 ids, dim 128, Zipf ids
over 1e9 keys, SGD and Adam) on 1 GPU and on N GPUs at the same per-GPU batch (weak scaling).

    python benchmarks/bench_distributed.py                 # 1 and 2 GPUs
    python benchmarks/bench_distributed.py --cpu --quick   # gloo on CPU, tiny sizes (a smoke run)
    python benchmarks/bench_distributed.py --recsys --worlds 1,2,4   # the HSTU recommender, data-parallel
    python benchmarks/bench_distributed.py --recsys --configs b     # one model configuration

Reported per configuration: step time (wall, median of the timed steps; the step waits on the host
for the exchanged counts anyway), ids/s per GPU and in all, the all-to-all time and bytes of a step
(measured in separate steps with the device synchronized around each all-to-all), and NCCL's own
all_to_all_single on plain buffers of the same split sizes in the same run, so that the exchange's
bandwidth is read against the fabric's at those message sizes. Both exchanges of the bags run: the
distinct ids' rows back and pooled locally ("rows"), and each owner pooling its part of every bag
("partial_sums").
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

ZIPF_S = 1.05
# (optimizer, bags' exchange, rows' and gradients' dtype on the wire: None = the table's fp32)
CONFIGS = [("sgd", "rows", None), ("adam", "rows", None), ("sgd", "partial_sums", None), ("adam", "partial_sums", None),
           ("sgd", "rows", torch.bfloat16), ("adam", "rows", torch.bfloat16)]


def zipf_ids(n, universe, g, dev):
    """n ids of Zipf(ZIPF_S) ranks over `universe` (_common.zipf_ranks), each rank mapped to a
    spread-out int64 key (an odd multiplier modulo 2**64)."""
    ranks = C.zipf_ranks(n, universe, ZIPF_S, generator=g)
    return (ranks * -7046029254386353131).to(dev)  # 0x9E3779B97F4A7C15 as int64


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _raw_a2a_seconds(log_sizes, world, dev, reps):
    """NCCL's (gloo's) own all_to_all_single on float buffers with each logged exchange's split
    sizes (in bytes, this rank's own part included, as in the exchange), timed as the exchange is (a
    barrier, then the device synchronized around it), the median of reps per exchange, summed over
    the step's exchanges."""
    total = 0.0
    for send_b, recv_b in log_sizes:
        src = torch.empty(sum(send_b) // 4, dtype=torch.float32, device=dev)
        dst = torch.empty(sum(recv_b) // 4, dtype=torch.float32, device=dev)
        ins, outs = [b // 4 for b in send_b], [b // 4 for b in recv_b]
        times = []
        for _ in range(reps):
            _sync(dev)
            dist.barrier()
            _sync(dev)
            t0 = time.perf_counter()
            dist.all_to_all_single(dst, src, outs, ins)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        total += statistics.median(times)
    return total


def _init(rank, world, tmp, args):
    from torchfuse.recsys.distributed import threads_per_process
    threads_per_process(world)
    dev = torch.device(f"cuda:{rank}") if not args.cpu else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo" if args.cpu else "nccl", init_method=f"file://{tmp}/pg", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600),
                            **({} if args.cpu else {"device_id": dev}))
    return dev


def recsys_worker(rank, world, tmp, args, out_path, c, per_rank_batch, steps):
    dev = _init(rank, world, tmp, args)
    import _recsys_dist as R
    out = R.worker(rank, world, dev, args, c, per_rank_batch, steps)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def worker(rank, world, tmp, args, out_path):
    dev = _init(rank, world, tmp, args)
    from torchfuse import optim as tfo
    from torchfuse.distributed import ShardedDynamicEmbeddingBag
    n, dim, L = args.ids_per_rank, args.dim, 64
    B = n // L
    results = []
    for opt, exchange, comm in CONFIGS:
        emb = ShardedDynamicEmbeddingBag(dim, args.capacity, max_capacity=args.capacity, device=dev,
                                         optimizer=tfo.SGD(0.01) if opt == "sgd" else tfo.Adam(0.001),
                                         eviction="lru", evicted_record_limit=0, exchange=exchange, comm_dtype=comm)
        g = torch.Generator().manual_seed(1000 * rank + 1)
        batches = [zipf_ids(B * L, args.universe, g, dev).view(B, L) for _ in range(4)]
        grad = torch.randn(B, dim, generator=g).to(dev)

        def step(i):
            (emb(batches[i % len(batches)]) * grad).sum().backward()

        for i in range(args.warmup):
            step(i)
        _sync(dev)
        times = []
        for i in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            step(i)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        # the exchange, step by step, with the device synchronized around every all-to-all
        a2a_s, a2a_bytes, logs = [], [], []
        for i in range(5):
            emb.exchange_log = log = []
            step(i)
            emb.exchange_log = None
            a2a_s.append(sum(e[3] for e in log))
            a2a_bytes.append(sum(e[1] for e in log))
            logs.append(log)
        uniq = torch.unique(batches[0]).numel()
        partial_rows = B * (world - 1)  # bags' partial sums from the other owners, each way
        results.append({"opt": opt, "exchange": exchange, "step_s": statistics.median(times), "a2a_s": statistics.median(a2a_s),
                        "a2a_bytes": statistics.median(a2a_bytes), "uniq": uniq, "B": B, "n": B * L,
                        "partial_rows": partial_rows, "log": logs[-1]})
        emb = batches = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    # plain all-to-alls of every logged exchange's own split sizes (the counts' too)
    for r in results:
        sizes = [(e[4], e[5]) for e in r["log"]]
        r["raw_s"] = _raw_a2a_seconds(sizes, world, dev, 5) if world > 1 else 0.0
        r["raw_bytes"] = sum(e[1] for e in r["log"])
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def run_world(world, args, fn=worker, *extra):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(fn, args=(world, tmp, args, out) + extra, nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def recsys(args, worlds):
    """For each model configuration: the recommender's step on each world size at one per-GPU batch,
    and (where the configuration runs one) each N-GPU loss curve against one GPU on the N-GPU run's
    global batch."""
    import _recsys_dist as R
    rows, crows, notes = [], [], []
    for name in (["tiny"] if args.quick else args.configs.split(",")):
        c = R.config(name, args)
        steps = max(c["warmup"] + c["timed"], c["curve"])
        runs = {w: run_world(w, args, recsys_worker, c, c["batch"], steps) for w in worlds}
        curves = {w: (runs[w][0][:c["curve"]], run_world(1, args, recsys_worker, c, c["batch"] * w, c["curve"])[0])
                  for w in worlds if w > 1 and c["curve"]}
        r, cr = R.summarize(c, runs, curves)
        rows += r
        crows += cr
        notes.append(f"{c['label']}: histories of {c['min_len']}..{c['max_len']} items, {c['batch']} users per GPU, "
                     f"{c['negatives']} negatives")
    rep = C.Report("distributed_recsys", "HSTU recommender: training step on 1 and N GPUs (data-parallel)")
    rep.notes += notes
    rep.notes.append(f"{'fp32 on CPU (gloo)' if args.cpu else 'bf16 STU stack, NCCL'}; item table sharded over the "
                     "GPUs (Adam), dense part under DistributedDataParallel (summed gradients), dropout off; one "
                     "process per GPU with its share of the host's cores as CPU threads; step: wall time of "
                     "Trainer.step (ends with the loss on the host), median of the timed steps after 5 warm-up "
                     "steps; tokens/s: the timed steps' tokens over their time; loss curves: the small "
                     "configuration only (one GPU at N times the per-GPU batch)")
    rep.table("Training step (per-GPU batch fixed)",
              ["model", "GPUs", "users per GPU", "global batch", "step ms", "tokens per GPU per step",
               "tokens/s per GPU", "tokens/s", "per-GPU tokens/s vs 1 GPU"], rows)
    rep.table("Loss curve: N GPUs against 1 GPU on the same global batch",
              ["model", "GPUs", "global batch", "steps", "1 GPU first loss", "1 GPU last loss", "N GPUs last loss",
               "max relative difference"], crows)
    return rep


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes (a smoke run)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few steps")
    ap.add_argument("--worlds", default="1,2", help="world sizes to run (default 1,2)")
    ap.add_argument("--ids-per-rank", type=int, default=None)
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--recsys", action="store_true",
                    help="the HSTU recommender's data-parallel training step and loss curve instead")
    ap.add_argument("--configs", default="small,b,a",
                    help="with --recsys: model configurations (small, b, a; default all three)")
    args = ap.parse_args()
    args.dim = 16 if args.quick else 128
    args.ids_per_rank = args.ids_per_rank or (64 * 64 if args.quick else 1 << 20)
    args.universe = 10**9
    args.capacity = 1 << 16 if args.quick else 1 << 24
    args.warmup, args.steps = (2, 3) if args.quick else (20, 20)
    worlds = [int(w) for w in args.worlds.split(",")]
    if not args.cpu:
        if torch.cuda.device_count() < max(worlds):
            print(f"bench_distributed: needs {max(worlds)} CUDA GPUs (or --cpu)")
            return 1
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    if args.recsys:
        if 1 not in worlds:
            worlds = [1] + worlds
        rep = recsys(args, worlds)
        C.TIMER = "wall time of a training step, median of the timed steps"
        return _emit(rep, args)
    per = {w: run_world(w, args) for w in worlds}
    rep = C.Report("distributed", "Sharded dynamic embeddings: training step on 1 and N GPUs")
    rep.notes.append(f"{args.ids_per_rank} ids per rank in bags of 64, dim {args.dim}, Zipf(s={ZIPF_S}) ids over "
                     f"1e9 keys, {args.capacity} slots per rank (LRU), fp32 rows, sum pooling; "
                     f"{'gloo on CPU' if args.cpu else 'NCCL'}; step: wall time, median of {args.steps} steps; "
                     "rows on the wire: the rows' and gradients' dtype in the exchange (comm_dtype; bfloat16 "
                     "rounds them, fp32 is exact); vs 1 GPU: against one GPU's fp32 step")
    rep.notes.append("a2a: the step's all-to-alls (counts, ids, rows, gradients), each timed from a barrier "
                     "with the device synchronized around it, in separate steps (median of 5); raw a2a: "
                     "all_to_all_single on plain buffers of each exchange's own split sizes, timed the same way "
                     "in the same run; a2a GB/s: bytes sent to other ranks over the time; partial-sum rows: the "
                     "partial bags a rank receives from the other owners with exchange='partial_sums'")
    rows = []
    base = {}
    for w in worlds:
        for i, (opt, exchange, comm) in enumerate(CONFIGS):
            rs = [per[w][r][i] for r in range(w)]
            step = max(r["step_s"] for r in rs)
            ids = sum(r["n"] for r in rs)
            a2a = max(r["a2a_s"] for r in rs)
            a2a_b = sum(r["a2a_bytes"] for r in rs) / w
            raw_s = max(r["raw_s"] for r in rs)
            raw_b = sum(r["raw_bytes"] for r in rs) / w
            gbs = a2a_b / a2a / 1e9 if w > 1 and a2a > 0 else None
            raw_gbs = raw_b / raw_s / 1e9 if w > 1 and raw_s > 0 else None
            uniq = sum(r["uniq"] for r in rs) / w
            # against one GPU's step with the exact exchange (at one GPU the rows' rounding is all it adds)
            key = (opt, exchange)
            if w == 1 and comm is None:
                base[key] = ids / step
            wire = "fp32" if comm is None else str(comm).replace("torch.", "")
            rows.append([w, opt, exchange, wire, C.fmt(step * 1e3, 2), C.fmt(ids / step / w / 1e6, 2),
                         C.fmt(ids / step / 1e6, 2), f"{ids / step / base[key]:.2f}x" if key in base else "-",
                         C.fmt(a2a * 1e3, 2), C.fmt(a2a_b / 1e6, 1), C.fmt(gbs, 1), C.fmt(raw_gbs, 1),
                         f"{gbs / raw_gbs:.0%}" if gbs and raw_gbs else "-",
                         C.fmt(uniq, 0), C.fmt(rs[0]["partial_rows"], 0)])
    rep.table("Training step (per-GPU batch fixed)",
              ["GPUs", "opt", "bags' exchange", "rows on the wire", "step ms", "M ids/s per GPU", "M ids/s", "vs 1 GPU", "a2a ms", "a2a MB sent",
               "a2a GB/s", "raw a2a GB/s", "a2a / raw", "distinct ids per rank", "partial-sum rows per rank"],
              rows)
    C.TIMER = "wall time per step with the device synchronized, median of the timed steps"
    return _emit(rep, args)


def _emit(rep, args):
    text = rep.markdown(C.command_line())
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
