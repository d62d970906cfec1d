"""The HSTU recommender's training step (forward, backward, the table's fused optimizer, the dense Adam)
on torchfuse against the same model in plain PyTorch (nn.Embedding tables with sparse SGD/Adam, eager
padded HSTU attention, GR's sampled-softmax formulation), at
two published configurations; and serving: scoring d new events per user from the K/V cache against
re-encoding the whole history.

  (a) NVIDIA's HSTU training config: 8 layers, embedding 1024, 4 heads x 256, lengths U[N/2, N], N = 4096
  (b) generative-recommenders' MovieLens-20M HSTU-large: 16 layers, embedding 256, 8 heads x 32, histories
      up to 200, batch 128, 128 negatives

MFU = model FLOPs per step / step time / the dense bf16 tensor peak (989 TFLOP/s, H100 and H200 SXM):
every GEMM 2MNK (backward 2x forward); causal attention 2 * 2 * H * (Dqk + Dv) / 2 * sum(len^2) forward,
2.5x that backward; the loss's similarities 2 * T * (R + 1) * E forward, 2x backward.

    python benchmarks/bench_recsys.py [--quick] [--configs a,b] [--parts train,serve] [--peers DIR]
                                      [--out results.md]

--peers: a folder holding generative_recommenders/ (fetched code, never committed): the same model with
its STU stack replaced by GR's STUStack on GR's Triton kernels (same weights; bf16 parameters, as GR
trains them).
"""
import math
import sys
import time

import torch

from torchfuse import reference
from torchfuse.recsys import data
from torchfuse.recsys.model import HSTURecommender, HSTURecommenderConfig
from torchfuse.recsys.reference import ReferenceRecommender
from torchfuse.recsys.train import Trainer, TrainConfig

import _common as C

# name, layers, embedding, heads, head dim, max length, batch, min length fraction, negatives
CONFIGS = {
    "a": ("(a) NVIDIA: 8 x 1024, 4 x 256 heads, N 4096", 8, 1024, 4, 256, 4096, 32, 0.5, 128),
    "b": ("(b) GR ML-20M large: 16 x 256, 8 x 32 heads, N 200", 16, 256, 8, 32, 200, 128, 0.0, 128),
}


def model_flops(cfg, lengths, negatives):
    """Training FLOPs of one step (forward + backward) by the count in the module docstring."""
    _, layers, E, H, Dh, _, _, _, _ = cfg
    T = int(lengths.sum())
    gemm = layers * T * (2 * E * 4 * Dh * H + 2 * 3 * Dh * H * E)
    attn = layers * 2 * 2 * H * (2 * Dh) / 2 * float((lengths.double() ** 2).sum())
    loss = 2 * T * (negatives + 1) * E
    return 3 * gemm + 3.5 * attn + 3 * loss


def histories(cfg, users, seed=0):
    _, _, _, _, _, N, _, lo, _ = cfg
    return data.synthetic_histories(users, 100_000, min_len=max(2, int(lo * (N + 1))), max_len=N + 1,
                                    id_stride=1_000_003, seed=seed)


def gr_stack(path, model, cfg):
    """GR's STUStack on its Triton kernels with `model`'s STU weights (the state_dict keys are GR's),
    or None when GR does not import."""
    stu = C.import_peer("generative_recommenders.modules.stu", path) if path else None
    common = C.import_peer("generative_recommenders.common", path) if path else None
    if stu is None or common is None:
        return None
    common.set_use_runtime_max_seq_len(True)
    _, layers, E, H, Dh, _, _, _, _ = cfg
    gcfg = stu.STULayerConfig(embedding_dim=E, num_heads=H, hidden_dim=Dh, attention_dim=Dh, output_dropout_ratio=0.0,
                              target_aware=False)
    stack = stu.STUStack([stu.STULayer(gcfg) for _ in range(layers)])
    stack.load_state_dict(model.stack.state_dict())
    return stack.to("cuda", torch.bfloat16)


