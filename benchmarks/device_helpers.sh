# Sourced by the run_device_s*.sh runners after device_build.sh: the test, sanitizer, A/B and bench
# helpers the parts share. Each writes its log under $OUT and prints a short summary.
T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
D="python3 -m pytest tests/test_dynamic_embedding.py -q -p no:cacheprovider"
summary() { grep -E "passed|failed|^FAILED|^ERROR" "$1" | head -${2:-8}; }
# run_tests NAME TIMEOUT PYTEST... : a pytest run, logged to NAME.log, and its summary
run_tests() { local name=$1 to=$2; shift 2; timeout "$to" "$@" > "$OUT/$name.log" 2>&1; echo "$name exit $?"; summary "$OUT/$name.log" 12; }
# sanitize TOOL NAME SELECTION [PYTEST]: compute-sanitizer on the tests SELECTION picks (the HSTU file by default)
sanitize() {
  timeout ${MEM_TO:-90} compute-sanitizer --tool "$1" --print-limit 5 ${4:-$T} -x -k "$3" > "$OUT/$2.log" 2>&1
  echo "$2 exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/$2.log" | tail -3
}
fwd_tests() { run_tests pytest_fwd ${TEST_TO:-150} $T -k "(test_forward or cached) and not cpu"; }
# fwd_ab ENVS TAG: ab_hstu_fwd.py over ENVS in one process, back to back and single synced calls
fwd_ab() {
  for mode in --b2b ""; do
    timeout ${AB_TO:-90} python3 benchmarks/ab_hstu_fwd.py --envs "$1" --rounds 3 $mode --out "$OUT/ab_fwd_$2${mode}.md" \
      > "$OUT/ab_$2${mode}.log" 2>&1
    echo "ab ${mode:-single} exit $?"; grep "^|" "$OUT/ab_fwd_$2${mode}.md"
  done
}
# dyn_bench TAG: bench_dynamic_embedding.py's HBM table ops
dyn_bench() {
  timeout ${BENCH_TO:-200} python3 benchmarks/bench_dynamic_embedding.py --parts hbm --dims ${DIMS:-64,128} \
    --out "$OUT/dyn_$1.md" > "$OUT/dyn_$1.log" 2>&1
  echo "bench ($1) exit $?"
}
# rebuild_with SRC DST...: copy the carried previous sources in place and rebuild (a cross-build A/B)
rebuild_with() {
  while [ $# -ge 2 ]; do cp "$1" "$2"; shift 2; done
  ( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build_old.log" 2>&1 || { tail -20 "$OUT/build_old.log"; exit 1; }
  echo "rebuilt at ${SECONDS}s"
}
