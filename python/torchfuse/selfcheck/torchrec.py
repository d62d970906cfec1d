"""TorchRec collections (torchfuse.torchrec): pooled and per-id lookups of a KeyedJaggedTensor
against F.embedding_bag / F.embedding over the same rows. With torchrec installed the inputs are
real KJTs and configs; without it, stand-ins with the same interface (the collections read only that)."""
import types

import torch
import torch.nn.functional as F

import torchfuse

from ._common import bench_row, close, exact

FAMILY = "torchrec"

TABLES = [  # name, dim, rows, features, pooling
    ("t_user", 12, 37, ["user", "friend"], "sum"),
    ("t_item", 20, 53, ["item", "click", "cart"], "mean"),
]


def _torchrec():
    try:
        import torchrec
        return torchrec
    except Exception:  # not installed, or its native libraries do not load here
        return None


def _configs(tables, bag):
    tr = _torchrec()
    if tr is None:
        return [types.SimpleNamespace(name=n, embedding_dim=d, num_embeddings=r, feature_names=list(f), pooling=p)
                for n, d, r, f, p in tables]
    if bag:
        return [tr.EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=list(f),
                                      pooling=tr.PoolingType.SUM if p == "sum" else tr.PoolingType.MEAN)
                for n, d, r, f, p in tables]
    return [tr.EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=list(f))
            for n, d, r, f, p in tables]


def _kjt(keys, values, lengths):
    tr = _torchrec()
    if tr is None:
        return torchfuse.torchrec.StandInKJT(keys, values, lengths)
    return tr.KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


def _batch(tables, B, device, max_len=6):
    """A KJT over every feature (ids are row indices, so the static reference can index with them),
    plus each feature's (ids, offsets)."""
    keys, vals, lens, per_feature = [], [], [], {}
    for _, _, rows, feats, _ in tables:
        for f in feats:
            ln = torch.randint(0, max_len + 1, (B,), device=device)
            ids = torch.randint(0, rows, (int(ln.sum()),), device=device)
            keys.append(f)
            vals.append(ids)
            lens.append(ln)
            per_feature[f] = (ids, torch.cat([ln.new_zeros(1), ln.cumsum(0)[:-1]]))
    return _kjt(keys, torch.cat(vals), torch.cat(lens)), per_feature


def _collection(cls, tables, rows, device):
    coll = cls(_configs(tables, cls is torchfuse.torchrec.DynamicEmbeddingBagCollection), device=device).eval()
    for name, w in rows.items():
        coll.tables[name].insert(torch.arange(w.shape[0], device=device), w)
    return coll


def checks(ctx):
    dev = ctx.device
    kind = "KeyedJaggedTensor" if _torchrec() is not None else "stand-in KJT"
    rows = {n: torch.randn(r, d, device=dev) for n, d, r, _, _ in TABLES}
    B = 7
    kjt, per_feature = _batch(TABLES, B, dev)
    out = []

    bags = _collection(torchfuse.torchrec.DynamicEmbeddingBagCollection, TABLES, rows, dev)
    with torch.no_grad():
        got = bags(kjt).values()
    ref, lp = [], []
    for n, _, _, feats, pool in TABLES:
        for f in feats:
            ids, off = per_feature[f]
            ref.append(F.embedding_bag(ids, rows[n].double(), off, mode=pool))
            lp.append(F.embedding_bag(ids, rows[n], off, mode=pool))
    out.append(close(f"DynamicEmbeddingBagCollection sum+mean ({kind})", got, torch.cat(ref, 1), torch.cat(lp, 1),
                     2.0, torch.float32))

    coll = _collection(torchfuse.torchrec.DynamicEmbeddingCollection, TABLES, rows, dev)
    with torch.no_grad():
        got = coll(kjt)
    g, r = [], []
    for n, _, _, feats, _ in TABLES:
        for f in feats:
            g.append(got[f].values().flatten())
            r.append(F.embedding(per_feature[f][0], rows[n]).flatten())
    out.append(exact(f"DynamicEmbeddingCollection rows ({kind})", torch.cat(g), torch.cat(r),
                     shape=(sum(x.numel() for x in g),)))
    return out


def bench(ctx):
    dev = ctx.device
    B, rows_n, dim = (4096, 1 << 18, 128) if dev == "cuda" else (512, 1 << 14, 64)
    tables = [(f"t{i}", dim, rows_n, [f"f{i}a", f"f{i}b"], "sum") for i in range(4)]
    rows = {n: torch.randn(r, d, device=dev) for n, d, r, _, _ in tables}
    kjt, per_feature = _batch(tables, B, dev, max_len=20)
    bags = _collection(torchfuse.torchrec.DynamicEmbeddingBagCollection, tables, rows, dev)
    order = [(n, f) for n, _, _, feats, _ in tables for f in feats]

    def eager():  # static tables: one embedding_bag per feature, then the KeyedTensor's layout
        return torch.cat([F.embedding_bag(per_feature[f][0], rows[n], per_feature[f][1], mode="sum")
                          for n, f in order], 1)

    n_ids = sum(per_feature[f][0].numel() for _, f in order)
    nbytes = n_ids * (dim * 4 + 8) + B * len(order) * dim * 4  # read the rows and ids, write the pooled
    with torch.no_grad():
        return bench_row(ctx, FAMILY, "DynamicEmbeddingBagCollection fwd", f"{len(order)}f x {B}b x {dim}",
                         torch.float32, lambda: bags(kjt), eager, nbytes=nbytes)
