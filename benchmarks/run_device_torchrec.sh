#!/usr/bin/env bash
# One device call for the dynamic-embedding tables and the TorchRec collections: build, their CUDA
# tests, compute-sanitizer memcheck on the table-batched tests, the DLRM-style step benchmark
# (table-batched, per-table and static in one run). Logs go to $OUT; the table is printed last.
#   bash benchmarks/run_device_torchrec.sh
set -uo pipefail
source "$(dirname "$0")/device_build.sh"
timeout 150 python3 -m pytest tests/test_dynamic_embedding.py tests/test_torchrec.py -q -n 4 -p no:cacheprovider -k cuda \
  > "$OUT/pytest.log" 2>&1
echo "pytest exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20; tail -1 "$OUT/pytest.log"
timeout 150 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_torchrec.py -q -p no:cacheprovider \
  -k "cuda and (table_batched or empty or weighted_sum)" > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $? at ${SECONDS}s"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
timeout 150 python3 benchmarks/bench_torchrec.py --out "$OUT/bench_torchrec.md" > "$OUT/bench_torchrec.log" 2>&1
echo "bench exit $? at ${SECONDS}s"; tail -7 "$OUT/bench_torchrec.log"
