"""A/B of the HSTU backward kernels in one process: the same inputs, `torch.ops.torchfuse.hstu_bwd` timed
in each of the chosen forms (`--forms`, comma-separated, in turns, best of `--rounds`):
    mma        the mma.sync kernel (TORCHFUSE_HSTU_SM90_BWD=0)
    1blk       the sm_90a wgmma kernel, one block per work item (TORCHFUSE_HSTU_BWD_PERSISTENT=0), L2 sections
    1blk1sec   the same, blocks in one section (TORCHFUSE_HSTU_BWD_SECTION=0)
    pers       the sm_90a wgmma kernel, persistent (one block per SM, items from a counter; the default)
    pers1sec   the same, items in one section
    pers4b     `pers` with dK / dV written by 4-byte stores (TORCHFUSE_HSTU_BWD_VEC_STORE=0; the default:
               16-byte stores after a quad transpose)
    persred    `pers` with dQ added by red.global.add from the registers (TORCHFUSE_HSTU_BWD_DQ=red) instead
               of TMA reduce-adds from shared memory (the other forms: the default, which head dims up to 128
               take; 192 / 256 always add with red.global.add: there `persred` is `pers`)
(wgmma where it applies: head dims up to 256). The gradients of the wgmma forms are compared with mma.sync's
(max abs difference, against the largest gradient; `mma` in --forms), dK / dV of `pers` with those of
`1blk` (the same arithmetic per item: expected 0), and with `persred` in --forms beside `pers` dQ and dK / dV
of the two (dQ: the same sums, added in another order; dK, dV: expected 0). With generative-recommenders
on the path, its Triton backward is timed on the same inputs. TFLOP/s by the issue's count (2.5x
bench_hstu.flops_fwd). Shapes: bench_hstu's five (full length and U[N/2, N], 16x4096x256 included) plus its targets and window cases;
--shapes first: 16x1024x128 full only (a smoke run); d256: the head-dim-256 ones; b128: 128x1024x128 only; short: N <= 2048 and head dims <= 128.

    python benchmarks/ab_hstu_bwd.py [--rounds 3] [--out ab_bwd.md] [--no-triton] [--shapes all|first|d256|b128]
                                     [--forms mma,1blk,pers]   (e.g. --forms persred,pers: the dQ A/B)
"""
import argparse
import os
import sys

import torch

import torchfuse  # noqa: F401
from torchfuse._timing import device_time_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hstu as bh  # noqa: E402

# form: (column title, TORCHFUSE_HSTU_SM90_BWD, TORCHFUSE_HSTU_BWD_SECTION, TORCHFUSE_HSTU_BWD_PERSISTENT,
# TORCHFUSE_HSTU_BWD_DQ, TORCHFUSE_HSTU_BWD_VEC_STORE); "" sets the variable empty, which the library reads
# as unset (the default)
FORMS = {
    "mma": ("mma.sync", "0", "", "", "", ""),
    "1blk1sec": ("wgmma, 1 block/item, one section", "1", "0", "0", "", ""),
    "1blk": ("wgmma, 1 block/item", "1", "", "0", "", ""),
    "pers1sec": ("wgmma, persistent, one section", "1", "0", "1", "", ""),
    "pers": ("wgmma, persistent", "1", "", "1", "", ""),
    "persred": ("wgmma, persistent, dQ red.add", "1", "", "1", "red", ""),
    "pers4b": ("wgmma, persistent, dK/dV 4-byte stores", "1", "", "1", "", "0"),
}
ENV_NAMES = ("TORCHFUSE_HSTU_SM90_BWD", "TORCHFUSE_HSTU_BWD_SECTION", "TORCHFUSE_HSTU_BWD_PERSISTENT",
             "TORCHFUSE_HSTU_BWD_DQ", "TORCHFUSE_HSTU_BWD_VEC_STORE")
assert all(len(v) == 1 + len(ENV_NAMES) for v in FORMS.values())


