#!/usr/bin/env bash
# Session 19's device calls (each under the 10-minute limit).
#   norec: find_or_insert / insert_or_assign on a table keeping no eviction record (evicted_record_limit=0:
#          the kernels write the evicting keys' rows over the victims' at once; no eviction-rows kernel after the
#          host's wait), which is HierarchicalKV's find_or_insert semantics: the new tests first, then every
#          dynamic-embedding and TorchRec GPU test, memcheck on the find_or_insert tests, HierarchicalKV's benchmark
#          ($1: the git-ignored peers folder holding hkv_bench) and bench_dynamic_embedding.py --parts hbm (both
#          forms of each inserting op, alternating on one table) in the same call. Short table last.
#   prof:  where find_or_insert's time goes per load factor with no record (call 1: 0.75 no faster than with the
#          record, both ~25% slower than at 0.5): profile_dynemb.py (kernels, median wall) at dims 8 and 128, load
#          factors 0.5 / 0.75 / 1.0; host_gap_dynemb.py at dim 8, 0.5 and 0.75 (api / gpu / op split, one call's trace)
#   cost:  the fixed host cost of a find_or_insert call piece by piece (host_cost_dynemb.py), then the table
#          operations again with the load factor held (bench_dynamic_embedding.py now erases each inserting call's
#          new keys after it; call 1's no-record columns ran 6 inserting calls later, at a fuller table), beside
#          HierarchicalKV's benchmark
#   split: host_split_foi.py: the public call against the op with its wait inside, the op without a wait followed by
#          a blocking sync or by polling, and the GPU's work alone (1M keys, dims 8 and 128, load factor 0.5)
#   mapped: the counts handed over by the insert kernel's last block in mapped pinned memory, the host spinning on a
#          sequence word, instead of a copy behind the kernels and a stream sync; and no eviction list written or
#          allocated when no record is kept. The GPU tests, memcheck, then ab_foi.py --set mapped --norec (one
#          process, forms alternating), host_split_foi.py, HierarchicalKV and bench_dynamic_embedding.py --parts hbm.
#   train: the training step with the mapped counts against the copy and stream sync (ab_train_step.py, SGD and
#          Adam, one process), then bench_dynamic_embedding.py --parts train,gather
#   tprof: the SGD training step's kernels (profile_dynemb_train.py, torchfuse and PyTorch sparse) and its GPU idle
#          gaps (gaps_dynemb_train.py): the sum of the kernels against the 2x target's 1.05 ms
#   floor: one machine for the block's figures: HierarchicalKV's benchmark, host_split_foi.py at dims 8 and 128
#          (the GPU's work alone against the public call) and host_cost_dynemb.py (the fixed cost with one key)
set -uo pipefail
PART=${1:?part: norec, prof, cost, split, mapped, train, tprof, floor}
PEERS=${2:-}
source "$(dirname "$0")/device_build.sh"
gpu_checks() {  # SMOKE_SELECTION MEMCHECK_SELECTION: the smoke tests (stop on a failure), every dynamic-embedding and
                # TorchRec GPU test, memcheck
  timeout 90 python3 -m pytest tests/test_dynamic_embedding.py -q -x -p no:cacheprovider -k "cuda and ($1)" \
    > "$OUT/smoke.log" 2>&1
  local rc=$?; echo "smoke exit $rc"; tail -3 "$OUT/smoke.log"
  [ $rc = 0 ] || { grep -E "^E  " "$OUT/smoke.log" | head -20; return 1; }
  timeout 150 python3 -m pytest tests/test_dynamic_embedding.py tests/test_torchrec.py -q -p no:cacheprovider -k cuda \
    > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -8
  timeout 100 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest tests/test_dynamic_embedding.py -q -x \
    -p no:cacheprovider -k "cuda and ($2)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
}
hkv() {  # HierarchicalKV's benchmark, when its binary is carried in $PEERS
  if [ -n "$PEERS" ] && [ -x "$PEERS/hkv_bench" ]; then
    timeout 120 "$PEERS/hkv_bench" > "$OUT/hkv.txt" 2>&1; echo "hkv exit $?"
  fi
}
bench_hbm() {  # TIMEOUT: the table operations of bench_dynamic_embedding.py
  timeout "$1" python3 benchmarks/bench_dynamic_embedding.py --parts hbm --out "$OUT/bench_dynemb.md" > "$OUT/bench.log" 2>&1
  echo "bench exit $?"
}
case "$PART" in
norec)
  gpu_checks "without_eviction_record or pool_early" \
    "without_eviction_record or full_table_rows or eviction_record or pool_early" || exit 1
  hkv
  bench_hbm 200
  [ -f "$OUT/hkv.txt" ] && grep -E "^dim|^\|" "$OUT/hkv.txt"
  cat "$OUT/bench_dynemb.md"
  ;;
