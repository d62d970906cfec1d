"""torchfuse.hstu_preprocess against generative-recommenders' hstu_compute_uqvk semantics
(torchfuse.reference.hstu_preprocess in float64, and GR's own function when a local copy is importable)."""
import importlib
import random

import pytest
import torch

import torchfuse
from torchfuse import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [  # (L, E, H, attn_dim, hidden_dim)
    (37, 64, 2, 32, 32),
    (19, 50, 2, 25, 25),   # MovieLens-1M: rows of 25 bf16 are not 16-byte aligned
    (11, 24, 3, 16, 8),
    (1, 8, 1, 4, 12),
    (0, 16, 2, 8, 8),      # no rows
]


def _inputs(L, E, H, Da, Dh, device, dtype):
    N = 2 * H * (Da + Dh)
    x = torch.randn(L, E, device=device) * 2 + 0.5
    nw = 1 + 0.3 * torch.randn(E, device=device)
    nb = 0.3 * torch.randn(E, device=device)
    w = torch.randn(E, N, device=device) / E ** 0.5
    b = 0.3 * torch.randn(N, device=device)
    return [t.to(dtype) for t in (x, nw, nb, w, b)]


def _rel(a, b):
    return (a.double() - b).abs().max().item() / (b.abs().max().item() + 1e-6) if b.numel() else 0.0


def _run(fn, ins, dims, grads, **kw):
    ins = [t.detach().clone().requires_grad_(True) for t in ins]
    out = fn(ins[0], ins[1], ins[2], 1e-6, ins[3], ins[4], *dims, **kw)
    gin = torch.autograd.grad(out, ins, [g.to(o.dtype) for o, g in zip(out, grads)], allow_unused=True)
    return list(out), [g if g is not None else torch.zeros_like(t) for g, t in zip(gin, ins)]


