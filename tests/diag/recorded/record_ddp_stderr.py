"""Regenerate the recorded stderr of failing 2-rank DDP jobs that tests/diag/test_ddp_errors.py parses.

    GLOO_SOCKET_IFNAME=lo PYTHONPATH=src python tests/diag/recorded/record_ddp_stderr.py [NAME ...]

Each NAME runs a job of tests/diag/jobs/ under ``nsa-diag watch -- torchrun --standalone --nproc-per-node
2`` (gloo, CPU) and keeps the case's ``stderr.log`` (torchrun's and both ranks' stderr, as torch prints it)
as ``<name>.stderr.txt``, and in ``<name>.meta.json`` the exit code, torch's version and each rank's
``probe.json`` facts (pid, rank, and the probe's record of DDP's parameter order: ``ddp_params``,
``ddp_options``).

- ``ddp_unused``: ddp_unused_param.py, indices only ("Parameter indices which did not receive grad");
- ``ddp_unused_info``: the same under TORCH_DISTRIBUTED_DEBUG=INFO, which prints the names too
  (DETAIL would as well, but on torch 2.13 with gloo on the CPU it segfaults in DDP's constructor);
- ``ddp_unused_tee``: the same through ``torchrun --tee 3``: ``[default<N>]:[rank<N>]:`` on every line;
- ``ddp_reentrant``: ddp_reentrant_checkpoint.py (marked ready twice; rank 0 or 1 stopped by SIGTERM);
- ``early_unprefixed``: each rank raises before it joins the process group: bare tracebacks, no prefix;
- ``ddp_uneven``: ddp_uneven_data.py (rank 1's shard ends first: it exits 0, rank 0's all-reduce in the
  next backward raises "Connection closed by peer"; each rank's ``steps_done`` kept too);
- ``elastic_retry``: elastic_retry.py under ``--max-restarts 1``: rank 1 raises OSError in step 3 of the
  first attempt, torchrun restarts both ranks, which resume from the checkpoint and finish (exit 0);
- ``elastic_fail``: the same with FAIL_ALWAYS=1: rank 1 raises in both attempts (exit 1).
  Both with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (restarted gloo ranks otherwise fail to connect in about
  one run of three on torch 2.13); their meta keeps every rank process of both attempts (``procs``, with
  ``restart_count``).

``ddp_interleaved.stderr.txt`` is made from ``ddp_unused_tee``'s: the two ranks' blocks merged line by line
(the tee's threads, or ranks writing line by line, interleave so; a recorded run rarely shows it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOBS = HERE.parent / "jobs"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
EARLY_JOB = """import os

rank = int(os.environ["RANK"])
with open(f"data/shard-{rank}.bin", "rb") as f:  # no such file
    f.read()
"""
RUNS = {
    "ddp_unused": (["ddp_unused_param.py"], {}),
    "ddp_unused_info": (["ddp_unused_param.py"], {"TORCH_DISTRIBUTED_DEBUG": "INFO"}),
    "ddp_unused_tee": (["--tee", "3", "ddp_unused_param.py"], {}),
    "ddp_reentrant": (["ddp_reentrant_checkpoint.py"], {}),
    "early_unprefixed": (["early_unprefixed.py"], {}),
    "ddp_uneven": (["ddp_uneven_data.py"], {}),
    "elastic_retry": (
        ["--max-restarts", "1", "elastic_retry.py"],
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    ),
    "elastic_fail": (
        ["--max-restarts", "1", "elastic_retry.py"],
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FAIL_ALWAYS": "1"},
    ),
}


def record(name: str) -> None:
    args, env = RUNS[name]
    with tempfile.TemporaryDirectory() as tmp:
        cwd = JOBS
        if name == "early_unprefixed":
            cwd = Path(tmp)
            (cwd / "early_unprefixed.py").write_text(EARLY_JOB)
        out = Path(tmp) / "runs"
        cmd = [sys.executable, "-m", "nsa_diag", "watch", "--out", str(out), "--", TORCHRUN, "--standalone",
               "--nproc-per-node", "2", *args]  # fmt: skip
        run_env = {**os.environ, **env, "CKPT_DIR": tmp}  # ddp_uneven's checkpoints
        subprocess.run(cmd, cwd=cwd, env=run_env, stdin=subprocess.DEVNULL, check=False)
        (case,) = out.glob("*/cases/watch")
        shutil.copy(case / "stderr.log", HERE / f"{name}.stderr.txt")
        result = json.loads((case / "result.json").read_text())
        ranks = {}
        for rank_json in sorted(case.glob("ranks/*/rank.json")):
            info = json.loads((case / json.loads(rank_json.read_text())["folder"] / "probe.json").read_text())
            keep = ("pid", "ppid", "rank", "ddp_params", "ddp_options")
            ranks[str(info["rank"])] = {k: info[k] for k in keep if k in info}
            process = result["evidence"]["processes"].get(str(info["rank"]), {})
            ranks[str(info["rank"])]["steps_done"] = _steps(process.get("where", ""))
        procs = {}  # every rank process, of every attempt (restarted ranks)
        for probe_json in sorted(case.glob("procs/pid-*/probe.json")):
            info = json.loads(probe_json.read_text())
            if isinstance(info.get("rank"), int) and not info.get("forked_from"):
                keep = ("pid", "ppid", "rank", "restart_count")
                procs[str(info["pid"])] = {k: info[k] for k in keep if k in info}
    import torch

    meta = {"exit_code": result["exit_code"], "torch": torch.__version__, "env": env, "ranks": ranks}
    if any(p.get("restart_count") for p in procs.values()):
        meta["procs"] = procs
    (HERE / f"{name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{name}: {result['verdict']}: {result['reason'][:160]}")


def _steps(where: str) -> int:
    # "rank 1, step 4, done": the steps the rank's probe counted
    return next((int(part.split()[1]) for part in where.split(", ") if part.startswith("step ")), 0)


def interleave() -> None:
    """ddp_unused_tee's rank blocks merged line by line into ddp_interleaved.stderr.txt."""
    lines = (HERE / "ddp_unused_tee.stderr.txt").read_text().splitlines(keepends=True)
    blocks: dict[str, list[str]] = {}
    first = last = None
    for i, line in enumerate(lines):
        if line.startswith("[default"):
            blocks.setdefault(line[: line.index("]") + 1], []).append(line)
            first = i if first is None else first
            last = i
    assert first is not None
    assert last is not None
    a, b = blocks.values()
    merged = [line for pair in zip(a, b, strict=False) for line in pair]
    merged += a[len(b) :] + b[len(a) :]
    bare = [line for line in lines[first : last + 1] if not line.startswith("[default")]
    text = "".join(lines[:first] + merged + bare + lines[last + 1 :])
    (HERE / "ddp_interleaved.stderr.txt").write_text(text)


def main() -> None:
    for name in sys.argv[1:] or list(RUNS):
        record(name)
    interleave()


if __name__ == "__main__":
    main()
