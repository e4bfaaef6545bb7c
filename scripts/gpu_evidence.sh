#!/usr/bin/env bash
# Issue 8: every experiment of the field reports (../shared/seeds/) re-run with nsa-diag on the GPU machine,
# one step per experiment, each named after its seed report and experiment (seed000 ... seed004; the
# `seedNNN` is the file's number). Parts sized so that each fits one device call (600 s) on an H100:
#
#   part1  branch isolation and backends (seeds 000, 002, 001 phase 3): `branch` at 5 layers (S=128, 512),
#          `backend` sweeps of sel, cmp and win against the reference, the selection backends' memory at
#          S=512..2048, profiler + memory snapshot, anomaly + CUDA_LAUNCH_BLOCKING, the backward-hook run
#   part2  scaling (seeds 000, 001, 002): `scale` over S=128..2048 at 5 layers (the seeds' masked
#          backends and the default ones), layers 4..10 at S=512, S=32..512 x layers 4..6 (the ">= 5
#          layers" threshold), and the memory estimator at 5 and 12 layers
#   part3  production and settings (seeds 001, 000, 002, 004): m7c-125m (12 layers, dim 768, S=2048) in
#          bf16 and fp32, allocator settings each against the default with `compare`, 6 steps with
#          sequential vs batched prefill (the "step 5" story), fp16 + GradScaler vs bf16 over 20 steps,
#          `verify --only prefill`, the one-layer single-branch "toy"
#   part4  checkpointing, CPU and hang evidence (seed 003): `gc-bisect` (gc all), the seeds' ranges 0:6 and
#          6:12, `gc-bisect --grads`, `verify --only gc`, the seeds' CPU runs (2 layers, S=512), `selftest`
#          of the hang kinds whose stacks the seeds never got
#   part5  long sequences and the seeds' plan as a matrix (seeds 000, 001, 002): `scale` to S=64k with the
#          Triton backends at 5 and 12 layers, `matrix backward`
#   ddp    DDP, only with 2 GPUs (seeds 003, 004): one step on NCCL with the bucket trace, the same with
#          TORCH_DISTRIBUTED_DEBUG=DETAIL, gloo, each branch alone, static graph, find-unused, both, a
#          parameter without gradient, 6 production steps
#   all    every part in turn (over 30 minutes: not for one device call)
#
# Expected time on one H100 (about 10-12 s a case, most of it the worker's start-up): part1 ~6-7 min,
# part2 ~7 min, part3 ~5-6 min, part4 ~6 min, part5 ~7-8 min (the matrix takes what is left), ddp ~4-5 min
# on two. Each part stops starting steps when its budget (below) is spent, so a call ends before 600 s.
#
#   device: kind nvidia-h100-x1 (nvidia-h100-x2 for ddp), carry [".whl"],
#           command: bash scripts/gpu_evidence.sh part1        (then part2 ... part5, ddp)
#
# At the end of a part: `nsa-diag report` on every run folder of the part, a table (step, rc, seconds) and
# into $OUT (the device call returns at most 8 files): evidence-<part>-summary.txt,
# evidence-<part>-logs.tgz (one log per step, its command line first; rewritten after every step, so a
# call cut short keeps what ran), evidence-<part>-runs.tgz (summaries, results, specs, reports and PNGs,
# scale/bisect/matrix JSON, compare markdown, stacks and other hang evidence), and for part1
# evidence-<part>-profile.tgz (Chrome trace, memory timeline, memory snapshot, as far as 15 MiB allow).
# Every step has a time limit, cut to what is left of the part's budget (BUDGET, default 540 s, of which
# RESERVE, 45 s, is kept for the reports and the archives); a step that no longer fits is listed as not run.
#
# ONLY="NAME NAME ..." runs just those steps of the part(s) (a rerun of what a budget cut off).
#
# Expected rc other than 0: seed003-gc-bisect-full 1 (the case passes with gc all: nothing to bisect),
# seed003-ddp-missing-params 1 (grad-missing, by injection); any compare 1 means a case got worse.
#
# Checks without a GPU (what was run before this script was handed over):
#   EVIDENCE_CHECK=parse PYTHON=.venv/bin/python bash scripts/gpu_evidence.sh all
#       every nsa-diag command line exactly as on the GPU but with --device cpu (and gloo for nccl), stopped
#       after PARSE_S (6) seconds: nsa-diag validates options, geometry and faults before anything runs, so
#       exit 2 (bad option or configuration) comes at once; `timed out` means it had started: valid.
#   EVIDENCE_CHECK=cpu PYTHON=.venv/bin/python bash scripts/gpu_evidence.sh all
#       every step run to the end on the CPU at tiny sizes (preset tiny, S 64/128, 1-2 layers, Triton
#       through TRITON_INTERPRET=1); the command lines are otherwise the same.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
parts=(part1 part2 part3 part4 part5 ddp)
if [[ ! " ${parts[*]} all " == *" $part "* ]]; then
  echo "usage: bash scripts/gpu_evidence.sh {$(IFS='|'; echo "${parts[*]}")|all}" >&2
  exit 2
