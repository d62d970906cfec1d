#!/usr/bin/env bash
# Session 15's device calls (each under the 10-minute limit). Both parts ran the in-kernel dQ conversion, since
# reverted (results/hstu_h100.md, session 15; the code is the commit before the revert): the conversion's env
# switches and A/B forms (perscast, persnoconv, persnocount) are gone from main. Both designs (in the consumers; in a
# dQ-writer warp) are in the history, each in the commit before its revert.
#   convert: dQ converted to q's dtype inside the HSTU backward kernel, each 64-row query tile by the warpgroup
#            whose reduce-add lands last on it (DqTile, kernels/hstu_bwd_sm90.cu): every HSTU backward GPU test
#            (the in-kernel conversion, the caller's cast, the path-ran test), memcheck, then the A/B against
#            the cast pass (ab_hstu_bwd.py --forms pers,perscast) with the Triton backward (PEERS)
#   convab: the conversion's forms (counted down two tiles late, one tile late, unordered: measurement only) against
#            the cast pass, no Triton, N <= 2048 (ab_hstu_bwd.py --shapes short), after the backward GPU tests
#   fwdab: the sm_90a forward's SiLU as h (1 + tanh h) with P's 1 / S moved onto O, the masked tile zeroed by an AND:
#          the forward GPU tests, then ab_hstu_fwd.py on this build, then on MAIN_FWD (the previous
#          kernels/hstu_fwd_sm90.cu, carried) rebuilt in place: a cross-build A/B, same machine
#   race:    racecheck on the converting backward (RACE_K), then the dynamic-embedding GPU tests and memcheck
#            on DYN_K
set -uo pipefail
PART=${1:?part: convert, convab, fwdab or race}
source "$(dirname "$0")/device_build.sh"
source "$(dirname "$0")/device_hstu_checks.sh"
peers() { [ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"; }
if [ "$PART" = convert ]; then
  peers
  hstu_tests "converted_in_kernel or (test_backward and bfloat16 and d128_h4 and cuda-wgmma)" \
    "test_backward and not cpu" \
    "test_backward and bfloat16 and cuda-wgmma and not wgmmared and (d128_h4 or many_short or window or context or long_d128 or dqk32)"
  timeout ${AB_TO:-220} python3 benchmarks/ab_hstu_bwd.py --forms pers,perscast --rounds 3 --out "$OUT/ab_convert.md" > "$OUT/ab.log" 2>&1
  echo "ab exit $?"; grep "^|" "$OUT/ab.log"; grep -i "error\|failed" "$OUT/ab.log" | head -3
elif [ "$PART" = convab ]; then
  hstu_tests "converted_in_kernel or (test_backward and bfloat16 and d128_h4 and cuda-wgmma)" "test_backward and not cpu" \
    "test_backward and bfloat16 and cuda-wgmma and not wgmmared and (d128_h4 or many_short or window)"
  timeout ${AB_TO:-240} python3 benchmarks/ab_hstu_bwd.py --forms pers,perscast --rounds 3 --no-triton \
    --shapes ${SHAPES:-short} --out "$OUT/ab_convab.md" > "$OUT/ab.log" 2>&1
  echo "ab exit $?"; grep "^|" "$OUT/ab.log"; grep -i "error\|failed" "$OUT/ab.log" | head -3
elif [ "$PART" = fwdab ]; then
  timeout ${TEST_TO:-150} $T -k "(test_forward or cached) and not cpu" > "$OUT/pytest_fwd.log" 2>&1
  echo "fwd pytest exit $?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest_fwd.log" | head -8
  timeout 90 compute-sanitizer --tool memcheck --print-limit 5 $T -x -k "test_forward and cuda-wgmma and bfloat16 and (d128_h4 or window or targets or many_short)" > "$OUT/memcheck_fwd.log" 2>&1
  echo "fwd memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_fwd.log" | tail -2
  timeout ${AB_TO:-120} python3 benchmarks/ab_hstu_fwd.py --envs 1,2 --rounds 3 --out "$OUT/ab_fwd_new.md" > "$OUT/ab_fwd_new.log" 2>&1
  echo "ab (new) exit $?"
  cp "${MAIN_FWD:?}" kernels/hstu_fwd_sm90.cu
  ( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build_main.log" 2>&1 || { tail -20 "$OUT/build_main.log"; exit 1; }
  echo "rebuilt at ${SECONDS}s"
  timeout ${AB_TO:-120} python3 benchmarks/ab_hstu_fwd.py --envs 1,2 --rounds 3 --out "$OUT/ab_fwd_main.md" > "$OUT/ab_fwd_main.log" 2>&1
  echo "ab (main) exit $?"
  echo "new:"; grep "^|" "$OUT/ab_fwd_new.md"; echo "main:"; grep "^|" "$OUT/ab_fwd_main.md"
elif [ "$PART" = race ]; then
  timeout ${RACE_TO:-150} compute-sanitizer --tool racecheck --print-limit 5 $T -x \
    -k "${RACE_K:-test_backward and bfloat16 and cuda-wgmma and not wgmmared and (d128_h4 or many_short or plain_h2)}" > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3
  if [ -n "${DYN_K:-}" ]; then
    timeout ${DYN_TO:-200} python3 -m pytest tests/test_dynamic_embedding.py -q -p no:cacheprovider -k cuda > "$OUT/pytest_dyn.log" 2>&1
    echo "dynemb pytest exit $?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest_dyn.log" | head -12
    timeout 120 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_dynamic_embedding.py -q \
      -p no:cacheprovider -x -k "$DYN_K" > "$OUT/memcheck_dyn.log" 2>&1
    echo "dynemb memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_dyn.log" | tail -2
  fi
fi
