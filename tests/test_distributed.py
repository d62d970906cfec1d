"""torchfuse.distributed: the sharded dynamic embeddings against single-device tables, in spawned
processes over gloo (CPU) and, with two, four or eight GPUs, NCCL.

Every rank draws the same global data from one seed (each rank's batch, and dyadic loss weights:
multiples of 1/8, so that every gradient sum is exact in fp32 in any order). Two references:

- no eviction (tables that grow): one single-device table fed the union of the ranks' batches (rank
  order). Outputs, rows, optimizer state and scores equal bit for bit: the owner inserts its keys
  in the same (sorted) order, the initializer is a function of (key, seed), bags are pooled by the
  same fp32 sums in id order, and the gradient sums (per rank, then per key across ranks in rank
  order, against one sum over the union in batch order) differ in order only, which the dyadic
  weights make exact.
- eviction (tables at max_capacity): each rank's table holds only its keys, so it evicts other keys
  than a single table of the same size would. The reference is one single-device table per owner
  fed the union's distinct keys that the owner owns, with their gradients summed over the union:
  outputs, rows, optimizer state, scores and the evicted keys equal bit for bit.
"""
import copy
import gc
import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchfuse
from _helpers import exit_failed_rank
from torchfuse import DynamicEmbedding, DynamicEmbeddingBag
from torchfuse import optim as tfo
from torchfuse.distributed import ShardedDynamicEmbedding, ShardedDynamicEmbeddingBag, owner_of, shard
from torchfuse.distributed._hash import owner_of_int

I64_MIN, I64_MAX = -(2**63), 2**63 - 1


# ---------------------------------------------------------------- process plumbing

def _init(rank, world, tmp, backend):
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # NCCL bound to this rank's GPU at once (device_id), as benchmarks/bench_distributed.py does
    dist.init_process_group(backend, init_method=f"file://{tmp}/pg", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120),
                            **({"device_id": torch.device(f"cuda:{rank}")} if backend == "nccl" else {}))


def _entry(rank, world, tmp, backend, fn, args):
    _init(rank, world, tmp, backend)
    try:
        fn(rank, world, *args)
        # the checks' modules sit in reference cycles (TorchRec's DMP, DDP's reducer): freed by the collector
        # only at exit, after the process group is gone, they aborted the process now and then ("terminate
        # called without an active exception", about 1 run in 5 of the DMP test); freed here, never
        gc.collect()
        dist.barrier()
    except BaseException:
        exit_failed_rank(rank)
    dist.destroy_process_group()


def _spawn(fn, world, *args, backend="gloo"):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, tmp, backend, fn, args), nprocs=world, join=True)


def _dev(backend, rank):
    return torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")


# ---------------------------------------------------------------- data

def _pool(g, n):
    pool = torch.randint(I64_MIN, I64_MAX, (n,), generator=g, dtype=torch.int64)
    pool[:4] = torch.tensor([0, -1, I64_MIN, I64_MAX])
    return pool


