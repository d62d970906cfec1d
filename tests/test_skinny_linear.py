"""torchfuse.skinny_linear ([LayerNorm(a)] @ weight + bias + residual for <= 8 rows) against plain
PyTorch: the norm op's rounded output then torch.addmm, in float64 and in the low precision."""
import pytest
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse.skinny_linear import skinny_linear

from _helpers import check_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [  # (M, K, N): odd sizes, one row, the most rows, a K split over a cluster, N not a multiple of 8
    (1, 1024, 4096), (8, 1024, 256), (3, 3072, 1024), (5, 7, 24), (2, 64, 1000), (1, 1, 8), (7, 200, 136),
]


def _inputs(M, K, N, device, dtype):
    a = torch.randn(M, K, device=device) * 2 + 0.5
    w = torch.randn(K, N, device=device) / K ** 0.5
    bias = 0.3 * torch.randn(N, device=device)
    res = torch.randn(M, N, device=device)
    nw = 1 + 0.3 * torch.randn(K, device=device)
    nb = 0.3 * torch.randn(K, device=device)
    return [t.to(dtype) for t in (a, w, bias, res, nw, nb)]


def _reference(a, w, bias, res, nw, nb, eps, dtype):
    """(float64, low precision): LayerNorm rounded to dtype (what the norm op hands the GEMM), then addmm;
    the low-precision one takes the norm in fp32, as PyTorch's own does."""
    a_lowp = a
    if nw is not None:
        normed = F.layer_norm(a.double(), (a.shape[1],), nw.double(), None if nb is None else nb.double(), eps)
        a_lowp = F.layer_norm(a.float(), (a.shape[1],), nw.float(), None if nb is None else nb.float(), eps).to(dtype)
        a = normed.to(dtype)
    out64 = a.double() @ w.double()
    lowp = a_lowp @ w if a.is_cuda or dtype == torch.float32 else (a_lowp.float() @ w.float()).to(dtype)
    for t in (bias, res):
        if t is not None:
            out64 = out64 + t.double()
            lowp = lowp + t
    return out64, lowp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("parts", ["norm+bias", "residual", "all", "none"])
