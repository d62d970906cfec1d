"""torchfuse.hstu_compute_output against torchfuse.reference (generative-recommenders' semantics) and,
when a local copy is found, GR's own pytorch_hstu_compute_output.

Forward and every gradient are compared with the float64 reference; the allowed error is a multiple
of the same computation's error in the input dtype (the reference run in that dtype) plus one ulp of
the reference's magnitude. With dropout the reference applies the mask the op draws for that seed
(torchfuse.hstu_output._dropout_mask), so forward and backward are checked with the mask fixed.
"""
import importlib.util
import itertools
import os

import numpy as np
import pytest
import torch

import torchfuse
from torchfuse import reference
from torchfuse.hstu_output import _dropout_mask
from _helpers import check_close as check_close_lowp
from test_hstu_dropout import philox4x32_10

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CONCATS = {"y": (False, False), "uy": (True, False), "xy": (False, True), "uxy": (True, True)}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cuda_only(device):
    if device != "cuda":
        pytest.skip("CUDA only")


def _parts(group_norm, concat_u, concat_x):
    if group_norm:
        return 3 if concat_u and concat_x else 1
    return 1 + concat_u + concat_x


def make(L, H, D, E, dtype, device, group_norm, concat_u, concat_x, requires_grad=True, wdtype=None, shift=0.0):
    n = H * D
    k = n * _parts(group_norm, concat_u, concat_x)
    wn = H if group_norm else n
    t = {
        "attn": torch.randn(L, n) * 2 + 0.5 + shift,
        "u": torch.randn(L, n),
        "x": torch.randn(L, E),
        "norm_weight": torch.randn(wn) * 0.5 + 1,
        "norm_bias": torch.randn(wn) * 0.1,
        "output_weight": torch.randn(k, E) / k ** 0.5,
    }
    dt = {name: wdtype or dtype if name.startswith("norm_") else dtype for name in t}
    return {name: v.to(device, dt[name]).requires_grad_(requires_grad) for name, v in t.items()}


def call(fn, t, eps, **kw):
    return fn(t["attn"], t["u"], t["x"], t["norm_weight"], t["norm_bias"], eps, t["output_weight"], **kw)


def check_close(name, got, ref64, lowp, factor, terms=1, ulps=1):
    """terms: the number of fp32 products summed into each element (out sums the concatenation's
    width of them, a norm weight's gradient rows x columns-per-weight, whose rounding or cancellation
    PyTorch's differently ordered sum may avoid by luck): the floor allows fp32 rounding growing as
    its square root. ulps: the fp32 ulps one such product may be off by itself."""
    ref64 = ref64.double()
    err = (got.double() - ref64).abs().max().item() if ref64.numel() else 0.0
    err_lp = (lowp.double() - ref64).abs().max().item() if ref64.numel() else 0.0
    big = max(1.0, ref64.abs().max().item() if ref64.numel() else 0.0)
    floor = max(torch.finfo(got.dtype).eps, torch.finfo(torch.float32).eps * ulps * terms ** 0.5) * big
    assert torch.isfinite(got).all(), name
    assert err <= factor * err_lp + floor, f"{name}: error {err:.3g} > {factor} x PyTorch's {err_lp:.3g} + {floor:.3g}"


def run_case(device, dtype, L, H, D, E, *, group_norm, concat, act, silu_u, p, recompute, grad=True, seed=1234,
             wdtype=None, shift=0.0, dout_scale=1.0):
    concat_u, concat_x = CONCATS[concat]
    eps = 1e-5
    kw = dict(num_heads=H, linear_dim=D, dropout_ratio=p, training=True, concat_u=concat_u, concat_x=concat_x,
              mul_u_activation_type=act, group_norm=group_norm, silu_u=silu_u)
    ours = make(L, H, D, E, dtype, device, group_norm, concat_u, concat_x, requires_grad=grad, wdtype=wdtype,
                shift=shift)
    lowp = {k: v.detach().clone().requires_grad_(grad) for k, v in ours.items()}
    ref = {k: v.detach().double().requires_grad_(grad) for k, v in ours.items()}
    mask = _dropout_mask(L, H * D, _parts(group_norm, concat_u, concat_x), p, seed=seed, device=device) if p else None
    out = call(torchfuse.hstu_compute_output, ours, eps, recompute_y_in_backward=recompute, seed=seed, **kw)
    out_lp = call(reference.hstu_compute_output, lowp, eps, dropout_mask=mask, **kw)
    out_ref = call(reference.hstu_compute_output, ref, eps, dropout_mask=mask, **kw)
    assert out.dtype == dtype and out.shape == (L, E)
    what = f"{dtype} L={L} H={H} D={D} gn={group_norm} {concat} {act} silu_u={silu_u} p={p} shift={shift}"
    # out sums the concatenation's k products per element: with one row, PyTorch's own sum can land
    # within an ulp of the float64 value by luck (seed 1715464834: 1.2e-7 against ours 4.2e-7)
    k = H * D * _parts(group_norm, concat_u, concat_x)
    check_close(f"out ({what})", out, out_ref, out_lp, 2.0, terms=k)
    if not grad:
        return
    dout = torch.randn_like(out_ref) * dout_scale
    names = list(ours)
    g = torch.autograd.grad(out, [ours[k] for k in names], dout.to(dtype))
    g_lp = torch.autograd.grad(out_lp, [lowp[k] for k in names], dout.to(dtype))
    g_ref = torch.autograd.grad(out_ref, [ref[k] for k in names], dout)
    # a norm parameter's gradient sums dn * xhat over its rows: xhat = (a - mean) * rstd carries the
    # rounding of the row's mean relative to a - mean, a few ulps where a lies near the mean, and with
    # one row PyTorch's own value can land within an ulp by luck (seed 410339896, L = 1: 2.3e-7, 4 ulps
    # of 0.75, against PyTorch's 4.3e-9)
    per_weight = L * (D if group_norm else 1)
    for name, a, b, c in zip(names, g, g_lp, g_ref):
        assert a.dtype == ours[name].dtype and a.shape == ours[name].shape, name
        norm = name.startswith("norm_")
        check_close(f"d{name} ({what})", a, c, b, 4.0, terms=per_weight if norm else 1, ulps=4 if norm else 1)