fi
CHECK=${EVIDENCE_CHECK:-}
case $CHECK in '' | parse | cpu) ;; *) echo "EVIDENCE_CHECK=$CHECK: parse or cpu" >&2; exit 2 ;; esac
BUDGET=${BUDGET:-540}
RESERVE=${RESERVE:-45}
PARSE_S=${PARSE_S:-6}
PY=${PYTHON:-python3}

out=${OUT:-/tmp/nsa-evidence/out}
work=/tmp/nsa-evidence/$part${CHECK:+-check-$CHECK}
logs=$work/logs runs=$work/runs
rm -rf "$work"
mkdir -p "$out" "$logs" "$runs"
if [[ -z $CHECK ]]; then
  source scripts/gpu_env.sh  # the carried wheels into /tmp/site; PYTHONPATH with src; unbuffered output
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
fi
[[ $CHECK ]] && export TRITON_INTERPRET=1  # the Triton kernels on the CPU, through the interpreter
diag=("$PY" -m nsa_diag)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
card=${card:-no GPU}

declare -a rows=()
invalid=0
part_end=$((SECONDS + BUDGET - RESERVE))

check_args() {  # check_args COMMAND...: the command for EVIDENCE_CHECK, in the array A
  local a prev=""
  A=()
  for a in "$@"; do
    case $prev in
      --device) a=cpu ;;
      --backend) [[ $a == nccl ]] && a=gloo ;;
    esac
    if [[ $CHECK == cpu ]]; then
      case $prev in
        --preset) a=tiny ;;
        --seq-len) a=64 ;;
        --seq-lens) a=64,128 ;;
        --layers) if [[ $a == *,* ]]; then a=1,2; elif ((a > 2)); then a=2; fi ;;
        --gc) if [[ $a == 0:* ]]; then a=0:1; elif [[ $a == *:* ]]; then a=1:2; fi ;;
        --inject) a=$(sed -E 's/layer=[0-9]+/layer=1/' <<<"$a") ;;
        --steps) ((a > 3)) && a=3 ;;
      esac
    fi
    A+=("$a")
    prev=$a
  done
}

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to $logs/NAME.log, remember rc and time
  local name=$1 limit=$2; shift 2
  if [[ -n ${ONLY:-} && " $ONLY " != *" $name "* && $name != report-* && $name != env-* ]]; then
    return  # ONLY="step names": just those (and the reports of what ran)
  fi
  local left=$((part_end - SECONDS)) start=$SECONDS
  if ((left < 20)); then
    rows+=("$(printf '%-46s rc=%-3s %5ss  %s' "$name" "-" 0 "not run: the part's budget is spent")")
    echo "=== $name: not run (budget spent)"
    return
  fi
  ((limit > left)) && limit=$left
  local -a cmd=("$@")
  if [[ $CHECK ]]; then
    check_args "$@"
    cmd=("${A[@]}")
    [[ $CHECK == parse ]] && limit=$PARSE_S
  fi
  echo "=== $name (limit ${limit} s): ${cmd[*]}"
  { printf '$'; printf ' %q' "${cmd[@]}"; printf '\n'; } >"$logs/$name.log"
  timeout -s INT -k 20 "$limit" "${cmd[@]}" >>"$logs/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$logs/$name.log" | cut -c1-160
  local what
  what=$(grep -aE '\((not )?all ok\)|^gc-bisect:|^ddp: |common case|^report: |^nsa-diag: ' "$logs/$name.log" | tail -n 1 | cut -c1-90)
  if [[ -z $what ]]; then  # scale prints no count line: count the verdicts of its points
    what=$(grep -aoE '^\[[0-9]+/[0-9]+\] [^ ]+: [a-z-]+ in ' "$logs/$name.log" | awk '{print $3}' | sort | uniq -c \
      | awk '{printf "%s%d %s", sep, $1, $2; sep = ", "}')
  fi
  if [[ $CHECK == parse ]]; then  # 124: still running at PARSE_S, so every check before the run passed
    if ((rc == 2 || rc == 3)); then what="INVALID: $what"; invalid=$((invalid + 1)); else what="valid${what:+: $what}"; fi
  elif [[ $CHECK == cpu ]] && ((rc >= 2)); then
    what="FAILED: $what"; invalid=$((invalid + 1))
  fi
  rows+=("$(printf '%-46s rc=%-3s %5ss  %s' "$name" "$rc" "$((SECONDS - start))" "$what")")
  tar -czf "$out/evidence-$part-logs.tgz" -C "$logs" .  # after every step, so a call cut short keeps what ran
}