def step_time_ms(trainer, steps):
    for _ in range(2):
        trainer.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def train_results(cfg, batch, args, rep, variants):
    """Step times (ms, None where out of memory) of ``variants`` at ``batch``, and the step's (tokens,
    model FLOPs)."""
    title, layers, E, H, Dh, N, _, _, negs = cfg
    h = histories(cfg, users=batch * 4)
    train, _ = data.leave_one_out(h)
    mcfg = HSTURecommenderConfig(embedding_dim=E, num_layers=layers, num_heads=H, attention_dim=Dh, hidden_dim=Dh,
                                 max_seq_len=N, dropout=0.0, item_capacity=1 << 20, embedding_optimizer="sgd",
                                 embedding_lr=0.01, compute_dtype=torch.bfloat16)
    tcfg = TrainConfig(batch_size=batch, max_len=N, num_negatives=negs, lr=1e-4)
    catalog = torch.unique(h.items)
    steps = 3 if args.quick else 10
    results = {}
    model = HSTURecommender(mcfg, device="cuda")
    ours = Trainer(model, train, catalog, tcfg)
    b0 = data.window_batch(train, ours._users_for(0), max_len=N)  # the first step's batch
    lengths = b0.offsets[1:] - b0.offsets[:-1]
    flops = model_flops(cfg, lengths, negs)
    tokens = int(lengths.sum())

    def measure(label, make):
        trainer = None
        try:
            trainer = make()
            results[label] = step_time_ms(trainer, steps)
        except torch.OutOfMemoryError:
            results[label] = None
            rep.notes.append(f"{title}: {label} does not fit in memory at batch {batch}")
        finally:
            trainer = None
            torch.cuda.empty_cache()

    def plain(compiled):
        twin = ReferenceRecommender(model, catalog.cuda()).cuda().to(torch.bfloat16)
        if compiled:  # one compile with dynamic shapes, the parameters its inputs: shared by every layer
            fn = torch.compile(reference.stu_layer_reference, dynamic=True)
            for layer in twin.layers:
                layer.layer_fn = fn
        return Trainer(twin, train, catalog, tcfg, loss_fn=reference.sampled_softmax_loss,
                       sparse_optimizer=torch.optim.SGD(twin.sparse_parameters(), lr=0.01))

    def gr():
        stack = gr_stack(args.peers, model, cfg)
        if stack is None:
            raise RuntimeError("generative-recommenders does not import")
        peer = HSTURecommender(mcfg, device="cuda")
        peer.stack = stack
        return Trainer(peer, train, catalog, tcfg)

    makers = {"eager": lambda: plain(False), "torch.compile": lambda: plain(True), "GR Triton": gr}
    if "torchfuse" in variants:
        results["torchfuse"] = step_time_ms(ours, steps)
    for label in variants:
        if label != "torchfuse":
            measure(label, makers[label])
    gr_ms, eager_ms = results.get("GR Triton"), results.get("eager")
    if gr_ms and eager_ms and gr_ms > 10 * eager_ms:  # not a step time: Triton autotunes each batch's shapes
        rep.notes.append(f"{title}: GR's Triton STU stack took {gr_ms:.0f} ms per step, every step far from its "
                         "steady state (its Triton autotuning re-runs for each batch's shapes); left out")
        results["GR Triton"] = None
    model = ours = None
    torch.cuda.empty_cache()
    return results, tokens, flops


def run(args):
    rep = C.Report("recsys", "HSTU recommender: training step and cached serving")
    peak = C.tensor_peak_tflops()
    rep.roofline = f"dense bf16 tensor peak {peak} TFLOP/s (MFU column)" if peak else "-"
    variants = ["torchfuse", "eager", "torch.compile"] + (["GR Triton"] if args.peers else [])
    rep.peers = ["plain PyTorch (eager)", "torch.compile of the plain model's STU layers (dynamic shapes; one "
                 "compile shared by the layers; lookups, positions and loss eager)"] + \
        (["GR Triton STU stack"] if args.peers else [])
    rep.notes.append("timing here: training, wall time per step, the mean of 10 after 2 warm-up steps; serving, wall "
                     "time of one extend, the median of 9 after a first call that warms up (or records the CUDA "
                     "graph); full recompute, the timer above over encode")
    rows = []
    parts = (getattr(args, "parts", None) or "train,serve").split(",")
    names = args.configs.split(",") if getattr(args, "configs", None) else (["b"] if args.quick else ["b", "a"])
    names = names if "train" in parts else []
    for name in names:
        cfg = CONFIGS[name]
        title, batch = cfg[0], cfg[6]
        runs = [(batch, train_results(cfg, batch, args, rep, variants))]
        if runs[0][1][0].get("eager") is None:
            # the padded eager attention keeps B x H x N x N scores per layer: every variant again at the largest
            # batch (halving) at which eager fits
            b = batch // 2
            while b >= 1:
                eager = train_results(cfg, b, args, rep, ["eager"])[0]["eager"]
                if eager is not None:
                    results, tokens, flops = train_results(cfg, b, args, rep, [v for v in variants if v != "eager"])
                    results["eager"] = eager
                    runs.append((b, ({v: results[v] for v in variants}, tokens, flops)))
                    break
                b //= 2
        for b, (results, tokens, flops) in runs:
            for label in results:
                ms = results[label]
                mfu = None if ms is None or not peak else flops / (ms * 1e-3) / (peak * 1e12) * 100
                rows.append([title, label, b, tokens, C.fmt(ms, 2), C.fmt(None if ms is None else tokens / ms * 1e3, 0),
                             C.fmt(mfu, 1),
                             C.ratio(results[label], results["torchfuse"]) if label != "torchfuse" else "1.00x"])
    if rows:
        rep.table("Training step (bf16 STU stack, fp32 tables; SGD on the tables, Adam on the dense part)",
                  ["config", "model", "batch", "tokens", "step ms", "tokens/s", "MFU %", "torchfuse speed-up"], rows)
    if "serve" in parts:
        rep.table("Serving: d new events per user, histories of 4096 - 9d to 4096 - d events cached, config (a)'s "
                  "layer shape; cached: HSTURecommender.extend, eager and as a CUDA graph (cuda_graph=True); "
                  "full recompute: encode of the whole 4096-event histories",
                  ["users", "d", "cached ms", "cached, CUDA graph ms", "full recompute ms", "speed-up",
                   "speed-up, CUDA graph"], serving_rows(args))
    return rep


