"""Where the sm_90a HSTU forward's consumer time goes, phase by phase, from the kernel's clock64 trace
(the ping-pong loop: head dims up to 128).

Needs a measurement build (the trace is compiled out otherwise):
    TORCHFUSE_HSTU_TRACE_BUILD=1 pip install --no-build-isolation -e .
    python benchmarks/trace_hstu_fwd.py [--shapes 128x1024x128,16x4096x128] [--window 0]

Each consumer warpgroup's thread 0 records events (kernels/hstu_fwd_sm90.cu, FWD_TRACE): 0 item handed
over, 1 Q in shared memory, 2 a key tile's K / V in shared memory, 3 the consumer's turn (its named
barrier passed), 4 its GEMMs of the turn done, 5 SiLU applied and P packed, 6 O stored. The phases are
the gaps between consecutive events, summed over every warpgroup of the launch (SM cycles), as shares
of the consumers' busy span (first hand-over to last store), and per key tile."""
import argparse
import os
import sys
import tempfile

import torch

import torchfuse  # noqa: F401
from torchfuse._timing import device_time_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hstu as bh  # noqa: E402
from trace_hstu_bwd import phases, run_trace  # noqa: E402

# (previous event, event) -> phase
PHASES = {
    (0, 1): "Q wait after the hand-over",
    (1, 2): "first K/V wait",
    (2, 3): "turn wait (the other consumer's MMAs issue)",
    (3, 4): "own GEMMs, issue to done",
    (4, 5): "SiLU, pack",
    (5, 2): "K/V wait, later tiles",
    (5, 3): "turn wait, last tile",
    (4, 6): "O scale and store",
    (6, 0): "hand-over wait",
    (0, 6): "item without tiles",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128x1024x128,16x4096x128")
    ap.add_argument("--window", type=int, default=0)
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, H = {bh.H}, full lengths, "
          f"window {a.window}; shares of the consumers' busy span (SM cycles, both warpgroups of every block)\n")
    rows, heads = {}, []
    for shape in a.shapes.split(","):
        B, N, D = (int(x) for x in shape.split("x"))
        c = bh.make_case(B, N, D, varied=False, window=a.window)

        def fwd():
            return torch.ops.torchfuse.hstu_fwd(c["q"], c["k"], c["v"], c["offsets"], c["nt"], None, N, c["alpha"],
                                                None, 0, a.window, 0, 1, 0, False)
        us = device_time_us(fwd, "cuda")
        with tempfile.TemporaryDirectory() as tmp:
            rec = run_trace(fwd, os.path.join(tmp, "trace.bin"), "TORCHFUSE_HSTU_FWD_TRACE_FILE")
            acc, span, items, tiles = phases(rec, PHASES, tile_event=5)
        heads.append(f"{shape} ({us:.0f} us; {items} items, {tiles / max(items, 1):.1f} tiles each)")
        for name, cyc in acc.items():
            rows.setdefault(name, []).append(f"{100.0 * cyc / max(span, 1):.1f}% ({cyc / max(tiles, 1):.0f}/tile)")
    print("| phase | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for name in list(dict.fromkeys(PHASES.values())) + ["other"]:
        print(f"| {name} | " + " | ".join(rows[name]) + " |")


if __name__ == "__main__":
    main()
