"""What the family modules share: the run's settings, the pass rule, and the timers."""
import dataclasses
import time
from typing import Callable, Dict, List, Optional

import torch


@dataclasses.dataclass
class Context:
    device: str
    quick: bool
    compile: bool  # time torch.compile of the eager baseline too

    @property
    def dtype(self) -> torch.dtype:
        """The precision checked: bf16 where torchfuse runs on tensor cores, fp32 on the CPU."""
        return torch.bfloat16 if self.device == "cuda" else torch.float32


@dataclasses.dataclass
class Check:
    op: str
    shape: str
    err: float
    tol: float
    note: str = ""
    skipped: bool = False

    @property
    def passed(self) -> bool:
        return self.skipped or self.err <= self.tol  # NaN fails


def shape_str(*shapes) -> str:
    return " ".join("x".join(str(int(d)) for d in s) for s in shapes)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    d = (a.double() - b.double()).abs()
    return float("nan") if not torch.isfinite(a).all() else d.max().item()


def close(op: str, got: torch.Tensor, ref: torch.Tensor, lp: torch.Tensor, factor: float = 2.0,
          dtype: Optional[torch.dtype] = None, shape=None) -> Check:
    """torchfuse's max error against the float64 reference `ref` must be at most `factor` times
    that of the same computation in PyTorch at the checked precision (`lp`), plus one ulp of the
    largest reference value (so an exact-zero budget is not impossible). The tests' rule."""
    dtype = dtype or got.dtype
    ref = ref.double()
    err = _max_abs(got, ref)
    err_lp = _max_abs(lp, ref)
    big = ref.abs().max().item() if ref.numel() else 0.0
    tol = factor * err_lp + torch.finfo(dtype).eps * max(1.0, big)
    return Check(op, shape_str(shape if shape is not None else got.shape), err, tol)


def exact(op: str, got: torch.Tensor, ref: torch.Tensor, shape=None) -> Check:
    """Ops that only move or select rows: bit-equal to the reference."""
    return Check(op, shape_str(shape if shape is not None else got.shape), _max_abs(got, ref), 0.0)


def skipped(op: str, why: str) -> Check:
    return Check(op, "-", 0.0, 0.0, note=why, skipped=True)


# ---- timing (benchmarks only; no check depends on it) ----


@dataclasses.dataclass
class BenchRow:
    family: str
    op: str
    shape: str
    dtype: str
    us: Dict[str, Optional[float]]  # "torchfuse", "eager", "compile", "peer" -> median microseconds
    peer: str = ""
    roofline_pct: Optional[float] = None
    roofline: str = ""  # what the percentage is of
    note: str = ""

    def ratio(self, other: str) -> Optional[float]:
        """How many times faster torchfuse is than `other` (None: not measured)."""
        t, o = self.us.get("torchfuse"), self.us.get(other)
        return o / t if t and o else None


def time_us(fn: Callable, ctx: Context) -> float:
    """Microseconds per call. On a GPU: triton.testing.do_bench's median (CUDA events), else CUDA
    events around single calls. On the CPU: back-to-back calls timed by the host clock, the best of
    several rounds (other processes on the machine only ever add time)."""
    if ctx.device == "cuda":
        try:
            from triton.testing import do_bench
            return do_bench(fn, warmup=10 if ctx.quick else 25, rep=30 if ctx.quick else 100,
                            return_mode="median") * 1e3
        except ImportError:
            from .._timing import device_time_us
            return device_time_us(fn, ctx.device, warmup=5, rep=20 if ctx.quick else 100)
    fn()
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    calls = max(1, min(100, int(2e-3 / max(first, 1e-7))))  # rounds of about 2 ms or more
    best = float("inf")
    for _ in range(5 if ctx.quick else 15):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def try_time(fn: Optional[Callable], ctx: Context, notes: List[str], what: str) -> Optional[float]:
    """time_us, or None (with a note) when `fn` is missing or raises: a baseline that cannot run here
    leaves its column empty, it does not stop the run."""
    if fn is None:
        return None
    try:
        return time_us(fn, ctx)
    except Exception as e:  # torch.compile without a compiler, a peer's unsupported shape, ...
        notes.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
        return None


_roof: Dict[str, float] = {}


def copy_us(nbytes: int, ctx: Context) -> float:
    """Time of ``torch.empty_like(x).copy_(x)`` moving `nbytes` (read + write), measured in this run:
    the memory roofline of an op that moves that many bytes."""
    x = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=ctx.device)
    return time_us(lambda: torch.empty_like(x).copy_(x), ctx)


def matmul_flops_per_us(ctx: Context) -> float:
    """The rate of one large matmul at the checked precision (cuBLAS on tensor cores on a GPU),
    measured once per run: the compute roofline for the attention rows."""
    if "mm" not in _roof:
        n = 4096 if ctx.device == "cuda" else 512
        a = torch.randn(n, n, device=ctx.device, dtype=ctx.dtype)
        b = torch.randn(n, n, device=ctx.device, dtype=ctx.dtype)
        _roof["mm"] = 2 * n ** 3 / time_us(lambda: a @ b, ctx)
    return _roof["mm"]


def bench_row(ctx: Context, family: str, op: str, shape, dtype, ours: Callable, eager: Callable,
              peer: Optional[Callable] = None, peer_name: str = "", nbytes: Optional[int] = None,
              flops: Optional[float] = None, compile_fn: Optional[Callable] = None) -> BenchRow:
    notes: List[str] = []
    us = {"torchfuse": time_us(ours, ctx), "eager": try_time(eager, ctx, notes, "eager")}
    if ctx.compile:
        us["compile"] = try_time(compiled(compile_fn or eager), ctx, notes, "torch.compile")
    if peer is not None:
        us["peer"] = try_time(peer, ctx, notes, peer_name)
    row = BenchRow(family, op, shape_str(shape) if not isinstance(shape, str) else shape,
                   str(dtype).replace("torch.", ""), us, peer_name if peer is not None else "", note="; ".join(notes))
    if nbytes:
        row.roofline_pct = 100.0 * copy_us(nbytes, ctx) / us["torchfuse"]
        row.roofline = "copy BW"
    elif flops:
        row.roofline_pct = 100.0 * flops / us["torchfuse"] / matmul_flops_per_us(ctx)
        row.roofline = "matmul"
    if row.roofline_pct is not None and row.roofline_pct > 110:
        # faster than a copy of its own bytes: another process slowed some timings, not others
        row.note = "; ".join(filter(None, [row.note, "timings disturbed (above the roofline): rerun on an idle "
                                           "machine" + (" or with OMP_NUM_THREADS=1" if ctx.device == "cpu" else "")]))
    return row
