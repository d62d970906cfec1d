#!/usr/bin/env bash
# Session 13's device calls (each under the 10-minute limit):
#   sortgroup: branch dynemb-sort-group (CUB radix sort with int32 values + the grouping in one op),
#          merged into main for this call: dynamic-embedding and TorchRec GPU tests, memcheck, the
#          one-process A/B (--switch _SORT_GROUP), the step's kernel profile, then where a step's wall
#          time goes (host_split_dynemb_train.py, incl. the no-op Function's backward: the engine's cost)
#   sgdred: SGD's segment update by vector reductions (segsum_sgd_red_kernel; measured 486 against
#          481 us, no gain, removed since: this part now times the register path only), the pool op's
#          slots past n_valid defined (foi_find_kernel), dynemb_bag_layout's with_bags: GPU tests,
#          memcheck, the kernel time of each segment-update form, the one-process A/B
#          (--switch TORCHFUSE_DYNEMB_SGD_RED), the training table
#   dqkeys: the HSTU wgmma backward with dQ by keys at head dim 128 (TORCHFUSE_HSTU_BWD_DQ_KEYS=1): its
#          GPU tests and the default's, memcheck and racecheck on it, then the A/B against the default
#          (ab_hstu_bwd.py --forms pers,perskeys). Measured 10-12% slower at every head-dim-128 shape and
#          removed since (kernel, tests and A/B form): this part no longer runs as it did.
#   trace: a measurement build (TORCHFUSE_HSTU_BWD_TRACE_BUILD=1, set by this part before the build) and
#          the HSTU backward's consumer phases (trace_hstu_bwd.py) at 128x1024x128 and 16x4096x128, and
#          with the window; then a smoke test of the backward on that build
#   vecstore: the HSTU backward's dK / dV by 16-byte stores after a quad transpose: the backward GPU tests
#          (every wgmma target; 1blk keeps the 4-byte stores), memcheck, the A/B against 4-byte stores
#          (ab_hstu_bwd.py --forms pers,pers4b)
#   final: every GPU test of the final code (all suites), memcheck on the dynamic-embedding changes of the
#          session, the training table
set -uo pipefail
PART=${1:?part: sortgroup, sgdred, dqkeys, trace, vecstore or final}
[ "$PART" = trace ] && export TORCHFUSE_HSTU_BWD_TRACE_BUILD=1
source "$(dirname "$0")/device_build.sh"
source "$(dirname "$0")/device_dynemb_checks.sh"
if [ "$PART" = sortgroup ]; then
  dynemb_tests "sort_group or group_sorted or pool or bag or training or one_sync"
  (cd benchmarks && timeout 150 python3 ab_train_step.py --switch _SORT_GROUP --rounds ${ROUNDS:-4} --steps 30) 2>&1 | grep "|"
  step_trace 10
  (cd benchmarks && timeout 100 python3 host_split_dynemb_train.py --steps 30) 2>&1 | grep "|"
elif [ "$PART" = sgdred ]; then
  dynemb_tests "vector_reduction or segment_update or n_valid or bag_layout or bad_inputs or training or pool"
  for red in 1 0 1 0; do
    (cd benchmarks && TORCHFUSE_DYNEMB_SGD_RED=$red timeout 40 python3 profile_dynemb_train.py --opt sgd) > "$OUT/prof_red$red.txt" 2>&1
    echo "red $red: $(grep -m1 -E "segsum_(sgd_red|update)_kernel" "$OUT/prof_red$red.txt" | awk '{print $1, $2, $(NF-4)}'), $(grep -m1 "Self CUDA time total" "$OUT/prof_red$red.txt")"
  done
  (cd benchmarks && timeout 150 python3 ab_train_step.py --switch TORCHFUSE_DYNEMB_SGD_RED --rounds ${ROUNDS:-4} --steps 30) 2>&1 | grep "|"
  timeout 80 python3 benchmarks/bench_dynamic_embedding.py --parts train --out "$OUT/train.md" > "$OUT/train.log" 2>&1
  echo "train bench exit $?"; grep "training step" "$OUT/train.log"
elif [ "$PART" = dqkeys ]; then
  [ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
  source "$(dirname "$0")/device_hstu_checks.sh"
  hstu_tests "dq_by_keys and d128_h4" "dq_by_keys or isolated or (test_backward and cuda-wgmma and not wgmmared and not 1blk)" \
    "dq_by_keys"
  [ "${RACE:-1}" = 1 ] && timeout 120 compute-sanitizer --tool racecheck --print-limit 5 $T -x -k "dq_by_keys and (d128_h4 or long_d128 or window)" > "$OUT/racecheck.log" 2>&1
  rc=$?; [ "${RACE:-1}" = 1 ] && { echo "racecheck exit $rc"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -2; }
  timeout 150 python3 benchmarks/ab_hstu_bwd.py --forms pers,perskeys --rounds 3 --no-triton --out "$OUT/ab_dqkeys.md" > "$OUT/ab.log" 2>&1
  echo "ab exit $?"; grep -v "^|" "$OUT/ab.log" | tail -3; cat "$OUT/ab_dqkeys.md"
elif [ "$PART" = final ]; then
  timeout 420 python3 -m pytest tests -q -p no:cacheprovider -k "cuda or kernel_choice or gpu" > "$OUT/pytest_all.log" 2>&1
  echo "all GPU tests exit $?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest_all.log" | head -12
  timeout 60 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_dynamic_embedding.py -q \
    -p no:cacheprovider -x -k "cuda and (n_valid_and_abort or bag_layout or bad_inputs or sort_group)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
  timeout 80 python3 benchmarks/bench_dynamic_embedding.py --parts train --out "$OUT/train.md" > "$OUT/train.log" 2>&1
  echo "train bench exit $?"; grep "training step" "$OUT/train.log"
elif [ "$PART" = trace ]; then
  timeout 120 python3 benchmarks/trace_hstu_bwd.py > "$OUT/trace.md" 2>&1; echo "trace exit $?"; cat "$OUT/trace.md"
  timeout 90 python3 benchmarks/trace_hstu_bwd.py --shapes 16x4096x128 --window 256 > "$OUT/trace_window.md" 2>&1
  echo "trace (window) exit $?"; cat "$OUT/trace_window.md"
  timeout 60 python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider -x -k "test_backward and cuda-wgmma and bfloat16 and not wgmmared" 2>&1 | tail -1
elif [ "$PART" = vecstore ]; then
  source "$(dirname "$0")/device_hstu_checks.sh"
  hstu_tests "test_backward and cuda-wgmma and bfloat16 and d128_h4" \
    "(test_backward and cuda-wgmma) or isolated or one_block or persistent_grid" \
    "test_backward and cuda-wgmma and bfloat16 and not wgmmared and (d128_h4 or long_d128 or dqk32 or d256_targets or many_short or window)"
  timeout 150 python3 benchmarks/ab_hstu_bwd.py --forms pers,pers4b --rounds 3 --no-triton --out "$OUT/ab_vec.md" > "$OUT/ab.log" 2>&1
  echo "ab exit $?"; cat "$OUT/ab_vec.md"
fi