# ---------------------------------------------------------------- every option combination


@pytest.mark.parametrize("recompute", [False, True], ids=["save_y", "recompute_y"])
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["p0", "p0.3"])
@pytest.mark.parametrize("silu_u", [False, True], ids=["u", "silu_u"])
@pytest.mark.parametrize("act", ["none", "silu", "sigmoid"])
@pytest.mark.parametrize("concat", list(CONCATS))
@pytest.mark.parametrize("group_norm", [False, True], ids=["ln", "gn"])
def test_options_fp32(device, group_norm, concat, act, silu_u, p, recompute):
    run_case(device, torch.float32, 37, 3, 7, 11, group_norm=group_norm, concat=concat, act=act, silu_u=silu_u,
             p=p, recompute=recompute)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("p", [0.0, 0.2], ids=["p0", "p0.2"])
@pytest.mark.parametrize("concat", list(CONCATS))
@pytest.mark.parametrize("group_norm", [False, True], ids=["ln", "gn"])
def test_options_low_precision(device, dtype, group_norm, concat, p):
    run_case(device, dtype, 45, 4, 8, 24, group_norm=group_norm, concat=concat, act="silu", silu_u=True, p=p,
             recompute=p > 0)


# Widths that take each CUDA path. LayerNorm rows kernels: 1, 2, 16, 64 (two warps per row, two rows a
# block) and 128 threads per row at one chunk each, two chunks each (1200 and 1500 columns); the forward
# staged through shared memory where the width is a multiple of 8 (8, 16, 1024, 1200), direct loads
# otherwise; the warp kernels past 2048 columns. Odd widths (no 16-byte vectors); GroupNorm heads of 1,
# 25, 256, 500, 600 and 700 columns in the warp kernels. (A GroupNorm head of one column normalises to
# exactly 0 and is left out: its attn gradient is rounding noise.)
WIDTHS = [(gn, H, D) for gn in (False, True)
          for H, D in [(1, 8), (2, 150), (4, 256), (2, 600), (3, 500), (3, 700), (5, 25), (16, 1), (1, 1)]
          if not (gn and D == 1)]


@pytest.mark.parametrize("group_norm,H,D", WIDTHS, ids=[f"{'gn' if g else 'ln'}-{h}x{d}" for g, h, d in WIDTHS])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_widths(device, dtype, group_norm, H, D):
    run_case(device, dtype, 19, H, D, 16, group_norm=group_norm, concat="uxy", act="silu", silu_u=False, p=0.1,
             recompute=False)


def _y_again_equals_forward(device, dtype, L, H, D, group_norm, concat, act, p, seed):
    concat_u, concat_x = CONCATS[concat]
    t = make(L, H, D, 8, dtype, device, group_norm, concat_u, concat_x, requires_grad=False)
    acts = {"none": 0, "silu": 1, "sigmoid": 2}
    opts = (H if group_norm else 0, acts[act], 1 if act != "none" else 0, concat_u, concat_x, p)
    y, mean, rstd, rng = torch.ops.torchfuse.hstu_output_fwd(t["attn"], t["u"], t["norm_weight"], t["norm_bias"],
                                                             1e-5, *opts, seed, None)
    dy = torch.randn_like(y)
    args = (dy, t["attn"], t["u"], t["norm_weight"], t["norm_bias"], mean, rstd, rng, *opts, True)
    plain = torch.ops.torchfuse.hstu_output_bwd(*args)
    again = torch.ops.torchfuse.hstu_output_bwd(*args, True)
    what = (dtype, L, H, D, group_norm, concat, act, p)
    assert plain[4].numel() == 0, what
    assert again[4].shape == y.shape and again[4].dtype == y.dtype, what
    assert torch.equal(again[4], y), what  # the forward's y, bit for bit, mask included
    for a, b in zip(plain[:4], again[:4]):
        assert torch.equal(a, b), what  # and the gradients unchanged by writing it


@pytest.mark.parametrize("group_norm,H,D", WIDTHS, ids=[f"{'gn' if g else 'ln'}-{h}x{d}" for g, h, d in WIDTHS])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_backward_writes_the_forward_y(device, dtype, group_norm, H, D):
    """recompute_y_in_backward: the backward op writes y again as it reads attn and u (every kernel path:
    the widths above), equal to the forward's bit for bit, with its gradients unchanged."""
    for concat, act, p in [("uxy", "silu", 0.3), ("xy", "sigmoid", 0.0), ("uy", "none", 0.5), ("y", "silu", 0.2)]:
        if group_norm and concat in ("uy", "xy"):
            continue  # GroupNorm concatenates all three parts or none
        _y_again_equals_forward(device, dtype, 19, H, D, group_norm, concat, act, p, 1234 + H * D)


