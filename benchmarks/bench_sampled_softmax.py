"""torchfuse.sampled_softmax_loss against GR's SampledSoftmaxLoss formulation (eager and torch.compile),
on one GPU: forward + backward time (median, CUDA events) and peak memory above the inputs.

Shapes: GR's MovieLens-20M recipe (batch 128 x 200 positions, 128 per-row negatives) at D = 256 and 50,
and shared negatives (an in-batch pool) at T = 25600, R = 8192.

    python benchmarks/bench_sampled_softmax.py [--quick] [--out results.md]
"""
import sys

import torch

import torchfuse
from torchfuse import reference

import _common as C

CASES = [  # (T, R, D, per_row)
    (25600, 128, 256, True),
    (25600, 128, 50, True),
    (25600, 8192, 256, False),
    (65536, 8192, 64, False),
]


def gr_loss(q, p, n, temperature, pos_ids, neg_ids):
    """generative-recommenders' SampledSoftmaxLoss.jagged_forward on gathered rows (weights 1)."""
    return reference.sampled_softmax_loss(q, p, n, temperature, positive_ids=pos_ids, negative_ids=neg_ids)


def fused(q, p, n, temperature, pos_ids, neg_ids):
    return torchfuse.sampled_softmax_loss(q, p, n, temperature, positive_ids=pos_ids, negative_ids=neg_ids)


def measure(fn, args, quick):
    """(forward + backward ms, peak MiB above the inputs), or (None, None) when it does not fit."""
    ins = args[:3]

    def step():
        loss = fn(*args)
        torch.autograd.grad(loss, ins)

    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        return C.bench_us(step, quick) / 1e3, peak
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, None


def run(args):
    rep = C.Report("sampled_softmax", "Sampled-softmax loss: forward + backward, bf16")
    rep.roofline = "- (GEMM-bound with shared negatives; memory-bound with per-row negatives)"
    rep.peers = ["GR's SampledSoftmaxLoss formulation (eager)", "torch.compile of it"]
    compiled = torch.compile(gr_loss)
    rows = []
    for T, R, D, per_row in CASES[:2] if args.quick else CASES:
        dev = "cuda"
        q, p = (torch.randn(T, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        n = torch.randn(*((T, R, D) if per_row else (R, D)), device=dev, dtype=torch.bfloat16, requires_grad=True)
        pos_ids = torch.randint(0, 1 << 20, (T,), device=dev)
        neg_ids = torch.randint(0, 1 << 20, (T, R) if per_row else (R,), device=dev)
        a = (q, p, n, 0.05, pos_ids, neg_ids)
        res = [measure(f, a, args.quick) for f in (fused, gr_loss, compiled)]
        (t_ours, m_ours), (t_eager, m_eager), (t_comp, m_comp) = res
        rows.append([T, R, D, "per row" if per_row else "shared", C.fmt(t_ours, 3), C.fmt(t_eager, 3),
                     C.fmt(t_comp, 3), C.ratio(t_eager, t_ours), C.ratio(t_comp, t_ours),
                     C.fmt(m_ours, 0), C.fmt(m_eager, 0), C.fmt(m_comp, 0)])
    rep.table("forward + backward (ms) and peak memory above the inputs (MiB)",
              ["T", "R", "D", "negatives", "torchfuse ms", "eager ms", "compile ms", "vs eager", "vs compile",
               "torchfuse MiB", "eager MiB", "compile MiB"], rows)
    return rep


if __name__ == "__main__":
    sys.exit(C.standalone("sampled_softmax", run, doc=__doc__))
