"""DynamicEmbedding / DynamicEmbeddingBag against a Python dict model of the table, nn.Embedding /
nn.EmbeddingBag plus torch.optim on pre-mapped ids, and each other (state_dict, tiers, devices)."""
import bisect
import io
import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

import _helpers
import torchfuse
from torchfuse import DynamicEmbedding, DynamicEmbeddingBag
from torchfuse import optim as tfo
from torchfuse.dynamic_embedding._table import STATE_FIELDS

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
SPECIAL = [0, -1, 1, I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1]
M64 = 2**64 - 1


def _mix64(x):
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _uniform(key, seed, i):
    h = _mix64((_mix64((key & M64) ^ _mix64((seed + 0x9E3779B97F4A7C15) & M64)) + i) & M64)
    return ((h >> 11) + 0.5) * 2.0**-53


def _init_ref(key, seed, dim, init):
    kind = init[0]
    if kind == "constant":
        return [init[1]] * dim
    if kind == "uniform":
        return [init[1] + (init[2] - init[1]) * _uniform(key, seed, j) for j in range(dim)]
    return [init[1] + init[2] * math.sqrt(-2.0 * math.log(_uniform(key, seed, 2 * j)))
            * math.cos(6.283185307179586 * _uniform(key, seed, 2 * j + 1)) for j in range(dim)]


def _bucket(key, num_buckets):
    return _mix64(key & M64) & (num_buckets - 1)


def _keys(n, pool=None):
    """n random int64 keys (specials included), or n draws from pool (with repeats)."""
    if pool is not None:
        return [random.choice(pool) for _ in range(n)]
    ks = random.sample(SPECIAL, min(n, len(SPECIAL)))
    ks += [random.randint(I64_MIN, I64_MAX) for _ in range(n - len(ks))]
    return ks


def _t(keys, device):
    return torch.tensor(keys, dtype=torch.int64, device=device)


def _check_vacant_keys(table):
    """The vacant-key rule (kernels/dynemb_kernels.h): an empty slot's key hashes to another bucket."""
    nb, bs = table._locks.numel(), table.bucket_size
    empty = torch.nonzero(table._digests == 0).squeeze(1).cpu()
    keys = table._keys.cpu()[empty]
    bad = [(s, k) for s, k in zip(empty.tolist(), keys.tolist()) if _bucket(k, nb) == s // bs]
    assert nb == 1 or not bad, f"empty slots holding a key of their own bucket: {bad[:5]}"


def _check_model(table, model, device, dim, extra_absent=()):
    assert len(table) == len(model)
    assert int((table._digests != 0).sum()) == len(model)  # the size the module tracks is the real one
    ks = list(model) + [k for k in extra_absent if k not in model]
    if not ks:
        return
    vals, found = table.find(_t(ks, device))
    assert found.tolist() == [k in model for k in ks]
    want = torch.stack([model[k] if k in model else torch.zeros(dim, dtype=table.dtype) for k in ks]).to(device)
    assert torch.equal(vals, want)


@pytest.mark.parametrize("host_tier", [False, True])
@pytest.mark.parametrize("eviction", ["none", "lru"])
def test_random_ops_against_dict(device, eviction, host_tier):
    dim = 5
    grow = eviction == "none"
    budget = 7 * (dim * 4) if host_tier else None
    # batches hold at most 12 distinct keys, fewer than a bucket's 16 slots: with eviction, a batch
    # always finds room (a bucket full of the batch's own keys raises; test_eviction_lru_one_bucket)
    table = DynamicEmbedding(dim, 16 if grow else 64, max_capacity=256 if grow else 64, device=device,
                             eviction=eviction, bucket_size=16, hbm_budget_bytes=budget,
                             initializer=("uniform", -1.0, 1.0), seed=3)
    if host_tier:
        assert table.hbm_rows == 7 and table._values_host.shape[0] == table.capacity - 7
    model = {}
    pool = _keys(40 if grow else 180)
    for step in range(60):
        op = random.choice(["insert", "insert", "forward", "erase", "find", "dups"])
        if op == "insert" or op == "dups":
            n = random.randint(0, 12)
            ks = _keys(n, pool)
            vs = torch.randn(n, dim)
            ev = table.insert(_t(ks, device), vs.to(device), return_evicted=True)
            evk, evv, evs, evsc = ev
            for k, v in zip(evk.tolist(), evv.cpu()):
                assert k in model and torch.equal(model.pop(k), v)
            for i, k in enumerate(ks):  # last occurrence wins
                model[k] = vs[i]
            if not grow:
                assert set(evk.tolist()).isdisjoint(ks)
        elif op == "forward":
            table.train()
            ks = _keys(random.randint(0, 10), pool)
            with torch.no_grad():
                out = table(_t(ks, device)).cpu()
            evk, evv, _, _ = table.drain_evicted()
            for k, v in zip(evk.tolist(), evv.cpu()):
                assert k in model and torch.equal(model.pop(k), v)
            for i, k in enumerate(ks):
                if k in model:
                    assert torch.equal(out[i], model[k])
                else:
                    model[k] = out[i]
                    want = torch.tensor(_init_ref(k, 3, dim, ("uniform", -1.0, 1.0)), dtype=torch.float32)
                    torch.testing.assert_close(out[i], want, rtol=1e-6, atol=1e-7)
        elif op == "erase":
            ks = _keys(random.randint(0, 6), pool) + [random.randint(I64_MIN, I64_MAX)]
            removed = table.erase(_t(ks, device))
            assert removed == len({k for k in ks if k in model})
            for k in ks:
                model.pop(k, None)
        else:
            ks = _keys(random.randint(0, 10), pool)
            assert table.contains(_t(ks, device)).tolist() == [k in model for k in ks]
        table.drain_evicted()
        _check_model(table, model, device, dim, extra_absent=pool[:5])
        assert table.load_factor <= 1.0
    if grow:
        assert table.capacity > 16  # it grew, and kept every key
    exported = {}
    for k, v, s, sc in table.export(batch_size=7):
        assert k.numel() <= 7 and s.shape == (k.numel(), 0)
        exported.update(zip(k.tolist(), v.cpu()))
    assert exported.keys() == model.keys()
    assert all(torch.equal(exported[k], model[k]) for k in model)


def test_special_keys(device):
    table = DynamicEmbedding(3, 8, device=device, bucket_size=4, max_capacity=64)
    ks = _t(SPECIAL, device)
    vs = torch.arange(len(SPECIAL) * 3, dtype=torch.float32, device=device).reshape(-1, 3)
    table.insert(ks, vs)
    v, f = table.find(ks)
    assert f.all() and torch.equal(v, vs)
    assert len(table) == len(SPECIAL)
    assert table.erase(_t([I64_MIN, 0], device)) == 2
    assert table.contains(ks).tolist() == [k not in (I64_MIN, 0) for k in SPECIAL]
    v, f = table.find(_t([0, I64_MIN], device))
    assert not f.any() and not v.any()


def test_growth_doubles(device):
    table = DynamicEmbedding(2, 16, max_capacity=1024, device=device, bucket_size=16, eviction="none")
    ks = _keys(300)
    caps = []
    for i in range(0, 300, 25):
        table.insert(_t(ks[i:i + 25], device), torch.ones(25, 2, device=device))
        caps.append(table.capacity)
    assert len(table) == 300 and table.contains(_t(ks, device)).all()
    assert all(c & (c - 1) == 0 for c in caps) and caps == sorted(caps) and caps[-1] >= 300 / 0.75
    _check_vacant_keys(table)  # after the rehashes
    with pytest.raises(RuntimeError, match="full"):
        small = DynamicEmbedding(2, 8, device=device, bucket_size=4, eviction="none")
        small.insert(_t(_keys(40), device), torch.ones(40, 2, device=device))


def _fill_one_bucket(table, device, n):
    """Keys 0..n-1 inserted one per operation (LRU clock 1..n)."""
    for k in range(n):
        table.insert(_t([k], device), torch.full((1, table.embedding_dim), float(k), device=device))


def test_eviction_lru_one_bucket(device):
    table = DynamicEmbedding(2, 8, device=device, bucket_size=8, eviction="lru")  # one bucket of 8
    _fill_one_bucket(table, device, 8)
    table.train()
    with torch.no_grad():
        table(_t([1, 0, 2], device))  # 3 is now the least recently used
    ek, ev, _, esc = table.insert(_t([100], device), torch.zeros(1, 2, device=device), return_evicted=True)
    assert ek.tolist() == [3] and torch.equal(ev.cpu(), torch.full((1, 2), 3.0)) and esc.tolist() == [4]
    # two new keys: the two least recent (4, 5) go, never a key of the same batch
    ek, _, _, _ = table.insert(_t([101, 102], device), torch.zeros(2, 2, device=device), return_evicted=True)
    assert sorted(ek.tolist()) == [4, 5]
    # a batch holding more new keys than the bucket can take without evicting its own keys fails loudly
    with pytest.raises(RuntimeError, match="same batch"):
        table.insert(_t(list(range(200, 209)), device), torch.zeros(9, 2, device=device))
    # the drained record has every eviction, in order
    dk, dv, _, _ = table.drain_evicted()
    assert dk.tolist()[:3] == [3, 4, 5] or sorted(dk.tolist()[:3]) == [3, 4, 5]


def test_eviction_lfu_one_bucket(device):
    table = DynamicEmbedding(2, 8, device=device, bucket_size=8, eviction="lfu")
    _fill_one_bucket(table, device, 8)  # each key accessed once
    table.train()
    freq = {k: 1 for k in range(8)}
    with torch.no_grad():
        # the score counts the operations that used a key (repeats inside one batch count once)
        for ks in ([0, 0, 1, 2, 3, 4, 5, 6], [7, 7, 6, 5, 4, 3, 2, 1, 1], [0, 1, 2, 3, 4, 5, 7], [0, 7, 7]):
            table(_t(ks, device))
            for k in set(ks):
                freq[k] += 1
    victim = min(freq, key=lambda k: freq[k])
    assert sorted(freq.values()).count(freq[victim]) == 1
    ek, _, _, esc = table.insert(_t([55], device), torch.zeros(1, 2, device=device), return_evicted=True)
    assert ek.tolist() == [victim] and esc.tolist() == [freq[victim]]


def test_eviction_none_raises(device):
    table = DynamicEmbedding(2, 8, device=device, bucket_size=8, eviction="none")
    _fill_one_bucket(table, device, 8)
    with pytest.raises(RuntimeError, match="eviction='none'"):
        table.insert(_t([9], device), torch.zeros(1, 2, device=device))
    assert len(table) == 8 and not table.contains(_t([9], device)).any()


def test_eviction_lru_many_buckets(device):
    """With several buckets, each evicted key is the least recently used key of its own bucket."""
    nb, bs = 4, 4
    table = DynamicEmbedding(1, nb * bs, device=device, bucket_size=bs, eviction="lru")
    last = {}
    clock = 0
    for _ in range(120):
        k = random.randint(I64_MIN, I64_MAX) if random.random() < 0.6 or not last else random.choice(list(last))
        clock += 1
        ek, _, _, _ = table.insert(_t([k], device), torch.zeros(1, 1, device=device), return_evicted=True)
        ek = ek.tolist()
        same = [q for q in last if _bucket(q, nb) == _bucket(k, nb)]
        if k not in last and len(same) == bs:
            assert ek == [min(same, key=lambda q: last[q])]
            del last[ek[0]]
        else:
            assert ek == []
        last[k] = clock
    assert len(table) == len(last)


def _ref_optimizer(name, params, lr):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=1e-10)
    if name == "adam":
        return torch.optim.SparseAdam(params, lr=lr, betas=(0.8, 0.95), eps=1e-8)
    return None  # rowwise: manual below


def _tf_optimizer(name, lr):
    return {"sgd": lambda: tfo.SGD(lr), "adagrad": lambda: tfo.Adagrad(lr, eps=1e-10),
            "rowwise": lambda: tfo.RowWiseAdagrad(lr, eps=1e-8),
            "adam": lambda: tfo.Adam(lr, betas=(0.8, 0.95), eps=1e-8)}[name]()


def _rowwise_step(weight, acc, lr, eps=1e-8):
    with torch.no_grad():
        g = weight.grad
        rows = (g != 0).any(1)  # rows the batch touched (random data: a zero gradient row is not drawn)
        acc[rows] += (g[rows] ** 2).mean(1)
        weight[rows] -= (lr / (acc[rows].sqrt() + eps))[:, None] * g[rows]
        weight.grad = None


def _close_elementwise(name, ours, ref64, ref32, rtol, atol):
    """ours against the float64 run, the tolerance widened only where the float32 run is off it."""
    _helpers.check_close_elementwise(name, ours, ref64, (ref32.double() - ref64.double()).abs(), rtol, atol)


