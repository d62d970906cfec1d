"""Where the sm_90a HSTU backward's consumer time goes, phase by phase, from the kernel's clock64 trace.

Needs a measurement build (the trace is compiled out otherwise):
    TORCHFUSE_HSTU_TRACE_BUILD=1 pip install --no-build-isolation -e .
    python benchmarks/trace_hstu_bwd.py [--shapes 128x1024x128,16x4096x128] [--window 0]

Each consumer warpgroup's thread 0 records events (kernels/hstu_bwd_sm90.cu, BWD_TRACE): 0 item handed
over, 1 K / V in shared memory, 2 a tile's Q / dO in shared memory, 3 S^T / dP^T done, 7 mask and SiLU
applied, 8 dZ^T stored and dK / dV's GEMMs issued, 4 past dQ's barrier, 5 the tile's dQ staged and its reduce
issued, 6 the item's dK / dV stored. (Builds from before 7 and 8 existed: their gap shows as one phase.) The phases are the gaps between
consecutive events, summed over every warpgroup of the launch (SM cycles), as shares of the consumers'
busy span (first hand-over to last store)."""
import argparse
import os
import sys
import tempfile

import numpy as np
import torch

import torchfuse  # noqa: F401
from torchfuse._timing import device_time_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hstu as bh  # noqa: E402

# (previous event, event) -> phase
PHASES = {
    (0, 1): "K/V wait after the hand-over",
    (1, 2): "Q/dO wait, first tile",
    (5, 2): "Q/dO wait, later tiles",
    (2, 3): "S^T, dP^T GEMMs",
    (3, 7): "mask, SiLU",
    (7, 8): "pack, dZ^T store, dK/dV issue",
    (8, 4): "dQ barrier (the other consumer)",
    (3, 4): "SiLU, dZ^T store, dK/dV issue, dQ barrier",
    (4, 5): "dQ GEMM, staging, reduce issue",
    (5, 6): "dK/dV stores",
    (1, 6): "dK/dV stores (item without tiles)",
    (6, 0): "hand-over wait",
}


def run_trace(fn, path, env="TORCHFUSE_HSTU_BWD_TRACE_FILE"):
    """The trace of one call of fn (the launch writes it to `path`): (regions, records, 2) uint64."""
    os.environ[env] = path
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        del os.environ[env]
    raw = np.fromfile(path, dtype=np.uint64)
    grid, cap = int(raw[0]), int(raw[1])
    return raw[2:].reshape(grid * 2, cap, 2)


def phases(rec, table=PHASES, tile_event=2):
    """Cycles per phase (table: (previous event, event) -> phase) over every warpgroup, the busy span,
    the items (event 0) and the tiles (tile_event)."""
    acc = {name: 0 for name in set(table.values())}
    acc["other"] = 0
    span = items = tiles = 0
    for region in rec:
        n = int(np.count_nonzero(region[:, 0]))
        if n < 2:
            continue
        clk = region[:n, 0].astype(np.int64)
        ev = (region[:n, 1] >> np.uint64(32)).astype(np.int64)
        span += int(clk[-1] - clk[0])
        items += int(np.count_nonzero(ev == 0))
        tiles += int(np.count_nonzero(ev == tile_event))
        for a, b, d in zip(ev[:-1], ev[1:], np.diff(clk)):
            acc[table.get((int(a), int(b)), "other")] += int(d)
    return acc, span, items, tiles


def trace_table(call_for, table, tile_event, env, default_shapes="128x1024x128,16x4096x128"):
    """The script's table: for each --shapes case (full lengths, --window), call_for(case, N, window) is
    the op call traced (env names the trace file); its phases (table) as shares of the busy span."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=default_shapes)
    ap.add_argument("--window", type=int, default=0)
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, H = {bh.H}, full lengths, "
          f"window {a.window}; shares of the consumers' busy span (SM cycles, both warpgroups of every block)\n")
    rows, heads = {}, []
    for shape in a.shapes.split(","):
        B, N, D = (int(x) for x in shape.split("x"))
        fn = call_for(bh.make_case(B, N, D, varied=False, window=a.window), N, a.window)
        us = device_time_us(fn, "cuda")
        with tempfile.TemporaryDirectory() as tmp:
            acc, span, items, tiles = phases(run_trace(fn, os.path.join(tmp, "trace.bin"), env), table, tile_event)
        heads.append(f"{shape} ({us:.0f} us; {items} items, {tiles / max(items, 1):.1f} tiles each)")
        for name, cyc in acc.items():
            rows.setdefault(name, []).append(f"{100.0 * cyc / max(span, 1):.1f}% ({cyc / max(tiles, 1):.0f}/tile)")
    print("| phase | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for name in list(dict.fromkeys(table.values())) + ["other"]:
        print(f"| {name} | " + " | ".join(rows[name]) + " |")


def backward_call(c, N, window):
    dout = torch.randn_like(c["v"])
    return lambda: torch.ops.torchfuse.hstu_bwd(dout, c["q"], c["k"], c["v"], c["offsets"], c["nt"], None, N,
                                                c["alpha"], None, 0, window, 0, 1, False)


if __name__ == "__main__":
    trace_table(backward_call, PHASES, 2, "TORCHFUSE_HSTU_BWD_TRACE_FILE")
