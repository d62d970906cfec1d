#!/usr/bin/env bash
# One device call for torchfuse.patch_hf: build, the HF benchmark, GPU tests of test_hf.py and
# test_norm.py (CUDA cases), within BUDGET seconds in all. Logs go to $OUT; the table is printed last.
# transformers (5.17 on the lent GPU image) must be installed. Usage, from the repo root:
#   bash benchmarks/run_device_hf.sh [quick]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-320}
export MAX_JOBS=16 PYTHONUNBUFFERED=1
left() { echo $(( BUDGET - SECONDS )); }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
tail -3 "$OUT/build.log"; echo "built at ${SECONDS}s"
timeout $(( $(left) - 60 )) python3 benchmarks/bench_hf.py ${1:+--quick} --out "$OUT/bench_hf.md" 2>"$OUT/bench_hf.err"
echo "bench exit $? at ${SECONDS}s"; grep -v "profiler\|^$" "$OUT/bench_hf.err" | tail -5
timeout $(( $(left) - 25 )) python3 -m pytest tests/test_hf.py -q -x -p no:cacheprovider -k cuda > "$OUT/pytest_hf.log" 2>&1
echo "pytest hf exit $? at ${SECONDS}s"; tail -4 "$OUT/pytest_hf.log"
timeout $(( $(left) - 5 )) python3 -m pytest tests/test_norm.py -q -x -p no:cacheprovider -k cuda > "$OUT/pytest_norm.log" 2>&1
echo "pytest norm exit $? (124: cut at the budget) at ${SECONDS}s"; tail -2 "$OUT/pytest_norm.log"
cat "$OUT/bench_hf.md" 2>/dev/null
