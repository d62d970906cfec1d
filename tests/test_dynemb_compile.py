"""torch.compile(fullgraph=True) over the dynamic embedding modules: the same outputs, rows, optimizer
state and table contents as eager mode, for inference, inserting forwards and training steps (forward,
backward with the fused optimizer), including a table that grows and one that evicts, and the
TorchRec bag collection."""
import copy
from types import SimpleNamespace

import pytest
import torch

from torchfuse import DynamicEmbedding, DynamicEmbeddingBag
from torchfuse import optim as tfo



@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Each test compiles from scratch: dynamo's recompile limit counts per code object across the
    whole process, and earlier tests' graphs of the same modules would count against this one's."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tables_equal(a, b, tol=0.0):
    """The same keys with the same rows, optimizer state and scores (slots may differ after growth).
    tol: the rows' gradients came through layers that inductor compiled (its own summation order)."""
    ka, va, sa, ca = a._compact()
    kb, vb, sb, cb = b._compact()
    ia, ib = torch.argsort(ka), torch.argsort(kb)
    assert torch.equal(ka[ia], kb[ib])
    torch.testing.assert_close(va[ia], vb[ib], rtol=tol, atol=tol)
    torch.testing.assert_close(sa[ia], sb[ib], rtol=tol, atol=tol)
    assert torch.equal(ca[ia], cb[ib])
    assert (len(a), a.capacity, a._step, a._clock) == (len(b), b.capacity, b._step, b._clock)


def _ids(n, high, device, shape=None):
    return torch.randint(-high, high, shape or (n,), device=device)


class _Model(torch.nn.Module):
    """A model around a table: the compiled graph holds the layers and the table's op."""

    def __init__(self, table, dim):
        super().__init__()
        self.table = table
        self.proj = torch.nn.Linear(dim, 3)

    def forward(self, *args):
        return self.proj(torch.relu(self.table(*args)))


def _pair(table, device, dim):
    torch.manual_seed(0)
    eager = _Model(table, dim).to(device)
    return eager, copy.deepcopy(eager)


@pytest.mark.parametrize("kind", ["rows", "bag"])
@pytest.mark.parametrize("growth", [False, True])
def test_compiled_training_matches_eager(device, kind, growth):
    """Training steps (inserting forward, loss backward, the table's fused Adagrad, SGD on the
    layers) compiled with fullgraph=True against the same model in eager mode: identical losses,
    layer weights and table contents, through growth (a small table with max_capacity) or eviction."""
    dim = 8
    opts = dict(device=device, optimizer=tfo.Adagrad(0.1), initializer=("uniform", -0.5, 0.5), seed=5)
    # growth: 8-slot buckets up to 256 slots; eviction: two 16-slot buckets, small batches (a bucket
    # holding more of one batch's keys than it has slots would be an error, not an eviction)
    opts.update(dict(bucket_size=8, max_capacity=256) if growth else dict(bucket_size=16, eviction="lru"))
    shape, n_bag = ((6, 5), 20) if growth else ((4, 3), 12)
    table = DynamicEmbedding(dim, 32, **opts) if kind == "rows" else DynamicEmbeddingBag(dim, 32, mode="mean", **opts)
    eager, compiled = _pair(table, device, dim)
    step = torch.compile(compiled, fullgraph=True)
    opt_e = torch.optim.SGD(eager.proj.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(compiled.proj.parameters(), lr=0.05)
    for _ in range(5):
        if kind == "rows":
            args = (_ids(0, 60, device, shape),)
        else:
            args = (_ids(n_bag, 60, device), torch.tensor([0, 3, 3, 9, 11], device=device))
        losses = []
        for model, fn, opt in ((eager, eager, opt_e), (compiled, step, opt_c)):
            opt.zero_grad()
            loss = fn(*args).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled.proj.weight, eager.proj.weight, rtol=1e-6, atol=1e-6)
    _tables_equal(compiled.table, eager.table, 1e-5)
    assert eager.table._step == 5
    if growth:
        assert eager.table.capacity > 32
    else:
        assert eager.table.evicted_dropped + eager.table.drain_evicted()[0].numel() > 0


