#!/usr/bin/env bash
# One device call for the Triton kernels (issue 7), on one GPU, in parts so each fits a call:
#   tests    the tests/core/triton folder ($TESTS: some of its files; $TESTS_K: pytest's -k over them) at
#            real sizes (CUDA_SIZES), dealt to $LANES pytests side by side
#   tiles    benchmarks/selection_tiles.py ($TILES_ARGS): the selection's forward and backward by path
#   profile  benchmarks/nsa_profile.py: time per kernel at 8k and 64k (G=16) and 16k (m7c-125m, G=6)
#   tune     benchmarks/tune_triton.py: launch options of every kernel family, timed at four shapes
#   bench    benchmarks/nsa_op.py: the full op against SDPA flash/cuDNN, 2k..64k, and 256k for ours
#   gqa      benchmarks/nsa_op.py at G=4 and G=6 (m7c-125m's 12 heads / 2 KV heads, head dim 64)
#   model    benchmarks/model_step.py ($MODEL_ARGS, default S=2048 and 16384; e.g. add --rounds 3 and raise
#            MODEL_S): m7c-125m training tokens/s and peak, triton vs cuDNN dense
#   ab       benchmarks/nsa_op.py ($AB_ARGS, default 8k and 64k) with an older tree in .ab/$AB_BASE (default
#            base; git archive COMMIT src benchmarks | tar -x -C .ab/base; carry ".ab"), then with this one
#   ab-model the same for benchmarks/model_step.py ($AB_ARGS, default S=2048 and 16384)
#   host     benchmarks/step_host.py (the m7c-125m step's host time, NSA against dense, each Triton launch
#            timed by kernel) and benchmarks/nsa_host.py (the op alone at m7c's geometry, 2k)
# Usage: bash scripts/gpu_triton.sh PART... (each part has a time limit; logs and a table in $OUT)
#   device: kind nvidia-h100-x1, carry [".whl"], command: bash scripts/gpu_triton.sh tests profile
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-triton-out}
for part in "$@"; do  # a wrong part name fails before any set-up
  case $part in tests | tiles | profile | tune | bench | gqa | model | ab | ab-model | host) ;; *) echo "unknown part $part (tests, tiles, profile, tune, bench, gqa, model, ab, ab-model, host)"; exit 2 ;; esac
  if [[ $part == ab* && ! -d .ab/${AB_BASE:-base}/src ]]; then echo "part $part needs .ab/${AB_BASE:-base}/src (carry .ab)"; exit 2; fi
