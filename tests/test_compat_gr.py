"""torchfuse.compat.gr.patch() / unpatch(): against stand-in generative_recommenders modules (GR's module
names and signatures, every function failing if it is reached), and against a local copy of GR when one
is importable (put its checkout on PYTHONPATH; it needs fbgemm_gpu and torchrec)."""
import enum
import importlib
import random
import sys
import types

import pytest
import torch

import torchfuse
from torchfuse import reference
from torchfuse.compat import gr

GR = "generative_recommenders"


class HammerKernel(enum.Enum):
    TRITON = "TRITON"
    PYTORCH = "PYTORCH"


def _unreached(name):
    def fn(*args, **kwargs):
        raise AssertionError(f"the stand-in {name} ran: patch() did not route it")
    fn.__name__ = name
    return fn


STANDIN_OPS = {
    "ops.hstu_attention": ["hstu_mha", "delta_hstu_mha"],
    "ops.hstu_compute": ["hstu_compute_uqvk", "hstu_compute_output", "hstu_preprocess_and_attention"],
    "ops.layer_norm": ["layer_norm", "triton_rms_norm"],
    "ops.jagged_tensors": ["concat_2D_jagged", "split_2D_jagged", "concat_2D_jagged_multirow",
                           "split_2D_jagged_multirow", "jagged_dense_bmm_broadcast_add"],
    "ops.mm": ["addmm"],
}

# GR's modules/stu.py binds its ops with from-imports: those bindings must be routed too
STANDIN_STU = """
from generative_recommenders.ops.hstu_attention import delta_hstu_mha
from generative_recommenders.ops.hstu_compute import (
    hstu_compute_output,
    hstu_compute_uqvk,
    hstu_preprocess_and_attention,
)
from generative_recommenders.ops.jagged_tensors import concat_2D_jagged, split_2D_jagged
"""


def _module(name, package=False):
    m = types.ModuleType(name)
    if package:
        m.__path__ = []
    return m


@pytest.fixture
def standin(monkeypatch):
    """Stand-in generative_recommenders modules in sys.modules (any real ones set aside)."""
    for name in [n for n in sys.modules if n == GR or n.startswith(GR + ".")]:
        monkeypatch.delitem(sys.modules, name)
    mods = {GR: _module(GR, True), f"{GR}.ops": _module(f"{GR}.ops", True),
            f"{GR}.modules": _module(f"{GR}.modules", True), f"{GR}.common": _module(f"{GR}.common")}
    mods[f"{GR}.common"].HammerKernel = HammerKernel
    for sub, names in STANDIN_OPS.items():
        m = mods[f"{GR}.{sub}"] = _module(f"{GR}.{sub}")
        for n in names:
            setattr(m, n, _unreached(n))
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    stu = _module(f"{GR}.modules.stu")
    monkeypatch.setitem(sys.modules, stu.__name__, stu)
    exec(STANDIN_STU, stu.__dict__)
    mods[stu.__name__] = stu
    originals = {(name, attr): val for name, m in mods.items() for attr, val in vars(m).items() if callable(val)}
    yield mods
    gr.unpatch()
    for (name, attr), val in originals.items():
        assert getattr(mods[name], attr) is val, f"{name}.{attr} was not restored"


@pytest.fixture
def output_op():
    fn = getattr(torchfuse, "hstu_compute_output", None)
    if fn is None:
        pytest.skip("torchfuse.hstu_compute_output is not in this build")
    return fn


def _call(mods, sub, attr, *args, **kwargs):
    with torchfuse.stats() as calls:
        out = getattr(mods[f"{GR}.{sub}"], attr)(*args, **kwargs)
    assert calls.get(f"gr.{attr}") == 1, (attr, calls)
    return out, calls


