"""Jagged ops against PyTorch index-based code (eager and torch.compile), torch.nested, and
generative-recommenders' Triton concat_2D_jagged / split_2D_jagged (given --peers), on one GPU.

Shape (generative-recommenders' benchmark): B = 1024 samples, history lengths uniform in [100, 3052],
16 candidates each; rows of D = 128 and 512 bf16. concat = [history; candidates] per sample, split its
inverse; to_padded / to_jagged convert the history to (B, max_len, D) and back. GB/s over the fewest
bytes the op must move (every row read once and written once; padding rows written). Backward =
torch.autograd.grad of one retained forward graph.

    python benchmarks/bench_jagged.py [--quick] [--peers DIR] [--out results.md]

--peers: a folder holding generative_recommenders/ (fetched code, never committed).
"""
import sys

import torch

import torchfuse

import _common as C

DIMS = [128, 512]
IMPLS = ["torchfuse", "torch index", "torch.compile", "torch.nested", "GR Triton"]


# ---- plain PyTorch, index-based (also what torch.compile gets) ----


def _rows(offsets, total):
    """Sample id and position of every row of a jagged tensor (no host sync: total is given)."""
    B = offsets.shape[0] - 1
    seg = torch.repeat_interleave(torch.arange(B, device=offsets.device), offsets.diff(), output_size=total)
    return seg, torch.arange(total, device=offsets.device) - offsets[seg]


def torch_concat(vl, vr, ol, orr, tl, tr):
    oo = ol + orr
    seg_l, p_l = _rows(ol, tl)
    seg_r, p_r = _rows(orr, tr)
    pos_l = oo[seg_l] + p_l
    pos_r = oo[seg_r] + ol.diff()[seg_r] + p_r
    out = vl.new_empty((tl + tr, *vl.shape[1:]))
    return out.index_copy(0, pos_l, vl).index_copy(0, pos_r, vr)


def torch_split(v, ol, orr, tl, tr):
    oo = ol + orr
    seg_l, p_l = _rows(ol, tl)
    seg_r, p_r = _rows(orr, tr)
    return v.index_select(0, oo[seg_l] + p_l), v.index_select(0, oo[seg_r] + ol.diff()[seg_r] + p_r)


def torch_to_padded(v, off, L, T):
    seg, p = _rows(off, T)
    B = off.shape[0] - 1
    dense = v.new_zeros((B * L, *v.shape[1:]))
    return dense.index_copy(0, seg * L + p, v).view(B, L, *v.shape[1:])


def torch_to_jagged(dense, off, T):
    seg, p = _rows(off, T)
    B, L = dense.shape[:2]
    return dense.reshape(B * L, *dense.shape[2:]).index_select(0, seg * L + p)


# ---- cases ----


def make_case(D, dtype, B=1024, lo=100, hi=3052, cand=16):
    g = torch.Generator().manual_seed(0)
    ll = torch.randint(lo, hi + 1, (B,), generator=g)
    lr = torch.full((B,), cand)
    ol = torchfuse.complete_cumsum(ll).to("cuda")
    orr = torchfuse.complete_cumsum(lr).to("cuda")
    tl, tr = int(ll.sum()), int(lr.sum())

    def rand(n):
        return torch.randn(n, D, device="cuda", dtype=dtype)

    return dict(vl=rand(tl), vr=rand(tr), ol=ol, orr=orr, tl=tl, tr=tr, ml=hi, mr=cand, B=B, D=D, dtype=dtype)