@pytest.mark.parametrize("L,H,D", [(0, 2, 8), (1, 2, 8), (20000, 4, 64), (6000, 4, 256), (20000, 5, 25)],
                         ids=["0", "1", "256", "1024", "125"])
@pytest.mark.parametrize("concat,p", [("uxy", 0.1), ("uxy", 0.0), ("y", 0.0)])
def test_backward_writes_the_forward_y_many_rows(device, L, H, D, concat, p):
    _y_again_equals_forward(device, torch.bfloat16, L, H, D, False, concat, "silu", p, 7)


@pytest.mark.parametrize("group_norm", [False, True], ids=["ln", "gn"])
def test_fp32_norm_params_with_bf16_activations(device, group_norm):
    run_case(device, torch.bfloat16, 33, 2, 12, 16, group_norm=group_norm, concat="uxy", act="silu", silu_u=False,
             p=0.2, recompute=False, wdtype=torch.float32)


@pytest.mark.parametrize("L", [0, 1, 2])
@pytest.mark.parametrize("group_norm", [False, True], ids=["ln", "gn"])
def test_few_rows(device, L, group_norm):
    run_case(device, torch.float32, L, 2, 5, 6, group_norm=group_norm, concat="uxy", act="silu", silu_u=True,
             p=0.25, recompute=True)


# More rows than an H100's resident blocks hold at once, so every block of the persistent grids takes
# several rows (the staged kernels' rings of prefetched rows wrapping around included): 256 and 1024
# columns (staged; 1024: one row per block at a time) and 125 (direct loads).
@pytest.mark.parametrize("L,H,D", [(20000, 4, 64), (6000, 4, 256), (20000, 5, 25)], ids=["256", "1024", "125"])
def test_many_rows(device, L, H, D):
    run_case(device, torch.bfloat16, L, H, D, 32, group_norm=False, concat="uxy", act="none", silu_u=False,
             p=0.1, recompute=False)


