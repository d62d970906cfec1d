"""torchfuse.layer_norm / rms_norm against plain PyTorch.

Each result is compared with a float64 reference; the allowed error is twice the error of the same
computation done by PyTorch in the input dtypes, plus a small per-dtype atol (scaled by the size of
the reference). s = x + residual (+ residual2) must be bit-identical to PyTorch's own add.
"""
import pytest
import torch
import torch.nn.functional as F

import _helpers
import torchfuse

KINDS = ["layer", "llama", "gemma"]


def _cuda_only(device):
    if device != "cuda":
        pytest.skip("CUDA only")


# ---------------------------------------------------------------- references


def sum_pytorch(x, residual, residual2, residual_dtype):
    if residual is None:
        return x
    s = x + residual
    if residual2 is not None:
        s = s + residual2
    return s.to(residual_dtype or residual.dtype)


def norm_lowp(kind, s, w, b, eps, out_dtype, offset=0.0):
    """What PyTorch / HF compute in the tensors' own dtypes."""
    n = s.shape[-1]
    if kind == "layer":
        wl = w.to(s.dtype) if w is not None else None
        bl = b.to(s.dtype) if b is not None else None
        return F.layer_norm(s, (n,), wl, bl, eps).to(out_dtype)
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "llama":  # HF LlamaRMSNorm
        return ((w + offset) * h.to(s.dtype)).to(out_dtype)
    return (h * (offset + w.float())).to(out_dtype)  # Gemma


def norm_f64(kind, s, w, b, eps, offset=0.0):
    s = s.double()
    if kind == "layer":
        d = s - s.mean(-1, keepdim=True)
        y = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps)
        y = y * w.double() if w is not None else y
        return y + b.double() if b is not None else y
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return y * (w.double() + offset)


def call(kind, x, w, b, eps, offset=0.0, **kw):
    if kind == "layer":
        return torchfuse.layer_norm(x, w, b, eps, **kw)
    if "bias2" in kw:
        kw.pop("bias2")
    return torchfuse.rms_norm(x, w, eps, cast=kind, weight_offset=offset, **kw)


def check_close(name, ours, ref64, lowp, dtype):
    _helpers.check_close(name, ours, ref64, lowp, dtype, scale_floor=1.0)


def make(shape, dtype, device, requires_grad=False, scale=1.0):
    t = (torch.randn(shape, dtype=torch.float32, device=device) * scale + 0.1).to(dtype)
    return t.requires_grad_(requires_grad)


def run_case(kind, device, dtype, rows, hidden, *, res_dtype="same", residual2=False, residual_dtype=None,
             two=False, with_bias=True, offset=0.0, grad=True, eps=1e-5, weight_dtype=None):
    """Forward (and backward) of one configuration against both references."""
    has_res = res_dtype is not None
    rdt = dtype if res_dtype == "same" else res_dtype
    x = make((rows, hidden), dtype, device, grad)
    res = make((rows, hidden), rdt, device, grad, scale=2.0) if has_res else None
    res2 = make((rows, hidden), rdt, device, grad) if residual2 else None
    wdt = weight_dtype or (torch.float32 if dtype == torch.float32 else dtype)
    w = make((hidden,), wdt, device, grad, scale=0.5)
    b = make((hidden,), wdt, device, grad, scale=0.5) if kind == "layer" and with_bias else None
    w2 = make((hidden,), wdt, device, grad, scale=0.5) if two else None
    b2 = make((hidden,), wdt, device, grad, scale=0.5) if two and kind == "layer" and with_bias else None
    inputs = [t for t in (x, res, res2, w, b, w2, b2) if t is not None]

    kw = {}
    if has_res:
        kw["residual"] = res
    if residual2:
        kw["residual2"] = res2
    if residual_dtype is not None:
        kw["residual_dtype"] = residual_dtype
    if two:
        kw["weight2"] = w2
        if b2 is not None:
            kw["bias2"] = b2
    out = call(kind, x, w, b, eps, offset, **kw)
    out = out if isinstance(out, tuple) else (out,)
    y, y2 = out[0], (out[1] if two else None)
    s = out[-1] if has_res else None

    # PyTorch in the input dtypes, and float64
    s_pt = sum_pytorch(x, res, res2, residual_dtype)
    y_pt = norm_lowp(kind, s_pt, w, b, eps, dtype, offset)
    y2_pt = norm_lowp(kind, s_pt, w2, b2, eps, dtype, offset) if two else None
    s64 = x.double() + (res.double() if has_res else 0) + (res2.double() if residual2 else 0)
    y64 = norm_f64(kind, s64, w, b, eps, offset)
    y2_64 = norm_f64(kind, s64, w2, b2, eps, offset) if two else None

    if has_res:
        assert s.dtype == s_pt.dtype and torch.equal(s, s_pt), "s differs from PyTorch's x + residual (+ residual2)"
    check_close("y", y, y64, y_pt, dtype)
    if two:
        check_close("y2", y2, y2_64, y2_pt, dtype)
    if not grad:
        return

    gy = torch.randn_like(y)
    outs, outs_pt, outs64, gouts = [y], [y_pt], [y64], [gy]
    if two:
        outs += [y2]; outs_pt += [y2_pt]; outs64 += [y2_64]; gouts += [torch.randn_like(y2)]
    if has_res:  # s is an output too: its gradient flows back into x and the residuals
        outs += [s]; outs_pt += [s_pt]; outs64 += [s64]; gouts += [torch.randn_like(s)]
    g = torch.autograd.grad(outs, inputs, gouts)
    g_pt = torch.autograd.grad(outs_pt, inputs, gouts)
    g64 = torch.autograd.grad(outs64, inputs, [t.double() for t in gouts])
    names = [n for n, t in zip(("dx", "dres", "dres2", "dw", "db", "dw2", "db2"), (x, res, res2, w, b, w2, b2))
             if t is not None]
    for name, a, r_pt, r64, t in zip(names, g, g_pt, g64, inputs):
        check_close(name, a, r64, r_pt, t.dtype)


