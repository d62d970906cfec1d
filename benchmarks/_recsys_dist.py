"""bench_distributed.py --recsys: the HSTU recommender's training step on 1 and N GPUs (tables
sharded, dense part under DDP) at the same per-GPU batch, and the loss curve of N GPUs against one
GPU on the same global batch."""
import statistics
import time

import torch
import torch.distributed as dist

from bench_recsys import CONFIGS as _RECSYS  # (a) and (b): the single-GPU benchmark's configurations

# name: (label, layers, embedding, heads, head dim, max history, users per GPU, shortest history as a
# fraction of the longest, negatives) as in bench_recsys.py, then the users in the data and whether a
# loss curve runs. "small" is a model whose step is short enough for the fixed costs of data
# parallelism (the exchanges, the host's batch work) to show.
CONFIGS = {
    "small": ("small: 4 x 256, 4 x 64 heads, N 512", 4, 256, 4, 64, 512, 64, 0.125, 512, 16384, True),
    "b": _RECSYS["b"] + (16384, False),
    "a": _RECSYS["a"] + (2048, False),
    "tiny": ("tiny (--quick)", 2, 32, 2, 16, 64, 8, 0.125, 64, 1024, True),
}


def config(name, args):
    """Model, data and step counts of one configuration."""
    label, layers, dim, heads, head_dim, max_len, batch, lo, negs, users, curve = CONFIGS[name]
    quick = name == "tiny"
    return dict(name=name, label=label, dim=dim, layers=layers, heads=heads, head_dim=head_dim, max_len=max_len,
                batch=batch, min_len=max(2, int(lo * (max_len + 1))), negatives=negs, users=users, items=100_000,
                warmup=2 if quick else 5, timed=4 if quick else 15, curve=(6 if quick else 20) if curve else 0)


def worker(rank, world, dev, args, c, per_rank_batch, steps):
    """Run `steps` training steps at `per_rank_batch` users per rank (global batch x world); return
    (per-step global loss, per-step wall seconds, per-step global tokens) from this rank."""
    from torchfuse.recsys import HSTURecommender, HSTURecommenderConfig, leave_one_out, synthetic_histories
    from torchfuse.recsys.train import TrainConfig, Trainer
    h = synthetic_histories(c["users"], c["items"], min_len=c["min_len"], max_len=c["max_len"] + 1,
                            id_stride=1_000_003, seed=0)
    train, _ = leave_one_out(h)
    catalog = torch.unique(h.items)
    # dropout off: the N-GPU and 1-GPU curves then differ only by rounding (a dropout mask depends on
    # which rank holds a row)
    mcfg = HSTURecommenderConfig(embedding_dim=c["dim"], num_layers=c["layers"], num_heads=c["heads"],
                                 attention_dim=c["head_dim"], hidden_dim=c["head_dim"], max_seq_len=c["max_len"],
                                 dropout=0.0, item_capacity=1 << 18, item_initial_capacity=1 << 17,
                                 compute_dtype=torch.float32 if args.cpu else torch.bfloat16, seed=0)
    model = HSTURecommender(mcfg, device=dev)
    tcfg = TrainConfig(batch_size=per_rank_batch * world, max_len=c["max_len"], num_negatives=c["negatives"],
                       lr=1e-3, seed=0)
    tr = Trainer(model, train, catalog, tcfg, process_group=dist.group.WORLD if world > 1 else None)
    losses, secs, tokens = [], [], []
    for _ in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        losses.append(tr.step())  # .item(): the step has finished on the device
        secs.append(time.perf_counter() - t0)
        tokens.append(tr.last_tokens)
    return losses, secs, tokens


def summarize(c, runs, curves):
    """runs: {world: (losses, secs, tokens)} at the same per-GPU batch; curves: {world: (losses of
    world GPUs, losses of 1 GPU on the same global batch)}. Returns (timing rows, curve rows)."""
    rows, base = [], None
    for w, (losses, secs, tokens) in sorted(runs.items()):
        t_secs, t_tok = secs[c["warmup"]:], tokens[c["warmup"]:]
        tps = sum(t_tok) / sum(t_secs)
        if w == 1:
            base = tps
        rows.append([c["label"], w, c["batch"], c["batch"] * w, f"{statistics.median(t_secs) * 1e3:.1f}",
                     f"{sum(t_tok) / len(t_tok) / w:.0f}", f"{tps / w:.0f}", f"{tps:.0f}",
                     f"{tps / w / base:.0%}" if base else "-"])
    crows = []
    for w, (got, ref) in sorted(curves.items()):
        rel = [abs(a - b) / abs(b) for a, b in zip(got, ref)]
        crows.append([c["label"], w, c["batch"] * w, len(rel), f"{ref[0]:.4f}", f"{ref[-1]:.4f}", f"{got[-1]:.4f}",
                      f"{max(rel):.2e}"])
    return rows, crows
