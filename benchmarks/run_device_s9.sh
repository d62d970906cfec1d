#!/usr/bin/env bash
# Session 9's device calls, one part per call (each under the 10-minute limit; the build is kept between
# calls on a warm machine):
#   hstu:   the head-dim-256 wgmma backward: smoke (a hang costs device time), every HSTU backward test
#           on CUDA, memcheck on the 192/256 cases, the A/B against mma.sync and Triton at 16x4096x256
#   dynemb: find_or_insert with the wait in the op: smoke, the dynamic-embedding + TorchRec GPU tests,
#           memcheck on the find_or_insert tests, ab_foi.py --set sync, host_gap_dynemb.py at dim 8
#           (PROFILE=1: instead of the A/B and host gap, profile_dynemb.py: kernels at load factor 1.0,
#           dims 8 and 128, and the host's ops at 0.5)
#   final:  the dynamic-embedding GPU tests (and memcheck), ab_foi.py --set $AB_SET (step2 in the call
#           that measured per-warp eviction numbering, since dropped), HierarchicalKV's benchmark
#           (PEERS: its binary) and bench_dynamic_embedding.py in the same call
#   both:   the persistent HSTU backward and step 2's eviction stage in one call (device time was short):
#           HSTU smoke (both launch forms), the backward GPU tests, memcheck on both forms, the A/B at
#           128x1024x128 (mma.sync / one block per item / persistent / Triton); the dynamic-embedding
#           GPU tests and ab_foi.py --set stage (the stage was reverted after this call: 0.93-1.02x)
#   PEERS=.gl/hstu-peers bash benchmarks/run_device_s9.sh hstu
#   bash benchmarks/run_device_s9.sh dynemb
# The calls ran ab_foi.py's sets "sync" (the wait in Python / in the op / + no marks), "step2" and
# "stage"; those forms are gone from the code since (results/dynemb_h100.md has their figures), so the
# parts now run the set that remains, "marks".
set -uo pipefail
PART=${1:?part: hstu or dynemb}
[ -n "${PEERS:-}" ] && export PYTHONPATH="$(cd "$PEERS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
source "$(dirname "$0")/device_build.sh"
if [ "$PART" = hstu ]; then
  T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
  timeout 60 $T -x -k "test_backward and cuda-wgmma and bfloat16 and (d256_dv32 or d256_targets_context)" > "$OUT/smoke.log" 2>&1
  rc=$?; echo "smoke exit $rc"; tail -3 "$OUT/smoke.log"; [ $rc = 124 ] && exit 1
  timeout ${TEST_TO:-200} $T -k "(test_backward and cuda) or kernel_choice" > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; grep -E "passed|failed|^FAILED" "$OUT/pytest.log" | head -20
  timeout ${MEM_TO:-120} compute-sanitizer --tool memcheck --print-limit 5 $T -x \
    -k "test_backward and cuda-wgmma and bfloat16 and (d192_dv256 or d256_targets_context or long_d256)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
  timeout ${RACE_TO:-90} compute-sanitizer --tool racecheck --print-limit 5 $T -x \
    -k "test_backward and cuda-wgmma and bfloat16 and d256_targets_context" > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3
  timeout ${AB_TO:-120} python3 benchmarks/ab_hstu_bwd.py --shapes d256 --out "$OUT/ab_d256.md" > "$OUT/ab.log" 2>&1
  echo "ab exit $?"; grep -v "^|" "$OUT/ab.log" | tail -4; cat "$OUT/ab_d256.md"
elif [ "$PART" = both ]; then
  T="python3 -m pytest tests/test_hstu.py -q -p no:cacheprovider"
  timeout 60 $T -x -k "test_backward and cuda-wgmma and bfloat16 and (plain_h2_d64 or d256_dv32 or many_short_seqs)" > "$OUT/smoke.log" 2>&1
  rc=$?; echo "smoke (persistent) exit $rc"; tail -1 "$OUT/smoke.log"; [ $rc = 124 ] && exit 1
  timeout 40 $T -x -k "one_block_per_item and bfloat16 and (plain_h2_d64 or many_short_seqs)" > "$OUT/smoke1.log" 2>&1
  rc=$?; echo "smoke (one block per item) exit $rc"; tail -1 "$OUT/smoke1.log"; [ $rc = 124 ] && exit 1
  timeout 150 $T -k "(test_backward and cuda) or one_block_per_item or persistent_grid or kernel_choice or (test_forward and many_short_seqs)" -rs > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; grep -E "passed|failed|^FAILED|^ERROR|^SKIPPED" "$OUT/pytest.log" | head -12
  timeout 80 compute-sanitizer --tool memcheck --print-limit 5 $T -x \
    -k "(test_backward and cuda-wgmma and bfloat16 and (long_d128 or d256_targets_context or window_minfull or many_short_seqs)) or (one_block_per_item and bfloat16 and many_short_seqs)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
  P="python3 -m pytest tests/test_dynamic_embedding.py -q -p no:cacheprovider"
  timeout 60 $P -k cuda > "$OUT/pytest_dynemb.log" 2>&1
  echo "dynemb pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_dynemb.log" | tail -4
  timeout 60 compute-sanitizer --tool memcheck --print-limit 5 $P -x -k "cuda and (stage_rows or sync_op)" > "$OUT/memcheck_dynemb.log" 2>&1
  echo "dynemb memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_dynemb.log" | tail -2
  timeout 110 python3 benchmarks/ab_hstu_bwd.py --forms mma,1blk,pers --shapes b128 --rounds 2 --out "$OUT/ab_pbwd.md" > "$OUT/ab.log" 2>&1
  echo "hstu ab exit $?"
  (cd benchmarks && timeout 110 python3 ab_foi.py --set marks --dims 8,128 --reps 2) > "$OUT/ab_foi.txt" 2>&1; echo "foi ab exit $?"
  echo "== HSTU backward A/B"; cat "$OUT/ab_pbwd.md"
  echo "== find_or_insert A/B"; grep "^|" "$OUT/ab_foi.txt" | tail -14
