"""torchfuse.sampled_softmax_loss against generative-recommenders' SampledSoftmaxLoss in plain PyTorch.

The reference is GR's formulation (normalize, logits, torch.where mask to -5e4, -log_softmax(...)[:, 0],
weighted mean). Each result is compared with it in float64; the allowed error is twice the error of the
same computation done by PyTorch in the input dtype (matmuls in that dtype, log_softmax in float32 as
under autocast), plus one machine epsilon of the dtype scaled by the reference's magnitude.
"""
import pytest
import torch

import _helpers
import torchfuse
from torchfuse import reference as _reference
from torchfuse import losses

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cuda_only(device):
    if device != "cuda":
        pytest.skip("CUDA only")


# ---------------------------------------------------------------- reference


def reference(q, p, n, temperature, **kw):
    """GR's SampledSoftmaxLoss.jagged_forward on already-gathered rows (torchfuse.reference), in the inputs'
    dtype (float64 for the exact reference)."""
    return _reference.sampled_softmax_loss(q, p, n, temperature, **kw)


def check_close(name, ours, ref64, lowp, dtype, expect_dtype):
    _helpers.check_close(name, ours, ref64, lowp, dtype, expect_dtype=expect_dtype)


def make_case(device, dtype, T, R, D, *, per_row=False, mask=None, weights=False, id_range=8):
    """Inputs (float32 masters), ids and weights. mask: None, 'row' ((T, R) ids) or 'shared' ((R,) ids)."""
    g = lambda *s: torch.randn(*s, device=device) * D**-0.25 + 0.05  # noqa: E731  (dots of order 1)
    q, p = g(T, D), g(T, D)
    n = g(T, R, D) if per_row else g(R, D)
    kw = {}
    if mask is not None:
        kw["positive_ids"] = torch.randint(0, id_range, (T,), device=device)
        kw["negative_ids"] = torch.randint(0, id_range, (T, R) if mask == "row" else (R,), device=device)
    if weights:
        w = torch.rand(T, device=device)
        w[::3] = 0
        kw["weights"] = w.to(dtype)
    return (q.to(dtype), p.to(dtype), n.to(dtype)), kw


def run_case(device, dtype, T, R, D, *, per_row=False, mask=None, weights=False, l2_norm=True, temperature=0.05,
             eps=1e-6):
    """Loss and gradients of query, positive and negatives against both references."""
    (q, p, n), kw = make_case(device, dtype, T, R, D, per_row=per_row, mask=mask, weights=weights)
    ins = [x.clone().requires_grad_(True) for x in (q, p, n)]
    dl = torch.tensor(1.3, device=device)
    loss = torchfuse.sampled_softmax_loss(*ins, temperature, l2_norm=l2_norm, eps=eps, **kw)
    grads = torch.autograd.grad(loss, ins, dl)

    def ref_of(cast):
        xs = [cast(x).detach().requires_grad_(True) for x in (q, p, n)]
        rkw = dict(kw)
        if "weights" in rkw:
            rkw["weights"] = cast(rkw["weights"])
        r = reference(*xs, temperature, l2_norm=l2_norm, eps=eps, **rkw)
        return r, torch.autograd.grad(r, xs, dl.to(r.dtype))

    r64, g64 = ref_of(lambda x: x.double())
    rlp, glp = ref_of(lambda x: x)
    check_close("loss", loss, r64, rlp, dtype, torch.float32)
    for name, ours, a, b in zip(("dquery", "dpositive", "dnegatives"), grads, g64, glp):
        check_close(name, ours, a, b, dtype, dtype)
    return loss, grads


# ---------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
@pytest.mark.parametrize("variant", ["plain", "no_l2", "mask_row", "mask_shared", "weights", "mask_weights"])
def test_loss_and_grads(device, dtype, per_row, variant):
    mask = {"mask_row": "row", "mask_shared": "shared", "mask_weights": "row"}.get(variant)
    run_case(device, dtype, 37, 19, 50, per_row=per_row, mask=mask, weights="weights" in variant,
             l2_norm=variant != "no_l2", temperature=0.5 if variant == "no_l2" else 0.05)


