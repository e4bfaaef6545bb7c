"""`make gpu-smoke`'s real jobs: scripts written as users write them (tests/diag/jobs/, nothing of nsa_diag
imported), under `nsa-diag watch` and `attach` on this machine's GPUs, each with the verdict a person who
knows the job would give. Prints one line per job and exits 1 when one is wrong.

- per-token: a transformer whose attention loops over sequences, tokens and heads (a naive sparse-attention
  reference) at S=2048, under `watch --stall 60`: one layer's forward outlasts the stall while the GPU
  keeps working, so the verdict is `slow` (the liveness signals), never `hang`. The batch is chosen from
  a short calibration run so that a layer's forward takes about 2 minutes.
- ddp-unused (2+ GPUs): a DDP model with a head the loss never uses, on NCCL: `grad-missing`, the head's
  parameters named.
- attach-nccl (2+ GPUs): a 2-rank NCCL job stuck because rank 1's prefetch thread died (rank 1 waits for
  a batch, rank 0 in the barrier), attached to with py-spy: `stalled`, the minority rank (1) named.
- compiled: a loop that torch.compiles its model with inductor on the GPU, from an empty cache, under
  `watch --stall 60`: `pass` with its 5 steps, and Dynamo's own count of graph breaks 0 (the probe forces
  none).
- fsdp2: an FSDP2 job (fully_shard per block) on NCCL, one rank per GPU (at most 2): `pass` with its 5
  steps; with 2+ GPUs again with rank 1's batch read blocked at step 3: `hang (collective)`, rank 1 the
  minority, at its read.

Usage: python3 scripts/gpu_smoke_jobs.py OUT_DIR [NSA_DIAG...]   (NSA_DIAG default: python3 -m nsa_diag;
GPU_SMOKE_JOBS=per-token,compiled,fsdp2,ddp-unused,attach-nccl picks checks)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "tests" / "diag" / "jobs"
PY = sys.executable
TARGET_LAYER_S = 120.0  # the per-token job's layer forward: twice the stall
HEADS = 12


def _gpus() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _result(out: Path) -> dict:
    (path,) = out.glob("*/cases/*/result.json")
    return json.loads(path.read_text())


def _torchrun(*args: str, ranks: int = 2) -> list[str]:
    found = shutil.which("torchrun") or str(Path(PY).parent / "torchrun")
    return [found, "--standalone", "--nproc-per-node", str(ranks), *args]


def calibrate_batch() -> int:
    """The batch at which one layer's forward of the per-token job takes about `TARGET_LAYER_S` at S=2048:
    one forward at S=256, batch 1, times the loop's iterations (sequences x tokens x heads)."""
    code = (
        "import sys, time, torch; sys.path.insert(0, sys.argv[1]); import per_token_layer as p; "
        f"m = p.LoopAttention(768, {HEADS}, True).cuda(); x = torch.randn(1, 256, 768, device='cuda'); "
        "m(x); torch.cuda.synchronize(); t = time.perf_counter(); m(x); torch.cuda.synchronize(); "
        "print(time.perf_counter() - t)"
    )
    seconds = float(
        subprocess.run([PY, "-c", code, str(JOBS)], capture_output=True, text=True, check=True).stdout
    )
    per_iteration = seconds / (256 * HEADS)
    return max(1, math.ceil(TARGET_LAYER_S / (per_iteration * 2048 * HEADS)))


def per_token(diag: list[str], out: Path) -> tuple[bool, str]:
    batch = calibrate_batch()
    job = [PY, "per_token_layer.py", "--seq-len", "2048", "--dim", "768", "--heads", str(HEADS),
           "--layers", "4", "--per-head", "--batch", str(batch), "--device", "cuda"]  # fmt: skip
    subprocess.run([*diag, "watch", "--stall", "60", "--timeout", "200", "--out", str(out), "--", *job],
                   cwd=JOBS, capture_output=True, check=False)  # fmt: skip
    r = _result(out)
    ok = r["verdict"] == "slow" and "still working" in r["reason"] and "pauses" not in r["evidence"]
    return ok, f"batch {batch}: {r['verdict']}: {r['reason'][:300]}"