def serving_rows(args, cases=None):
    """Serving rows for each (users, d) of ``cases`` (default: users 1, 64, 256 by d 1, 8, 64)."""
    cfg = CONFIGS["a"]
    _, layers, E, H, Dh, N, _, _, _ = cfg
    layers = 2 if args.quick else layers
    mcfg = HSTURecommenderConfig(embedding_dim=E, num_layers=layers, num_heads=H, attention_dim=Dh, hidden_dim=Dh,
                                 max_seq_len=N, dropout=0.0, item_capacity=1 << 22, compute_dtype=torch.bfloat16)
    model = HSTURecommender(mcfg, device="cuda").eval()
    rows = []
    if cases is None:
        cases = [(u, d) for u in ([1, 64] if args.quick else [1, 64, 256]) for d in (1, 8, 64)]
    for users, d in cases:
        hist = N - 10 * d  # then 10 extends of d events: the first warms up (or records the graph), 9 timed
        items = torch.randint(1, 1 << 40, (users * N,), device="cuda")
        offsets = torch.arange(users + 1, device="cuda") * N
        hist_idx = (torch.arange(users, device="cuda").unsqueeze(1) * N + torch.arange(hist, device="cuda")).reshape(-1)
        hist_offsets = torch.arange(users + 1, device="cuda") * hist

        def new_events(i):
            start = hist + i * d
            return items[(torch.arange(users, device="cuda").unsqueeze(1) * N + start
                          + torch.arange(d, device="cuda")).reshape(-1)]

        try:
            cached = {}
            for graph in (False, True):
                model.prefill(items[hist_idx], hist_offsets, hist)
                times = []
                for i in range(10):
                    new = new_events(i)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model.extend(new, cuda_graph=graph)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                cached[graph] = sorted(times[1:])[4]  # the median of the 9 warm calls
            # the full recompute needs no cache: free it first (256 users' cache is ~34 GB at this shape)
            model.stack.reset_kv_cache()
            model.__dict__.pop("_extend_graphs", None)
            torch.cuda.empty_cache()
            with torch.no_grad():
                full_ms = C.bench_us(lambda: model.encode(items, offsets, N), quick=True) / 1e3
            rows.append([users, d, C.fmt(cached[False], 2), C.fmt(cached[True], 2), C.fmt(full_ms, 2),
                         C.ratio(full_ms, cached[False]), C.ratio(full_ms, cached[True])])
        except torch.OutOfMemoryError:
            rows.append([users, d, "out of memory", "-", "-", "-", "-"])
        finally:
            model.stack.reset_kv_cache()
            model._cached_lengths = None
            model.__dict__.pop("_extend_graphs", None)
            torch.cuda.empty_cache()
    return rows


def _add_args(ap):
    ap.add_argument("--configs", help="training configurations: a comma-separated subset of a,b")
    ap.add_argument("--parts", help="a comma-separated subset of train,serve (default both)")


if __name__ == "__main__":
    sys.exit(C.standalone("recsys", run, doc=__doc__,
                          add_args=_add_args))
