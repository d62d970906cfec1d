"""HSTU attention (bf16, causal, H = 4) against PyTorch eager, torch.compile of it, generative-recommenders'
Triton `triton_hstu_mha` (given --peers), and F.scaled_dot_product_attention(is_causal=True) (softmax
flash attention, the yardstick), on one GPU, in one run. torchfuse runs with validate=False (no host-side
check of the offsets), as a training loop with known-good jagged metadata would, under the default
backend (torchfuse.backends.hstu); the forward is also timed with each backend forced. A second table
times head dims the 16-bit kernels take on a zero-padded copy (25, 100) against the dims they pad to, and
attention dropout against dropout off.

TFLOP/s use one count for every row: forward = sum over b of 2*H*(Dqk+Dv)*len_b^2/2, backward = 2.5x
forward (so windowed rows count the causal work they skip: an "effective" rate). SDPA runs on the padded
(B, H, N, D) tensors at full length, so its figure is listed on full-length rows only.

    python benchmarks/bench_hstu.py [--quick] [--peers DIR] [--out results.md]

--peers: a folder holding generative_recommenders/ (fetched code, never committed). Its autotuner
searches a subset of its configs (BLOCK_M >= 64 / num_warps >= 4 forward, BLOCK_N >= 64 / num_warps >= 4
backward: the large-tile ones that win at these shapes).
"""
import sys

import torch
import torch.nn.functional as F

import torchfuse

import _common as C

SHAPES = [(16, 1024, 128), (16, 4096, 128), (128, 1024, 128), (16, 2048, 64), (16, 4096, 256)]
SPECIAL = [((16, 4096, 128), "U[N/2,N], 16 targets", dict(varied=True, targets=16)),
           ((16, 4096, 128), "U[N/2,N], max_attn_len 256", dict(varied=True, window=256))]
H = 4