def ddp_unused(diag: list[str], out: Path) -> tuple[bool, str]:
    job = _torchrun("ddp_unused_param.py", "--nccl")
    subprocess.run(
        [*diag, "watch", "--out", str(out), "--", *job], cwd=JOBS, capture_output=True, check=False
    )
    r = _result(out)
    ok = r["verdict"] == "grad-missing" and set(r["missing_grads"]) == {"aux_head.weight", "aux_head.bias"}
    return ok, f"{r['verdict']} {r['missing_grads']}: {r['reason'][:300]}"


def attach_nccl(diag: list[str], out: Path) -> tuple[bool, str]:
    """attach (with py-spy) to a 2-rank NCCL job whose rank 1 waits forever for a batch from a prefetch
    thread that died, while rank 0 waits in a barrier: stalled, rank 1 the minority."""
    job = subprocess.Popen(
        _torchrun("nccl_prefetch_dies.py"), cwd=JOBS, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        time.sleep(40)  # both ranks past their start-up and stuck at step 3 since
        proc = subprocess.run([*diag, "attach", str(job.pid), "--out", str(out), "--json"],
                              capture_output=True, text=True, check=False)  # fmt: skip
        record = json.loads(proc.stdout) if proc.stdout.strip() else {}
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    state, reason = record.get("state"), record.get("reason", proc.stderr[-300:])
    ok = state == "stalled" and "minority rank(s) 1" in reason
    return ok, f"{state} ({record.get('hang_kind')}): {reason[:400]}"


def compiled(diag: list[str], out: Path) -> tuple[bool, str]:
    cache = str(out) + "-inductor-cache"  # empty: inductor compiles from nothing, as on a first run
    env = {**os.environ, "COMPILE_BACKEND": "inductor", "TORCHINDUCTOR_CACHE_DIR": cache}
    job = [PY, "compiled_loop.py", "--device", "cuda"]
    proc = subprocess.run([*diag, "watch", "--stall", "60", "--out", str(out), "--", *job],
                          cwd=JOBS, capture_output=True, text=True, env=env, check=False)  # fmt: skip
    r = _result(out)
    breaks = next((line for line in proc.stdout.splitlines() if line.startswith("graph breaks")), "no count")
    ok = r["verdict"] == "pass" and r["steps_done"] == 5 and breaks == "graph breaks 0"
    return ok, f"{r['verdict']}, {r['steps_done']} steps, {breaks}: {r['reason'][:300]}"


def fsdp2(diag: list[str], out: Path) -> tuple[bool, str]:
    ranks = min(_gpus(), 2)
    texts, ok = [], True
    for stuck in [-1, 1] if ranks == 2 else [-1]:
        job = _torchrun("fsdp2_stuck_rank.py", "--device", "cuda", "--stuck-rank", str(stuck), ranks=ranks)
        folder = out / ("healthy" if stuck < 0 else "rank-1-stuck")
        subprocess.run([*diag, "watch", "--stall", "10", "--out", str(folder), "--", *job], cwd=JOBS,
                       capture_output=True, check=False)  # fmt: skip
        r = _result(folder)
        if stuck < 0:
            ok &= r["verdict"] == "pass" and r["steps_done"] == 5
        else:
            ok &= (r["verdict"], r["hang_kind"]) == ("hang", "collective")
            ok &= r["evidence"].get("minority_ranks") == [1] and "in read_batch" in r["reason"]
        verdict = f"{r['verdict']} ({r.get('hang_kind')})"
        texts.append(f"{ranks} rank(s), stuck {stuck}: {verdict}: {r['reason'][:200]}")
    return ok, " | ".join(texts)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("nsa-diag-runs") / "gpu-smoke-jobs"
    diag = sys.argv[2:] or [PY, "-m", "nsa_diag"]
    checks = [("per-token", per_token), ("compiled", compiled), ("fsdp2", fsdp2)]
    if _gpus() >= 2:
        checks += [("ddp-unused", ddp_unused), ("attach-nccl", attach_nccl)]
    only = [name for name in os.environ.get("GPU_SMOKE_JOBS", "").split(",") if name]
    checks = [(name, check) for name, check in checks if not only or name in only]
    failed = 0
    for name, check in checks:
        start = time.monotonic()
        try:
            ok, text = check(diag, (out / name).resolve())
        except Exception as exc:  # one check's failure must not hide the others'
            ok, text = False, f"{type(exc).__name__}: {exc}"
        failed += not ok
        print(f"{name:12s} {'ok' if ok else 'WRONG':5s} {time.monotonic() - start:5.0f}s  {text}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
