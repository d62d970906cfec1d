"""torchfuse.torchrec: dynamic embedding collections against TorchRec's static ones (or, without
torchrec, against a plain nn.EmbeddingBag reference of the same semantics)."""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse.torchrec import StandInKJT
from torchfuse import torchrec as tftr

try:
    import torchrec  # noqa: F401
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    HAVE_TORCHREC = True
except Exception:  # not installed here: the stand-ins below cover the interface
    HAVE_TORCHREC = False


def make_kjt(keys, values, lengths, weights=None, real=False):
    if real:
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)
    return StandInKJT(keys, values, lengths, weights)


KJT_KINDS = ["standin"] + (["torchrec"] if HAVE_TORCHREC else [])

# Two tables with several features each; SUM and MEAN; non-round dims.
TABLES = [
    dict(name="t_user", embedding_dim=12, num_embeddings=37, feature_names=["user", "friend"], pooling="sum"),
    dict(name="t_item", embedding_dim=20, num_embeddings=53, feature_names=["item", "click", "cart"], pooling="mean"),
]


def configs(bag=True):
    if HAVE_TORCHREC:
        if bag:
            return [EmbeddingBagConfig(name=t["name"], embedding_dim=t["embedding_dim"],
                                       num_embeddings=t["num_embeddings"], feature_names=list(t["feature_names"]),
                                       pooling=PoolingType.SUM if t["pooling"] == "sum" else PoolingType.MEAN)
                    for t in TABLES]
        return [EmbeddingConfig(name=t["name"], embedding_dim=t["embedding_dim"], num_embeddings=t["num_embeddings"],
                                feature_names=list(t["feature_names"])) for t in TABLES]
    return [SimpleNamespace(**copy.deepcopy(t)) for t in TABLES]


def features_of():
    return [f for t in TABLES for f in t["feature_names"]]


def random_batch(B, device, key_order=None, max_len=5, id_range=None, weighted=False, real=False):
    """A KJT over every feature; ids below each table's num_embeddings unless id_range is given."""
    keys = key_order or features_of()
    n_emb = {f: t["num_embeddings"] for t in TABLES for f in t["feature_names"]}
    lengths = torch.randint(0, max_len + 1, (len(keys) * B,))
    if B:
        lengths[0] = 0  # an empty bag
    vals = []
    for i, k in enumerate(keys):
        n = int(lengths[i * B:(i + 1) * B].sum())
        hi = id_range if id_range is not None else n_emb[k]
        vals.append(torch.randint(0, hi, (n,)))
    values = torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)
    weights = torch.rand(values.numel()) if weighted else None
    return make_kjt(keys, values.to(device), lengths.to(device),
                    None if weights is None else weights.to(device), real=real)


def reference_pooled(weights_by_table, kjt, is_weighted):
    """(B, sum dims) float32 with plain F.embedding_bag per feature, in TorchRec's layout."""
    keys = kjt.keys()
    B = kjt.stride()
    offsets = kjt.offsets()
    w = kjt.weights_or_none() if is_weighted else None
    outs = []
    for t in TABLES:
        for f in t["feature_names"]:
            i = keys.index(f)
            o = offsets[i * B:(i + 1) * B + 1]
            lo, hi = int(o[0]), int(o[-1])
            ids = kjt.values()[lo:hi]
            psw = w[lo:hi] if w is not None else None
            outs.append(F.embedding_bag(ids, weights_by_table[t["name"]], o - lo, mode=t["pooling"],
                                        per_sample_weights=psw, include_last_offset=True).float())
    return torch.cat(outs, 1)


def build_dynamic_from(weights_by_table, device, **kw):
    ebc = tftr.DynamicEmbeddingBagCollection(configs(), device=device, **kw)
    for name, w in weights_by_table.items():
        ebc.tables[name].insert(torch.arange(w.shape[0], device=device), w)
    return ebc