def set_env(form):
    for k, v in zip(ENV_NAMES, FORMS[form][1:]):
        os.environ[k] = v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--shapes", default="all", choices=["all", "first", "d256", "b128", "short"],
                    help="all; 'first' (16x1024x128 full only: a smoke run); 'd256' (the head-dim-256 shapes "
                         "only); 'b128' (128x1024x128 only)")
    ap.add_argument("--forms", default="mma,1blk,pers",
                    help="comma-separated, from: " + ", ".join(FORMS))
    a = ap.parse_args()
    forms = [f for f in a.forms.split(",") if f]
    bad = [f for f in forms if f not in FORMS]
    if bad or not forms:
        ap.error(f"unknown forms {bad}; choose from {list(FORMS)}")
    wg = [f for f in forms if f != "mma"]
    triton_mha = None
    if not a.no_triton:
        try:
            from generative_recommenders.common import set_use_runtime_max_seq_len
            from generative_recommenders.ops.triton import triton_hstu_attention as gr_mod
            set_use_runtime_max_seq_len(True)
            bh.restrict_triton_configs(gr_mod)
            triton_mha = gr_mod.triton_hstu_mha
        except ImportError as e:
            print(f"Triton peer not run: {e}", file=sys.stderr)
    cases = []
    for B, N, D in bh.SHAPES:
        cases.append(((B, N, D), "full", dict(varied=False)))
        cases.append(((B, N, D), "U[N/2,N]", dict(varied=True)))
    # targets last: Triton's backward has stopped with an illegal memory access on jagged rows in some
    # runs (results/hstu_h100.md, session 4), which ends the process
    cases += [((16, 4096, 128), "U[N/2,N], window 256", dict(varied=True, window=256)),
              ((16, 4096, 128), "U[N/2,N], 16 targets", dict(varied=True, targets=16))]
    if a.shapes == "first":
        cases = cases[:1]
    elif a.shapes == "d256":
        cases = [c for c in cases if c[0][2] == 256]
    elif a.shapes == "b128":
        cases = [c for c in cases if c[0] == (128, 1024, 128)]
    elif a.shapes == "short":  # N <= 2048, head dims <= 128
        cases = [c for c in cases if c[0][1] <= 2048 and c[0][2] <= 128]
    both = "pers" in forms and "1blk" in forms
    dq_ab = "pers" in forms and "persred" in forms
    head = ["B x N x D", "lengths"] + [FORMS[f][0] for f in forms]
    head += ["pers x 1blk"] if both else []  # 1blk's time / pers's
    head += ["Triton"] + [f"{f} x Triton" for f in wg]  # speed-ups: Triton's time / the form's
    head += ["max diff / max (vs mma.sync)"] if "mma" in forms and wg else []
    head += ["dK, dV: persistent - 1 block"] if both else []
    head += ["pers - persred: dQ / max; dK, dV"] if dq_ab else []
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    saved = {k: os.environ.get(k) for k in ENV_NAMES}
    for (B, N, D), label, kw in cases:
        c = bh.make_case(B, N, D, **kw)
        fl = 2.5 * bh.flops_fwd(c)
        q, k, v, offsets, nt, window, alpha = c["q"], c["k"], c["v"], c["offsets"], c["nt"], c["window"], c["alpha"]
        dout = torch.randn_like(v)

        def ours():
            return torch.ops.torchfuse.hstu_bwd(dout, q, k, v, offsets, nt, None, N, alpha, None, 0, window, 0, 1,
                                                False)
        best = {f: float("inf") for f in forms}
        for _ in range(a.rounds):
            for f in forms:
                set_env(f)
                best[f] = min(best[f], device_time_us(ours, "cuda", warmup=2, rep=10))
        grads = {}
        for f in forms:
            set_env(f)
            grads[f] = ours()[:3]
        t_tri = None
        if triton_mha is not None:
            try:
                for x in (q, k, v):
                    x.requires_grad_(True)
                out = triton_mha(N, alpha, q, k, v, offsets, nt, window, 0)
                t_tri = device_time_us(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), "cuda",
                                       warmup=2, rep=10)
                del out
            except Exception as ex:  # a peer failure must not hide our figures
                print(f"triton failed at {B, N, D, label}: {ex}", file=sys.stderr)
        row = [f"{B}x{N}x{D}", label] + [f"{fl / (best[f] * 1e-6) / 1e12:.0f}" for f in forms]
        if both:
            row.append(f"{best['1blk'] / best['pers']:.2f}")
        row.append("-" if t_tri is None else f"{fl / (t_tri * 1e-6) / 1e12:.0f}")
        row += ["-" if t_tri is None else f"{t_tri / best[f]:.2f}" for f in wg]
        if "mma" in forms and wg:
            diff = max((x.float() - y.float()).abs().max().item() for f in wg for x, y in zip(grads["mma"], grads[f]))
            top = max(x.float().abs().max().item() for x in grads["mma"])
            row.append(f"{diff:.1e} / {top:.1e}")
        if both:
            d = max((x.float() - y.float()).abs().max().item() for x, y in zip(grads["pers"][1:], grads["1blk"][1:]))
            row.append(f"{d:.1e}")
        if dq_ab:
            gt, gr = grads["pers"], grads["persred"]
            dq = (gt[0].float() - gr[0].float()).abs().max().item()
            dkv = max((x.float() - y.float()).abs().max().item() for x, y in zip(gt[1:], gr[1:]))
            row.append(f"{dq:.1e} / {gr[0].float().abs().max().item():.1e}; {dkv:.1e}")
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
        del c, q, k, v, dout, grads
        torch.cuda.empty_cache()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TFLOP/s backward (2.5x the "
                    f"forward's FLOPs), bf16, H = {bh.H}\n\n{text}\n")


if __name__ == "__main__":
    main()
