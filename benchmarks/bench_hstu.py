"""HSTU attention (bf16, causal, H = 4) against PyTorch eager, torch.compile of it, generative-recommenders'
Triton `triton_hstu_mha`, and F.scaled_dot_product_attention(is_causal=True) (softmax flash attention,
the yardstick), on one GPU, in one run. torchfuse runs with validate=False (no host-side check of the
offsets, hence no sync per call), as a training loop with known-good jagged metadata would.

TFLOP/s use the issue's count for every row: forward = sum over b of 2*H*(Dqk+Dv)*len_b^2/2, backward
= 2.5x forward (so windowed rows count the causal work they skip: an "effective" rate). SDPA runs on
the padded (B, H, N, D) tensors at full length, so its figure is listed on full-length rows only.

generative-recommenders must be importable (PYTHONPATH), never committed: fetch
meta-recsys/generative-recommenders into a git-ignored folder. Its autotuner searches, by default, a
subset of its own configs (BLOCK_M >= 64 / num_warps >= 4 forward, BLOCK_N >= 64 / num_warps >= 4
backward: the large-tile ones that win at these shapes) so the run fits the device budget;
--triton-full-autotune searches them all.

    python benchmarks/bench_hstu.py [--quick] [--compile] [--no-eager] [--out results.md]
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import torchfuse
from torchfuse._timing import back_to_back_us, device_time_us

SHAPES = [(16, 1024, 128), (16, 4096, 128), (128, 1024, 128), (16, 2048, 64), (16, 4096, 256)]
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


def restrict_triton_configs(mod, no_sp=False):
    fwd = [c for c in mod._hstu_attn_fwd.configs if c.kwargs.get("BLOCK_M", 0) >= 64 and c.num_warps >= 4]
    bwd = [c for c in mod._hstu_attn_bwd.configs if c.kwargs.get("BLOCK_N", 0) >= 64 and c.num_warps >= 4
           and not (no_sp and c.kwargs.get("SEQUENCE_PARALLEL", False))]
    if fwd:
        mod._hstu_attn_fwd.configs = fwd
    if bwd:
        mod._hstu_attn_bwd.configs = bwd
    return len(fwd), len(bwd)


def bench(fn, inputs, dout, fwd_only=False):
    """(fwd us, bwd us): backward timed on a retained graph."""
    with torch.no_grad():
        t_f = device_time_us(fn, "cuda", warmup=3, rep=15)
    if fwd_only:
        return t_f, None
    for x in inputs:
        x.requires_grad_(True)
    out = fn()
    t_b = device_time_us(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True), "cuda", warmup=2, rep=10)
    for x in inputs:
        x.requires_grad_(False)
    return t_f, t_b


def bench_b2b(fn, inputs, dout):
    """(fwd us, bwd us), back to back."""
    with torch.no_grad():
        t_f = back_to_back_us(fn)
    for x in inputs:
        x.requires_grad_(True)
    out = fn()
    t_b = back_to_back_us(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True))
    for x in inputs:
        x.requires_grad_(False)
    return t_f, t_b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="full-length shapes (and the targets / window cases) only")
    ap.add_argument("--compile", action="store_true", help="torch.compile of the eager reference (full-length rows)")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--triton-full-autotune", action="store_true")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--triton-no-sp", action="store_true",
                    help="leave Triton's SEQUENCE_PARALLEL backward configs out of its autotune subset")
    ap.add_argument("--cases", default="full,varied,special",
                    help="comma list of: full (full-length rows), varied (lengths ~ U[N/2, N]), special (targets, window)")
    ap.add_argument("--b2b", action="store_true",
                    help="also time ours and Triton back to back (10 calls between two events): kernel-bound figures")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    try:
        if args.no_triton:
            raise ImportError("--no-triton")
        import generative_recommenders.common as grc
        from generative_recommenders.ops.triton import triton_hstu_attention as gr_mod

        grc.set_use_runtime_max_seq_len(True)
        note = "full autotune" if args.triton_full_autotune else "autotune subset %d fwd / %d bwd configs" % (
            restrict_triton_configs(gr_mod, args.triton_no_sp))
        triton_mha = gr_mod.triton_hstu_mha
    except ImportError as e:  # noqa: F841
        print(f"generative-recommenders not importable ({e}); Triton column skipped", file=sys.stderr)
        triton_mha, note = None, "not run"

    want = set(args.cases.split(","))
    if args.quick:
        want.discard("varied")
    cases = []
    for (B, N, D) in SHAPES:
        if "full" in want:
            cases.append(((B, N, D), "full", dict(varied=False)))
        if "varied" in want:
            cases.append(((B, N, D), "len~U[N/2,N]", dict(varied=True)))
    if "special" in want:
        special = [((16, 4096, 128), "U[N/2,N], 16 targets", dict(varied=True, targets=16)),
                   ((16, 4096, 128), "U[N/2,N], max_attn_len=256", dict(varied=True, window=256))]
        cases = special + cases if args.cases.startswith("special") else cases + special

    dev = torch.cuda.get_device_name()
    lines = [f"# HSTU attention, bf16, causal, H={H}, {dev}, torch {torch.__version__}", "",
             f"Triton: generative-recommenders triton_hstu_mha ({note}). TFLOP/s by the issue's FLOP count.", "",
             "| B, N, D | lengths | ours fwd | ours bwd | fwd: mma.sync / wgmma ping-pong / wgmma plain | Triton fwd | Triton bwd | fwd x Triton | bwd x Triton "
             "| SDPA fwd | fwd x SDPA | eager fwd/bwd | compile fwd/bwd | max abs diff vs Triton |"
             + (" b2b: ours fwd/bwd | b2b: Triton fwd/bwd | b2b: x Triton fwd/bwd |" if args.b2b else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if args.b2b else "")]
    print("\n".join(lines), flush=True)
    for (B, N, D), label, kw in cases:
        c = make_case(B, N, D, **kw)
        q, k, v, offsets, nt, window, alpha = c["q"], c["k"], c["v"], c["offsets"], c["nt"], c["window"], c["alpha"]
        fl = flops_fwd(c)
        tf = lambda t, mult=1.0: "-" if t is None else f"{fl * mult / (t * 1e-6) / 1e12:.0f}"  # noqa: E731
        dout = torch.randn_like(v)
        ours = lambda: torchfuse.hstu_attention(q, k, v, offsets, N, alpha, num_targets=nt,  # noqa: E731
                                                max_attn_len=window, validate=False)
        t_o = bench(ours, [q, k, v], dout)
        t_o2 = bench_b2b(ours, [q, k, v], dout) if args.b2b else None
        # the same op with each forward kernel forced (0: mma.sync, 1 / 2: the sm_90a wgmma one with / without ping-pong), whichever
        # the dispatch rule picks by default
        saved = os.environ.get("TORCHFUSE_HSTU_SM90")
        t_k = {}
        for env in ("0", "1", "2"):
            os.environ["TORCHFUSE_HSTU_SM90"] = env
            t_k[env], _ = bench(ours, [], None, fwd_only=True)
        if saved is None:
            del os.environ["TORCHFUSE_HSTU_SM90"]
        else:
            os.environ["TORCHFUSE_HSTU_SM90"] = saved
        row = {"ours": t_o}
        diff = "-"
        if triton_mha is not None:
            tri = lambda: triton_mha(N, alpha, q, k, v, offsets, nt, window, 0)  # noqa: E731
            try:
                with torch.no_grad():
                    a, t_ = ours().float(), tri().float()
                    diff = f"{(a - t_).abs().max().item():.1e} (max {a.abs().max().item():.1e})"
                row["triton"] = bench(tri, [q, k, v], dout)
                if args.b2b:
                    row["triton_b2b"] = bench_b2b(tri, [q, k, v], dout)
            except Exception as e:  # a peer failure must not hide our figures
                print(f"triton failed at {B, N, D, label}: {e}", file=sys.stderr)
        sd = "-"
        if label == "full":
            pq, pk, pv = (x.view(B, N, H, D).transpose(1, 2) for x in (q, k, v))
            t_s, _ = bench(lambda: F.scaled_dot_product_attention(pq, pk, pv, is_causal=True), [], None, fwd_only=True)
            row["sdpa"] = (t_s, None)
            sd = tf(t_s)
        eg = cp = "-"
        if not args.no_eager:
            lens = c["lens"]
            idx = (torch.arange(B).repeat_interleave(lens) * N + torch.cat([torch.arange(int(n)) for n in lens])).cuda()
            mask = valid_mask(lens, N, nt, window, "cuda")
            f_e = lambda: eager_hstu(q, k, v, idx, mask, B, N, alpha)  # noqa: E731
            try:
                te = bench(f_e, [q, k, v], dout)
                eg = f"{tf(te[0])}/{tf(te[1], 2.5)}"
            except torch.OutOfMemoryError:
                eg = "OOM"
            torch.cuda.empty_cache()
            if args.compile and label == "full":
                # a fresh compile per shape: past dynamo's recompile limit a shape silently runs eager
                torch._dynamo.reset()
                comp = torch.compile(eager_hstu, dynamic=False)
                f_c = lambda: comp(q, k, v, idx, mask, B, N, alpha)  # noqa: E731
                try:
                    t0 = time.time()
                    f_c()
                    tc = bench(f_c, [q, k, v], dout)
                    cp = f"{tf(tc[0])}/{tf(tc[1], 2.5)}"
                    print(f"  (compile took {time.time() - t0:.0f}s)", file=sys.stderr)
                except torch.OutOfMemoryError:
                    cp = "OOM"
                torch.cuda.empty_cache()
        t_t = row.get("triton", (None, None))
        ratio = lambda a, b: "-" if a is None or b is None else f"{b / a:.2f}"  # noqa: E731
        line = (f"| {B}, {N}, {D} | {label} | {tf(t_o[0])} | {tf(t_o[1], 2.5)} | {tf(t_k['0'])} / {tf(t_k['1'])} / {tf(t_k['2'])} | {tf(t_t[0])} | {tf(t_t[1], 2.5)} | "
                f"{ratio(t_o[0], t_t[0])} | {ratio(t_o[1], t_t[1])} | {sd} | "
                f"{ratio(t_o[0], row['sdpa'][0]) if 'sdpa' in row else '-'} | {eg} | {cp} | {diff} |")
        if args.b2b:
            t_t2 = row.get("triton_b2b", (None, None))
            line += (f" {tf(t_o2[0])}/{tf(t_o2[1], 2.5)} | {tf(t_t2[0])}/{tf(t_t2[1], 2.5)} | "
                     f"{ratio(t_o2[0], t_t2[0])} / {ratio(t_o2[1], t_t2[1])} |")
        print(line, flush=True)
        lines.append(line)
        if args.out:  # row by row, so a run cut short keeps what it measured
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
        del c, q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