@pytest.mark.parametrize("kind", KJT_KINDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_bag_collection_matches_reference(device, kind, weighted):
    weights = {t["name"]: torch.randn(t["num_embeddings"], t["embedding_dim"], device=device) for t in TABLES}
    ebc = build_dynamic_from(weights, device)
    ebc.eval()
    B = 7
    # keys in an order other than the tables' (features of one table not adjacent)
    order = ["item", "user", "cart", "friend", "click"]
    kjt = random_batch(B, device, key_order=order, weighted=weighted, real=(kind == "torchrec"))
    if weighted:
        with pytest.raises(ValueError, match="MEAN"):
            ebc(kjt)
        return
    with torch.no_grad():
        out = ebc(kjt)
    ref = reference_pooled(weights, kjt, weighted)
    assert out.keys() == features_of()
    assert out.length_per_key() == [12, 12, 20, 20, 20]
    assert out.values().shape == (B, 84) and out.values().dtype == torch.float32
    torch.testing.assert_close(out.values(), ref, rtol=1e-6, atol=1e-6)
    # to_dict splits by key as TorchRec does
    d = out.to_dict()
    torch.testing.assert_close(d["click"], ref[:, 44:64])


@pytest.mark.parametrize("kind", KJT_KINDS)
def test_weighted_sum(device, kind):
    tables = [SimpleNamespace(name="t", embedding_dim=9, num_embeddings=31, feature_names=["a", "b"], pooling="sum")]
    if HAVE_TORCHREC:
        tables = [EmbeddingBagConfig(name="t", embedding_dim=9, num_embeddings=31, feature_names=["a", "b"])]
    w = torch.randn(31, 9, device=device)
    ebc = tftr.DynamicEmbeddingBagCollection(tables, device=device)
    ebc.tables["t"].insert(torch.arange(31, device=device), w)
    ebc.eval()
    B = 5
    lengths = torch.randint(0, 4, (2 * B,), device=device)
    n = int(lengths.sum())
    kjt = make_kjt(["a", "b"], torch.randint(0, 31, (n,), device=device), lengths,
                   torch.rand(n, device=device), real=(kind == "torchrec"))
    with torch.no_grad():
        out = ebc(kjt).values()
    off = kjt.offsets()
    ref = F.embedding_bag(kjt.values(), w, off, mode="sum", per_sample_weights=kjt.weights_or_none(),
                          include_last_offset=True).view(2, B, 9).transpose(0, 1).reshape(B, 18)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


class _Model(torch.nn.Module):
    def __init__(self, ebc, width):
        super().__init__()
        self.sparse = ebc
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 17), torch.nn.ReLU(), torch.nn.Linear(17, 1))

    def forward(self, kjt):
        return self.mlp(self.sparse(kjt).values())


def _static_model(device):
    """A TorchRec model (EmbeddingBagCollection + MLP), or its stand-in without torchrec."""
    if HAVE_TORCHREC:
        ebc = EmbeddingBagCollection(tables=configs(), device=torch.device(device))
    else:
        ebc = _StandInEBC(configs(), device)
    for t in ebc.embedding_bags.values():
        torch.nn.init.normal_(t.weight)
    return _Model(ebc, 84).to(device)


class _StandInEBC(torch.nn.Module):
    """TorchRec's EmbeddingBagCollection semantics with plain nn.EmbeddingBag (named as TorchRec's, so
    swap_embedding_modules recognises it without torchrec installed)."""

    def __init__(self, tables, device):
        super().__init__()
        self._tables = tables
        self.embedding_bags = torch.nn.ModuleDict({
            t.name: torch.nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling,
                                          include_last_offset=True, device=device) for t in tables})

    def embedding_bag_configs(self):
        return self._tables

    def is_weighted(self):
        return False

    def forward(self, kjt):
        w = {n: m.weight for n, m in self.embedding_bags.items()}
        return tftr.KeyedTensor(features_of(), [12, 12, 20, 20, 20], reference_pooled(w, kjt, False))


_StandInEBC.__name__ = "EmbeddingBagCollection"


