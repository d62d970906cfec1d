#!/usr/bin/env bash
# Session 13's device calls (each under the 10-minute limit):
#   sortgroup: branch dynemb-sort-group (CUB radix sort with int32 values + the grouping in one op),
#          merged into main for this call: dynamic-embedding and TorchRec GPU tests, memcheck, the
#          one-process A/B (--switch _SORT_GROUP), the step's kernel profile, then where a step's wall
#          time goes (host_split_dynemb_train.py, incl. the no-op Function's backward: the engine's cost)
set -uo pipefail
PART=${1:?part: sortgroup}
source "$(dirname "$0")/device_build.sh"
source "$(dirname "$0")/device_dynemb_checks.sh"
if [ "$PART" = sortgroup ]; then
  dynemb_tests "sort_group or group_sorted or pool or bag or training or one_sync"
  (cd benchmarks && timeout 150 python3 ab_train_step.py --switch _SORT_GROUP --rounds ${ROUNDS:-4} --steps 30) 2>&1 | grep "|"
  step_trace 10
  (cd benchmarks && timeout 100 python3 host_split_dynemb_train.py --steps 30) 2>&1 | grep "|"
fi
