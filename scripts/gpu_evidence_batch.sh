#!/usr/bin/env bash
# Several parts of scripts/gpu_evidence.sh at once in one device call, on the same GPU(s): most of their
# cases are small and each spends ~10 s starting its worker, so three parts side by side take about the
# time of the longest. Peak memory stays per process (each case's figure is its own); times interfere, so
# time figures from a batch are marked as such in EVIDENCE.md. Keep memory-hungry parts (part5's 64k
# scale, whose out-of-memory point must be the card's) out of a batch.
# Returns in $OUT: evidence-batch-summary.txt (every part's table), evidence-batch-logs.tgz (every part's
# step logs and console output), evidence-<part>-runs.tgz per part and part1's evidence-part1-profile.tgz.
# The pseudo-part `triton-tests` runs tests/core/triton at real sizes beside them (triton-tests.log; the
# pytest arguments from TRITON_TESTS when set);
# `gpu-smoke` runs `make gpu-smoke` in a fresh clone of HEAD (gpu-smoke.log).
#   device: kind nvidia-h100-x1, carry [".whl"], command: bash scripts/gpu_evidence_batch.sh part1 part2 part4
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/nsa-evidence/out}
stage=/tmp/nsa-evidence/batch
rm -rf "$stage"
mkdir -p "$out" "$stage"
parts=()
for part in "$@"; do
  mkdir -p "$stage/$part"
  if [[ $part == triton-tests ]]; then  # the Triton kernel tests at real sizes, beside the parts
    (source scripts/gpu_env.sh && timeout -s INT -k 20 "${BUDGET:-550}" python3 -m pytest -q -p no:cacheprovider \
      --durations=15 ${TRITON_TESTS:-tests/core/triton}) >"$out/triton-tests.log" 2>&1 &
    continue
  fi
  if [[ $part == gpu-smoke ]]; then  # `make gpu-smoke` from a fresh clone of this checkout's HEAD
    (
      fresh=/tmp/nsa-evidence/fresh-clone
      rm -rf "$fresh"
      if ! git clone -q . "$fresh"; then  # no repository in this copy: the tree as it came, without outputs
        echo "git clone failed: copying the working tree instead"
        mkdir -p "$fresh" && tar -c --exclude=./nsa-diag-runs --exclude=./.whl . | tar -x -C "$fresh"
      fi
      cp -r .whl "$fresh/" 2>/dev/null
      cd "$fresh" && git log --oneline -1 && source scripts/gpu_env.sh \
        && GPU_SMOKE_OUT=/tmp/nsa-evidence/gpu-smoke timeout -s INT -k 20 "${BUDGET:-550}" \
          make gpu-smoke NSA_DIAG='python3 -m nsa_diag'
      echo "make gpu-smoke: rc=$?"
    ) >"$out/gpu-smoke.log" 2>&1 &
    continue
  fi
  parts+=("$part")
  OUT=$stage/$part BUDGET=${BUDGET:-550} bash scripts/gpu_evidence.sh "$part" >"$stage/$part/console.log" 2>&1 &
  sleep 5  # stagger the first workers' start-up
done
wait
[[ -f $out/triton-tests.log ]] && tail -n 30 "$out/triton-tests.log"
[[ -f $out/gpu-smoke.log ]] && tail -n 30 "$out/gpu-smoke.log"
set -- "${parts[@]}"
for part in "$@"; do
  cat "$stage/$part/evidence-$part-summary.txt" 2>/dev/null || { echo "=== $part: no summary"; tail -n 20 "$stage/$part/console.log"; }
  echo
done | tee "$out/evidence-batch-summary.txt"
(cd "$stage" && tar -czf "$out/evidence-batch-logs.tgz" ./*/console.log ./*/evidence-*-logs.tgz 2>/dev/null)
for part in "$@"; do
  for f in "$stage/$part"/evidence-"$part"-{runs,profile}.tgz; do
    [[ -f $f ]] && cp "$f" "$out/"
  done
done
ls -la "$out"
