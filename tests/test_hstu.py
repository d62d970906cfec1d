"""HSTU attention against a float64 reference built here from the formula (and generative-recommenders'
mask, ported literally). Pass rule (FBGEMM's and NVIDIA's): the kernel's max error against the float64
reference is at most 2x that of the same computation done by PyTorch in the input dtype (forward), 5x
for the gradients, plus one ulp of the output's magnitude so exact-zero budgets are not impossible."""
import pytest
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse.reference import hstu_valid_mask
from torchfuse.compat import gr

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- the reference ----


def gr_valid_mask(n, t, c, m, f, g, has_targets):
    """generative-recommenders' `_get_valid_attn_mask` for one sequence (causal), plus FBGEMM's target
    groups: (n, n) bool, [row p, column q]."""
    return hstu_valid_mask(n, t, c, m, f, g, has_targets)


def reference(q, k, v, offsets, max_seq_len, alpha, num_targets=None, contextual_seq_len=0, max_attn_len=0,
              min_full_attn_seq_len=0, target_group_size=1, scaling_seqlen=None, attn_bias=None):
    """The formula in q's dtype (differentiable), sequence by sequence."""
    S = scaling_seqlen if scaling_seqlen is not None else max_seq_len
    offs = offsets.tolist()
    outs = []
    for b in range(len(offs) - 1):
        s, e = offs[b], offs[b + 1]
        n = e - s
        qb, kb, vb = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)  # (H, n, D)
        t = int(num_targets[b]) if num_targets is not None else 0
        mask = gr_valid_mask(n, t, contextual_seq_len, max_attn_len, min_full_attn_seq_len, target_group_size,
                             num_targets is not None).to(q.device)
        qk = qb @ kb.transpose(1, 2)
        if attn_bias is not None:
            qk = qk + attn_bias[b, :, :n, :n]
        p = F.silu(alpha * qk) / S * mask
        outs.append((p @ vb).transpose(0, 1))
    return torch.cat(outs, 0) if outs else v.new_zeros((0,) + v.shape[1:])


# ---- data ----


def make_lengths(B, max_len, gen_max):
    """B lengths with 0, 1 and max_len among them (when B allows), the rest random."""
    lens = torch.randint(0, max_len + 1, (B,)).tolist()
    for i, forced in enumerate([max_len, 0, 1]):
        if i < B:
            lens[i] = forced
    perm = torch.randperm(B).tolist()
    lens = [lens[i] for i in perm]
    return [min(x, gen_max) for x in lens]


def make_inputs(device, dtype, B, H, dqk, dv, max_len, max_seq_len=None, idx_dtype=torch.int32, targets=False,
                bias_heads=0, strided=False):
    lens = make_lengths(B, max_len, max_len)
    offsets = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=idx_dtype, device=device)
    L = int(offsets[-1])
    if strided:  # q, k, v as views of one fused projection (unit inner stride, padded rows)
        fused = torch.randn(L, H, 2 * dqk + dv + 8, device=device, dtype=dtype)
        q, k, v = fused[..., :dqk], fused[..., dqk:2 * dqk], fused[..., 2 * dqk:2 * dqk + dv]
    else:
        q = torch.randn(L, H, dqk, device=device, dtype=dtype)
        k = torch.randn(L, H, dqk, device=device, dtype=dtype)
        v = torch.randn(L, H, dv, device=device, dtype=dtype)
    msl = max_seq_len if max_seq_len is not None else max_len
    nt = None
    if targets:
        nt = torch.tensor([torch.randint(0, x + 1, ()).item() if x > 0 else 0 for x in lens], dtype=idx_dtype,
                          device=device)
    bias = None
    if bias_heads:
        bias = torch.randn(B, bias_heads, msl, msl, device=device, dtype=dtype)
    return q, k, v, offsets, msl, nt, bias