prof)
  cd benchmarks
  for d in 8 128; do
    timeout 120 python3 profile_dynemb.py --dim $d --lfs 0.5,0.75,1.0 --norec > "$OUT/prof_$d.txt" 2>&1; echo "prof $d exit $?"
  done
  for lf in 0.5 0.75; do
    timeout 100 python3 host_gap_dynemb.py --dim 8 --lf $lf --trace "$OUT/trace_$lf.json" > "$OUT/gap_$lf.txt" 2>&1
    echo "gap $lf exit $?"
  done
  for d in 8 128; do grep -E "wall|Name|foi|kernel|memcpy|memset|Memcpy|Memset|Self CUDA time" "$OUT/prof_$d.txt" | grep -v "^-" | cut -c1-150; done
  for lf in 0.5 0.75; do head -30 "$OUT/gap_$lf.txt"; done
  ;;
cost)
  (cd benchmarks && timeout 120 python3 host_cost_dynemb.py) > "$OUT/host_cost.txt" 2>&1; echo "host cost exit $?"
  hkv
  bench_hbm 240
  cat "$OUT/host_cost.txt"
  [ -f "$OUT/hkv.txt" ] && grep -E "^\* dim|^\|" "$OUT/hkv.txt"
  cat "$OUT/bench_dynemb.md"
  ;;
split)
  cd benchmarks
  for d in 8 128; do
    timeout 120 python3 host_split_foi.py --dim $d > "$OUT/split_$d.txt" 2>&1; echo "split $d exit $?"; cat "$OUT/split_$d.txt"
  done
  ;;
mapped)
  gpu_checks "without_eviction_record or pool_early or n_valid_and_abort or matches_its_parts" \
    "without_eviction_record or full_table_rows or eviction_record or n_valid_and_abort" || exit 1
  (cd benchmarks && timeout 120 python3 ab_foi.py --set mapped --norec --dims 8,128 --reps 4) > "$OUT/ab_mapped.txt" 2>&1
  echo "ab exit $?"
  (cd benchmarks && timeout 60 python3 host_split_foi.py --dim 8) > "$OUT/split.txt" 2>&1; echo "split exit $?"
  hkv
  [ "${BENCH:-1}" = 1 ] && bench_hbm 200
  tail -16 "$OUT/ab_mapped.txt"; cat "$OUT/split.txt"
  [ -f "$OUT/hkv.txt" ] && grep -E "^\* dim|^\|" "$OUT/hkv.txt"
  [ -f "$OUT/bench_dynemb.md" ] && head -12 "$OUT/bench_dynemb.md"
  ;;
train)
  for opt in sgd adam; do
    (cd benchmarks && timeout 150 python3 ab_train_step.py --switch TORCHFUSE_DYNEMB_MAPPED_COUNTS --values 0,1 --opt $opt \
      --rounds 4) > "$OUT/ab_train_$opt.txt" 2>&1; echo "ab $opt exit $?"
  done
  timeout 150 python3 benchmarks/bench_dynamic_embedding.py --parts train,gather --out "$OUT/bench_train.md" \
    > "$OUT/bench_train.log" 2>&1; echo "bench exit $?"
  for opt in sgd adam; do tail -12 "$OUT/ab_train_$opt.txt"; done
  cat "$OUT/bench_train.md"
  ;;
tprof)
  cd benchmarks
  timeout 120 python3 profile_dynemb_train.py --opt sgd > "$OUT/tprof.txt" 2>&1; echo "tprof exit $?"
  timeout 120 python3 gaps_dynemb_train.py --opt sgd > "$OUT/gaps.txt" 2>&1; echo "gaps exit $?"
  grep -vE "^-+$" "$OUT/tprof.txt" | cut -c1-60,100-200 | head -60
  head -50 "$OUT/gaps.txt"
  ;;
floor)
  hkv
  cd benchmarks
  for d in 8 128; do timeout 90 python3 host_split_foi.py --dim $d > "$OUT/split_$d.txt" 2>&1; echo "split $d exit $?"; done
  timeout 90 python3 host_cost_dynemb.py > "$OUT/host_cost.txt" 2>&1; echo "cost exit $?"
  [ -f "$OUT/hkv.txt" ] && grep -E "^\* dim|^\|" "$OUT/hkv.txt"
  cat "$OUT/split_8.txt" "$OUT/split_128.txt" "$OUT/host_cost.txt"
  ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