elif [ "$PART" = final ]; then
  P="python3 -m pytest tests/test_dynamic_embedding.py -q -p no:cacheprovider"
  timeout 60 $P -x -k "cuda and (sync_op or concurrent_claims)" > "$OUT/smoke.log" 2>&1
  rc=$?; echo "smoke exit $rc"; tail -1 "$OUT/smoke.log"; [ $rc = 124 ] && exit 1
  timeout 90 python3 -m pytest tests/test_dynamic_embedding.py tests/test_torchrec.py -q -p no:cacheprovider -k cuda > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -6
  timeout 60 compute-sanitizer --tool memcheck --print-limit 5 $P -x -k "cuda and (sync_op or erased or concurrent_claims or full_table_rows)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
  (cd benchmarks && timeout 120 python3 ab_foi.py --set ${AB_SET:-marks} --dims 8,128 --reps 2) > "$OUT/ab_foi.txt" 2>&1; echo "ab exit $?"
  if [ -n "${PEERS:-}" ] && [ -x "$PEERS/hkv_bench" ]; then
    timeout 110 "$PEERS/hkv_bench" > "$OUT/hkv.txt" 2>&1; echo "hkv exit $?"; grep -E "^dim|^\| *[01]\." "$OUT/hkv.txt"
  fi
  timeout 170 python3 benchmarks/bench_dynamic_embedding.py --out "$OUT/bench_dynemb.md" > "$OUT/bench.log" 2>&1
  echo "bench exit $?"; cat "$OUT/bench_dynemb.md"
  echo "== A/B (ab_foi.py --set ${AB_SET:-marks})"; tail -10 "$OUT/ab_foi.txt"
else
  timeout 60 python3 -m pytest tests/test_dynamic_embedding.py -q -x -p no:cacheprovider -k "cuda and (sync_op or concurrent_claims)" > "$OUT/smoke.log" 2>&1
  rc=$?; echo "smoke exit $rc"; tail -3 "$OUT/smoke.log"; [ $rc = 124 ] && exit 1
  timeout 120 python3 -m pytest tests/test_dynamic_embedding.py tests/test_torchrec.py -q -p no:cacheprovider -k cuda > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -8
  SEL="cuda and (sync_op or erased or concurrent_claims or full_table_rows or random_ops or opcheck)"
  timeout 100 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_dynamic_embedding.py -q -x \
    -p no:cacheprovider -k "$SEL" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
  if [ "${PROFILE:-0}" = 1 ]; then
    for a in "--dim 8 --lf 1.0" "--dim 128 --lf 1.0" "--dim 8 --lf 0.5 --host"; do
      (cd benchmarks && timeout 60 python3 profile_dynemb.py $a) > "$OUT/profile.txt" 2>&1
      echo "== profile_dynemb.py $a (exit $?)"; grep -v "^-" "$OUT/profile.txt" | cut -c1-150 | head -22
    done
    exit 0
  fi
  (cd benchmarks && timeout ${AB_TO:-170} python3 ab_foi.py --set marks --reps ${REPS:-3}) > "$OUT/ab_foi.txt" 2>&1; echo "ab exit $?"
  (cd benchmarks && timeout 60 python3 host_gap_dynemb.py --dim 8 --lf 0.5 --calls 7) > "$OUT/host_gap.txt" 2>&1; echo "host_gap exit $?"
  echo "== host gap (dim 8, lf 0.5)"; tail -9 "$OUT/host_gap.txt"
  echo "== A/B (ab_foi.py --set marks)"; tail -20 "$OUT/ab_foi.txt"
fi
