"""``python -m torchfuse``: versions, then one line per self-check (PASS / FAIL), then one benchmark
row per family; exit status 1 if any check fails. Timings never decide a check."""
import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from typing import List, Optional

import torch

import torchfuse

from . import distributed, dynemb, hf, hstu, jagged, norm, recsys, torchrec
from ._common import BenchRow, Check, Context

FAMILIES = [norm, jagged, hstu, dynemb, hf, torchrec, recsys, distributed]
TRAIN_SCRIPT = "torchfuse.recsys.train"


def _parser():
    p = argparse.ArgumentParser(prog="python -m torchfuse", description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="smaller benchmark shapes and fewer repeats (no torch.compile column on a CPU)")
    p.add_argument("--check-only", action="store_true", help="run the self-checks, no benchmark")
    p.add_argument("--bench-only", action="store_true", help="run the benchmark, no self-checks")
    p.add_argument("--json", action="store_true", help="print the results as one JSON document on stdout")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the speedups (needs matplotlib)")
    p.add_argument("--families", metavar="LIST", help="comma-separated subset of: " +
                   ",".join(f.FAMILY for f in FAMILIES))
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available, else cpu")
    return p


class _Progress:
    """tqdm on stderr when it is installed and stderr is a terminal, else a plain line per step
    there; result lines go to stdout either way (through tqdm.write while a bar is shown)."""

    def __init__(self, total: int, quiet: bool):
        self.bar = None
        self.quiet = quiet
        try:
            from tqdm import tqdm
            if sys.stderr.isatty():
                self.bar = tqdm(total=total, file=sys.stderr, leave=False,
                                bar_format="{l_bar}{bar}| {n}/{total} [{elapsed}]")
        except ImportError:
            pass
        self.n, self.total = 0, total
        self.seconds = {}  # per step: where the run's time goes

    def step(self, what: str):
        self.n += 1
        self.what, self.t0 = what, time.perf_counter()
        if self.bar is not None:
            self.bar.set_description(what)
        elif not self.quiet:
            print(f"[{self.n}/{self.total}] {what} ...", file=sys.stderr, flush=True)

    def done(self):
        self.seconds[self.what] = round(time.perf_counter() - self.t0, 2)
        if self.bar is not None:
            self.bar.update(1)

    def write(self, line: str, out):
        if out is None:
            return
        if self.bar is not None:
            self.bar.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _env() -> dict:
    dev = {"cuda": torch.cuda.is_available()}
    if dev["cuda"]:
        cap = torch.cuda.get_device_capability()
        dev.update(name=torch.cuda.get_device_name(), capability=f"sm_{cap[0]}{cap[1]}")
    else:
        dev.update(name=f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s))")
    return {"torchfuse": torchfuse.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "device": dev}


def _check_line(family: str, c: Check) -> str:
    verdict = "SKIP" if c.skipped else ("PASS" if c.passed else "FAIL")
    note = f"  {c.note}" if c.note else ""
    return f"{family:<18} {c.op:<58} {c.shape:<14} {c.err:>10.3g} {c.tol:>10.3g}  {verdict}{note}"


def _fmt_us(t: Optional[float]) -> str:
    return "-" if t is None else (f"{t:.0f}" if t >= 100 else f"{t:.1f}")


def _fmt_x(r: Optional[float]) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _bench_lines(rows: List[BenchRow]) -> List[str]:
    head = (f"{'family':<18} {'op':<36} {'shape':<20} {'dtype':<9} {'torchfuse us':>12} {'eager us':>9} "
            f"{'vs eager':>8} {'compile us':>10} {'vs compile':>10} {'peer':<10} {'vs peer':>8} {'roofline':>16}")
    lines = [head]
    for r in rows:
        roof = "-" if r.roofline_pct is None else f"{r.roofline_pct:.0f}% {r.roofline}"
        lines.append(f"{r.family:<18} {r.op:<36} {r.shape:<20} {r.dtype:<9} {_fmt_us(r.us['torchfuse']):>12} "
                     f"{_fmt_us(r.us.get('eager')):>9} {_fmt_x(r.ratio('eager')):>8} "
                     f"{_fmt_us(r.us.get('compile')):>10} "
                     f"{_fmt_x(r.ratio('compile')):>10} {(r.peer or '-'):<10} {_fmt_x(r.ratio('peer')):>8} {roof:>16}")
        if r.note:
            lines.append(f"{'':<18} note: {r.note}")
    return lines