CASES = {
    # name: (B, H, dqk, dv, max_len, extra make_inputs kwargs, op kwargs)
    "plain_h2_d64": (5, 2, 64, 64, 150, {}, {}),
    "dqk32_dv96_h1": (4, 1, 32, 96, 90, {}, {}),
    "d128_h4_int64": (4, 4, 128, 128, 140, {"idx_dtype": torch.int64}, {}),
    "d192_dv256_h2": (3, 2, 192, 256, 80, {}, {}),
    "d256_dv32_h8_msl_scaling": (4, 8, 256, 32, 70, {"max_seq_len": 100}, {"scaling_seqlen": 37}),
    "context": (5, 2, 64, 64, 130, {}, {"contextual_seq_len": 6}),
    "targets": (6, 2, 64, 64, 150, {"targets": True}, {}),
    "targets_groups_context": (6, 2, 96, 64, 150, {"targets": True}, {"target_group_size": 3,
                                                                      "contextual_seq_len": 4}),
    "window": (5, 2, 64, 128, 200, {}, {"max_attn_len": 37}),
    "window_minfull_targets_ctx": (6, 4, 64, 64, 200, {"targets": True, "idx_dtype": torch.int64},
                                   {"max_attn_len": 20, "min_full_attn_seq_len": 9, "contextual_seq_len": 5}),
    "window_targets_groups": (5, 1, 32, 32, 160, {"targets": True}, {"max_attn_len": 33, "target_group_size": 4}),
    "bias_h_heads": (4, 4, 64, 64, 100, {"bias_heads": 4}, {}),
    "bias_1_head_targets_window": (4, 2, 128, 64, 120, {"bias_heads": 1, "targets": True, "max_seq_len": 130},
                                   {"max_attn_len": 25, "contextual_seq_len": 2}),
    "strided_qkv": (4, 2, 64, 64, 100, {"strided": True}, {"contextual_seq_len": 3}),
    # many key tiles per query tile (the K/V double buffer turns over several times), lengths not tile multiples
    "long_d128_targets": (3, 2, 128, 128, 700, {"targets": True}, {}),
    "long_d256_window": (3, 1, 256, 256, 450, {}, {"max_attn_len": 150}),
    # head dim 256 (the wgmma backward's 64-key tiles): lengths 0, 1, 300 and two random (several key
    # tiles, a tail), targets and context
    "d256_targets_context": (5, 2, 256, 256, 300, {"targets": True}, {"contextual_seq_len": 5}),
    # many more work items than SMs (the persistent wgmma backward: 2 key tiles x 600 pairs, a block runs
    # several; the items of sequences shorter than 129 whose second key tile starts past their end are
    # skipped): 300 lengths 0..200
    "many_short_seqs": (300, 2, 64, 64, 200, {}, {}),
    # the same at head dim 256 (64-key tiles, the consumers' query split, dQ staged in the ring's panels):
    # 4 key tiles x 240 pairs, several items a block, ring slots handed from one item to the next
    "many_short_seqs_d256": (120, 2, 256, 256, 200, {}, {}),
}
# cases for the GPU kernels' scheduling only: skipped on the CPU (the backward's reference there took 6-10 s)
CUDA_ONLY_CASES = {"many_short_seqs", "many_short_seqs_d256"}

# Where a case runs: the CPU, or a GPU with the HSTU kernels chosen through torchfuse.backends: "sm90"
# the Hopper (TMA + wgmma) kernels wherever they can run (16-bit, compute capability 9.0, a build for
# sm_90a; the backward also needs head dims up to 256 and no attn_bias; elsewhere mma.sync runs), "mma"
# the mma.sync kernels, so a Hopper GPU checks both on every case. Each Hopper kernel's other store and
# reduction forms run where the shapes take them (dQ by red.global.add at head dims 192 / 256, O by
# registers for partial query tiles).
TARGETS = ["cpu"] + (["cuda-sm90", "cuda-mma"] if torch.cuda.is_available() else [])


@pytest.fixture(params=TARGETS)
def target(request):
    """The device a test runs on, with the HSTU backend its id names selected while it runs."""
    device, _, backend = request.param.partition("-")
    with torchfuse.backends.use(hstu=backend or None):
        yield device


def run_case(device, dtype, case, grad):
    if device == "cpu" and case in CUDA_ONLY_CASES:
        pytest.skip("a GPU scheduling case")
    run_shape(device, dtype, *CASES[case], grad=grad, strided="strided" in case)


def run_shape(device, dtype, B, H, dqk, dv, max_len, mk, kw, grad, strided=False):
    q, k, v, offsets, msl, nt, bias = make_inputs(device, dtype, B, H, dqk, dv, max_len, **mk)
    alpha = 1.0 / dqk ** 0.5 * float(torch.empty(()).uniform_(0.5, 2.0))
    kw = dict(kw, num_targets=nt, attn_bias=bias)
    leaves = [q, k, v] + ([bias] if bias is not None else [])
    ins64 = [t.detach().double().requires_grad_(grad) for t in leaves]
    insl = [t.detach().clone().requires_grad_(grad) for t in leaves]
    insk = [t.detach().clone().requires_grad_(grad) for t in leaves]
    if strided:
        insk = [t.detach().requires_grad_(grad) for t in leaves]  # keep the strided views

    def call(fn, ins):
        bias_ = ins[3] if bias is not None else None
        return fn(ins[0], ins[1], ins[2], offsets, msl, alpha, **dict(kw, attn_bias=bias_))

    ref = call(reference, ins64)
    lp = call(reference, insl)
    out = call(torchfuse.hstu_attention, insk)
    assert out.shape == ref.shape and out.dtype == dtype
    check("out", out, ref, lp, 2.0, dtype)
    if grad:
        dout = torch.randn_like(ref)
        g64 = torch.autograd.grad(ref, ins64, dout)
        glp = torch.autograd.grad(lp, insl, dout.to(dtype))
        gk = torch.autograd.grad(out, insk, dout.to(dtype))
        for name, a, r, l in zip(["dq", "dk", "dv", "dbias"], gk, g64, glp):
            assert a.shape == r.shape and a.dtype == dtype
            check(name, a, r, l, 5.0, dtype)


def check(name, got, ref, lp, factor, dtype):
    ref = ref.double()
    err = (got.double() - ref).abs().max().item() if ref.numel() else 0.0
    err_lp = (lp.double() - ref).abs().max().item() if ref.numel() else 0.0
    floor = torch.finfo(dtype).eps * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    assert torch.isfinite(got).all(), name
    assert err <= factor * err_lp + floor, f"{name}: error {err:.3g} > {factor} x PyTorch's {err_lp:.3g} + {floor:.3g}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_forward(target, dtype, case):
    run_case(target, dtype, case, grad=False)


