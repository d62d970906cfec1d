"""The recommender's pieces: the fused sampled-softmax loss (value and gradients) and one STU layer
(forward and input gradient), each against its plain-PyTorch formulation in torchfuse.reference."""
import torch

import torchfuse
from torchfuse import reference

from ._common import bench_row, close

FAMILY = "recsys"


def _loss_inputs(dev, dt, T=193, R=64, D=50):
    q, p = torch.randn(T, D, device=dev, dtype=dt), torch.randn(T, D, device=dev, dtype=dt)
    n = torch.randn(R, D, device=dev, dtype=dt)
    pos_ids = torch.randint(0, 40, (T,), device=dev)
    neg_ids = torch.randint(0, 40, (R,), device=dev)  # some negatives equal their row's positive: masked
    return (q, p, n), pos_ids, neg_ids


def _loss_checks(dev, dt):
    (q, p, n), pos_ids, neg_ids = _loss_inputs(dev, dt)
    out = []
    res, grads = {}, {}
    for kind, cast in (("ours", dt), ("lp", dt), ("ref", torch.float64)):
        ins = [t.detach().to(cast).requires_grad_() for t in (q, p, n)]
        fn = torchfuse.sampled_softmax_loss if kind == "ours" else reference.sampled_softmax_loss
        res[kind] = fn(*ins, 0.05, positive_ids=pos_ids, negative_ids=neg_ids)
        grads[kind] = torch.autograd.grad(res[kind], ins)
    out.append(close("sampled_softmax_loss", res["ours"], res["ref"], res["lp"], 2.0, dt, shape=(193, 64, 50)))
    for i, what in enumerate(("dquery", "dpositive", "dnegatives")):
        out.append(close(f"sampled_softmax_loss backward {what}", grads["ours"][i], grads["ref"][i], grads["lp"][i],
                         5.0, dt))
    return out


def _stu_checks(dev, dt):
    from torchfuse.nn import STULayer, STULayerConfig
    cfg = STULayerConfig(embedding_dim=64, num_heads=2, hidden_dim=32, attention_dim=32, output_dropout_ratio=0.0)
    layer = STULayer(cfg).to(dev, dt).eval()
    lengths = torch.tensor([17, 0, 1, 30, 9], device=dev)
    offsets = torchfuse.complete_cumsum(lengths)
    x = torch.randn(int(lengths.sum()), 64, device=dev, dtype=dt)
    params = {k: v.detach() for k, v in layer.state_dict().items()}
    ins = {k: x.detach().to(c).requires_grad_() for k, c in (("ours", dt), ("lp", dt), ("ref", torch.float64))}
    res = {"ours": layer(ins["ours"], lengths, offsets, 30, None)}
    for kind, cast in (("lp", dt), ("ref", torch.float64)):
        res[kind] = reference.stu_layer_reference(params, cfg, ins[kind], offsets, 30, dtype=cast)
    g = torch.randn(res["ref"].shape, device=dev, dtype=torch.float64)
    grads = {k: torch.autograd.grad(v, ins[k], g.to(v.dtype))[0] for k, v in res.items()}
    return [close("STULayer forward", res["ours"], res["ref"], res["lp"], 3.0, dt),
            close("STULayer backward dx", grads["ours"], grads["ref"], grads["lp"], 5.0, dt)]


def checks(ctx):
    return _loss_checks(ctx.device, ctx.dtype) + _stu_checks(ctx.device, ctx.dtype)


def bench(ctx):
    if ctx.device == "cuda":
        dt, (T, R, D) = torch.bfloat16, ((6400, 128, 256) if ctx.quick else (25600, 128, 256))
    else:
        dt, (T, R, D) = torch.float32, (1024, 128, 64)
    q, p = torch.randn(T, D, device=ctx.device, dtype=dt), torch.randn(T, D, device=ctx.device, dtype=dt)
    n = torch.randn(T, R, D, device=ctx.device, dtype=dt)
    with torch.no_grad():
        return bench_row(ctx, FAMILY, "sampled_softmax_loss fwd (per-row negatives)", (T, R, D), dt,
                         lambda: torchfuse.sampled_softmax_loss(q, p, n, 0.05),
                         lambda: reference.sampled_softmax_loss(q, p, n, 0.05), nbytes=n.numel() * n.element_size())