def test_swap_same_outputs_then_grow_and_train(device):
    lr = 0.05
    static = _static_model(device)
    dynamic = copy.deepcopy(static)
    replaced = tftr.swap_embedding_modules(dynamic, optimizer=torchfuse.optim.SGD(lr=lr), capacity=512)
    assert list(replaced) == ["sparse"]
    assert isinstance(dynamic.sparse, tftr.DynamicEmbeddingBagCollection)
    real = HAVE_TORCHREC
    # same outputs on ids inside the static ranges
    kjt = random_batch(6, device, real=real)
    with torch.no_grad():
        torch.testing.assert_close(dynamic(kjt), static(kjt), rtol=1e-5, atol=1e-5)
    # training steps: fused SGD in the tables + torch SGD on the MLP == torch SGD on everything
    opt_s = torch.optim.SGD(static.parameters(), lr=lr)
    opt_d = torch.optim.SGD(dynamic.mlp.parameters(), lr=lr)
    for step in range(4):
        kjt = random_batch(9, device, real=real)
        target = torch.randn(9, 1, device=device)
        loss_s = F.mse_loss(static(kjt), target)
        opt_s.zero_grad()
        loss_s.backward()
        opt_s.step()
        loss_d = F.mse_loss(dynamic(kjt), target)
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        torch.testing.assert_close(loss_d, loss_s, rtol=1e-5, atol=1e-6)
    for t in TABLES:
        ids = torch.arange(t["num_embeddings"], device=device)
        rows, found = dynamic.sparse.tables[t["name"]].find(ids)
        assert bool(found.all())
        torch.testing.assert_close(rows, static.sparse.embedding_bags[t["name"]].weight.detach(), rtol=1e-5, atol=1e-6)
    # ids outside the static ranges are inserted and trained
    table = dynamic.sparse.tables["t_user"]
    before = len(table)
    kjt = random_batch(4, device, id_range=10**12, real=real)
    loss = dynamic(kjt).square().sum()
    loss.backward()
    assert len(table) > before


def test_empty_features_and_empty_batch(device):
    weights = {t["name"]: torch.randn(t["num_embeddings"], t["embedding_dim"], device=device) for t in TABLES}
    ebc = build_dynamic_from(weights, device)
    # every bag empty
    keys = features_of()
    kjt = make_kjt(keys, torch.empty(0, dtype=torch.int64, device=device),
                   torch.zeros(len(keys) * 3, dtype=torch.int64, device=device))
    out = ebc(kjt)
    assert out.values().shape == (3, 84)
    assert bool((out.values() == 0).all())
    # B = 0
    kjt = make_kjt(keys, torch.empty(0, dtype=torch.int64, device=device),
                   torch.zeros(0, dtype=torch.int64, device=device))
    out = ebc(kjt)
    assert out.values().shape == (0, 84)


def test_embedding_collection(device):
    if HAVE_TORCHREC:
        cfgs = configs(bag=False)
    else:
        cfgs = [SimpleNamespace(name=t["name"], embedding_dim=t["embedding_dim"], num_embeddings=t["num_embeddings"],
                                feature_names=list(t["feature_names"])) for t in TABLES]
    ec = tftr.DynamicEmbeddingCollection(cfgs, device=device)
    weights = {t["name"]: torch.randn(t["num_embeddings"], t["embedding_dim"], device=device) for t in TABLES}
    for n, w in weights.items():
        ec.tables[n].insert(torch.arange(w.shape[0], device=device), w)
    ec.eval()
    kjt = random_batch(5, device, key_order=["cart", "user", "item", "friend", "click"], real=HAVE_TORCHREC)
    with torch.no_grad():
        out = ec(kjt)
    B = 5
    offsets = kjt.offsets()
    for t in TABLES:
        for f in t["feature_names"]:
            i = kjt.keys().index(f)
            o = offsets[i * B:(i + 1) * B + 1]
            ids = kjt.values()[int(o[0]):int(o[-1])]
            torch.testing.assert_close(out[f].values(), weights[t["name"]][ids])
            torch.testing.assert_close(out[f].lengths(), o[1:] - o[:-1])


