#!/usr/bin/env bash
# Session 18's device calls (each under the 10-minute limit).
#   mask:  the mask's AND apart from the SiLU arithmetic (forward: one SiLU loop for every tile, the AND in a second
#          loop on masked tiles only; backward: the same, full tiles no longer running the mask): a GPU-test smoke
#          (bf16, wgmma, masked cases), then a cross-build A/B in one call: ab_hstu_fwd.py (mma.sync as the
#          unchanged anchor, back to back) and ab_hstu_bwd.py (mma as the anchor) on the new build, the previous
#          sources (carried in $OLD) rebuilt, the same two again. Measured neutral (call 1: forward -3..+1%,
#          window -2%; backward -2..+3.5%) and reverted: the change is commit 02e9d04.
#   zero:  the backward's fp32 dQ accumulator zeroed inside the kernel (zero_dq_units), no memset: the backward GPU
#          tests (test_backward_dq_zeroed_in_kernel among them) and the rows-outside test, memcheck on the new test and
#          a few backward cases, then ab_hstu_bwd.py --forms persmemset,pers in one process (all shapes, single calls).
#          Measured slower than the memset and reverted (the code: commit fe43e39, where this part runs):
#          call 2, all at once: 4-10% slower at N <= 2048, +1% at 4096; call 3, paced a section ahead: the same
#          (16x1024x128 186 vs 197, 16x2048x64 237 vs 270); call 4, the proxy fence once per section instead of
#          per item: the same (183 vs 196, 231 vs 253). The first section's zeros are not hidden behind anything
#          (~10 us), and the rest still costs more inside the kernel than the memset does before it.
#   slot:  issue 4's lead (NOTES item 0): probe_dynemb_slot_order.py, the training step's segment update with the rows
#          visited in slot order against key order, beside the forward's pool and plain gathers (SGD and Adam)
#   ncu:   Nsight Compute on the SGD segment update (probe_dynemb_slot_order.py, one round: the first two launches,
#          key and slot order): what holds it at 535 us when the gather moves its rows in 355 (call 8, with gathers
#          in the filter, profiled the table's setup instead)
#   hsort: the training batch sorted by its ids' 32-bit hashes (4 radix passes of 4-byte keys, collisions put in id
#          order after) instead of the ids (8 of 8-byte keys): the dynamic-embedding GPU tests, memcheck on the
#          sort-group tests, then ab_train_step.py over TORCHFUSE_DYNEMB_SORT_HASH_BITS=0 / 32 (SGD and Adam) and the
#          sort-group op alone
#   checks: the forward and backward GPU tests, memcheck on the masked cases
#   table: the full HSTU table (bench_hstu.py --cases full,special --compile --b2b, one process, Triton from PEERS)
set -uo pipefail
PART=${1:?part: mask, zero, slot, ncu, hsort, checks or table}
source "$(dirname "$0")/device_build.sh"
source "$(dirname "$0")/device_helpers.sh"
ab_both() {  # TAG
  timeout ${AB_TO:-150} python3 benchmarks/ab_hstu_fwd.py --envs 0,1 --rounds 3 --b2b --out "$OUT/ab_fwd_$1.md" \
    > "$OUT/ab_fwd_$1.log" 2>&1
  echo "ab fwd ($1) exit $?"; grep "^|" "$OUT/ab_fwd_$1.md"
  timeout ${AB_TO:-150} python3 benchmarks/ab_hstu_bwd.py --forms mma,pers --rounds 3 --no-triton \
    --out "$OUT/ab_bwd_$1.md" > "$OUT/ab_bwd_$1.log" 2>&1
  echo "ab bwd ($1) exit $?"; grep "^|" "$OUT/ab_bwd_$1.md"
}
case "$PART" in
mask)
  run_tests smoke ${TEST_TO:-150} $T -x -k "((test_forward or test_backward) and cuda-wgmma and not wgmmaplain and not wgmmared and bfloat16) or (nonfinite and not cpu)"
  ab_both new
  OLD=${OLD:-.gl/old}
  rebuild_with "$OLD/hstu_fwd_sm90.cu" kernels/hstu_fwd_sm90.cu "$OLD/hstu_bwd_sm90.cu" kernels/hstu_bwd_sm90.cu
  ab_both old ;;
