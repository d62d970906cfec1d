#!/usr/bin/env bash
# Session 16's device calls (each under the 10-minute limit).
#   check:  (its memcheck selection first read "cuda-wgmma-", which matches no test id: that run covered
#           store_forms and the cuda-wgmmaplain cases, 18 tests)
#           eviction ties broken by key (dynamic embeddings) and the HSTU forward's O by 16-byte stores:
#           the HSTU forward GPU tests (both store paths), memcheck on them, the dynamic-embedding GPU tests,
#           memcheck on the ties tests, then ab_hstu_fwd.py: 16-byte against 4-byte O stores in one process,
#           back to back and single synced calls
#   dynab:  the ties change's cost: the dynamic-embedding GPU tests and memcheck on the eviction tests, then
#           bench_dynamic_embedding.py --parts hbm (find, find_or_insert, insert_or_assign at load factors
#           0.5 / 0.75 / 1.0) on this build (step 2 of find_or_insert at 4 blocks per SM, then at 3:
#           TORCHFUSE_DYNEMB_QUARTER_MB=3), then on MAIN_DYN (the previous kernels/dynemb_cuda.cu, carried)
#           rebuilt in place: a cross-build A/B on one machine. (Ran on 173f0bc's code, since reverted with its
#           switches; the runs and figures are in results/dynemb_h100.md, session 16.)
#   split:  the forward's hand-over through a barrier pair per consumer, consumer 1 giving consumer 0 the next
#           item's first turn before its O store: the forward GPU tests, memcheck and racecheck on a few, then
#           ab_hstu_fwd.py against TORCHFUSE_HSTU_FWD_SPLIT=0 in one process, back to back and single calls
#   trace:  a measurement build (TORCHFUSE_HSTU_TRACE_BUILD=1, set by this part before the build): the forward's
#           phase trace (trace_hstu_fwd.py) and the backward's (trace_hstu_bwd.py, after its helpers moved)
#   causal: plain causal sequences' mask bits in a few integer ops (hstu_causal_row_bits / _col_bits) instead of
#           the spans: every HSTU GPU test, memcheck on a few, then the one-process A/Bs against
#           TORCHFUSE_HSTU_CAUSAL_BITS=0 (forward back to back and single calls; backward, N <= 2048, no Triton;
#           its persspans form was removed with the backward's prefix bits)
# The parts' switches that were reverted (dynab's, split's, qpf's, causal's backward form) live in the commits
# before those reverts; this script is the record of what ran, with shared helpers since the session's end.
#   qpf:    each item's Q fetched into L2 at its hand-over: the forward GPU tests, memcheck on a few, the one-process
#           A/B against TORCHFUSE_HSTU_FWD_Q_PREFETCH=0 (back to back and single calls)
#   vec:    O by 16-byte stores with the butterfly transpose (quad_chunk): the forward GPU tests, memcheck on the
#           store-form tests, the one-process A/B of 16- against 4-byte O stores at every head dim
#   bwdvec: the backward's dK / dV transpose by quad_chunk's butterfly: the backward GPU tests, memcheck on a few,
#           ab_hstu_bwd.py --forms pers,pers4b (16- against 4-byte stores, no Triton, N <= 2048) on this build,
#           then on OLD_BWD / OLD_MMA (the previous hstu_bwd_sm90.cu and hstu_mma.cuh, carried) rebuilt in place
#   table:  the dynamic-embedding GPU tests, then the full HSTU table (bench_hstu.py --cases full,special
#           --compile --b2b, one process, Triton from PEERS)
set -uo pipefail
PART=${1:?part: check, dynab, split, trace, causal, qpf, vec, bwdvec or table}
[ "$PART" = trace ] && export TORCHFUSE_HSTU_TRACE_BUILD=1
source "$(dirname "$0")/device_build.sh"
source "$(dirname "$0")/device_helpers.sh"
case "$PART" in
check)
  fwd_tests
  sanitize memcheck memcheck_fwd "store_forms or (test_forward and cuda-wgmma and bfloat16 and (d128_h4 or window or targets or many_short or d256))"
  run_tests pytest_dyn ${DYN_TO:-150} $D -k cuda
  sanitize memcheck memcheck_dyn "cuda and (ties_broken or evicts_identically or eviction_record or concurrent_claims)" "$D"
  fwd_ab "1,1+TORCHFUSE_HSTU_FWD_VEC_STORE=0" store ;;
