#!/usr/bin/env bash
# One device call for HSTU attention: build, GPU tests, compute-sanitizer (memcheck + racecheck) on a few
# small HSTU tests, benchmark. Logs go to $OUT (fetched back); the table is printed last.
#   BUILD=0|1 PEERS=<dir with generative_recommenders> SANITIZE=0|1 BENCH=none|quick|full TESTS=0|1 \
#     bash benchmarks/run_device_hstu.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
[ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${BUILD:-1}" = 1 ]; then
  ( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  tail -3 "$OUT/build.log"
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider -k "cuda or kernel_choice" > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; grep -E "passed|failed|Error|error" "$OUT/pytest.log" | tail -25
fi
if [ "${SANITIZE:-1}" = 1 ]; then
  SEL="${MEMCHECK_SEL:-cuda and ((bfloat16 and (plain_h2_d64 or targets_groups_context or d256_dv32 or window_minfull or bias_1_head or long_d256 or test_cached)) or (float32 and (plain_h2_d64 or bias_1_head)))}"
  timeout ${MEMCHECK_TIMEOUT:-120} compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_hstu.py -q -x -p no:cacheprovider \
    -k "$SEL" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
  timeout ${RACECHECK_TIMEOUT:-90} compute-sanitizer --tool racecheck --print-limit 5 python3 -m pytest tests/test_hstu.py -q -x -p no:cacheprovider \
    -k "cuda and bfloat16 and (test_forward and (targets_groups_context or long_d128) or test_backward and d256_dv32 or test_backward and plain_h2)" > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3
fi
case "${BENCH:-quick}" in
  quick) timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_hstu.py --quick --out "$OUT/bench_hstu.md" 2>"$OUT/bench_hstu.err"; echo "bench exit $?" ;;
  full) timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_hstu.py ${BENCH_ARGS:-} --out "$OUT/bench_hstu.md" 2>"$OUT/bench_hstu.err"; echo "bench exit $?" ;;
esac
[ -f "$OUT/bench_hstu.err" ] && tail -5 "$OUT/bench_hstu.err"