# GR's configuration on CUDA's kernels specialised by dtype, concatenation and dropout (16-bit attn, u,
# y and norm parameters of one dtype, LayerNorm rows of a multiple of 8 columns up to 1024, SiLU): more
# rows than the resident blocks, 1, 15, 75 and 128 chunks a row (past 64 chunks a warp per row, the
# lanes' last chunks partly past the row at 75), rows centred at 0 and at 300 (the forward's statistics
# are summed about the row's first element; a plain sum of squares would cancel); the backward writing y
# again without dropout, and not with it.
@pytest.mark.parametrize("shift", [0.0, 300.0], ids=["centred", "mean300"])
@pytest.mark.parametrize("H,D", [(4, 256), (3, 200), (3, 40), (1, 8)], ids=["1024", "600", "120", "8"])
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("concat", ["uxy", "y"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gr_configuration_many_rows(device, dtype, concat, p, H, D, shift):
    # rows centred at 300 put attn's part of [u, attn, y] at ~330 after dropout's scaling: the output
    # weight's gradient then sums 3001 products of ~330 with dout, ~17000 at one sigma, and at unit dout
    # its largest elements would pass fp16's 65504 (about 1 draw in 40); dout at 1/16 keeps them in range
    run_case(device, dtype, 3001, H, D, 16, group_norm=False, concat=concat, act="silu", silu_u=True, p=p,
             recompute=p == 0, seed=int(torch.randint(1 << 30, ())), shift=shift,
             dout_scale=1 / 16 if shift else 1.0)


def test_inference_and_eval(device):
    """No grad: the op and addmm alone; training=False: no dropout (and no generator draw)."""
    t = make(20, 2, 8, 12, torch.float32, device, False, True, True, requires_grad=False)
    kw = dict(num_heads=2, linear_dim=8, dropout_ratio=0.5, training=False, concat_u=True, concat_x=True,
              mul_u_activation_type="silu", group_norm=False)
    state = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
    out = call(torchfuse.hstu_compute_output, t, 1e-6, **kw)
    after = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
    assert torch.equal(state, after)
    ref = call(reference.hstu_compute_output, {k: v.double() for k, v in t.items()}, 1e-6, **kw)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_non_contiguous_inputs(device):
    t = make(30, 2, 8, 12, torch.float32, device, False, True, True, requires_grad=False)
    kw = dict(num_heads=2, linear_dim=8, dropout_ratio=0.2, training=True, concat_u=True, concat_x=True,
              mul_u_activation_type="silu", group_norm=False, seed=7)
    strided = dict(t)
    strided["attn"] = torch.stack([t["attn"], t["attn"]], 2)[:, :, 0]  # column stride 2
    assert strided["attn"].stride() == (32, 2) and torch.equal(strided["attn"], t["attn"])
    strided["u"] = t["u"].t().contiguous().t()  # column-major
    out = call(torchfuse.hstu_compute_output, t, 1e-5, **kw)
    torch.testing.assert_close(call(torchfuse.hstu_compute_output, strided, 1e-5, **kw), out, rtol=0, atol=0)


@pytest.mark.parametrize("concat", ["uxy", "y"])
def test_row_strided_16bit_inputs(device, concat):
    """attn and u column slices of wider bf16 tensors whose rows stay 16-byte aligned (the CUDA typed
    kernels read them in place): the same output and gradients, bit for bit, as from contiguous copies."""
    L, H, D = 700, 2, 64
    n = H * D
    t = make(L, H, D, 24, torch.bfloat16, device, False, concat == "uxy", concat == "uxy", requires_grad=False)
    kw = dict(num_heads=H, linear_dim=D, dropout_ratio=0.1, training=True, concat_u=concat == "uxy",
              concat_x=concat == "uxy", mul_u_activation_type="silu", silu_u=True, group_norm=False, seed=11)
    wide = torch.randn(L, 3 * n + 16, device=device, dtype=torch.bfloat16)
    wide[:, 8:8 + n] = t["attn"]
    wide[:, 16 + 2 * n:16 + 3 * n] = t["u"]
    strided = dict(t, attn=wide[:, 8:8 + n], u=wide[:, 16 + 2 * n:16 + 3 * n])
    assert strided["attn"].stride() == (3 * n + 16, 1) and strided["attn"].data_ptr() % 16 == 0
    grads = []
    for inputs in (t, strided):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
        if inputs is strided:  # keep the slices as views of one wide leaf
            w = wide.clone().requires_grad_(True)
            leaves["attn"], leaves["u"] = w[:, 8:8 + n], w[:, 16 + 2 * n:16 + 3 * n]
        out = call(torchfuse.hstu_compute_output, leaves, 1e-5, **kw)
        dout = torch.randn_like(out) if not grads else grads[0][0]
        ga = torch.autograd.grad(out, [leaves[k] for k in ("attn", "u", "norm_weight", "norm_bias")], dout)
        grads.append((dout, out, *ga))
    for name, a, b in zip(("out", "d attn", "d u", "d weight", "d bias"), grads[0][1:], grads[1][1:]):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------- dropout


def test_keep_rate_and_scale(device):
    p, L, n = 0.3, 512, 64
    mask = _dropout_mask(L, n, 3, p, seed=99, device=device)
    N = mask.numel()
    rate = mask.double().mean().item()
    sigma = (p * (1 - p) / N) ** 0.5
    assert abs(rate - (1 - p)) < 6 * sigma, (rate, 1 - p)
    # no structure along rows or columns: each column's and each row-block's keep rate is plausible
    cols = mask.double().mean(0)
    assert (cols - (1 - p)).abs().max().item() < 6 * (p * (1 - p) / L) ** 0.5
    # kept elements are scaled by 1 / (1 - p) exactly (fp32)
    y = torch.ops.torchfuse.hstu_output_fwd(torch.ones(L, n, device=device), torch.ones(L, n, device=device),
                                            torch.zeros(n, device=device), torch.ones(n, device=device), 1e-5, 0, 0,
                                            0, True, True, p, 99, None)[0]
    assert torch.equal(y[mask], torch.full_like(y[mask], 1 / (1 - p)))


def test_mask_against_philox_oracle(device):
    """Element e = row * (parts * n) + col is kept when its 16 bits (half e % 2 of word e / 2 % 4 of Philox
    block e / 8, the NumPy oracle of test_hstu_dropout) are >= ceil(p * 65536); widths that are not a
    multiple of 8 put chunks across two blocks."""
    for L, n, parts, p, seed in [(9, 24, 3, 0.3, 4242), (5, 21, 2, 0.1, 2**62 + 3), (3, 1000, 3, 0.5, 0)]:
        got = _dropout_mask(L, n, parts, p, seed=seed, device=device).cpu()
        e = np.arange(L * parts * n, dtype=np.uint64)
        words = np.stack(philox4x32_10(seed, 0, e >> np.uint64(3)), 0)
        w = np.take_along_axis(words, ((e >> np.uint64(1)) & np.uint64(3)).astype(np.int64)[None], 0)[0]
        half = (w >> (np.uint64(16) * (e & np.uint64(1)))) & np.uint64(0xFFFF)
        want = half >= np.uint64(np.ceil(np.float32(p) * np.float32(65536)))
        assert torch.equal(got.reshape(-1), torch.from_numpy(want)), (L, n, parts, p, seed)


def test_determinism_per_seed(device):
    t = make(50, 2, 16, 8, torch.bfloat16, device, False, True, True, requires_grad=False)
    kw = dict(num_heads=2, linear_dim=16, dropout_ratio=0.4, training=True, concat_u=True, concat_x=True,
              mul_u_activation_type="silu", group_norm=False)
    a = call(torchfuse.hstu_compute_output, t, 1e-5, seed=5, **kw)
    b = call(torchfuse.hstu_compute_output, t, 1e-5, seed=5, **kw)
    c = call(torchfuse.hstu_compute_output, t, 1e-5, seed=6, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    m5, m6 = (_dropout_mask(50, 32, 3, 0.4, seed=s, device=device) for s in (5, 6))
    assert (m5 != m6).double().mean().item() > 0.3  # independent masks differ in 2 p (1 - p) = 48% of places
    # seed=None draws from torch's generator: fresh masks per call, reproduced by torch.manual_seed
    torch.manual_seed(3)
    d = call(torchfuse.hstu_compute_output, t, 1e-5, **kw)
    e = call(torchfuse.hstu_compute_output, t, 1e-5, **kw)
    torch.manual_seed(3)
    f = call(torchfuse.hstu_compute_output, t, 1e-5, **kw)
    assert not torch.equal(d, e)
    assert torch.equal(d, f)


@pytest.mark.parametrize("recompute", [False, True], ids=["save_y", "recompute_y"])
def test_generator_mask_same_in_backward(device, recompute):
    """seed=None: the backward regenerates the forward's mask. With output_weight = I the forward's y
    is out - x, and with norm_weight = 0 the gradient of attn is exactly dout's attn part x mask / (1 - p);
    output_weight's gradient is y^T dout with y saved or recomputed."""
    L, n, p = 64, 24, 0.5
    attn = (torch.rand(L, n, device=device) + 0.5).requires_grad_()
    u = torch.randn(L, n, device=device)
    x = torch.randn(L, 2 * n, device=device)
    w, b = torch.zeros(n, device=device), torch.randn(n, device=device)
    W = torch.eye(2 * n, device=device).requires_grad_()
    out = torchfuse.hstu_compute_output(attn, u, x, w, b, 1e-5, W, num_heads=1, linear_dim=n, dropout_ratio=p,
                                        training=True, concat_u=False, concat_x=True, mul_u_activation_type="none",
                                        group_norm=False, recompute_y_in_backward=recompute)
    y = (out - x).detach()
    kept = y[:, :n] != 0
    assert 0 < kept.double().mean().item() < 1
    dout = torch.randn_like(out)
    da, dW = torch.autograd.grad(out, [attn, W], dout)
    torch.testing.assert_close(da, dout[:, :n] * kept / (1 - p), rtol=1e-6, atol=0)
    torch.testing.assert_close(dW, y.t() @ dout, rtol=1e-5, atol=1e-5)


def test_cpu_and_cuda_masks_equal(device):
    _cuda_only(device)
    for L, n, parts, p in [(33, 21, 3, 0.3), (7, 1000, 2, 0.1), (1, 3, 1, 0.9)]:
        for seed in (0, 12345, 2**62 + 3):
            a = _dropout_mask(L, n, parts, p, seed=seed, device="cpu")
            b = _dropout_mask(L, n, parts, p, seed=seed, device="cuda")
            assert torch.equal(a, b.cpu()), (L, n, parts, p, seed)
    t = make(40, 4, 25, 16, torch.float32, "cpu", True, True, True, requires_grad=False)
    kw = dict(num_heads=4, linear_dim=25, dropout_ratio=0.2, training=True, concat_u=True, concat_x=True,
              mul_u_activation_type="none", group_norm=True, seed=77)
    got = call(torchfuse.hstu_compute_output, {k: v.cuda() for k, v in t.items()}, 1e-5, **kw)
    torch.testing.assert_close(got.cpu(), call(torchfuse.hstu_compute_output, t, 1e-5, **kw), rtol=1e-5, atol=1e-5)


def test_cuda_graph_capture_fresh_mask_per_replay(device):
    _cuda_only(device)
    t = make(32, 2, 16, 8, torch.float32, device, False, True, True, requires_grad=False)
    kw = dict(num_heads=2, linear_dim=16, dropout_ratio=0.5, training=True, concat_u=True, concat_x=True,
              mul_u_activation_type="silu", group_norm=False)
    call(torchfuse.hstu_compute_output, t, 1e-5, **kw)  # warm-up outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call(torchfuse.hstu_compute_output, t, 1e-5, **kw)
    g.replay()
    first = out.clone()
    g.replay()
    torch.cuda.synchronize()
    assert not torch.equal(first, out)


# ---------------------------------------------------------------- weight gradients, compile, meta


def test_weight_gradients_deterministic(device):
    t = make(700, 2, 48, 16, torch.bfloat16, device, False, True, True)
    kw = dict(num_heads=2, linear_dim=48, dropout_ratio=0.1, training=True, concat_u=True, concat_x=True,
              mul_u_activation_type="silu", group_norm=False, seed=3)
    out = call(torchfuse.hstu_compute_output, t, 1e-5, **kw)
    dout = torch.randn_like(out)
    g1 = torch.autograd.grad(out, [t["norm_weight"], t["norm_bias"]], dout, retain_graph=True)
    g2 = torch.autograd.grad(out, [t["norm_weight"], t["norm_bias"]], dout)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_meta_tensors():
    t = make(10, 2, 4, 6, torch.bfloat16, "meta", True, True, True, requires_grad=False)
    out = call(torchfuse.hstu_compute_output, t, 1e-5, num_heads=2, linear_dim=4, dropout_ratio=0.1, training=True,
               concat_u=True, concat_x=True, mul_u_activation_type="none", group_norm=True)
    assert out.shape == (10, 6) and out.dtype == torch.bfloat16 and out.device.type == "meta"


def test_opcheck(device):
    t = make(9, 2, 4, 6, torch.float32, device, False, True, False, requires_grad=False)
    fwd_args = (t["attn"], t["u"], t["norm_weight"], t["norm_bias"], 1e-5, 0, 1, 1, True, False, 0.25, 11, None)
    torch.library.opcheck(torch.ops.torchfuse.hstu_output_fwd.default, fwd_args)
    grad_args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in fwd_args)
    torch.library.opcheck(torch.ops.torchfuse.hstu_output_fwd.default, grad_args)
    y, mean, rstd, rng = torch.ops.torchfuse.hstu_output_fwd(*fwd_args)
    bwd_args = (torch.randn_like(y), t["attn"], t["u"], t["norm_weight"], t["norm_bias"], mean, rstd, rng, 0, 1, 1,
                True, False, 0.25, True)
    torch.library.opcheck(torch.ops.torchfuse.hstu_output_bwd.default, bwd_args)
    torch.library.opcheck(torch.ops.torchfuse.hstu_output_bwd.default, bwd_args + (True,))


def test_torch_compile_fullgraph(device):
    t = make(24, 2, 8, 12, torch.float32, device, False, True, True)
    kw = dict(num_heads=2, linear_dim=8, dropout_ratio=0.2, training=True, concat_u=True, concat_x=True,
              mul_u_activation_type="silu", group_norm=False, seed=21)

    def f(attn, u, x, w, b, W):
        return torchfuse.hstu_compute_output(attn, u, x, w, b, 1e-5, W, **kw)

    args = [t[k] for k in ("attn", "u", "x", "norm_weight", "norm_bias", "output_weight")]
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    dout = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(compiled, args, dout), torch.autograd.grad(eager, args, dout)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- GR's own function


def _gr_module():
    """pt_hstu_linear.py from a local copy of generative-recommenders (imports torch only), or None."""
    candidates = [os.environ.get("TORCHFUSE_GR_DIR"), os.path.join(ROOT, "peers", "gr"), "/work/main/peers/gr"]
    for c in candidates:
        path = c and os.path.join(c, "generative_recommenders", "ops", "pytorch", "pt_hstu_linear.py")
        if path and os.path.exists(path):
            spec = importlib.util.spec_from_file_location("gr_pt_hstu_linear", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    return None


GR = _gr_module()
GR_NEW = GR is not None and "concat_u" in GR.pytorch_hstu_compute_output.__code__.co_varnames


def _gr_cases():
    """(group_norm, concat_u, concat_x, act, silu_u) that this copy of GR's function can express: copies
    before concat_u / concat_x / mul_u_activation_type had concat_ux and silu_u for both uses of u."""
    for gn, (cu, cx), act, silu_u in itertools.product([False, True], CONCATS.values(), ["none", "silu", "sigmoid"],
                                                       [False, True]):
        if GR_NEW or (cu == cx and (gn or act == ("silu" if silu_u else "none"))):
            yield gn, cu, cx, act, silu_u


@pytest.mark.skipif(GR is None, reason="no local copy of generative-recommenders (set TORCHFUSE_GR_DIR)")
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["p0", "p0.3"])
@pytest.mark.parametrize("case", list(_gr_cases()) if GR is not None else [None])
def test_against_gr(device, monkeypatch, case, p):
    gn, cu, cx, act, silu_u = case
    H, D, L, E = 3, 8, 29, 10
    t = make(L, H, D, E, torch.float32, device, gn, cu, cx)
    theirs = {k: v.detach().clone().requires_grad_() for k, v in t.items()}
    seed = 31
    mask = _dropout_mask(L, H * D, _parts(gn, cu, cx), p, seed=seed, device=device) if p else None
    # GR's F.dropout, with the mask our op draws for this seed
    monkeypatch.setattr(torch.nn.functional, "dropout",
                        lambda y, p, training: y * mask.to(y.dtype) / (1 - p) if training and p > 0 else y)
    kw = dict(eps=1e-5, dropout_ratio=p, training=True, silu_u=silu_u, group_norm=gn, num_heads=H, linear_dim=D)
    kw.update(dict(concat_u=cu, concat_x=cx, mul_u_activation_type=act) if GR_NEW else dict(concat_ux=cu))
    want = GR.pytorch_hstu_compute_output(theirs["attn"], theirs["u"], theirs["x"], theirs["norm_weight"],
                                          theirs["norm_bias"], theirs["output_weight"], **kw)
    got = call(torchfuse.hstu_compute_output, t, 1e-5, num_heads=H, linear_dim=D, dropout_ratio=p, training=True,
               concat_u=cu, concat_x=cx, mul_u_activation_type=act, group_norm=gn, silu_u=silu_u, seed=seed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(got)
    names = list(t)
    for name, a, b in zip(names, torch.autograd.grad(got, [t[k] for k in names], dout),
                          torch.autograd.grad(want, [theirs[k] for k in names], dout)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_op_autograd_matches_the_function(device):
    """torch.ops.torchfuse.hstu_output_fwd is differentiable by itself, with the same gradients."""
    t = make(21, 3, 5, 7, torch.float32, device, True, True, True)
    args = (t["attn"], t["u"], t["norm_weight"], t["norm_bias"], 1e-5, 3, 1, 1, True, True, 0.3, 9, None)
    y = torch.ops.torchfuse.hstu_output_fwd(*args)[0]
    out = torch.addmm(t["x"], y, t["output_weight"])
    want = call(torchfuse.hstu_compute_output, t, 1e-5, num_heads=3, linear_dim=5, dropout_ratio=0.3, training=True,
                concat_u=True, concat_x=True, mul_u_activation_type="none", group_norm=True, silu_u=True, seed=9)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    dout = torch.randn_like(out)
    leaves = list(t.values())
    for a, b in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- few rows: y built in the skinny kernel
# hstu_compute_output without autograd, at most 8 rows on CUDA, LayerNorm, no dropout: one kernel
# (torch.ops.torchfuse.hstu_output_skinny) instead of the output op's and skinny_linear's. On the CPU the
# op composes those two; it is called directly there (the route is CUDA's).

_ACT_CODES = {"none": 0, "silu": 1, "sigmoid": 2}
FUSED_OPTIONS = list(itertools.product(CONCATS, _ACT_CODES, [False, True]))


def _fused(device, t, eps, concat, act, silu_u):
    """The few-row result: through hstu_compute_output's route on CUDA (checked taken), the op on the CPU."""
    cu, cx = CONCATS[concat]
    L, n = t["attn"].shape
    if device != "cuda":
        return torch.ops.torchfuse.hstu_output_skinny(t["attn"], t["u"], t["x"], t["norm_weight"], t["norm_bias"],
                                                      eps, t["output_weight"], _ACT_CODES[act], int(silu_u), cu, cx)
    with torch.no_grad(), torchfuse.stats() as calls:
        out = call(torchfuse.hstu_compute_output, t, eps, num_heads=1, linear_dim=n, dropout_ratio=0.1,
                   training=False, concat_u=cu, concat_x=cx, mul_u_activation_type=act, group_norm=False,
                   silu_u=silu_u)
    assert calls.get("hstu_output_skinny") == 1 and "skinny_linear" not in calls, calls
    return out


def _check_fused(device, t, eps, concat, act, silu_u, what):
    """Against the two-kernel path's own y (the output op's rows, rounded as it stores them) multiplied
    exactly and by torch.addmm in the dtype, and against the plain-PyTorch formula."""
    cu, cx = CONCATS[concat]
    dtype = t["attn"].dtype
    out = _fused(device, t, eps, concat, act, silu_u)
    assert out.dtype == dtype and out.shape == t["x"].shape, what
    with torch.no_grad():
        y = torch.ops.torchfuse.hstu_output_fwd(t["attn"], t["u"], t["norm_weight"], t["norm_bias"], eps, 0,
                                                _ACT_CODES[act], int(silu_u), cu, cx, 0.0, None, None)[0]
        x, W = t["x"], t["output_weight"]
        ref64 = x.double() + y.double() @ W.double()
        lowp = torch.addmm(x, y, W) if device == "cuda" or dtype == torch.float32 else \
            (x.float() + y.float() @ W.float()).to(dtype)
        check_close_lowp(f"fused vs the output op's y ({what})", out, ref64, lowp, dtype)
        kw = dict(num_heads=1, linear_dim=t["attn"].shape[1], dropout_ratio=0.0, training=False, concat_u=cu,
                  concat_x=cx, mul_u_activation_type=act, group_norm=False, silu_u=silu_u)
        plain = call(reference.hstu_compute_output, {k: v.clone() for k, v in t.items()}, eps, **kw)
        plain64 = call(reference.hstu_compute_output, {k: v.double() for k, v in t.items()}, eps, **kw)
        check_close_lowp(f"fused vs the formula ({what})", out, plain64, plain, dtype)


@pytest.mark.parametrize("concat,act,silu_u", FUSED_OPTIONS, ids=[f"{c}-{a}-{'silu_u' if s else 'u'}"
                                                                  for c, a, s in FUSED_OPTIONS])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_fused_few_rows_options(device, dtype, concat, act, silu_u):
    L = int(torch.randint(1, 9, ()))
    t = make(L, 3, 7, 24, dtype, device, False, *CONCATS[concat], requires_grad=False)  # n = 21: odd K
    _check_fused(device, t, 1e-5, concat, act, silu_u, f"{dtype} L={L} {concat} {act} silu_u={silu_u}")


# 1 to 8 rows (each row tier of the kernel and the partial ones), at widths that split K over a
# cluster with part boundaries inside a block's K-range (n = 1024: NVIDIA's 4 x 256 heads, E = 1024;
# n = 1000), and narrow ones (one block, n < the block's threads).
@pytest.mark.parametrize("L", range(1, 9))
@pytest.mark.parametrize("n,E", [(1024, 1024), (1000, 256), (50, 64)], ids=["1024x1024", "1000x256", "50x64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_fused_few_rows_widths(device, dtype, n, E, L):
    t = make(L, 1, n, E, dtype, device, False, True, True, requires_grad=False)
    _check_fused(device, t, 1e-6, "uxy", "silu", True, f"{dtype} L={L} n={n} E={E}")


@pytest.mark.parametrize("concat", ["uxy", "y"])
def test_fused_few_rows_fp32_norm_params(device, concat):
    t = make(5, 2, 12, 32, torch.bfloat16, device, False, *CONCATS[concat], requires_grad=False,
             wdtype=torch.float32)
    _check_fused(device, t, 1e-5, concat, "sigmoid", False, f"fp32 norm params {concat}")


def test_fused_few_rows_mean_far_from_zero(device):
    """attn rows a thousand standard deviations from zero: the statistics must not cancel."""
    t = make(3, 2, 64, 32, torch.float32, device, False, True, True, requires_grad=False)
    t["attn"] = t["attn"] + 1000
    _check_fused(device, t, 1e-5, "uxy", "silu", True, "mean 1000")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_few_rows_strided(device, dtype):
    """attn and x column slices of wider tensors (row strides past their widths), u column-major (copied),
    the output weight a column slice (row stride past E): the same result as contiguous inputs."""
    L, n, E = 6, 40, 64
    t = make(L, 1, n, E, dtype, device, False, True, True, requires_grad=False)
    s = dict(t)
    s["attn"] = torch.cat([torch.randn(L, 8, device=device, dtype=dtype), t["attn"]], 1)[:, 8:]
    s["x"] = torch.cat([t["x"], torch.randn(L, 16, device=device, dtype=dtype)], 1)[:, :E]
    s["u"] = t["u"].t().contiguous().t()
    s["output_weight"] = torch.cat([torch.randn(3 * n, 64, device=device, dtype=dtype), t["output_weight"]], 1)[:, 64:]
    assert s["attn"].stride(0) == n + 8 and s["x"].stride(0) == E + 16 and s["u"].stride() == (1, L)
    assert s["output_weight"].stride(0) == E + 64
    _check_fused(device, s, 1e-5, "uxy", "silu", False, f"strided {dtype}")
    torch.testing.assert_close(_fused(device, s, 1e-5, "uxy", "silu", False),
                               _fused(device, t, 1e-5, "uxy", "silu", False), rtol=0, atol=0)


def test_fused_few_rows_unaligned_weight(device):
    """E not a multiple of the kernel's 16-byte vectors: the op runs the output op and the linear."""
    t = make(4, 2, 9, 20, torch.bfloat16, device, False, True, False, requires_grad=False)
    _check_fused(device, t, 1e-5, "uy", "none", True, "E = 20")


def test_fused_route_falls_back(device):
    """GroupNorm, dropout, more than 8 rows and autograd keep the two-kernel path (or addmm), with the
    formula's results."""
    _cuda_only(device)
    H, D, E = 2, 16, 32
    cases = [  # (rows, group_norm, training, requires_grad, the GEMM's op counted)
        (4, True, False, False, "skinny_linear"), (4, False, True, False, "skinny_linear"),
        (9, False, False, False, None), (4, False, False, True, None),
    ]
    for L, gn, training, grad, gemm in cases:
        t = make(L, H, D, E, torch.bfloat16, device, gn, True, True, requires_grad=grad)
        kw = dict(num_heads=H, linear_dim=D, dropout_ratio=0.2, training=training, concat_u=True, concat_x=True,
                  mul_u_activation_type="silu", group_norm=gn, silu_u=True, seed=5)
        with torch.set_grad_enabled(grad), torchfuse.stats() as calls:
            out = call(torchfuse.hstu_compute_output, t, 1e-5, **kw)
        what = f"L={L} gn={gn} training={training} grad={grad}"
        assert "hstu_output_skinny" not in calls and calls.get("hstu_output_fwd") == 1, (what, calls)
        assert calls.get("skinny_linear") == (1 if gemm else None), (what, calls)
        mask = _dropout_mask(L, H * D, 3, 0.2, seed=5, device=device) if training else None
        kw.pop("seed")
        with torch.no_grad():
            ref = {k: v.detach() for k, v in t.items()}
            lowp = call(reference.hstu_compute_output, ref, 1e-5, dropout_mask=mask, **kw)
            ref64 = call(reference.hstu_compute_output, {k: v.double() for k, v in ref.items()}, 1e-5,
                         dropout_mask=mask, **kw)
        check_close_lowp(f"fallback {what}", out.detach(), ref64, lowp, torch.bfloat16)


def test_fused_op_checks(device):
    t = make(3, 2, 8, 16, torch.float32, device, False, True, True, requires_grad=False)
    args = [t["attn"], t["u"], t["x"], t["norm_weight"], t["norm_bias"], 1e-5, t["output_weight"], 1, 1, True, True]
    op = torch.ops.torchfuse.hstu_output_skinny

    def bad(i, value, err, match):
        a = list(args)
        a[i] = value
        with pytest.raises(err, match=match):
            op(*a)

    bad(0, torch.randn(9, 16, device=device), ValueError, "attn must have at most 8 rows")
    bad(1, torch.randn(3, 15, device=device), ValueError, "u must have attn's shape")
    bad(2, torch.randn(2, 16, device=device), ValueError, "x must be 2-D with attn's 3 rows")
    bad(2, t["x"].double(), TypeError, "x must have attn's dtype")
    bad(3, torch.ones(15, device=device), ValueError, "norm_weight must be 1-D with 16 elements")
    bad(4, torch.zeros(16, device=device, dtype=torch.bfloat16), TypeError, "norm_weight and norm_bias must share")
    bad(5, 0.0, ValueError, "eps must be")
    bad(6, torch.randn(32, 16, device=device), ValueError, r"output_weight must be \(48, 16\)")
    bad(6, t["output_weight"].half(), TypeError, "output_weight must have attn's dtype")
    bad(7, 3, ValueError, "mul_u_activation_type code")
    bad(8, 2, ValueError, "concatenated u's activation")
    torch.library.opcheck(op.default, tuple(args), test_utils=("test_schema", "test_faketensor"))
    assert op(*[a[:0] if isinstance(a, torch.Tensor) and a.dim() == 2 and i < 3 else a
                for i, a in enumerate(args)]).shape == (0, 16)


def test_fused_few_rows_cuda_graph(device):
    """Captured once, replayed on new inputs: the replay computes what an eager call computes."""
    _cuda_only(device)
    t = make(2, 4, 256, 1024, torch.bfloat16, device, False, True, True, requires_grad=False)
    f = lambda: _fused(device, t, 1e-6, "uxy", "silu", True)  # noqa: E731
    f()  # warm-up outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = call(torchfuse.hstu_compute_output, t, 1e-6, num_heads=4, linear_dim=256, dropout_ratio=0.0,
                   training=False, concat_u=True, concat_x=True, mul_u_activation_type="silu", group_norm=False,
                   silu_u=True)
    for k in ("attn", "u", "x"):
        t[k].copy_(torch.randn_like(t[k]))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, f())
