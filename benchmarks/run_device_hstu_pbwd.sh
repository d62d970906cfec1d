#!/usr/bin/env bash
# The persistent sm_90a HSTU backward (branch hstu-bwd-persistent), one part per device call (each under
# the 10-minute limit; the build is kept between calls on a warm machine):
#   test: smoke runs of both launch forms with short timeouts (a hang costs device time), every HSTU
#         backward test on CUDA (persistent by default, test_backward_one_block_per_item for
#         TORCHFUSE_HSTU_BWD_PERSISTENT=0, the grid check), the forward on the many-items case,
#         compute-sanitizer memcheck and racecheck on both forms
#   ab:   ab_hstu_bwd.py, mma.sync / one block per item / persistent (and Triton with PEERS)
#   PEERS=.gl/hstu-peers bash benchmarks/run_device_hstu_pbwd.sh test
#   PEERS=.gl/hstu-peers bash benchmarks/run_device_hstu_pbwd.sh ab
set -uo pipefail
PART=${1:?part: test or ab}
[ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
source "$(dirname "$0")/device_build.sh"
T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
if [ "$PART" = test ]; then
  timeout 90 $T -x -k "test_backward and cuda-wgmma and bfloat16 and (plain_h2_d64 or d128_h4 or d256_dv32 or many_short_seqs)" \
    > "$OUT/smoke.log" 2>&1
  rc=$?; echo "smoke (persistent) exit $rc"; tail -3 "$OUT/smoke.log"; [ $rc = 124 ] && exit 1
  timeout 60 $T -x -k "one_block_per_item and bfloat16 and (plain_h2_d64 or d256_targets_context or many_short_seqs)" \
    > "$OUT/smoke1.log" 2>&1
  rc=$?; echo "smoke (one block per item) exit $rc"; tail -3 "$OUT/smoke1.log"; [ $rc = 124 ] && exit 1
  timeout ${TEST_TO:-240} $T -k "(test_backward and cuda) or one_block_per_item or persistent_grid or kernel_choice or (test_forward and many_short_seqs)" \
    > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest.log" | head -30
  timeout ${MEM_TO:-120} compute-sanitizer --tool memcheck --print-limit 5 $T -x \
    -k "(test_backward and cuda-wgmma and bfloat16 and (plain_h2_d64 or long_d128 or d256_targets_context or window_minfull or many_short_seqs)) or (one_block_per_item and bfloat16 and (many_short_seqs or d256_targets_context))" \
    > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3; grep -m5 -E "Invalid|out of bounds" "$OUT/memcheck.log"
  timeout ${RACE_TO:-120} compute-sanitizer --tool racecheck --print-limit 5 $T -x \
    -k "test_backward and cuda-wgmma and bfloat16 and (plain_h2_d64 or d192_dv256 or many_short_seqs)" > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3; grep -m5 -E "hazard|Race" "$OUT/racecheck.log"
else
  timeout ${AB_TO:-420} python3 benchmarks/ab_hstu_bwd.py --forms mma,1blk,pers --out "$OUT/ab_pbwd.md" > "$OUT/ab.log" 2>&1
  echo "ab exit $?"; grep -v "^|" "$OUT/ab.log" | tail -4; cat "$OUT/ab_pbwd.md"
fi
