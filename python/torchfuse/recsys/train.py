"""Train and evaluate an HSTU next-item recommender on torchfuse.

    python -m torchfuse.recsys.train --data synthetic --steps 300 --quick
    python -m torchfuse.recsys.train --data movielens:/path/to/ml-1m --steps 5000 --plot curves.png
    python -m torchfuse.recsys.train --quick --nproc 4 --batch-size 512   # 4 GPUs, 128 users each

Each step: one lookup of the batch's items, targets and sampled negatives in the item table (one
optimizer step of the table per backward), the STU stack over the jagged histories, the sampled-softmax
loss (``torchfuse.sampled_softmax_loss``), the dense optimizer. Evaluation: HR@10 and NDCG@10 of every
user's held-out last item by exact top-k over the whole catalog, next to the most-popular baseline.
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional

import torch

from . import data as _data
from . import metrics as _metrics
from .model import HSTURecommender, HSTURecommenderConfig

__all__ = ["Trainer", "TrainConfig", "main"]


@dataclasses.dataclass
class TrainConfig:
    batch_size: int = 128
    max_len: int = 50
    num_negatives: int = 128
    temperature: float = 0.05
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    # with a process_group: the dtype the sharded tables' rows and gradients cross the exchange in, or a
    # (forward, backward) pair (torchfuse.distributed.ShardedDynamicEmbedding's comm_dtype; None: the
    # tables' own, exact)
    comm_dtype: Optional[object] = None


def _fused_loss(*args, **kwargs):
    from .. import sampled_softmax_loss
    return sampled_softmax_loss(*args, **kwargs)


class Trainer:
    """The training state: model, dense optimizer, data order and step. Every random draw of step s
    (batch order, negatives, dropout) is a function of (seed, s), so a resumed run repeats the
    uninterrupted one."""

    def __init__(self, model: torch.nn.Module, train: _data.Histories, catalog: torch.Tensor, cfg: TrainConfig,
                 loss_fn: Callable = _fused_loss, dense_optimizer: Optional[torch.optim.Optimizer] = None,
                 sparse_optimizer: Optional[torch.optim.Optimizer] = None, process_group=None):
        self.model, self.train, self.cfg, self.loss_fn = model, train, cfg, loss_fn
        self.catalog = torch.unique(catalog)
        self.device = model.positions.weight.device
        # process_group: data-parallel over its ranks (recsys.distributed); cfg.batch_size is the global batch
        self.process_group = process_group
        self.rank, self.world = 0, 1
        self._forward = model.encode
        if process_group is not None:
            import torch.distributed as dist
            from .distributed import distribute
            if not isinstance(model, HSTURecommender):
                raise TypeError("Trainer: process_group needs an HSTURecommender")
            self.rank, self.world = dist.get_rank(process_group), dist.get_world_size(process_group)
            if cfg.batch_size < self.world:
                raise ValueError(f"Trainer: batch_size {cfg.batch_size} (the global batch) is smaller than the "
                                 f"{self.world} ranks")
            self.ddp = distribute(model, process_group, comm_dtype=cfg.comm_dtype)
            self._forward = self.ddp
        self.opt = dense_optimizer or torch.optim.Adam(model.dense_parameters(), lr=cfg.lr,
                                                        weight_decay=cfg.weight_decay)
        self.sparse_opt = sparse_optimizer  # the plain-PyTorch model's tables; the dynamic tables step themselves
        self.step_count = 0
        self.last_tokens = 0
        n_users = int((train.lengths >= 2).sum())
        if n_users == 0:
            raise ValueError("Trainer: no user has the 2 events a training example needs")
        self._batches_per_epoch = math.ceil(n_users / cfg.batch_size)
        self._cursor, self._iter = None, None

    def _epoch_iter(self, epoch: int) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
        return _data.batch_users(self.train, self.cfg.batch_size, generator=g)

    def _users_for(self, step: int) -> torch.Tensor:
        """The users of step ``step``'s global batch (data.batches' order)."""
        epoch, k = divmod(step, self._batches_per_epoch)
        if self._cursor != (epoch, k):  # a new epoch, or a resumed run: replay the epoch's order up to k
            self._iter = self._epoch_iter(epoch)
            for _ in range(k):
                next(self._iter)
        self._cursor = (epoch, k + 1)
        return next(self._iter)

    def step(self) -> float:
        cfg, m = self.cfg, self.model
        m.train()
        users = self._users_for(self.step_count)
        if self.world > 1:  # this rank's slice of the users, found before any item is gathered
            from .distributed import rank_users
            users, self.last_tokens = rank_users(self.train, users, self.rank, self.world, max_len=cfg.max_len)
        b = _data.window_batch(self.train, users, max_len=cfg.max_len)
        if self.world == 1:
            self.last_tokens = b.items.numel()  # the global batch's
        b = b.to(self.device)
        # the negatives are the same on every rank: each row's loss is then the single process's
        g = torch.Generator().manual_seed(cfg.seed * 7_919 + self.step_count)
        negs = self.catalog[torch.randint(0, self.catalog.numel(), (cfg.num_negatives,), generator=g)].to(self.device)
        torch.manual_seed((cfg.seed * 104_729 + self.step_count) * self.world + self.rank)  # dropout, per rank
        T = b.items.numel()
        ids = torch.cat([b.items, b.targets, negs])
        rows = m.items(ids) if isinstance(m, HSTURecommender) else m.item_rows(ids)
        q = self._forward(b.items, b.offsets, b.max_len, user_ids=b.user_ids, item_rows=rows[:T])
        loss = self.loss_fn(q, rows[T:2 * T], rows[2 * T:], cfg.temperature, positive_ids=b.targets,
                            negative_ids=negs)
        if self.world > 1:
            # this rank's share of the global mean: the ranks' gradients sum to the global batch's
            loss = loss * (T / self.last_tokens)
        self.opt.zero_grad(set_to_none=True)
        if self.sparse_opt is not None:
            self.sparse_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.sparse_opt is not None:
            self.sparse_opt.step()
        self.step_count += 1
        if self.world > 1:
            import torch.distributed as dist
            loss = loss.detach()
            dist.all_reduce(loss, group=self.process_group)
        return loss.item()

    @torch.no_grad()
    def evaluate(self, history: _data.Histories, targets: torch.Tensor, k: int = 10,
                 batch_size: int = 256) -> Dict[str, float]:
        m = self.model
        m.eval()
        item_ids = self.catalog.to(self.device)
        items = (m.item_vectors(item_ids) if isinstance(m, HSTURecommender) else
                 torch.nn.functional.normalize(m.item_rows(item_ids), dim=-1, eps=1e-6))
        queries = []
        for b in _data.windows(history, batch_size, max_len=self.cfg.max_len):
            b = b.to(self.device)
            y = m.encode(b.items, b.offsets, b.max_len, user_ids=b.user_ids)
            queries.append(y[b.offsets[1:] - 1])
        q = torch.cat(queries) if queries else items.new_empty((0, items.shape[1]))
        keep = history.lengths >= 1
        return _metrics.evaluate(q, items, item_ids, targets[keep].to(self.device), k=k)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step_count,
                "train_config": dataclasses.asdict(self.cfg)}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step_count = int(state["step"])
        self._cursor = None


def load_data(spec: str, *, quick: bool, seed: int):
    """(train histories, eval histories, eval targets, catalog ids) for 'synthetic' or 'movielens:PATH'."""
    if spec == "synthetic":
        users, items = (2000, 2000) if quick else (20000, 20000)
        h = _data.synthetic_histories(users, items, min_len=10, max_len=60, id_stride=1_000_003, seed=seed)
    elif spec.startswith("movielens:"):
        h = _data.load_movielens(spec.split(":", 1)[1])
    else:
        raise SystemExit(f"--data: expected 'synthetic' or 'movielens:PATH', got {spec!r}")
    train, targets = _data.leave_one_out(h)
    return train, train, targets, torch.unique(h.items)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m torchfuse.recsys.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="synthetic", help="'synthetic' or 'movielens:PATH' (ratings.dat or .csv)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 300 with --quick, else 3000)")
    p.add_argument("--quick", action="store_true", help="a small model and data set: under a minute on a GPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the STU stack's dtype (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dim", type=int, default=None, help="embedding dim")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--max-len", type=int, default=50)
    p.add_argument("--negatives", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="PATH", help="write the loss and HR@10 curves as a PNG")
    p.add_argument("--save", metavar="PATH", help="write a checkpoint (model, dynamic tables, optimizer, step)")
    p.add_argument("--resume", metavar="PATH", help="continue from a checkpoint written by --save")
    p.add_argument("--json", action="store_true", help="print the final table as JSON")
    p.add_argument("--nproc", type=int, default=1,
                   help="data-parallel processes (one per GPU, NCCL; gloo on CPU): the tables sharded, the dense "
                        "part under DistributedDataParallel, --batch-size the global batch split over them")
    p.add_argument("--comm-dtype", choices=["bfloat16", "float16"], default=None,
                   help="with --nproc > 1: the sharded tables' rows and gradients exchanged in this dtype (half "
                        "the bytes; rounded) instead of their own")
    return p.parse_args(argv)


def _progress(total: int):
    try:
        from tqdm import tqdm
        return tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
    except ImportError:
        return None


def main(argv: Optional[List[str]] = None) -> int:
    a = _parse(argv)
    if a.nproc < 1:
        raise SystemExit(f"--nproc: expected >= 1, got {a.nproc}")
    if a.nproc == 1:
        return _run(a)
    if a.save or a.resume:
        raise SystemExit("--save and --resume are single-process (the sharded tables checkpoint per rank: "
                         "torchfuse.distributed's state_dict)")
    if a.device.startswith("cuda") and torch.cuda.device_count() < a.nproc:
        raise SystemExit(f"--nproc {a.nproc}: only {torch.cuda.device_count()} CUDA devices")
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(a, tmp), nprocs=a.nproc, join=True)
    return 0


def _worker(rank: int, a, tmp: str) -> None:
    import torch.distributed as dist

    from .distributed import threads_per_process
    threads_per_process(a.nproc)
    cuda = a.device.startswith("cuda")
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        a.device = f"cuda:{rank}"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/pg", rank=rank,
                            world_size=a.nproc, **({"device_id": torch.device(a.device)} if cuda else {}))
    try:
        _run(a, dist.group.WORLD)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(a, process_group=None) -> int:
    world = a.nproc if process_group is not None else 1
    lead = process_group is None or torch.distributed.get_rank(process_group) == 0
    print_ = print if lead else (lambda *args, **kw: None)
    steps = a.steps if a.steps is not None else (300 if a.quick else 3000)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    dim = a.dim or (64 if a.quick else 128)
    head = dim // a.heads
    train, hist, targets, catalog = load_data(a.data, quick=a.quick, seed=a.seed)
    mcfg = HSTURecommenderConfig(embedding_dim=dim, num_layers=a.layers or 2, num_heads=a.heads, attention_dim=head,
                                 hidden_dim=head, max_seq_len=a.max_len, dropout=0.2,
                                 item_capacity=max(1 << 12, 2 * catalog.numel()), compute_dtype=dtype, seed=a.seed)
    model = HSTURecommender(mcfg, device=device)
    tcfg = TrainConfig(batch_size=a.batch_size, max_len=a.max_len, num_negatives=a.negatives,
                       temperature=a.temperature, lr=a.lr, seed=a.seed,
                       comm_dtype=getattr(torch, a.comm_dtype) if a.comm_dtype else None)
    trainer = Trainer(model, train, catalog, tcfg, process_group=process_group)
    if a.resume:
        trainer.load_state_dict(torch.load(a.resume, map_location=device, weights_only=False))
    eval_every = a.eval_every or max(1, steps // 5)
    popular, _ = _data.item_popularity(train)
    base = _metrics.most_popular_metrics(popular, targets, k=10)
    print_(f"torchfuse.recsys: {a.data}, {train.num_users} users, {catalog.numel()} items, {int(train.lengths.sum())} "
           f"events; {mcfg.num_layers} STU layers, dim {dim}, {a.heads} heads, {dtype}, "
           + (f"{world} processes ({device.type}, global batch {a.batch_size})" if world > 1 else f"{device}"))
    print_(f"most-popular baseline: HR@10 {base['hr@10']:.4f}  NDCG@10 {base['ndcg@10']:.4f}")
    curve, evals = [], []
    bar = _progress(steps - trainer.step_count) if lead else None
    t0, tokens = time.perf_counter(), 0
    while trainer.step_count < steps:
        loss = trainer.step()
        tokens += trainer.last_tokens
        curve.append((trainer.step_count, loss))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
        if trainer.step_count % eval_every == 0 or trainer.step_count == steps:
            m = trainer.evaluate(hist, targets)
            evals.append((trainer.step_count, m))
            msg = f"step {trainer.step_count}: loss {loss:.4f}  HR@10 {m['hr@10']:.4f}  NDCG@10 {m['ndcg@10']:.4f}"
            (bar.write(msg) if bar is not None else print_(msg))
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if a.save:
        torch.save(trainer.state_dict(), a.save)
    final = evals[-1][1] if evals else trainer.evaluate(hist, targets)
    n_steps = len(curve)
    table = {"steps": trainer.step_count, "step_ms": 1e3 * elapsed / max(n_steps, 1),
             "tokens_per_s": tokens / elapsed if elapsed > 0 else float("nan"),
             "processes": world, "tokens_per_s_per_process": tokens / elapsed / world if elapsed > 0 else float("nan"),
             "loss": curve[-1][1] if curve else float("nan"), "hr@10": final["hr@10"], "ndcg@10": final["ndcg@10"],
             "popular_hr@10": base["hr@10"], "popular_ndcg@10": base["ndcg@10"]}
    if not lead:
        return 0
    if a.json:
        print(json.dumps(table))
    elif world == 1:
        print("| steps | step (ms) | tokens/s | loss | HR@10 | NDCG@10 | most-popular HR@10 |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print(f"| {table['steps']} | {table['step_ms']:.1f} | {table['tokens_per_s']:.0f} | {table['loss']:.4f} | "
              f"{table['hr@10']:.4f} | {table['ndcg@10']:.4f} | {table['popular_hr@10']:.4f} |")
    else:
        print("| processes | steps | step (ms) | tokens/s | tokens/s per process | loss | HR@10 | NDCG@10 | "
              "most-popular HR@10 |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print(f"| {world} | {table['steps']} | {table['step_ms']:.1f} | {table['tokens_per_s']:.0f} | "
              f"{table['tokens_per_s_per_process']:.0f} | {table['loss']:.4f} | {table['hr@10']:.4f} | "
              f"{table['ndcg@10']:.4f} | {table['popular_hr@10']:.4f} |")
    if a.plot:
        _plot(a.plot, curve, evals, base)
    return 0


def _plot(path: str, curve, evals, base) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([s for s, _ in curve], [v for _, v in curve])
    ax1.set_xlabel("step")
    ax1.set_ylabel("sampled-softmax loss")
    ax2.plot([s for s, _ in evals], [m["hr@10"] for _, m in evals], marker="o", label="HSTU")
    ax2.axhline(base["hr@10"], color="gray", linestyle="--", label="most popular")
    ax2.set_xlabel("step")
    ax2.set_ylabel("HR@10")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {os.path.abspath(path)}")


if __name__ == "__main__":
    sys.exit(main())
