#!/usr/bin/env bash
# Session 14's device calls (each under the 10-minute limit):
#   trace: a measurement build (TORCHFUSE_HSTU_BWD_TRACE_BUILD=1, set by this part before the build), the
#          HSTU backward's consumer phases (trace_hstu_bwd.py, events 7 and 8 split the SiLU / dZ^T store /
#          dQ barrier phase) at 128x1024x128, 16x4096x128 and with the window, on the 16-byte dK / dV stores
#   defer: the HSTU backward with each query tile's dQ deferred to the next tile (head dim 128), and its
#          ping-pong form: the backward GPU tests (every wgmma target), memcheck and racecheck on both, then
#          the A/B against dQ in its own tile (ab_hstu_bwd.py --forms persnd,pers,perspp,perspx; perspx: the
#          turn passes when the wgmmas have completed). RACE=0 skips racecheck
#   tracepp: the phase trace (measurement build) of the three forms at 128x1024x128: dQ in its own tile, deferred,
#          deferred with ping-pong
#   silu: the backward's element-wise step in six FP32 instructions per element (was ten): every HSTU GPU
#          test, memcheck on the wgmma backward, the A/B against the textbook form (--forms pers,persoldsilu)
#   spans: a masked tile's bits from the spans the sequence's options make non-empty only (hstu_col_bits): every
#          HSTU GPU test, memcheck, the A/B (--forms pers,persallspans) with the Triton backward (PEERS)
#   convert: (measured code since removed) dQ converted to q's dtype inside the backward kernel (the last warpgroup to add into a (sequence,
#          head) converts its rows): every HSTU GPU test, memcheck, the A/B (--forms pers,perscast)
#   mask: a masked tile's elements zeroed by an AND with the mask bits (no spills in the tile loop; selects made
#          ptxas spill there): every HSTU GPU test, memcheck, the A/B (--forms pers,persselect; the switch and
#          the select form removed since)
#   table: the full HSTU table (bench_hstu.py --cases full,special --compile --b2b, one process, Triton from PEERS)
#   final: every GPU test of the final code (all suites), memcheck on MEMCHECK_K's dynamic-embedding tests if
#          given
#   abfinal: the final backward against Triton at every shape (ab_hstu_bwd.py --forms pers, PEERS)
# (defer, tracepp and silu's A/B form measured code since removed: the deferred dQ and ping-pong, results/hstu_h100.md)
set -uo pipefail
PART=${1:?part: trace, defer, tracepp, silu, spans, convert, mask, table, final or abfinal}
case "$PART" in trace|tracepp) export TORCHFUSE_HSTU_BWD_TRACE_BUILD=1;; esac
source "$(dirname "$0")/device_build.sh"
source "$(dirname "$0")/device_hstu_checks.sh"
# ab NAME FORMS [ab_hstu_bwd.py arguments]: the one-process A/B of the backward forms, its table to $OUT/ab_NAME.md
ab() {
  local name=$1 forms=$2; shift 2
  timeout ${AB_TO:-200} python3 benchmarks/ab_hstu_bwd.py --forms "$forms" --rounds 3 "$@" --out "$OUT/ab_$name.md" > "$OUT/ab.log" 2>&1
  echo "ab exit $?"; cat "$OUT/ab_$name.md"
}
peers() { [ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"; }
if [ "$PART" = trace ]; then
  timeout 120 python3 benchmarks/trace_hstu_bwd.py > "$OUT/trace.md" 2>&1; echo "trace exit $?"; cat "$OUT/trace.md"
  timeout 90 python3 benchmarks/trace_hstu_bwd.py --shapes 16x4096x128 --window 256 > "$OUT/trace_window.md" 2>&1
  echo "trace (window) exit $?"; cat "$OUT/trace_window.md"
elif [ "$PART" = defer ]; then
  hstu_tests "test_backward and bfloat16 and d128_h4 and cuda-wgmma and not wgmmared and not wgmma1blk" \
    "(test_backward and cuda-wgmma) or isolated or one_block or persistent_grid" \
    "test_backward and bfloat16 and cuda-wgmma and not wgmmared and not wgmma1blk and (d128_h4 or long_d128 or dqk32 or many_short or window)"
  [ "${RACE:-1}" = 1 ] && timeout ${RACE_TO:-100} compute-sanitizer --tool racecheck --print-limit 5 $T -x \
    -k "test_backward and bfloat16 and cuda-wgmma and not wgmmared and not wgmma1blk and (d128_h4 or many_short)" > "$OUT/racecheck.log" 2>&1
  [ "${RACE:-1}" = 1 ] && echo "racecheck exit $?" && grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -2
  ab defer ${FORMS:-persnd,pers,perspp,perspx} --no-triton
elif [ "$PART" = tracepp ]; then
  for form in "0 0" "1 0" "1 1"; do
    set -- $form
    echo "DEFER=$1 PINGPONG=$2"
    TORCHFUSE_HSTU_BWD_DEFER=$1 TORCHFUSE_HSTU_BWD_PINGPONG=$2 timeout 60 python3 benchmarks/trace_hstu_bwd.py --shapes 128x1024x128 2>&1 | grep "|"
  done
elif [ "$PART" = silu ]; then
  hstu_tests "test_backward and bfloat16 and d128_h4 and cuda-wgmma" "cuda or kernel_choice or gpu" \
    "test_backward and cuda-wgmma and not wgmmared and (d128_h4 or long_d128 or dqk32 or many_short or window or d256)"
  ab silu pers,persoldsilu --no-triton
elif [ "$PART" = spans ]; then
  peers
  hstu_tests "test_backward and bfloat16 and window and cuda-wgmma" "cuda or kernel_choice or gpu" \
    "test_backward and (cuda-wgmma or cuda-mma) and not wgmmared and (d128_h4 or context or targets or window or d256)"
  AB_TO=${AB_TO:-300} ab spans pers,persallspans
elif [ "$PART" = table ]; then
  peers
  timeout 60 $T -x -k "test_backward and cuda-wgmma and bfloat16 and (many_short or long_d128)" > "$OUT/smoke.log" 2>&1
  echo "smoke exit $?"; tail -1 "$OUT/smoke.log"
  timeout ${BENCH_TO:-450} python3 benchmarks/bench_hstu.py --cases full,special --compile --b2b --out "$OUT/bench_full.md" 2>"$OUT/bench_full.err"
  echo "bench exit $?"; tail -3 "$OUT/bench_full.err"; cat "$OUT/bench_full.md"
elif [ "$PART" = final ]; then
  timeout ${TEST_TO:-420} python3 -m pytest tests -q -p no:cacheprovider -k "cuda or kernel_choice or gpu" > "$OUT/pytest_all.log" 2>&1
  echo "all GPU tests exit $?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest_all.log" | head -12
  if [ -n "${MEMCHECK_K:-}" ]; then
    timeout 90 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_dynamic_embedding.py -q \
      -p no:cacheprovider -x -k "$MEMCHECK_K" > "$OUT/memcheck.log" 2>&1
    echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
  fi
elif [ "$PART" = abfinal ]; then
  # the final backward against Triton at every shape (one process; Triton's backward stops with an illegal
  # memory access on the targets row, the last: the rows come from the log)
  peers
  timeout ${AB_TO:-300} python3 benchmarks/ab_hstu_bwd.py --forms pers --rounds 3 --out "$OUT/ab_final.md" > "$OUT/ab.log" 2>&1
  echo "ab exit $?"; grep "^|" "$OUT/ab.log"
elif [ "$PART" = convert ]; then
  hstu_tests "test_backward and bfloat16 and d128_h4 and cuda-wgmma" "cuda or kernel_choice or gpu" \
    "test_backward and cuda-wgmma and (d128_h4 or long_d128 or dqk32 or many_short or window or context or isolated)"
  ab convert pers,perscast --no-triton
elif [ "$PART" = mask ]; then
  hstu_tests "test_backward and bfloat16 and window and cuda-wgmma" "cuda or kernel_choice or gpu" \
    "test_backward and cuda-wgmma and not wgmmared and (d128_h4 or context or targets or window or d256 or dqk32)"
  ab mask pers,persselect --no-triton
fi