# ---------------------------------------------------------------- correctness

HIDDEN_ROWS = [(1, 37), (7, 37), (100, 37), (768, 19), (2560, 5), (4099, 3), (8192, 3), (65536, 2)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hidden,rows", HIDDEN_ROWS, ids=[f"n{h}" for h, _ in HIDDEN_ROWS])
def test_residual_norm_fwd_bwd(device, kind, dtype, hidden, rows):
    run_case(kind, device, dtype, rows, hidden, offset=1.0 if kind == "gemma" else 0.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden", [5, 1000, 3000])
def test_many_rows_gpu_shapes(device, kind, hidden):
    # many rows per launch: exercises the persistent backward grid and its partial sums
    rows = 4099 if device == "cuda" else 301
    run_case(kind, device, torch.bfloat16, rows, hidden)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [0, 1])
def test_zero_and_one_row(device, kind, rows):
    run_case(kind, device, torch.bfloat16, rows, 96)


@pytest.mark.parametrize("kind", KINDS)
def test_no_residual(device, kind):
    run_case(kind, device, torch.bfloat16, 33, 300, res_dtype=None)


ALIGNED_ROWS = [(64, 300), (256, 129), (1024, 2051), (2560, 33), (4096, 9), (8192, 17), (8192, 301)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden,rows", ALIGNED_ROWS, ids=[f"n{h}" for h, _ in ALIGNED_ROWS])
def test_aligned_16bit_rows(device, kind, dtype, residual, hidden, rows):
    # 16-bit rows of a multiple of 8 elements, one dtype throughout: CUDA's compile-time-dtype
    # forward and backward (with the residual, s's own gradient enters the backward), at group sizes
    # below, at and above a warp, a block of 1024 threads, and more rows than resident row slots
    run_case(kind, device, dtype, rows, hidden, res_dtype="same" if residual else None,
             offset=1.0 if kind == "gemma" else 0.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [64, 560, 1024, 2560, 4096])
def test_aligned_row_strides_and_weight_views(device, kind, residual, hidden):
    # 16-bit rows that are aligned column slices of wider tensors give the contiguous result bit for
    # bit (the typed forwards read rows by stride); a weight that is a misaligned view of a longer
    # tensor, or of fp32, is read as it is (another kernel, so compared with the references)
    rows, dtype = 301, torch.bfloat16
    offset = 1.0 if kind == "gemma" else 0.0
    wide_x = make((rows, hidden + 64), dtype, device)
    wide_r = make((rows, hidden + 64), dtype, device, scale=2.0)
    x, r = wide_x[:, 32:32 + hidden], (wide_r[:, 64:] if residual else None)
    w = make((hidden,), dtype, device, scale=0.5)
    b = make((hidden,), dtype, device, scale=0.5) if kind == "layer" else None
    kw = {"residual": r} if residual else {}
    got = call(kind, x, w, b, 1e-5, offset, **kw)
    want = call(kind, x.contiguous(), w, b, 1e-5, offset, **({"residual": r.contiguous()} if residual else {}))
    for a, e in zip(got if residual else (got,), want if residual else (want,)):
        assert torch.equal(a, e)

    s = (x + r) if residual else x
    wbig = make((hidden + 1,), dtype, device, scale=0.5)
    for wv in (wbig[1:], w.float()):
        bv = None if b is None else (b.float() if wv.dtype == torch.float32 else make((hidden + 1,), dtype, device)[1:])
        y = call(kind, x, wv, bv, 1e-5, offset, **kw)
        y = y[0] if residual else y
        ref64 = norm_f64(kind, s.double(), wv, bv, 1e-5, offset)
        lowp = norm_lowp(kind, s, wv.to(dtype) if kind == "layer" else wv, bv, 1e-5, dtype, offset)
        check_close("y", y, ref64, lowp, dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_backward_with_unaligned_gradients(device, kind):
    # aligned 16-bit rows (CUDA's typed forward) whose incoming gradients are views starting 2 bytes into
    # their storage, rows an odd number of elements apart: the backward must not take them for aligned
    rows, n, dtype = 67, 1024, torch.bfloat16
    x = make((rows, n), dtype, device, True)
    r = make((rows, n), dtype, device, True, scale=2.0)
    w = make((n,), dtype, device, True, scale=0.5)
    b = make((n,), dtype, device, True, scale=0.5) if kind == "layer" else None
    inputs = [t for t in (x, r, w, b) if t is not None]
    y, s = call(kind, x, w, b, 1e-5, residual=r)
    gy = torch.randn(rows, n + 3, device=device).to(dtype)[:, 1:n + 1]
    gs = torch.randn(rows, n + 3, device=device).to(dtype)[:, 2:n + 2]
    assert gy.storage_offset() == 1 and gy.stride(0) == n + 3
    got = torch.autograd.grad((y, s), inputs, (gy, gs))
    s_pt = x + r
    y_pt = norm_lowp(kind, s_pt, w, b, 1e-5, dtype)
    s64 = x.double() + r.double()
    y64 = norm_f64(kind, s64, w, b, 1e-5)
    g_pt = torch.autograd.grad((y_pt, s_pt), inputs, (gy, gs))
    g64 = torch.autograd.grad((y64, s64), inputs, (gy.double(), gs.double()))
    for name, a, r_pt, r64, t in zip(("dx", "dres", "dw", "db"), got, g_pt, g64, inputs):
        check_close(name, a, r64, r_pt, t.dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_fp32_weights_of_16bit_rows(device, kind, residual):
    # fp32 parameters with bf16 activations (the llama cast's product is then not rounded to bf16)
    run_case(kind, device, torch.bfloat16, 65, 1024, res_dtype="same" if residual else None,
             weight_dtype=torch.float32, offset=1.0 if kind == "gemma" else 0.0)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [1000, 4096])
def test_layer_norm_mean_far_from_zero(device, residual, hidden):
    # |mean| / std ~ 1000: variance taken as E[s^2] - mean^2 about zero would lose nearly every digit
    # in fp32; the statistics must stay within the usual tolerance
    rows = 37
    x = (torch.randn(rows, hidden, device=device) * 2 + 1000).half()
    r = (torch.randn(rows, hidden, device=device) * 2).half() if residual else None
    w = make((hidden,), torch.float16, device, scale=0.5)
    b = make((hidden,), torch.float16, device, scale=0.5)
    out = torchfuse.layer_norm(x, w, b, 1e-5, residual=r)
    y = out[0] if residual else out
    s = x + r if residual else x
    check_close("y", y, norm_f64("layer", s.double(), w, b, 1e-5), norm_lowp("layer", s, w, b, 1e-5, x.dtype),
                torch.float16)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "x_dtype,res_dtype,residual_dtype",
    [
        (torch.bfloat16, torch.float32, None),  # bf16 branch output + fp32 residual stream (autocast)
        (torch.float16, torch.float32, None),
        (torch.bfloat16, torch.bfloat16, torch.float32),  # residual kept in fp32
        (torch.float32, torch.bfloat16, None),  # x + residual in fp32, s rounded to bf16
        (torch.float16, torch.bfloat16, torch.float16),
    ],
    ids=str,
)
def test_mixed_dtypes(device, kind, x_dtype, res_dtype, residual_dtype):
    run_case(kind, device, x_dtype, 29, 520, res_dtype=res_dtype, residual_dtype=residual_dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_two_residuals_gpt_neox_order(device, kind, dtype):
    run_case(kind, device, dtype, 23, 264, residual2=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden", [264, 2560, 9000])
def test_second_norm_same_pass(device, kind, hidden):
    run_case(kind, device, torch.bfloat16, 11, hidden, residual2=True, two=True)


def test_layer_norm_without_bias_or_affine(device):
    run_case("layer", device, torch.bfloat16, 17, 130, with_bias=False)
    x = make((5, 70), torch.float32, device)
    y = torchfuse.layer_norm(x, None, None, 1e-5)
    torch.testing.assert_close(y, F.layer_norm(x, (70,), eps=1e-5), rtol=1e-5, atol=1e-5)


def test_s_bit_identical_fp16_rounding(device):
    # values whose fp16 sum lands exactly between representable numbers: round-to-nearest-even
    x = torch.tensor([[1.0, 1.0, 2048.0, 3.0, 65504.0, -0.0]], dtype=torch.float16, device=device)
    r = torch.tensor([[2 ** -11, 3 * 2 ** -11, 1.0, 2 ** -10, 16.0, -0.0]], dtype=torch.float16, device=device)
    _, s = torchfuse.rms_norm(x, torch.ones(6, dtype=torch.float16, device=device), residual=r)
    ref = x + r
    assert torch.equal(s, ref) and torch.equal(torch.signbit(s), torch.signbit(ref))
    assert torch.isinf(s[0, 4])


def test_leading_shapes_and_strides(device):
    base = make((4, 6, 300), torch.bfloat16, device)
    w = make((200,), torch.bfloat16, device)
    b = make((200,), torch.bfloat16, device)
    res = make((4, 6, 200), torch.bfloat16, device)
    for x in (base[..., :200], base[..., 100:], base[..., ::1][:, ::2, :200], base.transpose(0, 1)[..., :200]):
        r = res if x.shape == res.shape else make(x.shape, torch.bfloat16, device)
        y, s = torchfuse.layer_norm(x, w, b, residual=r)
        assert torch.equal(s, x + r)
        ref = F.layer_norm((x + r).float(), (200,), w.float(), b.float()).to(torch.bfloat16)
        torch.testing.assert_close(y, ref, rtol=0.02, atol=0.02)
    # a last dimension that is not contiguous: copied, never misread
    xt = make((200, 8), torch.bfloat16, device).t()
    y = torchfuse.layer_norm(xt, w, b)
    torch.testing.assert_close(y, F.layer_norm(xt.float(), (200,), w.float(), b.float()).bfloat16(), rtol=0.02,
                               atol=0.02)
    # expanded (stride-0) rows
    xe = make((1, 200), torch.float32, device).expand(5, 200)
    y = torchfuse.layer_norm(xe, w.float(), b.float())
    torch.testing.assert_close(y, F.layer_norm(xe, (200,), w.float(), b.float()), rtol=1e-5, atol=1e-5)


def test_weight_gradients_deterministic(device):
    x = make((3001, 1024), torch.bfloat16, device, True)
    r = make((3001, 1024), torch.bfloat16, device)
    w = make((1024,), torch.float32, device, True)
    b = make((1024,), torch.float32, device, True)
    gy = torch.randn(3001, 1024, device=device, dtype=torch.bfloat16)
    first = None
    for _ in range(3):
        y, _ = torchfuse.layer_norm(x, w, b, residual=r)
        grads = torch.autograd.grad(y, (x, w, b), gy)
        if first is None:
            first = grads
        else:
            for a, c in zip(first, grads):
                assert torch.equal(a, c)


def test_no_stats_without_grad(device):
    x = make((8, 64), torch.bfloat16, device, True)
    w = make((64,), torch.bfloat16, device)
    with torch.no_grad():
        y = torchfuse.rms_norm(x, w)
    assert not y.requires_grad
    _, _, _, mean, rstd = torch.ops.torchfuse.norm_fwd(x.detach(), None, None, w, None, None, None, 1e-6, 1, 0.0,
                                                        None, False)
    assert mean.numel() == 0 and rstd.numel() == 0


def test_registered_autograd_matches_wrapper(device):
    """The wrappers and norm_fwd called directly train through the op's C++ autograd
    (csrc/norm_autograd.cpp): same outputs and gradients, bitwise."""
    x, r = make((37, 96), torch.float32, device, True), make((37, 96), torch.float32, device, True)
    w, b = make((96,), torch.float32, device, True), make((96,), torch.float32, device, True)
    y, s = torchfuse.layer_norm(x, w, b, residual=r, eps=1e-5)
    assert "torchfuse::NormFunction" in y.grad_fn.name()
    y_op, _, s_op, _, _ = torch.ops.torchfuse.norm_fwd(x, r, None, w, b, None, None, 1e-5, 0, 0.0, None, True)
    assert torch.equal(y, y_op) and torch.equal(s, s_op)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    ins = (x, r, w, b)
    for a, c in zip(torch.autograd.grad((y, s), ins, (dy, ds)), torch.autograd.grad((y_op, s_op), ins, (dy, ds))):
        assert torch.equal(a, c)


def test_inference_op_refuses_grad(device):
    x = make((4, 32), torch.float32, device, True)
    w = torch.ones(32, device=device)
    with pytest.raises(RuntimeError, match="add_norm is inference-only"):
        torch.ops.torchfuse.add_norm(x, None, w, None, 1e-5, 0, 0.0)
    with torch.no_grad():  # the wrappers take the inference op here, and agree with norm_fwd
        y, s = torchfuse.layer_norm(x, w, None, residual=x)
        y2, _, s2, _, _ = torch.ops.torchfuse.norm_fwd(x, x, None, w, None, None, None, 1e-5, 0, 0.0, None, False)
    assert torch.equal(y, y2) and torch.equal(s, s2)


def test_meta_tensors():
    x = torch.empty(3, 5, 64, device="meta", dtype=torch.bfloat16)
    r = torch.empty(3, 5, 64, device="meta", dtype=torch.float32)
    w = torch.empty(64, device="meta", dtype=torch.bfloat16)
    y, s = torchfuse.layer_norm(x, w, w, residual=r)
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and s.dtype == torch.float32 and y.device.type == "meta"


def _opcheck_args(device):
    x = make((6, 40), torch.bfloat16, device, True)
    r = make((6, 40), torch.float32, device, True)
    w = make((40,), torch.float32, device, True)
    b = make((40,), torch.float32, device, True)
    return [
        (x, r, None, w, b, None, None, 1e-5, 0, 0.0, None, True),
        (x, r, r.detach().bfloat16().requires_grad_(), w, b, w, b, 1e-5, 0, 0.0, torch.float32, True),
        (x, None, None, w, None, None, None, 1e-6, 1, 0.0, None, True),
        (x.detach(), r.detach(), None, w.detach(), None, None, None, 1e-6, 2, 1.0, None, False),
    ]


def test_opcheck(device):
    """Schema, fake kernel, autograd registration and dispatch agree (torch.library.opcheck)."""
    for args in _opcheck_args(device):
        torch.library.opcheck(torch.ops.torchfuse.norm_fwd.default, args)
    x, r, w = make((6, 40), torch.bfloat16, device), make((6, 40), torch.bfloat16, device), make((40,), torch.bfloat16, device)
    for args in [(x, r, w, w, 1e-5, 0, 0.0), (x, None, w, None, 1e-6, 1, 0.0), (x, r, w, None, 1e-6, 2, 1.0)]:
        torch.library.opcheck(torch.ops.torchfuse.add_norm.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,cols", [(0, 16), (1, 1), (37, 7), (64, 8), (19, 50), (129, 1024), (5, 4099)])
def test_layer_norm_with_ones(device, dtype, rows, cols):
    """[LN(x), 1, 0...] rows of width round_up(cols + 1, 8): the norm bit-identical to norm_fwd's (same
    kernels, strided rows), then the ones column and zeros; stats only when asked for."""
    x = make((rows, cols), dtype, device) * 3 + 1
    w, b = make((cols,), dtype, device), make((cols,), dtype, device)
    y, _, _, mean, rstd = torch.ops.torchfuse.norm_fwd(x, None, None, w, b, None, None, 1e-6, 0, 0.0, None, True)
    width = (cols + 8) // 8 * 8
    for save_stats in (True, False):
        got, m, r = torch.ops.torchfuse.layer_norm_with_ones(x, w, b, 1e-6, save_stats)
        assert got.shape == (rows, width) and got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got[:, :cols], y)
        assert torch.equal(got[:, cols], torch.ones(rows, dtype=dtype, device=device))
        assert torch.equal(got[:, cols + 1:], torch.zeros(rows, width - cols - 1, dtype=dtype, device=device))
        if save_stats:
            assert torch.equal(m, mean) and torch.equal(r, rstd)
        else:
            assert m.numel() == 0 and r.numel() == 0
    strided = make((rows, cols + 3), dtype, device)[:, 1:cols + 1]
    got = torch.ops.torchfuse.layer_norm_with_ones(strided, w, b, 1e-6, False)[0]
    want = torch.ops.torchfuse.norm_fwd(strided, None, None, w, b, None, None, 1e-6, 0, 0.0, None, False)[0]
    assert torch.equal(got[:, :cols], want)
    torch.library.opcheck(torch.ops.torchfuse.layer_norm_with_ones.default, (x, w, b, 1e-6, True))
    with pytest.raises(RuntimeError, match="layer_norm_with_ones: x must be 2-D"):
        torch.ops.torchfuse.layer_norm_with_ones(x.reshape(-1), w, b, 1e-6, False)
    with pytest.raises(RuntimeError, match="layer_norm_with_ones is not differentiable"):
        torch.ops.torchfuse.layer_norm_with_ones(x, w.detach().requires_grad_(), b, 1e-6, False)
    with torch.no_grad():  # as hstu_preprocess's autograd Function runs it
        got = torch.ops.torchfuse.layer_norm_with_ones(x.detach().requires_grad_(), w, b, 1e-6, False)[0]
    assert torch.equal(got[:, :cols], y)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_compile_fullgraph(device, kind):
    backend = "inductor" if device == "cuda" else "aot_eager"

    def f(x, r, w, b):
        if kind == "layer":
            y, s = torchfuse.layer_norm(x, w, b, residual=r)
        else:
            y, s = torchfuse.rms_norm(x, w, residual=r, cast=kind)
        return (y.float() * 2).sum() + s.float().sum()

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend=backend)
    for rows in (7, 13):  # a second size exercises dynamic shapes through the fake kernel
        x = make((rows, 96), torch.bfloat16, device, True)
        r = make((rows, 96), torch.bfloat16, device, True)
        w = make((96,), torch.bfloat16, device, True)
        b = make((96,), torch.bfloat16, device, True)
        out = cf(x, r, w, b)
        gc = torch.autograd.grad(out, (x, r, w))
        ref = f(x, r, w, b)
        ge = torch.autograd.grad(ref, (x, r, w))
        torch.testing.assert_close(out, ref)
        for a, c in zip(gc, ge):
            torch.testing.assert_close(a, c)


def test_cuda_graph_capture(device):
    _cuda_only(device)
    x = make((64, 2560), torch.float16, device)
    r = make((64, 2560), torch.float16, device)
    w = make((2560,), torch.float16, device)
    b = make((2560,), torch.float16, device)
    y, s = torchfuse.layer_norm(x, w, b, residual=r)  # warm-up outside the graph
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg, sg = torchfuse.layer_norm(x, w, b, residual=r)
    x.copy_(make((64, 2560), torch.float16, device))
    g.replay()
    torch.cuda.synchronize()
    y, s = torchfuse.layer_norm(x, w, b, residual=r)
    assert torch.equal(yg, y) and torch.equal(sg, s)


def test_kernel_shapes_in_any_order(device):
    # one kernel launched with different block and shared-memory sizes, large before small and back:
    # each launch must keep working whatever was launched before it
    for hidden in (8192, 2560, 8192, 264, 4096, 1024):
        run_case("layer", device, torch.bfloat16, 9, hidden, grad=False)
        run_case("llama", device, torch.float32, 5, hidden, grad=False)


def test_other_device_is_refused(device):
    _cuda_only(device)
    x = make((4, 32), torch.float32, "cuda")
    with pytest.raises(RuntimeError, match="weight must be on the same device as x"):
        torchfuse.layer_norm(x, torch.ones(32), None)
    with pytest.raises(RuntimeError, match="residual must be on the same device as x"):
        torchfuse.layer_norm(x, None, None, residual=torch.ones(4, 32))


def test_bad_inputs(device):
    x = make((4, 32), torch.float32, device)
    w = torch.ones(32, device=device)
    with pytest.raises(RuntimeError, match="weight must be 1-D with x.shape\\[-1\\] = 32"):
        torchfuse.layer_norm(x, torch.ones(31, device=device), None)
    with pytest.raises(RuntimeError, match="residual must have the shape of x"):
        torchfuse.layer_norm(x, w, None, residual=torch.ones(4, 31, device=device))
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16, got Double"):
        torchfuse.layer_norm(x.double(), w, None)
    with pytest.raises(TypeError, match="residual must be float32, float16 or bfloat16, got Long"):
        torchfuse.layer_norm(x, w, None, residual=torch.ones(4, 32, dtype=torch.long, device=device))
    with pytest.raises(RuntimeError, match="eps must be a positive finite number"):
        torchfuse.rms_norm(x, w, eps=0.0)
    with pytest.raises(RuntimeError, match="eps must be a positive finite number"):
        torchfuse.layer_norm(x, w, None, eps=-1e-5)
    with pytest.raises(RuntimeError, match="residual2 needs residual"):
        torchfuse.layer_norm(x, w, None, residual2=x)
    with pytest.raises(RuntimeError, match="must share one dtype"):
        torchfuse.layer_norm(x, w, torch.ones(32, device=device, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="non-empty last dimension"):
        torchfuse.layer_norm(torch.ones(4, 0, device=device), None, None)
    with pytest.raises(ValueError, match="cast must be 'llama' or 'gemma'"):
        torchfuse.rms_norm(x, w, cast="t5")


# ---------------------------------------------------------------- modules


def test_layer_norm_module_drop_in(device):
    ref = torch.nn.LayerNorm(300, eps=1e-6, device=device)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    mod = torchfuse.nn.LayerNorm(300, eps=1e-6, device=device)
    mod.load_state_dict(ref.state_dict())
    assert list(mod.state_dict()) == list(ref.state_dict())
    x = make((3, 7, 300), torch.float32, device)
    r = make((3, 7, 300), torch.float32, device)
    torch.testing.assert_close(mod(x), ref(x), rtol=1e-5, atol=1e-5)
    y, s = mod(x, r)
    assert torch.equal(s, x + r)
    torch.testing.assert_close(y, ref(x + r), rtol=1e-5, atol=1e-5)
    # normalized over the last two dims
    ref2 = torch.nn.LayerNorm((7, 30), device=device)
    mod2 = torchfuse.nn.LayerNorm((7, 30), device=device)
    x2 = make((4, 7, 30), torch.float32, device)
    torch.testing.assert_close(mod2(x2), ref2(x2), rtol=1e-5, atol=1e-5)


class LlamaRMSNormRef(torch.nn.Module):
    """HF transformers' LlamaRMSNorm, verbatim."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def test_rms_norm_module_drop_in(device):
    ref = LlamaRMSNormRef(257, eps=1e-5).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.normal_()
    mod = torchfuse.nn.RMSNorm(257, eps=1e-5, device=device, dtype=torch.bfloat16)
    mod.load_state_dict(ref.state_dict())
    assert mod.variance_epsilon == 1e-5
    x = make((9, 257), torch.bfloat16, device)
    r = make((9, 257), torch.bfloat16, device)
    y, s = mod(x, r)
    assert torch.equal(s, x + r)
    ref_y = ref(x + r)
    # the llama cast reproduces HF up to the rounding of the rsqrt / mean in fp32
    assert (y.float() - ref_y.float()).abs().max().item() <= 2 * (ref_y.float().abs().max().item() * 2 ** -8)
    gemma = torchfuse.nn.RMSNorm(64, cast="gemma", weight_offset=1.0, device=device)
    assert torch.equal(gemma.weight, torch.zeros(64, device=device))
    x = make((3, 64), torch.float32, device)
    torch.testing.assert_close(gemma(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
