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
import os
import sys

import torch

import torchfuse  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_hstu_bwd import trace_table  # noqa: E402

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


def forward_call(c, N, window):
    return lambda: torch.ops.torchfuse.hstu_fwd(c["q"], c["k"], c["v"], c["offsets"], c["nt"], None, N, c["alpha"],
                                                None, 0, window, 0, 1, 0, False)


if __name__ == "__main__":
    trace_table(forward_call, PHASES, 5, "TORCHFUSE_HSTU_FWD_TRACE_FILE")
