#!/usr/bin/env bash
# The HSTU device run behind results/hstu_h100.md: build, GPU tests, compute-sanitizer, then in one process
# each: full-length and targets / window rows against eager, torch.compile, Triton and SDPA; the jagged
# (U[N/2, N]) rows against eager (Triton's backward crashes on them, taking the process down).
#   PEERS=<dir with generative_recommenders> bash benchmarks/run_device_hstu_final.sh
set -uo pipefail
[ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
BENCH=none bash benchmarks/run_device_hstu.sh
timeout ${BENCH1_TIMEOUT:-330} python3 benchmarks/bench_hstu.py --cases full,special --compile --out "$OUT/bench_full.md" 2>"$OUT/bench_full.err"
echo "bench (full, special) exit $?"; tail -3 "$OUT/bench_full.err"
timeout ${BENCH2_TIMEOUT:-90} python3 benchmarks/bench_hstu.py --cases varied --no-triton --out "$OUT/bench_varied.md" 2>"$OUT/bench_varied.err"
echo "bench (varied) exit $?"
grep -h "^|" "$OUT/bench_full.md" "$OUT/bench_varied.md"