@pytest.mark.parametrize("kind", ["rows", "bag"])
def test_compiled_inference_matches_eager(device, kind):
    """Eval forwards (no inserts) and training-mode forwards without gradients (inserts) compiled
    with fullgraph=True give eager mode's outputs, and leave the same table."""
    dim = 4
    opts = dict(device=device, bucket_size=8, initializer=("normal", 0.0, 1.0), seed=2)
    table = DynamicEmbedding(dim, 64, **opts) if kind == "rows" else DynamicEmbeddingBag(dim, 64, **opts)
    keys = _ids(20, 30, device).unique()
    table.insert(keys, torch.randn(keys.numel(), dim, device=device))
    eager = table
    compiled = copy.deepcopy(table)
    fn = torch.compile(compiled, fullgraph=True)
    for training in (True, False, True):
        eager.train(training)
        compiled.train(training)
        with torch.no_grad():
            if kind == "rows":
                args = (_ids(0, 30, device, (3, 7)),)
            else:
                args = (_ids(0, 30, device, (5, 3)),)
            torch.testing.assert_close(fn(*args), eager(*args), rtol=0, atol=0)
    _tables_equal(compiled, eager)
    assert len(eager) > 0


def test_compiled_copy_is_its_own_table(device):
    """A deep copy of a module (compiled separately) writes its own table, not the original's."""
    a = DynamicEmbedding(4, 64, device=device, bucket_size=8)
    b = copy.deepcopy(a)
    assert a._compile_handle != b._compile_handle
    torch.compile(b, fullgraph=True)(torch.arange(10, device=device))
    assert len(b) == 10 and len(a) == 0


@pytest.mark.parametrize("table_batched", [True, False])
def test_compiled_collection_matches_eager(device, table_batched):
    """DynamicEmbeddingBagCollection under torch.compile(fullgraph=True): training steps (SUM and MEAN
    tables, per-id weights, one launch set for all tables or one table after another) give eager
    mode's values and tables; then eval forwards."""
    from torchfuse.torchrec import DynamicEmbeddingBagCollection, StandInKJT
    cfgs = [SimpleNamespace(name="a", embedding_dim=4, num_embeddings=40, feature_names=["f0", "f1"], pooling="sum"),
            SimpleNamespace(name="b", embedding_dim=4 if table_batched else 6, num_embeddings=40,
                            feature_names=["f2"], pooling="mean")]
    eager = DynamicEmbeddingBagCollection(cfgs, device=device, optimizer=tfo.RowWiseAdagrad(0.2), is_weighted=False,
                                          table_batched=table_batched, bucket_size=8, seed=1)
    compiled = copy.deepcopy(eager)
    fn = torch.compile(compiled, fullgraph=True)
    B = 4
    for training in (True, True, True, False):
        eager.train(training)
        compiled.train(training)
        lengths = torch.randint(0, 4, (3 * B,), device=device)
        kjt = StandInKJT(["f0", "f1", "f2"], torch.randint(0, 30, (int(lengths.sum()),), device=device), lengths)
        outs = []
        for fwd in (eager, fn):
            v = fwd(kjt).values()
            if training:
                (v * torch.arange(v.shape[1], device=device)).sum().backward()
            outs.append(v.detach())
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    for name in ("a", "b"):
        _tables_equal(compiled.tables[name], eager.tables[name])
    assert eager.tables["a"]._step == 3


def test_module_op_writes_the_state_it_is_given(device):
    """torchfuse::dynemb_module_forward runs the table on the state list it is passed (what
    functionalization hands it may be copies, which it then writes back): copies get the inserts,
    the table's own tensors are left alone and stay the table's."""
    m = DynamicEmbedding(4, 64, device=device, bucket_size=8)
    own = list(m._tensors)
    before = [x.clone() for x in own]
    copies = [x.clone() for x in own]
    ids = torch.arange(10, device=device)
    out, token = torch.ops.torchfuse.dynemb_module_forward(m._compile_handle, copies, [ids], False)
    assert out.shape == (10, 4) and int(token[0]) == 0
    assert all(a is b for a, b in zip(m._tensors, own))
    for x, y in zip(own, before):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    m._set_tensors(copies)
    found, hit = m.find(ids)
    assert bool(hit.all()) and torch.equal(found, out)