def _equal(got, want):
    got = got if isinstance(got, (tuple, list)) else [got]
    want = want if isinstance(want, (tuple, list)) else [want]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _offsets(lengths, device):
    o = torch.zeros(len(lengths) + 1, dtype=torch.long)
    o[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return o.to(device)


def test_patch_without_gr_raises(monkeypatch):
    for name in [n for n in sys.modules if n == GR or n.startswith(GR + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, GR, None)  # import generative_recommenders raises ImportError
    with pytest.raises(ImportError, match="generative_recommenders is not importable"):
        gr.patch()
    gr.unpatch()  # nothing patched: a no-op


def test_patch_routes_jagged_norm_and_gemm_ops(standin, device):
    names = gr.patch()
    assert f"{GR}.modules.stu.concat_2D_jagged" in names and f"{GR}.ops.mm.addmm" in names
    assert gr.patch() == names  # a second call changes nothing
    K = HammerKernel.TRITON
    lengths_l, lengths_r = [random.randint(0, 4) for _ in range(3)], [random.randint(0, 4) for _ in range(3)]
    ol, orr = _offsets(lengths_l, device), _offsets(lengths_r, device)
    vl, vr = torch.randn(sum(lengths_l), 5, device=device), torch.randn(sum(lengths_r), 5, device=device)
    want = torchfuse.concat_2d_jagged(vl, ol, vr, orr, 4, 4)[0]
    _equal(_call(standin, "ops.jagged_tensors", "concat_2D_jagged", 8, vl, vr, 4, 4, ol, orr, kernel=K)[0], want)
    _equal(_call(standin, "ops.jagged_tensors", "concat_2D_jagged_multirow", 8, vl, vr, ol, orr, 4, 4, K)[0], want)
    want = torchfuse.split_2d_jagged(want, ol, orr)
    for attr in ("split_2D_jagged", "split_2D_jagged_multirow"):
        got, _ = _call(standin, "ops.jagged_tensors", attr, 8, torchfuse.concat_2d_jagged(vl, ol, vr, orr)[0],
                       offsets_left=ol, offsets_right=orr, kernel=K)
        _equal(got, want)
    dense, bias = torch.randn(3, 5, 2, device=device), torch.randn(3, 2, device=device)
    _equal(_call(standin, "ops.jagged_tensors", "jagged_dense_bmm_broadcast_add", 4, ol, vl, dense, bias, kernel=K)[0],
           torchfuse.jagged_dense_bmm_broadcast_add(4, ol, vl, dense, bias))
    a, w, b = torch.randn(6, 5, device=device), torch.randn(5, 3, device=device), torch.randn(3, device=device)
    _equal(_call(standin, "ops.mm", "addmm", b, a, w, K)[0], torch.addmm(b, a, w))
    x, nw, nb = torch.randn(6, 8, device=device), torch.randn(8, device=device), torch.randn(8, device=device)
    out, calls = _call(standin, "ops.layer_norm", "layer_norm", x, nw, nb, 1e-6, kernel=K)
    assert calls["norm_fwd"] == 1  # torchfuse's kernel ran
    _equal(out, torchfuse.layer_norm(x, nw, nb, eps=1e-6))
    _equal(_call(standin, "ops.layer_norm", "triton_rms_norm", x, nw, 1e-6)[0],
           torchfuse.rms_norm(x, nw, eps=1e-6, cast="gemma"))
    # the from-import binding in the STU module is routed as well
    _equal(_call(standin, "modules.stu", "concat_2D_jagged", 8, vl, vr, 4, 4, ol, orr)[0],
           torchfuse.concat_2d_jagged(vl, ol, vr, orr)[0])


def _hstu_inputs(device, B=3, H=2, D=32, N=6):
    lengths = [random.randint(1, N) for _ in range(B)]
    lengths[0] = N
    o = _offsets(lengths, device)
    L = sum(lengths)
    q, k, v = (torch.randn(L, H, D, device=device) for _ in range(3))
    nt = torch.tensor([random.randint(0, n) for n in lengths], device=device)
    return q, k, v, o, N, nt


def test_patch_routes_hstu_attention(standin, device):
    gr.patch()
    q, k, v, o, N, nt = _hstu_inputs(device)
    out, calls = _call(standin, "ops.hstu_attention", "hstu_mha", N, 0.3, q, k, v, o, causal=True, dropout_pr=0.0,
                       training=False, num_targets=nt, kernel=HammerKernel.TRITON, enable_tma=False)
    assert calls["hstu_fwd"] == 1
    _equal(out, torchfuse.hstu_attention(q, k, v, o, N, 0.3, num_targets=nt))
    B, delta = o.shape[0] - 1, 1
    rows = (o[1:] - 1).cpu()
    dq = q[rows]
    for sub in ("ops.hstu_attention", "modules.stu"):
        got, _ = _call(standin, sub, "delta_hstu_mha", N, 0.3, dq, k, v, o, num_targets=nt,
                       kernel=HammerKernel.TRITON)
        _equal(got, torchfuse.hstu_attention_cached(dq, k, v, o, N, 0.3, num_targets=nt))
    assert B * delta == dq.shape[0]


def _layer_inputs(device, E=16, H=2, Da=32, Dh=32):
    q, _, _, o, N, nt = _hstu_inputs(device, H=H, D=Da)
    L = q.shape[0]
    x = torch.randn(L, E, device=device)
    nw, nb = 1 + 0.1 * torch.randn(E, device=device), 0.1 * torch.randn(E, device=device)
    w, b = torch.randn(E, 2 * H * (Da + Dh), device=device) / 4, torch.randn(2 * H * (Da + Dh), device=device)
    return x, nw, nb, w, b, o, N, nt, (H, Da, Dh)


def test_patch_routes_hstu_input_section(standin, device):
    gr.patch()
    x, nw, nb, w, b, o, N, nt, (H, Da, Dh) = _layer_inputs(device)
    want = torchfuse.hstu_preprocess(x, nw, nb, 1e-6, w, b, H, Da, Dh)
    for sub in ("ops.hstu_compute", "modules.stu"):
        got, calls = _call(standin, sub, "hstu_compute_uqvk", x=x, norm_weight=nw, norm_bias=nb, norm_eps=1e-6,
                           num_heads=H, attn_dim=Da, hidden_dim=Dh, uvqk_weight=w, uvqk_bias=b,
                           kernel=HammerKernel.TRITON)
        assert calls["hstu_preprocess"] == 1
        _equal(got, want)
    u, q, k, v = want
    attn = torchfuse.hstu_attention(q, k, v, o, N, 0.2, num_targets=nt, contextual_seq_len=1).reshape(-1, H * Dh)
    x.requires_grad_(True)
    got, calls = _call(standin, "modules.stu", "hstu_preprocess_and_attention", x=x, norm_weight=nw, norm_bias=nb,
                       norm_eps=1e-6, num_heads=H, attn_dim=Da, hidden_dim=Dh, uvqk_weight=w, uvqk_bias=b,
                       max_seq_len=N, seq_offsets=o, attn_alpha=0.2, causal=True, num_targets=nt, max_attn_len=0,
                       contextual_seq_len=1, recompute_uvqk_in_backward=True, recompute_normed_x_in_backward=True,
                       sort_by_length=True, prefill=False, kernel=HammerKernel.TRITON)
    assert calls["hstu_preprocess"] == 1 and calls["hstu_fwd"] == 1
    _equal([t.detach() for t in got], [u, attn, k, v])
    (got[0].sum() + got[1].pow(2).sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_patch_routes_hstu_compute_output(standin, device, output_op):
    gr.patch()
    E, H, Dh, L = 16, 2, 8, 7
    attn, u = torch.randn(L, H * Dh, device=device), torch.randn(L, H * Dh, device=device)
    x, ow = torch.randn(L, E, device=device), torch.randn(3 * H * Dh, E, device=device) / 8
    nw, nb = 1 + 0.1 * torch.randn(H * Dh, device=device), 0.1 * torch.randn(H * Dh, device=device)
    want = output_op(attn, u, x, nw, nb, 1e-6, ow, num_heads=H, linear_dim=Dh, dropout_ratio=0.0, training=False,
                     concat_u=True, concat_x=True, mul_u_activation_type="none", group_norm=False)
    for sub, form in (("ops.hstu_compute", dict(concat_u=True, concat_x=True, mul_u_activation_type="none")),
                      ("modules.stu", dict(concat_ux=True))):  # GR's current and earlier keywords
        got, _ = _call(standin, sub, "hstu_compute_output", attn=attn, u=u, x=x, norm_weight=nw, norm_bias=nb,
                       norm_eps=1e-6, output_weight=ow, num_heads=H, linear_dim=Dh, dropout_ratio=0.0,
                       training=False, group_norm=False, recompute_y_in_backward=False,
                       kernel=HammerKernel.TRITON, **form)
        _equal(got, want)


def test_unpatch_restores_modules_imported_after_patch(standin):
    original = standin[f"{GR}.ops.mm"].addmm
    gr.patch()
    late = _module(f"{GR}.modules.late")
    sys.modules[late.__name__] = late
    try:
        exec("from generative_recommenders.ops.mm import addmm", late.__dict__)
        assert late.addmm is standin[f"{GR}.ops.mm"].addmm and late.addmm.__wrapped__ is gr.addmm
        gr.unpatch()
        assert late.addmm is original
        with pytest.raises(AssertionError, match="the stand-in addmm ran"):
            late.addmm(torch.zeros(1), torch.zeros(1, 1), torch.zeros(1, 1))
    finally:
        del sys.modules[late.__name__]


# ---- a local copy of generative-recommenders ----


def _real_gr(fbgemm=False):
    """GR's stu module and HammerKernel; ``fbgemm``: GR's PyTorch kernels are used too, which call
    torch.ops.fbgemm's jagged ops (registered by importing fbgemm_gpu)."""
    try:
        importlib.import_module("fbgemm_gpu")
    except ImportError:
        pass
    try:
        stu = importlib.import_module(f"{GR}.modules.stu")
        common = importlib.import_module(f"{GR}.common")
    except Exception as e:  # noqa: BLE001  (GR imports triton, torchrec and fbgemm at module level)
        pytest.skip(f"generative_recommenders is not importable here ({type(e).__name__}: {e})")
    if fbgemm and not hasattr(torch.ops.fbgemm, "jagged_to_padded_dense"):
        pytest.skip("GR's PyTorch kernels need fbgemm_gpu's jagged ops, which are not installed here")
    return stu, common.HammerKernel


def _rel(a, b):
    return (a.double() - b.double()).abs().max().item() / (b.double().abs().max().item() + 1e-6)


LENGTHS, TARGETS = [7, 3, 5, 1], [2, 1, 0, 1]


def _gr_layer(stu, dtype, device):
    cfg = stu.STULayerConfig(embedding_dim=32, num_heads=2, hidden_dim=32, attention_dim=32, output_dropout_ratio=0.0,
                             contextual_seq_len=1)
    layer = stu.STULayer(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return cfg, layer.to(device, dtype)


def _twin(stu, cfg, layer, kernel=None):
    twin = stu.STULayer(cfg).to(next(layer.parameters()).device, next(layer.parameters()).dtype)
    twin.load_state_dict(layer.state_dict())
    if kernel is not None:
        twin.set_hammer_kernel(kernel)
    return twin


def test_real_gr_stu_layer_runs_on_torchfuse(device, output_op):
    """GR's own STULayer, its default (Triton) kernel selection, routed to torchfuse: forward and backward.
    Truth: torchfuse.reference's STU layer in float64 (fbgemm's CPU jagged ops have no float64, so GR's
    own code cannot run there); unit: the same GR layer unpatched on GR's kernels (on the CPU its PyTorch
    kernels in float32, on CUDA its Triton kernels in bfloat16)."""
    stu, HK = _real_gr(fbgemm=device == "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cfg, layer = _gr_layer(stu, dtype, device)
    names = [n for n, _ in layer.named_parameters()]
    o = _offsets(LENGTHS, device)
    nt = torch.tensor(TARGETS, device=device)
    x = torch.randn(sum(LENGTHS), 32, device=device)
    dout = torch.randn_like(x)

    def run(model):
        xi = x.to(dtype).requires_grad_(True)
        out = model(x=xi, x_lengths=o.diff(), x_offsets=o, max_seq_len=7, num_targets=nt)
        grads = torch.autograd.grad(out, [xi] + list(model.parameters()), dout.to(dtype))
        return [out.detach()] + list(grads)

    x64 = x.double().requires_grad_(True)
    P64 = {k: v.detach().double().requires_grad_(True) for k, v in layer.state_dict().items()}
    out64 = reference.stu_layer_reference(P64, cfg, x64, o, 7, nt, dtype=torch.float64)
    ref = [out64.detach()] + list(torch.autograd.grad(out64, [x64] + [P64[n] for n in names], dout.double()))
    unit = run(_twin(stu, cfg, layer, HK.PYTORCH if device == "cpu" else None))
    gr.patch()
    try:
        with torchfuse.stats() as calls:
            got = run(layer)  # the layer's default kernel: GR's Triton entry points
    finally:
        gr.unpatch()
    assert calls["gr.hstu_preprocess_and_attention"] == 1 and calls["gr.hstu_compute_output"] == 1
    assert calls["hstu_preprocess"] == 1 and calls["hstu_fwd"] == 1
    floor = 1e-5 if dtype == torch.float32 else 1e-2
    for name, g, u, r in zip(["out", "x"] + names, got, unit, ref):
        assert _rel(g, r) <= max(3 * _rel(u, r), floor), (name, _rel(g, r), _rel(u, r))


def test_real_gr_cached_forward_runs_on_torchfuse(output_op):
    """GR's STULayer.cached_forward routed to torchfuse equals the unpatched layer on GR's PyTorch kernels:
    the last position of every sequence against the K/V cache of the others (CPU, float32)."""
    stu, HK = _real_gr(fbgemm=True)
    cfg, layer = _gr_layer(stu, torch.float32, "cpu")
    layer.eval()
    unit_layer = _twin(stu, cfg, layer, HK.PYTORCH).eval()
    o = _offsets(LENGTHS, "cpu")
    nt = torch.tensor(TARGETS)
    x = torch.randn(sum(LENGTHS), 32)
    kv = torch.tensor(LENGTHS) - 1
    delta_x = x[o[1:] - 1]

    def cached(model):
        with torch.no_grad():
            model(x=x, x_lengths=o.diff(), x_offsets=o, max_seq_len=7, num_targets=nt, kv_caching_lengths=kv)
            return model.cached_forward(delta_x=delta_x, num_targets=nt)

    want = cached(unit_layer)
    gr.patch()
    try:
        with torchfuse.stats() as calls:
            got = cached(layer)
    finally:
        gr.unpatch()
    assert calls["gr.hstu_compute_uqvk"] == 1 and calls["gr.delta_hstu_mha"] == 1
    assert calls["gr.split_2D_jagged"] == 2 and calls["gr.concat_2D_jagged"] == 2  # filling and extending the cache
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_real_gr_preprocess_and_attention(device):
    """GR's hstu_preprocess_and_attention routed to torchfuse. Truth: torchfuse.reference in float64; unit:
    GR's own entry point unpatched on the same input (PyTorch kernels in float32 on the CPU, Triton in
    bfloat16 on CUDA)."""
    stu, HK = _real_gr(fbgemm=device == "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    hc = importlib.import_module(f"{GR}.ops.hstu_compute")
    x, nw, nb, w, b, o, N, nt, (H, Da, Dh) = _layer_inputs(device, E=24)
    x, nw, nb, w, b = (t.to(dtype) for t in (x, nw, nb, w, b))
    kw = dict(x=x, norm_weight=nw, norm_bias=nb, norm_eps=1e-6, num_heads=H, attn_dim=Da, hidden_dim=Dh,
              uvqk_weight=w, uvqk_bias=b, max_seq_len=N, seq_offsets=o, attn_alpha=0.2, causal=True, num_targets=nt,
              max_attn_len=0, contextual_seq_len=0, recompute_uvqk_in_backward=False,
              recompute_normed_x_in_backward=False, sort_by_length=False)
    unit = hc.hstu_preprocess_and_attention(**kw, kernel=HK.PYTORCH if device == "cpu" else HK.TRITON)
    u, q, k, v = reference.hstu_preprocess(x.double(), nw.double(), nb.double(), 1e-6, w.double(), b.double(), H, Da,
                                           Dh)
    ref = (u, reference.hstu_attention(q, k, v, o, N, 0.2, num_targets=nt).reshape(-1, H * Dh), k, v)
    gr.patch()
    try:
        with torchfuse.stats() as calls:
            got = stu.hstu_preprocess_and_attention(**kw, kernel=HK.TRITON)
        assert calls["gr.hstu_preprocess_and_attention"] == 1 and calls["hstu_fwd"] == 1
    finally:
        gr.unpatch()
    assert stu.hstu_preprocess_and_attention is hc.hstu_preprocess_and_attention
    floor = 1e-5 if dtype == torch.float32 else 1e-2
    # GR's Triton path returns no k and v (it keeps them inside its fused op)
    for g, un, r in zip(got, unit, ref):
        if un is not None:
            assert _rel(g, r) <= max(3 * _rel(un, r), floor), (_rel(g, r), _rel(un, r))
