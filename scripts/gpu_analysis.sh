#!/usr/bin/env bash
# The analysis commands on the GPU (issue 4):
#   part "scale":  `scale` of m7c-125m in bf16 from S=512 to 8192, masked backends (sel and win masked) and
#                  linear ones (sel gather, win chunked), and small in bf16 (masked) and fp32 (gather);
#   part "verify": `verify` in bf16 on CUDA for every preset;
#   part "all":    both (about 6 minutes on an H100);
#   part "estimator": the memory estimator's calibration and validation sweeps (over 10 minutes: a call
#                  of its own), per branch, with checkpointing, fp32, tiny and small in fp32 and bf16.
# scale.json and summary.json of every run are packed into $OUT/<part>-runs.tgz; a short table at the end.
#   device: carry [".whl"], command: bash scripts/gpu_analysis.sh scale   (then: ... verify)
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
out=${OUT:-gpu-analysis-out}
mkdir -p "$out"
source scripts/gpu_env.sh
runs=/tmp/nsa-diag-runs-$part
declare -a rows=()
step() {  # step NAME COMMAND...: run, log to $out/NAME.log, remember rc and seconds
  local name=$1; shift
  local start=$SECONDS
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  rows+=("$(printf '%-22s rc=%-3s %5ss' "$name" "$rc" "$((SECONDS - start))")")
}
diag() { python3 -m nsa_diag "$@"; }
cuda=(--device cuda --batch 1 --out "$runs")
m7c=(--preset m7c-125m --dtype bf16 --steps 2 "${cuda[@]}")

if [[ $part == scale || $part == all ]]; then
  step m7c-masked diag scale "${m7c[@]}" --sel masked --win masked --seq-lens 512,1024,2048,4096,8192
  step m7c-gather diag scale "${m7c[@]}" --sel gather --win chunked --seq-lens 512,1024,2048,4096,8192
  step small-bf16-masked diag scale --preset small --dtype bf16 --sel masked "${cuda[@]}" --seq-lens 512,1024,2048,4096
  step small-fp32-gather diag scale --preset small --dtype fp32 --sel gather "${cuda[@]}" --seq-lens 512,1024,2048,4096
fi
if [[ $part == estimator ]]; then  # the estimator's calibration and validation points (BENCHMARKS.md)
  step m7c-masked-branches diag scale "${m7c[@]}" --sel masked --win masked --per-branch --seq-lens 512,1024,2048,4096,8192
  step m7c-gc-gather diag scale "${m7c[@]}" --sel gather --gc all --seq-lens 2048,4096,8192
  step m7c-fp32-gather diag scale --preset m7c-125m --dtype fp32 --steps 2 "${cuda[@]}" --seq-lens 512,1024,2048
  for preset in tiny small; do
    for dtype in fp32 bf16; do
      for sel in masked gather; do
        step "$preset-$dtype-$sel" diag scale --preset "$preset" --dtype "$dtype" --sel "$sel" "${cuda[@]}" \
          --seq-lens 512,1024,2048,4096
      done
    done
  done
fi
if [[ $part == verify || $part == all ]]; then
  for preset in tiny small m7c-125m; do
    step "verify-$preset" diag verify --preset "$preset" --device cuda --dtype bf16 --out "$runs"
  done
fi
(cd /tmp && find "nsa-diag-runs-$part" \( -name 'scale.json' -o -name 'summary.json' -o -name 'result.json' \) -print0 \
  | tar --null -czf "$out/$part-runs.tgz" -T -)
echo
echo "=== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $(date -u +%F))"
printf '%s\n' "${rows[@]}"
