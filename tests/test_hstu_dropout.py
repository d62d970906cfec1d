"""Attention dropout of HSTU attention: the mask against a NumPy Philox4x32-10 written here from the
paper (the oracle), the op's forward and backward against a float64 reference that applies that mask,
the keep rate over a large P, determinism per seed, CPU and CUDA drawing the same mask, and CUDA graph
replays drawing fresh masks."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse.compat import gr
from test_hstu import DTYPES, TARGETS, check, gr_valid_mask, make_inputs

M32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(seed, offset, block):
    """Philox4x32-10 (Salmon et al., SC'11) of counter (block lo, block hi, offset lo, offset hi) and key
    (seed lo, seed hi), block an array of uint64: the four output words, uint64 arrays."""
    block = np.asarray(block, dtype=np.uint64)
    c0, c1 = block & M32, block >> np.uint64(32)
    c2 = np.full_like(block, np.uint64(offset) & M32)
    c3 = np.full_like(block, np.uint64(offset) >> np.uint64(32))
    k0, k1 = np.uint64(seed) & M32, np.uint64(seed) >> np.uint64(32)
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2  # < 2^64: exact in uint64
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & M32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & M32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & M32, (k1 + np.uint64(0xBB67AE85)) & M32
    return c0, c1, c2, c3


def test_philox_known_answer():
    """The oracle against Random123's known-answer vectors for Philox4x32-10."""
    assert [int(w[0]) for w in philox4x32_10(0, 0, [0])] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = 0xFFFFFFFF
    got = philox4x32_10(ones | ones << 32, ones | ones << 32, [ones | ones << 32])
    assert [int(w[0]) for w in got] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def keep_mask(seed, offset, p, rows, H, max_seq_len, cols):
    """keep[row, h, col] for q rows `rows` (global), all heads, columns < cols: hstu_kernels.h's element
    index (rows max_seq_len rounded up to 4 apart) and tf_philox.h's keep test (24 bits >= float32 p)."""
    stride = (max_seq_len + 3) // 4 * 4
    r = np.asarray(rows, dtype=np.uint64)[:, None, None]
    h = np.arange(H, dtype=np.uint64)[None, :, None]
    c = np.arange(cols, dtype=np.uint64)[None, None, :]
    e = (r * np.uint64(H) + h) * np.uint64(stride) + c
    words = np.stack(philox4x32_10(seed, offset, e >> np.uint64(2)), 0)
    w = np.take_along_axis(words, (e & np.uint64(3)).astype(np.int64)[None], 0)[0]
    u = (w >> np.uint64(8)).astype(np.float64) / 16777216.0
    return torch.from_numpy(u >= float(np.float32(p)))


def reference(q, k, v, offsets, max_seq_len, alpha, p, seed, offset=0, num_targets=None, contextual_seq_len=0,
              max_attn_len=0, attn_bias=None):
    """The formula with dropout on P (mask from the oracle), in q's dtype, differentiable."""
    offs = offsets.tolist()
    H = q.shape[1]
    outs = []
    for b in range(len(offs) - 1):
        s, e = offs[b], offs[b + 1]
        n = e - s
        qb, kb, vb = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
        t = int(num_targets[b]) if num_targets is not None else 0
        mask = gr_valid_mask(n, t, contextual_seq_len, max_attn_len, 0, 1, num_targets is not None).to(q.device)
        keep = keep_mask(seed, offset, p, range(s, e), H, max_seq_len, n).transpose(0, 1).to(q.device)  # (H, n, n)
        qk = qb @ kb.transpose(1, 2)
        if attn_bias is not None:
            qk = qk + attn_bias[b, :, :n, :n]
        pw = F.silu(alpha * qk) / max_seq_len * mask * keep / (1.0 - p)
        outs.append((pw @ vb).transpose(0, 1))
    return torch.cat(outs, 0) if outs else v.new_zeros((0,) + v.shape[1:])


@pytest.fixture(params=TARGETS)
def target(request):
    device, _, backend = request.param.partition("-")
    with torchfuse.backends.use(hstu=backend or None):
        yield device


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", ["d64_targets_ctx", "d128_window_bias", "d256_dv32", "d25_dv50", "long_d64"])
def test_forward_backward_with_the_mask(target, dtype, shape):
    """Forward and every gradient (dq, dk, dv, dattn_bias) against the float64 reference with the same
    mask: the backward regenerates the forward's mask."""
    B, H, dqk, dv, max_len, mk, kw = {
        "d64_targets_ctx": (5, 2, 64, 64, 150, {"targets": True}, {"contextual_seq_len": 3}),
        "d128_window_bias": (4, 2, 128, 64, 120, {"bias_heads": 2, "max_seq_len": 130}, {"max_attn_len": 30}),
        "d256_dv32": (3, 2, 256, 32, 90, {}, {}),
        "d25_dv50": (4, 2, 25, 50, 80, {"targets": True}, {}),
        "long_d64": (2, 1, 64, 64, 600, {}, {}),
    }[shape]
    q, k, v, offsets, msl, nt, bias = make_inputs(target, dtype, B, H, dqk, dv, max_len, **mk)
    p, seed, alpha = 0.3, int(torch.randint(0, 2**62, ())), 0.7 / dqk ** 0.5
    kw = dict(kw, num_targets=nt)
    leaves = [q, k, v] + ([bias] if bias is not None else [])
    ins64 = [t.detach().double().requires_grad_() for t in leaves]
    insl = [t.detach().clone().requires_grad_() for t in leaves]
    insk = [t.detach().clone().requires_grad_() for t in leaves]

    def ref(ins):
        return reference(*ins[:3], offsets, msl, alpha, p, seed, attn_bias=ins[3] if bias is not None else None, **kw)

    out = torchfuse.hstu_attention(*insk[:3], offsets, msl, alpha, attn_bias=insk[3] if bias is not None else None,
                                   dropout_p=p, seed=seed, **kw)
    r64, rlp = ref(ins64), ref(insl)
    check("out", out, r64, rlp, 2.0, dtype)
    dout = torch.randn_like(r64)
    g64 = torch.autograd.grad(r64, ins64, dout)
    glp = torch.autograd.grad(rlp, insl, dout.to(dtype))
    gk = torch.autograd.grad(out, insk, dout.to(dtype))
    for name, a, r, lp in zip(["dq", "dk", "dv", "dbias"], gk, g64, glp):
        check(name, a, r, lp, 5.0, dtype)


def op_mask(device, dtype, p, seed, B=4, H=2, n=256):
    """The mask the op draws, read from its output: q = k constant (every z the same), v = identity
    (output column j = P'[row, j]). Returns (keep over the valid causal pairs, the output, the valid
    pairs, the expected kept value)."""
    L = B * n
    q = torch.full((L, H, 32), 0.25, device=device, dtype=dtype)
    v = torch.eye(n, device=device, dtype=dtype).repeat(B, 1).view(L, 1, n).expand(L, H, n).contiguous()
    offsets = torch.arange(0, L + 1, n, device=device)
    out = torchfuse.hstu_attention(q, q, v, offsets, n, 0.5, dropout_p=p, seed=seed).cpu().float()
    valid = torch.ones(n, n, dtype=torch.bool).tril().repeat(B, 1)[:, None, :].expand(L, H, n)
    kept = 0.5 * 32 * 0.25 ** 2
    value = kept / (1 + np.exp(-kept)) / n / (1 - p)
    return out != 0, out, valid, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_values(target, dtype, p):
    """Over ~260k valid pairs the kept fraction is 1 - p within 6 standard deviations, every kept weight
    is P / (1 - p), masked pairs stay 0, and the mask is the oracle's (fp32 and the 16-bit kernels)."""
    seed = int(torch.randint(0, 2**62, ()))
    keep, out, valid, value = op_mask(target, dtype, p, seed)
    n_valid = int(valid.sum())
    rate = float(keep[valid].sum()) / n_valid
    assert abs(rate - (1 - p)) < 6 * (p * (1 - p) / n_valid) ** 0.5, (rate, 1 - p)
    assert not keep[~valid].any()
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[keep], torch.full_like(out[keep], value), rtol=rtol, atol=0)
    want = keep_mask(seed, 0, p, range(out.shape[0]), out.shape[1], 256, 256) & valid
    assert torch.equal(keep, want)