@pytest.mark.parametrize("dtype", DTYPES)
# on CUDA, per-row negatives take groups of 4 / 8 / 16 lanes up to D = 32 / 64 / 128, then whole warps
# (one chunk of 8 per lane up to 256, several above)
@pytest.mark.parametrize("D", [1, 3, 25, 50, 100, 256, 300])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
def test_feature_dims(device, dtype, D, per_row):
    # at D = 1 a normalised row is its sign, so with l2_norm every gradient is 0 up to rounding (checked
    # below): the gradients are compared without the normalisation there
    run_case(device, dtype, 21, 11, D, per_row=per_row, mask="row", l2_norm=D > 1, temperature=0.05 if D > 1 else 0.5)


@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
def test_unit_dim_normalised(device, per_row):
    (q, p, n), kw = make_case(device, torch.float32, 15, 6, 1, per_row=per_row, mask="row")
    ins = [x.clone().requires_grad_(True) for x in (q, p, n)]
    loss = torchfuse.sampled_softmax_loss(*ins, 0.05, **kw)
    r = reference(q.double(), p.double(), n.double(), 0.05, **kw)
    torch.testing.assert_close(loss.double(), r, rtol=1e-5, atol=1e-5)
    for x, gx in zip((q, p, n), torch.autograd.grad(loss, ins)):
        # zero up to the rounding of the gradient before the normalisation, s g / |x| per element
        assert gx.abs().max().item() <= 1e-5 * (1 / 0.05) * (1 / x.abs().min().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_rows_per_row(device, dtype):
    """D = 3500: the per-row backward's running sums need more than 48 KiB of shared memory per block."""
    run_case(device, dtype, 9, 5, 3500, per_row=True, mask="row")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,R", [(1, 9), (13, 1), (1, 1), (6, 0)])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
def test_small_sizes(device, dtype, T, R, per_row):
    run_case(device, dtype, T, R, 24, per_row=per_row, mask="row", weights=T > 1)


@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
def test_no_rows(device, per_row):
    """T = 0: loss 0 (not GR's 0/0), zero gradients of the inputs' shapes."""
    n = torch.randn(0, 5, 8, device=device) if per_row else torch.randn(5, 8, device=device)
    q, p = torch.randn(0, 8, device=device), torch.randn(0, 8, device=device)
    ins = [x.requires_grad_(True) for x in (q, p, n)]
    for kw in ({}, {"weights": torch.ones(0, device=device)}):
        loss = torchfuse.sampled_softmax_loss(*ins, 0.05, **kw)
        assert loss.shape == () and loss.dtype == torch.float32 and loss.item() == 0.0
        grads = torch.autograd.grad(loss, ins)
        for x, gx in zip(ins, grads):
            assert gx.shape == x.shape and (gx == 0).all()


@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
def test_zero_total_weight(device, per_row):
    (q, p, n), _ = make_case(device, torch.float32, 9, 4, 16, per_row=per_row)
    ins = [x.requires_grad_(True) for x in (q, p, n)]
    loss = torchfuse.sampled_softmax_loss(*ins, 0.05, weights=torch.zeros(9, device=device))
    assert loss.item() == 0.0
    for gx in torch.autograd.grad(loss, ins):
        assert (gx == 0).all()


@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
def test_every_negative_masked(device, per_row):
    """All negatives are the positive: each row's loss is log(1 + R exp(-5e4 - pos)) = 0."""
    T, R = 5, 7
    (q, p, n), _ = make_case(device, torch.float32, T, R, 16, per_row=per_row)
    ids = torch.arange(T, device=device)
    neg_ids = ids.unsqueeze(1).expand(T, R)
    ins = [x.requires_grad_(True) for x in (q, p, n)]
    loss = torchfuse.sampled_softmax_loss(*ins, 0.05, positive_ids=ids, negative_ids=neg_ids)
    assert loss.item() == 0.0
    for gx in torch.autograd.grad(loss, ins):
        assert (gx == 0).all()


@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
def test_dominant_positive_keeps_relative_accuracy(device, per_row):
    """positive close to the query at temperature 0.05: each row's loss is ~R exp(20 (cos_n - cos_p)),
    far below the logits' rounding; the fused op keeps it (and the gradients) to float32 relative accuracy."""
    (q, p, n), _ = make_case(device, torch.float32, 16, 32, 64, per_row=per_row)
    p = q + 0.1 * p
    ins = [x.clone().requires_grad_(True) for x in (q, p, n)]
    loss = torchfuse.sampled_softmax_loss(*ins, 0.05)
    grads = torch.autograd.grad(loss, ins)
    xs = [x.double().requires_grad_(True) for x in (q, p, n)]
    r = reference(*xs, 0.05)
    assert r.item() < 1e-3
    assert abs(loss.item() - r.item()) <= 1e-4 * r.item()
    for name, a, b in zip(("dquery", "dpositive", "dnegatives"), grads, torch.autograd.grad(r, xs)):
        err = (a.double() - b).abs().max().item()
        assert err <= 1e-3 * b.abs().max().item(), f"{name}: {err:.3g} against {b.abs().max().item():.3g}"


def test_zero_vectors_clamped_norm(device):
    """Rows of norm below eps are divided by eps (F.normalize), forward and backward."""
    (q, p, n), kw = make_case(device, torch.float32, 8, 6, 12, mask="row")
    q[2] = 0
    p[3] = 1e-8
    n[1] = 0
    ins = [x.clone().requires_grad_(True) for x in (q, p, n)]
    loss = torchfuse.sampled_softmax_loss(*ins, 0.05, **kw)
    grads = torch.autograd.grad(loss, ins)

    def ref_of(cast):
        xs = [cast(x).detach().requires_grad_(True) for x in (q, p, n)]
        r = reference(*xs, 0.05, **kw)
        return r, torch.autograd.grad(r, xs)

    # against float64, within a few times the float32 reference's own error
    (r64, g64), (r32, g32) = ref_of(lambda x: x.double()), ref_of(lambda x: x)
    check_close("loss", loss, r64, r32, torch.float32, torch.float32)
    for name, ours, a, b in zip(("dquery", "dpositive", "dnegatives"), grads, g64, g32):
        check_close(name, ours, a, b, torch.float32, torch.float32)


@pytest.mark.parametrize("mask", ["row", "shared"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [1, 7, 8, 16])
def test_chunks(device, dtype, chunk, mask, monkeypatch):
    """Queries in blocks of `chunk` rows (the last one partial) are as accurate as one block: against the
    float64 reference within the bound of every other test. With shared negatives their gradient sums
    over the blocks; its summation order differs from one block's, so the two agree to rounding only."""
    monkeypatch.setattr(losses, "_chunk_rows", chunk)
    run_case(device, dtype, 45, 13, 40, mask=mask, weights=True)


def test_chunks_match_one_block(device, monkeypatch):
    """Shared negatives in blocks of 8 query rows against one block, same inputs, element by element:
    within rtol 1e-5 / atol 1e-7 plus twice PyTorch's own float32 error at that element (the blocks sum
    the negatives' gradients in another order, which moves an element by its rounding where its terms
    cancel, as PyTorch's float32 error there shows)."""
    (q, p, n), kw = make_case(device, torch.float32, 50, 17, 33, mask="shared", weights=True)
    outs = []
    for chunk in (0, 8):
        monkeypatch.setattr(losses, "_chunk_rows", chunk)
        ins = [x.clone().requires_grad_(True) for x in (q, p, n)]
        loss = torchfuse.sampled_softmax_loss(*ins, 0.05, **kw)
        outs.append((loss, *torch.autograd.grad(loss, ins)))
    refs = []
    for cast in (lambda x: x.double(), lambda x: x):
        xs = [cast(x).detach().requires_grad_(True) for x in (q, p, n)]
        rkw = dict(kw, weights=cast(kw["weights"]))
        r = reference(*xs, 0.05, **rkw)
        refs.append((r, *torch.autograd.grad(r, xs)))
    for name, a, b, r64, r32 in zip(("loss", "dquery", "dpositive", "dnegatives"), *outs, *refs):
        _helpers.check_close_elementwise(f"{name}: chunked vs one block", a, b, (r32.double() - r64).abs(), 1e-5,
                                         1e-7)


def test_int32_ids_and_strided_inputs(device):
    (q, p, n), kw = make_case(device, torch.float32, 12, 9, 20, mask="row", weights=True)
    expect = torchfuse.sampled_softmax_loss(q, p, n, 0.1, **kw)
    kw32 = {k: (v.int() if v.dtype == torch.int64 else v) for k, v in kw.items()}
    # query as a transposed view, negatives as every other row of a larger tensor
    qt = q.t().contiguous().t()
    big = torch.zeros(18, 20, device=device)
    big[::2] = n
    got = torchfuse.sampled_softmax_loss(qt, p, big[::2], 0.1, **kw32)
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)


def test_autocast_mixed_dtypes(device):
    """Under autocast, fp32 queries meet bf16 item embeddings as in GR's autocast training: one dtype for
    the op, a float32 loss, gradients in each input's dtype."""
    (q, p, n), kw = make_case(device, torch.float32, 20, 9, 32, mask="row")
    ins = [q.clone().requires_grad_(True), p.bfloat16().requires_grad_(True), n.bfloat16().requires_grad_(True)]
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = torchfuse.sampled_softmax_loss(*ins, 0.05, **kw)
    assert loss.dtype == torch.float32
    grads = torch.autograd.grad(loss, ins)
    assert [g.dtype for g in grads] == [torch.float32, torch.bfloat16, torch.bfloat16]
    xs = [x.detach().bfloat16().double().requires_grad_(True) for x in ins]
    r = reference(*xs, 0.05, **kw)
    assert abs(loss.item() - r.item()) <= 1e-3 * abs(r.item())
    for a, b in zip(grads, torch.autograd.grad(r, xs)):
        assert (a.double() - b).abs().max().item() <= 2.0**-7 * b.abs().max().item()


def test_no_grad_needed(device):
    (q, p, n), kw = make_case(device, torch.bfloat16, 10, 5, 16, mask="row")
    loss = torchfuse.sampled_softmax_loss(q, p, n, 0.05, **kw)
    assert not loss.requires_grad and loss.dtype == torch.float32
    r = reference(q.double(), p.double(), n.double(), 0.05, **kw)
    assert abs(loss.item() - r.item()) < 0.05 * max(1.0, abs(r.item()))


# ---------------------------------------------------------------- registration


def test_meta_tensors():
    q = torch.empty(7, 32, device="meta", dtype=torch.bfloat16)
    loss = torchfuse.sampled_softmax_loss(q, q, torch.empty(7, 5, 32, device="meta", dtype=torch.bfloat16), 0.05)
    assert loss.shape == () and loss.dtype == torch.float32 and loss.device.type == "meta"


def test_opcheck(device):
    """Schema, fake kernel, autograd registration and dispatch agree (torch.library.opcheck)."""
    (q, p, n), kw = make_case(device, torch.float32, 6, 4, 10, mask="row", weights=True)
    (_, _, n3), _ = make_case(device, torch.bfloat16, 6, 4, 10, per_row=True)
    qb, pb = q.bfloat16(), p.bfloat16()
    req = lambda *xs: [x.clone().requires_grad_(True) for x in xs]  # noqa: E731
    fwd = torch.ops.torchfuse.sampled_softmax_fwd.default
    for args in [
        (*req(q, p, n), kw["positive_ids"], kw["negative_ids"], kw["weights"], 0.05, True, 1e-6, 0),
        (*req(q, p, n), None, None, None, 0.7, False, 1e-6, 2),
        (*req(qb, pb, n3), kw["positive_ids"], kw["negative_ids"], None, 0.05, True, 1e-6, 0),
    ]:
        torch.library.opcheck(fwd, args)


def test_torch_compile_fullgraph():
    """fullgraph compile (CPU, aot_eager) of the loss and its gradients equals eager."""

    def f(q, p, n, ids, nids, w):
        return torchfuse.sampled_softmax_loss(q, p, n, 0.05, positive_ids=ids, negative_ids=nids, weights=w) * 2

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    for T in (9, 14):
        (q, p, n), kw = make_case("cpu", torch.float32, T, 6, 16, mask="row", weights=True)
        args = (kw["positive_ids"], kw["negative_ids"], kw["weights"])
        a = [x.clone().requires_grad_(True) for x in (q, p, n)]
        b = [x.clone().requires_grad_(True) for x in (q, p, n)]
        out, ref = cf(*a, *args), f(*b, *args)
        torch.testing.assert_close(out, ref)
        for x, y in zip(torch.autograd.grad(out, a), torch.autograd.grad(ref, b)):
            torch.testing.assert_close(x, y)


def test_bad_inputs(device):
    (q, p, n), kw = make_case(device, torch.float32, 6, 4, 10, mask="row", weights=True)
    loss = torchfuse.sampled_softmax_loss

    def raises(exc, match, *args, **kwargs):
        with pytest.raises(exc, match=match):
            loss(*args, **kwargs)

    raises(RuntimeError, "query must be", q[0], p, n, 0.1)
    raises(RuntimeError, "positive must have the shape", q, p[:5], n, 0.1)
    raises(TypeError, "positive must have query's dtype", q, p.double(), n, 0.1)
    raises(RuntimeError, "negatives must be", q, p, n[:, :9], 0.1)
    raises(RuntimeError, "negatives must be", q, p, torch.randn(5, 4, 10, device=device), 0.1)
    raises(TypeError, "negatives must have query's dtype", q, p, n.half(), 0.1)
    raises(TypeError, "query must be float32", q.double(), p.double(), n.double(), 0.1)
    raises(RuntimeError, "temperature must be", q, p, n, 0.0)
    raises(RuntimeError, "temperature must be", q, p, n, -1.0)
    raises(RuntimeError, "eps must be", q, p, n, 0.1, eps=0.0)
    raises(RuntimeError, "positive_ids and negative_ids go together", q, p, n, 0.1, positive_ids=kw["positive_ids"])
    raises(RuntimeError, "positive_ids must be", q, p, n, 0.1, positive_ids=kw["positive_ids"][:5],
           negative_ids=kw["negative_ids"])
    raises(RuntimeError, "negative_ids must be", q, p, n, 0.1, positive_ids=kw["positive_ids"],
           negative_ids=kw["negative_ids"][:, :3])
    raises(TypeError, "negative_ids must be int64 or int32", q, p, n, 0.1, positive_ids=kw["positive_ids"],
           negative_ids=kw["negative_ids"].float())
    raises(RuntimeError, "weights must be", q, p, n, 0.1, weights=kw["weights"][:4])
    raises(TypeError, "weights must be a float tensor", q, p, n, 0.1, weights=torch.ones(6, dtype=torch.int64,
                                                                                              device=device))
    if device == "cuda":
        raises(RuntimeError, "negatives must be on the same device", q, p, n.cpu(), 0.1)
        raises(RuntimeError, "weights must be on the same device", q, p, n, 0.1, weights=kw["weights"].cpu())
        raises(RuntimeError, "positive_ids must be on the same device", q, p, n, 0.1,
               positive_ids=kw["positive_ids"].cpu(), negative_ids=kw["negative_ids"])


# ---------------------------------------------------------------- memory


def test_forward_and_backward_memory_bounded(device):
    """Shared negatives at T x R far above the similarity block: peak memory stays well below one
    (T x R) float32 logits tensor, forward and backward."""
    _cuda_only(device)
    T, R, D = 65536, 8192, 64
    logits_bytes = T * R * 4  # 2 GiB
    (q, p, n), kw = make_case(device, torch.bfloat16, T, R, D, mask="shared")
    ins = [x.requires_grad_(True) for x in (q, p, n)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = torchfuse.sampled_softmax_loss(*ins, 0.05, **kw)
    torch.cuda.synchronize()
    fwd_peak = torch.cuda.max_memory_allocated() - base
    assert fwd_peak < logits_bytes / 8, f"forward peak {fwd_peak / 2**20:.0f} MiB"
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(loss, ins)
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - base
    assert bwd_peak < logits_bytes / 8, f"backward peak {bwd_peak / 2**20:.0f} MiB"
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    # the value of a slice of rows, as a sanity check of the large case
    r = reference(q[:512].double(), p[:512].double(), n.double(), 0.05, positive_ids=kw["positive_ids"][:512],
                  negative_ids=kw["negative_ids"])
    l512 = torchfuse.sampled_softmax_loss(q[:512].detach(), p[:512].detach(), n.detach(), 0.05,
                                          positive_ids=kw["positive_ids"][:512], negative_ids=kw["negative_ids"])
    assert abs(l512.item() - r.item()) < 0.02 * abs(r.item())