def test_state_dict_round_trip(device):
    weights = {t["name"]: torch.randn(t["num_embeddings"], t["embedding_dim"], device=device) for t in TABLES}
    a = build_dynamic_from(weights, device, optimizer=torchfuse.optim.Adam(lr=0.01))
    kjt = random_batch(8, device, id_range=1000)
    a(kjt).values().sum().backward()
    sd = a.state_dict()
    b = tftr.DynamicEmbeddingBagCollection(configs(), device=device, optimizer=torchfuse.optim.Adam(lr=0.01))
    b.load_state_dict(sd)
    for name in weights:
        ka = sorted(torch.cat([k for k, *_ in a.tables[name].export()]).tolist())
        kb = sorted(torch.cat([k for k, *_ in b.tables[name].export()]).tolist())
        assert ka == kb
        ids = torch.tensor(ka, device=device)
        ra, fa = a.tables[name].find(ids)
        rb, fb = b.tables[name].find(ids)
        assert bool(fa.all()) and bool(fb.all())
        assert torch.equal(ra, rb)
    a.eval()
    b.eval()
    kjt = random_batch(8, device, id_range=1000)
    with torch.no_grad():
        assert torch.equal(a(kjt).values(), b(kjt).values())


def test_bad_inputs(device):
    weights = {t["name"]: torch.randn(t["num_embeddings"], t["embedding_dim"], device=device) for t in TABLES}
    ebc = build_dynamic_from(weights, device)
    keys = features_of()
    good = random_batch(3, device)
    with pytest.raises(KeyError, match="no table reads"):
        ebc(make_kjt(keys + ["unknown"], good.values(), torch.cat([good.lengths(), good.lengths()[:3] * 0])))
    with pytest.raises(KeyError, match="lacks"):
        ebc(make_kjt(keys[:-1], good.values()[:0], torch.zeros(3 * (len(keys) - 1), dtype=torch.int64,
                                                                 device=device)))
    # lengths that do not add up to the values
    bad = make_kjt(keys, good.values()[:-1] if good.values().numel() else torch.zeros(1, dtype=torch.int64,
                                                                                       device=device), good.lengths())
    with pytest.raises(ValueError, match="do not match"):
        ebc(bad)


@pytest.mark.skipif(not HAVE_TORCHREC, reason="needs torchrec (CI installs it; .ci/run checks it imported)")
@pytest.mark.parametrize("weighted", [False, True])
def test_swap_matches_torchrec_shared_features(device, weighted):
    """Against real TorchRec modules: a feature read by two tables ('x@a', 'x@b' names), KJT keys in
    another order, weighted and unweighted collections, B = 0, 1 and 5; and an EmbeddingCollection."""
    tables = [EmbeddingBagConfig(name="a", embedding_dim=6, num_embeddings=20, feature_names=["x", "y"]),
              EmbeddingBagConfig(name="b", embedding_dim=3, num_embeddings=11, feature_names=["z", "x"])]
    static = _Holder(EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device(device)))
    dynamic = copy.deepcopy(static)
    tftr.swap_embedding_modules(dynamic)
    n_emb = {"x": 11, "y": 20, "z": 11}
    for B in (0, 1, 5):
        kjt = _kjt_over(["z", "y", "x"], n_emb, B, device, weighted)
        want, got = static(kjt), dynamic(kjt)
        assert got.keys() == want.keys() == ["x@a", "y", "z", "x@b"]
        assert got.length_per_key() == want.length_per_key()
        torch.testing.assert_close(got.values(), want.values(), rtol=1e-5, atol=1e-6)
    ec_tables = [EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=9, feature_names=["x", "y"]),
                 EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=7, feature_names=["z"])]
    static = _Holder(EmbeddingCollection(tables=ec_tables, device=torch.device(device)))
    dynamic = copy.deepcopy(static)
    tftr.swap_embedding_modules(dynamic)
    kjt = _kjt_over(["y", "z", "x"], {"x": 9, "y": 9, "z": 7}, 4, device, False)
    want, got = static(kjt), dynamic(kjt)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k].values(), want[k].values())
        assert torch.equal(got[k].lengths(), want[k].lengths())