def test_same_seed_same_mask_and_fresh_draws(device):
    """An explicit seed gives the same result every call; seed=None draws from torch's generator: a
    fresh mask per call, the same after re-seeding torch."""
    q, k, v, offsets, msl, _, _ = make_inputs(device, torch.float32, 4, 2, 64, 64, 120)

    def f(**kw):
        return torchfuse.hstu_attention(q, k, v, offsets, msl, 0.2, dropout_p=0.4, **kw)

    a, b, c = f(seed=7), f(seed=7), f(seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(1234)
    x, y = f(), f()
    torch.manual_seed(1234)
    assert torch.equal(f(), x) and not torch.equal(x, y)
    # off: p = 0 or not training
    plain = torchfuse.hstu_attention(q, k, v, offsets, msl, 0.2)
    assert torch.equal(f(seed=7, training=False), plain)
    assert torch.equal(torchfuse.hstu_attention(q, k, v, offsets, msl, 0.2, dropout_p=0.0, seed=7), plain)


def test_unseeded_backward_uses_the_forwards_mask(device):
    """seed=None: the gradients are those of the reference with the mask of the state the forward drew
    (the backward reads the same state, not a new draw)."""
    q, k, v, offsets, msl, _, _ = make_inputs(device, torch.float32, 3, 2, 32, 64, 70)
    p = 0.25
    torch.manual_seed(99)
    state = torch.ops.torchfuse.hstu_dropout_state(q, None).tolist()
    torch.manual_seed(99)
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = torchfuse.hstu_attention(*ins, offsets, msl, 0.3, dropout_p=p)
    torch.randn(8, device=device)  # the generator moves on between forward and backward
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*ins64, offsets, msl, 0.3, p, state[0] % 2**64, state[1])
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    dout = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, ins, dout), torch.autograd.grad(ref, ins64, dout.double())):
        torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("backend", ["sm90", "mma"])
