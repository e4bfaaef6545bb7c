#!/usr/bin/env bash
# The first failures of the Triton tests at real sizes, with short tracebacks: one test per file/kind, -x.
#   device: kind nvidia-h100-x1, carry [".whl"], command: bash scripts/gpu_triton_diag.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-triton-diag-out}
mkdir -p "$out"
source scripts/gpu_env.sh
run() {  # run NAME SECONDS PYTEST-ARGS...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout -s INT -k 10 "$limit" python3 -m pytest -q -x -p no:cacheprovider --tb=short "$@" > "$out/$name.log" 2>&1
  echo "rc=$?"; grep -E "^E |Error|passed|failed" "$out/$name.log" | head -n 25 | cut -c1-220
}
run sel-zeros 60 "tests/core/triton/test_selection.py::test_rows_without_blocks_give_zeros"
run sel-fp32 90 tests/core/triton/test_selection.py -k "fp32 and T1000-HQ8"
run sel-strided 60 "tests/core/triton/test_selection.py::test_strided_inputs"
run cmp-bf16 90 tests/core/triton/test_compression.py -k "low_precision and T4096-HQ8-H2-D64 and bfloat16"
run cmp-t1 60 tests/core/triton/test_compression.py -k "low_precision and T1-off7"
