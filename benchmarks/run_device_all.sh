#!/usr/bin/env bash
# One device call over the whole package (the integration check after merging families): build,
# every CUDA test (4 pytest workers), compute-sanitizer memcheck on the TorchRec tests, the TorchRec
# DLRM-style benchmark. Each family's own runner (run_device_<family>.sh) has its benchmarks.
# Logs go to $OUT; the summary is printed last. Usage, from the repo root:
#   bash benchmarks/run_device_all.sh
set -uo pipefail
source "$(dirname "$0")/device_build.sh"
timeout ${TEST_S:-240} python3 -m pytest tests -q -n 4 -p no:cacheprovider -k cuda > "$OUT/pytest.log" 2>&1
echo "pytest (cuda) exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20; tail -2 "$OUT/pytest.log"
timeout 90 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_torchrec.py -q -x -p no:cacheprovider -k cuda \
  > "$OUT/memcheck_torchrec.log" 2>&1
echo "memcheck torchrec exit $? at ${SECONDS}s"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_torchrec.log" | tail -2
timeout 120 python3 benchmarks/bench_torchrec.py --out "$OUT/bench_torchrec.md" > "$OUT/bench_torchrec.log" 2>&1
echo "bench_torchrec exit $? at ${SECONDS}s"; tail -6 "$OUT/bench_torchrec.log"
