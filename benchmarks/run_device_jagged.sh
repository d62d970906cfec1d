#!/usr/bin/env bash
# One device call for the jagged ops: build, GPU tests and compute-sanitizer memcheck on a subset of
# them (side by side), then the benchmark. Logs go to $OUT (fetched back); the table is printed last.
# Usage (repo root, GPU machine):
#   bash benchmarks/run_device_jagged.sh [PEERS_DIR]
# PEERS_DIR holds generative-recommenders' Triton jagged files (fetched, never committed); without it
# the benchmark skips that column. COMPILE=1 adds the torch.compile column (slower: it compiles
# every op at every shape). BUDGET (seconds, default 230) bounds the whole script: each stage
# gets what is left, the benchmark writes its rows as it goes (DIMS: its row shapes, in order).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PEERS=${1:-}; [ -n "$PEERS" ] && PEERS=$(realpath "$PEERS")
BUDGET=${BUDGET:-230}
left() { echo $(( BUDGET - SECONDS )); }
export MAX_JOBS=16 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
tail -3 "$OUT/build.log"; echo "built at ${SECONDS}s"
T_CHECK=${T_CHECK:-90}
timeout "$T_CHECK" python3 -m pytest tests/test_jagged.py -q -p no:cacheprovider -k cuda > "$OUT/pytest_jagged.log" 2>&1 &
PY=$!
if [ "${SANITIZE:-1}" = 1 ]; then
  timeout "$T_CHECK" compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_jagged.py -q -p no:cacheprovider \
    -k "cuda and not 64bit and not compile and (stay_in_bounds or (concat_split_2d and (bfloat16 or int64)) or (to_padded and int64 and (float32 or bfloat16)) or index_select or empty or (dense_add and (bfloat16 or float64)) or jagged_concat_split or non_contiguous or compat)" \
    > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
fi
wait $PY; echo "pytest exit $?"; tail -4 "$OUT/pytest_jagged.log"
echo "checks done at ${SECONDS}s"
timeout $(( $(left) > 10 ? $(left) : 10 )) python3 benchmarks/bench_jagged.py ${PEERS:+--peers "$PEERS"} --quick --ab $( [ "${COMPILE:-0}" = 1 ] || echo --no-compile ) \
  --dims "${DIMS:-128,512,1}" --out "$OUT/bench_jagged.md" 2>"$OUT/bench_jagged.err"
echo "bench exit $? at ${SECONDS}s"; tail -5 "$OUT/bench_jagged.err"
cat "$OUT/bench_jagged.md" 2>/dev/null