class _Holder(torch.nn.Module):
    def __init__(self, coll):
        super().__init__()
        self.coll = coll

    def forward(self, kjt):
        return self.coll(kjt)


def _kjt_over(keys, n_emb, B, device, weighted):
    lengths = torch.randint(0, 4, (len(keys) * B,))
    vals = [torch.randint(0, n_emb[k], (int(lengths[i * B:(i + 1) * B].sum()),)) for i, k in enumerate(keys)]
    v = torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)
    w = torch.rand(v.numel()) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=v.to(device), lengths=lengths.to(device),
                             weights=None if w is None else w.to(device))


# Equal row widths (the table-batched path's condition); a feature read by two tables; MEAN pooling.
SAME_DIM_TABLES = [
    dict(name="a", embedding_dim=16, num_embeddings=40, feature_names=["fa", "shared"], pooling="sum"),
    dict(name="b", embedding_dim=16, num_embeddings=30, feature_names=["fb"], pooling="mean"),
    dict(name="c", embedding_dim=16, num_embeddings=50, feature_names=["shared", "fc"], pooling="sum"),
]


def _same_dim_configs(all_sum, tables=SAME_DIM_TABLES):
    out = []
    for t in tables:
        t = copy.deepcopy(t)
        if all_sum:
            t["pooling"] = "sum"
        if HAVE_TORCHREC:
            out.append(EmbeddingBagConfig(name=t["name"], embedding_dim=t["embedding_dim"],
                                          num_embeddings=t["num_embeddings"], feature_names=t["feature_names"],
                                          pooling=PoolingType.SUM if t["pooling"] == "sum" else PoolingType.MEAN))
        else:
            out.append(SimpleNamespace(**t))
    return out


def _sorted_state(coll):
    """Each table's (keys, values, optimizer state, scores) sorted by key (slot positions may differ)."""
    out = {}
    for name, t in coll.tables.items():
        keys, values, state, scores = t._compact()
        order = torch.argsort(keys)
        out[name] = (keys[order], values[order].float(), state[order], scores[order], len(t), t.capacity)
    return out


# No shared feature: a KJT can list the tables' features in order, the batched path's sync-free input.
IN_ORDER_TABLES = [
    dict(name="a", embedding_dim=8, num_embeddings=40, feature_names=["fa", "fa2"], pooling="sum"),
    dict(name="b", embedding_dim=8, num_embeddings=30, feature_names=["fb"], pooling="mean"),
    dict(name="c", embedding_dim=8, num_embeddings=50, feature_names=["fc"], pooling="sum"),
]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["shuffled", "in_order"])
def test_table_batched_matches_per_table(device, opt, weighted, dtype, order):
    """The table-batched step (one launch per phase over all tables) against one table after another:
    outputs, every table's rows, optimizer state, scores and size after several training steps with
    growth (tables a and c), a MEAN table, a feature shared by two tables, the KJT's keys in another
    order than the tables', an empty bag, and a batch of size 0. (Eviction: the next test.)"""
    make_opt = (lambda: torchfuse.optim.SGD(lr=0.1)) if opt == "sgd" else (lambda: torchfuse.optim.Adam(lr=0.01))
    tables = SAME_DIM_TABLES if order == "shuffled" else IN_ORDER_TABLES
    colls = [tftr.DynamicEmbeddingBagCollection(
        _same_dim_configs(weighted, tables), device=device, dtype=dtype, optimizer=make_opt(),
        capacity={"a": 16, "b": 256, "c": 32}, max_capacity={"a": 512, "c": 1024}, eviction="lru",
        initializer=("uniform", -0.5, 0.5), is_weighted=weighted, table_batched=tb) for tb in (True, False)]
    keys = ["fc", "shared", "fb", "fa"] if order == "shuffled" else ["fa", "fa2", "fb", "fc"]
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for step, B in enumerate([7, 5, 0, 9, 6, 9, 8]):
        lengths = torch.randint(0, 4, (len(keys) * B,))
        if B:
            lengths[1] = 0
        n = int(lengths.sum())
        values = torch.randint(-400, 400, (n,)) * 1000003  # negative and large ids; tables a, c overflow
        w = torch.rand(n) if weighted else None
        kjt = make_kjt(keys, values.to(device), lengths.to(device), None if w is None else w.to(device))
        outs = []
        for c in colls:
            out = c(kjt).values()
            g = torch.Generator().manual_seed(step)
            (out * torch.randn(out.shape, generator=g).to(device)).sum().backward()
            outs.append(out.detach())
        torch.testing.assert_close(outs[0], outs[1], **tol)
    s0, s1 = _sorted_state(colls[0]), _sorted_state(colls[1])
    assert colls[0].tables["a"].capacity > 16 and colls[0].tables["c"].capacity > 32, "tables a, c should have grown"
    for name in s0:
        k0, v0, st0, sc0, n0, cap0 = s0[name]
        k1, v1, st1, sc1, n1, cap1 = s1[name]
        assert (n0, cap0) == (n1, cap1), name
        torch.testing.assert_close(k0, k1)
        torch.testing.assert_close(sc0, sc1)
        torch.testing.assert_close(v0, v1, **tol)
        torch.testing.assert_close(st0, st1, **tol)


