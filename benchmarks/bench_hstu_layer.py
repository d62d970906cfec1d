"""One STU layer (and a stack of 4), forward + backward, bf16, on one GPU in one run:
torchfuse.nn.STULayer, eager and under torch.compile, against the same layer in plain PyTorch ops (torchfuse.reference.stu_layer_reference:
generative-recommenders' PyTorch formulation, eager padded attention), torch.compile of that, and
generative-recommenders' own STULayer on its Triton kernels (given --peers), plus that GR layer routed to
torchfuse by ``torchfuse.compat.gr.patch()``.

  (a) NVIDIA's HSTU training config: B = 32, lengths U[N/2, N], N = 4096, embedding 1024, 4 heads x 256
  (b) generative-recommenders' MovieLens-1M config: B = 128, lengths U[N/2, N], N = 200, embedding 50,
      2 heads x 25

Every variant has the same weights (one state_dict), output dropout 0 (so all compute the same function),
target-aware off. Where a variant does not fit in memory at the config's batch (eager attention keeps
B x H x N x N scores per layer), every variant of that table runs at the largest batch (halving) that
fits them all, and the table says so. Times: the median of ``triton.testing.do_bench`` (see _common.py) of
one forward and its backward (``torch.autograd.grad`` of x and the parameters).

The "output vs torchfuse" column is each variant's forward output's largest difference to torchfuse's,
relative to the largest |output| (bf16: about 1e-2 is rounding).

Launches: kernels (and memcpy / memset) on the GPU for one forward + backward of one layer at config
(b), counted with torch.profiler: config (b) is launch-bound.

Memory: the torchfuse layer at config (a) under its ``recompute_normed_x`` / ``recompute_uvqk`` /
``recompute_y`` choices (GR's defaults: all three on; the plain layer's autograd keeps everything, as
all three off do): the bytes the forward leaves for the backward (allocated after the forward minus
before), and the time.

    python benchmarks/bench_hstu_layer.py [--quick] [--peers DIR] [--out results.md]

--peers: a folder holding generative_recommenders/ (fetched code, never committed).
"""
import sys

import torch

import torchfuse
from torchfuse.reference import stu_layer_reference
from torchfuse.stu import STULayer, STULayerConfig, STUStack

import _common as C
from bench_hstu import restrict_triton_configs

# label, batch, max length, embedding, heads, head dim
CONFIGS = {
    "a": ("(a) NVIDIA: B 32, N 4096, E 1024, 4 x 256", 32, 4096, 1024, 4, 256),
    "b": ("(b) GR ML-1M: B 128, N 200, E 50, 2 x 25", 128, 200, 50, 2, 25),
}
DTYPE = torch.bfloat16
DEVICE = "cuda"


def layer_config(cfg, **kw):
    _, _, _, E, H, D = cfg
    return STULayerConfig(embedding_dim=E, num_heads=H, hidden_dim=D, attention_dim=D, output_dropout_ratio=0.0,
                          target_aware=False, **kw)


