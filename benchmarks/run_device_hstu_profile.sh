#!/usr/bin/env bash
# One device call: build, then where the HSTU forward kernels spend their time: ncu (speed of light, warp
# stall reasons) on one call per head dim, and the SASS of the bf16 sm_90a kernels (instruction mix;
# the D = 128 kernel in full in $OUT/k128.sass).   bash benchmarks/run_device_hstu_profile.sh [N]
source benchmarks/device_build.sh
N=${1:-1024}
SO=$(python3 -c "import torchfuse._C as C; print(C.__file__)")
cuobjdump -sass $SO > /tmp/all.sass 2>/dev/null
python3 - <<'PY'
import os, re, collections
s = open("/tmp/all.sass").read()
for f in re.split(r"\n\s+Function : ", s):
    name = f.split("\n", 1)[0]
    if "hstu_fwd_ws" not in name or "bfloat16" not in name: continue
    ops = collections.Counter(re.findall(r"\b(HGMMA\S*|WARPGROUP\S*|BAR\.\S+|LDGSTS\S*|MUFU\.\S+|STL\S*|LDL\S*|DEPBAR\S*|CALL\S*)", f))
    print(name[-40:], "instructions:", f.count(";"), dict(ops))
    if "Li128E" in name:
        open(os.environ["OUT"] + "/k128.sass", "w").write(f)
PY
M="smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_misc_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__inst_executed.sum,sm__cycles_elapsed.avg,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_xu.sum"
for D in 128 256; do
  ncu --kernel-name regex:hstu_fwd --launch-skip 1 --launch-count 1 --metrics $M python3 benchmarks/profile_hstu.py --D $D --N $N > $OUT/ncu_$D.txt 2>&1
  echo "== D=$D N=$N"; grep -E "stalled|inst_executed|cycles|gmma" $OUT/ncu_$D.txt | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | awk '{print $1, $NF}' | sort -k2 -g -r | head -24
done
