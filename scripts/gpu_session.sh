#!/usr/bin/env bash
# One call on the lent GPU machine: environment, the whole test suite (GPU tests included), the demo on
# CUDA, and the backend benchmark; a short table at the end. Logs go to $OUT (or ./gpu-session-out).
#   device: carry [".whl"], command: bash scripts/gpu_session.sh
# Wheels the GPU machine lacks come from ../shared/tools/gpu-wheels.sh pytest-timeout hypothesis sortedcontainers.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-session-out}
mkdir -p "$out"
source scripts/gpu_env.sh

declare -a rows=()
step() {  # step NAME COMMAND...: run, log to $out/NAME.log, remember rc and seconds
  local name=$1; shift
  local start=$SECONDS
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  rows+=("$(printf '%-10s rc=%-3s %5ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(tail -n 1 "$out/$name.log" | cut -c1-90)")")
}

step env python3 -m nsa_diag env
step tests python3 -m pytest -q -p no:cacheprovider tests
step demo python3 -m nsa_diag.demo --device cuda
step bench python3 benchmarks/backends.py --device cuda --dtype bf16 --preset small --seq-lens 2048 4096 8192 16384

echo
echo "=== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $(date -u +%F))"
printf '%s\n' "${rows[@]}"
