#!/usr/bin/env bash
# Session 12's device calls (each under the 10-minute limit; a warm machine keeps the build):
#   check: the two branches session 11 wrote without a GPU, merged into main for this call:
#          dynemb-one-sync (a training batch into a full table with one host wait) and
#          dynemb-segsum-stage (SGD's segment update with the chunk's rows cp.async-staged in shared
#          memory; the norm and HSTU mma.sync kernels now take cp.async from kernels/tf_cp_async.cuh).
#          GPU tests (dynamic embeddings, TorchRec, norm, HSTU mma.sync), memcheck on the new paths,
#          racecheck on the staged kernel, then the A/B of both switches in GPU time and in the step.
#   layout: the bag layout in one kernel (dynemb_bag_layout) and the grouping in three launches (CUB
#          scan): dynamic-embedding and TorchRec GPU tests, memcheck on them, then the one-process A/B
#          (ab_train_step.py --switch _FUSED_LAYOUT, removed since), the step's gaps and kernel profile
#   pool:  the bags pooled before the host's wait (dynemb_find_or_insert_pool, dynemb_pool through inv
#          with clamped bounds): the same tests and memcheck, then the A/B (--switch _POOL_EARLY), the
#          step's gaps and profile, the training table (bench_dynamic_embedding.py --parts train)
#   split: host_split_dynemb_train.py, with one host wait and with two
#   final: the last code's GPU tests (dynamic embeddings, TorchRec), memcheck, the training table
#   sortgroup: branch dynemb-sort-group (written after the session's device time ran out): tests,
#          memcheck, the A/B (--switch _SORT_GROUP), the step's kernel profile
set -uo pipefail
PART=${1:?part: check, layout, pool, split, final or sortgroup}
source "$(dirname "$0")/device_build.sh"
T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
source "$(dirname "$0")/device_dynemb_checks.sh"
if [ "$PART" = check ]; then
  timeout 100 $P -k cuda > "$OUT/pytest_dynemb.log" 2>&1
  echo "dynemb pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|replay" "$OUT/pytest_dynemb.log" | tail -4
  timeout 50 python3 -m pytest tests/test_torchrec.py -q -p no:cacheprovider -k cuda > "$OUT/pytest_torchrec.log" 2>&1
  echo "torchrec pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_torchrec.log" | tail -3
  timeout 60 python3 -m pytest tests/test_norm.py -q -p no:cacheprovider -k cuda -x > "$OUT/pytest_norm.log" 2>&1
  echo "norm pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_norm.log" | tail -3
  timeout 60 $T -k "cuda-mma" -x > "$OUT/pytest_hstu_mma.log" 2>&1
  echo "hstu mma.sync pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_hstu_mma.log" | tail -3
  timeout 90 compute-sanitizer --tool memcheck --print-limit 5 $P -x -k "cuda and (n_valid or group_sorted or one_sync or bad_inputs or training or staged or segment_update)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
  timeout 45 compute-sanitizer --tool racecheck --print-limit 5 $P -x -k "cuda and staged" > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -2
  for round in 1 2; do for cfg in "0 0" "1 0" "0 1" "1 1"; do set -- $cfg
    (cd benchmarks && TORCHFUSE_DYNEMB_ONE_SYNC=$1 TORCHFUSE_DYNEMB_SEG_STAGE=$2 timeout 40 python3 profile_dynemb_train.py --opt sgd) > "$OUT/prof_$1$2.txt" 2>&1
    echo "round $round one_sync $1 stage $2: segsum $(grep -m1 -E "segsum_update(_staged)?_kernel" "$OUT/prof_$1$2.txt" | awk '{print $(NF-4)}'), $(grep -m1 "Self CUDA time total" "$OUT/prof_$1$2.txt"), syncs $(grep -m1 cudaStreamSynchronize "$OUT/prof_$1$2.txt" | awk '{print $NF}')"
  done; done
  for cfg in "0 0" "1 1" "0 0" "1 1"; do set -- $cfg
    TORCHFUSE_DYNEMB_ONE_SYNC=$1 TORCHFUSE_DYNEMB_SEG_STAGE=$2 timeout 80 python3 benchmarks/bench_dynamic_embedding.py --parts train --out "$OUT/train_$1$2.md" > "$OUT/train_$1$2.log" 2>&1
    echo "one_sync $1 stage $2: $(grep "training step" "$OUT/train_$1$2.log" | tr '\n' ' ')"
  done
elif [ "$PART" = layout ]; then
  dynemb_tests "bag_layout or group_sorted or one_sync or bad_inputs or training or bag"
  # call 4 ran here `ab_train_step.py --switch _FUSED_LAYOUT`; the switch and the ATen path went after it
  step_trace 30
elif [ "$PART" = pool ]; then
  dynemb_tests "pool or bag_layout or group_sorted or one_sync or bad_inputs or training or bag or n_valid"
  (cd benchmarks && timeout 150 python3 ab_train_step.py --switch _POOL_EARLY --rounds ${ROUNDS:-4} --steps 30) 2>&1 | grep "|"
  step_trace 8
  timeout 80 python3 benchmarks/bench_dynamic_embedding.py --parts train --out "$OUT/train.md" > "$OUT/train.log" 2>&1
  echo "train bench exit $?"; grep "training step" "$OUT/train.log"
elif [ "$PART" = split ]; then
  # where a step's wall time goes (one wait, then two)
  (cd benchmarks && timeout 120 python3 host_split_dynemb_train.py --steps 30 && \
   TORCHFUSE_DYNEMB_ONE_SYNC=0 timeout 100 python3 host_split_dynemb_train.py --steps 20) 2>&1 | grep "|"
elif [ "$PART" = final ]; then
  dynemb_tests "pool or bag_layout or bag or training or one_sync"
  timeout 80 python3 benchmarks/bench_dynamic_embedding.py --parts train --out "$OUT/train.md" > "$OUT/train.log" 2>&1
  echo "train bench exit $?"; grep "training step" "$OUT/train.log"
elif [ "$PART" = sortgroup ]; then
  dynemb_tests "sort_group or group_sorted or pool or bag or training or one_sync"
  (cd benchmarks && timeout 150 python3 ab_train_step.py --switch _SORT_GROUP --rounds ${ROUNDS:-4} --steps 30) 2>&1 | grep "|"
  step_trace 10
fi