def _batches(g, pool, world, n_max, step):
    """Every rank's ids (repeats within and across ranks); the last rank's batch is empty on step 1."""
    out = []
    for r in range(world):
        n = 0 if (step == 1 and r == world - 1 and world > 1) else int(torch.randint(n_max // 2, n_max + 1, (1,), generator=g))
        out.append(pool[torch.randint(0, pool.numel(), (n,), generator=g)])
    return out


def _dyadic(g, *shape):
    return torch.randint(-8, 9, shape, generator=g).float() / 8


def _by_key(export):
    """(keys, values, state, scores) sorted by key."""
    parts = list(export)
    if not parts:
        return None
    k, v, s, c = (torch.cat(x) for x in zip(*parts))
    o = torch.argsort(k)
    return k[o], v[o], s[o], c[o]


def _check_same_rows(local, ref_tables, rank, world, what):
    """The local table's (key, row, state, score) equal the references' for the same keys, every local
    key is owned by this rank, and the ranks together hold every reference key once."""
    mine = _by_key(local.export())
    ref = [_by_key(t.export()) for t in ref_tables]
    ref = [r for r in ref if r is not None]
    rk, rv, rs, rc = (torch.cat(x) for x in zip(*ref))
    o = torch.argsort(rk)
    rk, rv, rs, rc = rk[o], rv[o], rs[o], rc[o]
    owned = owner_of(rk, world) == rank
    if mine is None:
        assert not owned.any(), what
        n_local = 0
    else:
        k, v, s, c = mine
        assert (owner_of(k, world) == rank).all(), what
        assert torch.equal(k, rk[owned]), what
        assert torch.equal(v, rv[owned]), what
        assert torch.equal(s, rs[owned]), what
        assert torch.equal(c, rc[owned]), what
        n_local = k.numel()
    total = torch.tensor([n_local], device=local.device)  # NCCL reduces device tensors only
    dist.all_reduce(total)
    assert int(total) == rk.numel(), what


# ---------------------------------------------------------------- the checks of one world size

def _check_union_per_id(rank, world, seed, dev, opt, dtype=torch.float32):
    """Growth, no eviction: against one table fed the union of the batches; then eval."""
    g = torch.Generator().manual_seed(seed)
    pool = _pool(g, 300)
    cfg = dict(capacity=16, max_capacity=1 << 14, device=dev, optimizer=opt, seed=seed % 1000, bucket_size=8,
               dtype=dtype, eviction="none")
    emb = ShardedDynamicEmbedding(8, **cfg)
    ref = DynamicEmbedding(8, **cfg)
    for step in range(4):
        ids = _batches(g, pool, world, 40, step)
        gw = [_dyadic(g, i.numel(), 8) for i in ids]
        shape = (ids[rank].numel() // 2, 2) if step == 2 and ids[rank].numel() % 2 == 0 else (-1,)
        out = emb(ids[rank].view(*shape).to(dev))
        assert out.shape == (*ids[rank].view(*shape).shape, 8)
        (out.reshape(-1, 8).float() * gw[rank].to(dev)).sum().backward()
        ref_out = ref(torch.cat(ids).to(dev))
        (ref_out.float() * torch.cat(gw).to(dev)).sum().backward()
        lo = sum(i.numel() for i in ids[:rank])
        assert torch.equal(out.reshape(-1, 8), ref_out[lo:lo + ids[rank].numel()]), f"step {step}"
    assert ref.capacity > 16  # grew
    _check_same_rows(emb.local, [ref], rank, world, "union per-id")
    emb.eval(), ref.eval()
    probe = torch.cat([pool[:50], torch.tensor([12345, 67890])])[torch.randperm(52, generator=g)]
    with torch.no_grad():
        assert torch.equal(emb(probe[rank::world].to(dev)), ref(probe[rank::world].to(dev)))
    n_before = len(emb)
    with torch.no_grad():
        emb(probe.to(dev))  # eval: inserts nothing
    assert len(emb) == n_before


def _check_union_bags(rank, world, seed, dev, mode, exchange="rows", dtype=torch.float32):
    """exchange="partial_sums": each owner pools its part of every bag and the partial bags are added
    in rank order, so the outputs equal one device's to rounding only; the rows' gradients are exact
    either way, so the tables still match bit for bit."""
    g = torch.Generator().manual_seed(seed + 1)
    pool = _pool(g, 200)
    cfg = dict(capacity=16, max_capacity=1 << 14, device=dev, optimizer=tfo.Adam(lr=0.05), seed=3, bucket_size=8,
               mode=mode, eviction="none", dtype=dtype)
    emb = ShardedDynamicEmbeddingBag(4, include_last_offset=False, exchange=exchange, **cfg)
    ref = DynamicEmbeddingBag(4, **cfg)
    emb.exchange_log = log = []
    for step in range(3):
        if mode == "mean":  # fixed-size bags (2-D ids): the mean's 1/4 is exact in the backward too
            ids = [b[: b.numel() // 4 * 4].view(-1, 4) for b in _batches(g, pool, world, 40, step)]
            gw = [_dyadic(g, i.shape[0], 4) for i in ids]
            out = emb(ids[rank].to(dev))
            (out * gw[rank].to(dev)).sum().backward()
            ref_out = ref(torch.cat(ids).to(dev))
        else:  # bags of random lengths (empty ones too) with per-id weights
            ids = _batches(g, pool, world, 40, step)
            offs, ws = [], []
            for i in ids:
                cuts = torch.sort(torch.randint(0, i.numel() + 1, (5,), generator=g)).values
                offs.append(torch.cat([torch.zeros(1, dtype=torch.int64), cuts]))
                # powers of two: the products w * row are exact, so a fused multiply-add (CUDA)
                # rounds the sums as a multiply then an add does
                ws.append(torch.randint(-1, 2, (i.numel(),), generator=g).float()
                          * torch.exp2(-torch.randint(0, 4, (i.numel(),), generator=g).float()))
            gw = [_dyadic(g, o.numel(), 4) for o in offs]
            w_grad = step == 1
            w = ws[rank].to(dev).clone().requires_grad_(w_grad)
            out = emb(ids[rank].to(dev), offs[rank].to(dev), per_sample_weights=w)
            (out * gw[rank].to(dev)).sum().backward()
            base = torch.cumsum(torch.tensor([0] + [i.numel() for i in ids[:-1]]), 0)
            ref_w = torch.cat(ws).to(dev).requires_grad_(w_grad)
            ref_out = ref(torch.cat(ids).to(dev), torch.cat([o + b for o, b in zip(offs, base)]).to(dev),
                          per_sample_weights=ref_w)
        (ref_out * torch.cat(gw).to(dev)).sum().backward()
        lo = sum(x.shape[0] for x in gw[:rank])
        if exchange == "partial_sums" and world > 1:
            torch.testing.assert_close(out, ref_out[lo:lo + gw[rank].shape[0]], rtol=1e-6, atol=1e-7)
        elif mode == "sum" and w_grad:
            # With gradients for the weights the single-device module pools through F.embedding_bag,
            # whose sums run in another order than its kernel's (and this module's): equal to rounding.
            # The rows' gradients are dyadic either way, so the rows stay equal bit for bit.
            tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(out, ref_out[lo:lo + gw[rank].shape[0]], **tol)
            wlo = sum(i.numel() for i in ids[:rank])
            torch.testing.assert_close(w.grad, ref_w.grad[wlo:wlo + ids[rank].numel()].float(), **tol)
        else:
            assert torch.equal(out, ref_out[lo:lo + gw[rank].shape[0]]), f"{mode} step {step}"
    # which exchange ran (the weights with gradients take the rows' exchange)
    assert any(e[0] == "partial bags" for e in log) == (exchange == "partial_sums")
    assert any(e[0] == "rows" for e in log) == (exchange == "rows" or mode == "sum")
    _check_same_rows(emb.local, [ref], rank, world, f"union bags {mode}")


def _check_comm_dtype(rank, world, seed, dev):
    """comm_dtype on an fp32 table (bfloat16 with the rows' exchange, float16 with the partial sums',
    and a (bfloat16 forward, float16 backward) pair): the rows' (partial bags') and gradients'
    exchanges move half the exact module's bytes, each output is within the forward dtype's rounding
    of one device's (a rounding per row, or per owner's partial bag), and the tables equal one
    device's bit for bit (the dyadic gradient sums here are exact in 16 bits)."""
    for comm, exchange, eps in ((torch.bfloat16, "rows", 2.0**-8), (torch.float16, "partial_sums", 2.0**-11),
                                ((torch.bfloat16, torch.float16), "rows", 2.0**-8)):
        g = torch.Generator().manual_seed(seed + 5)
        pool = _pool(g, 200)
        cfg = dict(capacity=16, max_capacity=1 << 14, device=dev, optimizer=tfo.SGD(lr=0.25), seed=3, bucket_size=8,
                   eviction="none")
        emb = ShardedDynamicEmbeddingBag(4, exchange=exchange, comm_dtype=comm, **cfg)
        exact = ShardedDynamicEmbeddingBag(4, exchange=exchange, **cfg)
        ref = DynamicEmbeddingBag(4, **cfg)
        for step in range(3):
            ids = [b[: b.numel() // 4 * 4].view(-1, 4) for b in _batches(g, pool, world, 40, step)]
            gw = [_dyadic(g, i.shape[0], 4) for i in ids]
            emb.exchange_log, exact.exchange_log = [], []
            out = emb(ids[rank].to(dev))
            (out * gw[rank].to(dev)).sum().backward()
            (exact(ids[rank].to(dev)) * gw[rank].to(dev)).sum().backward()
            ref_out = ref(torch.cat(ids).to(dev))
            m = max((v.abs().max().item() for _, v, _, _ in ref.export() if v.numel()), default=0.0)
            (ref_out * torch.cat(gw).to(dev)).sum().backward()
            lo = sum(x.shape[0] for x in gw[:rank])
            want = ref_out[lo:lo + gw[rank].shape[0]]
            assert ((out - want).abs() <= 8 * eps * m).all(), f"{comm} step {step}"
            moved = {e[0]: e[1] for e in emb.exchange_log}
            for what, sent in ((w, b) for w, b, *_ in exact.exchange_log):
                assert moved[what] == (sent // 2 if what in ("rows", "grads", "partial bags", "partial grads") else sent), what
        _check_same_rows(emb.local, [ref], rank, world, f"comm_dtype {comm}")


def _check_eviction(rank, world, seed, dev):
    """Tables at max_capacity evicting (LRU, Adam): against one single-device table per owner. On CUDA
    the victims among equal scores are chosen by slot, and the GPU's insert kernels do not fix which
    slot a key takes, so two tables fed the same keys may evict different ones: there the check is
    that every rank holds only its keys and that the tables evicted, not the bit-for-bit equality."""
    exact = dev.type == "cpu"
    g = torch.Generator().manual_seed(seed + 2)
    pool = _pool(g, 400)
    cfg = dict(capacity=16, max_capacity=32, device=dev, optimizer=tfo.Adam(lr=0.05), seed=5, bucket_size=8,
               eviction="lru")
    emb = ShardedDynamicEmbedding(4, **cfg)
    refs = [DynamicEmbedding(4, **cfg) for _ in range(world)]
    evicted = 0
    for step in range(8):  # about 48 draws per owner: more distinct keys than its 32 slots
        ids = _batches(g, pool, world, 8, step)
        gw = [_dyadic(g, i.numel(), 4) for i in ids]
        out = emb(ids[rank].to(dev))
        (out * gw[rank].to(dev)).sum().backward()
        union, ugw = torch.cat(ids), torch.cat(gw)
        keys, inv = torch.unique(union, return_inverse=True)
        gsum = torch.zeros(keys.numel(), 4).index_add_(0, inv, ugw)  # exact: dyadic
        rows = torch.zeros(keys.numel(), 4)
        owner = owner_of(keys, world)
        for o in range(world):
            sel = owner == o
            r = refs[o](keys[sel].to(dev))
            (r * gsum[sel].to(dev)).sum().backward()
            rows[sel] = r.detach().cpu()
        ev, ref_ev = emb.drain_evicted()[0], refs[rank].drain_evicted()[0]
        if exact:
            assert torch.equal(out.cpu(), rows[inv[sum(i.numel() for i in ids[:rank]):][:ids[rank].numel()]]), \
                f"step {step}"
            assert torch.equal(torch.sort(ev).values, torch.sort(ref_ev).values)
        evicted += ev.numel()
    total = torch.tensor([evicted], device=dev)
    dist.all_reduce(total)
    assert int(total) > 0  # the tables did evict
    if exact:
        _check_same_rows(emb.local, refs, rank, world, "eviction")
    else:
        k = _by_key(emb.local.export())[0]
        assert (owner_of(k, world) == rank).all() and k.numel() == len(emb.local) <= emb.local.max_capacity


def _check_frozen_and_nograd(rank, world, seed, dev):
    g = torch.Generator().manual_seed(seed + 3)
    pool = _pool(g, 100)
    emb = ShardedDynamicEmbedding(4, 64, max_capacity=1 << 14, device=dev, seed=1, eviction="none")
    ref = DynamicEmbedding(4, 64, max_capacity=1 << 14, device=dev, seed=1, eviction="none")
    ids = _batches(g, pool, world, 20, 0)
    with torch.no_grad():  # training mode without autograd: inserts, no step
        out = emb(ids[rank].to(dev))
        ref_out = ref(torch.cat(ids).to(dev))
    lo = sum(i.numel() for i in ids[:rank])
    assert torch.equal(out, ref_out[lo:lo + ids[rank].numel()])
    _check_same_rows(emb.local, [ref], rank, world, "no grad")
    emb.requires_grad_(False), ref.requires_grad_(False)  # frozen: the forward inserts, nothing steps
    out = emb(ids[rank].to(dev) + 1)
    ref_out = ref(torch.cat(ids).to(dev) + 1)
    assert not out.requires_grad and torch.equal(out, ref_out[lo:lo + ids[rank].numel()])
    _check_same_rows(emb.local, [ref], rank, world, "frozen")


def _check_bad_inputs(dev):
    """Errors raised before any exchange (a rank that raises later leaves the others waiting)."""
    emb = ShardedDynamicEmbeddingBag(4, 64, device=dev, mode="sum")
    ids = torch.arange(6, device=dev)
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        emb(ids.float().view(2, 3))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        emb(ids, torch.tensor([1, 0], device=dev))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        emb(ids, torch.tensor([0, 7], device=dev))
    with pytest.raises(TypeError, match="offsets must be a 1-D int32 or int64"):
        emb(ids, torch.tensor([0.0, 2.0], device=dev))
    with pytest.raises(ValueError, match="ids must be 2-D"):
        emb(ids)
    with pytest.raises(ValueError, match="per_sample_weights must have the shape"):
        emb(ids, torch.tensor([0, 2], device=dev), per_sample_weights=torch.ones(5, device=dev))
    with pytest.raises(ValueError, match="per_sample_weights need mode='sum'"):
        ShardedDynamicEmbeddingBag(4, 64, device=dev, mode="mean")(ids, torch.tensor([0], device=dev),
                                                                   per_sample_weights=torch.ones(6, device=dev))
    for bad in (torch.int16, (torch.bfloat16,), (torch.bfloat16, torch.int8)):
        with pytest.raises(ValueError, match="comm_dtype must be None, torch.float32, torch.bfloat16 or torch.float16"):
            ShardedDynamicEmbeddingBag(4, 64, device=dev, comm_dtype=bad)
    with pytest.raises(ValueError, match="exchange must be"):
        ShardedDynamicEmbeddingBag(4, 64, device=dev, exchange="bags")
    with pytest.raises(ValueError, match="owner_rank must be"):
        ShardedDynamicEmbeddingBag(4, 64, device=dev, owner_rank=1)
    try:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
    except ImportError:
        EmbeddingBagConfig = None
    if EmbeddingBagConfig is not None:
        from torchfuse.torchrec import DynamicEmbeddingBagCollection
        ebc = DynamicEmbeddingBagCollection([EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=8,
                                                                feature_names=["f0"])], device=dev, capacity=16)
        with pytest.raises(ValueError, match="owner_rank names tables"):
            shard(ebc, owner_rank={"nope": 0})
    with pytest.raises(ValueError, match="mode must be"):
        ShardedDynamicEmbeddingBag(4, 64, device=dev, mode="max")
    with pytest.raises(TypeError, match="module must be"):
        shard(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="shard header"):
        emb.load_resharded([dict(emb.state_dict(), shard={"world_size": 1, "rank": 0, "shard_hash": "other"})])


def _check_table_wise(rank, world, seed, dev):
    """owner_rank: the whole table on one rank, against one table fed the union of the batches (the
    owner's table is that table): outputs and every key's row, state and score bit for bit; the other
    ranks' tables stay empty. Then (gloo) a re-shard round trip to row-wise and back.

    On the CPU the tables evict (LRU). On CUDA they grow instead: the keys of one step share a score,
    the victim among equal scores is the key in the lowest slot, and the owner receives the keys in
    another order than the single table (grouped by owner, in hash order), so the two tables may
    evict different keys of a step (see _check_eviction)."""
    exact_eviction = dev.type == "cpu"
    g = torch.Generator().manual_seed(seed + 5)
    pool = _pool(g, 300)
    owner = world - 1
    # 4 buckets of 16 for at most 24 distinct ids a step (32 from 8 ranks: bags of 4): no bucket fills
    # with one batch's keys
    per_rank = max(4, 24 // world)
    cfg = dict(capacity=16, max_capacity=64 if exact_eviction else 1 << 14, device=dev, optimizer=tfo.Adam(lr=0.05),
               seed=4, bucket_size=16, eviction="lru" if exact_eviction else "none", evicted_record_limit=0)
    emb = ShardedDynamicEmbeddingBag(4, owner_rank=owner, **cfg)
    ref = DynamicEmbeddingBag(4, **cfg)
    assert "table-wise on rank" in repr(emb)
    seen = set()
    for step in range(16):
        ids = [b[: b.numel() // 4 * 4].view(-1, 4) for b in _batches(g, pool, world, per_rank, step)]
        seen.update(torch.cat(ids).reshape(-1).tolist())
        gw = [_dyadic(g, i.shape[0], 4) for i in ids]
        out = emb(ids[rank].to(dev))
        (out * gw[rank].to(dev)).sum().backward()
        ref_out = ref(torch.cat(ids).to(dev))
        (ref_out * torch.cat(gw).to(dev)).sum().backward()
        lo = sum(x.shape[0] for x in gw[:rank])
        assert torch.equal(out, ref_out[lo:lo + gw[rank].shape[0]]), f"table-wise step {step}"
    assert len(ref) < len(seen) if exact_eviction else len(ref) == len(seen)  # it evicted, or it grew
    if rank == owner:
        assert all(torch.equal(a, b) for a, b in zip(_by_key(emb.export()), _by_key(ref.export())))
    else:
        assert len(emb) == 0 and emb.local.capacity == 128
    if dev.type != "cpu":  # the checkpoints travel as pickled objects: CPU tensors over gloo
        return
    # table-wise -> row-wise -> table-wise on another rank: every key once, where the placement puts it
    sds = [None] * world
    dist.all_gather_object(sds, emb.state_dict())
    row = ShardedDynamicEmbeddingBag(4, **cfg)
    row.load_resharded(sds)
    _check_same_rows(row.local, [ref], rank, world, "table-wise to row-wise")
    sds = [None] * world
    dist.all_gather_object(sds, row.state_dict())
    back = ShardedDynamicEmbeddingBag(4, owner_rank=0, **cfg)
    back.load_resharded(sds)
    if rank == 0:
        assert all(torch.equal(a, b) for a, b in zip(_by_key(back.export()), _by_key(ref.export())))
    else:
        assert len(back) == 0


def _world_checks(rank, world, seed, backend):
    dev = _dev(backend, rank)
    if world == 1:
        _check_bad_inputs(dev)
    _check_union_per_id(rank, world, seed, dev, tfo.SGD(lr=0.5))
    _check_union_per_id(rank, world, seed + 7, dev, tfo.Adam(lr=0.1))
    _check_union_bags(rank, world, seed, dev, "sum")
    _check_union_bags(rank, world, seed, dev, "mean")
    _check_union_bags(rank, world, seed, dev, "sum", "partial_sums")
    if world == 2:  # 16-bit rows: the gradients' per-rank sums are exact here, and so is everything else
        _check_union_per_id(rank, world, seed + 11, dev, tfo.Adam(lr=0.1), torch.bfloat16)
        _check_union_bags(rank, world, seed + 11, dev, "sum", "rows", torch.float16)
    _check_union_bags(rank, world, seed, dev, "mean", "partial_sums")
    _check_comm_dtype(rank, world, seed, dev)
    _check_eviction(rank, world, seed, dev)
    _check_table_wise(rank, world, seed, dev)
    _check_frozen_and_nograd(rank, world, seed, dev)
    # the same inputs give the same results run to run
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        emb = ShardedDynamicEmbeddingBag(4, 32, max_capacity=1 << 14, device=dev, bucket_size=8, eviction="none",
                                         optimizer=tfo.Adam(lr=0.1))
        g = torch.Generator().manual_seed(seed)
        pool = _pool(g, 100)
        for step in range(3):
            ids = pool[torch.randint(0, 100, (16, 8), generator=g)].to(dev)
            grad = torch.randn(16, 4, generator=g).to(dev)
            (emb(ids) * grad).sum().backward()
        runs.append(_by_key(emb.export()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_sharded_matches_single_device(world, fresh_seed):
    _spawn(_world_checks, world, fresh_seed, "gloo")


@pytest.mark.parametrize("world", [2, 4, 8])
def test_sharded_matches_single_device_nccl(world, fresh_seed, monkeypatch):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    _spawn(_world_checks, world, fresh_seed, "nccl", backend="nccl")


# ---------------------------------------------------------------- checkpoints

_CK_CFG = dict(device="cpu", capacity=16, max_capacity=1 << 14, bucket_size=8, eviction="none", optimizer=tfo.Adam(lr=0.05), seed=9)


def _train_steps(emb, ref, g, pool, world, rank, steps):
    for step in range(steps):
        ids = _batches(g, pool, world, 30, step + 5)
        gw = [_dyadic(g, i.numel(), 4) for i in ids]
        (emb(ids[rank]) * gw[rank]).sum().backward()
        (ref(torch.cat(ids)) * torch.cat(gw)).sum().backward()


def _ck_save(rank, world, seed, tmp):
    """World 2: train, save each rank's shard and the single-device reference."""
    g = torch.Generator().manual_seed(seed)
    pool = _pool(g, 200)
    emb, ref = ShardedDynamicEmbedding(4, **_CK_CFG), DynamicEmbedding(4, **_CK_CFG)
    _train_steps(emb, ref, g, pool, world, rank, 3)
    sd = emb.state_dict()
    assert sd["shard"] == {"world_size": world, "rank": rank, "shard_hash": torchfuse.distributed.SHARD_HASH}
    torch.save(sd, os.path.join(tmp, f"ck{world}_{rank}.pt"))
    if rank == 0:
        torch.save(ref.state_dict(), os.path.join(tmp, f"ref{world}.pt"))
    _check_same_rows(emb.local, [ref], rank, world, "before saving")
    # the same world size and rank load back as a plain load_state_dict; another rank's shard is refused
    again = ShardedDynamicEmbedding(4, **_CK_CFG)
    again.load_state_dict(sd)
    _check_same_rows(again.local, [ref], rank, world, "reloaded")
    if world > 1:
        other = torch.load(os.path.join(tmp, f"ck{world}_{rank}.pt"), weights_only=False)
        other["shard"] = dict(other["shard"], rank=(rank + 1) % world)
        with pytest.raises(RuntimeError, match="load_resharded"):
            again.load_state_dict(other)
    # shard() of the single-device table reads the same rows
    sharded = shard(ref)
    ids = _batches(g, pool, world, 30, 0)
    sharded.eval(), ref.eval()
    with torch.no_grad():
        lo = sum(i.numel() for i in ids[:rank])
        assert torch.equal(sharded(ids[rank]), ref(torch.cat(ids))[lo:lo + ids[rank].numel()])


def _ck_load(rank, world, seed, tmp, old_world, save):
    """Load every rank's shard of old_world, compare with the reference, train on, save."""
    g = torch.Generator().manual_seed(seed + old_world)
    pool = _pool(g, 200)
    shards = [torch.load(os.path.join(tmp, f"ck{old_world}_{r}.pt"), weights_only=False) for r in range(old_world)]
    emb = ShardedDynamicEmbedding(4, **_CK_CFG)
    emb.load_resharded(shards)
    ref = DynamicEmbedding(4, **_CK_CFG)
    ref.load_state_dict(torch.load(os.path.join(tmp, f"ref{old_world}.pt"), weights_only=False))
    _check_same_rows(emb.local, [ref], rank, world, f"{old_world} -> {world}")
    assert emb.local._step == ref._step and emb.local._clock == ref._clock
    with pytest.raises(ValueError, match="every rank"):
        ShardedDynamicEmbedding(4, **_CK_CFG).load_resharded(shards[:-1] if old_world > 1 else [])
    _train_steps(emb, ref, g, pool, world, rank, 2)
    _check_same_rows(emb.local, [ref], rank, world, f"{old_world} -> {world}, trained")
    if save:
        torch.save(emb.state_dict(), os.path.join(tmp, f"ck{world}_{rank}.pt"))
        if rank == 0:
            torch.save(ref.state_dict(), os.path.join(tmp, f"ref{world}.pt"))


def test_reshard_checkpoints(fresh_seed):
    """2 -> 1, 1 -> 2 (from the 1-rank save), 2 -> 3 (from the first 2-rank save)."""
    with tempfile.TemporaryDirectory() as ck:
        _spawn(_ck_save, 2, fresh_seed, ck)
        first = {f: open(os.path.join(ck, f), "rb").read() for f in ("ck2_0.pt", "ck2_1.pt", "ref2.pt")}
        _spawn(_ck_load, 1, fresh_seed, ck, 2, True)
        _spawn(_ck_load, 2, fresh_seed, ck, 1, False)
        for f, b in first.items():
            open(os.path.join(ck, f), "wb").write(b)
        _spawn(_ck_load, 3, fresh_seed, ck, 2, False)


def test_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedDynamicEmbedding(4, 16, device="cpu")


def test_owner_hash():
    """owner_of against its Python definition, and the keys spread over the ranks."""
    keys = [0, -1, 1, I64_MIN, I64_MAX] + torch.randint(I64_MIN, I64_MAX, (2000,)).tolist()
    for world in (1, 2, 3, 5):
        got = owner_of(torch.tensor(keys), world)
        assert got.tolist() == [owner_of_int(k, world) for k in keys]
        counts = torch.bincount(got, minlength=world)
        assert counts.min() > len(keys) / world * 0.8


# ---------------------------------------------------------------- TorchRec's DistributedModelParallel

def _kjt(keys, per_feature, cls):
    """A KJT of feature-major (values, lengths) per feature."""
    values = torch.cat([v for v, _ in per_feature])
    lengths = torch.cat([l for _, l in per_feature])
    return cls(keys=keys, values=values, lengths=lengths)


def _dmp_checks(rank, world, seed, table_wise):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchfuse.torchrec import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection, DynamicEmbeddingSharder
    from torchfuse.distributed._torchrec import ShardedDynamicEmbeddingCollection

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=64, feature_names=["f0", "f1"]),
              EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f2"],
                                 pooling=PoolingType.MEAN)]

    # Adam at 2 ranks; SGD at 4 and 8, where the per-key gradient sums over more ranks in another order
    # than the unsharded model's round differently and Adam turns that into a visible weight change where
    # a key's gradient nearly cancels (7.7e-5 relative at 8 ranks, seed 31906793; SGD moves a weight by
    # lr x the rounding). The sharded Adam itself is checked exactly, on dyadic gradients, by
    # test_sharded_matches_single_device at every world size.
    table_optimizer = tfo.Adam if world <= 2 else tfo.SGD

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = DynamicEmbeddingBagCollection(tables, device="cpu", capacity=16, max_capacity=1 << 14,
                                                     eviction="none", optimizer=table_optimizer(lr=0.05), seed=2)
            self.dense = torch.nn.Linear(12, 1)

        def forward(self, kjt):
            return self.dense(self.ebc(kjt).values())

    class ECModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ec = DynamicEmbeddingCollection(
                [EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=64, feature_names=["f0", "f2"])],
                device="cpu", capacity=16, max_capacity=1 << 14, eviction="none", optimizer=tfo.SGD(lr=0.5))

        def forward(self, kjt):
            jts = self.ec(kjt)
            return [jts[f].values() for f in ("f0", "f2")]

    torch.manual_seed(0)
    model = Model()
    torch.manual_seed(0)
    ref = Model()
    if table_wise:  # t1 asked table-wise through the planner's constraints
        sharder = DynamicEmbeddingSharder(sharding_types=["row_wise", "table_wise"])
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                           constraints={"t0": ParameterConstraints(sharding_types=["row_wise"]),
                                                        "t1": ParameterConstraints(sharding_types=["table_wise"])})
        plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    else:
        sharder, plan = DynamicEmbeddingSharder(), None
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), sharders=[sharder], plan=plan)
    sharded = [m for m in dmp.modules() if isinstance(m, ShardedDynamicEmbeddingCollection)]
    assert len(sharded) == 1
    planned = dmp.plan.get_plan_for_module("ebc")
    assert planned["t0"].sharding_type == "row_wise"
    assert planned["t1"].sharding_type == ("table_wise" if table_wise else "row_wise")
    t1_owner = planned["t1"].ranks[0] if table_wise else None
    assert sharded[0]._inner.tables["t1"].owner_rank == t1_owner
    # an EmbeddingCollection's dynamic form, through its own sharder
    torch.manual_seed(0)
    ec_model = ECModel()
    ec_ref = copy.deepcopy(ec_model)
    ec_dmp = DistributedModelParallel(ec_model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                      device=torch.device("cpu"),
                                      sharders=[DynamicEmbeddingSharder(DynamicEmbeddingCollection)])
    dense_w = [p for n, p in dmp.named_parameters() if n.endswith("dense.weight")]
    assert len(dense_w) == 1
    g = torch.Generator().manual_seed(seed)
    pool = _pool(g, 80)
    keys = ["f0", "f1", "f2"]
    B = 3
    for step in range(3):
        feats = []  # feats[r][f] = (values, lengths)
        for r in range(world):
            fr = []
            for _ in keys:
                lengths = torch.randint(0, 4, (B,), generator=g)
                fr.append((pool[torch.randint(0, pool.numel(), (int(lengths.sum()),), generator=g)], lengths))
            feats.append(fr)
        union = [(torch.cat([feats[r][f][0] for r in range(world)]), torch.cat([feats[r][f][1] for r in range(world)]))
                 for f in range(len(keys))]
        gw = _dyadic(g, world * B, 1)
        out = dmp(_kjt(keys, feats[rank], KeyedJaggedTensor))
        (out * gw[rank * B:(rank + 1) * B]).sum().backward()
        ref_out = ref(_kjt(keys, union, KeyedJaggedTensor))
        (ref_out * gw).sum().backward()
        torch.testing.assert_close(out, ref_out[rank * B:(rank + 1) * B], rtol=1e-6, atol=1e-7)
        # the EmbeddingCollection: per-id rows, exact (dyadic loss weights)
        ec_out = ec_dmp(_kjt(["f0", "f2"], [feats[rank][0], feats[rank][2]], KeyedJaggedTensor))
        ec_ref_out = ec_ref(_kjt(["f0", "f2"], [union[0], union[2]], KeyedJaggedTensor))
        ec_gw = [_dyadic(g, int(u[1].sum()), 4) for u in (union[0], union[2])]
        loss = 0
        for f, (mine, full, w) in enumerate(zip(ec_out, ec_ref_out, ec_gw)):
            fi = (0, 2)[f]
            lo = int(sum(feats[r][fi][1].sum() for r in range(rank)))
            hi = lo + int(feats[rank][fi][1].sum())
            assert torch.equal(mine, full[lo:hi])
            loss = loss + (mine * w[lo:hi]).sum()
        loss.backward()
        sum((full * w).sum() for full, w in zip(ec_ref_out, ec_gw)).backward()
        # DDP averages the dense gradients over the ranks; the tables' gradients are summed
        torch.testing.assert_close(dense_w[0].grad * world, ref.dense.weight.grad, rtol=1e-5, atol=1e-7)
        dense_w[0].grad = None
        ref.dense.weight.grad = None
        for name in ("t0", "t1"):
            table = sharded[0]._inner.tables[name]
            mine = _by_key(table.local.export())
            if mine is None:  # table-wise on another rank, or row-wise with none of the ids hashed to this rank
                assert table.owner_rank != rank  # (the count over the ranks below still has to add up)
                k = torch.empty(0, dtype=torch.int64)
            else:
                k, v = mine[0], mine[1]
                assert (table.owner(k) == rank).all()
                if name == "t1" and table_wise:  # the whole table here
                    assert torch.equal(k, _by_key(ref.ebc.tables[name].export())[0])
                rv, found = ref.ebc.tables[name].find(k)
                assert found.all()
                torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-7)
            n = torch.tensor([k.numel()])
            dist.all_reduce(n)
            assert int(n) == len(ref.ebc.tables[name])
        ec_local = [m for m in ec_dmp.modules() if isinstance(m, ShardedDynamicEmbeddingCollection)][0]
        _check_same_rows(ec_local._inner.tables["t2"].local, [ec_ref.ec.tables["t2"]], rank, world, "EC")
    if world == 2 and not table_wise:  # TorchRec's qcomm registry reaches the tables' exchange
        from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
        reg = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.FP16),
                                        device=torch.device("cpu"))
        torch.manual_seed(0)
        qmodel = Model()
        torch.manual_seed(0)
        qref = Model()
        qdmp = DistributedModelParallel(qmodel, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                        device=torch.device("cpu"), sharders=[DynamicEmbeddingSharder(qcomm_codecs_registry=reg)])
        qs = [m for m in qdmp.modules() if isinstance(m, ShardedDynamicEmbeddingCollection)][0]
        assert all(t._comm == (torch.float16, torch.float16) for t in qs._inner.tables.values())
        feats = [[(pool[torch.randint(0, pool.numel(), (int(n.sum()),), generator=g)], n)
                  for n in (torch.randint(0, 4, (B,), generator=g) for _ in keys)] for _ in range(world)]
        union = [(torch.cat([feats[r][f][0] for r in range(world)]), torch.cat([feats[r][f][1] for r in range(world)]))
                 for f in range(len(keys))]
        out = qdmp(_kjt(keys, feats[rank], KeyedJaggedTensor))
        want = qref(_kjt(keys, union, KeyedJaggedTensor))[rank * B:(rank + 1) * B]
        # each row rounded once to fp16 (2^-11 relative) before pooling and the dense layer: near the
        # unsharded output, and not within fp32 rounding of it (the rows took the fp16 path)
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
        gap = torch.tensor([(out - want).abs().max().item()])
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
        assert gap.item() > 1e-6


def test_sharder_reads_qcomm_registry():
    """DynamicEmbeddingSharder takes the wire dtypes from TorchRec's qcomm codecs registry (the pooled
    or sequence embeddings' all-to-all entry, forward and backward apart) and refuses precisions and
    loss scales the exchange does not have, naming the argument."""
    pytest.importorskip("torchrec")
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    from torchfuse.torchrec import DynamicEmbeddingCollection, DynamicEmbeddingSharder
    cuda = torch.device("cuda")  # the registry's target backend (no GPU needed to build it)
    reg = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.BF16, backward_precision=CommType.FP16),
                                    device=cuda)
    assert DynamicEmbeddingSharder(qcomm_codecs_registry=reg)._comm == (torch.bfloat16, torch.float16)
    assert DynamicEmbeddingSharder(DynamicEmbeddingCollection, qcomm_codecs_registry=reg)._comm == (torch.bfloat16,
                                                                                                    torch.float16)
    assert DynamicEmbeddingSharder()._comm is None
    int8 = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.INT8), device=cuda)
    with pytest.raises(ValueError, match="qcomm_codecs_registry's forward precision"):
        DynamicEmbeddingSharder(qcomm_codecs_registry=int8)
    scaled = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.FP16,
                                                    backward_loss_scale=128.0), device=cuda)
    with pytest.raises(ValueError, match="qcomm_codecs_registry's backward loss scale"):
        DynamicEmbeddingSharder(qcomm_codecs_registry=scaled)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("table_wise", [False, True], ids=["row_wise", "t1_table_wise"])
def test_dmp_sharder_matches_unsharded(fresh_seed, table_wise, world):
    """DistributedModelParallel with DynamicEmbeddingSharder (planned by TorchRec's planner: row-wise,
    or one table asked table-wise through its ParameterConstraints) on a small model against the
    unsharded model fed every rank's samples (2, 4 and 8 ranks): the same outputs, dense gradients (DDP's mean times the
    world size) and table rows, to fp32 rounding (the dense layer's gradients make the sums' order
    matter)."""
    pytest.importorskip("torchrec")
    _spawn(_dmp_checks, world, fresh_seed, table_wise)