def _pooled_from_tables(coll, kjt):
    """SUM-pooled (B, features x dim) values from the rows the collection's tables hold now."""
    B, off, vals = kjt.stride(), kjt.offsets(), kjt.values()
    keys, outs = kjt.keys(), []
    for cfg in coll.table_configs():
        table = coll.tables[cfg.name]
        for f in cfg.feature_names:
            i = keys.index(f)
            o = off[i * B:(i + 1) * B + 1]
            rows, found = table.find(vals[int(o[0]):int(o[-1])])
            assert bool(found.all())
            outs.append(F.embedding_bag(torch.arange(rows.shape[0], device=rows.device), rows.float(), o - o[0],
                                        mode="sum", include_last_offset=True))
    return torch.cat(outs, 1)


def test_table_batched_eviction(device):
    """A full LRU table (64 slots) through the batched path. On the CPU (inserts in key order) the
    evicted keys, rows and outputs equal the per-table path's. On the GPU, keys touched by the same
    batch tie on their LRU score and ties go by slot, which depends on the order warps insert in, so
    the evicted keys may differ between two runs of either path: there the test checks what holds
    whatever the order (full table, present + evicted = every key seen, the running batch's keys
    present, outputs = the pooled rows the tables hold after the forward)."""
    colls = [tftr.DynamicEmbeddingBagCollection(
        _same_dim_configs(all_sum=True), device=device, optimizer=torchfuse.optim.SGD(lr=0.1),
        capacity={"a": 256, "b": 256, "c": 64}, eviction="lru", initializer=("uniform", -0.5, 0.5),
        table_batched=tb) for tb in (True, False)]
    keys = ["fc", "shared", "fb", "fa"]
    seen = set()
    for step, B in enumerate([7, 9, 8, 9, 9]):
        lengths = torch.randint(0, 4, (len(keys) * B,))  # table c gets < 64 ids per batch: no failures
        values = torch.randint(-10**6, 10**6, (int(lengths.sum()),))
        kjt = make_kjt(keys, values.to(device), lengths.to(device))
        outs = [c(kjt).values() for c in colls]
        torch.testing.assert_close(outs[0].detach(), _pooled_from_tables(colls[0], kjt), rtol=1e-6, atol=1e-6)
        for o in outs:
            o.sum().backward()
        # ids of table c: features "shared" (2nd) and "fc" (1st)
        off = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        batch_c = set(values[: int(off[2 * B])].tolist())
        seen |= batch_c
        t = colls[0].tables["c"]
        present = set(t._compact()[0].tolist())
        assert batch_c <= present, "a batch must not evict its own keys"
        if device == "cpu":
            torch.testing.assert_close(outs[0], outs[1].detach())
    t = colls[0].tables["c"]
    ev_keys, ev_rows, _, _ = t.drain_evicted()
    assert len(t) == 64 and ev_keys.numel() > 0
    assert set(t._compact()[0].tolist()) | set(ev_keys.tolist()) == seen
    if device == "cpu":
        ev1 = colls[1].tables["c"].drain_evicted()
        torch.testing.assert_close(ev_keys, ev1[0])
        torch.testing.assert_close(ev_rows, ev1[1])