def batch_inputs(cfg, B, seed=0):
    _, _, N, E, _, _ = cfg
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(N // 2, N + 1, (B,), generator=g)
    lengths[0] = N
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    x = torch.randn(int(offsets[-1]), E, generator=g).to(DEVICE, DTYPE)
    return x, lengths.to(DEVICE), offsets.to(DEVICE), N


# ---- the variants: each builds (fn(x) -> out, parameters) for a list of layers with one state_dict each ----


def ours(cfg, states, **kw):
    stack = STUStack([STULayer(layer_config(cfg, **kw)) for _ in states]).to(DEVICE, DTYPE)
    for layer, sd in zip(stack._stu_layers, states):
        layer.load_state_dict(sd)
    return stack, list(stack.parameters())


def plain(cfg, states):
    lcfg = layer_config(cfg)
    params = [{k: v.detach().clone().requires_grad_(True) for k, v in sd.items()} for sd in states]

    def fn(x, lengths, offsets, N):
        for P in params:
            x = stu_layer_reference(P, lcfg, x, offsets, N, None, dtype=DTYPE)
        return x

    return fn, [p for P in params for p in P.values()]


def compiled(cfg, states):
    fn, params = plain(cfg, states)
    return C.compile_fn(fn), params


def ours_compiled(cfg, states):
    """The torchfuse stack compiled whole: its ops stay opaque (fake kernels), the glue between them is
    fused and the per-op host cost goes, which is what a launch-bound configuration needs."""
    model, params = ours(cfg, states)
    return C.compile_fn(as_fn(model)), params


def load_gr(path):
    if not path:
        return None
    common = C.import_peer("generative_recommenders.common", path)
    stu = C.import_peer("generative_recommenders.modules.stu", path)
    if common is None or stu is None:
        return None
    common.set_use_runtime_max_seq_len(True)
    mod = C.import_peer("generative_recommenders.ops.triton.triton_hstu_attention", path)
    if mod is not None:  # the large-tile configs only, as bench_hstu.py does (autotuning time)
        restrict_triton_configs(mod)
    return stu


def gr_layers(stu, cfg, states):
    _, _, _, E, H, D = cfg
    gcfg = stu.STULayerConfig(embedding_dim=E, num_heads=H, hidden_dim=D, attention_dim=D, output_dropout_ratio=0.0,
                              target_aware=False)
    stack = stu.STUStack([stu.STULayer(gcfg) for _ in states]).to(DEVICE, DTYPE)
    for layer, sd in zip(stack._stu_layers, states):
        layer.load_state_dict(sd)
    return stack, list(stack.parameters())


def as_fn(model):
    if isinstance(model, torch.nn.Module):
        return lambda x, lengths, offsets, N: model(x=x, x_lengths=lengths, x_offsets=offsets, max_seq_len=N,
                                                    num_targets=None)
    return model


def step(fn, params, inputs):
    x, lengths, offsets, N = inputs
    x = x.detach().requires_grad_(True)
    dout = torch.ones_like(x)  # a fixed output gradient

    def run():
        out = fn(x, lengths, offsets, N)
        return torch.autograd.grad(out, [x] + params, dout)

    return run


def launches(run):
    """Kernels, and memcpy / memset, on the GPU in one call of run()."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = copies = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if e.name.startswith(("Memcpy", "Memset")):
                copies += 1
            else:
                kernels += 1
    return kernels, copies


def variants(gr_stu):
    v = [("torchfuse STULayer", lambda cfg, st: ours(cfg, st)),
         ("torchfuse STULayer, torch.compile", ours_compiled),
         ("plain PyTorch (eager)", plain),
         ("torch.compile of plain", compiled)]
    if gr_stu is not None:
        v.append(("GR STULayer (Triton)", lambda cfg, st: gr_layers(gr_stu, cfg, st)))
        if hasattr(torchfuse, "hstu_compute_output"):
            v.append(("GR STULayer + compat.gr.patch()", lambda cfg, st: gr_layers(gr_stu, cfg, st)))
    return v


def measure(cfg, n_layers, variant_list, quick, count=False):
    """({label: (us, launches or None, output's max difference to torchfuse's / its max)}, batch, errors)
    at the largest batch (halving from the config's) that fits every variant."""
    _, B, _, _, _, _ = cfg
    while B >= 1:
        states = []
        for i in range(n_layers):
            torch.manual_seed(i)
            layer = STULayer(layer_config(cfg)).to(DTYPE)
            states.append({k: v.to(DEVICE) for k, v in layer.state_dict().items()})
        inputs = batch_inputs(cfg, B)
        results, errors, first = {}, [], None
        try:
            for label, build in variant_list:
                patched = "patch()" in label
                if patched:
                    torchfuse.compat.gr.patch()
                us = n = diff = None
                try:
                    model, params = build(cfg, states)
                    fn = as_fn(model)
                    with torch.no_grad():
                        out = fn(*inputs).float()
                    if first is None:
                        first = out
                    diff = (out - first).abs().max().item() / max(first.abs().max().item(), 1e-30)
                    out = None
                    run = step(fn, params, inputs)
                    us = C.bench_us(run, quick)
                    if count:
                        try:
                            n = launches(run)
                        except Exception as e:  # noqa: BLE001
                            errors.append(f"{label}: launch count: {type(e).__name__}: {e}")
                except torch.OutOfMemoryError:
                    raise
                except Exception as e:  # noqa: BLE001  (a peer that fails at a shape is reported, not fatal)
                    # one line: a triton CompilationError's message is a source excerpt, its cause the error
                    msg = (str(e).splitlines() or [""])[0]
                    cause = e.__cause__
                    why = f" ({type(cause).__name__}: {(str(cause).splitlines() or [''])[0]})" if cause else ""
                    errors.append(f"{label} at {cfg[0]}, {n_layers} layer(s): {type(e).__name__}: {msg}{why}")
                finally:
                    if patched:
                        torchfuse.compat.gr.unpatch()
                results[label] = (us, n, diff)
                model = params = run = fn = None
                torch.cuda.empty_cache()
            return results, B, errors
        except torch.OutOfMemoryError:
            results = model = params = run = fn = first = out = None
            torch.cuda.empty_cache()
            B //= 2
    return {}, 0, []


def memory_rows(cfg, quick):
    rows = []
    _, B, _, _, _, _ = cfg
    inputs = batch_inputs(cfg, B)
    torch.manual_seed(0)
    sd = {k: v.to(DEVICE) for k, v in STULayer(layer_config(cfg)).to(DTYPE).state_dict().items()}
    for rn, ru, ry in ((False, False, True), (True, False, True), (False, True, True), (True, True, True),
                       (False, False, False), (True, True, False)):
        try:
            model, params = ours(cfg, [sd], recompute_normed_x=rn, recompute_uvqk=ru, recompute_y=ry)
            x, lengths, offsets, N = inputs
            xi = x.detach().requires_grad_(True)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = as_fn(model)(xi, lengths, offsets, N)
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
            out = None
            us = C.bench_us(step(as_fn(model), params, inputs), quick)
            rows.append([str(rn), str(ru), str(ry), C.fmt(kept / 2**20, 0), C.fmt(us / 1e3, 2)])
        except torch.OutOfMemoryError:
            rows.append([str(rn), str(ru), str(ry), "out of memory", "-"])
        finally:
            model = params = out = None
            torch.cuda.empty_cache()
    return rows


def output_kernel_rows(quick):
    """hstu_compute_output's fused kernels alone (torch.ops.torchfuse.hstu_output_fwd / _bwd, without
    the GEMM) at each config's rows and width, against the bytes they must move over copy bandwidth;
    LayerNorm, SiLU on u, concatenation [u, attn, y], dropout 0 and 0.1. Eager: the same section in
    PyTorch ops (norm, multiply, cat, dropout), forward."""
    from torchfuse import reference
    fwd, bwd = torch.ops.torchfuse.hstu_output_fwd.default, torch.ops.torchfuse.hstu_output_bwd.default
    copy_gbs = C.copy_bandwidth_gbs(quick)
    rows = []
    for name in ("b", "a"):
        label, B, N, _, H, D = CONFIGS[name]
        L, n = B * (3 * N // 4), H * D  # lengths U[N/2, N]: 3N/4 rows per sequence on average
        attn, u = (torch.randn(L, n, device=DEVICE, dtype=DTYPE) for _ in range(2))
        w, b = torch.randn(n, device=DEVICE, dtype=DTYPE), torch.randn(n, device=DEVICE, dtype=DTYPE)
        for p in (0.0, 0.1):
            y, mean, rstd, rng = fwd(attn, u, w, b, 1e-6, 0, 1, 1, True, True, p, 0, None)
            dy = torch.randn_like(y)
            t_f = C.bench_us(lambda: fwd(attn, u, w, b, 1e-6, 0, 1, 1, True, True, p, 0, None), quick)
            t_b = C.bench_us(lambda: bwd(dy, attn, u, w, b, mean, rstd, rng, 0, 1, 1, True, True, p, True), quick)

            def eager():
                y_ = torch.nn.functional.silu(u.float())
                z = torch.cat([y_, attn.float(), y_ * torch.nn.functional.layer_norm(attn.float(), (n,), w.float(),
                                                                                      b.float(), 1e-6)], 1)
                return torch.nn.functional.dropout(z, p, training=True).to(DTYPE)
            t_e = C.bench_us(eager, quick)
            el = attn.element_size()
            fb, bb = L * n * el * 5, L * n * el * 7  # fwd: read attn, u, write 3n; bwd: read attn, u, dy (3n), write 2n
            for what, t, nb in (("forward", t_f, fb), ("backward", t_b, bb)):
                rows.append([f"{label}: {L} x {n}", p, what, C.fmt(t, 1), C.fmt(nb / (t * 1e-6) / 1e9, 0),
                             f"{nb / (t * 1e-6) / 1e9 / copy_gbs * 100:.0f}%",
                             C.fmt(t_e, 1) if what == "forward" else "-",
                             C.ratio(t_e, t) if what == "forward" else "-"])
            y = dy = mean = rstd = rng = None
        attn = u = None
        torch.cuda.empty_cache()
    return rows, copy_gbs


def run(args):
    rep = C.Report("hstu_layer", "STU layer and 4-layer stack, forward + backward, bf16")
    gr_stu = load_gr(args.peers)
    vs = variants(gr_stu)
    rep.peers = [label for label, _ in vs if not label.startswith("torchfuse")]
    if gr_stu is not None and not hasattr(torchfuse, "hstu_compute_output"):
        rep.notes.append("GR STULayer + compat.gr.patch(): not measured (this build has no "
                         "torchfuse.hstu_compute_output)")
    names = ["b"] if args.quick else ["b", "a"]
    for n_layers in (1, 4):
        rows = []
        for name in names:
            cfg = CONFIGS[name]
            results, B, errors = measure(cfg, n_layers, vs, args.quick, count=(name == "b" and n_layers == 1))
            rep.notes += errors
            if B != cfg[1]:
                rep.notes.append(f"{cfg[0]}, {n_layers} layer(s): batch {B} for every variant (the largest that "
                                 "fits them all)" if B else f"{cfg[0]}, {n_layers} layer(s): no batch fits")
            base = results.get("torchfuse STULayer", (None, None, None))[0]
            for label, _ in vs:
                us, n, diff = results.get(label, (None, None, None))
                row = [cfg[0], label, B, C.fmt(None if us is None else us / 1e3, 3), C.ratio(us, base),
                       "-" if diff is None else f"{diff:.1e}"]
                if n_layers == 1:
                    row.append("-" if n is None else f"{n[0]} + {n[1]}")
                rows.append(row)
        cols = ["config", "variant", "batch", "fwd+bwd ms", "torchfuse speed-up", "output vs torchfuse (max rel)"]
        if n_layers == 1:
            cols.append("GPU launches, kernels + copies (config b)")
        rep.table(f"{'One STU layer' if n_layers == 1 else 'Stack of 4 STU layers'}, forward + backward", cols, rows)
    out_rows, copy_gbs = output_kernel_rows(args.quick)
    rep.roofline = f"device-to-device copy {copy_gbs:.0f} GB/s (read + write), measured in this run (output op table)"
    rep.table("hstu_compute_output's fused kernels alone (no GEMM): bytes they must move over copy bandwidth",
              ["rows x width", "dropout", "pass", "us", "GB/s", "% of copy", "eager fwd us", "vs eager"], out_rows)
    if not args.quick:
        rep.table("torchfuse STULayer at config (a): what the forward keeps for the backward, by recompute choice",
                  ["recompute_normed_x", "recompute_uvqk", "recompute_y", "kept MiB", "fwd+bwd ms"],
                  memory_rows(CONFIGS["a"], False))
    return rep


if __name__ == "__main__":
    sys.exit(C.standalone("hstu_layer", run, doc=__doc__))