done
mkdir -p "$out"
source scripts/gpu_env.sh
declare -a rows=()
step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to $out/NAME.log, remember rc and time
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name: $*"
  timeout -s INT -k 20 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$out/$name.log" | cut -c1-160
  rows+=("$(printf '%-10s rc=%-3s %5ss' "$name" "$rc" "$((SECONDS - start))")")
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for part in "$@"; do
  case $part in
    tests)  # the tests dealt round-robin to lanes side by side (the kernels compile on the CPUs; a lane of
      # whole files waited on its slowest file: 430 s for test_selection alone), each lane one pytest
      # under TESTS_S; TESTS: the files (default: all of tests/core/triton); LANES: six on a card of over
      # 120 GB (165 tests of test_selection and test_nsa in 215 s on an H200), three on smaller ones (four
      # lanes of whole files ran an H100's 79 GB out with the float64 references); the whole folder (485
      # tests) in six lanes ran an H200 out of memory (19 tests, and the CUDA errors after them in the same
      # lane): give it as two calls, TESTS="test_selection.py" then the other files
      files=()
      for f in ${TESTS:-$(cd tests/core/triton && ls test_*.py)}; do files+=("tests/core/triton/${f##*/}"); done
      mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
      lanes=${LANES:-3}; [[ -z ${LANES:-} ]] && (( ${mib:-0} > 120000 )) && lanes=6
      # the lanes' files in a folder of their own; $out gets the ids and one log of every lane (a call
      # brings back at most 8 files)
      lanes_dir=$(mktemp -d)
      python3 -m pytest --collect-only -q -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} "${files[@]}" 2>/dev/null | grep "::" > "$out/test-ids.txt"
      echo "=== tests: $(wc -l < "$out/test-ids.txt") in $lanes lanes"
      pids=()
      for ((i = 0; i < lanes; i++)); do
        lane=$lanes_dir/tests-$i
        awk -v i=$i -v n=$lanes 'NR % n == i' "$out/test-ids.txt" > "$lane.ids"
        if [[ ! -s $lane.ids ]]; then echo "tests-$i: no test dealt to it" > "$lane.row"; continue; fi
        (mapfile -t ids < "$lane.ids"
         timeout -s INT -k 20 "${TESTS_S:-540}" python3 -m pytest -q -p no:cacheprovider --durations=5 "${ids[@]}" > "$lane.log" 2>&1
         echo "tests-$i rc=$? of $(wc -l < "$lane.ids"): $(grep -E '(passed|failed|error)' "$lane.log" | tail -n 1)" > "$lane.row") &
        pids+=($!)
      done
      wait "${pids[@]}"
      for ((i = 0; i < lanes; i++)); do
        rows+=("$(cat "$lanes_dir/tests-$i.row")")
        [[ -f $lanes_dir/tests-$i.log ]] && { echo "===== tests-$i"; cat "$lanes_dir/tests-$i.log"; } >> "$out/tests.log"
      done
      grep -h -E "^(FAILED|ERROR)" "$lanes_dir"/tests-*.log | head -n 30
      # and each failure's last error line, in the reply itself (the logs come back only under $OUT)
      grep -h -E "^E   " "$lanes_dir"/tests-*.log | cut -c1-200 | head -n 20 ;;
    profile)
      step profile "${PROFILE_S:-150}" python3 benchmarks/nsa_profile.py --seq-lens 8192 65536
      [[ ${SKIP_G6:-} ]] || step profile-g6 60 python3 benchmarks/nsa_profile.py --heads 12 --kv-heads 2 --head-dim 64 --seq-lens 16384 ;;
    tiles)  # TILES_ARGS as a shell would split it (geometry names hold spaces: "m7c 16k")
      eval "tiles_args=(${TILES_ARGS:-})"
      step tiles "${TILES_S:-240}" python3 benchmarks/selection_tiles.py "${tiles_args[@]}" ;;
    tune) step tune "${TUNE_S:-300}" python3 benchmarks/tune_triton.py ${TUNE_FAMILIES:+--families $TUNE_FAMILIES} ;;
    ab | ab-model)  # the same benchmark with the older tree, then with this one
      bench=nsa_op.py args=${AB_ARGS:---seq-lens 8192 65536}
      [[ $part == ab-model ]] && bench=model_step.py args=${AB_ARGS:---seq-lens 2048 16384}
      base=.ab/${AB_BASE:-base}
      step "$part-base" "${AB_S:-150}" env PYTHONPATH="$PWD/$base/src:${PYTHONPATH#$PWD/src:}" python3 "$base/benchmarks/$bench" $args --json "$out/$part-base.json"
      step "$part-head" "${AB_S:-150}" python3 "benchmarks/$bench" $args --json "$out/$part-head.json" ;;
    bench) step bench "${BENCH_S:-240}" python3 benchmarks/nsa_op.py --json "$out/nsa_op.json" ;;
    gqa)
      step gqa-g4 90 python3 benchmarks/nsa_op.py --heads 16 --kv-heads 4 --seq-lens 8192 65536 --json "$out/g4.json"
      step gqa-g6 90 python3 benchmarks/nsa_op.py --heads 12 --kv-heads 2 --head-dim 64 --seq-lens 8192 65536 --json "$out/g6.json" ;;
    host)
      step step-host 150 python3 benchmarks/step_host.py --seq-len 2048 --batch 8 --kernels 20
      step nsa-host 60 python3 benchmarks/nsa_host.py --heads 12 --kv-heads 2 --head-dim 64 --seq-lens 2048 --top 25 ;;
    model) step model "${MODEL_S:-200}" python3 benchmarks/model_step.py ${MODEL_ARGS:---seq-lens 2048 16384} --json "$out/model.json" ;;
  esac
done
echo; printf '%s\n' "${rows[@]}"