# Head dims the 16-bit CUDA kernels do not take directly (not multiples of 8: a zero-padded copy), those
# they take in partly zero-filled tiles (8, 16, 40, 200), and Dqk != Dv pairs of both kinds;
# generative-recommenders' tests use 16, its MovieLens config 25.
HEAD_DIMS = [(1, 1), (8, 8), (16, 16), (25, 25), (40, 40), (50, 50), (100, 100), (200, 200), (256, 256),
             (25, 50), (16, 200), (100, 1), (256, 25), (7, 64), (8, 136), (16, 100)]


@pytest.mark.parametrize("dqk, dv", HEAD_DIMS, ids=lambda d: str(d))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_any_head_dim(target, dtype, dqk, dv):
    """Every head dim from 1 to 256, Dqk and Dv independently, forward and backward (targets, context
    and a window so the masked tiles run too); alpha is the caller's at every dim."""
    run_shape(target, dtype, 4, 2, dqk, dv, 90, {"targets": True}, {"contextual_seq_len": 2, "max_attn_len": 40},
              grad=True)


@pytest.mark.parametrize("dqk, dv", [(25, 25), (25, 50), (12, 7)], ids=lambda d: str(d))
def test_padded_head_dims_of_strided_views(device, dqk, dv):
    """Head dims the 16-bit kernels do not take, with q, k and v as column slices of one projection (as
    the STU layer passes them): the same output and gradients, bit for bit, as from contiguous copies."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, offsets, msl, nt, _ = make_inputs(device, dtype, 5, 2, dqk, dv, 60, targets=True, strided=True)
    assert not q.is_contiguous()
    kw = dict(num_targets=nt, contextual_seq_len=1, max_attn_len=20)
    views = [t.detach().requires_grad_(True) for t in (q, k, v)]
    copies = [t.detach().contiguous().requires_grad_(True) for t in (q, k, v)]
    outs = [torchfuse.hstu_attention(*ins, offsets, msl, 0.4, **kw) for ins in (views, copies)]
    assert torch.equal(outs[0], outs[1])
    L, H = outs[0].shape[:2]
    dout = torch.randn(L, H, dv + 3, device=device, dtype=dtype)[..., :dv]  # a strided output gradient too
    for a, b in zip(torch.autograd.grad(outs[0], views, dout), torch.autograd.grad(outs[1], copies, dout)):
        assert torch.equal(a, b)


def test_padded_head_dims_refuse_another_device():
    """At a padded head dim, k on the CPU beside CUDA q and v is refused by name, not copied from."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    q, k, v, offsets, msl, _, _ = make_inputs("cuda", torch.bfloat16, 3, 2, 25, 25, 30)
    with pytest.raises(RuntimeError, match="k"):
        torchfuse.hstu_attention(q, k.cpu(), v, offsets, msl, 0.4)