zero)
  run_tests pytest_bwd ${TEST_TO:-200} $T -k "(backward and not cpu) or (rows_outside and not cpu)"
  MEM_TO=${MEM_TO:-150} sanitize memcheck memcheck_bwd "dq_zeroed_in_kernel or (test_backward and cuda-wgmma and not wgmmared and bfloat16 and (window or d128_h4 or many_short or d256_dv32))"
  timeout ${AB_TO:-150} python3 benchmarks/ab_hstu_bwd.py --forms ${FORMS:-persmemset,pers} --rounds 3 --no-triton \
    --out "$OUT/ab_bwd_zero.md" > "$OUT/ab_bwd_zero.log" 2>&1
  echo "ab bwd exit $?"; grep "^|" "$OUT/ab_bwd_zero.md" ;;
slot)
  for opt in sgd adam; do
    timeout ${AB_TO:-150} python3 benchmarks/probe_dynemb_slot_order.py --opt $opt > "$OUT/slot_$opt.md" 2>&1
    echo "slot order ($opt) exit $?"; cat "$OUT/slot_$opt.md" | tail -8
  done ;;
ncu)
  timeout ${NCU_TO:-300} ncu --clock-control none -k regex:"segsum_update_kernel|pool_kernel" -c 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats \
    python3 benchmarks/probe_dynemb_slot_order.py --rounds 1 > "$OUT/ncu_dynemb.txt" 2>&1
  echo "ncu exit $?"
  grep -E "segsum_update_kernel|gather_kernel|pool_kernel|Duration|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit Reg|Warp Cycles Per Issued|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Stall|Mem Busy|Max Bandwidth" "$OUT/ncu_dynemb.txt" | head -90 ;;
hsort)
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    run_tests pytest_dyn ${TEST_TO:-300} $D -k "not cpu"
    MEM_TO=${MEM_TO:-120} sanitize memcheck memcheck_dyn "sort_group and not cpu" "$D"
  fi
  for opt in ${OPTS:-sgd adam}; do
    ( cd benchmarks && timeout ${AB_TO:-150} python3 ab_train_step.py --switch TORCHFUSE_DYNEMB_SORT_HASH_BITS \
      --values 0,32 --opt $opt --rounds ${ROUNDS:-3} ) > "$OUT/ab_hsort_$opt.md" 2>&1
    echo "ab hsort ($opt) exit $?"; grep "^|" "$OUT/ab_hsort_$opt.md"
  done
  timeout 60 python3 - <<'PY'
import os, torch
import torchfuse  # noqa: F401
ids = torch.randint(-2**63, 2**63 - 1, (4 << 20,), dtype=torch.int64, device="cuda")[torch.randint(0, 4 << 20, (1 << 20,), device="cuda")]
for bits in ("0", "32", "0", "32"):
    os.environ["TORCHFUSE_DYNEMB_SORT_HASH_BITS"] = bits
    for _ in range(3):
        torch.ops.torchfuse.dynemb_sort_group(ids)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        torch.ops.torchfuse.dynemb_sort_group(ids)
    b.record(); torch.cuda.synchronize()
    print(f"dynemb_sort_group, 1M ids from 4M keys, hash bits {bits}: {a.elapsed_time(b) / 20 * 1e3:.0f} us back to back")
PY
  ;;
checks)
  fwd_tests
  run_tests pytest_bwd ${TEST_TO:-200} $T -k "backward and not cpu"
  sanitize memcheck memcheck_fwd "test_forward and cuda-wgmma and not wgmmaplain and bfloat16 and (window or targets or d128_h4 or plain_h2)"
  sanitize memcheck memcheck_bwd "test_backward and cuda-wgmma and not wgmmared and bfloat16 and (window or targets or d128_h4 or plain_h2)" ;;
table)
  fwd_tests
  [ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
  timeout ${BENCH_TO:-420} python3 benchmarks/bench_hstu.py --cases full,special --compile --b2b \
    --out "$OUT/bench_hstu_full.md" > "$OUT/bench_hstu.log" 2>"$OUT/bench_hstu.err"
  echo "hstu bench exit $?"; cat "$OUT/bench_hstu_full.md"; tail -3 "$OUT/bench_hstu.err" ;;
esac
