#!/usr/bin/env bash
# One device call for the dynamic embeddings: build, GPU tests, compute-sanitizer memcheck on a few
# small tests, HierarchicalKV's benchmark (a binary built beforehand from the fetched headers, carried
# in the git-ignored peers folder given as $1; skipped when absent), our benchmark. Logs go to $OUT.
#   bash benchmarks/run_device_dynemb.sh [peers_dir] [quick]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PEERS=${1:-}
export MAX_JOBS=16 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
( time timeout 200 python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
tail -3 "$OUT/build.log"
timeout 120 python3 -m pytest tests/test_dynamic_embedding.py -q -p no:cacheprovider > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -12
timeout 100 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_dynamic_embedding.py -q -x \
  -p no:cacheprovider -k "cuda and (special_keys or lru_one_bucket or duplicates or empty_batches or (training and sgd and bag_weighted) or (training and adam and embedding-True) or (training and rowwise and bag_mean-False) or (random_ops and lru-True) or device_move or bag_eval or full_table_rows or concurrent_claims or segment_update)" \
  > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
# racecheck: the find_or_insert kernels share per-block miss lists and counts through shared memory
timeout 100 compute-sanitizer --tool racecheck --print-limit 5 python3 -m pytest tests/test_dynamic_embedding.py -q -x \
  -p no:cacheprovider -k "cuda and (full_table_rows or concurrent_claims)" > "$OUT/racecheck.log" 2>&1
echo "racecheck exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3
if [ -n "$PEERS" ] && [ -x "$PEERS/hkv_bench" ]; then
  timeout 100 "$PEERS/hkv_bench" > "$OUT/hkv.txt" 2>&1; echo "hkv exit $?"; grep -E "^dim|^\| *[01]\." "$OUT/hkv.txt"
fi
timeout 150 python3 benchmarks/bench_dynamic_embedding.py ${2:+--quick} --out "$OUT/bench_dynemb.md" > "$OUT/bench.log" 2>&1
echo "bench exit $?"; tail -40 "$OUT/bench.log"
# where the GPU time goes: one find_or_insert call, one training step (ours and PyTorch's)
if [ "${PROFILE:-1}" = 1 ]; then
  (cd benchmarks && for d in 8 128; do for lf in 0.5 1.0; do timeout 60 python3 profile_dynemb.py --dim $d --lf $lf; done; done) > "$OUT/profile_foi.txt" 2>&1
  (cd benchmarks && timeout 60 python3 profile_dynemb.py --dim 8 --host) > "$OUT/profile_foi_host.txt" 2>&1
  (cd benchmarks && timeout 90 python3 profile_dynemb_train.py --opt sgd) > "$OUT/profile_train.txt" 2>&1
  echo "profiles exit $?"
fi
