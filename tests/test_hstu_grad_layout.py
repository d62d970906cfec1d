"""HSTU attention's gradients laid out like its inputs: `hstu_bwd_into` writes dq, dk, dv into the
caller's row-strided tensors, and the autograd backward uses it when q, k, v are disjoint column views
of one buffer (a fused projection's output), so `hstu_preprocess`'s backward reads the three gradients
as one tensor instead of concatenating them. Every result is compared with the plain `hstu_bwd`."""
import importlib

import pytest
import torch

import torchfuse
hp_mod = importlib.import_module("torchfuse.hstu_preprocess")

TARGETS = ["cpu"] + (["cuda-sm90", "cuda-mma"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_bwd = torch.ops.torchfuse.hstu_bwd.default
_into = torch.ops.torchfuse.hstu_bwd_into.default


@pytest.fixture(params=TARGETS)
def target(request):
    device, _, backend = request.param.partition("-")
    with torchfuse.backends.use(hstu=backend or None):
        yield device


def lengths(B, max_len):
    lens = torch.randint(0, max_len + 1, (B,))
    lens[:3] = torch.tensor([max_len, 0, 1])[:B]
    return lens[torch.randperm(B)]


def fused(device, dtype, L, H, dqk, dv, pad=0):
    """u, v, q, k columns of one (L, 2 H (dv + dqk) + pad) buffer, as hstu_preprocess's GEMM output."""
    n = 2 * H * (dv + dqk)
    buf = torch.randn(L, n + pad, device=device, dtype=dtype)
    v = buf[:, H * dv:2 * H * dv].unflatten(1, (H, dv))
    q = buf[:, 2 * H * dv:2 * H * dv + H * dqk].unflatten(1, (H, dqk))
    k = buf[:, 2 * H * dv + H * dqk:n].unflatten(1, (H, dqk))
    return buf, q, k, v


def assert_grads_close(name, got, want, dtype):
    """dk, dv come from one block each: equal bit for bit. dq is added up across key tiles in fp32 in an
    order that may vary run to run (the sm_90a kernels' reduce-adds), so two runs may differ by an ulp
    of the output dtype once rounded."""
    if name != "dq" or got.device.type == "cpu":
        assert torch.equal(got, want), name
        return
    eps = torch.finfo(dtype).eps
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=2 * eps, atol=2 * eps * scale, msg=name)


CASES = {  # B, H, dqk, dv, max_len, max_attn_len, pad (extra columns: row strides other than 2 H (dqk + dv))
    "d64": (5, 2, 64, 64, 150, 0, 0),
    "d256_window": (4, 2, 256, 256, 140, 40, 0),
    "dqk32_dv96_padded_rows": (4, 1, 32, 96, 90, 0, 8),
    "head_dim_25": (4, 2, 25, 25, 60, 0, 0),  # the padded-head-dim path: computed, then copied in
    "odd_row_stride": (3, 2, 64, 64, 70, 0, 3),  # 16-bit rows not 4-byte aligned: computed, then copied in
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_bwd_into_matches_bwd(target, dtype, case):
    B, H, dqk, dv, max_len, window, pad = CASES[case]
    lens = lengths(B, max_len)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(target)
    L = int(offsets[-1])
    _, q, k, v = fused(target, dtype, L, H, dqk, dv, pad)
    dout = torch.randn(L, H, dv, device=target, dtype=dtype)
    opts = (offsets, None, None, max_len, 0.7 / dqk ** 0.5, None, 0, window, 0, 1)
    want = _bwd(dout, q, k, v, *opts, False)[:3]
    # the gradients' own buffer, laid out as the inputs', filled with a sentinel: u's columns and the
    # padding must keep it
    gbuf = torch.full((L, 2 * H * (dv + dqk) + pad), 7.0, device=target, dtype=dtype)
    g = [gbuf.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (q, k, v)]
    _into(dout, q, k, v, *opts, *g)
    for name, a, b in zip(("dq", "dk", "dv"), g, want):
        assert_grads_close(name, a, b, dtype)
    assert (gbuf[:, :H * dv] == 7.0).all() and (gbuf[:, 2 * H * (dv + dqk):] == 7.0).all()
    # three separate tensors, each a column slice of a wider one
    sep = [torch.full((L, t.shape[1] * t.shape[2] + 16), -3.0, device=target, dtype=dtype)[:, 8:8 + t.shape[1] *
                                                                                            t.shape[2]]
           .unflatten(1, t.shape[1:]) for t in (q, k, v)]
    _into(dout, q, k, v, *opts, *sep)
    for name, a, b in zip(("dq", "dk", "dv"), sep, want):
        assert_grads_close(name, a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bwd_into_rows_outside_sequences(device, dtype):
    """Rows no sequence covers: zero in the caller's tensors too (their other columns untouched)."""
    L, H, D = 45, 2, 64
    offsets = torch.tensor([3, 10, 10, 31], device=device)
    buf, q, k, v = fused(device, dtype, L, H, D, D)
    dout = torch.randn(L, H, D, device=device, dtype=dtype)
    gbuf = torch.full_like(buf, float("nan"))
    g = [gbuf.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (q, k, v)]
    _into(dout, q, k, v, offsets, None, None, 24, 0.5, None, 0, 0, 0, 1, *g)
    want = _bwd(dout, q, k, v, offsets, None, None, 24, 0.5, None, 0, 0, 0, 1, False)[:3]
    for name, a, b in zip(("dq", "dk", "dv"), g, want):
        assert torch.isfinite(a).all(), name
        assert a[:3].abs().max() == 0 and a[31:].abs().max() == 0, name
        assert_grads_close(name, a, b, dtype)
    assert torch.isnan(gbuf[:, :H * D]).all()


def test_bwd_into_empty(device):
    q = torch.randn(0, 2, 32, device=device)
    g = [torch.empty(0, 2, 32, device=device) for _ in range(3)]
    _into(q, q, q, q, torch.zeros(1, dtype=torch.int32, device=device), None, None, 0, 1.0, None, 0, 0, 0, 1, *g)


def test_bwd_into_bad_outputs(device):
    L, H, D = 20, 2, 32
    offsets = torch.tensor([0, 7, 20], device=device)
    buf, q, k, v = fused(device, torch.float32, L, H, D, D)
    dout = torch.randn(L, H, D, device=device)
    opts = (offsets, None, None, 13, 0.5, None, 0, 0, 0, 1)
    ok = [torch.empty(L, H, D, device=device) for _ in range(3)]

    def call(dq, dk, dv):
        _into(dout, q, k, v, *opts, dq, dk, dv)

    with pytest.raises(RuntimeError, match="dq must have q's shape"):
        call(ok[0][:, :1], ok[1], ok[2])
    with pytest.raises(RuntimeError, match="dv must have q's dtype"):
        call(ok[0], ok[1], ok[2].double())
    with pytest.raises(RuntimeError, match="dk must hold each row's heads contiguously"):
        call(ok[0], torch.empty(L, D, H, device=device).transpose(1, 2), ok[2])
    with pytest.raises(RuntimeError, match="dq shares memory with an input"):
        call(q, ok[1], ok[2])
    with pytest.raises(RuntimeError, match="dk shares memory with an input"):
        call(ok[0], buf[:, :H * D].unflatten(1, (H, D)), ok[2])
    with pytest.raises(RuntimeError, match="dq and dv overlap"):
        call(ok[0], ok[1], ok[0])
    wide = torch.empty(L, 3 * H * D, device=device)
    with pytest.raises(RuntimeError, match="dk and dv overlap"):
        call(ok[0], wide[:, :H * D].unflatten(1, (H, D)), wide[:, H * D // 2:3 * H * D // 2].unflatten(1, (H, D)))
    if device == "cuda":
        with pytest.raises(RuntimeError, match="dq must be on q's device"):
            call(ok[0].cpu(), ok[1], ok[2])


def test_bwd_into_opcheck():
    L, H, D = 12, 2, 16
    offsets = torch.tensor([0, 5, 12])
    _, q, k, v = fused("cpu", torch.float32, L, H, D, D)
    g = [torch.empty(L, H, D) for _ in range(3)]
    torch.library.opcheck(_into, (torch.randn(L, H, D), q, k, v, offsets, None, None, 7, 0.5, None, 0, 0, 0, 1,
                                  *g))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_attention_grads_share_the_inputs_layout(target, dtype):
    """q, k, v views of one buffer: their gradients come back as views of one buffer, equal to those of
    contiguous copies."""
    B, H, D = 4, 2, 64
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths(B, 80).cumsum(0)]).to(target)
    L = int(offsets[-1])
    buf = torch.randn(L, 4 * H * D, device=target, dtype=dtype, requires_grad=True)
    q, k, v = (buf[:, i * H * D:(i + 1) * H * D].unflatten(1, (H, D)) for i in (2, 3, 1))
    out = torchfuse.hstu_attention(q, k, v, offsets, 80, 0.3)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ptr = dq.untyped_storage().data_ptr()
    assert dk.untyped_storage().data_ptr() == ptr and dv.untyped_storage().data_ptr() == ptr
    assert (dq.stride(), dq.storage_offset()) == (q.stride(), q.storage_offset())
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(torchfuse.hstu_attention(qc, kc, vc, offsets, 80, 0.3), (qc, kc, vc), dout)
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_grads_close(name, a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_preprocess_takes_the_gradients_as_one_tensor(target, dtype, monkeypatch):
    """hstu_preprocess -> hstu_attention: the preprocess backward finds dv, dq, dk in place (no
    concatenation), and its gradients equal those of the concatenating path (taken when the attention
    gets copies of q, k, v)."""
    L, E, H, D = 150, 48, 2, 32
    joined = []
    orig = hp_mod._joined
    monkeypatch.setattr(hp_mod, "_joined", lambda *a: joined.append(orig(*a)) or joined[-1])
    offsets = torch.tensor([0, 60, 60, 61, 150], device=target)
    x = torch.randn(L, E, device=target, dtype=dtype)
    params = [torch.randn(E, device=target, dtype=dtype) * 0.1 + 1, torch.randn(E, device=target, dtype=dtype) * 0.1,
              torch.randn(E, 4 * H * D, device=target, dtype=dtype) / E ** 0.5,
              torch.randn(4 * H * D, device=target, dtype=dtype) * 0.1]
    dy = torch.randn(L, H * D, device=target, dtype=dtype)

    def grads(copy):
        leaves = [t.detach().clone().requires_grad_() for t in [x] + params]
        u, q, k, v = hp_mod.hstu_preprocess(leaves[0], leaves[1], leaves[2], 1e-5, leaves[3], leaves[4], H, D, D)
        if copy:
            q, k, v = q.clone(), k.clone(), v.clone()
        a = torchfuse.hstu_attention(q, k, v, offsets, 89, 0.25)
        y = (a.flatten(1) * u).float()
        return torch.autograd.grad((y * dy.float()).sum(), leaves)

    got = grads(False)
    assert joined and joined[-1] is not None
    want = grads(True)
    assert joined[-1] is None
    for i, (a, b) in enumerate(zip(got, want)):
        if target == "cpu":
            assert torch.equal(a, b), i
        else:  # dq's last-ulp run-to-run differences, through the GEMMs
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(a, b, rtol=8 * eps, atol=8 * eps * max(1.0, b.abs().max().item()))