@pytest.mark.parametrize("dqk, dv", [(25, 25), (16, 50), (1, 200)], ids=lambda d: str(d))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_any_head_dim_cached_and_compat(device, dtype, dqk, dv):
    """The cached form and generative-recommenders' hstu_mha / delta_hstu_mha at head dims the kernels
    do not take directly: the same rows as the full forward, which matches the fp64 reference."""
    q, k, v, offsets, msl, nt, _ = make_inputs(device, dtype, 4, 2, dqk, dv, 80, targets=True)
    kw = dict(num_targets=nt, contextual_seq_len=2, max_attn_len=30)
    full = torchfuse.hstu_attention(q, k, v, offsets, msl, 0.3, **kw)
    ref = reference(q.double(), k.double(), v.double(), offsets, msl, 0.3, **kw)
    lp = reference(q, k, v, offsets, msl, 0.3, **kw)
    check("out", full, ref, lp, 2.0, dtype)
    mha = gr.hstu_mha(msl, 0.3, q, k, v, offsets, num_targets=nt, contextual_seq_len=2, max_attn_len=30)
    assert torch.equal(mha, full)
    offs = offsets.tolist()
    B, D = len(offs) - 1, 3
    dq = q.new_zeros(B * D, 2, dqk)
    want = full.new_zeros(B * D, 2, dv)
    for b in range(B):
        n = offs[b + 1] - offs[b]
        for i in range(D):
            if n - D + i >= 0:
                dq[b * D + i] = q[offs[b] + n - D + i]
                want[b * D + i] = full[offs[b] + n - D + i]
    tol = torch.finfo(dtype).eps * max(1.0, want.abs().max().item())
    got = torchfuse.hstu_attention_cached(dq, k, v, offsets, msl, 0.3, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    got = gr.delta_hstu_mha(msl, 0.3, dq, k, v, offsets, num_targets=nt, max_attn_len=30, contextual_seq_len=2)
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma forward runs on compute capability 9.0 only")
@pytest.mark.parametrize("backend, d, n, rows, want", [
    ("sm90", 64, 90, 0, "hstu_fwd_ws"), ("mma", 256, 90, 0, "hstu_fwd_mma"),  # forced, both ways
    ("auto", 128, 2048, 0, "hstu_fwd_ws"), ("auto", 256, 90, 0, "hstu_fwd_ws"),
    ("auto", 128, 1000, 0, "hstu_fwd_ws"), ("auto", 64, 2048, 0, "hstu_fwd_ws"),
    ("auto", 32, 90, 0, "hstu_fwd_ws"),
    # cached inference (rows: query rows per sequence): one row runs the split-key decode kernels unless a
    # backend is forced (then mma.sync or the Hopper kernel as asked); more rows mma.sync up to head dim 128,
    # the Hopper kernel above
    ("auto", 128, 300, 1, "hstu_decode_partial"), ("auto", 256, 300, 1, "hstu_decode_partial"),
    ("sm90", 128, 300, 1, "hstu_fwd_ws"), ("mma", 256, 300, 1, "hstu_fwd_mma"),
    ("auto", 128, 300, 4, "hstu_fwd_mma"), ("auto", 256, 300, 4, "hstu_fwd_ws")])
def test_forward_kernel_choice(backend, d, n, rows, want):
    """On a Hopper GPU the forward really runs the kernel the dispatch rule names (the warp-specialized
    wgmma one; the decode kernels for cached inference of one row per sequence) and torchfuse.backends.hstu
    really forces one or the other."""
    q, k, v, offsets, msl, _, _ = make_inputs("cuda", torch.bfloat16, 2, 1, d, d, n)
    with torchfuse.backends.use(hstu=backend), \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        if rows:
            torchfuse.hstu_attention_cached(q[:2 * rows], k, v, offsets, msl, 0.2)
        else:
            torchfuse.hstu_attention(q, k, v, offsets, msl, 0.2)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any(want in n for n in names), f"expected a {want} kernel (torchfuse built for 9.0a?), ran {names}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_backward(target, dtype, case):
    run_case(target, dtype, case, grad=True)


def bwd_kernel_grids(d, B, n):
    """The grids of the hstu_bwd_ws launches of one backward (B sequences of n rows, 2 heads), from the
    profiler's trace."""
    import json
    import tempfile
    q, k, v = (torch.randn(B * n, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    offsets = torch.arange(0, B * n + 1, n, device="cuda")
    q.requires_grad_(True)
    with torchfuse.backends.use(hstu="sm90"):
        out = torchfuse.hstu_attention(q, k, v, offsets, n, 0.2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out.sum().backward()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = tmp + "/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if "hstu_bwd_ws" in e.get("name", "")]
    assert kernels, "no hstu_bwd_ws kernel ran (torchfuse built for 9.0a?)"
    assert all("grid" in e.get("args", {}) for e in kernels), "the profiler's trace has no grid sizes"
    return [e["args"]["grid"][0] for e in kernels]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma backward runs on compute capability 9.0 only")
@pytest.mark.parametrize("d, key_tile", [(64, 128), (128, 128), (256, 64)])
def test_backward_persistent_grid(d, key_tile):
    """The wgmma backward is persistent: one block per SM, fewer where there are fewer (key tile,
    sequence, head) items."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    B, n = 96, 512
    items = (n // key_tile) * B * 2
    assert bwd_kernel_grids(d, B, n) == [min(items, sms)]
    assert bwd_kernel_grids(d, 1, 2 * key_tile) == [min(2 * 2, sms)]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma backward runs on compute capability 9.0 only")
@pytest.mark.parametrize("backend, d, bias, want", [
    ("auto", 128, False, "hstu_bwd_ws"), ("auto", 64, False, "hstu_bwd_ws"), ("auto", 96, False, "hstu_bwd_ws"),
    ("auto", 256, False, "hstu_bwd_ws"), ("auto", 192, False, "hstu_bwd_ws"), ("sm90", 256, False, "hstu_bwd_ws"),
    ("auto", 256, False, "hstu_bwd_dq"), ("auto", 192, False, "hstu_bwd_dq"), ("auto", 128, False, "hstu_bwd_dq"),
    ("auto", 96, False, "hstu_bwd_dq"),
    ("mma", 128, False, "hstu_bwd_mma"), ("mma", 256, False, "hstu_bwd_mma"), ("auto", 64, True, "hstu_bwd_mma"),
    ("sm90", 256, True, "hstu_bwd_mma")])
def test_backward_kernel_choice(backend, d, bias, want):
    """On a Hopper GPU the backward really runs the wgmma kernel where it applies (16-bit, head dims up
    to 256, no attn_bias) and torchfuse.backends.hstu = "mma" really forces mma.sync; the backward takes
    the selection its forward ran under."""
    q, k, v, offsets, msl, _, b = make_inputs("cuda", torch.bfloat16, 2, 1, d, d, 90, bias_heads=1 if bias else 0)
    q.requires_grad_(True)
    with torchfuse.backends.use(hstu=backend):
        out = torchfuse.hstu_attention(q, k, v, offsets, msl, 0.2, attn_bias=b)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out.sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any(want in n for n in names), f"expected a {want} kernel (torchfuse built for 9.0a?), ran {names}"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the two-part wgmma backward runs on compute capability 9.0 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("dqk, dv", [(128, 100), (256, 200)])
def test_backward_two_part_in_chunks(dtype, dqk, dv):
    """Head dims 65-256 on sm_90a: the backward stores dZ's tiles and dQ = dZ K runs as its own kernel, over
    sequences in chunks when max_seq_len's tiles outgrow the scratch (2 bytes per query, key and head: at
    max_seq_len 8192 and 2 heads 256 MiB a sequence, 8 sequences to a 2 GiB chunk, so 13 sequences take
    two). Short sequences (lengths 0, 1 and up to 150), targets, context and a window, against the
    reference."""
    run_shape("cuda", dtype, 13, 2, dqk, dv, 150, {"targets": True, "max_seq_len": 8192},
              {"contextual_seq_len": 3, "max_attn_len": 70, "scaling_seqlen": 150}, grad=True)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma backward runs on compute capability 9.0 only")
@pytest.mark.parametrize("dqk, dv", [(128, 100), (256, 200)])
def test_backward_one_part_where_a_sequence_outgrows_the_scratch(dqk, dv):
    """Where one sequence's dZ tiles do not fit the two-part backward's 2 GiB scratch (72 heads at
    max_seq_len 4096: 2.25 GiB), the one-part backward (dQ added in fp32) runs instead, against the
    reference."""
    run_shape("cuda", torch.bfloat16, 3, 72, dqk, dv, 150, {"targets": True, "max_seq_len": 4096},
              {"contextual_seq_len": 2, "max_attn_len": 40}, grad=True)


def test_float64_cpu_matches_reference_tightly():
    q, k, v, offsets, msl, nt, bias = make_inputs("cpu", torch.float64, 5, 2, 32, 64, 60, targets=True,
                                                  bias_heads=2)
    kw = dict(num_targets=nt, contextual_seq_len=3, max_attn_len=11, min_full_attn_seq_len=4, target_group_size=2,
              attn_bias=bias)
    ins = [t.requires_grad_() for t in (q, k, v, bias)]
    out = torchfuse.hstu_attention(q, k, v, offsets, msl, 0.3, **kw)
    ref = reference(q, k, v, offsets, msl, 0.3, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    dout = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, ins, dout), torch.autograd.grad(ref, ins, dout)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_mask_prose_matches_gr_port():
    """The prose description of the mask (hstu_attention's docstring) equals the ported GR mask (when n > c + t)."""
    for _ in range(200):
        n = int(torch.randint(1, 40, ()))
        c = int(torch.randint(0, 5, ()))
        t = int(torch.randint(0, max(1, n - c), ()))
        m = int(torch.randint(0, 8, ())) * int(torch.randint(0, 2, ()))
        f = int(torch.randint(0, 6, ()))
        g = int(torch.randint(1, 4, ()))
        if n <= c + t:
            continue
        u = n - t

        def num(p):
            if p >= u:
                return num(u - 1) + 1
            return (0 if p < c else p - c + 1) if c > 0 else p

        want = torch.zeros(n, n, dtype=torch.bool)
        for p in range(n):
            for qq in range(n):
                if p < c:
                    ok = qq < u
                elif p < u:
                    ok = qq <= p
                else:
                    ok = qq < u or qq == p or (g > 1 and qq >= u and qq < p and (p - u) // g == (qq - u) // g)
                if ok and m > 0 and p >= c and not (f > 0 and p >= u - f):
                    ok = num(p) - num(qq) <= m
                want[p, qq] = ok
        got = gr_valid_mask(n, t, c, m, f, g, True)
        assert torch.equal(got, want), (n, c, t, m, f, g)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("D", [1, 3, 70])
def test_cached_equals_full_rows(device, dtype, D):
    q, k, v, offsets, msl, nt, _ = make_inputs(device, dtype, 5, 2, 64, 32, 130, targets=True)
    kw = dict(num_targets=nt, contextual_seq_len=2, max_attn_len=40, min_full_attn_seq_len=3, target_group_size=2)
    full = torchfuse.hstu_attention(q, k, v, offsets, msl, 0.2, **kw)
    offs = offsets.tolist()
    B = len(offs) - 1
    dq = q.new_zeros(B * D, 2, 64)
    want = full.new_zeros(B * D, 2, 32)
    for b in range(B):
        n = offs[b + 1] - offs[b]
        for i in range(D):
            pos = n - D + i
            if pos >= 0:
                dq[b * D + i] = q[offs[b] + pos]
                want[b * D + i] = full[offs[b] + pos]
    got = torchfuse.hstu_attention_cached(dq, k, v, offsets, msl, 0.2, **kw)
    tol = torch.finfo(dtype).eps * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("dqk, dv", [(256, 256), (25, 40), (8, 130), (200, 1)], ids=lambda d: str(d))
@pytest.mark.parametrize("D", [1, 2, 5, 8, 9])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_cached_few_rows_long_histories(device, dtype, D, dqk, dv):
    """Cached inference of a few newest rows over histories long enough to span many key chunks (on
    CUDA, one row per sequence runs the split-key decode kernels, more the tiled ones), with empty,
    one-row and shorter-than-D sequences, a window, context rows and int64 offsets, against the fp64
    reference of the full forward's rows; and the same rows from q as a strided view."""
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    lens = [0, 1, 3, 1500, 700 + int(torch.randint(0, 300, (), generator=g)), 64, 65]
    H, msl, alpha = 2, 1600, 0.4
    offsets = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=device)
    L = int(offsets[-1])
    q = torch.randn(L, H, dqk, generator=g).to(device, dtype)
    k = torch.randn(L, H, dqk, generator=g).to(device, dtype)
    v = torch.randn(L, H, dv, generator=g).to(device, dtype)
    kw = dict(contextual_seq_len=1, max_attn_len=900)
    ref = reference(q.double(), k.double(), v.double(), offsets, msl, alpha, **kw)
    lp = reference(q, k, v, offsets, msl, alpha, **kw)
    B = len(lens)
    rows, picks = [], []
    for b, n in enumerate(lens):
        for i in range(D):
            pos = n - D + i
            rows.append(int(offsets[b]) + max(pos, 0))
            picks.append(pos >= 0)
    rows = torch.tensor(rows, device=device)
    keep = torch.tensor(picks, device=device).view(-1, 1, 1)
    dq = q[rows] * keep
    want, want_lp = ref[rows] * keep, lp[rows] * keep
    got = torchfuse.hstu_attention_cached(dq, k, v, offsets, msl, alpha, **kw)
    check("cached", got, want, want_lp, 2.0, dtype)
    wide = torch.zeros(B * D, H, dqk + 8, device=device, dtype=dtype)
    wide[..., 3:3 + dqk] = dq
    strided = torchfuse.hstu_attention_cached(wide[..., 3:3 + dqk], k, v, offsets, msl, alpha, **kw)
    assert torch.equal(strided, got)


@pytest.mark.parametrize("D", [1, 4, 12])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_cached_kv_lengths_reads_slots(device, dtype, D):
    """kv_lengths: the same rows as the jagged cache when each sequence sits at the start of a larger slot
    whose tail holds garbage (nan); lengths past a slot are refused, naming kv_lengths."""
    lens, slack = [7, 0, 300, 1], [3, 5, 40, 0]
    H, dqk, dv, msl = 2, 32, 40, 400
    offsets = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device)
    L = int(offsets[-1])
    k = torch.randn(L, H, dqk, device=device, dtype=dtype)
    v = torch.randn(L, H, dv, device=device, dtype=dtype)
    dq = torch.randn(len(lens) * D, H, dqk, device=device, dtype=dtype)
    want = torchfuse.hstu_attention_cached(dq, k, v, offsets, msl, 0.3, contextual_seq_len=1)
    spans = [n + e for n, e in zip(lens, slack)]
    starts = torch.tensor([0] + torch.tensor(spans).cumsum(0).tolist(), device=device)
    ks = torch.full((int(starts[-1]), H, dqk), float("nan"), device=device, dtype=dtype)
    vs = torch.full((int(starts[-1]), H, dv), float("nan"), device=device, dtype=dtype)
    for b, n in enumerate(lens):
        ks[int(starts[b]):int(starts[b]) + n] = k[int(offsets[b]):int(offsets[b + 1])]
        vs[int(starts[b]):int(starts[b]) + n] = v[int(offsets[b]):int(offsets[b + 1])]
    for idx in (torch.int32, torch.int64):
        kl = torch.tensor(lens, device=device, dtype=idx)
        got = torchfuse.hstu_attention_cached(dq, ks, vs, starts, msl, 0.3, contextual_seq_len=1, kv_lengths=kl)
        assert torch.equal(got, want)
    bad = torch.tensor([7, 6, 300, 1], device=device)  # 6 > the second slot's 5 rows
    with pytest.raises((RuntimeError, ValueError), match="kv_lengths"):
        torchfuse.hstu_attention_cached(dq, ks, vs, starts, msl, 0.3, kv_lengths=bad)


@pytest.mark.parametrize("dqk, dv", [(128, 128), (96, 72)], ids=lambda d: str(d))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_cached_one_row_many_sequences(device, dtype, dqk, dv):
    """One newest row for more (sequence, head) pairs than one CUDA grid dimension holds (65535; the
    decode kernels then run a second plane), with empty and one-row sequences, at head dims the decode
    kernels load in whole 16-byte slices, against the formula in fp64 for every sequence at once."""
    B, H, n_max, alpha = 33000, 2, 3, 0.7
    lens = torch.randint(0, n_max + 1, (B,))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    L = int(offsets[-1])
    k = torch.randn(L, H, dqk, dtype=dtype)
    v = torch.randn(L, H, dv, dtype=dtype)
    dq = torch.randn(B, H, dqk, dtype=dtype)
    # every key of a sequence is valid for its last row (causal, no targets, context or window)
    j = torch.arange(n_max)
    valid = j[None, :] < lens[:, None]  # (B, n_max)
    rows = torch.where(valid, offsets[:-1, None] + j[None, :], 0)
    want = {}
    for t in (torch.float64, dtype):
        kk, vv = k[rows].to(t), v[rows].to(t)  # (B, n_max, H, d)
        s = torch.einsum("bhd,bjhd->bhj", dq.to(t), kk)
        p = F.silu(alpha * s) / n_max * valid[:, None, :].to(t)
        want[t] = torch.einsum("bhj,bjhd->bhd", p, vv)
    got = torchfuse.hstu_attention_cached(dq.to(device), k.to(device), v.to(device), offsets.to(device), n_max,
                                          alpha)
    check("cached", got.cpu(), want[torch.float64], want[dtype], 2.0, dtype)
    assert torch.equal(got.cpu()[lens == 0], torch.zeros_like(got.cpu()[lens == 0]))


def test_sequences_are_isolated_from_nonfinite_neighbours(target):
    """inf / nan in one sequence's rows must not reach another sequence's output (a kernel that reads
    whole tiles past a sequence's end multiplies those rows by P = 0, and 0 x inf is nan)."""
    device = target
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for d in (64, 128, 256):
        offsets = torch.tensor([0, 300, 305, 565], device=device)
        q, k, v = (torch.randn(565, 2, d, device=device, dtype=dtype) for _ in range(3))
        k[300:305] = float("inf")  # sequence 1, rows 300-304: all bad
        v[300:303] = float("nan")
        v[303:305] = float("inf")
        out = torchfuse.hstu_attention(q, k, v, offsets, 300, 0.1)
        for b in (0, 2):  # the neighbours of the bad sequence stay finite
            s, e = int(offsets[b]), int(offsets[b + 1])
            assert torch.isfinite(out[s:e]).all(), (d, b)


def test_backward_sequences_are_isolated_from_nonfinite_neighbours(target):
    """The backward reads whole tiles of K, V, Q and dO past a sequence's end too: inf / nan in one
    sequence (inputs and output gradient) must not reach another sequence's gradients."""
    device = target
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for d in (64, 128, 256):
        offsets = torch.tensor([0, 300, 305, 565], device=device)
        q, k, v, dout = (torch.randn(565, 2, d, device=device, dtype=dtype) for _ in range(4))
        for t in (q, k, v, dout):
            t[300:303] = float("inf")  # sequence 1, rows 300-304: all bad
            t[303:305] = float("nan")
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        out = torchfuse.hstu_attention(q, k, v, offsets, 300, 0.1)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        for b in (0, 2):  # the neighbours of the bad sequence stay finite
            s, e = int(offsets[b]), int(offsets[b + 1])
            for name, gr_ in (("dq", dq), ("dk", dk), ("dv", dv)):
                assert torch.isfinite(gr_[s:e]).all(), (d, b, name)


def test_backend_names_are_checked(device):
    """A backend name the ops do not know is refused naming it, from torchfuse.backends.use and from the
    op; the known ones give the same result on the CPU, which has one path."""
    q, k, v, offsets, msl, _, _ = make_inputs(device, torch.float32, 3, 1, 32, 32, 40)
    with pytest.raises(ValueError, match="hstu"):
        with torchfuse.backends.use(hstu="fast"):
            pass
    with pytest.raises(ValueError, match="no backend choice"):
        with torchfuse.backends.use(norm="mma"):
            pass
    assert torchfuse.backends.hstu is None
    with pytest.raises(ValueError, match="backend"):
        torch.ops.torchfuse.hstu_fwd(q, k, v, offsets, None, None, msl, 0.2, None, 0, 0, 0, 1, 0, True, "fast")
    if device == "cpu":
        outs = []
        for name in ("auto", "sm90", "mma", None):
            with torchfuse.backends.use(hstu=name):
                outs.append(torchfuse.hstu_attention(q, k, v, offsets, msl, 0.2))
        assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_backend_environment_default_is_checked():
    """TORCHFUSE_HSTU_BACKEND, the process default, is read once and a wrong value is refused by name."""
    import subprocess
    import sys
    code = ("import torch, torchfuse\n"
            "x = torch.randn(4, 1, 32)\n"
            "torchfuse.hstu_attention(x, x, x, torch.tensor([0, 4]), 4, 0.2)\n")
    env = dict(__import__("os").environ, TORCHFUSE_HSTU_BACKEND="fastest")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "TORCHFUSE_HSTU_BACKEND" in r.stderr and "fastest" in r.stderr, r.stderr[-2000:]
    env["TORCHFUSE_HSTU_BACKEND"] = "mma"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_validate_false_same_result(device):
    q, k, v, offsets, msl, nt, _ = make_inputs(device, torch.bfloat16, 5, 2, 64, 64, 150, targets=True)
    kw = dict(num_targets=nt, contextual_seq_len=3, max_attn_len=30)
    a = torchfuse.hstu_attention(q, k, v, offsets, msl, 0.2, **kw)
    b = torchfuse.hstu_attention(q, k, v, offsets, msl, 0.2, validate=False, **kw)
    assert torch.equal(a, b) and a.abs().max() > 0


def test_empty_batch_and_all_empty(device):
    q = torch.randn(0, 2, 32, device=device)
    out = torchfuse.hstu_attention(q, q, q, torch.zeros(1, dtype=torch.int32, device=device), 0, 1.0)
    assert out.shape == (0, 2, 32)
    offsets = torch.zeros(4, dtype=torch.int64, device=device)
    out = torchfuse.hstu_attention(q, q, q, offsets, 16, 1.0)
    assert out.shape == (0, 2, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("validate", [True, False])
def test_rows_outside_sequences_are_zero(device, dtype, validate):
    """Rows before offsets[0] and from offsets[B] on belong to no sequence: out, dq, dk and dv are zero
    there. On CUDA the outputs are allocated uninitialised and only those rows zeroed, so the freed
    NaN-filled blocks below are what the allocator hands back if a row were missed."""
    L, H, D = 45, 2, 64
    q, k, v = (torch.randn(L, H, D, device=device, dtype=dtype) for _ in range(3))
    offsets = torch.tensor([3, 10, 10, 31], device=device)
    if device == "cuda":
        junk = [torch.full((L, H, D), float("nan"), device=device, dtype=t) for t in (dtype, dtype, dtype, torch.float32)]
        del junk
    for x in (q, k, v):
        x.requires_grad_()
    out = torchfuse.hstu_attention(q, k, v, offsets, 24, 0.5, validate=validate)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), name
        assert t[:3].abs().max() == 0 and t[31:].abs().max() == 0, name
    qd, kd, vd = (x[3:31].detach().double().requires_grad_() for x in (q, k, v))
    ref = reference(qd, kd, vd, offsets - 3, 24, 0.5)
    rq, rk, rv = torch.autograd.grad(ref, (qd, kd, vd), dout[3:31].double())
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out[3:31].double(), ref, **tol)
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(got[3:31].double(), want, **tol)


def test_compat_gr_hstu_mha(device):
    q, k, v, offsets, msl, nt, _ = make_inputs(device, torch.float32, 4, 2, 64, 64, 50, targets=True)
    out = gr.hstu_mha(msl, 0.25, q, k, v, offsets, causal=True, dropout_pr=0.0, training=True, num_targets=nt,
                      max_attn_len=9, contextual_seq_len=2, min_full_attn_seq_len=3)
    ref = reference(q.double(), k.double(), v.double(), offsets, msl, 0.25, num_targets=nt, max_attn_len=9,
                    contextual_seq_len=2, min_full_attn_seq_len=3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    # dropout off in evaluation, as GR's F.dropout(training=False); dropout itself: test_hstu_dropout.py
    plain = torchfuse.hstu_attention(q, k, v, offsets, msl, 0.25)
    assert torch.equal(gr.hstu_mha(msl, 0.25, q, k, v, offsets, dropout_pr=0.3, training=False), plain)
    with pytest.raises(NotImplementedError, match="causal"):
        gr.hstu_mha(msl, 0.25, q, k, v, offsets, causal=False)


def test_bad_inputs(device):
    q, k, v, offsets, msl, nt, _ = make_inputs(device, torch.float32, 3, 2, 64, 64, 20)
    call = torchfuse.hstu_attention
    with pytest.raises(RuntimeError, match="same number of heads"):
        call(q, k[:, :1], v, offsets, msl, 1.0)
    with pytest.raises(RuntimeError, match="head dim must equal"):
        call(q, k[..., :32], v, offsets, msl, 1.0)
    with pytest.raises(RuntimeError, match=r"head dims must lie in \[1, 256\], got Dqk=0"):
        call(q[..., :0], k[..., :0], v, offsets, msl, 1.0)
    with pytest.raises(RuntimeError, match="same number of rows"):
        call(q, k[:-1], v[:-1], offsets, msl, 1.0)
    with pytest.raises(RuntimeError, match=r"max_seq_len \(\d+\) is smaller"):
        call(q, k, v, offsets, msl - 1, 1.0)
    with pytest.raises(RuntimeError, match="lie in"):
        call(q, k, v, offsets + 1, msl + 1, 1.0)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        call(q, k, v, offsets.flip(0), 1000, 1.0)
    with pytest.raises(RuntimeError, match="num_targets must be 1-D with B"):
        call(q, k, v, offsets, msl, 1.0, num_targets=torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="num_targets must lie"):
        call(q, k, v, offsets, msl, 1.0, num_targets=torch.full((3,), 1000, dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="attn_bias must have shape"):
        call(q, k, v, offsets, msl, 1.0, attn_bias=torch.zeros(3, 3, msl, msl, device=device))
    with pytest.raises(TypeError, match="int32 or int64"):
        call(q, k, v, offsets.float(), msl, 1.0)
    with pytest.raises(TypeError, match="must be bfloat16"):
        call(q.int(), k.int(), v.int(), offsets, msl, 1.0)
    with pytest.raises(RuntimeError, match="share one dtype"):
        call(q, k.half(), v, offsets, msl, 1.0)
    with pytest.raises(RuntimeError, match="3-D"):
        call(q[0], k, v, offsets, msl, 1.0)
    with pytest.raises(ValueError, match="B \\* D rows"):
        torchfuse.hstu_attention_cached(q[:4], k, v, offsets, msl, 1.0)
    if device == "cuda":
        with pytest.raises(TypeError, match="only the CPU"):
            call(q.double(), k.double(), v.double(), offsets, msl, 1.0)


def test_registered_autograd_matches_wrapper():
    """hstu_attention trains through its own autograd.Function; the op called directly trains through
    the op's registered autograd. Both give the same output and gradients (attn_bias included)."""
    q, k, v, offsets, msl, nt, bias = make_inputs("cpu", torch.float64, 4, 2, 32, 64, 40, targets=True,
                                                  bias_heads=2)
    ins = [t.requires_grad_() for t in (q, k, v, bias)]
    out = torchfuse.hstu_attention(q, k, v, offsets, msl, 0.4, num_targets=nt, contextual_seq_len=2, attn_bias=bias)
    out_op = torch.ops.torchfuse.hstu_fwd(q, k, v, offsets, nt, bias, msl, 0.4, None, 2, 0, 0, 1, 0)
    torch.testing.assert_close(out, out_op, rtol=0, atol=0)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, ins, dout), torch.autograd.grad(out_op, ins, dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert out.grad_fn is not None and "HstuAttention" in type(out.grad_fn).__name__


def test_opcheck_and_compile():
    q, k, v, offsets, msl, nt, bias = make_inputs("cpu", torch.float32, 3, 2, 32, 32, 20, targets=True,
                                                  bias_heads=1)
    args = (q, k, v, offsets, nt, bias, msl, 0.5, None, 1, 5, 2, 2, 0)
    torch.library.opcheck(torch.ops.torchfuse.hstu_fwd.default, args)
    dout = torch.randn(q.shape[0], q.shape[1], v.shape[2])
    torch.library.opcheck(torch.ops.torchfuse.hstu_bwd.default,
                          (dout, q, k, v, offsets, nt, bias, msl, 0.5, None, 1, 5, 2, 2, True))

    def f(q, k, v, bias):
        return torchfuse.hstu_attention(q, k, v, offsets, msl, 0.5, num_targets=nt, attn_bias=bias).sum()

    ins = [t.requires_grad_() for t in (q, k, v, bias)]
    g_eager = torch.autograd.grad(f(*ins), ins)
    g_comp = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(*ins), ins)
    for a, b in zip(g_eager, g_comp):
        torch.testing.assert_close(a, b)