def test_cpu_and_cuda_draw_the_same_mask(dtype, backend):
    """The same seed on the CPU and on CUDA (every kernel family: the dropout runs on mma.sync even
    where the sm_90a kernels are chosen): the same output and gradients within the dtype's tolerance."""
    q, k, v, offsets, msl, nt, _ = make_inputs("cpu", dtype, 4, 2, 64, 32, 200, targets=True)
    seed = int(torch.randint(0, 2**62, ()))
    outs, grads = [], []
    for dev in ("cpu", "cuda"):
        ins = [t.detach().to(dev).requires_grad_() for t in (q, k, v)]
        with torchfuse.backends.use(hstu=backend):
            out = torchfuse.hstu_attention(*ins, offsets.to(dev), msl, 0.2, num_targets=nt.to(dev),
                                           contextual_seq_len=2, dropout_p=0.35, seed=seed)
        dout = torch.ones_like(out)
        grads.append([g.cpu().double() for g in torch.autograd.grad(out, ins, dout)])
        outs.append(out.cpu().double())
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_replays_draw_fresh_masks():
    """Captured with seed=None, each replay of a CUDA graph reads the generator's state anew: a fresh
    mask per replay, forward and backward in step (the gradients match the reference of the state the
    replay drew)."""
    q, k, v, offsets, msl, _, _ = make_inputs("cuda", torch.bfloat16, 3, 2, 64, 64, 100)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture
        torchfuse.hstu_attention(q, k, v, offsets, msl, 0.2, dropout_p=0.3, validate=False)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        state = torch.ops.torchfuse.hstu_dropout_state(q, None)
        out = torch.ops.torchfuse.hstu_fwd(q, k, v, offsets, None, None, msl, 0.2, None, 0, 0, 0, 1, 0, False, None,
                                           0.3, state)
    results = []
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        results.append((out.clone(), state.clone()))
    assert not torch.equal(results[0][0], results[1][0])
    assert not torch.equal(results[0][1], results[1][1])
    for o, st in results:
        seed, offset = st.tolist()
        ref = reference(q.double(), k.double(), v.double(), offsets, msl, 0.2, 0.3, seed % 2**64, offset)
        torch.testing.assert_close(o.double(), ref, rtol=3e-2, atol=3e-2)


