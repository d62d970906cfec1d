#!/usr/bin/env bash
# One device call for a find_or_insert change: build; a smoke test; the A/B (ab_foi.py); the
# dynamic-embedding and TorchRec GPU tests (every CUDA test
# also with TORCHFUSE_DYNEMB_FOI_CLAIM=0, the two-step form); memcheck and racecheck on the
# find_or_insert tests; HierarchicalKV's benchmark if its binary is carried
# ($1: the git-ignored peers folder); then bench_dynamic_embedding.py. Short table last.
#   bash benchmarks/run_device_foi.sh [peers_dir]
set -uo pipefail
PEERS=${1:-}
source "$(dirname "$0")/device_build.sh"
timeout 60 python3 -m pytest tests/test_dynamic_embedding.py -q -x -p no:cacheprovider -k "cuda and (erased or concurrent_claims)" > "$OUT/smoke.log" 2>&1
rc=$?; echo "smoke exit $rc"; tail -3 "$OUT/smoke.log"; [ $rc = 0 ] || exit 1
(cd benchmarks && timeout 120 python3 ab_foi.py) > "$OUT/ab_foi.txt" 2>&1; echo "ab exit $?"
timeout 120 python3 -m pytest tests/test_dynamic_embedding.py tests/test_torchrec.py -q -p no:cacheprovider -k cuda > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -8
for r in $(seq ${TWOSTEP_REPS:-1}); do
  TORCHFUSE_DYNEMB_FOI_CLAIM=0 timeout 90 python3 -m pytest tests/test_dynamic_embedding.py -q -p no:cacheprovider -k cuda > "$OUT/pytest_twostep.log" 2>&1
  echo "pytest (two-step) exit $?"; grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/pytest_twostep.log" | tail -14
done
SEL="cuda and (erased or concurrent_claims or full_table_rows or random_ops or special_keys or lru_one_bucket or (training and sgd and bag_weighted))"
timeout 100 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_dynamic_embedding.py -q -x \
  -p no:cacheprovider -k "$SEL" > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
timeout 80 compute-sanitizer --tool racecheck --print-limit 5 python3 -m pytest tests/test_dynamic_embedding.py -q -x \
  -p no:cacheprovider -k "cuda and (erased or full_table_rows or concurrent_claims)" > "$OUT/racecheck.log" 2>&1
echo "racecheck exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3
if [ -n "$PEERS" ] && [ -x "$PEERS/hkv_bench" ]; then
  timeout 100 "$PEERS/hkv_bench" > "$OUT/hkv.txt" 2>&1; echo "hkv exit $?"; grep -E "^dim|^\| *[01]\." "$OUT/hkv.txt"
fi
[ "${BENCH:-1}" = 1 ] && { timeout 150 python3 benchmarks/bench_dynamic_embedding.py --out "$OUT/bench_dynemb.md" > "$OUT/bench.log" 2>&1; echo "bench exit $?"; cat "$OUT/bench_dynemb.md"; }
echo "== two-step test runs"; grep -E "passed|failed" "$OUT/pytest_twostep.log" | tail -1
echo "== A/B (ab_foi.py)"; tail -22 "$OUT/ab_foi.txt"
