#!/usr/bin/env bash
# Session 17's device calls (each under the 10-minute limit).
#   qbuf:  the forward's K and V in rings of their own and two Q buffers at head dims up to 128: the forward
#          GPU tests, memcheck and racecheck on a few, then ab_hstu_fwd.py against one Q buffer
#          (TORCHFUSE_HSTU_FWD_QBUF=1, the K ring then 3 stages) in one process, back to back and single calls
#   otma:  O staged in the item's Q buffer and stored by TMA (head dims up to 128), on top of qbuf: the forward GPU
#          tests, memcheck and racecheck on a few, then ab_hstu_fwd.py against register stores
#          (TORCHFUSE_HSTU_FWD_O_TMA=0) and against one Q buffer in one process
#   d256:  O staged in the single Q buffer at head dim 256 too (TORCHFUSE_HSTU_FWD_O_TMA=2, the next item's Q
#          load waiting for the store's read): the forward GPU tests, memcheck on the store forms, the A/B
#   dkv:   the backward's dK / dV staged in the Z buffers and dQ's staging tiles and stored by TMA: the backward
#          GPU tests, memcheck and racecheck on a few, then ab_hstu_bwd.py --forms pers,pers16b (TMA against
#          16-byte register stores, no Triton, N <= 2048 and head dims <= 128). Measured +1% (call 5) and
#          reverted: its switch, test and A/B form are in the commit before the revert.
#   pp256: ping-pong at head dim 256 (TORCHFUSE_HSTU_FWD_PP256=1, since merged as the default and the switch removed;
#          its loop no longer spills): the forward GPU tests
#          with it, memcheck on the head-dim-256 ones, then the one-process A/B against the plain loop
#   trace: a measurement build (TORCHFUSE_HSTU_TRACE_BUILD=1): the forward's phase trace on the final code at
#          128x1024x128 and with max_attn_len = 256 at 16x4096x128 (full lengths)
#   band:  a plain window's mask bits as a band of two prefixes (hstu_band_row_bits): the forward GPU tests, memcheck
#          on the window cases, the one-process A/B against the spans (TORCHFUSE_HSTU_CAUSAL_BITS=0, which
#          also switches plain causal sequences to the spans)
#   table: the forward GPU tests on the final code (RACE=1: and racecheck on the ping-pong loop at head dims 192 /
#          256), then the full HSTU table (bench_hstu.py --cases full,special --compile --b2b, one process, Triton from PEERS)
set -uo pipefail
PART=${1:?part: qbuf, otma, d256, dkv, pp256, trace, band or table}
[ "$PART" = trace ] && export TORCHFUSE_HSTU_TRACE_BUILD=1
source "$(dirname "$0")/device_build.sh"
source "$(dirname "$0")/device_helpers.sh"
case "$PART" in
qbuf)
  fwd_tests
  sanitize memcheck memcheck_fwd "test_forward and cuda-wgmma and not wgmmaplain and bfloat16 and (d128_h4 or window or targets or many_short or plain_h2)"
  sanitize racecheck racecheck_fwd "test_forward and cuda-wgmma and bfloat16 and (d128_h4_int64 or many_short or plain_h2)"
  fwd_ab "1,1+TORCHFUSE_HSTU_FWD_QBUF=1" qbuf ;;
otma)
  fwd_tests
  sanitize memcheck memcheck_fwd "store_forms or (test_forward and cuda-wgmma and not wgmmaplain and bfloat16 and (d128_h4 or window or targets or plain_h2))"
  MEM_TO=${RACE_TO:-150} sanitize racecheck racecheck_fwd "test_forward and cuda-wgmma and not wgmmaplain and bfloat16 and (d128_h4_int64 or plain_h2)"
  fwd_ab "1,1+TORCHFUSE_HSTU_FWD_O_TMA=0,1+TORCHFUSE_HSTU_FWD_QBUF=1" otma ;;
d256)
  fwd_tests
  sanitize memcheck memcheck_fwd "store_forms"
  fwd_ab "1,1+TORCHFUSE_HSTU_FWD_O_TMA=2" d256 ;;
dkv)
  run_tests pytest_bwd ${TEST_TO:-200} $T -k "backward and not cpu"
  sanitize memcheck memcheck_bwd "store_forms or (test_backward and cuda-wgmma and not wgmmared and bfloat16 and (d128_h4 or plain_h2 or many_short or long_d128 or dqk32))"
  MEM_TO=${RACE_TO:-150} sanitize racecheck racecheck_bwd "test_backward and cuda-wgmma and not wgmmared and bfloat16 and (d128_h4_int64 or plain_h2)"
  timeout ${AB_TO:-150} python3 benchmarks/ab_hstu_bwd.py --forms pers,pers16b --rounds 3 --no-triton --shapes short \
    --out "$OUT/ab_bwd_dkv.md" > "$OUT/ab_bwd_dkv.log" 2>&1
  echo "ab bwd exit $?"; grep "^|" "$OUT/ab_bwd_dkv.md" ;;
pp256)
  TORCHFUSE_HSTU_FWD_PP256=1 fwd_tests
  TORCHFUSE_HSTU_FWD_PP256=1 sanitize memcheck memcheck_fwd "test_forward and cuda-wgmma and not wgmmaplain and bfloat16 and (d256 or d192)"
  fwd_ab "1,1+TORCHFUSE_HSTU_FWD_PP256=1" pp256 ;;
trace)
  timeout ${TRACE_TO:-120} python3 benchmarks/trace_hstu_fwd.py --shapes 128x1024x128 > "$OUT/trace_fwd.md" 2>&1
  echo "fwd trace exit $?"; cat "$OUT/trace_fwd.md"
  timeout ${TRACE_TO:-120} python3 benchmarks/trace_hstu_fwd.py --shapes 16x4096x128 --window 256 > "$OUT/trace_fwd_window.md" 2>&1
  echo "fwd window trace exit $?"; cat "$OUT/trace_fwd_window.md" ;;
band)
  fwd_tests
  sanitize memcheck memcheck_fwd "test_forward and cuda-wgmma and not wgmmaplain and (window or plain_h2)"
  fwd_ab "1,1+TORCHFUSE_HSTU_CAUSAL_BITS=0" band ;;
table)
  fwd_tests
  [ "${RACE:-0}" = 1 ] && MEM_TO=${RACE_TO:-150} sanitize racecheck racecheck_fwd "test_forward and cuda-wgmma and not wgmmaplain and bfloat16 and (d256_dv32 or d192)"
  [ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
  timeout ${BENCH_TO:-420} python3 benchmarks/bench_hstu.py --cases full,special --compile --b2b \
    --out "$OUT/bench_hstu_full.md" > "$OUT/bench_hstu.log" 2>"$OUT/bench_hstu.err"
  echo "hstu bench exit $?"; cat "$OUT/bench_hstu_full.md"; tail -3 "$OUT/bench_hstu.err" ;;
esac
