#!/usr/bin/env bash
# Session 11's device calls (each under the 10-minute limit; a warm machine keeps the build):
#   check:  the two branches session 10 wrote without a GPU, merged for this call:
#           hstu-bwd-masked-skip (HSTU backward GPU tests incl. cuda-wgmmanoskip, memcheck, racecheck,
#           ab_hstu_bwd.py --forms persnoskip,pers at every shape) and dynemb-tier-init-evict (the
#           dynamic-embedding GPU tests, memcheck on the new op), then where a training step's GPU and
#           host time go (profile_dynemb_train.py)
#   train:  the dynamic-embedding GPU tests, memcheck on the segment / grouping / bag tests, the TorchRec
#           GPU tests, then the training step (profile and bench_dynamic_embedding.py --parts train)
#   hybrid: half the rows in host memory, ours against HierarchicalKV's hybrid mode (branch
#           dynemb-tier-init-evict's change, merged after the check)
#   onesync: branch dynemb-one-sync's check and A/B (tests, memcheck, TORCHFUSE_DYNEMB_ONE_SYNC=0 / 1)
#   stage:  branch dynemb-segsum-stage's check and A/B (tests incl. norm and HSTU mma.sync, memcheck,
#           racecheck, TORCHFUSE_DYNEMB_SEG_STAGE=0 / 1)
#   PEERS_HKV=.gl/dynemb-peers/hkv_bench bash benchmarks/run_device_s11.sh hybrid
set -uo pipefail
PART=${1:?part: check or hybrid}
source "$(dirname "$0")/device_build.sh"
T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
P="python3 -m pytest tests/test_dynamic_embedding.py -q -p no:cacheprovider"
BWD_SEL="test_backward and cuda-wgmma and not wgmmared and not wgmmanoskip and bfloat16"
if [ "$PART" = check ]; then
  timeout 60 $T -x -k "$BWD_SEL and (plain_h2_d64 or many_short_seqs or targets_groups)" > "$OUT/smoke.log" 2>&1
  rc=$?; echo "smoke exit $rc"; tail -1 "$OUT/smoke.log"; [ $rc = 124 ] && exit 1
  timeout 200 $T -k "(test_backward and cuda) or rows_outside or tile_empty" -rs > "$OUT/pytest_hstu.log" 2>&1
  echo "hstu pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_hstu.log" | tail -8
  timeout 80 compute-sanitizer --tool memcheck --print-limit 5 $T -x \
    -k "$BWD_SEL and (long_d128 or window_minfull or many_short_seqs or targets_groups or dqk32_dv96)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
  timeout 60 compute-sanitizer --tool racecheck --print-limit 5 $T -x -k "$BWD_SEL and (long_d128 or targets_groups)" > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -2
  timeout 150 python3 benchmarks/ab_hstu_bwd.py --forms persnoskip,pers --rounds 2 --no-triton --out "$OUT/ab_skip.md" > "$OUT/ab.log" 2>&1
  echo "ab exit $?"; cat "$OUT/ab_skip.md"
  timeout 100 $P -k cuda > "$OUT/pytest_dynemb.log" 2>&1
  echo "dynemb pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_dynemb.log" | tail -4
  timeout 60 compute-sanitizer --tool memcheck --print-limit 5 $P -x -k "cuda and (init_gather or eviction_record or host_tier)" > "$OUT/memcheck_dynemb.log" 2>&1
  echo "dynemb memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_dynemb.log" | tail -2
  (cd benchmarks && timeout 90 python3 profile_dynemb_train.py --opt sgd) > "$OUT/prof_train.txt" 2>&1
  echo "profile exit $?"; grep -E "^==|Self CUDA time total|Self CPU time total" "$OUT/prof_train.txt"