def _assert_close_to_f64(got, lp, ref, dtype, what):
    # relative to each tensor's scale: a few roundings, for tensors too small for the reference's own
    # error to be a steady unit (one row: the weight gradients are single products)
    floor = max(4 * torch.finfo(dtype).eps, 2e-6)
    for i, (g, own, want) in enumerate(zip(got, lp, ref)):
        assert g.shape == want.shape and g.dtype == own.dtype, (what, i, g.shape, want.shape, g.dtype)
        assert _rel(g, want) <= max(3 * _rel(own, want), floor), (what, i, _rel(g, want), _rel(own, want))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-E{}-H{}-Da{}-Dh{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("recompute", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["save", "recompute_normed_x", "recompute_uvqk", "recompute_both"])
def test_forward_backward_match_float64(device, shape, dtype, recompute):
    L, E, H, Da, Dh = shape
    dims = (H, Da, Dh)
    ins = _inputs(L, E, H, Da, Dh, device, dtype)
    ins64 = [t.double() for t in ins]
    shapes = [(L, H * Dh), (L, H, Da), (L, H, Da), (L, H, Dh)]
    grads = [torch.randn(s, device=device, dtype=torch.float64) for s in shapes]
    ref_out, ref_g = _run(reference.hstu_preprocess, ins64, dims, grads)
    lp_out, lp_g = _run(reference.hstu_preprocess, ins, dims, grads)  # the formulation in dtype: the unit
    out, g = _run(torchfuse.hstu_preprocess, ins, dims, grads, recompute_normed_x=recompute[0],
                  recompute_uvqk=recompute[1])
    _assert_close_to_f64(out, lp_out, ref_out, dtype, "forward")
    _assert_close_to_f64(g, lp_g, ref_g, dtype, "gradients of x, norm_weight, norm_bias, uvqk_weight, uvqk_bias")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("frozen", [3, 4], ids=["uvqk_weight_frozen", "uvqk_bias_frozen"])
@pytest.mark.parametrize("recompute", [False, True], ids=["save", "recompute_normed_x"])
def test_one_gemm_parameter_frozen(device, dtype, frozen, recompute):
    """With only one of the GEMM's weight and bias trained, the bias gradient is a column sum of its own
    (the joint [dW; db] GEMM needs both): same gradients as with both trained."""
    L, E, H, Da, Dh = 23, 40, 2, 16, 8
    dims = (H, Da, Dh)
    ins = _inputs(L, E, H, Da, Dh, device, dtype)
    grads = [torch.randn(s, device=device) for s in [(L, H * Dh), (L, H, Da), (L, H, Da), (L, H, Dh)]]
    _, both = _run(torchfuse.hstu_preprocess, ins, dims, grads, recompute_normed_x=recompute)
    leaves = [t.detach().clone().requires_grad_(i != frozen) for i, t in enumerate(ins)]
    out = torchfuse.hstu_preprocess(leaves[0], leaves[1], leaves[2], 1e-6, leaves[3], leaves[4], *dims,
                                    recompute_normed_x=recompute)
    torch.autograd.backward(out, [g.to(o.dtype) for o, g in zip(out, grads)])
    assert leaves[frozen].grad is None
    for i, t in enumerate(leaves):
        if i != frozen:  # a column sum and a GEMM row sum in other orders: a few roundings apart
            assert _rel(t.grad, both[i].double()) <= 8 * torch.finfo(dtype).eps, i


@pytest.mark.parametrize("dtype", DTYPES, ids=str)


def test_inference_path_equals_training_path(device, dtype):
    L, E, H, Da, Dh = 13, 32, 2, 16, 8
    ins = _inputs(L, E, H, Da, Dh, device, dtype)
    with torch.no_grad():
        inf = torchfuse.hstu_preprocess(ins[0], ins[1], ins[2], 1e-6, ins[3], ins[4], H, Da, Dh)
    train = torchfuse.hstu_preprocess(ins[0].requires_grad_(), ins[1], ins[2], 1e-6, ins[3], ins[4], H, Da, Dh)
    for a, b in zip(inf, train):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("recompute", [False, True])
def test_silu_u_false_returns_the_pre_activation(device, recompute):
    """silu_u=False: u before its SiLU (a view of the GEMM output), gradients through it unchanged."""
    L, E, H, Da, Dh = 12, 24, 2, 8, 6
    ins = _inputs(L, E, H, Da, Dh, device, torch.float32)
    shapes = [(L, H * Dh), (L, H, Da), (L, H, Da), (L, H, Dh)]
    grads = [torch.randn(s, device=device, dtype=torch.float64) for s in shapes]

    def pre_then_silu(x, nw, nb, eps, w, b, H, Da, Dh):
        u, q, k, v = torchfuse.hstu_preprocess(x, nw, nb, eps, w, b, H, Da, Dh, silu_u=False,
                                               recompute_normed_x=recompute, recompute_uvqk=recompute)
        assert u.data_ptr() + H * Dh * u.element_size() == v.data_ptr()  # a view: v's columns follow u's
        return torch.nn.functional.silu(u), q, k, v

    out, g = _run(pre_then_silu, ins, (H, Da, Dh), grads)
    want, want_g = _run(torchfuse.hstu_preprocess, ins, (H, Da, Dh), grads)
    for a, b in zip(out + g, want + want_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_outputs_are_views_of_one_gemm_output(device):
    L, E, H, Da, Dh = 9, 16, 2, 8, 4
    ins = _inputs(L, E, H, Da, Dh, device, torch.float32)
    u, q, k, v = torchfuse.hstu_preprocess(ins[0], ins[1], ins[2], 1e-6, ins[3], ins[4], H, Da, Dh)
    N = 2 * H * (Da + Dh)
    assert u.is_contiguous() and u.shape == (L, H * Dh)
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    base = v.data_ptr() - H * Dh * 4  # v starts after u's columns
    assert (q.data_ptr() - base, k.data_ptr() - base) == (2 * H * Dh * 4, (2 * H * Dh + H * Da) * 4)
    assert q.stride() == (N, Da, 1) and k.stride() == (N, Da, 1) and v.stride() == (N, Dh, 1)


def test_recompute_flags_save_less(device):
    """recompute_normed_x drops the normalized rows from what the backward keeps ([LN(x), 1] padded to a
    multiple of 8 columns when both GEMM parameters train); recompute_uvqk drops u's pre-activation
    (L, H * hidden_dim)."""
    L, E, H, Da, Dh = 10, 24, 2, 8, 6
    ins = [t.requires_grad_() for t in _inputs(L, E, H, Da, Dh, device, torch.float32)]

    def saved(**kw):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torchfuse.hstu_preprocess(ins[0], ins[1], ins[2], 1e-6, ins[3], ins[4], H, Da, Dh, **kw)
        return sum(sizes)

    normed = L * ((E + 8) // 8 * 8)
    full = saved()
    assert full - saved(recompute_normed_x=True) == normed
    assert full - saved(recompute_uvqk=True) == L * H * Dh
    assert full - saved(recompute_normed_x=True, recompute_uvqk=True) == normed + L * H * Dh


def test_compile_and_meta():
    L, E, H, Da, Dh = 7, 12, 2, 5, 3
    ins = [t.requires_grad_() for t in _inputs(L, E, H, Da, Dh, "cpu", torch.float32)]

    def f(x, nw, nb, w, b):
        u, q, k, v = torchfuse.hstu_preprocess(x, nw, nb, 1e-6, w, b, H, Da, Dh, recompute_normed_x=True,
                                               recompute_uvqk=True)
        return u.sum() + (q * k).sum() + v.pow(2).sum()

    g_eager = torch.autograd.grad(f(*ins), ins)
    g_comp = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(*ins), ins)
    for a, b in zip(g_eager, g_comp):
        torch.testing.assert_close(a, b)
    m = [t.detach().to("meta") for t in ins]
    out = torchfuse.hstu_preprocess(m[0], m[1], m[2], 1e-6, m[3], m[4], H, Da, Dh)
    assert [tuple(o.shape) for o in out] == [(L, H * Dh), (L, H, Da), (L, H, Da), (L, H, Dh)]


def test_autocast_runs_in_its_dtype(device):
    """fp32 inputs under autocast: the section in autocast's dtype, the same as casting first."""
    L, E, H, Da, Dh = 9, 16, 2, 8, 8
    ins = _inputs(L, E, H, Da, Dh, device, torch.float32)
    shapes = [(L, H * Dh), (L, H, Da), (L, H, Da), (L, H, Dh)]
    grads = [torch.randn(s, device=device, dtype=torch.float64) for s in shapes]
    with torch.autocast(device, dtype=torch.bfloat16), torchfuse.stats() as calls:
        out, g = _run(torchfuse.hstu_preprocess, ins, (H, Da, Dh), grads, recompute_normed_x=True)
    assert calls["hstu_preprocess"] == 1
    want, want_g = _run(torchfuse.hstu_preprocess, [t.bfloat16() for t in ins], (H, Da, Dh), grads,
                        recompute_normed_x=True)
    assert all(o.dtype == torch.bfloat16 for o in out)
    for a, b in zip(out + g, want + want_g):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0)


def test_stats_count_the_call():
    ins = _inputs(3, 8, 1, 4, 4, "cpu", torch.float32)
    with torchfuse.stats() as calls:
        torchfuse.hstu_preprocess(ins[0], ins[1], ins[2], 1e-6, ins[3], ins[4], 1, 4, 4)
    assert calls["hstu_preprocess"] == 1


# ---- generative-recommenders' own function, where a local copy is importable ----


def _gr_compute():
    try:
        importlib.import_module("fbgemm_gpu")  # registers torch.ops.fbgemm, which GR's modules expect
    except ImportError:
        pass
    try:
        hc = importlib.import_module("generative_recommenders.ops.hstu_compute")
        common = importlib.import_module("generative_recommenders.common")
    except Exception as e:  # noqa: BLE001  (GR imports triton, torchrec and fbgemm at module level)
        pytest.skip(f"generative_recommenders is not importable here ({type(e).__name__}: {e})")
    return hc, common.HammerKernel


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_gr_hstu_compute_uqvk(device, dtype):
    hc, HammerKernel = _gr_compute()
    L, E, H, Da, Dh = random.choice(SHAPES[:4])
    ins = _inputs(L, E, H, Da, Dh, device, dtype)

    def gr(x, nw, nb, eps, w, b, H, Da, Dh):
        return hc.hstu_compute_uqvk(x=x, norm_weight=nw, norm_bias=nb, norm_eps=eps, num_heads=H, attn_dim=Da,
                                    hidden_dim=Dh, uvqk_weight=w, uvqk_bias=b, kernel=HammerKernel.PYTORCH)

    shapes = [(L, H * Dh), (L, H, Da), (L, H, Da), (L, H, Dh)]
    grads = [torch.randn(s, device=device, dtype=torch.float64) for s in shapes]
    ref_out, ref_g = _run(reference.hstu_preprocess, [t.double() for t in ins], (H, Da, Dh), grads)
    # GR's own code in the inputs' dtype is the tolerance's unit
    lp_out, lp_g = _run(gr, ins, (H, Da, Dh), grads)
    out, g = _run(torchfuse.hstu_preprocess, ins, (H, Da, Dh), grads, recompute_normed_x=True)
    _assert_close_to_f64(out, lp_out, ref_out, dtype, "forward")
    _assert_close_to_f64(g, lp_g, ref_g, dtype, "gradients")
    # GR's code on float64 inputs (its LayerNorm runs in float32) is torchfuse's float64 reference
    gr64, gr64_g = _run(gr, [t.double() for t in ins], (H, Da, Dh), grads)
    for a, b in zip(gr64 + gr64_g, ref_out + ref_g):
        assert _rel(a, b) < 1e-5