dynab)
  run_tests pytest_dyn ${DYN_TO:-150} $D -k cuda
  sanitize memcheck memcheck_dyn "cuda and (ties_broken or evicts_identically or eviction_record or concurrent_claims or full_table_rows)" "$D"
  dyn_bench new
  TORCHFUSE_DYNEMB_QUARTER_MB=3 dyn_bench new_mb3
  rebuild_with "${MAIN_DYN:?}" kernels/dynemb_cuda.cu
  dyn_bench main
  for t in new new_mb3 main; do echo "$t:"; grep "^| hbm" "$OUT/dyn_$t.md"; done ;;
split)
  fwd_tests
  sanitize memcheck memcheck_fwd "test_forward and cuda-wgmma and not wgmmaplain and bfloat16 and (d128_h4 or window or targets or many_short or plain_h2)"
  sanitize racecheck racecheck_fwd "test_forward and cuda-wgmma and not wgmmaplain and bfloat16 and (d128_h4_int64 or many_short or plain_h2)"
  fwd_ab "1,1+TORCHFUSE_HSTU_FWD_SPLIT=0" split ;;
trace)
  timeout ${TRACE_TO:-150} python3 benchmarks/trace_hstu_fwd.py --shapes ${SHAPES:-128x1024x128,16x4096x128,16x1024x128} \
    > "$OUT/trace_fwd.md" 2>&1
  echo "fwd trace exit $?"; cat "$OUT/trace_fwd.md"
  timeout ${TRACE_TO:-150} python3 benchmarks/trace_hstu_bwd.py --shapes 128x1024x128 > "$OUT/trace_bwd.md" 2>&1
  echo "bwd trace exit $?"; cat "$OUT/trace_bwd.md" ;;
causal)
  run_tests pytest_hstu ${TEST_TO:-240} $T -k "not cpu"
  sanitize memcheck memcheck_hstu "(test_forward or test_backward) and cuda-wgmma and not wgmmaplain and not wgmmared and bfloat16 and (d128_h4 or plain_h2 or many_short or long_d128)"
  fwd_ab "1,1+TORCHFUSE_HSTU_CAUSAL_BITS=0" causal
  timeout ${AB_TO:-150} python3 benchmarks/ab_hstu_bwd.py --forms pers,persspans --rounds 3 --no-triton --shapes short \
    --out "$OUT/ab_bwd_causal.md" > "$OUT/ab_bwd_causal.log" 2>&1
  echo "ab bwd exit $?"; grep "^|" "$OUT/ab_bwd_causal.md" ;;
qpf)
  fwd_tests
  sanitize memcheck memcheck_fwd "test_forward and cuda-wgmma and not wgmmaplain and bfloat16 and (d128_h4 or window or targets or many_short or plain_h2)"
  fwd_ab "1,1+TORCHFUSE_HSTU_FWD_Q_PREFETCH=0" qpf ;;
vec)
  fwd_tests
  sanitize memcheck memcheck_fwd "store_forms"
  fwd_ab "1+TORCHFUSE_HSTU_FWD_VEC_STORE=1,1+TORCHFUSE_HSTU_FWD_VEC_STORE=0" vec ;;
bwdvec)
  run_tests pytest_bwd ${TEST_TO:-200} $T -k "backward and not cpu"
  sanitize memcheck memcheck_bwd "test_backward and cuda-wgmma and not wgmmared and bfloat16 and (d128_h4 or plain_h2 or many_short or d192 or dv32)"
  for t in new old; do
    [ $t = old ] && rebuild_with "${OLD_BWD:?}" kernels/hstu_bwd_sm90.cu "${OLD_MMA:?}" kernels/hstu_mma.cuh
    timeout ${AB_TO:-120} python3 benchmarks/ab_hstu_bwd.py --forms pers,pers4b --rounds 3 --no-triton --shapes short \
      --out "$OUT/ab_bwd_$t.md" > "$OUT/ab_bwd_$t.log" 2>&1
    echo "ab ($t) exit $?"; grep "^|" "$OUT/ab_bwd_$t.md"
  done ;;
table)
  run_tests pytest_dyn ${DYN_TO:-100} $D -k cuda
  [ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
  timeout ${BENCH_TO:-420} python3 benchmarks/bench_hstu.py --cases full,special --compile --b2b \
    --out "$OUT/bench_hstu_full.md" > "$OUT/bench_hstu.log" 2>"$OUT/bench_hstu.err"
  echo "hstu bench exit $?"; cat "$OUT/bench_hstu_full.md"; tail -3 "$OUT/bench_hstu.err" ;;
esac