elif [ "$PART" = train ]; then
  # the training step after the segment kernels' 32-way search and register cap, and the forward's
  # grouping in one C++ op (dynemb_group_sorted) with the sort launched first
  timeout 100 $P -k cuda > "$OUT/pytest_dynemb.log" 2>&1
  echo "dynemb pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_dynemb.log" | tail -4
  timeout 90 compute-sanitizer --tool memcheck --print-limit 5 $P -x -k "cuda and (segment or group_sorted or bad_inputs or training or duplicates or bag)" > "$OUT/memcheck_dynemb.log" 2>&1
  echo "dynemb memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_dynemb.log" | tail -2
  timeout 60 python3 -m pytest tests/test_torchrec.py -q -p no:cacheprovider -k cuda > "$OUT/pytest_torchrec.log" 2>&1
  echo "torchrec pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_torchrec.log" | tail -3
  (cd benchmarks && timeout 90 python3 profile_dynemb_train.py --opt sgd) > "$OUT/prof_train.txt" 2>&1
  echo "profile exit $?"; grep -E "^==|Self CUDA time total|Self CPU time total" "$OUT/prof_train.txt"
  grep -E "segsum|pool_kernel|probe|RadixSort|cudaStreamSynchronize|cudaLaunchKernel" "$OUT/prof_train.txt" | awk '{$2=""; print substr($0,1,60), $(NF-5), $(NF-4), $(NF-1), $NF}' | head -14
  timeout 150 python3 benchmarks/bench_dynamic_embedding.py --parts train --out "$OUT/train.md" > "$OUT/train.log" 2>&1
  echo "train bench exit $?"; grep "training step" "$OUT/train.log"
elif [ "$PART" = pf ]; then
  # the segment update's L2 prefetch of the chunk's rows: tests, memcheck, then the A/B (GPU time of a
  # training step and the step itself, prefetch off then on, in turns)
  timeout 100 $P -x -k cuda > "$OUT/pytest_dynemb.log" 2>&1
  echo "dynemb pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_dynemb.log" | tail -4
  timeout 60 compute-sanitizer --tool memcheck --print-limit 5 $P -x -k "cuda and (segment or training or host)" > "$OUT/memcheck_dynemb.log" 2>&1
  echo "dynemb memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_dynemb.log" | tail -2
  for round in 1 2; do for pf in 0 1; do
    (cd benchmarks && TORCHFUSE_DYNEMB_SEG_PREFETCH=$pf timeout 60 python3 profile_dynemb_train.py --opt sgd) > "$OUT/prof_pf$pf.txt" 2>&1
    echo "round $round prefetch $pf: segsum_update $(grep -m1 segsum_update_kernel "$OUT/prof_pf$pf.txt" | awk '{print $(NF-4)}'), $(grep -m1 "Self CUDA time total" "$OUT/prof_pf$pf.txt")"
  done; done
  (cd benchmarks && TORCHFUSE_DYNEMB_SEG_PREFETCH=1 timeout 60 python3 profile_dynemb_train.py --opt adam) > "$OUT/prof_adam.txt" 2>&1
  echo "adam: segsum_update $(grep -m1 segsum_update_kernel "$OUT/prof_adam.txt" | awk '{print $(NF-4)}'), $(grep -m1 "Self CUDA time total" "$OUT/prof_adam.txt")"
  for pf in 0 1; do
    TORCHFUSE_DYNEMB_SEG_PREFETCH=$pf timeout 100 python3 benchmarks/bench_dynamic_embedding.py --parts train --out "$OUT/train_pf$pf.md" > "$OUT/train_pf$pf.log" 2>&1
    echo "prefetch $pf: $(grep "training step" "$OUT/train_pf$pf.log" | tr '\n' ' ')"
  done
elif [ "$PART" = final ]; then
  # the last code: the dynamic-embedding GPU tests, then the state_dict continuation (made eviction-free
  # after call 7's failure) 15 times with fresh seeds
  timeout 60 $P -k cuda > "$OUT/pytest_dynemb.log" 2>&1
  echo "dynemb pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|replay" "$OUT/pytest_dynemb.log" | tail -4
  for i in $(seq 15); do timeout 20 $P -k "state_dict_round_trip and cuda" 2>&1 | tail -1; done | sort | uniq -c | awk '{print $1, $2, $3}'
elif [ "$PART" = onesync ]; then
  # branch dynemb-one-sync: a training batch into a full table with one host wait (the grouping's count
  # handed to the insert on the device); tests, memcheck on the new paths, then the A/B
  # (TORCHFUSE_DYNEMB_ONE_SYNC=0: the two-wait path) in GPU time and the training step
  source "$(dirname "$0")/device_dynemb_checks.sh"
  dynemb_tests "n_valid or group_sorted or one_sync or bad_inputs or training"
  for round in ${ROUNDS:-1 2}; do for one in 0 1; do
    (cd benchmarks && TORCHFUSE_DYNEMB_ONE_SYNC=$one timeout 60 python3 profile_dynemb_train.py --opt sgd) > "$OUT/prof_one$one.txt" 2>&1
    echo "round $round one_sync $one: $(grep -m1 "Self CUDA time total" "$OUT/prof_one$one.txt"), stream syncs $(grep -m1 cudaStreamSynchronize "$OUT/prof_one$one.txt" | awk '{print $NF}')"
  done; done
  for one in 0 1 0 1; do
    TORCHFUSE_DYNEMB_ONE_SYNC=$one timeout 100 python3 benchmarks/bench_dynamic_embedding.py --parts train --out "$OUT/train_one$one.md" > "$OUT/train_one$one.log" 2>&1
    echo "one_sync $one: $(grep "training step" "$OUT/train_one$one.log" | tr '\n' ' ')"
  done
