#!/usr/bin/env bash
# The one-GPU checks in one command, for a GPU machine that has torch and transformers but not grpoflow's
# environment: the sharded (FSDP2) GRPO update (bench/gpu_fsdp_check.py: NCCL, bf16 with fp32 master weights,
# tokens/s, peak memory, MFU, the sync's gather) and the replicated trainer's train step
# (bench/gpu_check.py: tokens/s, MFU), then the run's GPU plan on this machine (`grpoflow.placement`).
#
#   bench/gpu_checks.sh [OUT_DIR]          # OUT_DIR defaults to $OUT, else ./gpu-checks
#   bench/gpu_checks.sh --cpu [OUT_DIR]    # the same path on the CPU with tiny models (what the tests run)
#
# gpu_check.py and the plan read grpoflow's config, which needs pydantic and harbor besides torch: where they are
# missing, install their wheels without dependencies first (pydantic, pydantic-core, annotated-types,
# typing-inspection, harbor; about 5 MB). Each check gets BUDGET_S seconds of timed steps (default 200), so the
# whole command ends well inside ten minutes on one H100 or H200. Each check's report goes to OUT_DIR/<check>.log
# and its last line (RESULT {json}) to OUT_DIR/<check>.json; a failed check does not stop the others, and the
# exit status counts the failed ones.
set -uo pipefail

cpu=""
if [ "${1:-}" = "--cpu" ]; then cpu=1; shift; fi
out=${1:-${OUT:-gpu-checks}}
python=${PYTHON:-python3}
case $python in */*) python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python") ;; esac  # checks run from the repo root
budget=${BUDGET_S:-200}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"

failed=0
check() {  # check NAME SCRIPT ARGS...: run it, keep its report and its RESULT line
  local name=$1
  shift
  echo "== $name: $*"
  local result=""
  if (cd "$here" && "$python" "$@") 2>&1 | tee "$out/$name.log"; then
    result=$(grep '^RESULT ' "$out/$name.log" | tail -1)
    [ -n "$result" ] || echo "== $name: exited 0 without a RESULT line"
  fi
  if [ -n "$result" ]; then
    echo "${result#RESULT }" >"$out/$name.json"
  else
    echo "== $name: FAILED (see $out/$name.log)"
    failed=$((failed + 1))
  fi
}

if [ -n "$cpu" ]; then
  check fsdp_update bench/gpu_fsdp_check.py --cpu
  check train_step bench/gpu_check.py --dry-run
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.csv" 2>&1 || true
  check fsdp_update bench/gpu_fsdp_check.py --time-budget-s "$budget"
  check train_step bench/gpu_check.py --time-budget-s "$budget"
fi
# The run's GPU plan on this machine: one trainer rank, and an SGLang launched on the other GPUs if it has any.
check gpu_plan -c "
import json
from grpoflow.config import parse_run_config
from grpoflow.placement import machine_gpus, plan_gpus
gpus = machine_gpus()
engine = {'backend': 'sglang-launch', 'sglang': {'python': '/opt/sglang/bin/python'}, 'tp_size': gpus - 1} if gpus > 1 else {}
plan = plan_gpus(parse_run_config({'engine': engine}), gpus)
print(plan.describe())
print('RESULT ' + json.dumps(plan.to_json()))
"
echo "== $failed check(s) failed; reports in $out"
exit "$failed"