@pytest.mark.parametrize("host_tier", [False, True])
@pytest.mark.parametrize("kind", ["embedding", "bag_sum", "bag_mean", "bag_weighted"])
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise", "adam"])
def test_training_matches_pytorch(device, opt, kind, host_tier):
    """Four training steps against nn.Embedding(Bag) + torch.optim on pre-mapped ids, run in float32 and
    float64: each element within rtol / atol of the float64 run plus twice the float32 run's own error at
    that element (_close_elementwise). Not against the float32 run alone: Adam divides each gradient by its
    own magnitude, so where a row's per-sample terms cancel, the gradient's rounding (which depends on the
    order its terms are summed in) moves the weight by up to lr times that relative rounding, more than a
    fixed tolerance allows; the float32 run's error shows where that happens."""
    dim, P, lr = 7, 37, 0.05
    pool = _keys(P)
    budget = 10 * (dim * 4 + 4 * tfo.Adam().state_dim(dim)) if host_tier else None
    bag = kind != "embedding"
    cls = DynamicEmbeddingBag if bag else DynamicEmbedding
    kw = {"mode": "mean" if kind == "bag_mean" else "sum"} if bag else {}
    table = cls(dim, 128, device=device, optimizer=_tf_optimizer(opt, lr), hbm_budget_bytes=budget,
                initializer=("normal", 0.0, 0.5), bucket_size=16, **kw)
    table.train()
    with torch.no_grad():  # insert the pool (no optimizer step without a gradient)
        DynamicEmbedding.forward(table, _t(pool, device))
    w0 = table.find(_t(pool, device))[0].clone()
    sparse = opt == "adam"
    refs = []  # (module, optimizer, row-wise accumulator): float32, then float64
    for dtype in (torch.float32, torch.float64):
        if bag:
            ref = torch.nn.EmbeddingBag(P, dim, mode=kw["mode"], sparse=sparse)
        else:
            ref = torch.nn.Embedding(P, dim, sparse=sparse)
        ref = ref.to(device=device, dtype=dtype)
        with torch.no_grad():
            ref.weight.copy_(w0)
        refs.append((ref, _ref_optimizer(opt, ref.parameters(), lr), torch.zeros(P, device=device, dtype=dtype)))
    index = {k: i for i, k in enumerate(pool)}
    for step in range(4):
        n = random.choice([0, 1, 23, 50]) if step else 31
        ks = _keys(n, pool)
        ids, idx = _t(ks, device), _t([index[k] for k in ks], device)
        if bag:
            B = 6
            cuts = sorted(random.randint(0, n) for _ in range(B - 1))
            offsets = _t([0] + cuts, device)
            psw = torch.rand(n, device=device) if kind == "bag_weighted" else None
            out = table(ids, offsets, psw)
            wants = [ref(idx, offsets, per_sample_weights=None if psw is None else psw.to(ref.weight.dtype))
                     for ref, _, _ in refs]
        else:
            out = table(ids.reshape(-1, 1) if step == 2 else ids)
            wants = [ref(idx.reshape(-1, 1) if step == 2 else idx) for ref, _, _ in refs]
        target = torch.randn_like(wants[0])
        loss = ((out - target) ** 2).sum()
        losses = [((w - target.to(w.dtype)) ** 2).sum() for w in wants]
        _close_elementwise("out", out, wants[1], wants[0], rtol=1e-5, atol=1e-6)
        _close_elementwise("loss", loss, losses[1], losses[0], rtol=1e-5, atol=1e-5)
        loss.backward()
        for (ref, ropt, acc), loss_ref in zip(refs, losses):
            loss_ref.backward()
            if ropt is None:
                _rowwise_step(ref.weight, acc, lr)
            else:
                if ref.weight.grad is not None:
                    ropt.step()
                ropt.zero_grad()
        _close_elementwise(f"weights after step {step}", table.find(_t(pool, device))[0],
                           refs[1][0].weight.detach(), refs[0][0].weight.detach(), rtol=1e-5, atol=1e-6)
    assert len(table) == P


