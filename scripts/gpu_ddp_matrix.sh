#!/usr/bin/env bash
# One device call on two GPUs for issues 4-7: `ddp` on NCCL (pass, static graph + bucket trace,
# find-unused with an unused parameter, skip-collective hang with flight-recorder evidence),
# `verify --only backends` of m7c-125m in bf16, the backward.yaml matrix on both GPUs with its report,
# the Triton kernel tests at real sizes, then the Triton op benchmark in what is left of 560 s. Each step
# has a time limit so the call ends in time.
# Case results, summaries, reports and JUnit files are packed into $OUT/runs.tgz; a short table at the end.
#   device: kind nvidia-h100-x2, carry [".whl"], command: bash scripts/gpu_ddp_matrix.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-ddp-matrix-out}
logs=/tmp/nsa-diag-logs  # the device call returns at most 8 files: logs travel as one archive
mkdir -p "$out" "$logs"
source scripts/gpu_env.sh
runs=/tmp/nsa-diag-runs
declare -a rows=()
step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to $out/NAME.log, remember rc and time
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name: $*"
  timeout -s INT -k 20 "$limit" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$logs/$name.log" | cut -c1-160
  rows+=("$(printf '%-14s rc=%-3s %5ss' "$name" "$rc" "$((SECONDS - start))")")
  tar -czf "$out/logs.tgz" -C "$logs" .  # after every step, so a call cut short keeps what ran
}
diag=(python3 -m nsa_diag)
nccl=(--nproc 2 --backend nccl --device cuda --out "$runs")
step ddp-pass 60 "${diag[@]}" ddp "${nccl[@]}" --tag pass
step ddp-static 60 "${diag[@]}" ddp "${nccl[@]}" --static-graph --trace-buckets --steps 3 --tag static
step ddp-unused 60 "${diag[@]}" ddp "${nccl[@]}" --find-unused --inject unused-param:layer=1 --tag unused
step ddp-skip 75 "${diag[@]}" ddp "${nccl[@]}" --inject skip-collective:rank=1 --stall 10 --tag skip
(cd "$runs" && ls -R ./*-ddp-skip/cases/*/ranks 2>/dev/null | head -30)
step verify-m7c 75 "${diag[@]}" verify --preset m7c-125m --device cuda --dtype bf16 --only backends --out "$runs"
step matrix 140 "${diag[@]}" matrix backward --jobs 4 --out "$runs" --tag backward --junit "$out/backward.xml"
mdir=$(ls -d "$runs"/*-matrix-backward 2>/dev/null | tail -n 1)
[[ -n $mdir ]] && step report 45 "${diag[@]}" report "$mdir"
[[ ${SKIP_TRITON:-} ]] || step triton-tests 120 python3 -m pytest -q -p no:cacheprovider -x tests/core/triton
left=$((560 - SECONDS))  # what is left of the call goes to a first look at the Triton op's speed
[[ ${SKIP_TRITON:-} ]] || ((left < 40)) || step nsa-op "$left" python3 benchmarks/nsa_op.py --seq-lens 8192 65536 --baseline-max 65536
(cd /tmp && find nsa-diag-runs \( -name 'summary.*' -o -name 'result.json' -o -name 'report.md' -o -name '*.png' \
  -o -name 'stacks.txt' -o -name 'matrix.json' -o -name '*flight_recorder*' \) -print0 \
  | tar --null -czf "$out/runs.tgz" -T -)
echo
echo "=== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1) x$(nvidia-smi -L | wc -l), $(date -u +%F))"
printf '%s\n' "${rows[@]}"