elif [ "$PART" = stage ]; then
  # branch dynemb-segsum-stage: SGD's segment update with the chunk's rows staged in shared memory by
  # cp.async (TORCHFUSE_DYNEMB_SEG_STAGE=0: the register kernel); the norm and HSTU mma.sync kernels
  # now take cp.async from kernels/tf_cp_async.cuh (same instructions): their GPU tests too
  timeout 100 $P -k cuda > "$OUT/pytest_dynemb.log" 2>&1
  echo "dynemb pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|replay" "$OUT/pytest_dynemb.log" | tail -4
  timeout 120 python3 -m pytest tests/test_norm.py -q -p no:cacheprovider -k cuda -x > "$OUT/pytest_norm.log" 2>&1
  echo "norm pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_norm.log" | tail -3
  timeout 120 $T -q -k "cuda-mma" -x > "$OUT/pytest_hstu_mma.log" 2>&1
  echo "hstu mma.sync pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_hstu_mma.log" | tail -3
  timeout 60 compute-sanitizer --tool memcheck --print-limit 5 $P -x -k "cuda and (staged or segment_update or training)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
  timeout 60 compute-sanitizer --tool racecheck --print-limit 5 $P -x -k "cuda and staged" > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -2
  for round in ${ROUNDS:-1 2}; do for st in 0 1; do
    (cd benchmarks && TORCHFUSE_DYNEMB_SEG_STAGE=$st timeout 60 python3 profile_dynemb_train.py --opt sgd) > "$OUT/prof_st$st.txt" 2>&1
    echo "round $round stage $st: segsum $(grep -m1 -E "segsum_update(_staged)?_kernel" "$OUT/prof_st$st.txt" | awk '{print $(NF-4)}'), $(grep -m1 "Self CUDA time total" "$OUT/prof_st$st.txt")"
  done; done
  for st in 0 1; do
    TORCHFUSE_DYNEMB_SEG_STAGE=$st timeout 100 python3 benchmarks/bench_dynamic_embedding.py --parts train --out "$OUT/train_st$st.md" > "$OUT/train_st$st.log" 2>&1
    echo "stage $st: $(grep "training step sgd" "$OUT/train_st$st.log")"
  done
elif [ "$PART" = hstu ]; then
  # the full HSTU table (ping-pong forward at every shape since session 10), one process
  [ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
  timeout 60 $T -x -k "test_forward and cuda-wgmma and bfloat16 and (many_short_seqs or long_d128)" > "$OUT/smoke.log" 2>&1
  echo "smoke exit $?"; tail -1 "$OUT/smoke.log"
  timeout ${BENCH_TO:-420} python3 benchmarks/bench_hstu.py --cases full,special --compile --b2b --out "$OUT/bench_full.md" 2>"$OUT/bench_full.err"
  echo "bench exit $?"; tail -3 "$OUT/bench_full.err"; cat "$OUT/bench_full.md"
elif [ "$PART" = hybrid ]; then
  if [ -n "${PEERS_HKV:-}" ]; then
    timeout ${HKV_TO:-200} "$PEERS_HKV" hybrid > "$OUT/hkv_hybrid.txt" 2>&1; echo "hkv hybrid exit $?"; grep -v "^$" "$OUT/hkv_hybrid.txt" | tail -16
  fi
  timeout ${OURS_TO:-300} python3 benchmarks/bench_dynamic_embedding.py --parts half_host --dims ${DIMS:-64,128} --out "$OUT/ours_half_host.md" > "$OUT/ours.log" 2>&1
  echo "ours exit $?"; grep -v "^|" "$OUT/ours.log" | tail -8; cat "$OUT/ours_half_host.md"
  if [ -n "${TRAIN:-}" ]; then  # a second sample of the training step (its wall time moves from machine to machine)
    timeout 100 python3 benchmarks/bench_dynamic_embedding.py --parts train --out "$OUT/train.md" > "$OUT/train.log" 2>&1
    echo "train bench exit $?"; grep "training step" "$OUT/train.log"
  fi
fi
