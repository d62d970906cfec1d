"""Dynamic embeddings: insert / find, one training step (SGD and Adagrad) and pooled bags, against
nn.Embedding / nn.EmbeddingBag holding the same rows."""
import torch
import torch.nn.functional as F

import torchfuse

from ._common import bench_row, close, exact

FAMILY = "dynamic_embedding"


def _keys(n, device):
    """n distinct int64 keys spread over the whole range (hash-table keys, not indices)."""
    k = torch.unique(torch.randint(-2**62, 2**62, (2 * n,), dtype=torch.int64))[:n]
    return k[torch.randperm(k.numel())].to(device)


def _train_reference(rows, idx, g, opt, lr, steps_dtype):
    """nn.Embedding over the same rows, one torch.optim step; returns (forward, rows after)."""
    emb = torch.nn.Embedding.from_pretrained(rows.to(steps_dtype), freeze=False)
    optim = torch.optim.SGD(emb.parameters(), lr=lr) if opt == "SGD" else torch.optim.Adagrad(emb.parameters(), lr=lr)
    out = emb(idx)
    (out * g.to(steps_dtype)).sum().backward()
    optim.step()
    return out.detach(), emb.weight.detach()


def checks(ctx):
    dev = ctx.device
    n, dim, lr = 300, 40, 0.1
    keys = _keys(n, dev)
    rows = torch.randn(n, dim, device=dev)
    absent = _keys(50, dev)
    absent = absent[~torch.isin(absent, keys)]
    out = []

    table = torchfuse.DynamicEmbedding(dim, 1024, device=dev)
    table.insert(keys, rows)
    got, found = table.find(keys)
    out.append(exact("DynamicEmbedding insert + find", got, rows))
    out.append(exact("DynamicEmbedding find: found mask", found.float(), torch.ones(n, device=dev)))
    got, found = table.find(absent)
    out.append(exact("DynamicEmbedding find of absent keys", torch.cat([got.flatten(), found.float()]),
                     torch.zeros(got.numel() + found.numel(), device=dev), shape=got.shape))

    idx = torch.randint(0, n, (700,), device=dev)  # with repeats: their gradients add up
    g = torch.randn(700, dim, device=dev)
    for name, opt in (("SGD", torchfuse.optim.SGD(lr=lr)), ("Adagrad", torchfuse.optim.Adagrad(lr=lr))):
        table = torchfuse.DynamicEmbedding(dim, 1024, device=dev, optimizer=opt)
        table.insert(keys, rows)
        fwd = table(keys[idx])
        (fwd * g).sum().backward()
        after = table.find(keys)[0]
        ref_fwd, ref_rows = _train_reference(rows, idx, g, name, lr, torch.float64)
        lp_fwd, lp_rows = _train_reference(rows, idx, g, name, lr, torch.float32)
        out.append(exact(f"DynamicEmbedding forward ({name} table)", fwd, lp_fwd))
        out.append(close(f"DynamicEmbedding training step ({name}): rows", after, ref_rows, lp_rows, 2.0,
                         torch.float32))

    bag = torchfuse.DynamicEmbeddingBag(dim, 1024, device=dev, mode="mean").eval()
    bag.insert(keys, rows)
    offsets = torch.tensor([0, 3, 3, 10, 64, 200], device=dev)  # an empty bag among them
    with torch.no_grad():
        got = bag(keys[idx[:300]], offsets)
    ref = F.embedding_bag(idx[:300], rows.double(), offsets, mode="mean")
    lp = F.embedding_bag(idx[:300], rows, offsets, mode="mean")
    out.append(close("DynamicEmbeddingBag mean (eval)", got, ref, lp, 2.0, torch.float32))
    return out


def bench(ctx):
    dev = ctx.device
    n_keys, batch, dim = (1 << 20, 1 << 16, 128) if dev == "cuda" else (1 << 16, 1 << 13, 64)
    keys = _keys(n_keys, dev)
    rows = torch.randn(n_keys, dim, device=dev)
    table = torchfuse.DynamicEmbedding(dim, 2 * n_keys, device=dev).eval()
    table.insert(keys, rows, unique=True)
    ids = keys[torch.randint(0, n_keys, (batch,), device=dev)]
    # plain PyTorch's hash-free lookup: keys kept sorted, binary search, gather, absent -> 0
    sorted_keys, order = torch.sort(keys)
    rows_sorted = rows[order]

    def eager():
        pos = torch.searchsorted(sorted_keys, ids).clamp_(max=n_keys - 1)
        hit = sorted_keys[pos] == ids
        return rows_sorted[pos] * hit.unsqueeze(1)

    nbytes = batch * (dim * 4 * 2 + 8)  # read the rows and ids, write the rows
    with torch.no_grad():
        return bench_row(ctx, FAMILY, "find (lookup)", (batch, dim), torch.float32, lambda: table.find(ids),
                         eager, nbytes=nbytes)
