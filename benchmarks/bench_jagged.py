"""Jagged ops against PyTorch index-based code (eager and torch.compile), torch.nested, and
generative-recommenders' Triton concat_2D_jagged / split_2D_jagged, on one GPU.

Shape (generative-recommenders' benchmark): B = 1024 samples, history lengths uniform in [100, 3052],
16 candidates each; rows of D = 128 bf16, plus D = 1 int64 (timestamps) and D = 512 bf16.
concat = [history; candidates] per sample, split its inverse; to_padded / to_jagged convert the
history to (B, max_len, D) and back. GB/s over the fewest bytes the op must move (every row read once
and written once; padding rows written); % of the device-to-device copy bandwidth measured in the same
run.

Times (us per call, median over repetitions, CUDA events):
- main columns: N back-to-back calls between two events, divided by N (as a training step runs them:
  the host dispatches call i+1 while call i runs), for every implementation alike;
- "torchfuse 1-call": one call between two events from an idle GPU (host dispatch inside the window);
- "torchfuse graph": the forward replayed from a CUDA graph (kernel time only).
Backward = torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True) of one forward graph
built once, called back to back the same way (autograd engine dispatch included).

    python benchmarks/bench_jagged.py [--peers DIR] [--quick] [--dims 128,1,512] [--no-compile]
                                      [--ab] [--out results.md]

--ab adds torchfuse with the copy kernel's run fast path off (TORCHFUSE_JAGGED_RUNS=0, read at each
launch), timed in the same process on the same tensors ("per-row" columns).

--peers: a folder holding generative_recommenders/ops/triton/triton_jagged_tensors.py (fetched code,
never committed); without it the Triton column is skipped.
"""
import argparse
import os
import statistics
import sys

import torch

import torchfuse
from torchfuse._timing import back_to_back_us, device_time_us

DEV = "cuda"


def copy_bandwidth():
    src = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    t = device_time_us(lambda: dst.copy_(src), DEV, warmup=5, rep=20)
    del src, dst
    return 2 * 2 * 1024**3 / (t * 1e-6) / 1e9


def load_triton_peer(path):
    if not path or not os.path.isdir(path):
        return None
    sys.path.insert(0, path)
    try:
        from generative_recommenders.ops.triton import triton_jagged_tensors as t
        return t
    except Exception as e:  # noqa: BLE001  (a peer that does not import is reported, not fatal)
        print(f"# generative-recommenders Triton peer not usable: {type(e).__name__}: {e}", file=sys.stderr)
        return None


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
    ol = torchfuse.complete_cumsum(ll).to(DEV)
    orr = torchfuse.complete_cumsum(lr).to(DEV)
    tl, tr = int(ll.sum()), int(lr.sum())

    def rand(n):
        if dtype.is_floating_point:
            return torch.randn(n, D, device=DEV, dtype=dtype)
        return torch.randint(0, 2**40, (n, D), device=DEV, dtype=dtype)

    return dict(vl=rand(tl), vr=rand(tr), ol=ol, orr=orr, tl=tl, tr=tr, ml=hi, mr=cand, B=B, D=D, dtype=dtype)


def b2b_time_us(fn, rep, n=20):
    """Median over `rep` repetitions of (n back-to-back calls between two CUDA events) / n."""
    return back_to_back_us(fn, calls=n, rounds=rep, warmup=3, stat=statistics.median_high)