tagged() {  # tagged NAME SECONDS COMMAND...: step, with the run folder in $runs tagged NAME
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" "$@" --out "$runs" --tag "$name"
}

ds() {  # ds NAME SECONDS SUBCOMMAND ARGS...: an nsa-diag command into $runs, its run folder tagged NAME
  local name=$1 limit=$2; shift 2
  tagged "$name" "$limit" "${diag[@]}" "$@"
}

rundir() {  # rundir TAG: the run folder of the step TAG (empty when it did not run)
  local d found=""
  for d in "$runs"/*-"$1"; do [[ -d $d ]] && found=$d; done
  printf '%s' "$found"
}

compare() {  # compare NAME TAG_A TAG_B: `nsa-diag compare` of two steps' run folders, markdown beside them
  local name=$1 a b
  a=$(rundir "$2") b=$(rundir "$3")
  if [[ -z $a || -z $b ]]; then
    rows+=("$(printf '%-46s rc=%-3s %5ss  %s' "$name" "-" 0 "not run: no run folder of $2 or $3")")
    return
  fi
  step "$name" 60 "${diag[@]}" compare "$a" "$b" --out "$runs/$name.md"
}

# The Triton backends, named (on CUDA they are also what a case runs where it names no backend)
triton=(--sel triton --cmp triton --win triton)

cuda=(--device cuda)
m7c5=(--preset m7c-125m --layers 5 --batch 1 "${cuda[@]}")     # the seeds' 5-layer repro (dim 768, GQA 12/2)
prod=(--preset m7c-125m --seq-len 2048 --batch 1 "${cuda[@]}")  # production: 12 layers, dim 768, S=2048
scale_m7c=(--preset m7c-125m "${cuda[@]}")                      # scale: batch 1 by default, --layers is a list

part1() {  # branch isolation, backends, introspection: ~26 cases, about 7 minutes
  # 002 A.1 (the plan's 5-layer repro at S=128) and 000 "Branch Isolation" (S=512, dim 768, 5 layers):
  # each branch truly alone (the seeds' NSA_FORCE_BRANCH still ran every branch), then all
  ds seed002-branch-isolation-5L-S128 120 branch "${m7c5[@]}" --seq-len 128
  ds seed000-branch-isolation-5L 120 branch "${m7c5[@]}" --seq-len 512
  # 002 A.2-A.4: backend sweeps, each branch alone, loss and every gradient against the reference backends
  # (the seeds' "parity" path); S=128 keeps the per-token reference at seconds
  ds seed002-sel-backend-sweep 150 backend "${m7c5[@]}" --seq-len 128 --sel masked,packed,gather,triton
  ds seed002-cmp-backend-sweep 90 backend "${m7c5[@]}" --seq-len 128 --cmp masked,triton
  ds seed002-win-backend-sweep 90 backend "${m7c5[@]}" --seq-len 128 --win masked,chunked,triton
  # 001 phase 3 ("no memory advantage between backends at S=2048"): the whole 5-layer model per selection
  # backend over S=512..2048, so the fit shows how each grows (parity at S=2048 would need the per-token
  # reference over 10k token-layers: minutes; the sweeps above give the parity)
  local sel
  for sel in masked packed gather triton; do
    ds "seed001-sel-backend-memory-$sel" 100 scale "${scale_m7c[@]}" --layers 5 --seq-lens 512,1024,2048 --sel "$sel"
  done
  # 000 "Diagnostic Tests" at S=512 and 002 B.6, B.7, C.9: profiler with the memory timeline and a CUDA
  # memory snapshot; autograd anomaly detection with CUDA_LAUNCH_BLOCKING=1; the backward-hook run (the
  # seeds' --hooks): every block's and branch's backward begin/end is in cases/hooks/progress.jsonl
  ds seed000-profiler 150 run "${m7c5[@]}" --seq-len 512 --profile --memory-snapshot --name profile
  ds seed000-anomaly-blocking 150 run "${m7c5[@]}" --seq-len 512 --anomaly --launch-blocking --name anomaly
  ds seed000-backward-hooks 90 run "${m7c5[@]}" --seq-len 512 --name hooks
}

part2() {  # scaling: 33 points, about 7 minutes
  # 000 "Memory Scaling" (483 MB at 128 to 20.5 GB at 2048, "O(S^2) confirmed"), 5 layers: with the
  # dense-mask backends the seeds ran, then with the default ones (Triton on CUDA); exponent, estimate, OOM length
  ds seed000-seq-scaling-5L-masked 180 scale "${scale_m7c[@]}" --layers 5 --seq-lens 128,256,512,1024,2048 --sel masked --win masked
  ds seed000-seq-scaling-5L 180 scale "${scale_m7c[@]}" --layers 5 --seq-lens 128,256,512,1024,2048
  # 000 "Layer Scaling" at S=512: 4, 5, 6, 8, 10 layers (scale's layer series runs at the preset's S, 2048,
  # so S=512 takes one point per layer count: verdict, memory and estimate each)
  ds seed000-layer-scaling-S512 180 scale "${scale_m7c[@]}" --seq-lens 512 --layers 4,5,6,8,10
  # 002 B.5: does the ">= 5 layers" threshold move with S? S=32..512 x 4..6 layers
  ds seed002-seq-x-layers-threshold 240 scale "${scale_m7c[@]}" --seq-lens 32,64,128,512 --layers 4,5,6
  # 001 phases 2 and 5: 5 layers at S=512..2048 and the 12-layer model, the estimator's error per point
  # (the seeds' estimator was off by -71% at S=512); 2 steps, so AdamW's moments are in the peak
  ds seed001-scaling-estimator-5L-12L 200 scale "${scale_m7c[@]}" --layers 5,12 --seq-lens 512,1024,2048 --steps 2
}

part3() {  # production, allocator, prefill, dtype: 18 cases + 5 comparisons, about 5-6 minutes
  # 001 phase 4: the production configuration (the seeds: 49 GB, 224 s), bf16 and fp32, 3 steps
  ds seed001-production-12L-S2048-bf16 120 run "${prod[@]}" --dtype bf16 --steps 3 --name prod
  ds seed001-production-12L-S2048-fp32 150 run "${prod[@]}" --dtype fp32 --steps 3 --name prod
  # 001 "Production Settings": the allocator setting the seeds recommended, against the bf16 run above
  ds seed001-production-alloc-recommended 120 run "${prod[@]}" --dtype bf16 --steps 3 --name prod \
    --alloc-conf expandable_segments:True,max_split_size_mb:256
  compare compare-seed001-production-alloc seed001-production-12L-S2048-bf16 seed001-production-alloc-recommended
  # 000 "Allocator Sensitivity" (S=1024, 5 layers) and 002 B.8 (max_split_size_mb:64 + expandable).
  # 003 phase 6, the PyTorch 2.4.1 vs 2.5.1 A/B, cannot run here: the machine has one torch (2.11) and no
  # network to install another. `nsa-diag compare` is the tool for that A/B (two venvs, one tag each);
  # here it compares two runs that differ by their allocator setting instead, the same way it would
  # compare two torch versions: environment differences, verdicts, memory and time ratios.
  ds seed000-allocator-default-S1024 90 run "${m7c5[@]}" --seq-len 1024 --name alloc
  ds seed000-allocator-expandable-S1024 90 run "${m7c5[@]}" --seq-len 1024 --name alloc --alloc-conf expandable_segments:True
  ds seed002-allocator-split64-expandable 90 run "${m7c5[@]}" --seq-len 1024 --name alloc \
    --alloc-conf max_split_size_mb:64,expandable_segments:True
  compare compare-seed000-allocator seed000-allocator-default-S1024 seed000-allocator-expandable-S1024
  compare compare-seed002-allocator seed000-allocator-default-S1024 seed002-allocator-split64-expandable
  # 004 "step 5 barrier": 6 steps with sequential prefill (token by token through the decode cache) and
  # with batched; 5 layers at S=256 keep sequential (1,280 layer-token decodes a forward) within minutes
  ds seed004-step5-sequential-prefill 240 run --preset m7c-125m --layers 5 --seq-len 256 --batch 1 "${cuda[@]}" \
    --dtype bf16 --steps 6 --prefill sequential --timeout 200 --name prefill
  ds seed004-step5-batched-prefill 90 run --preset m7c-125m --layers 5 --seq-len 256 --batch 1 "${cuda[@]}" \
    --dtype bf16 --steps 6 --prefill batched --name prefill
  compare compare-seed004-prefill seed004-step5-batched-prefill seed004-step5-sequential-prefill
  # 004 "NaN in fp16 after step 1" (GradScaler) vs bf16 "stable": 20 production steps each
  ds seed004-fp16-gradscaler 120 run "${prod[@]}" --dtype fp16 --steps 20 --name dtype
  ds seed004-bf16 120 run "${prod[@]}" --dtype bf16 --steps 20 --name dtype
  compare compare-seed004-dtype seed004-bf16 seed004-fp16-gradscaler
  # 004 root cause "_forward_prefill_sequential accumulates state": batched == sequential == decode
  ds seed004-verify-prefill 120 verify --preset m7c-125m "${cuda[@]}" --dtype bf16 --only prefill
  # 002 C.10, the "minimal single-branch toy": one layer, each branch alone
  ds seed002-toy-single-layer-branches 120 branch --preset m7c-125m --layers 1 --seq-len 128 --batch 1 "${cuda[@]}"
}

part4() {  # checkpointing, CPU, hang evidence: ~24 cases, about 6 minutes
  # 003 phase 5, GC bisection on the production model (bf16): all layers (passes: "nothing to bisect",
  # rc 1), the seeds' halves 0:6 and 6:12, then each single layer's gradients against no checkpointing
  ds seed003-gc-bisect-full 120 gc-bisect "${prod[@]}" --dtype bf16 --gc all
  ds seed003-gc-range-0-6 90 run "${prod[@]}" --dtype bf16 --gc 0:6 --name gc
  ds seed003-gc-range-6-12 90 run "${prod[@]}" --dtype bf16 --gc 6:12 --name gc
  ds seed003-gc-bisect-grads 240 gc-bisect "${prod[@]}" --dtype bf16 --grads
  ds seed003-verify-gc 120 verify --preset m7c-125m "${cuda[@]}" --dtype bf16 --only gc
  # 003 "CPU Validation": the m7c-125m config with 2 layers at S=512 "hangs @30s" in every branch and with
  # full GC; here on the GPU machine's CPUs, under the watchdog (hang or slow, with stacks)
  ds seed003-cpu-branch-2L-S512 150 branch --preset m7c-125m --layers 2 --seq-len 512 --batch 1 --device cpu
  ds seed003-cpu-gc-full-2L-S512 90 run --preset m7c-125m --layers 2 --seq-len 512 --batch 1 --device cpu --gc all --name cpu-gc
  # 003 "Timeout handling: SIGUSR1 -> stack dump" and 002's "nvidia-smi around hang": a Python deadlock,
  # a GIL-holding C call and a spinning kernel, each detected, classified and dumped before the kill
  ds seed003-hang-evidence-selftest 150 selftest "${cuda[@]}" --kinds deadlock,gil-hog,gpu-spin
}

part5() {  # long sequences with Triton, the seeds' plan as a matrix: about 7 minutes
  # 000/001 "O(S^2) scaling persists - careful with sequence length": S to 64k with the Triton backends
  # (every branch O(S)), 5 and 12 layers, bf16; a point that runs out of memory ends its series as oom
  ds seed000-seq-scaling-triton-64k 330 scale "${scale_m7c[@]}" "${triton[@]}" --layers 5,12 \
    --seq-lens 2048,4096,8192,16384,32768,65536 --dtype bf16 --steps 2
  # 001 phase 1 ("16 configurations ... 100% PASS") and 002's whole plan: the backward matrix, 32 cases
  # (last: it gets what is left of the part; an interrupted matrix continues with --resume RUN_DIR)
  ds seed001-backward-matrix 280 matrix backward --jobs 4
}

ddp() {  # DDP on the 2 GPUs: 11 cases, about 4-5 minutes
  if ((gpus < 2)) && [[ -z $CHECK ]]; then
    rows+=("$(printf '%-46s rc=%-3s %5ss  %s' "ddp" "-" 0 "not run: $gpus GPU(s) here, ddp needs 2")")
    return
  fi
  local nccl=(ddp --nproc 2 --backend nccl "${prod[@]}" --dtype bf16)
  # 003 phase 1: one step on NCCL with the bucket trace (only step 1, as the seeds insisted), the seeds'
  # allocator setting and NCCL_DEBUG=INFO (in ranks/<r>/stderr.log); gradient arrival per parameter and
  # rank is in the result
  tagged seed003-ddp-onestep-nccl-trace 120 env NCCL_DEBUG=INFO "${diag[@]}" "${nccl[@]}" \
    --steps 1 --trace-buckets --alloc-conf expandable_segments:True,max_split_size_mb:256
  # ... and the seeds' TORCH_DISTRIBUTED_DEBUG=DETAIL, apart: with torch 2.13 on the CPU (gloo) it kills
  # every rank with SIGSEGV inside DDP's constructor (set_construction_data_and_log), nsa-diag or not
  tagged seed003-ddp-onestep-debug-detail 120 env TORCH_DISTRIBUTED_DEBUG=DETAIL "${diag[@]}" "${nccl[@]}" --steps 1
  # 003 phase 2: the same step on gloo (CUDA tensors)
  tagged seed003-ddp-onestep-gloo 150 "${diag[@]}" ddp --nproc 2 --backend gloo "${prod[@]}" --dtype bf16 --steps 1
  # 003 phase 3: branch isolation at 12 layers x 2048 on 2 GPUs
  local branch
  for branch in cmp sel win; do
    tagged "seed003-ddp-branch-$branch" 120 "${diag[@]}" "${nccl[@]}" --steps 1 --branch "$branch"
  done
  # 003 phase 4 ("static_graph with find_unused_parameters=True"): static graph, find-unused, and both
  tagged seed003-ddp-static-graph 120 "${diag[@]}" "${nccl[@]}" --steps 2 --static-graph
  tagged seed003-ddp-find-unused 120 "${diag[@]}" "${nccl[@]}" --steps 2 --find-unused
  tagged seed003-ddp-static-graph-find-unused 120 "${diag[@]}" "${nccl[@]}" --steps 2 --static-graph --find-unused
  # 003 "MISSING: blocks.4.attn.gate_mlp.weight": a parameter of block 4 left without gradient on purpose,
  # named with its rank (rc 1, grad-missing)
  tagged seed003-ddp-missing-params 120 "${diag[@]}" "${nccl[@]}" --steps 1 --inject unused-param:layer=4
  # 004 "A100 production": torchrun on 2 GPUs, bf16, batched prefill, past step 5; tokens/s per rank
  tagged seed004-ddp-prod-bf16-batched 150 "${diag[@]}" "${nccl[@]}" --steps 6 --prefill batched
}

finish() {  # reports of every run folder, the archives, the table
  part_end=$((part_end + RESERVE - 10))
  local d base
  for d in "$runs"/*/; do
    d=${d%/}
    [[ -d $d/cases && ! -f $d/report.md ]] || continue
    base=${d##*/}
    step "report-${base#*-*-}" 60 "${diag[@]}" report "$d"
  done
  local keep=(-name 'summary.*' -o -name env.json -o -name spec.json -o -name result.json -o -name worker_result.json
    -o -name memory_stats.json -o -name 'report*.md' -o -name '*.png' -o -name scale.json -o -name bisect.json
    -o -name matrix.json -o -name 'compare-*.md' -o -name stacks.txt -o -name pyspy.txt -o -name gpu.json
    -o -name nvidia-smi.txt -o -name proc.json -o -name replay.sh -o -name '*flight_recorder*'
    -o \( \( -name stderr.log -o -name stdout.log \) -size -1024k \))
  (cd "$runs" && find . -type f \( "${keep[@]}" -o \( -name progress.jsonl -size -2048k \) \) -print0 \
    | tar --null -czf "$out/evidence-$part-runs.tgz" -T -)
  if (($(stat -c %s "$out/evidence-$part-runs.tgz") > 15 << 20)); then  # the device returns 16 MiB a file
    (cd "$runs" && find . -type f \( "${keep[@]}" \) ! -name replay.sh -print0 \
      | tar --null -czf "$out/evidence-$part-runs.tgz" -T -)
  fi
  # the profiler's files, as many as fit in 15 MiB: all three, else without the snapshot, else the timeline
  local names files n
  local -a find_names
  for names in "trace.json memory_timeline.html memory_snapshot.pickle" "trace.json memory_timeline.html" \
    "memory_timeline.html" ""; do
    if [[ -z $names ]]; then
      rows+=("profile: even the memory timeline alone is over 15 MiB compressed; not returned")
      break
    fi
    find_names=()
    for n in $names; do find_names+=(-o -name "$n"); done
    files=$(cd "$runs" && find . -type f \( "${find_names[@]:1}" \) | head -n 50)
    [[ -n $files ]] || break
    # shellcheck disable=SC2086  # run-folder paths: no blanks
    (cd "$runs" && tar -czf "$out/evidence-$part-profile.tgz" $files)
    (($(stat -c %s "$out/evidence-$part-profile.tgz") <= 15 << 20)) && break
    rm -f "$out/evidence-$part-profile.tgz"
  done
  {
    echo "=== evidence $part ($card x$gpus, $(date -u +%F)${CHECK:+, check: $CHECK})"
    printf '%s\n' "${rows[@]}"
  } | tee "$out/evidence-$part-summary.txt"
  tar -czf "$out/evidence-$part-logs.tgz" -C "$logs" .
}

run_part() {
  local p=$1
  part_end=$((SECONDS + BUDGET - RESERVE))
  rows+=("--- $p")
  step "env-$p" 60 "${diag[@]}" env
  "$p"
}

echo "=== gpu_evidence $part on $card x$gpus (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null))"
nvidia-smi >"$logs/nvidia-smi.txt" 2>&1 || true
if [[ $part == all ]]; then
  for p in "${parts[@]}"; do
    run_part "$p"
    finish
  done
else
  run_part "$part"
  finish
fi
if [[ $CHECK ]]; then
  echo "check $CHECK: $invalid step(s) $([[ $CHECK == parse ]] && echo invalid || echo failed)"
  ((invalid == 0))
fi