def fwd_bwd(fn, inputs, grad_out):
    """(forward callable, backward callable) for fn(*inputs) -> tensor or tuple of tensors."""
    def fwd():
        with torch.no_grad():
            return fn(*inputs)

    if not inputs[0].dtype.is_floating_point:
        return fwd, None
    xs = [x.detach().requires_grad_() for x in inputs]
    out = fn(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    grads = grad_out(outs)

    def bwd():
        return torch.autograd.grad(outs, xs, grads, retain_graph=True)

    return fwd, bwd


def impls(c, op, triton_peer, compiled):
    """name -> (fn, inputs) for one op."""
    vl, vr, ol, orr, tl, tr, ml, mr = (c[k] for k in ("vl", "vr", "ol", "orr", "tl", "tr", "ml", "mr"))
    L = ml
    out = {}
    if op == "concat":
        out["torchfuse"] = (lambda a, b: torchfuse.concat_2d_jagged(a, ol, b, orr, ml, mr)[0], (vl, vr))
        out["torch index"] = (lambda a, b: torch_concat(a, b, ol, orr, tl, tr), (vl, vr))
        if compiled is not None:
            cf = compiled.setdefault("concat", torch.compile(torch_concat, dynamic=False))
            out["torch.compile"] = (lambda a, b: cf(a, b, ol, orr, tl, tr), (vl, vr))
        if triton_peer is not None:
            out["GR Triton"] = (lambda a, b: triton_peer.triton_concat_2D_jagged(ml + mr, a, b, ml, mr, ol, orr),
                                (vl, vr))
    elif op == "split":
        v = torchfuse.concat_2d_jagged(vl, ol, vr, orr)[0]
        out["torchfuse"] = (lambda x: torchfuse.split_2d_jagged(x, ol, orr, ml, mr, 0, tl, tr), (v,))
        out["torch index"] = (lambda x: torch_split(x, ol, orr, tl, tr), (v,))
        if compiled is not None:
            cf = compiled.setdefault("split", torch.compile(torch_split, dynamic=False))
            out["torch.compile"] = (lambda x: cf(x, ol, orr, tl, tr), (v,))
        if triton_peer is not None:
            out["GR Triton"] = (lambda x: triton_peer.triton_split_2D_jagged(ml + mr, x, tl, tr, ml, mr, ol, orr),
                                (v,))
    elif op == "to_padded":
        out["torchfuse"] = (lambda x: torchfuse.jagged_to_padded_dense(x, ol, L), (vl,))
        out["torch index"] = (lambda x: torch_to_padded(x, ol, L, tl), (vl,))
        if compiled is not None:
            cf = compiled.setdefault("to_padded", torch.compile(torch_to_padded, dynamic=False))
            out["torch.compile"] = (lambda x: cf(x, ol, L, tl), (vl,))
        if vl.dtype.is_floating_point:
            def nested(x):
                nt = torch.nested.nested_tensor_from_jagged(x, ol)
                return torch.nested.to_padded_tensor(nt, 0.0, (c["B"], L, x.shape[1]))
            out["torch.nested"] = (nested, (vl,))
    elif op == "to_jagged":
        dense = torchfuse.jagged_to_padded_dense(vl, ol, L)
        out["torchfuse"] = (lambda d: torchfuse.dense_to_jagged(d, ol, tl), (dense,))
        out["torch index"] = (lambda d: torch_to_jagged(d, ol, tl), (dense,))
        if compiled is not None:
            cf = compiled.setdefault("to_jagged", torch.compile(torch_to_jagged, dynamic=False))
            out["torch.compile"] = (lambda d: cf(d, ol, tl), (dense,))
    return out


def min_bytes(c, op, direction):
    rb = c["D"] * c["vl"].element_size()
    T, Tl, dense_rows = c["tl"] + c["tr"], c["tl"], c["B"] * c["ml"]
    if op in ("concat", "split"):
        return 2 * T * rb
    padded_side = (op == "to_padded") == (direction == "fwd")
    return (Tl + dense_rows) * rb if padded_side else 2 * Tl * rb



def run(args):
    rep = C.Report("jagged", "Jagged tensor ops")
    copy_gbs = C.copy_bandwidth_gbs(args.quick)
    rep.roofline = f"device-to-device copy {copy_gbs:.0f} GB/s (read + write), measured in this run"
    gr = None
    if args.peers:
        gr = C.import_peer("generative_recommenders.ops.triton.triton_jagged_tensors", args.peers)
    rep.peers = ["PyTorch index code (eager)", "torch.compile", "torch.nested"] + (["GR Triton"] if gr else [])
    rows = []
    for D in DIMS[:1] if args.quick else DIMS:
        c = make_case(D, torch.bfloat16)
        torch._dynamo.reset()  # fresh compiles per row width
        compiled = {}
        for op in ("concat", "split", "to_padded", "to_jagged"):
            t = {"fwd": {}, "bwd": {}}
            for name, (fn, inputs) in impls(c, op, gr, compiled).items():
                try:
                    f, b = fwd_bwd(fn, inputs, lambda outs: [torch.randn_like(o) for o in outs])
                    t["fwd"][name] = C.bench_us(f, args.quick)
                    if b is not None:
                        t["bwd"][name] = C.bench_us(b, args.quick)
                except Exception as e:  # noqa: BLE001  (a peer that cannot run this case is shown as -)
                    print(f"# {op} D={D} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                          file=sys.stderr)
                torch.cuda.empty_cache()
            for direction in ("fwd", "bwd"):
                tt = t[direction]
                if "torchfuse" not in tt:
                    continue
                ours = tt["torchfuse"]
                gbs = min_bytes(c, op, direction) / (ours * 1e-6) / 1e9
                others = [v for k, v in tt.items() if k != "torchfuse"]
                rows.append([f"{op} {direction}", D] + [C.fmt(tt.get(n)) for n in IMPLS]
                            + [f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%",
                               C.ratio(min(others), ours) if others else "-", C.ratio(tt.get("GR Triton"), ours)])
        del c
        torch.cuda.empty_cache()
    rep.table("B = 1024, history lengths uniform in [100, 3052] + 16 candidates, bf16 rows of D columns; "
              "kernel time in us; x = their time / ours.",
              ["op", "D"] + [f"{n} us" for n in IMPLS] + ["torchfuse GB/s", "% of copy", "vs best other",
                                                         "vs GR Triton"], rows)
    return rep


if __name__ == "__main__":
    sys.exit(C.standalone("jagged", run, doc=__doc__))
