#!/usr/bin/env bash
# Build, then profile the norm kernels with Nsight Compute (clocks left alone). Reports under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MAX_JOBS=16
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
ncu --clock-control none -k regex:"norm_(fwd|bwd)_fast" -c 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
  --section LaunchStats python3 benchmarks/profile_norm.py "$@" > "$OUT/ncu.txt" 2>&1
echo "ncu exit $?"
grep -E "norm_|DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Grid Size|Block Size|Stall|Warp Cycles Per Issued|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth|Issued Warp" "$OUT/ncu.txt" | head -80
