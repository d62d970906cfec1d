"""Sharded dynamic embeddings (torchfuse.distributed) in this process as a world of one (gloo, CPU
tensors, whatever the device): the exchange's whole path (owner hash, the all-to-alls, the owner's
find-or-insert, the gradients' way back, the fused optimizer) against a single-device table fed the
same batches. Several ranks and GPUs: tests/test_distributed.py and benchmarks/bench_distributed.py."""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist

import torchfuse
from torchfuse import optim as tfo

from ._common import Check, skipped

FAMILY = "distributed"


def _rows(table):
    keys, values = [], []
    for k, v, _, _ in table.export():
        keys.append(k)
        values.append(v)
    keys, values = torch.cat(keys), torch.cat(values)
    order = torch.argsort(keys)
    return keys[order], values[order]


def checks(ctx):
    op = "ShardedDynamicEmbeddingBag (world of 1, gloo)"
    if not dist.is_available():
        return [skipped(op, "torch.distributed is not available in this build")]
    if dist.is_initialized():
        return [skipped(op, "a process group already exists in this process")]
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "store"), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        try:
            return _compare(op)
        finally:
            dist.destroy_process_group()


def _compare(op):
    g = torch.Generator().manual_seed(0)
    cfg = dict(capacity=64, max_capacity=1 << 12, optimizer=tfo.Adam(lr=0.05), seed=3, bucket_size=8, device="cpu")
    sharded = torchfuse.distributed.ShardedDynamicEmbeddingBag(16, **cfg)
    single = torchfuse.DynamicEmbeddingBag(16, **cfg)
    err, big = 0.0, 0.0
    for _ in range(3):
        ids = torch.randint(0, 300, (48, 5), generator=g)
        w = torch.randn(48, 16, generator=g)
        outs = []
        for m in (sharded, single):
            out = m(ids)
            (out * w).sum().backward()
            outs.append(out.detach())
        err = max(err, (outs[0] - outs[1]).abs().max().item())
        big = max(big, outs[1].abs().max().item())
    k0, v0 = _rows(sharded.local)
    k1, v1 = _rows(single)
    same_keys = torch.equal(k0, k1)
    row_err = (v0 - v1).abs().max().item() if same_keys else float("inf")
    tol = 4 * torch.finfo(torch.float32).eps * max(1.0, big)
    return [Check(f"{op}: outputs over 3 training steps", "48x5 ids x 16", err, tol),
            Check(f"{op}: table rows after them (Adam)", f"{k1.numel()}x16", row_err,
                  4 * torch.finfo(torch.float32).eps * max(1.0, v1.abs().max().item()),
                  note="" if same_keys else "the tables hold different keys")]


def bench(ctx):
    return None  # one process has nothing to exchange: bench_distributed.py times 1 to N GPUs
