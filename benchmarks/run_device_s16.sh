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
#           TORCHFUSE_HSTU_CAUSAL_BITS=0 (forward back to back and single calls; backward, N <= 2048, no Triton)
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
T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
D="python3 -m pytest tests/test_dynamic_embedding.py -q -p no:cacheprovider"
summary() { grep -E "passed|failed|^FAILED|^ERROR" "$1" | head -${2:-8}; }
if [ "$PART" = check ]; then
  timeout ${TEST_TO:-170} $T -k "(test_forward or cached) and not cpu" > "$OUT/pytest_fwd.log" 2>&1
  echo "fwd pytest exit $?"; summary "$OUT/pytest_fwd.log"
  timeout ${MEM_TO:-90} compute-sanitizer --tool memcheck --print-limit 5 $T -x \
    -k "store_forms or (test_forward and cuda-wgmma and bfloat16 and (d128_h4 or window or targets or many_short or d256))" \
    > "$OUT/memcheck_fwd.log" 2>&1
  echo "fwd memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_fwd.log" | tail -2
  timeout ${DYN_TO:-200} $D -k cuda > "$OUT/pytest_dyn.log" 2>&1
  echo "dynemb pytest exit $?"; summary "$OUT/pytest_dyn.log" 12
  timeout ${DMEM_TO:-100} compute-sanitizer --tool memcheck --print-limit 5 $D -x \
    -k "cuda and (ties_broken or evicts_identically or eviction_record or concurrent_claims)" > "$OUT/memcheck_dyn.log" 2>&1
  echo "dynemb memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_dyn.log" | tail -2
  for mode in --b2b ""; do
    timeout ${AB_TO:-90} python3 benchmarks/ab_hstu_fwd.py --envs "1,1+TORCHFUSE_HSTU_FWD_VEC_STORE=0" --rounds 3 $mode \
      --out "$OUT/ab_fwd_store${mode}.md" > "$OUT/ab_fwd${mode}.log" 2>&1
    echo "ab ${mode:-single} exit $?"; grep "^|" "$OUT/ab_fwd_store${mode}.md"
  done
