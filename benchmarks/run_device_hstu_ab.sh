#!/usr/bin/env bash
# One device call for a change to the sm_90a HSTU forward: build; the HSTU GPU tests (every forward case
# on each kernel: mma.sync, wgmma with and without ping-pong); compute-sanitizer on the wgmma forward and
# the tail-row isolation test; the kernels' A/B (ab_hstu_fwd.py). With MAIN_KERNEL=<file> (a copy of
# another version of kernels/hstu_fwd_sm90.cu, e.g. main's, in a carried git-ignored folder) it then
# rebuilds with that file and runs the isolation test against it: a check that the test can fail.
#   MAIN_KERNEL=.gl/s6/main_hstu_fwd_sm90.cu bash benchmarks/run_device_hstu_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MEMCHECK_SEL="cuda and bfloat16 and (isolated or (test_forward and wgmma and (targets_groups_context or d256_dv32 or window_minfull or long_d256 or bias_1_head)))"
BENCH=none TEST_TIMEOUT=${TEST_TIMEOUT:-220} MEMCHECK_TIMEOUT=${MEMCHECK_TIMEOUT:-130} RACECHECK_TIMEOUT=60 \
  bash benchmarks/run_device_hstu.sh
timeout ${AB_TIMEOUT:-150} python3 benchmarks/ab_hstu_fwd.py --out "$OUT/ab_hstu_fwd.md" > "$OUT/ab.log" 2>&1
echo "ab exit $?"; tail -3 "$OUT/ab.log" | grep -v "^|"
if [ -n "${MAIN_KERNEL:-}" ] && [ -f "$MAIN_KERNEL" ]; then
  cp "$MAIN_KERNEL" kernels/hstu_fwd_sm90.cu
  ( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build_main.log" 2>&1 || tail -20 "$OUT/build_main.log"
  timeout 60 python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider -k "isolated and cuda" > "$OUT/isolated_main.log" 2>&1
  echo "isolation test against $MAIN_KERNEL (expected to fail on cuda-wgmma): exit $?"
  grep -E "passed|failed|^FAILED" "$OUT/isolated_main.log" | tail -6
fi
cat "$OUT/ab_hstu_fwd.md"