def test_compat_gr_hstu_mha_dropout(device):
    """generative-recommenders' hstu_mha with dropout_pr in training: GR's formula (its F.dropout) with
    our mask, i.e. exactly the op with that dropout_p; with training=False no dropout."""
    q, k, v, offsets, msl, nt, _ = make_inputs(device, torch.float32, 4, 2, 25, 25, 60, targets=True)
    torch.manual_seed(5)
    a = gr.hstu_mha(msl, 0.3, q, k, v, offsets, dropout_pr=0.2, training=True, num_targets=nt, enable_tma=True)
    torch.manual_seed(5)
    b = torchfuse.hstu_attention(q, k, v, offsets, msl, 0.3, num_targets=nt, dropout_p=0.2)
    assert torch.equal(a, b)
    plain = torchfuse.hstu_attention(q, k, v, offsets, msl, 0.3, num_targets=nt)
    assert not torch.equal(a, plain)
    assert torch.equal(gr.hstu_mha(msl, 0.3, q, k, v, offsets, dropout_pr=0.2, training=False, num_targets=nt), plain)


def test_bad_dropout(device):
    q, k, v, offsets, msl, _, _ = make_inputs(device, torch.float32, 2, 1, 32, 32, 10)
    for p in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"dropout_p must lie in \[0, 1\)"):
            torchfuse.hstu_attention(q, k, v, offsets, msl, 0.2, dropout_p=p)
        with pytest.raises(ValueError, match=r"dropout_p must lie in \[0, 1\)"):
            torch.ops.torchfuse.hstu_fwd(q, k, v, offsets, None, None, msl, 0.2, None, 0, 0, 0, 1, 0, True, None, p,
                                         None)
    with pytest.raises(ValueError, match="needs rng_state"):
        torch.ops.torchfuse.hstu_fwd(q, k, v, offsets, None, None, msl, 0.2, None, 0, 0, 0, 1, 0, True, None, 0.1)
    with pytest.raises(RuntimeError, match=r"rng_state must be int64 of shape \(2,\)"):
        torch.ops.torchfuse.hstu_fwd(q, k, v, offsets, None, None, msl, 0.2, None, 0, 0, 0, 1, 0, True, None, 0.1,
                                     torch.zeros(3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="cached-inference form has no dropout"):
        torch.ops.torchfuse.hstu_fwd(q[:2], k, v, offsets, None, None, msl, 0.2, None, 0, 0, 0, 1, 1, True, None, 0.1,
                                     torch.zeros(2, dtype=torch.int64, device=device))


def test_opcheck_and_compile_with_dropout():
    q, k, v, offsets, msl, nt, _ = make_inputs("cpu", torch.float32, 3, 2, 32, 32, 20, targets=True)
    state = torch.tensor([12345, 8], dtype=torch.int64)
    args = (q, k, v, offsets, nt, None, msl, 0.5, None, 1, 0, 0, 1, 0, True, None, 0.2, state)
    torch.library.opcheck(torch.ops.torchfuse.hstu_fwd.default, args)
    dout = torch.randn(q.shape[0], q.shape[1], v.shape[2])
    torch.library.opcheck(torch.ops.torchfuse.hstu_bwd.default,
                          (dout, q, k, v, offsets, nt, None, msl, 0.5, None, 1, 0, 0, 1, False, None, 0.2, state))

    def f(q, k, v):
        return torchfuse.hstu_attention(q, k, v, offsets, msl, 0.5, num_targets=nt, dropout_p=0.2, seed=3).sum()

    ins = [t.requires_grad_() for t in (q, k, v)]
    g_eager = torch.autograd.grad(f(*ins), ins)
    g_comp = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(*ins), ins)
    for a, b in zip(g_eager, g_comp):
        torch.testing.assert_close(a, b)


def test_gradcheck_with_the_mask_fixed():
    """float64 gradcheck of the op with dropout (one rng_state: the mask fixed), zero-length sequences
    and a nonzero offset included: the backward's mask is the forward's."""
    off = torch.tensor([0, 0, 6, 6, 11])
    q, k, v = (torch.randn(11, 2, n, dtype=torch.float64, requires_grad=True) for n in (5, 5, 3))
    state = torch.tensor([int(torch.randint(0, 2**62, ())), 4])

    def f(q, k, v):
        return torch.ops.torchfuse.hstu_fwd(q, k, v, off, None, None, 7, 0.3, None, 0, 0, 0, 1, 0, True, None, 0.4,
                                            state)

    assert torch.autograd.gradcheck(f, (q, k, v))