def make_case(B, N, D, varied, targets=0, window=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.full((B,), N) if not varied else torch.randint(N // 2, N + 1, (B,), generator=g)
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    offsets[1:] = lens.cumsum(0)
    L = int(offsets[-1])
    dev = "cuda"
    q, k, v = (torch.randn(L, H, D, device=dev, dtype=torch.bfloat16, generator=None) for _ in range(3))
    nt = torch.full((B,), targets, dtype=torch.int64, device=dev) if targets else None
    return dict(q=q, k=k, v=v, offsets=offsets.to(dev), lens=lens, N=N, D=D, B=B, nt=nt, window=window,
                alpha=1.0 / D ** 0.5)


def flops_fwd(c):
    return float(sum(2 * H * (2 * c["D"]) * int(n) ** 2 / 2 for n in c["lens"]))


# ---- the eager reference (generative-recommenders' pytorch_hstu_mha, jagged -> padded -> dense) ----


def valid_mask(lens, N, nt, window, device):
    ids = torch.arange(N, device=device).view(1, N)
    max_ids = lens.to(device).view(-1, 1, 1)
    if nt is not None:
        max_ids = max_ids - nt.view(-1, 1, 1)
        ids = torch.minimum(ids.view(1, 1, N), max_ids)
        row, col = ids.view(-1, N, 1), ids.view(-1, 1, N)
    else:
        row, col = ids.view(1, N, 1), ids.view(1, 1, N)
    dist = row - col
    m = torch.eye(N, dtype=torch.bool, device=device).view(1, N, N) | (dist > 0)
    if window > 0:
        m = m & (dist <= window)
    return m.unsqueeze(1)  # (B or 1, 1, N, N)


def eager_hstu(q, k, v, idx, mask, B, N, alpha):
    L, Hh, D = q.shape

    def pad(x):
        out = x.new_zeros(B * N, Hh, x.shape[-1])
        out[idx] = x
        return out.view(B, N, Hh, -1).transpose(1, 2)

    pq, pk, pv = pad(q), pad(k), pad(v)
    p = F.silu(alpha * (pq @ pk.transpose(-1, -2))) / N * mask
    out = (p @ pv).transpose(1, 2).reshape(B * N, Hh, -1)
    return out[idx]


def restrict_triton_configs(mod):
    fwd = [c for c in mod._hstu_attn_fwd.configs if c.kwargs.get("BLOCK_M", 0) >= 64 and c.num_warps >= 4]
    bwd = [c for c in mod._hstu_attn_bwd.configs if c.kwargs.get("BLOCK_N", 0) >= 64 and c.num_warps >= 4]
    if fwd:
        mod._hstu_attn_fwd.configs = fwd
    if bwd:
        mod._hstu_attn_bwd.configs = bwd
    return len(fwd), len(bwd)


def fwd_bwd_us(fn, inputs, dout, quick):
    """(forward us, backward us): the backward on one retained graph."""
    with torch.no_grad():
        t_f = C.bench_us(fn, quick)
    for x in inputs:
        x.requires_grad_(True)
    out = fn()
    t_b = C.bench_us(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True), quick)
    for x in inputs:
        x.requires_grad_(False)
    return t_f, t_b


def load_triton(path):
    if not path:
        return None
    grc = C.import_peer("generative_recommenders.common", path)
    mod = C.import_peer("generative_recommenders.ops.triton.triton_hstu_attention", path)
    if grc is None or mod is None:
        return None
    grc.set_use_runtime_max_seq_len(True)
    restrict_triton_configs(mod)
    return mod.triton_hstu_mha


# head dims the 16-bit kernels take on a zero-padded copy, each beside the dim it is padded to (lengths
# U[N/2, N]): GR's MovieLens-1M config (2 heads x 25 there; H = 4 here) and a mid-size dim
PADDED = [((128, 200, 25), 32), ((16, 1024, 100), 104)]
DROPOUT_SHAPES = [(16, 1024, 128), (16, 4096, 128)]


def padded_and_dropout(args):
    """Forward / backward microseconds of the padded head dims against the dims they pad to (the copy's
    cost is the difference), and of attention dropout (mma.sync on every GPU) against dropout off."""
    rows = []

    def times(B, N, D, **kw):
        c = make_case(B, N, D, varied=True)
        q, k, v = c["q"], c["k"], c["v"]
        return fwd_bwd_us(lambda: torchfuse.hstu_attention(q, k, v, c["offsets"], N, c["alpha"], validate=False, **kw),
                          [q, k, v], torch.randn_like(v), args.quick)

    for (B, N, D), Dk in PADDED:
        t_p, t_k = times(B, N, D), times(B, N, Dk)
        rows.append([f"{B}, {N}, {D}", f"head dim {D} (padded to {Dk})", f"{t_p[0]:.0f} / {t_p[1]:.0f}",
                     f"{t_k[0]:.0f} / {t_k[1]:.0f}", f"{C.ratio(t_p[0], t_k[0])} / {C.ratio(t_p[1], t_k[1])}"])
    for B, N, D in DROPOUT_SHAPES:
        t_d = times(B, N, D, dropout_p=0.1)
        t_0 = times(B, N, D)
        with torchfuse.backends.use(hstu="mma"):
            t_m = times(B, N, D)
        rows.append([f"{B}, {N}, {D}", "dropout 0.1 vs off (auto)", f"{t_d[0]:.0f} / {t_d[1]:.0f}",
                     f"{t_0[0]:.0f} / {t_0[1]:.0f}", f"{C.ratio(t_d[0], t_0[0])} / {C.ratio(t_d[1], t_0[1])}"])
        rows.append([f"{B}, {N}, {D}", "dropout 0.1 vs off (mma)", f"{t_d[0]:.0f} / {t_d[1]:.0f}",
                     f"{t_m[0]:.0f} / {t_m[1]:.0f}", f"{C.ratio(t_d[0], t_m[0])} / {C.ratio(t_d[1], t_m[1])}"])
        torch.cuda.empty_cache()
    return ("Padded head dims and attention dropout, us (lower is better; lengths U[N/2, N]); x = the row's "
            "time / the baseline's, so the padded copy's or the dropout's cost.",
            ["B, N, D", "case", "fwd / bwd us", "baseline fwd / bwd us", "time / baseline (fwd / bwd)"], rows)


def run(args):
    rep = C.Report("hstu", "HSTU attention, bf16, causal, H = 4")
    peak = C.tensor_peak_tflops()
    rep.roofline = (f"dense bf16 tensor-core peak {peak:.0f} TFLOP/s" if peak else "tensor-core peak unknown for "
                    "this device") + " (TFLOP/s below by the count in the script's docstring)"
    triton_mha = load_triton(args.peers)
    rep.peers = (["GR Triton triton_hstu_mha (autotune subset)"] if triton_mha else []) + [
        "SDPA flash (softmax, full lengths)", "eager PyTorch", "torch.compile"]
    cases = [(s, "full", dict(varied=False)) for s in SHAPES] + SPECIAL
    if args.quick:
        cases = cases[:2] + SPECIAL
    rows, triton_errors = [], {}
    for (B, N, D), label, kw in cases:
        c = make_case(B, N, D, **kw)
        q, k, v, offsets, nt, window, alpha = c["q"], c["k"], c["v"], c["offsets"], c["nt"], c["window"], c["alpha"]
        fl = flops_fwd(c)

        def tf(t, mult=1.0):
            return "-" if t is None else f"{fl * mult / (t * 1e-6) / 1e12:.0f}"

        dout = torch.randn_like(v)

        def ours():
            return torchfuse.hstu_attention(q, k, v, offsets, N, alpha, num_targets=nt, max_attn_len=window,
                                            validate=False)

        t_o = fwd_bwd_us(ours, [q, k, v], dout, args.quick)
        t_k = {}
        for backend in ("sm90", "mma"):
            with torchfuse.backends.use(hstu=backend), torch.no_grad():
                t_k[backend] = C.bench_us(ours, args.quick)
        t_t = (None, None)
        if triton_mha is not None:
            try:
                t_t = fwd_bwd_us(lambda: triton_mha(N, alpha, q, k, v, offsets, nt, window, 0), [q, k, v], dout,
                                 args.quick)
            except Exception as e:  # noqa: BLE001  (a peer failure must not hide our figures)
                print(f"# Triton failed at {B, N, D, label}: {e}", file=sys.stderr)
                # one line: a triton CompilationError's message is a source excerpt
                triton_errors.setdefault(type(e).__name__, []).append(f"{B}x{N}x{D} {label}")
        t_s = t_e = t_c = (None, None)
        if label == "full":
            pq, pk, pv = (x.view(B, N, H, D).transpose(1, 2) for x in (q, k, v))
            with torch.no_grad():
                t_s = (C.bench_us(lambda: F.scaled_dot_product_attention(pq, pk, pv, is_causal=True), args.quick),
                       None)
            lens = c["lens"]
            idx = (torch.arange(B).repeat_interleave(lens) * N + torch.cat([torch.arange(int(n)) for n in lens])).cuda()
            mask = valid_mask(lens, N, nt, window, "cuda")
            try:
                t_e = fwd_bwd_us(lambda: eager_hstu(q, k, v, idx, mask, B, N, alpha), [q, k, v], dout, args.quick)
            except torch.OutOfMemoryError:
                pass
            torch.cuda.empty_cache()
            if not args.quick:
                torch._dynamo.reset()  # a fresh compile per shape: past the recompile limit a shape runs eager
                comp = C.compile_fn(eager_hstu)
                try:
                    t_c = fwd_bwd_us(lambda: comp(q, k, v, idx, mask, B, N, alpha), [q, k, v], dout, args.quick)
                except torch.OutOfMemoryError:
                    pass
                torch.cuda.empty_cache()
        rows.append([f"{B}, {N}, {D}", label, tf(t_o[0]), tf(t_o[1], 2.5),
                     f"{100 * fl / (t_o[0] * 1e-6) / 1e12 / peak:.0f}%" if peak and not window else "-",
                     f"{tf(t_k['sm90'])} / {tf(t_k['mma'])}", tf(t_t[0]), tf(t_t[1], 2.5),
                     C.ratio(t_t[0], t_o[0]), C.ratio(t_t[1], t_o[1]), tf(t_s[0]), C.ratio(t_s[0], t_o[0]),
                     f"{tf(t_e[0])} / {tf(t_e[1], 2.5)}", f"{tf(t_c[0])} / {tf(t_c[1], 2.5)}"])
        c = q = k = v = None  # freed before the next case
        torch.cuda.empty_cache()
    if triton_errors:
        failed = sum(len(v) for v in triton_errors.values())
        rep.notes.append(f"GR Triton `triton_hstu_mha` failed at {failed} of {len(cases)} shapes on this machine's "
                         "Triton (" + "; ".join(f"{k}: {', '.join(v)}" for k, v in triton_errors.items()) +
                         "): those Triton columns are empty")
        if failed == len(cases):
            rep.peers.remove("GR Triton triton_hstu_mha (autotune subset)")
    rep.table("TFLOP/s (higher is better; windowed rows count the causal work they skip, so no % of peak); "
              "x = their time / ours.",
              ["B, N, D", "lengths", "ours fwd", "ours bwd", "fwd % of peak", "fwd sm90 / mma", "Triton fwd",
               "Triton bwd", "fwd vs Triton", "bwd vs Triton", "SDPA fwd", "fwd vs SDPA", "eager fwd / bwd",
               "compile fwd / bwd"], rows)
    rep.table(*padded_and_dropout(args))
    return rep


if __name__ == "__main__":
    sys.exit(C.standalone("hstu", run, doc=__doc__))
