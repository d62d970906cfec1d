"""What every benchmark shares: one timing method, the rooflines, the peers, the results file.

Timing: ``triton.testing.do_bench`` (the L2 cache flushed before every call, median of the calls),
falling back to CUDA events around single calls with the same flush when triton is missing
(``bench_us``). Calls that change state between calls (a hash table's inserts) take CUDA events around
single calls with the same flush and untimed set-up between them (``calls_us``). Decode-size calls,
whose cost is the host's, are timed as wall time per call of back-to-back calls (``wall_us``); their
tables say so.
"""
import datetime
import functools
import importlib
import os
import shlex
import statistics
import sys
import time

import torch

from torchfuse._timing import event_time_us, wall_times_us

try:
    import triton.testing as _tt
except ImportError:  # the CUDA-event fallback below
    _tt = None

TIMER = "triton.testing.do_bench (L2 flushed, median)" if _tt is not None else \
    "CUDA events around single calls (L2 flushed, median; triton not importable)"

# dense bf16 / fp16 tensor-core peak in TFLOP/s (the vendors' figures, without sparsity)
TENSOR_PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0}

_flush_buf = None


def _flush_l2():
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    _flush_buf.zero_()


def bench_us(fn, quick=False):
    """Median time of one call of fn() on the GPU, in microseconds, the L2 flushed before each call."""
    warmup, rep = (10, 40) if quick else (25, 100)  # milliseconds, do_bench's units
    if _tt is not None:
        if not quick:  # at least 15 timed calls (at most 3 s): a 15 ms layer step got 6 in 100 ms, a median
            fn()       # that moved 1-2% run to run; the first call may compile
            rep = min(3000.0, max(rep, 15 * event_time_us(fn, _flush_l2) / 1e3))
        return _tt.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3
    fn()
    torch.cuda.synchronize()
    return statistics.median(event_time_us(fn, _flush_l2) for _ in range(10 if quick else 30))


def calls_us(fn, before=None, after=None, reps=5, warmup=0):
    """Median of `reps` single calls of fn() in microseconds, CUDA events around each, the L2 flushed
    before each: for calls that change what the next one sees (a table's inserts), with before() and
    after() run untimed around every call. `warmup` calls go first, untimed (a first call that pays for
    allocator growth and first launches)."""
    def prepare():
        if before is not None:
            before()
        _flush_l2()

    for _ in range(warmup):
        prepare()
        fn()
        if after is not None:
            after()
    times = []
    for _ in range(reps):
        times.append(event_time_us(fn, prepare))
        if after is not None:
            after()
    return statistics.median(times)


def wall_us(fns, calls=300, rounds=10):
    """Wall time per call of back-to-back calls (a decode loop's cost: host dispatch and launch), for
    several functions in interleaved rounds, the best round of each."""
    return wall_times_us(fns, "cuda", calls, rounds)


def copy_bandwidth_gbs(quick=False):
    """Device-to-device copy of 1 GiB, bytes read + written per second (GB/s): the memory roofline."""
    src = torch.empty(1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = bench_us(lambda: dst.copy_(src), quick)
    src = dst = None  # noqa: F841  (freed before the family's tensors)
    torch.cuda.empty_cache()
    return 2 * 1024**3 / (t * 1e-6) / 1e9


def gpu_tag():
    """h100 / h200 from the device name, else the name in lower case with its spaces as dashes."""
    name = torch.cuda.get_device_name().lower()
    for tag in ("h200", "h100"):
        if tag in name:
            return tag
    return "-".join(name.replace("nvidia", "").split())


def tensor_peak_tflops():
    return TENSOR_PEAK_TFLOPS.get(gpu_tag())


@functools.lru_cache(maxsize=None)
def import_peer(module, path=None):
    """A peer library's module, or None. `path` (a folder) is put on sys.path first; the peers are
    never part of torchfuse."""
    if path:
        path = os.path.abspath(path)
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (a peer that does not import is reported, not fatal)
        print(f"# peer {module} not importable: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def compile_fn(fn):
    """torch.compile of fn, one graph per shape (dynamic=False: the shapes of a table are few)."""
    return torch.compile(fn, dynamic=False)


def zipf_ranks(n, universe, s, generator=None, device="cpu"):
    """n ranks in [1, universe] with P(k) ~ k^-s (continuous inverse CDF, floored): the skewed ids of
    recommendation traffic, where the hottest holds several percent of a batch (s = 1.05)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=device)
    a = 1.0 - s
    return torch.floor(((universe ** a - 1.0) * u + 1.0) ** (1.0 / a)).to(torch.int64)


def ratio(base, ours):
    """base / ours as 'N.NNx', '-' when either is missing."""
    return "-" if base is None or ours is None else f"{base / ours:.2f}x"


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


class Report:
    """One family's results: a header (date, device, torch, command, timer, roofline, peers) and tables."""

    def __init__(self, family, title):
        self.family, self.title = family, title
        self.roofline, self.peers, self.notes, self.tables = "", [], [], []

    def table(self, caption, columns, rows):
        self.tables.append((caption, columns, rows))

    def markdown(self, command):
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        lines = [f"# {self.title}", "",
                 f"- date: {datetime.date.today().isoformat()}",
                 f"- device: {dev}",
                 f"- torch: {torch.__version__}",
                 f"- command: `{command}`",
                 f"- timing: {TIMER}",
                 f"- roofline: {self.roofline or '-'}",
                 f"- peers measured in this run: {', '.join(self.peers) if self.peers else 'none'}"]
        lines += [f"- {n}" for n in self.notes]
        for caption, columns, rows in self.tables:
            if columns is None:  # lines copied as a peer printed them
                lines += ["", caption, ""] + list(rows)
                continue
            lines += ["", caption, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        return "\n".join(lines) + "\n"


def command_line():
    return " ".join(["python"] + [shlex.quote(a) for a in sys.argv])


def standalone(family, run, add_args=None, doc=None):
    """main() of a bench_<family>.py: parse --quick / --peers / --out, run, print (and write) the table."""
    import argparse
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--peers", default=os.environ.get("TORCHFUSE_PEERS"),
                    help="a folder holding the peer libraries' sources (generative_recommenders, ...)")
    ap.add_argument("--out", help="also write the results (markdown) here")
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"bench_{family}: needs a CUDA GPU")
        return 1
    torch.manual_seed(0)
    text = run(args).markdown(command_line())
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0
