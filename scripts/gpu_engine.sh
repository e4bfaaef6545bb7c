#!/usr/bin/env bash
# The engine's GPU checks in one device call (issue 3): the diag tests with their CUDA cases, `branch` and
# `backend` on m7c-125m at S=2048 in bf16, and `selftest` with gpu-spin. A short table at the end; the
# case results and summaries are packed into $OUT/runs.tgz.
#   device: carry [".whl"], command: bash scripts/gpu_engine.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-engine-out}
mkdir -p "$out"
source scripts/gpu_env.sh
runs=/tmp/nsa-diag-runs
declare -a rows=()
step() {  # step NAME COMMAND...: run, log to $out/NAME.log, remember rc and seconds
  local name=$1; shift
  local start=$SECONDS
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  rows+=("$(printf '%-9s rc=%-3s %5ss' "$name" "$rc" "$((SECONDS - start))")")
}
m7c=(--preset m7c-125m --seq-len 2048 --dtype bf16 --device cuda --batch 1 --out "$runs")
step selftest python3 -m nsa_diag selftest --device cuda --out "$runs"
step branch python3 -m nsa_diag branch "${m7c[@]}"
step backend python3 -m nsa_diag backend "${m7c[@]}"
step tests python3 -m pytest -q -p no:cacheprovider -x tests/diag
(cd /tmp && find nsa-diag-runs \( -name 'summary.*' -o -name 'result.json' -o -name 'stacks.txt' -o -name 'gpu.json' -o -name 'nvidia-smi.txt' -o -name 'pyspy.txt' \) -print0 | tar --null -czf "$out/runs.tgz" -T -)
echo
echo "=== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $(date -u +%F))"
printf '%s\n' "${rows[@]}"
