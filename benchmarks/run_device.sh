#!/usr/bin/env bash
# One device call: build, GPU tests, compute-sanitizer on the norm tests, benchmarks. Logs go to
# $OUT (fetched back); the tables are printed last. Usage (from the repo root, on the GPU machine):
#   bash benchmarks/run_device.sh [quick]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)"
( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
tail -3 "$OUT/build.log"
python3 -m pytest tests -q -x -p no:cacheprovider > "$OUT/pytest.log" 2>&1; echo "pytest exit $?"; tail -15 "$OUT/pytest.log"
if [ "${SANITIZE:-1}" = 1 ]; then
  compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_norm.py -q -x -p no:cacheprovider \
    -k "cuda and (n100 or n768 or n4099 or n65536 or zero_and_one or strides or many_rows or second_norm or mixed)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
  compute-sanitizer --tool racecheck --print-limit 5 python3 -m pytest tests/test_norm.py -q -x -p no:cacheprovider \
    -k "cuda and (n768 or n2560 or n65536) and bfloat16" > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3
fi
python3 benchmarks/decode_overhead.py 2>&1 | tee "$OUT/decode_overhead.txt"
python3 -m torchfuse > "$OUT/main.log" 2>&1; echo "python -m torchfuse exit $?"; tail -8 "$OUT/main.log"
python3 benchmarks/bench_norm.py ${1:+--quick} --out "$OUT/bench_norm.md" 2>"$OUT/bench_norm.err"; echo "bench exit $?"