def test_table_batched_eval_and_frozen(device):
    """Eval mode (no inserts: unseen ids pool as zeros) and frozen tables through the batched path equal
    the per-table path."""
    colls = [tftr.DynamicEmbeddingBagCollection(_same_dim_configs(False), device=device, capacity=256,
                                                table_batched=tb) for tb in (True, False)]
    keys = ["fa", "shared", "fb", "fc"]
    lengths = torch.randint(0, 4, (4 * 6,))
    vals = torch.randint(0, 100, (int(lengths.sum()),))
    kjt = make_kjt(keys, vals.to(device), lengths.to(device))
    with torch.no_grad():
        for c in colls:
            c(kjt)  # training mode, no gradient: inserts
    for c in colls:
        c.eval()
    vals2 = torch.randint(0, 200, (int(lengths.sum()),))  # half unseen
    kjt2 = make_kjt(keys, vals2.to(device), lengths.to(device))
    a, b = (c(kjt2).values() for c in colls)
    torch.testing.assert_close(a, b)
    assert len(colls[0].tables["a"]) == len(colls[1].tables["a"])
    for c in colls:
        c.train()
        for t in c.tables.values():
            t.requires_grad_(False)
    a, b = (c(kjt2).values() for c in colls)
    assert not a.requires_grad
    torch.testing.assert_close(a, b)


def test_table_batched_path_runs(device):
    """The batched path is really taken when the tables allow it (and not when row widths differ)."""
    from torchfuse import dynemb_group, dynemb_tables
    assert dynemb_group is dynemb_tables  # the former name stays an alias
    calls = []
    orig = dynemb_tables.pooled_parts
    dynemb_tables.pooled_parts = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        keys = ["fa", "shared", "fb", "fc"]
        lengths = torch.randint(1, 3, (4 * 3,))
        kjt = make_kjt(keys, torch.randint(0, 9, (int(lengths.sum()),)).to(device), lengths.to(device))
        tftr.DynamicEmbeddingBagCollection(_same_dim_configs(False), device=device)(kjt)
        assert calls == [1]
        batch = random_batch(3, device)
        tftr.DynamicEmbeddingBagCollection(configs(), device=device)(batch)  # dims 12 and 20
        assert calls == [1]
    finally:
        dynemb_tables.pooled_parts = orig


@pytest.mark.parametrize("order", ["shuffled", "in_order"])
def test_table_batched_bad_lengths(device, order):
    """A negative length inside a feature (per-feature totals still consistent) is refused before any
    kernel reads the ids, on the batched path too (in table order the check is deferred to the
    batch's first host read)."""
    tables = SAME_DIM_TABLES if order == "shuffled" else IN_ORDER_TABLES
    ebc = tftr.DynamicEmbeddingBagCollection(_same_dim_configs(False, tables), device=device)
    keys = ["fa", "shared", "fb", "fc"] if order == "shuffled" else ["fa", "fa2", "fb", "fc"]
    lengths = torch.tensor([2, 1, 1, 1, 0, 3, 1, 1, 1, 1, 1, 1])
    lengths[0], lengths[1] = 5, -2  # feature fa still holds 4 ids in total
    kjt = make_kjt(keys, torch.arange(int(lengths.sum()), device=device), lengths.to(device))
    with pytest.raises(ValueError, match="do not match"):
        ebc(kjt)