def test_duplicates_share_one_row(device):
    table = DynamicEmbedding(4, 16, device=device, optimizer=tfo.SGD(1.0), bucket_size=16)
    table.train()
    ids = _t([5, 5, -7, 5], device)
    out = table(ids)
    assert len(table) == 2 and torch.equal(out[0], out[1]) and torch.equal(out[0], out[3])
    before = table.find(_t([5], device))[0].clone()
    g = torch.randn(4, 4, device=device)
    (out * g).sum().backward()
    after = table.find(_t([5], device))[0]
    torch.testing.assert_close(after, before - (g[0] + g[1] + g[3]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
@pytest.mark.parametrize("dim", [5, 300])
def test_skewed_duplicates_gradient(device, mode, dim):
    """A hot id repeated hundreds of times (as in Zipf-distributed batches): its gradient is the sum
    over every occurrence, whatever way the kernel splits that sum (CUDA cuts it into chunks of 32
    occurrences, so runs crossing one, two and many chunk edges all occur here). dim 300 exceeds one
    pass of a warp's columns."""
    P, lr = 41, 0.5
    pool = _keys(P)
    hot, warm = pool[0], pool[1]
    ks = [hot] * 203 + [warm] * 67 + _keys(150, pool)
    random.shuffle(ks)
    n = len(ks)
    index = {k: i for i, k in enumerate(pool)}
    table = DynamicEmbeddingBag(dim, 256, device=device, optimizer=tfo.SGD(lr), bucket_size=32,
                                mode="mean" if mode == "mean" else "sum", initializer=("normal", 0.0, 1.0))
    table.train()
    with torch.no_grad():
        DynamicEmbedding.forward(table, _t(pool, device))
    w0 = table.find(_t(pool, device))[0].clone()
    ref = torch.nn.EmbeddingBag(P, dim, mode="mean" if mode == "mean" else "sum").to(device)
    with torch.no_grad():
        ref.weight.copy_(w0)
    B = 9
    offsets = _t([0] + sorted(random.randint(0, n) for _ in range(B - 1)), device)
    psw = torch.rand(n, device=device) if mode == "weighted" else None
    ids, idx = _t(ks, device), _t([index[k] for k in ks], device)
    g = torch.randn(B, dim, device=device)
    (table(ids, offsets, psw) * g).sum().backward()
    (ref(idx, offsets, per_sample_weights=psw) * g).sum().backward()
    want = w0 - lr * ref.weight.grad
    # fp32 sums of up to 203 terms in another order: a few ulps of the largest partial sum
    torch.testing.assert_close(table.find(_t(pool, device))[0], want, rtol=1e-5, atol=2e-5 * B)
    # the same batch again from the same state gives the same bits (fixed summation order)
    t2 = DynamicEmbeddingBag(dim, 256, device=device, optimizer=tfo.SGD(lr), bucket_size=32,
                             mode="mean" if mode == "mean" else "sum")
    t2.insert(_t(pool, device), w0)
    t2.train()
    (t2(ids, offsets, psw) * g).sum().backward()
    assert torch.equal(t2.find(_t(pool, device))[0], table.find(_t(pool, device))[0])


def test_empty_batches(device):
    table = DynamicEmbedding(3, 8, device=device, bucket_size=8)
    table.train()
    out = table(torch.empty(0, 4, dtype=torch.int64, device=device))
    assert out.shape == (0, 4, 3)
    out.sum().backward()
    bag = DynamicEmbeddingBag(3, 8, device=device, bucket_size=8, mode="mean")
    bag.train()
    o = bag(torch.empty(0, dtype=torch.int64, device=device), torch.zeros(3, dtype=torch.int64, device=device))
    assert o.shape == (3, 3) and not o.any()
    o.sum().backward()
    o = bag(_t([4, 9], device), _t([0, 0, 2], device))  # empty bags around a full one
    assert o.shape == (3, 3) and not o[0].any() and not o[2].any()
    assert len(table) == 0 and len(bag) == 2
    assert table.find(torch.empty(0, dtype=torch.int64, device=device))[0].shape == (0, 3)
    table.insert(torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, 3, device=device))
    assert table.erase(torch.empty(0, dtype=torch.int64, device=device)) == 0


def test_eval_does_not_insert_and_frozen(device):
    table = DynamicEmbedding(3, 8, device=device, bucket_size=8, optimizer=tfo.SGD(1.0))
    table.eval()
    out = table(_t([1, 2], device))
    assert not out.any() and len(table) == 0
    table.train()
    table(_t([1], device))
    table.eval()
    out = table(_t([1, 2], device))
    assert out[0].any() and not out[1].any() and len(table) == 1
    table.train()
    table.requires_grad_(False)
    before = table.find(_t([1], device))[0].clone()
    out = table(_t([1, 3], device))
    assert not out.requires_grad and len(table) == 2
    assert torch.equal(table.find(_t([1], device))[0], before)


def test_state_dict_round_trip(device):
    # max_capacity leaves room to grow: the continuation below must not evict. Which of two equal-score
    # keys an eviction takes depends on their slots, and a table loaded from a state_dict has the
    # same keys and rows but, on the GPU (parallel inserts), not the same slots.
    kw = dict(device=device, max_capacity=1024, eviction="lfu", bucket_size=8, initializer=("uniform", -0.1, 0.1),
              seed=11, optimizer=tfo.Adam(0.01))
    a = DynamicEmbeddingBag(6, 16, mode="sum", **kw)
    a.train()
    for _ in range(3):
        # ~20 distinct ids a batch over 16 buckets of 8: a bucket overfilled by one batch's own keys
        # (which eviction may not take) is vanishingly unlikely (40 ids made it a ~2% flake)
        ids = _t(_keys(24, _keys(60)), device)
        a(ids, _t([0, 10, 20], device)).square().sum().backward()
    sd = a.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    b = DynamicEmbeddingBag(6, 8, mode="sum", device=device, optimizer=tfo.SGD(1.0))
    b.load_state_dict(torch.load(buf, weights_only=False))
    assert b.capacity == a.capacity and b.max_capacity == 1024 and b.eviction == "lfu" and len(b) == len(a)
    assert b.optimizer.config() == a.optimizer.config() and b._config() == a._config()

    def table(m):
        rows = [torch.cat([k[:, None].double(), v.double(), s.double(), sc[:, None].double()], 1)
                for k, v, s, sc in m.export()]
        keys = torch.cat([e[0] for e in m.export()])
        return keys, torch.cat(rows)[torch.argsort(keys)]
    ka, ta = table(a)
    kb, tb = table(b)
    assert torch.equal(ta, tb) and torch.equal(torch.sort(ka)[0], torch.sort(kb)[0])
    # both continue identically
    ids = _t(_keys(30, ka.tolist()[:20] + _keys(5)), device)
    for m in (a, b):
        m(ids, _t([0, 30], device)).square().sum().backward()
        assert m.capacity < m.max_capacity and m.drain_evicted()[0].numel() == 0  # grew, never evicted
    assert torch.equal(table(a)[1], table(b)[1])
    # another dimension is refused clearly
    c = DynamicEmbedding(5, 16, device=device)
    with pytest.raises(RuntimeError, match="embedding_dim"):
        c.load_state_dict(a.state_dict())


def _trained_with_evictions(device, dtype=torch.float32):
    """A table trained until it grew to max_capacity and evicted (with Adam state and scores)."""
    t = DynamicEmbeddingBag(6, 16, mode="sum", device=device, max_capacity=64, eviction="lru", bucket_size=16,
                            dtype=dtype, initializer=("uniform", -0.1, 0.1), seed=5, optimizer=tfo.Adam(0.01),
                            evicted_record_limit=0)
    t.train()
    pool = _keys(400)
    for _ in range(40):  # 8 ids a batch: no bucket of 16 can fill with one batch's own keys
        t(_t(_keys(8, pool), device), _t([0, 4], device)).square().sum().backward()
    assert t.capacity == t.max_capacity == 64 and t.evicted_dropped > 0
    return t


def _snapshot(m):
    """Everything a checkpoint restores, in key order, as host tensors and numbers."""
    keys, values, state, scores = (torch.cat(c) for c in zip(*m.export())) if len(m) else m.drain_evicted()
    order = torch.argsort(keys)
    return ([x[order].cpu() for x in (keys, values, state, scores)],
            {k: v for k, v in m._config().items() if k not in ("capacity", "max_capacity")}, len(m))


def _same(a, b):
    (ta, ca, na), (tb, cb, nb) = a, b
    return ca == cb and na == nb and all(torch.equal(x.view(torch.uint8) if x.is_floating_point() else x,
                                                     y.view(torch.uint8) if y.is_floating_point() else y)
                                         for x, y in zip(ta, tb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grow_by", [1, 4])
def test_checkpoint_mid_training_loads_bit_exact(device, dtype, grow_by, tmp_path):
    a = _trained_with_evictions(device, dtype)
    torch.save(a.state_dict(), tmp_path / "ckpt.pt")
    # a fresh table of the same or a larger capacity, other settings its own
    b = DynamicEmbeddingBag(6, 64 * grow_by, mode="sum", device=device, dtype=dtype, optimizer=tfo.SGD(1.0))
    b.load_state_dict(torch.load(tmp_path / "ckpt.pt"))  # weights_only: plain types only
    assert _same(_snapshot(a), _snapshot(b)) and b.capacity == 64 * grow_by
    keys = _snapshot(a)[0][0].to(device)
    assert torch.equal(a.find(keys)[0], b.find(keys)[0]) and bool(b.find(keys)[1].all())
    # it trains on: the same ids give the same rows (no eviction in b at the larger capacity)
    ids = keys[torch.randint(0, keys.numel(), (20,), device=device)]
    for m in (a, b):
        m(ids, _t([0, 10], device)).square().sum().backward()
    assert torch.equal(a.find(keys)[0], b.find(keys)[0])


def _zip_records(path):
    """(name, data offset, data size) of each record of a torch.save file (stored, not compressed)."""
    import struct
    import zipfile
    raw = path.read_bytes()
    out = []
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            o = info.header_offset
            name_len, extra_len = struct.unpack("<HH", raw[o + 26:o + 30])
            out.append((info.filename, o + 30 + name_len + extra_len, info.file_size))
    return out


def _faulty_checkpoints(sd, tmp_path, device):
    """(what, loader) pairs: each loader raises, from torch.load or from load_state_dict."""
    path = tmp_path / "good.pt"
    torch.save(sd, path)
    raw = path.read_bytes()
    faults = []
    for cut in (10, len(raw) // 3, len(raw) // 2, len(raw) - 30):
        p = tmp_path / f"cut{cut}.pt"
        p.write_bytes(raw[:cut])
        faults.append((f"truncated at {cut}", p))
    for name, off, size in _zip_records(path):
        if "/data/" not in name or size == 0:
            continue
        for at in (off, off + size // 2, off + size - 1):  # a tensor's first, middle and last byte
            bad = bytearray(raw)
            bad[at] ^= 1 << random.randrange(8)
            p = tmp_path / f"flip{at}.pt"
            p.write_bytes(bytes(bad))
            faults.append((f"bit flipped in {name} at {at - off}", p))
    files = [(w, (lambda p=p: torch.load(p))) for w, p in faults]
    dicts = []
    for k in ("keys", "values", "optimizer_state", "scores", "config"):
        d = dict(sd)
        del d[k]
        dicts.append((f"no {k}", d))
    for k in ("keys", "values", "optimizer_state", "scores"):
        d = dict(sd)
        d[k] = d[k][:-1]
        dicts.append((f"{k} one row short", d))
        d = dict(sd)
        d[k] = d[k].unsqueeze(0)
        dicts.append((f"{k} of another rank", d))
    d = dict(sd)
    d["values"] = d["values"].double()
    dicts.append(("values of another dtype", d))
    d = dict(sd)
    d["keys"] = d["keys"].clone()
    d["keys"][1] = d["keys"][0]
    dicts.append(("a repeated key", d))
    for field, value in (("capacity", 48), ("bucket_size", 3), ("eviction", "fifo"), ("clock", -1),
                         ("optimizer", {"name": "Nope"}), ("initializer", ("normal",)), ("step", "7")):
        d = dict(sd)
        d["config"] = dict(d["config"], **{field: value})
        dicts.append((f"config {field}={value!r}", d))
    d = dict(sd)
    d["config"] = dict(d["config"], seed=d["config"]["seed"] + 1)
    dicts.append(("config edited under its checksum", d))
    return files + [(w, (lambda d=d: d)) for w, d in dicts]


def test_checkpoint_faults_leave_the_table_unchanged(device, tmp_path):
    a = _trained_with_evictions(device)
    sd = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.state_dict().items()}
    b = DynamicEmbeddingBag(6, 32, mode="sum", device=device, max_capacity=128, optimizer=tfo.Adagrad(0.1))
    b.train()
    b(_t(_keys(40), device), _t([0, 20], device)).sum().backward()
    before = _snapshot(b)
    cap, max_cap, opt = b.capacity, b.max_capacity, b.optimizer.config()
    faults = _faulty_checkpoints(sd, tmp_path, device)
    assert len(faults) > 30
    for what, load in faults:
        with pytest.raises(Exception) as e:
            b.load_state_dict(load())
        assert str(e.value), what
        assert _same(before, _snapshot(b)), what
        assert (b.capacity, b.max_capacity, b.optimizer.config()) == (cap, max_cap, opt), what
    # the table still works, and the intact checkpoint loads after all of those
    b(_t(_keys(10), device), _t([0, 5], device)).sum().backward()
    b.load_state_dict(sd)
    assert _same(_snapshot(a), _snapshot(b))


def test_checkpoint_fault_messages(device):
    a = _trained_with_evictions(device)
    sd = a.state_dict()
    b = DynamicEmbeddingBag(6, 16, device=device)
    for what, d, match in (
            ("dim", DynamicEmbedding(5, 16, device=device), "embedding_dim 6, this table 5"),
            ("dtype", DynamicEmbedding(6, 16, device=device, dtype=torch.float16),
             "dtype float32, this table float16"),
    ):
        with pytest.raises(RuntimeError, match=match):
            d.load_state_dict(sd)
    bad = dict(sd, values=sd["values"][:-1])
    with pytest.raises(RuntimeError, match="inconsistent state_dict shapes: keys"):
        b.load_state_dict(bad)
    bad = dict(sd, scores=sd["scores"].clone())
    bad["scores"][0] += 1
    with pytest.raises(RuntimeError, match="checksum does not match"):
        b.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="Missing key.*values"):
        b.load_state_dict({k: v for k, v in sd.items() if k != "values"})
    unsummed = {k: v for k, v in sd["config"].items() if k != "checksum"}
    repeated = dict(sd, keys=sd["keys"].clone(), config=unsummed)
    repeated["keys"][1] = repeated["keys"][0]
    with pytest.raises(RuntimeError, match="keys repeat"):
        b.load_state_dict(repeated)
    with pytest.raises(RuntimeError, match=r"config\['clock'\] is out of range"):
        b.load_state_dict(dict(sd, config=dict(unsummed, clock=-3)))
    # keys that pass every check but overflow a bucket: the insert fails, the table is restored
    c = DynamicEmbedding(6, 32, device=device, bucket_size=4)
    c.insert(_t(list(range(8)), device), torch.ones(8, 6, device=device))
    crowded = [k for k in range(10**4) if _bucket(k, 8) == 0][:8]
    csd = c.state_dict()
    csd["keys"] = _t(crowded, device)
    csd["config"] = {k: v for k, v in csd["config"].items() if k != "checksum"}
    before = _snapshot(b)
    with pytest.raises(RuntimeError, match="did not fit.*the table is unchanged|unchanged.*did not fit"):
        b.load_state_dict(csd)
    assert _same(before, _snapshot(b)) and b.capacity == 16 and b.bucket_size == 16
    # an edited state_dict loads once its checksum is dropped
    bad["config"] = {k: v for k, v in sd["config"].items() if k != "checksum"}
    b.load_state_dict(bad)
    k0 = sd["keys"][:1]
    assert len(b) == len(a) and torch.equal(b._scores[b._lookup(k0)], sd["scores"][:1] + 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_rows(device, dtype):
    dim, P = 8, 20
    pool = _keys(P)
    table = DynamicEmbedding(dim, 32, device=device, dtype=dtype, optimizer=tfo.SGD(0.1), bucket_size=32)
    vs = torch.randn(P, dim, device=device).to(dtype)
    table.insert(_t(pool, device), vs)
    assert torch.equal(table.find(_t(pool, device))[0], vs)
    ref = torch.nn.Embedding(P, dim, dtype=dtype, device=device)
    with torch.no_grad():
        ref.weight.copy_(vs)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    table.train()
    idx = torch.randint(0, P, (30,), device=device)
    ids = _t(pool, device)[idx]
    g = torch.randn(30, dim, device=device).to(dtype)
    (table(ids).float() * g.float()).sum().backward()
    (ref(idx).float() * g.float()).sum().backward()
    ropt.step()
    # the table sums repeated ids' gradients in fp32 before rounding once; PyTorch's embedding
    # backward rounds the sum to the row dtype: allow one rounding of the update
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(table.find(_t(pool, device))[0].float(), ref.weight.detach().float(), rtol=tol, atol=tol)


def test_bad_inputs(device):
    table = DynamicEmbedding(3, 8, device=device, bucket_size=8)
    bag = DynamicEmbeddingBag(3, 8, device=device, bucket_size=8)
    with pytest.raises(TypeError, match="integer"):
        table(torch.ones(3, device=device))
    with pytest.raises(TypeError, match="integer"):
        table.find(torch.ones(3, dtype=torch.float64, device=device))
    other = "meta" if device == "cpu" else "cpu"
    with pytest.raises(ValueError, match="device"):
        table(torch.ones(3, dtype=torch.int64, device=other))
    with pytest.raises(ValueError, match="offsets"):
        bag(_t([1, 2, 3], device), _t([0, 2, 1], device))
    with pytest.raises(ValueError, match="offsets"):
        bag(_t([1, 2, 3], device), _t([1, 2], device))
    with pytest.raises(ValueError, match="offsets"):
        bag(_t([1, 2, 3], device), _t([0, 4], device))
    with pytest.raises(TypeError, match="offsets"):
        bag(_t([1, 2, 3], device), torch.tensor([0.0], device=device))
    with torch.no_grad(), pytest.raises(ValueError, match="offsets"):
        bag(_t([1, 2, 3], device), _t([0, 2, 1], device))
    with pytest.raises(ValueError, match="offsets"):  # no ids, bad offsets: still refused
        bag(_t([], device), _t([1], device))
    mean_bag = DynamicEmbeddingBag(3, 8, device=device, bucket_size=8, mode="mean")
    for bad in ([0, 7, 2], [0, -5, 3], [2, 3]):  # the bags' layout is launched before the check reads the device
        with pytest.raises(ValueError, match="offsets"):
            mean_bag(_t([1, 2, 3], device), _t(bad, device))
    assert len(mean_bag) == 0
    assert len(bag) == 0  # refused before any id was inserted
    with pytest.raises(ValueError, match="per_sample_weights"):
        DynamicEmbeddingBag(3, 8, device=device, mode="mean")(_t([1], device), _t([0], device),
                                                              torch.ones(1, device=device))
    with pytest.raises(ValueError, match="values"):
        table.insert(_t([1, 2], device), torch.ones(2, 4, device=device))
    with pytest.raises(ValueError, match="eviction"):
        DynamicEmbedding(3, 8, device=device, eviction="fifo")
    with pytest.raises(ValueError, match="initializer"):
        DynamicEmbedding(3, 8, device=device, initializer=("xavier",))
    with pytest.raises(ValueError, match="max_capacity"):
        DynamicEmbedding(3, 8, device=device, max_capacity=4)
    with pytest.raises(TypeError, match="optimizer"):
        DynamicEmbedding(3, 8, device=device, optimizer=torch.optim.SGD)
    with pytest.raises(TypeError, match="dtype"):
        DynamicEmbedding(3, 8, device=device, dtype=torch.float64)
    with pytest.raises(TypeError, match="query must be int64"):  # the raw ops check their arguments too
        torch.ops.torchfuse.dynemb_lookup(torch.ones(2, dtype=torch.int32, device=device), table._tensors, 0)
    with pytest.raises(TypeError, match=r"table\[0\] \(keys\) must be Long"):
        torch.ops.torchfuse.dynemb_lookup(torch.ones(2, dtype=torch.int64, device=device),
                                          [table._keys.int()] + table._tensors[1:], 0)


def _bag_layout_ref(offsets, n, incl, mean):
    """dynemb_bag_layout's contract in plain Python, for any offsets (bad ones included)."""
    offs = [int(o) for o in offsets]
    full = offs if incl else offs + [n]
    n_bags = len(full) - 1
    bad = full[0] != 0 or full[-1] != n or any(b < a for a, b in zip(full, full[1:]))
    last = max(n_bags - 1, 0)
    if all(a <= b for a, b in zip(full, full[1:])):  # the last bag b <= last with full[b] <= i (0 if none)
        bag_of = [max(bisect.bisect_right(full, i, 0, last + 1) - 1, 0) for i in range(n)]
    else:  # unsorted offsets: any in-range bag (the search tolerates disorder)
        bag_of = [None] * n
    scale = [None if b is None else 1.0 / max(full[b + 1] - full[b], 1) for b in bag_of] if mean else []
    return full, bag_of, scale, bad, last


@pytest.mark.parametrize("otype", [torch.int32, torch.int64])
@pytest.mark.parametrize("incl", [False, True])
@pytest.mark.parametrize("mean", [False, True])
def test_bag_layout(device, otype, incl, mean):
    """dynemb_bag_layout (the bags' bounds, each id's bag, mean scales and the offsets' check flag in
    one kernel) against a Python reference: valid offsets with empty bags, and bad ones (not starting
    at 0, decreasing, ending past or short of n), whose results must still be in range."""
    cases = []
    for n, n_bags in [(0, 0), (0, 3), (1, 1), (5, 1), (37, 6), (1000, 97), (20011, 1301)]:
        if n_bags == 0 and incl:
            continue
        cuts = sorted(random.choices(range(n + 1), k=max(n_bags - 1, 0)))
        offs = [0] + cuts + ([n] if incl else [])
        if not incl and n_bags == 0:
            offs = []
        cases.append((offs, n))
    cases += [([1, 3, 5] + ([9] if incl else []), 9), ([0, 4, 2] + ([9] if incl else []), 9),
              ([0, 3, 12] + ([12] if incl else []), 9), ([0, 3] + ([7] if incl else []), 9)]
    for offs, n in cases:
        if not offs and (incl or n):
            continue
        offsets = torch.tensor(offs, dtype=otype, device=device)
        full, bag_of, scale, bad = torch.ops.torchfuse.dynemb_bag_layout(offsets, n, incl, mean)
        r_full, r_bag, r_scale, r_bad, last = _bag_layout_ref(offs, n, incl, mean)
        assert full.dtype == torch.int64 and full.tolist() == r_full, (offs, n)
        assert bad.dtype == torch.uint8 and bool(bad) == r_bad, (offs, n)
        got = bag_of.tolist()
        assert len(got) == n and all(0 <= b <= last for b in got), (offs, n)
        assert all(r is None or g == r for g, r in zip(got, r_bag)), (offs, n)
        if mean:
            sc = scale.tolist()
            assert scale.dtype == torch.float32 and len(sc) == n
            assert all(r is None or s == pytest.approx(r, rel=1e-7) for s, r in zip(sc, r_scale)), (offs, n)
        else:
            assert scale.numel() == 0
        # with_bags=False: the bounds and the flag alone, the same values
        full2, bag_of2, scale2, bad2 = torch.ops.torchfuse.dynemb_bag_layout(offsets, n, incl, mean, False)
        assert torch.equal(full2, full) and torch.equal(bad2, bad) and bag_of2.numel() == scale2.numel() == 0
    with pytest.raises(TypeError, match="int32 or int64"):
        torch.ops.torchfuse.dynemb_bag_layout(torch.zeros(2, device=device), 3, incl, mean)
    with pytest.raises(RuntimeError, match="no bags"):
        torch.ops.torchfuse.dynemb_bag_layout(torch.zeros(1 if incl else 0, dtype=otype, device=device), 3, incl, mean)


def test_bag_layout_in_training(device):
    """DynamicEmbeddingBag's training path on dynemb_bag_layout's outputs, empty bags included:
    outputs and rows after one step against F.embedding_bag on the same rows, and errors for bad
    offsets."""
    for mode in ("sum", "mean"):
        bag = DynamicEmbeddingBag(6, 256, device=device, mode=mode, optimizer=tfo.SGD(0.25),
                                  initializer=("uniform", -1.0, 1.0), seed=3)
        ids = _t(_keys(50, _keys(20)), device)  # repeats too
        offsets = _t([0, 0, 7, 20, 20, 33], device)  # empty bags too
        out = bag(ids, offsets)
        uniq, inv = torch.unique(ids, return_inverse=True)
        rows0, _ = bag.find(uniq)
        ref_out = F.embedding_bag(inv, rows0, offsets, mode=mode)
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
        g = torch.randn_like(out)
        (out * g).sum().backward()
        rows_ref = rows0.detach().clone().requires_grad_(True)
        (F.embedding_bag(inv, rows_ref, offsets, mode=mode) * g).sum().backward()
        torch.testing.assert_close(bag.find(uniq)[0], rows0 - 0.25 * rows_ref.grad, rtol=1e-6, atol=1e-6)
        for bad in ([1, 7, 20], [0, 9, 4], [0, 7, 51]):
            with pytest.raises(ValueError, match="offsets must start at 0"):
                bag(ids, _t(bad, device))


@pytest.mark.parametrize("mean", [False, True])
def test_pool_inv_and_clamped_bounds(device, mean):
    """dynemb_pool through inv (slots of the unique ids) equals the pool of slots[inv]; bag bounds
    outside the batch or out of order are clamped into it (short or empty bags, no fault)."""
    table = DynamicEmbedding(12, 512, device=device, initializer=("uniform", -1.0, 1.0), seed=2)
    keys = _t(_keys(60), device)
    table.find_or_insert(keys)
    slots_u = table._lookup(keys)
    inv = torch.randint(0, 60, (97,), device=device)
    w = torch.rand(97, device=device)
    ops = torch.ops.torchfuse
    for offs in ([0, 10, 10, 50, 97], [0, 97], [5, 3, 120, 40, -7]):
        offsets = _t(offs, device)
        got = ops.dynemb_pool(slots_u, offsets, w, table._values, table._values_host, mean, inv)
        clamped, lo = [], 0
        for o in offs:  # the kernels' rule: each bound into [0, n], an end not before its start
            o = min(max(o, 0), 97)
            clamped.append(o)
        ref = []
        for b in range(len(offs) - 1):
            a = clamped[b]
            e = min(max(clamped[b + 1], a), 97)
            rows = table._values[slots_u[inv[a:e]]] * w[a:e, None]
            r = rows.sum(0) if e > a else torch.zeros(12, device=device)
            ref.append(r / (e - a) if mean and e > a else r)
        torch.testing.assert_close(got, torch.stack(ref), rtol=1e-5, atol=1e-6)
        if offs == sorted(offs) and offs[-1] == 97:
            direct = ops.dynemb_pool(slots_u[inv], offsets, w, table._values, table._values_host, mean)
            torch.testing.assert_close(got, direct, rtol=0, atol=0)


@pytest.mark.parametrize("record", [1 << 20, 0])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_pool_early_with_evictions(device, mode, record):
    """A training batch into a full LRU table that evicts: with the pool queued before the host's wait
    (dynemb_find_or_insert_pool) the bags must be pooled again after the eviction row work (the new
    keys' rows replace the victims'), so the output equals the bags of the rows the table holds right
    after the forward. With no eviction record (record 0) the kernels write those rows before the pool,
    which then runs once. Also: bad offsets raise and leave the table untouched."""
    bag = DynamicEmbeddingBag(8, 256, device=device, bucket_size=128, eviction="lru", mode=mode,
                              optimizer=tfo.SGD(0.1), initializer=("uniform", -1.0, 1.0), seed=11,
                              evicted_record_limit=record)
    assert bag.capacity == bag.max_capacity
    evicted = 0
    for step in range(6):
        keys = _keys(120)
        ids = _t(keys + keys[:30], device)  # repeats in the batch
        offsets = _t([0] + sorted(random.sample(range(1, 150), 11)), device)
        before = bag.evicted_dropped + sum(e[0].numel() for e in bag._evicted)
        out = bag(ids, offsets)
        uniq, inv = torch.unique(ids, return_inverse=True)
        rows, found = bag.find(uniq)
        assert bool(found.all())
        torch.testing.assert_close(out, F.embedding_bag(inv, rows, offsets, mode=mode), rtol=1e-6, atol=1e-6)
        evicted += bag.evicted_dropped + sum(e[0].numel() for e in bag._evicted) - before
        (out * torch.randn_like(out)).sum().backward()
    assert evicted > 0  # the re-pool was exercised
    assert (bag.evicted_dropped == evicted) == (record == 0) and (not bag._evicted) == (record == 0)
    snapshot = bag.find(uniq)[0].clone()
    n = len(bag)
    with pytest.raises(ValueError, match="offsets must start at 0"):
        bag(_t(_keys(40), device), _t([0, 30, 20], device))
    assert len(bag) == n and torch.equal(bag.find(uniq)[0], snapshot)


def check_segments(ids, perm, uniq, seg, inv, n_unique):
    """A grouping of ids in any order of the groups: each group one distinct id, its occurrences in
    batch order (perm increasing within it), seg its bounds, inv each occurrence's group; uniq and seg
    defined past n_unique as dynemb_sort_segments leaves them (seg n there)."""
    n, nu = ids.numel(), int(n_unique)
    assert nu == torch.unique(ids).numel()
    assert torch.equal(torch.sort(perm)[0], torch.arange(n, device=ids.device))  # a permutation
    u = uniq[:nu]
    assert torch.unique(u).numel() == nu
    group = inv[perm]  # the group of each sorted position
    assert torch.equal(ids[perm], u[group])
    if n:
        step = group[1:] - group[:-1]
        assert int(group[0]) == 0 and int(group[-1]) == nu - 1 and bool(((step == 0) | (step == 1)).all())
        same = step == 0
        assert bool((perm[1:][same] > perm[:-1][same]).all())  # batch order within a group
        starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=ids.device), torch.nonzero(~same).flatten() + 1])
        assert torch.equal(seg[:nu], starts)
    assert bool((seg[nu:] == n).all())


@pytest.mark.parametrize("n,universe", [(0, 1), (1, 1), (9, 4), (3000, 50), (4097, 100000), (200003, 150001)])
def test_sort_segments(device, n, universe):
    """dynemb_sort_segments (the sort and the grouping in one op) against torch.sort(stable=True) and
    torch.unique: a valid grouping (check_segments) of the same distinct ids with the same counts;
    extreme keys included. The CPU sorts the ids themselves: the stable sort's permutation, bit for
    bit, and the groups in id order. CUDA sorts by the ids' 32-bit hashes: its groups in hash order."""
    base = torch.randint(-2**63, 2**63 - 1, (universe,), dtype=torch.int64)
    base[0] = -2**63
    if universe > 2:
        base[1], base[2] = 2**63 - 1, -1
    ids = base[torch.randint(0, universe, (n,))].to(device)
    perm, uniq, seg, inv, n_unique = torch.ops.torchfuse.dynemb_sort_segments(ids)
    assert perm.dtype == torch.int64 and perm.shape == (n,) and uniq.shape == (n,) and seg.shape == (n + 1,)
    assert n_unique.shape == (1,) and n_unique.device == ids.device
    check_segments(ids, perm, uniq, seg, inv, n_unique)
    nu = int(n_unique)
    ref_u, ref_counts = torch.unique(ids, return_counts=True)
    order = torch.argsort(uniq[:nu])
    assert torch.equal(uniq[:nu][order], ref_u) and torch.equal((seg[1:nu + 1] - seg[:nu])[order], ref_counts)
    if device == "cpu":
        assert torch.equal(perm, torch.sort(ids, stable=True)[1]) and torch.equal(uniq[:nu], ref_u)
    with pytest.raises(TypeError, match="int64"):
        torch.ops.torchfuse.dynemb_sort_segments(ids.int())
    with pytest.raises(RuntimeError, match="1-D"):
        torch.ops.torchfuse.dynemb_sort_segments(ids.view(1, -1))


def _hash_top32(ids: torch.Tensor):
    """tf_mix64(id) >> 32 for each id (numpy's uint64 arithmetic wraps as the kernels' does)."""
    import numpy as np
    x = ids.cpu().numpy().astype(np.uint64)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return torch.from_numpy((x >> np.uint64(32)).astype(np.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_sort_segments_hash_collisions():
    """CUDA's hash sort where distinct ids share a 32-bit hash key (about a hundred pairs in a million
    distinct ids; the test checks that some do): those runs are put in id order and the grouping is
    still exact, with a hot id (a tenth of the batch) among the repeats."""
    universe, n = 1 << 20, 3 << 20
    base = torch.unique(torch.randint(-2**63, 2**63 - 1, (universe,), dtype=torch.int64))
    h = _hash_top32(base)
    hs, hc = torch.unique(h, return_counts=True)
    assert int((hc > 1).sum()) > 10  # collisions present: the fix-up path runs
    ids = base[torch.randint(0, base.numel(), (n,))]
    ids[torch.randperm(n)[: n // 10]] = base[0]
    ids = torch.cat([ids, base[torch.isin(h, hs[hc > 1])]])  # every colliding id at least once
    ids = ids.cuda()
    check_segments(ids, *torch.ops.torchfuse.dynemb_sort_segments(ids))


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_one_sync_training_matches_two(device, opt):
    """A training batch into a table at max_capacity (one host wait: the grouping on the device, its
    count handed to the insert) and into the same table with room to grow that never grows (two waits:
    the distinct ids counted first, for the growth check): the same outputs, updated rows and state,
    and bookkeeping, step for step, with new and repeated ids. No evictions: which of two equal-score
    keys goes depends on slots, a race on the GPU (evictions through the op: test_find_or_insert_sync_*)."""
    def make(max_capacity):
        o = tfo.SGD(0.5) if opt == "sgd" else tfo.Adam(0.05)
        return DynamicEmbeddingBag(4, 512, max_capacity=max_capacity, device=device, bucket_size=128,
                                   eviction="lru", optimizer=o, initializer=("uniform", -1.0, 1.0), seed=5)
    bags = {True: make(512), False: make(4096)}  # 200 keys stay under the growth threshold (384)
    pool = _keys(200)
    for step in range(5):
        ids = _t(_keys(90, pool), device)
        offsets = _t(sorted(random.sample(range(1, 90), 9)), device)
        offsets = torch.cat([_t([0], device), offsets])
        grad = torch.randn(10, 4, device=device)
        outs = {}
        for one, bag in bags.items():
            out = bag(ids, offsets)
            (out * grad).sum().backward()
            outs[one] = out.detach()
        torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=0)
        a, b = bags[False], bags[True]
        assert a.capacity == b.capacity == 512
        assert len(a) == len(b) and a._version == b._version and a._clock == b._clock
        for x, y in zip(_sorted_by_key(*a._compact()), _sorted_by_key(*b._compact())):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        assert a.drain_evicted()[0].numel() == b.drain_evicted()[0].numel() == 0
    assert 100 < len(bags[True]) <= 200


@pytest.mark.parametrize("bucket_size", [16, 128])
def test_find_or_insert_sync_n_valid_and_abort(device, bucket_size):
    """dynemb_find_or_insert_sync's n_valid (take the first n_valid[0] keys of the query) and abort
    (take none): a padded query with n_valid gives the result of the unpadded one, the padding is never
    inserted; an aborted call leaves every table tensor as it was and returns no rows. On CUDA with
    128-slot buckets the counts, keys taken and flag reach the host in mapped memory, written by the
    insert kernel; with smaller buckets they are copied after it."""
    ops = torch.ops.torchfuse
    t = DynamicEmbedding(5, 4 * bucket_size, device=device, bucket_size=bucket_size, initializer=("uniform", -1.0, 1.0),
                         seed=3, optimizer=tfo.Adagrad(0.1))
    first = _t(_keys(bucket_size), device)
    t.insert(first, torch.randn(first.numel(), 5, device=device))
    q = torch.unique(torch.cat([first[: bucket_size // 2], _t(_keys(bucket_size // 2), device)]))
    pad = _t([random.randint(I64_MIN, I64_MAX) for _ in range(7)], device)  # no specials: those are in q
    assert not bool(t.contains(pad).any()) and not bool(torch.isin(pad, q).any())  # 2^-60-ish odds

    def run(query, n_valid=None, abort=None):
        c = {name: getattr(t, name).clone() for name in _TABLE_TENSORS}
        out = ops.dynemb_find_or_insert_sync(query, _listed(c), t._epoch + 1, True, 0, t._clock + 1, 2, -1.0, 1.0, 3,
                                             True, n_valid, abort)
        return out, c

    (slots, rows, is_new, _, _, _, counts), c_ref = run(q)
    n = q.numel()
    for abort in (None, torch.zeros((), dtype=torch.bool, device=device)):
        (slots_p, rows_p, is_new_p, _, _, _, counts_p), c_pad = run(torch.cat([q, pad]), _t([n], device), abort)
        assert counts_p.tolist() == counts.tolist()[:3] + [n, 0]
        assert slots_p.shape == (n,) and rows_p.shape == (n, 5) and is_new_p.shape == (n,)
        torch.testing.assert_close(rows_p, rows, rtol=0, atol=0)
        assert torch.equal(is_new_p, is_new)
        # the same keys, rows and state (slots of new keys in one bucket are a race on the GPU)
        for x, y in zip(_sorted_by_key(*_compact_of(c_pad)), _sorted_by_key(*_compact_of(c_ref))):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        assert not bool(torch.isin(c_pad["_keys"][c_pad["_digests"] != 0], pad).any())
    for flag in (torch.ones((), dtype=torch.bool, device=device), torch.ones(1, dtype=torch.uint8, device=device)):
        (slots_a, rows_a, is_new_a, ev_a, _, _, counts_a), c_ab = run(torch.cat([q, pad]), _t([n], device), flag)
        assert counts_a.tolist() == [0, 0, 0, 0, 1]  # no key taken
        assert slots_a.numel() == rows_a.shape[0] == is_new_a.numel() == ev_a.shape[1] == 0
        for name in _TABLE_TENSORS:  # bit for bit: free slots' rows are uninitialised (NaN != NaN)
            assert torch.equal(c_ab[name].view(torch.uint8), getattr(t, name).view(torch.uint8)), name
    # the pool op reads every slot it is handed, past n_valid too: those are -1 (pooled as zeros), and
    # all of them on an aborted call; free rows are set to 7 so that any slot read shows in the bags
    def run_pool(query, n_valid, abort):
        c = {name: getattr(t, name).clone() for name in _TABLE_TENSORS}
        c["_values"][c["_digests"] == 0] = 7.0
        junk = torch.full((4 * query.numel() + 64,), 7, dtype=torch.int64, device=device)
        del junk  # recycled memory under the outputs: not zeros
        full = _t([0, n, query.numel()], device)
        return ops.dynemb_find_or_insert_pool(
            query, _listed(c), t._epoch + 1, True, 0, t._clock + 1, 2, -1.0, 1.0, 3, True, n_valid, abort, full,
            torch.arange(query.numel(), device=device), None, False)
    padded = torch.cat([q, pad])
    bags = run_pool(padded, _t([n], device), None)[7]
    torch.testing.assert_close(bags[0], rows.float().sum(0), rtol=1e-5, atol=1e-5)
    assert torch.equal(bags[1], torch.zeros_like(bags[1]))  # the padding's slots are -1
    bags = run_pool(padded, _t([n], device), torch.ones((), dtype=torch.bool, device=device))[7]
    assert torch.equal(bags, torch.zeros_like(bags))  # aborted: every slot -1
    with pytest.raises(TypeError, match="n_valid"):
        run(q, _t([n], device).int())
    with pytest.raises(RuntimeError, match="abort"):
        run(q, None, torch.zeros(2, dtype=torch.bool, device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_move_and_host_tier_cuda():
    dim = 4
    a = DynamicEmbedding(dim, 64, device="cpu", bucket_size=16, optimizer=tfo.Adagrad(0.1),
                         hbm_budget_bytes=20 * (dim * 4 + dim * 4))
    ks = _t(_keys(40), "cpu")
    vs = torch.randn(40, dim)
    a.insert(ks, vs)
    a.cuda()
    assert a.device.type == "cuda" and a.hbm_rows == 20 and a._values_host.is_pinned()
    v, f = a.find(ks.cuda())
    assert f.all() and torch.equal(v.cpu(), vs)
    a.cpu()
    assert torch.equal(a.find(ks)[0], vs)


def test_initializer_is_per_key(device):
    a = DynamicEmbedding(6, 32, device=device, initializer=("normal", 0.5, 2.0), seed=7, bucket_size=32)
    b = DynamicEmbedding(6, 32, device=device, initializer=("normal", 0.5, 2.0), seed=7, bucket_size=32)
    a.train(), b.train()
    ks = _keys(10)
    with torch.no_grad():
        ra = a(_t(ks, device))
        rb = b(_t(ks[::-1], device)).flip(0)
    assert torch.equal(ra, rb)
    want = torch.tensor([_init_ref(k, 7, 6, ("normal", 0.5, 2.0)) for k in ks], dtype=torch.float32)
    torch.testing.assert_close(ra.cpu(), want, rtol=1e-6, atol=1e-6)
    c = DynamicEmbedding(6, 32, device=device, initializer=("constant", 0.25), bucket_size=32)
    c.train()
    with torch.no_grad():
        assert torch.equal(c(_t(ks, device)), torch.full((10, 6), 0.25, device=device))


def test_find_or_insert_and_unique_insert(device):
    table = DynamicEmbedding(4, 64, device=device, bucket_size=16, initializer=("uniform", 0.0, 1.0))
    ks = _keys(20)
    rows = table.find_or_insert(_t(ks + ks[:5], device))
    assert len(table) == 20 and torch.equal(rows[20:], rows[:5])
    assert torch.equal(table.find_or_insert(_t(ks, device), unique=True), rows[:20])
    vs = torch.randn(20, 4, device=device)
    table.insert(_t(ks, device), vs, unique=True)
    assert torch.equal(table.find(_t(ks, device))[0], vs)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bag_eval_and_weight_gradients(device, mode):
    dim, P = 5, 12
    pool = _keys(P)
    bag = DynamicEmbeddingBag(dim, 32, device=device, bucket_size=32, mode=mode, optimizer=tfo.SGD(0.1))
    vs = torch.randn(P, dim, device=device)
    bag.insert(_t(pool, device), vs)
    ref = torch.nn.EmbeddingBag(P, dim, mode=mode).to(device)
    with torch.no_grad():
        ref.weight.copy_(vs)
    idx = torch.randint(0, P, (17,), device=device)
    offsets = _t([0, 3, 3, 10], device)
    bag.eval()  # eval: unseen ids read as zeros, nothing inserted
    ids = _t(pool, device)[idx]
    ids[0] = 12345 if 12345 not in pool else 54321
    with torch.no_grad():
        got = bag(ids, offsets)
        mask = torch.ones(17, device=device)
        mask[0] = 0
        want = F.embedding_bag(idx, vs, offsets, mode="sum", per_sample_weights=mask)
        if mode == "mean":  # the unseen id counts as a zero row
            want = want / torch.tensor([3.0, 1.0, 7.0, 7.0], device=device)[:, None]
            want[1] = 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(bag) == P
    if mode == "sum":  # per_sample_weights that need a gradient take PyTorch's embedding_bag
        bag.train()
        w = torch.rand(17, device=device, requires_grad=True)
        w_ref = w.detach().clone().requires_grad_(True)
        g = torch.randn(4, dim, device=device)
        (bag(_t(pool, device)[idx], offsets, w) * g).sum().backward()
        (ref(idx, offsets, per_sample_weights=w_ref) * g).sum().backward()
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            ref.weight -= 0.1 * ref.weight.grad
        torch.testing.assert_close(bag.find(_t(pool, device))[0], ref.weight.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bucket", [16, 128])
@pytest.mark.parametrize("dim", [3, 128])
def test_find_op_matches_lookup_gather(device, dim, bucket):
    """dynemb_find (probe and copy in one kernel; four keys a warp for 128-slot buckets) against
    lookup + gather, with rows in both tiers."""
    table = DynamicEmbedding(dim, 4 * bucket, device=device, bucket_size=bucket, hbm_budget_bytes=20 * dim * 4)
    ks = _keys(30)  # 4 buckets: 40 keys overfilled one of 16 slots about 5% of seeds
    table.insert(_t(ks, device), torch.randn(30, dim, device=device))
    q = _t(ks[::3] + [random.randint(I64_MIN, I64_MAX) for _ in range(7)], device)
    ops = torch.ops.torchfuse
    rows, slots = ops.dynemb_find(q, table._tensors)
    ref_slots = table._lookup(q)
    assert torch.equal(slots, ref_slots)
    assert torch.equal(rows, table._gather(ref_slots, table._values, table._values_host))
    assert (slots >= 0).sum() == len(ks[::3])


def test_ops_opcheck(device):
    """Every table op's schema (mutation and aliasing annotations), fake kernel and AOT tracing,
    checked by torch.library.opcheck on a small live table."""
    ops = torch.ops.torchfuse
    t = DynamicEmbeddingBag(5, 64, device=device, bucket_size=16, optimizer=tfo.Adam(0.1))
    t.train()
    t(_t([3, -1, 7, 2**62, 3], device), _t([0, 2, 2, 5], device))  # inserts four keys
    q = _t([3, 7, 11, -1], device)
    found = ops.dynemb_lookup(q, _state(t), 0).clamp(min=0)
    f32 = dict(device=device, dtype=torch.float32)
    t128 = DynamicEmbedding(5, 128, device=device, bucket_size=128)  # find_or_insert's quarter-warp path on the GPU
    t128.insert(_t([3, 7], device), torch.ones(2, 5, device=device))
    full = DynamicEmbedding(5, 16, device=device, bucket_size=16, optimizer=tfo.Adam(0.1))  # one full bucket: evicts
    full.insert(_t(list(range(1000, 1016)), device), torch.randn(16, 5, device=device))
    cases = [
        (ops.dynemb_lookup.default, (q, _state(t), 0)),
        (ops.dynemb_lookup.default, (q, _state(t), 7)),
        (ops.dynemb_find.default, (q, t._tensors)),
        (ops.dynemb_gather.default, (found, t._values, t._values_host)),
        (ops.dynemb_gather.default, (found, t._values, t._values_host, torch.argsort(found))),
        (ops.dynemb_pool.default, (found, _t([0, 1, 4], device), None, t._values, t._values_host, False)),
        (ops.dynemb_segment_sum.default, (torch.randn(4, 5, **f32), _t([1, 0, 2, 3], device), _t([0, 2, 3, 4], device),
                                          None, None)),
        (ops.dynemb_touch.default, (_state(t), found, 0, 5)),
        (ops.dynemb_scatter.default, (found[:2], torch.randn(2, 5, **f32), t._values.clone(), t._values_host.clone())),
        (ops.dynemb_scatter.default, (found[:2], torch.randn(2, 5, **f32), t._values.clone(), t._values_host.clone(),
                                      _t([1, 0], device))),
        (ops.dynemb_update.default, (found[:2], torch.randn(2, 5, **f32), _state(t), 3, 0.1, 1e-8, 0.9, 0.999, 0.1)),
        (ops.dynemb_init.default, (found[:2], q[:2], None, _state(t), 1, 0.0, 1.0, 0)),
        (ops.dynemb_init_gather.default, (torch.cat([found[:2], _t([-1], device)]), q[:3],
                                          torch.tensor([1, 0, 1], dtype=torch.uint8, device=device), _state(t),
                                          1, 0.0, 1.0, 0)),
        (ops.dynemb_init_gather.default, (torch.cat([found[:2], _t([-1], device)]), q[:3],
                                          torch.tensor([0, 1, 1], dtype=torch.uint8, device=device), _state(t),
                                          2, -1.0, 1.0, 3, _t([2, 0, 1], device))),
        (ops.dynemb_insert.default, (_t([99, 100], device), _t([-1, -1], device), _state(t), 5, False)),
        (ops.dynemb_find_or_insert_sync.default, (_t([3, 99, 100, 5], device), _state(t128), 6, True, 0, 9, 2, -1.0,
                                                  1.0, 3, True)),
        # one key evicting: which victim goes with which new key is a race on the GPU
        (ops.dynemb_find_or_insert_sync.default, (_t([1000, 1003, 99], device), _state(full), 6, True, 0, 9, 2, -1.0,
                                                  1.0, 3, False)),
        (ops.dynemb_segment_update.default, (torch.randn(4, 5, **f32), _t([1, 0, 2, 3], device),
                                             _t([0, 2, 4], device), None, None, found[:2], _state(t), 3, 0.1,
                                             1e-8, 0.9, 0.999, 0.1)),
        (ops.dynemb_sort_segments.default, (_t([5, -1, 5, 2**62, 0, -1, 5], device),)),
        (ops.dynemb_sort_segments.default, (_t([], device),)),
        (ops.dynemb_find_or_insert_sync.default, (_t([3, 99, 100, 5, 77], device), _state(t128), 6, True, 0, 9, 2,
                                                  -1.0, 1.0, 3, True, _t([3], device),
                                                  torch.zeros((), dtype=torch.bool, device=device))),
        (ops.dynemb_find_or_insert_pool.default, (_t([3, 99, 100, 5], device), _state(t128), 6, True, 0, 9, 2, -1.0,
                                                  1.0, 3, False, None, None, _t([0, 1, 4], device),
                                                  _t([0, 1, 2, 3], device), None, False)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_tables_ops_opcheck(device):
    """The table-batched ops (torchfuse.dynemb_tables): schema, fake kernel and AOT tracing on two live
    tables, the second with no keys in the batch."""
    ops = torch.ops.torchfuse
    ts = [DynamicEmbeddingBag(5, 64, device=device, bucket_size=16, optimizer=tfo.Adam(0.1)) for _ in range(2)]
    for t in ts:
        t.train()
        t(_t([3, -1, 7, 2**62, 3], device), _t([0, 2, 2, 5], device))
    q = _t([3, 7, 11, -1], device)
    starts = [0, 4, 4]
    f32 = dict(device=device, dtype=torch.float32)

    def each(clone=True):  # the ops' `tables`: every table's state list, one after another
        return [x for t in ts for x in (_state(t) if clone else t._tensors)]

    found = ops.dynemb_tables_lookup(q, starts, each(), [0, 0])
    found = found.clamp(min=0)
    cases = [
        (ops.dynemb_tables_lookup.default, (q, starts, each(), [3, 3])),
        (ops.dynemb_tables_insert.default, (_t([99, 100, 101], device), _t([-1, -1, -1], device), [0, 2, 3], each(),
                                            [5, 5], [False, True])),
        (ops.dynemb_tables_init.default, (found, q, None, starts, each(), [1, 2], [0.0, -1.0], [1.0, 1.0], [0, 1])),
        (ops.dynemb_tables_touch.default, (each(), found, starts, [0, 1], [5, 6])),
        (ops.dynemb_tables_update.default, (found, torch.randn(4, 5, **f32), starts, each(), 3, 0.1, 1e-8, 0.9, 0.999,
                                            [0.1, 0.2])),
        (ops.dynemb_tables_pool.default, (found, _t([0, 1, 4, 4, 4], device), None, 2, [1, 1], each(False),
                                          [False, True])),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("dim", [6, 32])
@pytest.mark.parametrize("bucket_size, n_first, n_new", [(32, 24, 20), (128, 120, 60)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_find_or_insert_full_table_rows(device, dtype, bucket_size, n_first, n_new, dim):
    """find_or_insert on a full table of one bucket (the one-op path; 128-slot buckets take the
    quarter-warp kernels on the GPU, 6 and 32 columns the 2- and 16-byte row copies): rows returned
    for found, new and evicting keys equal the table's rows afterwards; new rows are the
    initializer's; evicted keys come back with the rows they had."""
    t = DynamicEmbedding(dim, bucket_size, device=device, dtype=dtype, bucket_size=bucket_size, eviction="lru",
                         initializer=("uniform", -1.0, 1.0), seed=5, optimizer=tfo.Adam(0.1))
    first = _t(_keys(n_first), device)
    t.insert(first, torch.randn(n_first, dim, device=device).to(dtype))
    t._state.copy_(torch.randn_like(t._state))  # optimizer state travels with an evicted key
    before = {k: r.clone() for k, r in zip(first.tolist(), t.find(first)[0])}
    slots_before = dict(zip(first.tolist(), t._lookup(first).tolist()))
    state_before = {k: t._state[s].clone() for k, s in slots_before.items()}
    q = torch.cat([first[:5], _t(_keys(n_new), device)])  # 5 found and n_new new keys: more than the slots
    q = torch.unique(q)
    rows = t.find_or_insert(q)
    got, found = t.find(q)
    assert bool(found.all())
    assert len(t) == bucket_size
    torch.testing.assert_close(rows, got, rtol=0, atol=0)
    ref = DynamicEmbedding(dim, 1024, device=device, dtype=dtype, initializer=("uniform", -1.0, 1.0), seed=5)
    new = torch.tensor([k not in before for k in q.tolist()], device=device)
    torch.testing.assert_close(rows[new], ref.find_or_insert(q[new]), rtol=0, atol=0)
    ev_keys, ev_rows, ev_state, _ = t.drain_evicted()
    assert ev_keys.numel() == len(before) + int(new.sum()) - bucket_size  # _keys repeats special keys
    for k, r, st in zip(ev_keys.tolist(), ev_rows, ev_state):
        torch.testing.assert_close(r, before[k], rtol=0, atol=0)
        torch.testing.assert_close(st, state_before[k], rtol=0, atol=0)
    new_slots = t._lookup(q[new])
    assert bool((t._state[new_slots] == 0).all())  # new keys start with zeroed optimizer state


_TABLE_TENSORS = STATE_FIELDS


def _listed(c):
    """A {name: tensor} copy of a table's state as the ops' `table` list."""
    return [c[name] for name in STATE_FIELDS]


def _state(t):
    """A copy of table t's state, as the ops' `table` list."""
    return [x.clone() for x in t._tensors]


def _state_around(values, values_host, state, state_host, bucket_size=16):
    """A `table` list around these rows: an empty hash table with one slot per row."""
    cap, dev = values.shape[0] + values_host.shape[0], values.device
    z = [torch.zeros(cap, dtype=d, device=dev) for d in (torch.int64, torch.uint8, torch.int64, torch.int32)]
    return z + [torch.zeros(cap // bucket_size, dtype=torch.int32, device=dev), values, values_host, state, state_host]


def _compact_of(c):
    """(keys, values, state, scores) of the occupied slots of cloned table tensors (no host rows)."""
    occ = torch.nonzero(c["_digests"]).squeeze(1)
    return c["_keys"][occ], c["_values"][occ], c["_state"][occ], c["_scores"][occ]


def _sorted_by_key(keys, *cols):
    o = torch.argsort(keys)
    return [keys[o]] + [c[o] for c in cols]


@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("bucket_size", [32, 128])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_find_or_insert_without_eviction_record(device, policy, bucket_size, with_rows):
    """A table keeping no eviction record (evicted_record_limit=0: dynemb_find_or_insert_sync with
    keep_evicted=False, where the kernels write the evicting keys' rows over the victims' at once)
    against the op keeping them (the victims' rows copied out first, then the new rows written), run on
    a copy of the table's tensors before each batch: the same rows returned, the same keys, rows, state
    and scores in the table, the same counts; the evictions only counted (evicted_dropped), no rows
    kept. A full table of 4 buckets with Adam state; 128-slot buckets take the quarter-warp kernels on
    the GPU. insert(..., return_evicted=True) on it still returns the victims' rows."""
    ops = torch.ops.torchfuse
    n_first, n_batch = 15 * bucket_size // 8, 15 * bucket_size // 16
    t = DynamicEmbedding(6, 4 * bucket_size, device=device, bucket_size=bucket_size, eviction=policy,
                         optimizer=tfo.Adam(0.1), initializer=("uniform", -1.0, 1.0), seed=3, evicted_record_limit=0)
    first = _t(_keys(n_first), device)
    t.insert(first, torch.randn(n_first, 6, device=device))
    t._state.copy_(torch.randn(t._state.shape, device=device))
    pool = first.tolist() + _keys(4 * n_first)
    n_evicted = 0
    for step in range(6):
        c = {name: getattr(t, name).clone() for name in _TABLE_TENSORS}
        q = torch.unique(_t(random.sample(pool, n_batch), device))
        size, epoch, clock, dropped = len(t), t._epoch + 1, t._clock + 1, t.evicted_dropped
        slots, rows, is_new, ev, old_values, old_state, counts = ops.dynemb_find_or_insert_sync(
            q, _listed(c), epoch, True, 1 if policy == "lfu" else 0, clock, 2, -1.0, 1.0, 3, True)
        inserted, n_ev, failed, _, _ = counts.tolist()
        assert ev.shape == (4, n_ev) and old_values.shape[0] == n_ev and failed == 0
        if with_rows:
            got = t.find_or_insert(q, unique=True)
            torch.testing.assert_close(got, rows, rtol=0, atol=0)
        else:  # the op without rows out, as DynamicEmbedding's training forward calls it
            t._find_or_insert(q)
        assert (t._epoch, t._clock) == (epoch, clock)
        assert len(t) == size + inserted - n_ev == int((t._digests != 0).sum())
        assert t.evicted_dropped == dropped + n_ev and t.drain_evicted()[0].numel() == 0
        n_evicted += n_ev
        occ = torch.nonzero(c["_digests"]).squeeze(1)
        want = (c["_keys"][occ], c["_values"][occ], c["_state"][occ], c["_scores"][occ])
        for x, y in zip(_sorted_by_key(*t._compact()), _sorted_by_key(*want)):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert n_evicted > 0
    # the op itself: with keep_evicted=False the list and the victims' rows come back empty
    q = torch.unique(_t(_keys(n_batch), device))
    out = ops.dynemb_find_or_insert_sync(q, t._tensors, t._next_epoch(), True, 0, t._bump("_clock"), 2, -1.0, 1.0, 3,
                                         True, None, None, False)
    n_ev = out[6].tolist()[1]
    assert n_ev > 0 and out[3].shape == (4, 0) and out[4].shape == (0, 6) and out[5].shape == (0, 12)
    t._size += out[6].tolist()[0] - n_ev
    # an insert asking for its evictions gets them, rows included
    present = t._compact()
    keys = _t(_keys(n_batch), device)
    keys = keys[~t.contains(keys)]
    ev_keys, ev_rows, ev_state, _ = t.insert(keys, torch.randn(keys.numel(), 6, device=device), return_evicted=True,
                                             unique=True)
    assert ev_keys.numel() > 0
    where = {k: i for i, k in enumerate(present[0].tolist())}
    idx = torch.tensor([where[k] for k in ev_keys.tolist()], device=device)
    assert torch.equal(ev_rows, present[1][idx]) and torch.equal(ev_state, present[2][idx])


def test_find_or_insert_concurrent_claims(device):
    """Many keys racing for few buckets (4 buckets of 128 slots, batches of 300 distinct keys, LRU
    eviction from the second batch on): every key of a batch is found afterwards, no key is stored
    twice, the size matches the occupied slots, and present + evicted keys are exactly the keys seen."""
    t = DynamicEmbedding(4, 512, device=device, bucket_size=128, eviction="lru", initializer=("constant", 0.5))
    seen = set()
    for _ in range(5):
        q = torch.unique(_t(_keys(300), device))
        seen |= set(q.tolist())
        rows = t.find_or_insert(q, unique=True)
        assert rows.shape == (q.numel(), 4)
        assert bool(t.find(q)[1].all())
        keys = t._compact()[0]
        assert keys.numel() == torch.unique(keys).numel() == len(t) == int((t._digests != 0).sum())
    ev = t.drain_evicted()[0]
    assert set(t._compact()[0].tolist()) | set(ev.tolist()) == seen
    assert ev.numel() + len(t) == len(seen)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_find_or_insert_reuses_erased_slots(device, policy):
    """On the GPU, find_or_insert's first kernel places a missing key in an empty slot of its bucket
    while the batch's other keys are still probing. Erase leaves the old key in the slot it empties,
    so each batch here brings erased keys back alongside new keys that may take those very slots.
    After every batch: each key in its own slot, found keys keep their rows, new keys get the
    initializer's, the size is the number of occupied slots, and the dict model agrees."""
    dim = 4
    t = DynamicEmbedding(dim, 2048, device=device, bucket_size=128, eviction=policy, initializer=("constant", 0.25))
    model = {}
    pool = list(set(_keys(2000)))
    erased = []
    for _ in range(6):
        q = list(set(random.sample(pool, 300)) | set(erased[:150]))
        random.shuffle(q)
        qt = _t(q, device)
        rows = t.find_or_insert(qt, unique=True)
        want = torch.stack([model[k] if k in model else torch.full((dim,), 0.25) for k in q]).to(device)
        torch.testing.assert_close(rows, want, rtol=0, atol=0)
        vals = torch.randn(len(q), dim)
        t.insert(qt, vals.to(device))  # distinct rows, so a key sharing another's slot shows up
        model.update(zip(q, vals))
        keys = t._compact()[0]
        assert keys.numel() == torch.unique(keys).numel() == len(t)
        _check_model(t, model, device, dim)
        erased = random.sample(list(model), len(model) // 2)
        assert t.erase(_t(erased, device)) == len(erased)
        for k in erased:
            del model[k]
        _check_vacant_keys(t)
    _check_model(t, model, device, dim, extra_absent=erased)


@pytest.mark.parametrize("dim", [3, 128, 300])
def test_segment_sum_long_runs(device, dim):
    """dynemb_segment_sum against a float64 sum per id, with runs whose lengths straddle CUDA's
    chunk (32 occurrences), level-1 (32 chunks) and level-2 (1024 chunks) edges at odd offsets: exact
    for gradients in eighths (every order sums them exactly), to fp32 rounding for random ones, and
    the same bits on a second call."""
    ops = torch.ops.torchfuse
    counts = [random.randint(1, 40) for _ in range(7)] + [31, 32, 33, 1023, 1024, 1025, 32 * 33, 32 * 64 + 5,
                                                           32768, 32768 * 2 + 33, 100003] + [1] * 5
    random.shuffle(counts)
    n_occ = sum(counts)
    seg = torch.tensor([0] + list(itertools.accumulate(counts)), device=device)
    perm = torch.randperm(n_occ, device=device)
    id_of = torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))
    eighths = torch.randint(-8, 9, (n_occ, dim), device=device).float() / 8
    for grad, exact in ((eighths, True), (torch.randn(n_occ, dim, device=device), False)):
        want = torch.zeros(len(counts), dim, dtype=torch.float64, device=device)
        want.index_add_(0, id_of, grad.double().index_select(0, perm))
        got = ops.dynemb_segment_sum(grad, perm, seg, None, None)
        assert torch.equal(got, ops.dynemb_segment_sum(grad, perm, seg, None, None))
        if exact:
            assert torch.equal(got.double(), want)
        else:
            # fp32 sums of up to 1e5 terms of N(0, 1), in any order: well under 1e-6 of sum |g|
            mag = torch.zeros_like(want).index_add_(0, id_of, grad.double().abs().index_select(0, perm))
            assert ((got.double() - want).abs() <= 1e-6 * mag + 1e-6).all()


@pytest.mark.parametrize("bags", [False, True])
@pytest.mark.parametrize("dim", [5, 128, 130])
@pytest.mark.parametrize("opt", [0, 1, 2, 3])
def test_segment_update_matches_sum_then_update(device, opt, dim, bags):
    """dynemb_segment_update (on CUDA the sums applied as they are made; rows wider than 128 columns
    take the two ops) against dynemb_segment_sum then dynemb_update, for every optimizer: ids with one
    occurrence, and a hot id whose run crosses several 32-occurrence chunks, and an id cut by a chunk
    edge, with bag sources and scales or without."""
    ops = torch.ops.torchfuse
    # 70000: a run over more than two whole groups of 1024 chunks (CUDA's level-2 sums)
    counts = [1] * 20 + [150] + [3] * 7 + [40] + [1] * 9 + [2] + [70000]
    random.shuffle(counts)
    n_occ, n_u = sum(counts), len(counts)
    seg = torch.tensor([0] + list(itertools.accumulate(counts)), device=device)
    perm = torch.randperm(n_occ, device=device)
    n_rows = 50 if bags else n_occ
    grad = torch.randn(n_rows, dim, device=device)
    bag_of = torch.randint(0, n_rows, (n_occ,), device=device) if bags else None
    scale = torch.rand(n_occ, device=device) if bags else None
    slots = torch.randperm(256, device=device)[:n_u]
    slots[3] = -1  # an id gone from the table since the forward: skipped
    sdim = [0, dim, 1, 2 * dim][opt]
    values = torch.randn(256, dim, device=device)
    state = torch.rand(256, sdim, device=device)
    host = values.new_empty(0, dim)
    host_st = state.new_empty(0, sdim)
    args = (opt, 0.05, 1e-8, 0.9, 0.999, 0.07)
    v1, s1 = values.clone(), state.clone()
    ops.dynemb_update(slots, ops.dynemb_segment_sum(grad, perm, seg, bag_of, scale), _state_around(v1, host, s1, host_st),
                      *args)
    v2, s2 = values.clone(), state.clone()
    ops.dynemb_segment_update(grad, perm, seg, bag_of, scale, slots, _state_around(v2, host, s2, host_st), *args)
    # bit for bit: the same sums in the same order, and one optimizer arithmetic in every kernel
    assert torch.equal(v2, v1)
    assert torch.equal(s2, s1)
    assert not torch.equal(v2, values)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opt", [0, 1, 3])
def test_update_and_pool_cuda_equal_cpu(opt, dtype):
    """The optimizer step and the bags' pooling round every operation as the CPU's C does (no fused
    multiply-add), so CUDA equals the CPU bit for bit (RowWiseAdagrad's row sum runs as a warp tree on
    CUDA, so it is left out)."""
    ops = torch.ops.torchfuse
    n, dim = 256, 37
    values = torch.randn(n, dim).to(dtype)
    sdim = [0, dim, 1, 2 * dim][opt]
    state = torch.rand(n, sdim)
    slots = torch.randperm(n)[:200]
    grad = torch.randn(200, dim)
    args = (opt, 0.05, 1e-8, 0.9, 0.999, 0.07)
    offsets = torch.tensor([0, 0, 5, 60, 61, 200])
    w = torch.randn(200)
    out = []
    for dev in ("cpu", "cuda"):
        v, s = values.to(dev, copy=True), state.to(dev, copy=True)
        for _ in range(3):
            ops.dynemb_update(slots.to(dev), grad.to(dev), _state_around(v, v.new_empty(0, dim), s, s.new_empty(0, sdim)),
                              *args)
        pooled = [ops.dynemb_pool(slots.to(dev), offsets.to(dev), ww, v, v.new_empty(0, dim), mean)
                  for ww, mean in ((w.to(dev), False), (None, True))]
        out.append([t.cpu() for t in (v, s, *pooled)])
    for a, b in zip(*out):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("dim", [4, 128, 132])
def test_pool_op_layouts(device, shift, dim):
    """dynemb_pool against F.embedding_bag for row widths on both sides of the 16-byte fast path
    (fp32, <= 128 columns, a multiple of 4) and rows that start off a 16-byte boundary."""
    n = 50
    rows = torch.randn(n * dim + shift, device=device)[shift:].view(n, dim)
    host = rows.new_empty(0, dim)
    slots = _t([random.randrange(-1, n) for _ in range(40)], device)
    offsets = _t([0, 0, 1, 7, 40], device)
    w = torch.rand(40, device=device)
    for weights, mean in [(None, False), (w, False), (None, True)]:
        got = torch.ops.torchfuse.dynemb_pool(slots, offsets, weights, rows, host, mean)
        padded = torch.cat([rows, rows.new_zeros(1, dim)])  # slot -1 -> a zero row (counted by mean, as ours)
        ref = F.embedding_bag(torch.where(slots < 0, n, slots), padded, offsets[:-1], mode="mean" if mean else "sum",
                              per_sample_weights=weights)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [3, 32])
def test_gather_scatter_order(device, dim, dtype):
    """dynemb_gather / dynemb_scatter with a visiting order (a random permutation, argsort(slots): what a
    table with host rows on CUDA passes) equal the calls without it: slots in both tiers, -1 slots
    (zeros gathered, nothing scattered), an empty batch; a bad order is refused."""
    ops = torch.ops.torchfuse
    t = DynamicEmbedding(dim, 64, device=device, dtype=dtype, bucket_size=16, hbm_budget_bytes=20 * dim * 4)
    assert 0 < t.hbm_rows < t.capacity and t._values_host.numel() > 0
    rows, host = t._values, t._values_host
    rows.copy_(torch.randn(rows.shape).to(dtype))
    host.copy_(torch.randn(host.shape).to(dtype))
    slots = torch.randperm(t.capacity, device=device)[:40]
    slots[torch.randperm(40, device=device)[:7]] = -1
    assert bool((slots < t.hbm_rows).any()) and bool((slots >= t.hbm_rows).any())
    orders = [torch.randperm(40, device=device), torch.argsort(slots), torch.arange(40, device=device)]
    want = ops.dynemb_gather(slots, rows, host)
    assert bool((want[slots < 0] == 0).all())
    for order in orders:
        assert torch.equal(ops.dynemb_gather(slots, rows, host, order), want)
        assert torch.equal(ops.dynemb_gather(slots, rows, host, order=order), want)
    src = torch.randn(40, dim).to(dtype).to(device)

    def host_copy():  # on CUDA host rows must be mapped pinned memory (a clone is pageable)
        if device == "cpu":
            return host.clone()
        h = ops.dynemb_host_rows(rows, host.shape[0], dim, dtype)
        h.copy_(host)
        return h

    ref_rows, ref_host = rows.clone(), host_copy()
    ops.dynemb_scatter(slots, src, ref_rows, ref_host)
    for order in orders:
        r, h = rows.clone(), host_copy()
        ops.dynemb_scatter(slots, src, r, h, order)
        assert torch.equal(r, ref_rows) and torch.equal(h, ref_host)
    empty = _t([], device)
    assert ops.dynemb_gather(empty, rows, host, empty).shape == (0, dim)
    ops.dynemb_scatter(empty, src[:0], rows, host, empty)
    with pytest.raises(TypeError, match="order must be int64"):
        ops.dynemb_gather(slots, rows, host, orders[0].to(torch.int32))
    with pytest.raises(RuntimeError, match="order must have as many entries as slots"):
        ops.dynemb_gather(slots, rows, host, orders[0][:39])
    with pytest.raises(RuntimeError, match="order must have as many entries as slots"):
        ops.dynemb_scatter(slots, src, rows.clone(), host_copy(), _t([0, 1], device))
    with pytest.raises(RuntimeError, match="order must be 1-D"):
        ops.dynemb_gather(slots, rows, host, orders[0].reshape(4, 10))
    with pytest.raises(RuntimeError, match="order must be contiguous"):
        ops.dynemb_scatter(slots, src, rows.clone(), host_copy(), torch.arange(80, device=device)[::2])
    if device != "cpu":
        with pytest.raises(RuntimeError, match="order must be on the same device as slots"):
            ops.dynemb_gather(slots, rows, host, orders[0].cpu())


def _host_rows_like(rows, host):
    """A copy of a table's host rows: on CUDA mapped pinned memory as the table's own (a clone would be
    pageable, which the kernels cannot read); on the CPU a clone."""
    if not rows.is_cuda:
        return host.clone()
    h = torch.ops.torchfuse.dynemb_host_rows(rows, host.shape[0], host.shape[1], host.dtype)
    h.copy_(host)
    return h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [3, 32, 130])
def test_init_gather_matches_init_then_gather(device, dim, dtype):
    """dynemb_init_gather (what a table with host rows on CUDA runs after find_or_insert's op: new rows
    initialised and all rows read in one slot-ordered pass) against dynemb_init then dynemb_gather:
    the rows returned and the table's values and optimizer state in both tiers agree exactly, for new
    and old keys in both tiers, -1 slots (zeros out, nothing written), every initializer kind (none
    included: a new row keeps its values, its state is zeroed), no order / a random order / argsort
    order, all keys new or none, and an empty batch. Bad arguments are refused, naming the argument."""
    ops = torch.ops.torchfuse
    t = DynamicEmbedding(dim, 128, device=device, dtype=dtype, bucket_size=16, optimizer=tfo.Adam(0.1),
                         hbm_budget_bytes=50 * (dim * _elem_size(dtype) + 8 * dim))
    assert 0 < t.hbm_rows < t.capacity and t._values_host.numel() > 0 and t._state_host.numel() > 0
    t._values.copy_(torch.randn(t._values.shape).to(dtype))
    t._values_host.copy_(torch.randn(t._values_host.shape).to(dtype))
    t._state.copy_(torch.randn(t._state.shape))
    t._state_host.copy_(torch.randn(t._state_host.shape))
    n = 60
    slots = torch.randperm(t.capacity, device=device)[:n]
    slots[torch.randperm(n, device=device)[:9]] = -1
    keys = _t(_keys(n), device)
    is_new = (torch.rand(n, device=device) < 0.5).to(torch.uint8)
    for tier in (slots < t.hbm_rows, slots >= t.hbm_rows):  # new and old keys in both tiers
        assert bool((tier & (is_new == 1)).any()) and bool((tier & (is_new == 0) & (slots >= 0)).any())

    def tables():  # the table's state list (dynamic_embedding._table.STATE_FIELDS), rows copied
        return _state(t)[:5] + [t._values.clone(), _host_rows_like(t._values, t._values_host), t._state.clone(),
                                _host_rows_like(t._state, t._state_host)]

    orders = [None, torch.randperm(n, device=device), torch.argsort(slots)]
    for init in ((1, 0.5, 2.0), (2, -1.0, 1.0), (3, 0.25, 0.0), (0, 0.0, 0.0)):
        for mask in (is_new, torch.ones_like(is_new), torch.zeros_like(is_new)):
            ref = tables()
            ops.dynemb_init(slots, keys, mask, ref, *init, 7)
            want = ops.dynemb_gather(slots, ref[5], ref[6])
            assert bool((want[slots < 0] == 0).all())
            for order in orders:
                got_t = tables()
                got = ops.dynemb_init_gather(slots, keys, mask, got_t, *init, 7, order)
                assert got.shape == (n, dim) and got.dtype == dtype
                assert torch.equal(got, want), (init, order)
                for x, y in zip(got_t, ref):
                    assert torch.equal(x, y), (init, order)
    empty = _t([], device)
    e8 = empty.to(torch.uint8)
    assert ops.dynemb_init_gather(empty, empty, e8, tables(), 1, 0.0, 1.0, 7).shape == (0, dim)
    assert ops.dynemb_init_gather(empty, empty, e8, tables(), 1, 0.0, 1.0, 7, empty).shape == (0, dim)
    args = tables()
    with pytest.raises(RuntimeError, match="dynemb_init_gather: is_new must be a contiguous uint8"):
        ops.dynemb_init_gather(slots, keys, is_new.to(torch.int32), args, 1, 0.0, 1.0, 7)
    with pytest.raises(RuntimeError, match="is_new must be a contiguous uint8 tensor of 60"):
        ops.dynemb_init_gather(slots, keys, is_new[:59], args, 1, 0.0, 1.0, 7)
    with pytest.raises(RuntimeError, match="is_new must be 1-D"):
        ops.dynemb_init_gather(slots, keys, is_new.reshape(6, 10), args, 1, 0.0, 1.0, 7)
    with pytest.raises(RuntimeError, match="keys and slots must have the same length"):
        ops.dynemb_init_gather(slots, keys[:59], is_new, args, 1, 0.0, 1.0, 7)
    with pytest.raises(TypeError, match="slots must be int64"):
        ops.dynemb_init_gather(slots.to(torch.int32), keys, is_new, args, 1, 0.0, 1.0, 7)
    with pytest.raises(RuntimeError, match="bad init_kind"):
        ops.dynemb_init_gather(slots, keys, is_new, args, 4, 0.0, 1.0, 7)
    with pytest.raises(TypeError, match=r"table\[7\] \(state\) must be float32"):
        ops.dynemb_init_gather(slots, keys, is_new, args[:7] + [args[7].double()] + args[8:], 1, 0.0, 1.0, 7)
    with pytest.raises(RuntimeError, match="order must have as many entries as slots"):
        ops.dynemb_init_gather(slots, keys, is_new, args, 1, 0.0, 1.0, 7, orders[1][:59])
    with pytest.raises(TypeError, match="order must be int64"):
        ops.dynemb_init_gather(slots, keys, is_new, args, 1, 0.0, 1.0, 7, orders[1].to(torch.int32))
    with pytest.raises(RuntimeError, match=r"table\[6\] \(values_host\) must be contiguous with rows of"):
        ops.dynemb_init_gather(slots, keys, is_new, args[:6] + [args[6][:, :1]] + args[7:], 1, 0.0, 1.0, 7)
    with pytest.raises(RuntimeError, match=r"table\[2\] \(scores\) must be a contiguous 1-D tensor of capacity"):
        ops.dynemb_init_gather(slots, keys, is_new, args[:2] + [args[2][:5]] + args[3:], 1, 0.0, 1.0, 7)
    with pytest.raises(TypeError, match=r"table\[3\] \(marks\) must be Int"):
        ops.dynemb_init_gather(slots, keys, is_new, args[:3] + [args[3].long()] + args[4:], 1, 0.0, 1.0, 7)
    with pytest.raises(RuntimeError, match=r"table must hold the table's 9 state tensors"):
        ops.dynemb_init_gather(slots, keys, is_new, args[:8], 1, 0.0, 1.0, 7)
    with pytest.raises(RuntimeError, match=r"bucket size .* must be a power of two in \[4, 128\]"):
        ops.dynemb_init_gather(slots, keys, is_new, args[:4] + [args[4].new_zeros(64)] + args[5:], 1, 0.0, 1.0, 7)
    if device != "cpu":
        with pytest.raises(RuntimeError, match="is_new must be on the same device"):
            ops.dynemb_init_gather(slots, keys, is_new.cpu(), args, 1, 0.0, 1.0, 7)
        with pytest.raises(RuntimeError, match="order must be on the same device as slots"):
            ops.dynemb_init_gather(slots, keys, is_new, args, 1, 0.0, 1.0, 7, orders[1].cpu())


def _elem_size(dtype):
    return torch.tensor([], dtype=dtype).element_size()


def _copy_table(dst, src):
    """dst's keys, scores, rows and counters set to src's (one capacity, any split of hbm and host rows)."""
    for name in ("_keys", "_digests", "_scores", "_marks", "_locks"):
        getattr(dst, name).copy_(getattr(src, name))
    for rows, host in (("_values", "_values_host"), ("_state", "_state_host")):
        full = torch.cat([getattr(src, rows), getattr(src, host).to(src.device)])
        n = getattr(dst, rows).shape[0]
        getattr(dst, rows).copy_(full[:n])
        getattr(dst, host).copy_(full[n:])
    for name in ("_size", "_epoch", "_clock", "_step"):
        setattr(dst, name, getattr(src, name))


@pytest.mark.parametrize("slot_order", [False, True])
@pytest.mark.parametrize("grow", [False, True])
def test_host_tier_matches_hbm_table(device, grow, slot_order):
    """A table with host rows (on CUDA: rows read, written and initialised in slot order) against the
    same table all in HBM, under find_or_insert (the one-op path at full capacity, evicting; the
    growing path), insert (with and without scores) and find. Before each call the HBM table takes
    the tiered table's state (on the GPU which new key takes which slot is a race); the rows
    returned, the evicted keys / rows / state / scores and the table contents then agree exactly.
    slot_order: the tiered table takes the slot-order paths on any device (on the CPU too)."""
    dim = 8
    kw = dict(device=device, bucket_size=16, eviction="lru", optimizer=tfo.Adam(0.1),
              initializer=("normal", 0.0, 1.0), seed=4)
    cap = 16 if grow else 64
    tiered = DynamicEmbedding(dim, cap, max_capacity=64, hbm_budget_bytes=5 * dim * 12, **kw)
    hbm = DynamicEmbedding(dim, cap, max_capacity=64, **kw)
    assert 0 < tiered.hbm_rows < tiered.capacity and hbm.hbm_rows == hbm.capacity
    if slot_order:
        tiered._host_tier_on_cuda = lambda: True
    elif device != "cpu":
        pytest.skip("a CUDA table with host rows always takes the slot-order paths")
    pool = _keys(150)
    seen_full, n_evicted, most_evicted = False, 0, 0
    for step in range(40):
        _copy_table(hbm, tiered)
        op = ("find_or_insert", "find_or_insert", "insert", "find")[step % 4] if step >= 4 else "find_or_insert"
        n = random.randint(0, 12)  # distinct keys < a bucket's 16 slots: a batch always finds room
        ks = _keys(n, pool)
        outs = []
        for t in (tiered, hbm):
            torch.manual_seed(step)
            if op == "find_or_insert":
                outs.append((t.find_or_insert(_t(ks, device)),))
            elif op == "insert":
                vs = torch.randn(n, dim, device=device)
                sc = _t([random.Random(step * 100 + i).randint(0, 99) for i in range(n)], device) if step % 8 == 2 else None
                ev = t.insert(_t(ks, device), vs, scores=sc, return_evicted=True)
                outs.append(_sorted_by_key(*ev))
            else:
                outs.append(t.find(_t(ks + pool[:3], device)))
        for x, y in zip(*outs):
            assert torch.equal(x, y), (step, op)
        seen_full |= tiered.capacity == tiered.max_capacity and len(tiered) > 48
        assert tiered.capacity == hbm.capacity and len(tiered) == len(hbm)
        ev = tiered.drain_evicted()
        n_evicted += ev[0].numel()
        most_evicted = max(most_evicted, ev[0].numel())
        for x, y in zip(_sorted_by_key(*ev), _sorted_by_key(*hbm.drain_evicted())):
            assert torch.equal(x, y), (step, op)
        for x, y in zip(_sorted_by_key(*tiered._compact()), _sorted_by_key(*hbm._compact())):
            assert torch.equal(x, y), (step, op)
    assert seen_full and n_evicted > 0
    assert most_evicted >= 2  # calls with several evictions: the tiered table's are sorted by victim slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("host_tier", [False, True])
def test_find_or_insert_sync_eviction_record(device, host_tier, dtype):
    """dynemb_find_or_insert_sync on a full table taking new keys (every one evicts): the eviction
    record is consistent entry by entry (victim key, score, row and optimizer state as they were in the
    victim's slot; the new key now in that slot, with the initializer's row, also in the rows returned,
    and zeroed state). A table with host rows (on CUDA: mapped pinned memory) gets its evictions sorted
    by victim slot, so the eviction-rows kernel visits host rows in address order."""
    ops = torch.ops.torchfuse
    dim = 8
    init = ("uniform", -1.0, 1.0)
    t = DynamicEmbedding(dim, 64, device=device, dtype=dtype, bucket_size=16, eviction="lru", initializer=init,
                         seed=3, optimizer=tfo.Adam(0.1), hbm_budget_bytes=20 * dim * 12 if host_tier else None)
    assert (t._values_host.numel() > 0) == host_tier and (0 < t.hbm_rows < 64) == host_tier
    def fresh(n):  # random keys (no special keys: _keys repeats those)
        return _t([random.randint(I64_MIN, I64_MAX) for _ in range(n)], device)

    for _ in range(30):  # fills every bucket (an LRU table at max capacity stays full)
        t.insert(fresh(10), torch.randn(10, dim, device=device))
    assert len(t) == t.capacity
    t._values.copy_(torch.randn(t._values.shape).to(dtype))
    t._values_host.copy_(torch.randn(t._values_host.shape).to(dtype))
    t._state.copy_(torch.randn(t._state.shape))
    t._state_host.copy_(torch.randn(t._state_host.shape))

    def by_slot(rows, host):
        return torch.cat([rows, host.to(device)])

    keys0, scores0 = t._keys.clone(), t._scores.clone()
    values0, state0 = by_slot(t._values, t._values_host), by_slot(t._state, t._state_host)
    q = torch.unique(fresh(12))
    assert not bool(t.contains(q).any())
    slots, rows, is_new, ev, old_values, old_state, counts = ops.dynemb_find_or_insert_sync(
        q, t._tensors, t._epoch + 1, True, 0, t._clock + 1, 2, -1.0, 1.0, 3, True)
    inserted, n_ev, failed, n_taken, aborted = counts.tolist()
    assert inserted == n_ev == q.numel() >= 2 and failed == 0 and bool(is_new.all())
    assert n_taken == q.numel() and aborted == 0
    assert ev.shape == (4, n_ev) and old_values.shape == (n_ev, dim) and old_state.shape == (n_ev, 2 * dim)
    ev_keys, ev_slots, ev_scores, ev_new = ev
    if host_tier:
        assert bool((ev_slots[1:] > ev_slots[:-1]).all()), ev_slots  # slot order
    assert torch.equal(torch.sort(ev_slots).values, torch.sort(slots).values)
    assert torch.equal(torch.sort(ev_new).values, torch.arange(n_ev, device=device))
    assert torch.equal(ev_keys, keys0[ev_slots]) and torch.equal(ev_scores, scores0[ev_slots])
    assert torch.equal(old_values, values0[ev_slots]) and torch.equal(old_state, state0[ev_slots])
    assert torch.equal(slots[ev_new], ev_slots) and torch.equal(t._keys[ev_slots], q[ev_new])
    ref = DynamicEmbedding(dim, 1024, device=device, dtype=dtype, initializer=init, seed=3)
    assert torch.equal(rows, ref.find_or_insert(q))
    assert torch.equal(by_slot(t._values, t._values_host)[slots], rows)
    assert bool((by_slot(t._state, t._state_host)[slots] == 0).all())


def test_public_import_paths():
    """The modules and the table-batched helpers under their public and former names."""
    import torchfuse.dynamic_embedding as de
    from torchfuse import dynemb_group, dynemb_tables
    assert de.DynamicEmbedding is torchfuse.DynamicEmbedding and de.DynamicEmbeddingBag is torchfuse.DynamicEmbeddingBag
    assert issubclass(DynamicEmbeddingBag, de.DynamicEmbeddingTable) and isinstance(DynamicEmbedding(4, 8, device="cpu"),
                                                                                  torch.nn.Module)
    assert dynemb_group is dynemb_tables and callable(dynemb_tables.can_batch)