def plot(rows: List[BenchRow], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = [("eager", "vs eager PyTorch"), ("compile", "vs torch.compile"), ("peer", "vs best peer")]
    cols = [(k, label) for k, label in cols if any(r.ratio(k) for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    width = 0.8 / max(1, len(cols))
    for i, (k, label) in enumerate(cols):
        xs = [j + (i - (len(cols) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r.ratio(k) or 0.0 for r in rows], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ratios = [r.ratio(k) for r in rows for k, _ in cols if r.ratio(k)]
    if ratios and max(ratios) / min(ratios) > 20:
        ax.set_yscale("log")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r.family}\n{r.op}" for r in rows], fontsize=7)
    ax.set_ylabel("speedup of torchfuse (x)")
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    ax.set_title(f"torchfuse {torchfuse.__version__} on {dev}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:120] if str(e) else ""


def _busy_cpu() -> str:
    """Why the CPU benchmark should run on one thread, or "": other processes keep the cores busy."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return ""
    cores = os.cpu_count() or 1
    return f"the machine is busy: load {load:.1f} on {cores} cores" if load > cores else ""


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent package is missing
        return False


def run(argv=None) -> dict:
    """Run the checks and the benchmark as ``argv`` asks; returns the results (what --json prints)
    with ``"ok"`` False when a check failed."""
    args = _parser().parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m torchfuse: --device cuda, but torch sees no GPU")
    ctx = Context(device=device, quick=args.quick, compile=not (args.quick and device == "cpu"))
    fams = FAMILIES
    if args.families:
        want = args.families.split(",")
        unknown = set(want) - {f.FAMILY for f in FAMILIES}
        if unknown:
            raise SystemExit(f"python -m torchfuse: unknown families {sorted(unknown)}")
        fams = [f for f in FAMILIES if f.FAMILY in want]
    out = None if args.json else sys.stdout
    env = _env()
    result = {"env": env, "device": device, "quick": args.quick, "checks": [], "bench": [], "ok": True}
    if out:
        print(f"torchfuse {env['torchfuse']} | torch {env['torch']} | CUDA {env['cuda']} | "
              f"Python {env['python']}", file=out)
        print(f"device: {env['device']['name']}" + (f" ({env['device']['capability']})" if device == "cuda" else
                                                    " (no GPU: checking and timing the CPU paths)"), file=out)
    steps = (0 if args.bench_only else len(fams)) + (0 if args.check_only else len(fams))
    prog = _Progress(steps, quiet=args.json)
    t0 = time.perf_counter()
    try:
        if not args.bench_only:
            prog.write("\nself-check against the PyTorch reference (err: max abs error against float64; tol: 2x "
                       "(5x for gradients) PyTorch's own error at the same precision, + 1 ulp)", out)
            prog.write(f"{'family':<18} {'check':<58} {'shape':<14} {'err':>10} {'tol':>10}  result", out)
            for fam in fams:
                prog.step(f"check {fam.FAMILY}")
                torch.manual_seed(0)
                try:
                    checks = fam.checks(ctx)
                except Exception as e:  # a crash is a failed check, and the other families still run
                    checks = [Check(f"{fam.FAMILY} raised {type(e).__name__}", "-", float("inf"), 0.0,
                                    note=_first_line(e))]
                for c in checks:
                    result["checks"].append(dict(family=fam.FAMILY, op=c.op, shape=c.shape, err=c.err, tol=c.tol,
                                                 result="SKIP" if c.skipped else ("PASS" if c.passed else "FAIL"),
                                                 note=c.note))
                    result["ok"] &= c.passed
                    prog.write(_check_line(fam.FAMILY, c), out)
                prog.done()
        if not args.check_only:
            threads = torch.get_num_threads()
            busy = _busy_cpu() if device == "cpu" else None
            if busy:  # other processes hold the cores: parallel regions would wait on preempted threads
                torch.set_num_threads(1)
            how = ("median of CUDA-event timings" if device == "cuda" else
                   f"best of host-clock rounds, {torch.get_num_threads()} thread(s)" +
                   (f" ({busy})" if busy else "")) + \
                  ("" if ctx.compile else "; torch.compile left out (--quick on a CPU)")
            prog.write(f"\nbenchmark ({device}, inference, microseconds per call: {how}). Nx: torchfuse is N times "
                       "as fast; roofline: % of the speed of a copy of the same bytes, or of a large matmul's "
                       "FLOP rate, both measured in this run", out)
            rows = []
            for fam in fams:
                prog.step(f"bench {fam.FAMILY}")
                torch.manual_seed(0)
                try:
                    row = fam.bench(ctx)
                except Exception as e:
                    row = BenchRow(fam.FAMILY, "-", "-", "-", {"torchfuse": None},
                                   note=f"not run: {type(e).__name__}: {_first_line(e)}")
                if row is not None:
                    rows.append(row)
                prog.done()
            for line in _bench_lines(rows):
                prog.write(line, out)
            result["bench"] = [dict(family=r.family, op=r.op, shape=r.shape, dtype=r.dtype, us=r.us, peer=r.peer,
                                    speedup={k: r.ratio(k) for k in ("eager", "compile", "peer")},
                                    roofline_pct=r.roofline_pct, roofline=r.roofline, note=r.note) for r in rows]
            torch.set_num_threads(threads)
            if args.plot:
                plot([r for r in rows if r.us.get("torchfuse")], args.plot)
                prog.write(f"\nspeedup chart written to {args.plot}", out)
    finally:
        prog.close()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["step_seconds"] = prog.seconds
    return result


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("python -m torchfuse: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    if args.plot and args.check_only:
        print("python -m torchfuse: --plot draws the benchmark; it cannot go with --check-only", file=sys.stderr)
        return 2
    result = run(argv)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        n = len(result["checks"])
        failed = sum(c["result"] == "FAIL" for c in result["checks"])
        if n:
            print(f"\n{n - failed} of {n} checks passed" if not failed else f"\n{failed} of {n} CHECKS FAILED")
        slow = sorted(result["step_seconds"].items(), key=lambda kv: -kv[1])[:3]
        print(f"done in {result['seconds']} s" +
              (" (longest: " + ", ".join(f"{k} {v:.1f} s" for k, v in slow) + ")" if slow else ""))
        if _module_exists(TRAIN_SCRIPT):
            print(f"next: train a recommender end to end with `python -m {TRAIN_SCRIPT} --quick`")
    return 0 if result["ok"] else 1