elif [ "$PART" = dynab ]; then
  timeout ${DYN_TO:-150} $D -k cuda > "$OUT/pytest_dyn.log" 2>&1
  echo "dynemb pytest exit $?"; summary "$OUT/pytest_dyn.log" 12
  timeout ${DMEM_TO:-80} compute-sanitizer --tool memcheck --print-limit 5 $D -x \
    -k "cuda and (ties_broken or evicts_identically or eviction_record or concurrent_claims or full_table_rows)" > "$OUT/memcheck_dyn.log" 2>&1
  echo "dynemb memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_dyn.log" | tail -2
  timeout ${BENCH_TO:-200} python3 benchmarks/bench_dynamic_embedding.py --parts hbm --dims ${DIMS:-64,128} \
    --out "$OUT/dyn_new.md" > "$OUT/dyn_new.log" 2>&1
  echo "bench (new) exit $?"
  TORCHFUSE_DYNEMB_QUARTER_MB=3 timeout ${BENCH_TO:-200} python3 benchmarks/bench_dynamic_embedding.py --parts hbm \
    --dims ${DIMS:-64,128} --out "$OUT/dyn_new_mb3.md" > "$OUT/dyn_new_mb3.log" 2>&1
  echo "bench (new, 3 blocks per SM) exit $?"
  cp "${MAIN_DYN:?}" kernels/dynemb_cuda.cu
  ( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build_main.log" 2>&1 || { tail -20 "$OUT/build_main.log"; exit 1; }
  echo "rebuilt at ${SECONDS}s"
  timeout ${BENCH_TO:-200} python3 benchmarks/bench_dynamic_embedding.py --parts hbm --dims ${DIMS:-64,128} \
    --out "$OUT/dyn_main.md" > "$OUT/dyn_main.log" 2>&1
  echo "bench (main) exit $?"
  echo "new:"; grep "^| hbm" "$OUT/dyn_new.md"; echo "new, 3 blocks per SM:"; grep "^| hbm" "$OUT/dyn_new_mb3.md"
  echo "main:"; grep "^| hbm" "$OUT/dyn_main.md"
elif [ "$PART" = split ]; then
  timeout ${TEST_TO:-150} $T -k "(test_forward or cached) and not cpu" > "$OUT/pytest_fwd.log" 2>&1
  echo "fwd pytest exit $?"; summary "$OUT/pytest_fwd.log"
  timeout ${MEM_TO:-80} compute-sanitizer --tool memcheck --print-limit 5 $T -x \
    -k "test_forward and cuda-wgmma- and bfloat16 and (d128_h4 or window or targets or many_short or plain_h2)" \
    > "$OUT/memcheck_fwd.log" 2>&1
  echo "fwd memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_fwd.log" | tail -2
  timeout ${RACE_TO:-120} compute-sanitizer --tool racecheck --print-limit 5 $T -x \
    -k "test_forward and cuda-wgmma- and bfloat16 and (d128_h4_int64 or many_short or plain_h2)" > "$OUT/racecheck_fwd.log" 2>&1
  echo "fwd racecheck exit $?"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck_fwd.log" | tail -3
  for mode in --b2b ""; do
    timeout ${AB_TO:-90} python3 benchmarks/ab_hstu_fwd.py --envs "1,1+TORCHFUSE_HSTU_FWD_SPLIT=0" --rounds 3 $mode \
      --out "$OUT/ab_fwd_split${mode}.md" > "$OUT/ab_split${mode}.log" 2>&1
    echo "ab ${mode:-single} exit $?"; grep "^|" "$OUT/ab_fwd_split${mode}.md"
  done
elif [ "$PART" = trace ]; then
  timeout ${TRACE_TO:-150} python3 benchmarks/trace_hstu_fwd.py --shapes ${SHAPES:-128x1024x128,16x4096x128,16x1024x128} \
    > "$OUT/trace_fwd.md" 2>&1
  echo "fwd trace exit $?"; cat "$OUT/trace_fwd.md"
  timeout ${TRACE_TO:-150} python3 benchmarks/trace_hstu_bwd.py --shapes 128x1024x128 > "$OUT/trace_bwd.md" 2>&1
  echo "bwd trace exit $?"; cat "$OUT/trace_bwd.md"
elif [ "$PART" = causal ]; then
  timeout ${TEST_TO:-240} $T -k "not cpu" > "$OUT/pytest_hstu.log" 2>&1
  echo "hstu pytest exit $?"; summary "$OUT/pytest_hstu.log"
  timeout ${MEM_TO:-90} compute-sanitizer --tool memcheck --print-limit 5 $T -x \
    -k "(test_forward or test_backward) and cuda-wgmma and not wgmmaplain and not wgmmared and bfloat16 and (d128_h4 or plain_h2 or many_short or long_d128)" \
    > "$OUT/memcheck_hstu.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_hstu.log" | tail -2
  for mode in --b2b ""; do
    timeout ${AB_TO:-90} python3 benchmarks/ab_hstu_fwd.py --envs "1,1+TORCHFUSE_HSTU_CAUSAL_BITS=0" --rounds 3 $mode \
      --out "$OUT/ab_fwd_causal${mode}.md" > "$OUT/ab_causal${mode}.log" 2>&1
    echo "ab fwd ${mode:-single} exit $?"; grep "^|" "$OUT/ab_fwd_causal${mode}.md"
  done
  timeout ${AB_TO:-150} python3 benchmarks/ab_hstu_bwd.py --forms pers,persspans --rounds 3 --no-triton --shapes short \
    --out "$OUT/ab_bwd_causal.md" > "$OUT/ab_bwd_causal.log" 2>&1
  echo "ab bwd exit $?"; grep "^|" "$OUT/ab_bwd_causal.log"
elif [ "$PART" = qpf ]; then
  timeout ${TEST_TO:-150} $T -k "(test_forward or cached) and not cpu" > "$OUT/pytest_fwd.log" 2>&1
  echo "fwd pytest exit $?"; summary "$OUT/pytest_fwd.log"
  timeout ${MEM_TO:-80} compute-sanitizer --tool memcheck --print-limit 5 $T -x \
    -k "test_forward and cuda-wgmma and not wgmmaplain and bfloat16 and (d128_h4 or window or targets or many_short or plain_h2)" \
    > "$OUT/memcheck_fwd.log" 2>&1
  echo "fwd memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_fwd.log" | tail -2
  for mode in --b2b ""; do
    timeout ${AB_TO:-90} python3 benchmarks/ab_hstu_fwd.py --envs "1,1+TORCHFUSE_HSTU_FWD_Q_PREFETCH=0" --rounds 3 $mode \
      --out "$OUT/ab_fwd_qpf${mode}.md" > "$OUT/ab_qpf${mode}.log" 2>&1
    echo "ab ${mode:-single} exit $?"; grep "^|" "$OUT/ab_fwd_qpf${mode}.md"
  done
elif [ "$PART" = vec ]; then
  timeout ${TEST_TO:-150} $T -k "(test_forward or cached) and not cpu" > "$OUT/pytest_fwd.log" 2>&1
  echo "fwd pytest exit $?"; summary "$OUT/pytest_fwd.log"
  timeout ${MEM_TO:-80} compute-sanitizer --tool memcheck --print-limit 5 $T -x -k "store_forms" > "$OUT/memcheck_fwd.log" 2>&1
  echo "fwd memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_fwd.log" | tail -2
  for mode in --b2b ""; do
    timeout ${AB_TO:-90} python3 benchmarks/ab_hstu_fwd.py \
      --envs "1+TORCHFUSE_HSTU_FWD_VEC_STORE=1,1+TORCHFUSE_HSTU_FWD_VEC_STORE=0" --rounds 3 $mode \
      --out "$OUT/ab_fwd_vec${mode}.md" > "$OUT/ab_vec${mode}.log" 2>&1
    echo "ab ${mode:-single} exit $?"; grep "^|" "$OUT/ab_fwd_vec${mode}.md"
  done
elif [ "$PART" = bwdvec ]; then
  timeout ${TEST_TO:-200} $T -k "backward and not cpu" > "$OUT/pytest_bwd.log" 2>&1
  echo "bwd pytest exit $?"; summary "$OUT/pytest_bwd.log"
  timeout ${MEM_TO:-90} compute-sanitizer --tool memcheck --print-limit 5 $T -x \
    -k "test_backward and cuda-wgmma and not wgmmared and bfloat16 and (d128_h4 or plain_h2 or many_short or d192 or dv32)" \
    > "$OUT/memcheck_bwd.log" 2>&1
  echo "bwd memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_bwd.log" | tail -2
  timeout ${AB_TO:-120} python3 benchmarks/ab_hstu_bwd.py --forms pers,pers4b --rounds 3 --no-triton --shapes short \
    --out "$OUT/ab_bwd_new.md" > "$OUT/ab_bwd_new.log" 2>&1
  echo "ab (new) exit $?"
  cp "${OLD_BWD:?}" kernels/hstu_bwd_sm90.cu; cp "${OLD_MMA:?}" kernels/hstu_mma.cuh
  ( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build_old.log" 2>&1 || { tail -20 "$OUT/build_old.log"; exit 1; }
  echo "rebuilt at ${SECONDS}s"
  timeout ${AB_TO:-120} python3 benchmarks/ab_hstu_bwd.py --forms pers,pers4b --rounds 3 --no-triton --shapes short \
    --out "$OUT/ab_bwd_old.md" > "$OUT/ab_bwd_old.log" 2>&1
  echo "ab (old) exit $?"; echo "new:"; grep "^|" "$OUT/ab_bwd_new.md"; echo "old:"; grep "^|" "$OUT/ab_bwd_old.md"
elif [ "$PART" = table ]; then
  timeout ${DYN_TO:-100} $D -k cuda > "$OUT/pytest_dyn.log" 2>&1
  echo "dynemb pytest exit $?"; summary "$OUT/pytest_dyn.log" 12; grep -B30 "short test summary" "$OUT/pytest_dyn.log" | grep -E "^E " | head -12
  [ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
  timeout ${BENCH_TO:-420} python3 benchmarks/bench_hstu.py --cases full,special --compile --b2b \
    --out "$OUT/bench_hstu_full.md" > "$OUT/bench_hstu.log" 2>"$OUT/bench_hstu.err"
  echo "hstu bench exit $?"; cat "$OUT/bench_hstu_full.md"; tail -3 "$OUT/bench_hstu.err"
fi