def graph_time_us(fn, rep):
    """The forward replayed from a CUDA graph: kernel time without host dispatch (small shapes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        fn()
    return b2b_time_us(g.replay, rep)


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


COLS = ["torchfuse", "torchfuse 1-call", "torchfuse graph", "per-row", "per-row graph", "torch index",
        "torch.compile", "torch.nested", "GR Triton"]


def without_runs(fn):
    """fn() with the copy kernel's run fast path off (TORCHFUSE_JAGGED_RUNS=0, read at each launch)."""
    old = os.environ.get("TORCHFUSE_JAGGED_RUNS")
    os.environ["TORCHFUSE_JAGGED_RUNS"] = "0"
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["TORCHFUSE_JAGGED_RUNS"]
        else:
            os.environ["TORCHFUSE_JAGGED_RUNS"] = old


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", default=os.environ.get("TORCHFUSE_PEERS"))
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--compile-all", action="store_true", help="torch.compile at every shape (default: D=128)")
    ap.add_argument("--no-compile", action="store_true", help="no torch.compile column")
    ap.add_argument("--ab", action="store_true", help="also torchfuse with the run fast path off ('per-row')")
    ap.add_argument("--dims", default="128,1,512", help="row shapes: D for bf16 rows, 1 means D=1 int64")
    ap.add_argument("--out")
    args = ap.parse_args()
    triton_peer = load_triton_peer(args.peers)
    copy_gbs = copy_bandwidth()
    rep = 10 if args.quick else 30
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {copy_gbs:.0f} GB/s",
             "B=1024, history lengths uniform in [100, 3052], 16 candidates; us per call (median): 20 back-to-back "
             "calls between two CUDA events / 20; '1-call' = one call from an idle GPU; 'graph' = the forward "
             "replayed from a CUDA graph (no host dispatch); bwd = torch.autograd.grad(retain_graph=True) of one "
             "forward graph, back to back; GB/s and % (of copy bandwidth) from the back-to-back torchfuse time; "
             "x = best other / torchfuse; 'per-row' (A/B, same process) = torchfuse with the copy kernel's run "
             "fast path off (TORCHFUSE_JAGGED_RUNS=0)",
             "",
             "| op | D dtype | " + " | ".join(f"{n} us" for n in COLS) + " | torchfuse GB/s | % copy | x best other | x GR |",
             "|---|---|" + "---|" * (len(COLS) + 4)]
    print("\n".join(lines), flush=True)
    shapes = [(1, torch.int64) if d == 1 else (d, torch.bfloat16) for d in map(int, args.dims.split(","))]
    for D, dtype in shapes:
        c = make_case(D, dtype)
        compiled = {} if ((D == 128 or args.compile_all) and not args.no_compile) else None
        for op in ("concat", "split", "to_padded", "to_jagged"):
            fns = impls(c, op, triton_peer, compiled)
            timings = {"fwd": {}, "bwd": {}}
            for name, (fn, inputs) in fns.items():
                try:
                    f, b = fwd_bwd(fn, inputs, lambda outs: [torch.randn_like(o) for o in outs])
                    timings["fwd"][name] = b2b_time_us(f, rep)
                    if name == "torchfuse":
                        timings["fwd"]["torchfuse 1-call"] = device_time_us(f, DEV, warmup=3, rep=rep)
                        try:
                            timings["fwd"]["torchfuse graph"] = graph_time_us(lambda: fn(*inputs), rep)
                            if args.ab:  # the graph captures the kernel variant at capture time
                                timings["fwd"]["per-row graph"] = without_runs(
                                    lambda: graph_time_us(lambda: fn(*inputs), rep))
                        except Exception as e:  # noqa: BLE001
                            print(f"# {op} D={D} graph capture: {type(e).__name__}: {e}", file=sys.stderr)
                        if args.ab:
                            timings["fwd"]["per-row"] = without_runs(lambda: b2b_time_us(f, rep))
                    if b is not None:
                        timings["bwd"][name] = b2b_time_us(b, rep)
                        if name == "torchfuse":
                            timings["bwd"]["torchfuse 1-call"] = device_time_us(b, DEV, warmup=3, rep=rep)
                            if args.ab:
                                timings["bwd"]["per-row"] = without_runs(lambda: b2b_time_us(b, rep))
                except Exception as e:  # noqa: BLE001  (a baseline that cannot run this case is shown as n/a)
                    print(f"# {op} D={D} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", file=sys.stderr)
                torch.cuda.empty_cache()
            for direction in ("fwd", "bwd"):
                t = timings[direction]
                if "torchfuse" not in t:
                    continue
                gbs = min_bytes(c, op, direction) / (t["torchfuse"] * 1e-6) / 1e9
                others = [v for k, v in t.items() if not k.startswith("torchfuse") and not k.startswith("per-row")]
                best = f"{min(others) / t['torchfuse']:.2f}" if others else "n/a"
                vs_gr = f"{t['GR Triton'] / t['torchfuse']:.2f}" if "GR Triton" in t else "n/a"
                cells = [f"{t[n]:.1f}" if n in t else "n/a" for n in COLS]
                row = (f"| {op} {direction} | {D} {str(dtype).replace('torch.', '')} | " + " | ".join(cells)
                       + f" | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {best} | {vs_gr} |")
                lines.append(row)
                print(row, flush=True)
                if args.out:  # written as it goes: a run cut short keeps its rows
                    with open(args.out, "w") as f:
                        f.write("\n".join(lines) + "\n")
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
