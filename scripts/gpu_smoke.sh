#!/usr/bin/env bash
# `make gpu-smoke`: the gpu-smoke matrix and `selftest` on the GPUs of this machine, one command; with two
# or more GPUs also `selftest --ddp` on NCCL; then real jobs written as users write them under `watch` and
# `attach` (scripts/gpu_smoke_jobs.py: a per-token layer at S=2048 under --stall 60 is slow; a loop that
# compiles its model with inductor passes with 0 graph breaks; FSDP2 on NCCL passes; with two GPUs an NCCL
# job with an unused parameter is grad-missing with its names, FSDP2 with a stuck rank is a collective
# hang about it, and attach to a stuck NCCL job names the minority rank). A short table at the end; the
# run folders stay under $GPU_SMOKE_OUT (default nsa-diag-runs/gpu-smoke-<UTC time>), with JUnit XML and a
# report per run.
# Exit 0 when every step passed, 1 when one did not, 2 when this machine has no usable GPU.
#   NSA_DIAG: the nsa-diag command (default .venv/bin/nsa-diag; on a machine whose Python already has the
#   dependencies: NSA_DIAG='python3 -m nsa_diag' with PYTHONPATH=src).
#   GPU_SMOKE_PARTS: the steps to run, comma-separated (default all: matrix,selftest,selftest-ddp,jobs).
set -uo pipefail
cd "$(dirname "$0")/.."
read -r -a diag <<< "${NSA_DIAG:-.venv/bin/nsa-diag}"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [[ ${gpus:-0} -lt 1 ]]; then
  echo "gpu-smoke: no GPU here (nvidia-smi lists none); run it on a machine with CUDA" >&2
  exit 2
fi
out=${GPU_SMOKE_OUT:-nsa-diag-runs/gpu-smoke-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$out"
declare -a rows=()
failed=0
step() {  # step NAME COMMAND...: run it (the run folder lands under $out), remember rc, time and verdicts
  local name=$1; shift
  local start=$SECONDS
  echo "=== $name: $*"
  "$@" --out "$out/$name" --junit "$out/$name.xml"
  local rc=$?
  ((rc == 0)) || failed=1
  local run counts="-"
  run=$(ls -d "$out/$name"/*/ 2>/dev/null | tail -n 1)
  if [[ -n $run && -f $run/summary.json ]]; then
    counts=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1]))["counts"]; print(", ".join(f"{n} {v}" for v, n in sorted(c.items())))' "$run/summary.json")
    "${diag[@]}" report "$run" > /dev/null 2>&1 || true
  fi
  rows+=("$(printf '%-14s rc=%-3s %5ss  %s' "$name" "$rc" "$((SECONDS - start))" "$counts")")
}
parts=",${GPU_SMOKE_PARTS:-matrix,selftest,selftest-ddp,jobs},"
[[ $parts == *,matrix,* ]] && step matrix "${diag[@]}" matrix gpu-smoke --jobs "$gpus"
[[ $parts == *,selftest,* ]] && step selftest "${diag[@]}" selftest --device cuda
if ((gpus >= 2)) && [[ $parts == *,selftest-ddp,* ]]; then
  step selftest-ddp "${diag[@]}" selftest --ddp --device cuda
fi
if [[ $parts == *,jobs,* ]]; then
  echo "=== jobs: scripts/gpu_smoke_jobs.py"
  start=$SECONDS
  python3 scripts/gpu_smoke_jobs.py "$out/jobs" "${diag[@]}" | tee "$out/jobs.txt"
  rc=${PIPESTATUS[0]}
  ((rc == 0)) || failed=1
  rows+=("$(printf '%-14s rc=%-3s %5ss  %s' jobs "$rc" "$((SECONDS - start))" "$(grep -c ' ok ' "$out/jobs.txt") ok")")
fi
echo
echo "=== gpu-smoke: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1) x$gpus, $(date -u +%F), runs in $out"
printf '%s\n' "${rows[@]}"
exit "$failed"
