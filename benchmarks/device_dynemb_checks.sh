# Sourced by the dynamic-embedding device runners after device_build.sh: the GPU tests + memcheck,
# and the training step's idle gaps and kernel profile.
P="python3 -m pytest tests/test_dynamic_embedding.py -q -p no:cacheprovider"
# the dynamic-embedding and TorchRec GPU tests, then memcheck on the tests selected by $1
dynemb_tests() {
  timeout 100 $P -k cuda > "$OUT/pytest_dynemb.log" 2>&1
  echo "dynemb pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|replay" "$OUT/pytest_dynemb.log" | tail -4
  timeout 50 python3 -m pytest tests/test_torchrec.py -q -p no:cacheprovider -k cuda > "$OUT/pytest_torchrec.log" 2>&1
  echo "torchrec pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_torchrec.log" | tail -3
  timeout 100 compute-sanitizer --tool memcheck --print-limit 5 $P -x -k "cuda and ($1)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
}
# the training step's GPU idle gaps (a profiled step) and its kernel time
step_trace() {
  (cd benchmarks && timeout 40 python3 gaps_dynemb_train.py --min-us 5) > "$OUT/gaps.txt" 2>&1
  echo "gaps exit $?"; grep -E "^host|^\\| [0-9]" "$OUT/gaps.txt" | tail -${1:-30}
  (cd benchmarks && timeout 40 python3 profile_dynemb_train.py --opt sgd) > "$OUT/prof.txt" 2>&1
  echo "profile exit $?"; grep -m1 "Self CUDA time total" "$OUT/prof.txt"
}
