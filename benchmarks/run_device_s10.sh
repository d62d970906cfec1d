#!/usr/bin/env bash
# Session 10's device calls (each under the 10-minute limit; a warm machine keeps the build):
#   probe:  HSTU outputs without the full memset (uncovered rows zeroed by a small kernel): the HSTU GPU
#           tests, memcheck on the new kernel's test; the dynamic-embedding GPU tests (session 9's sync
#           op test had not run on a GPU); where a single backward call's time goes
#           (probe_hstu_bwd.py) and ncu on the wgmma backward kernel (stall reasons, tensor-pipe use,
#           L2 reduction traffic) at 16x1024x128 and 16x4096x128
#   hybrid: half the rows in host memory, ours against HierarchicalKV's hybrid mode (PEERS_HKV: its
#           benchmark binary, built by the git-ignored .gl/dynemb-peers/build_hkv.sh), dims 64 and 128
#   dqtma:  the backward's dQ by TMA reduce-add (branch hstu-dq-tma): smoke (a hang costs device time),
#           the HSTU backward GPU tests on both dQ paths, memcheck and racecheck on the TMA path, then
#           ab_hstu_bwd.py --forms persred,pers (red.add / TMA, same process) at every shape
#   final:  the L2 prefetches (next item's K/V in the backward, Q in the forward) and the dynamic
#           embedding's host rows visited in slot order: HSTU smoke, GPU tests, memcheck, the A/Bs
#           (ab_hstu_bwd.py --forms persnopf,pers --shapes short; ab_hstu_fwd.py ping-pong / plain, each
#           with and without the prefetch); the dynamic-embedding GPU tests, memcheck on the ordered
#           gather / scatter, HierarchicalKV's hybrid mode (PEERS_HKV) and our half_host rows
# The prefetch forms the final call measured (ab_hstu_bwd.py persnopf / --shapes short, ab_hstu_fwd.py
# "/nopf") were reverted after it (results/hstu_h100.md has their figures); the part now runs the A/Bs
# that remain (dQ red.add / TMA at 128x1024, ping-pong / plain).
#   bash benchmarks/run_device_s10.sh probe
#   PEERS_HKV=.gl/dynemb-peers/hkv_bench bash benchmarks/run_device_s10.sh hybrid
set -uo pipefail
PART=${1:?part: probe or hybrid}
[ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
source "$(dirname "$0")/device_build.sh"
if [ "$PART" = probe ]; then
  T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
  timeout 60 $T -x -k "rows_outside or validate_false" > "$OUT/smoke.log" 2>&1
  rc=$?; echo "smoke exit $rc"; tail -2 "$OUT/smoke.log"; [ $rc = 124 ] && exit 1
  timeout ${TEST_TO:-200} $T -k "cuda" > "$OUT/pytest_hstu.log" 2>&1
  echo "hstu pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_hstu.log" | tail -6
  timeout 60 compute-sanitizer --tool memcheck --print-limit 5 $T -x -k "rows_outside and cuda" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
  P="python3 -m pytest tests/test_dynamic_embedding.py -q -p no:cacheprovider"
  timeout 90 $P -k cuda > "$OUT/pytest_dynemb.log" 2>&1
  echo "dynemb pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_dynemb.log" | tail -4
  timeout 90 python3 benchmarks/probe_hstu_bwd.py --shapes 16x1024x128,128x1024x128,16x4096x128 > "$OUT/probe.txt" 2>&1
  echo "probe exit $?"; cat "$OUT/probe.txt" | head -60
  M="smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_misc_per_issue_active.ratio,smsp__inst_executed.sum,sm__cycles_elapsed.avg,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_xu.sum,lts__t_sectors_op_red.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum"
  for N in 1024 4096; do
    timeout 120 ncu --kernel-name regex:hstu_bwd_ws --launch-count 1 --metrics $M python3 benchmarks/profile_hstu.py --bwd --N $N --reps 1 > $OUT/ncu_bwd_$N.txt 2>&1
    echo "== ncu backward 16x${N}x128 (exit $?)"
    grep -E "stalled|inst_executed|cycles|gmma|lts__|dram__|l1tex__|issue_active|duration" $OUT/ncu_bwd_$N.txt | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | awk '{print $1, $(NF-1), $NF}' | sort -k3 -g -r | head -26
  done
elif [ "$PART" = dqtma ]; then
  T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
  timeout 60 $T -x -k "test_backward and cuda-wgmma and not wgmmared and not wgmma1blk and bfloat16 and (plain_h2_d64 or dqk32_dv96 or many_short_seqs)" > "$OUT/smoke.log" 2>&1
  rc=$?; echo "smoke exit $rc"; tail -1 "$OUT/smoke.log"; [ $rc = 124 ] && exit 1
  timeout 200 $T -k "(test_backward and cuda) or one_block_per_item or persistent_grid or rows_outside" -rs > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest.log" | head -12
  timeout 80 compute-sanitizer --tool memcheck --print-limit 5 $T -x \
    -k "test_backward and cuda-wgmma and not wgmmared and not wgmma1blk and bfloat16 and (long_d128 or dqk32_dv96 or window_minfull or many_short_seqs or targets_groups)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
  timeout 80 compute-sanitizer --tool racecheck --print-limit 5 $T -x \
    -k "test_backward and cuda-wgmma and not wgmmared and not wgmma1blk and bfloat16 and (long_d128 or plain_h2_d64)" > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -2
  timeout ${AB_TO:-200} python3 benchmarks/ab_hstu_bwd.py --forms persred,pers --rounds 2 ${AB_ARGS:-} --out "$OUT/ab_dq.md" > "$OUT/ab.log" 2>&1
  echo "ab exit $?"; grep -v "^|" "$OUT/ab.log" | tail -3; cat "$OUT/ab_dq.md"
elif [ "$PART" = final ]; then
  T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
  timeout 60 $T -x -k "(test_forward and cuda-wgmma and many_short_seqs) or (test_backward and cuda-wgmma and not wgmmared and not wgmma1blk and bfloat16 and (plain_h2_d64 or many_short_seqs)) or (one_block_per_item and bfloat16 and plain_h2_d64)" > "$OUT/smoke.log" 2>&1
  rc=$?; echo "smoke exit $rc"; tail -1 "$OUT/smoke.log"; [ $rc = 124 ] && exit 1
  timeout 150 $T -k "cuda" > "$OUT/pytest_hstu.log" 2>&1
  echo "hstu pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_hstu.log" | tail -6
  timeout 70 compute-sanitizer --tool memcheck --print-limit 5 $T -x \
    -k "(test_forward and cuda-wgmma and bfloat16 and (many_short_seqs or window_minfull or long_d128)) or (test_backward and cuda-wgmma and not wgmmared and bfloat16 and (many_short_seqs or long_d128 or targets_groups))" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
  timeout 100 python3 benchmarks/ab_hstu_bwd.py --forms persred,pers --shapes b128 --rounds 2 --no-triton --out "$OUT/ab_bwd.md" > "$OUT/ab_bwd.log" 2>&1
  echo "ab bwd exit $?"; cat "$OUT/ab_bwd.md"
  timeout 100 python3 benchmarks/ab_hstu_fwd.py --envs 1,2 --rounds 2 --out "$OUT/ab_fwd.md" > "$OUT/ab_fwd.log" 2>&1
  echo "ab fwd exit $?"; cat "$OUT/ab_fwd.md"
  P="python3 -m pytest tests/test_dynamic_embedding.py -q -p no:cacheprovider"
  timeout 90 $P -k cuda > "$OUT/pytest_dynemb.log" 2>&1
  echo "dynemb pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_dynemb.log" | tail -4
  timeout 60 compute-sanitizer --tool memcheck --print-limit 5 $P -x -k "cuda and (order or tiered or host)" > "$OUT/memcheck_dynemb.log" 2>&1
  echo "dynemb memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_dynemb.log" | tail -2
  if [ -n "${PEERS_HKV:-}" ]; then
    timeout 120 "$PEERS_HKV" hybrid > "$OUT/hkv_hybrid.txt" 2>&1; echo "hkv hybrid exit $?"; grep -v "^$" "$OUT/hkv_hybrid.txt" | tail -10
  fi
  timeout ${OURS_TO:-150} python3 benchmarks/bench_dynamic_embedding.py --parts half_host --dims 64,128 --out "$OUT/ours_half_host.md" > "$OUT/ours.log" 2>&1
  echo "ours exit $?"; grep "^| half_host" "$OUT/ours_half_host.md"
elif [ "$PART" = hybrid ]; then
  if [ -n "${PEERS_HKV:-}" ]; then
    timeout 200 "$PEERS_HKV" hybrid > "$OUT/hkv_hybrid.txt" 2>&1; echo "hkv hybrid exit $?"; cat "$OUT/hkv_hybrid.txt" | grep -v "^$" | tail -16
  fi
  timeout ${OURS_TO:-300} python3 benchmarks/bench_dynamic_embedding.py --parts half_host --dims 64,128 --out "$OUT/ours_half_host.md" > "$OUT/ours.log" 2>&1
  echo "ours exit $?"; grep -v "^|" "$OUT/ours.log" | tail -8; cat "$OUT/ours_half_host.md"
fi
