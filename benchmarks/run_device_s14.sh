#!/usr/bin/env bash
# Session 14's device calls (each under the 10-minute limit):
#   trace: a measurement build (TORCHFUSE_HSTU_BWD_TRACE_BUILD=1, set by this part before the build), the
#          HSTU backward's consumer phases (trace_hstu_bwd.py, events 7 and 8 split the SiLU / dZ^T store /
#          dQ barrier phase) at 128x1024x128, 16x4096x128 and with the window, on the 16-byte dK / dV stores
set -uo pipefail
PART=${1:?part: trace}
[ "$PART" = trace ] && export TORCHFUSE_HSTU_BWD_TRACE_BUILD=1
source "$(dirname "$0")/device_build.sh"
if [ "$PART" = trace ]; then
  timeout 120 python3 benchmarks/trace_hstu_bwd.py > "$OUT/trace.md" 2>&1; echo "trace exit $?"; cat "$OUT/trace.md"
  timeout 90 python3 benchmarks/trace_hstu_bwd.py --shapes 16x4096x128 --window 256 > "$OUT/trace_window.md" 2>&1
  echo "trace (window) exit $?"; cat "$OUT/trace_window.md"
fi
