# Sourced by the HSTU device runners after device_build.sh. hstu_tests SMOKE TESTS MEMCHECK: a smoke run
# first (a hang costs device time: stop on a timeout), then the selected GPU tests, then memcheck on a
# selection; each argument a pytest -k expression for tests/test_hstu.py.
T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
hstu_tests() {
  timeout 60 $T -x -k "$1" > "$OUT/smoke.log" 2>&1
  local rc=$?; echo "smoke exit $rc"; tail -1 "$OUT/smoke.log"; [ $rc = 124 ] && exit 1
  timeout ${TEST_TO:-200} $T -k "$2" > "$OUT/pytest_hstu.log" 2>&1
  echo "hstu pytest exit $?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest_hstu.log" | head -12
  timeout ${MEMCHECK_TO:-120} compute-sanitizer --tool memcheck --print-limit 5 $T -x -k "$3" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
}