def test_matches_reference(device, dtype, shape, parts):
    M, K, N = shape
    a, w, bias, res, nw, nb = _inputs(M, K, N, device, dtype)
    bias = bias if parts in ("norm+bias", "all") else None
    res = res if parts in ("residual", "all") else None
    nw, nb = (nw, nb) if parts in ("norm+bias", "all") else (None, None)
    with torch.no_grad():
        out = skinny_linear(a, w, bias, res, norm_weight=nw, norm_bias=nb, eps=1e-6)
    ref64, lowp = _reference(a, w, bias, res, nw, nb, 1e-6, dtype)
    check_close(f"skinny_linear {parts}", out, ref64, lowp, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_inputs(device, dtype):
    """a a column slice, w a column slice of a wider matrix (a row stride past N), residual a slice,
    and a transposed weight (no unit column stride: copied)."""
    M, K, N = 4, 96, 128
    big_a = torch.randn(M, K + 13, device=device, dtype=dtype)
    big_w = (torch.randn(K, N + 64, device=device) / K ** 0.5).to(dtype)
    big_r = torch.randn(M, 2 * N, device=device, dtype=dtype)
    a, w, r = big_a[:, 5:5 + K], big_w[:, 64:], big_r[:, ::2]
    with torch.no_grad():
        out = skinny_linear(a, w, None, r)
        out_t = skinny_linear(a, w.t().contiguous().t(), None, r)
    ref64, lowp = _reference(a.contiguous(), w.contiguous(), None, r.contiguous(), None, None, 0, dtype)
    check_close("strided", out, ref64, lowp, dtype)
    check_close("transposed weight", out_t, ref64, lowp, dtype)


def test_zero_rows_and_columns(device):
    w = torch.randn(16, 32, device=device)
    assert skinny_linear(torch.randn(0, 16, device=device), w).shape == (0, 32)
    assert skinny_linear(torch.randn(3, 16, device=device), w[:, :0]).shape == (3, 0)
    z = skinny_linear(torch.randn(2, 0, device=device), torch.randn(0, 8, device=device),
                      torch.ones(8, device=device))
    assert torch.equal(z, torch.ones(2, 8, device=device))


def test_bad_inputs(device):
    a, w = torch.randn(2, 16, device=device), torch.randn(16, 32, device=device)
    with pytest.raises(ValueError, match="a must have at most 8 rows"):
        skinny_linear(torch.randn(9, 16, device=device), w)
    with pytest.raises(ValueError, match="weight must be"):
        skinny_linear(a, torch.randn(15, 32, device=device))
    with pytest.raises(TypeError, match="weight must have a's dtype"):
        skinny_linear(a, w.double())
    with pytest.raises(ValueError, match="bias must have shape"):
        skinny_linear(a, w, torch.randn(31, device=device))
    with pytest.raises(ValueError, match="residual must have shape"):
        skinny_linear(a, w, None, torch.randn(2, 31, device=device))
    with pytest.raises(ValueError, match="norm_bias needs norm_weight"):
        skinny_linear(a, w, norm_bias=torch.randn(16, device=device))
    with pytest.raises(ValueError, match="eps must be"):
        skinny_linear(a, w, norm_weight=torch.ones(16, device=device), eps=0.0)
    with pytest.raises(ValueError, match="inference only"):
        skinny_linear(a.requires_grad_(), w)


def test_opcheck(device):
    a, w, bias, res, nw, nb = _inputs(3, 40, 64, device, torch.float32)
    torch.library.opcheck(torch.ops.torchfuse.skinny_linear.default, (a, w, bias, res, nw, nb, 1e-5),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_replay():
    a, w, bias, res, nw, nb = _inputs(2, 1024, 4096, "cuda", torch.bfloat16)
    with torch.no_grad():
        eager = skinny_linear(a, w, bias, res, norm_weight=nw, norm_bias=nb)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            skinny_linear(a, w, bias, res, norm_weight=nw, norm_bias=nb)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = skinny_linear(a, w, bias, res, norm_weight=nw, norm_bias=nb)
        a.copy_(torch.randn_like(a))
        g.replay()
        torch.cuda.synchronize()
        again = skinny_linear(a, w, bias, res, norm_weight=nw, norm_bias=nb)
    assert not torch.equal(out, eager)
    assert torch.equal(out, again)  # deterministic: fixed summation order, same result every call


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the few-row routing is CUDA's")
@pytest.mark.parametrize("L", [1, 5, 8])
def test_serving_ops_route_few_rows(L):
    """hstu_preprocess and hstu_compute_output without autograd take the skinny kernel for a few rows on
    CUDA (the output section with y built in its prologue), with the same results as their many-row path."""
    torch.manual_seed(L)
    dt, E, H, D = torch.bfloat16, 256, 2, 64
    x = torch.randn(L + 40, E, device="cuda", dtype=dt)
    nw, nb = 1 + 0.1 * torch.randn(E, device="cuda", dtype=dt), 0.1 * torch.randn(E, device="cuda", dtype=dt)
    W = (torch.randn(E, 4 * H * D, device="cuda") / E ** 0.5).to(dt)
    b = 0.1 * torch.randn(4 * H * D, device="cuda", dtype=dt)
    with torch.no_grad(), torchfuse.stats() as calls:
        few = torchfuse.hstu_preprocess(x[:L], nw, nb, 1e-6, W, b, H, D, D)
    assert calls.get("skinny_linear") == 1
    with torch.no_grad(), torchfuse.stats() as calls:
        many = torchfuse.hstu_preprocess(x, nw, nb, 1e-6, W, b, H, D, D)
    assert "skinny_linear" not in calls
    with torch.no_grad():
        for f, m in zip(few, many):
            torch.testing.assert_close(f, m[:L], rtol=2e-2, atol=2e-2)
        u, attn = few[0], torch.randn(L, H * D, device="cuda", dtype=dt)
        Wo = (torch.randn(3 * H * D, E, device="cuda") / (3 * H * D) ** 0.5).to(dt)
        onw, onb = torch.ones(H * D, device="cuda", dtype=dt), torch.zeros(H * D, device="cuda", dtype=dt)
        kw = dict(num_heads=H, linear_dim=D, dropout_ratio=0.0, training=False, concat_u=True, concat_x=True,
                  mul_u_activation_type="silu", group_norm=False)
        with torchfuse.stats() as calls:
            out_few = torchfuse.hstu_compute_output(attn, u, x[:L], onw, onb, 1e-6, Wo, **kw)
        assert calls.get("hstu_output_skinny") == 1 and "skinny_linear" not in calls
        pad = lambda t: torch.cat([t, torch.zeros(40, t.shape[1], device="cuda", dtype=dt)])
        out_many = torchfuse.hstu_compute_output(pad(attn), pad(u), x, onw, onb, 1e-6, Wo, **kw)
    torch.testing.assert_close(out_few, out_many[:L], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_far_from_zero(device, dtype):
    """Rows whose mean is a thousand standard deviations from zero: the variance must not cancel."""
    M, K, N = 3, 512, 64
    a = (1000 + torch.randn(M, K, device=device)).to(dtype)
    w = (torch.randn(K, N, device=device) / K ** 0.5).to(dtype)
    nw, nb = torch.ones(K, device=device, dtype=dtype), torch.zeros(K, device=device, dtype=dtype)
    with torch.no_grad():
        out = skinny_linear(a, w, norm_weight=nw, norm_bias=nb, eps=1e-6)
    ref64, lowp = _reference(a, w, None, None, nw, nb, 1e-6, dtype)
    check_close("far from zero", out, ref64, lowp, dtype)
