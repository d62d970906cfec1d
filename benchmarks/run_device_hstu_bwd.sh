#!/usr/bin/env bash
# One device call for the sm_90a HSTU backward: build; smoke tests with short timeouts (a hang costs
# device time); the HSTU GPU tests (every backward case on both kernels, every forward case on each
# forward kernel); compute-sanitizer memcheck and racecheck on the wgmma backward; the backward A/B
# against mma.sync and, with PEERS=<dir holding generative_recommenders>, Triton (ab_hstu_bwd.py).
#   PEERS=.gl/hstu-peers bash benchmarks/run_device_hstu_bwd.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
[ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
tail -3 "$OUT/build.log"
T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
timeout 60 $T -x -k "test_backward and cuda-wgmma and bfloat16 and (plain_h2_d64 or d128_h4 or d256_dv32)" > "$OUT/smoke.log" 2>&1
rc=$?; echo "smoke tests exit $rc"; tail -15 "$OUT/smoke.log"; [ $rc = 124 ] && exit 1
timeout 60 python3 benchmarks/ab_hstu_bwd.py --shapes first --no-triton --rounds 1 2>&1 | tail -2
echo "smoke bench exit $?"
timeout ${TEST_TIMEOUT:-240} $T -k "cuda or kernel_choice" > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|^FAILED|Error" "$OUT/pytest.log" | head -30
SEL="test_backward and cuda-wgmma and bfloat16 and (plain_h2_d64 or targets_groups_context or window_minfull or long_d128 or dqk32 or strided or isolated or d192_dv256 or d256_targets_context)"
timeout ${MEMCHECK_TIMEOUT:-150} compute-sanitizer --tool memcheck --print-limit 5 $T -x -k "$SEL" > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3; grep -m5 -E "Invalid|out of bounds" "$OUT/memcheck.log"
timeout ${RACECHECK_TIMEOUT:-120} compute-sanitizer --tool racecheck --print-limit 5 $T -x \
  -k "test_backward and cuda-wgmma and bfloat16 and (plain_h2_d64 or long_d128 or d192_dv256)" > "$OUT/racecheck.log" 2>&1
echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3; grep -m5 -E "hazard|Race" "$OUT/racecheck.log"
# memcheck at a benchmark-sized jagged shape with targets (4 sequences of U[2048, 4096], 16 targets each)
timeout ${MEMCHECK_BIG_TIMEOUT:-90} compute-sanitizer --tool memcheck --print-limit 5 python3 -c "
import sys, torch, torchfuse; sys.path.insert(0, 'benchmarks'); import bench_hstu as bh
c = bh.make_case(4, 4096, 128, varied=True, targets=16)
g = torch.ops.torchfuse.hstu_bwd(torch.randn_like(c['v']), c['q'], c['k'], c['v'], c['offsets'], c['nt'], None, 4096,
                                 c['alpha'], None, 0, 0, 0, 1, False)
torch.cuda.synchronize(); print('big memcheck ran', [tuple(x.shape) for x in g[:3]])" > "$OUT/memcheck_big.log" 2>&1
echo "memcheck (4x4096x128, targets) exit $?"; grep -E "ERROR SUMMARY|big memcheck ran" "$OUT/memcheck_big.log"
timeout ${AB_TIMEOUT:-200} python3 benchmarks/ab_hstu_bwd.py --out "$OUT/ab_hstu_bwd.md" > "$OUT/ab_bwd.log" 2>&1
echo "ab exit $?"; grep -v "^|" "$OUT/ab_bwd.log" | tail -5; cat "$OUT/ab_hstu_bwd.md"
