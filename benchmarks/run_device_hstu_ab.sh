#!/usr/bin/env bash
# One device call for a change to the sm_90a HSTU forward: build; a 60 s smoke test (a hang costs device
# time); the HSTU GPU tests (every forward case on each kernel); compute-sanitizer on the wgmma forward
# and the tail-row isolation test; the kernels' A/B (ab_hstu_fwd.py --envs $AB_ENVS; "d" = the default
# dispatch). With BASE_KERNEL=<file> (another version of kernels/hstu_fwd_sm90.cu, e.g. main's, in a
# carried git-ignored folder) it then rebuilds with that file and runs the A/B again with $BASE_ENVS:
# both versions in one call, on one GPU.
#   BASE_KERNEL=.gl/s7/main_hstu_fwd_sm90.cu AB_ENVS=d,2:128,2:64 BASE_ENVS=d bash benchmarks/run_device_hstu_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
tail -3 "$OUT/build.log"
timeout 60 python3 -m pytest tests/test_hstu.py -q -x -p no:cacheprovider -k "cuda and bfloat16 and test_forward and plain_h2_d64" > "$OUT/smoke.log" 2>&1
rc=$?; echo "smoke exit $rc"; tail -2 "$OUT/smoke.log"; [ $rc = 0 ] || exit 1
export MEMCHECK_SEL="cuda and bfloat16 and (isolated or (test_forward and wgmma and (targets_groups_context or d256_dv32 or window_minfull or long_d256 or bias_1_head)))"
BUILD=0 BENCH=none TEST_TIMEOUT=${TEST_TIMEOUT:-220} MEMCHECK_TIMEOUT=${MEMCHECK_TIMEOUT:-130} RACECHECK_TIMEOUT=${RACECHECK_TIMEOUT:-60} \
  bash benchmarks/run_device_hstu.sh
timeout ${AB_TIMEOUT:-150} python3 benchmarks/ab_hstu_fwd.py --envs "${AB_ENVS:-0,1,2}" --out "$OUT/ab_hstu_fwd.md" > "$OUT/ab.log" 2>&1
echo "ab exit $?"; cat "$OUT/ab_hstu_fwd.md"
if [ -n "${BASE_KERNEL:-}" ] && [ -f "$BASE_KERNEL" ]; then
  cp kernels/hstu_fwd_sm90.cu /tmp/hstu_fwd_sm90.cu.mine
  cp "$BASE_KERNEL" kernels/hstu_fwd_sm90.cu
  ( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build_base.log" 2>&1 || tail -20 "$OUT/build_base.log"
  timeout ${AB_TIMEOUT:-150} python3 benchmarks/ab_hstu_fwd.py --envs "${BASE_ENVS:-d}" --out "$OUT/ab_base.md" > "$OUT/ab_base.log" 2>&1
  echo "ab (base kernel $BASE_KERNEL) exit $?"; cat "$OUT/ab_base.md"
  cp /tmp/hstu_fwd_sm90.cu.mine kernels/hstu_fwd_sm90.cu
fi
