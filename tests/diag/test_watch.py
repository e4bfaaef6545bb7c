"""`nsa-diag watch -- CMD` on real jobs: scripts in tests/diag/jobs/ written as users write them (nothing of
nsa_diag imported), run by nsa-diag in a subprocess as a user would, each judged from its run folder.

The default set keeps one pass, one hang (deadlock in backward), bad input, Ctrl-C and the pure parts
(the probe's import cost, traceback parsing, collective counts); the other jobs are marked slow (each
10-40 s on a loaded 2-core machine: nsa-diag's and the job's torch imports, the stall limits).
GPU jobs (a CUDA kernel that spins, 2-GPU NCCL jobs that skip a collective or fail in DDP) skip without CUDA.
DDP's errors on recorded stderr, without processes: test_ddp_errors.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from diag_cli import cli_env, run_cli

from nsa_diag import artifacts
from nsa_diag.app import run_cli as cli_main
from nsa_diag.classify import focus_thread
from nsa_diag.errors import EXIT_HANG
from nsa_diag.evidence import stacks as stack_samples
from nsa_diag.evidence.stacks import parse_faulthandler
from nsa_diag.launchers import job
from nsa_diag.records import StackDiff

JOBS = Path(__file__).resolve().parent / "jobs"
PY = sys.executable


def _result(out: Path) -> dict[str, Any]:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return json.loads((run / "cases" / "watch" / "result.json").read_text())


def _case(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run / "cases" / "watch"


def _watch(
    tmp_path: Path, *options: str, job: list[str], env: dict[str, str] | None = None, timeout: float = 240
):
    out = tmp_path / "runs"
    proc = run_cli("watch", "--out", out, *options, "--", *job, cwd=JOBS, env=env, timeout=timeout)
    return proc, out


def _job_pids(case: Path) -> list[int]:
    return [int(p.name.removeprefix("pid-")) for p in (case / "procs").glob("pid-*")]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- pure parts: the probe's import cost, the job's traceback, the ranks' counts ---------------------


def test_probe_api_is_a_no_op_outside_watch_and_imports_nothing_heavy() -> None:
    code = (
        "import sys; import nsa_diag.probe as probe; "
        "probe.total_steps(3); probe.step(1); probe.phase('eval'); probe.loss(float('nan')); "
        "heavy = [m for m in ('torch', 'typer', 'rich', 'pydantic') if m in sys.modules]; "
        "print(probe.active(), heavy)"
    )
    env = {k: v for k, v in cli_env().items() if k != "NSA_DIAG_PROBE_DIR"}
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout.strip() == "False []", proc.stderr


def test_the_probe_ignores_sigusr1_once_its_exit_handler_ran(tmp_path: Path) -> None:
    """A stack sample asked for while the interpreter finalizes (faulthandler's handler gone) must not end
    a job that exits well: after the probe's atexit handler, SIGUSR1 is ignored; before it, it dumps."""
    code = (
        "import os, signal, time\n"
        "from nsa_diag.probe.runtime import start\n"
        f"probe = start({str(tmp_path)!r})\n"
        "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.2)\n"
        "probe._at_exit()\n"
        "assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN\n"
        "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.2)\n"
        "print('alive')\n"
    )
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "alive"
    (stacks,) = tmp_path.glob("pid-*/stacks.txt")
    assert "Current thread" in stacks.read_text()  # the first signal's dump


def test_branch_marks_reach_the_jobs_probe_and_replay(tmp_path: Path) -> None:
    """`watch --branch-marks`: the job's environment asks its probe for NSA branch marks (by default it
    hooks the blocks alone), and replay.sh asks again."""
    from nsa_diag._cli_utils import CaseOptions
    from nsa_diag.cases import replay_argv
    from nsa_diag.launchers.command import probe_env
    from nsa_diag.probe import BRANCHES_ENV
    from nsa_diag.session.watch import build_watch_spec

    for marks in (False, True):
        options = CaseOptions(branch_marks=marks)
        spec = build_watch_spec(options, [PY, "train.py"], keep_alive=False, total_steps=None)
        assert spec.branch_marks is marks
        assert ("--branch-marks" in replay_argv(spec, tmp_path)) is marks
        assert probe_env(tmp_path, {}, spec.branch_marks)[BRANCHES_ENV] == ("1" if marks else "0")


def test_probe_env_sets_the_recorders_buffer_by_its_current_name_only(tmp_path: Path) -> None:
    """The flight recorder's buffer by TORCH_FR_BUFFER_SIZE: torch (2.9 on) warns in every rank's output
    where its old name is set; a size the user gave under either name stands (the new name would outrank
    the old one)."""
    from nsa_diag.launchers.command import probe_env

    env = probe_env(tmp_path, {})
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    assert "TORCH_FR_BUFFER_SIZE" not in probe_env(tmp_path, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"})
    assert "TORCH_FR_BUFFER_SIZE" not in probe_env(tmp_path, {"TORCH_FR_BUFFER_SIZE": "50"})


def test_straggler_ratio_is_watchs_own_kept_out_of_the_hash_and_replayed(tmp_path: Path) -> None:
    """`watch --straggler-ratio`: ddp's option (declared once, on DdpSpec) into the command's spec; what a
    straggler is changes nothing the job computes, so not its hash; replay.sh gives it where it was given."""
    from nsa_diag._cli_utils import CaseOptions
    from nsa_diag.cases import replay_argv
    from nsa_diag.session.watch import build_watch_spec

    default = build_watch_spec(CaseOptions(), [PY, "train.py"], keep_alive=False, total_steps=None)
    given = build_watch_spec(
        CaseOptions(straggler_ratio=1.5), [PY, "train.py"], keep_alive=False, total_steps=None
    )
    assert default.command is not None
    assert given.command is not None
    assert (default.command.straggler_ratio, given.command.straggler_ratio) == (1.25, 1.5)
    assert given.spec_hash() == default.spec_hash()
    assert "--straggler-ratio" not in replay_argv(default, tmp_path)
    argv = replay_argv(given, tmp_path)
    assert argv[argv.index("--straggler-ratio") + 1] == "1.5"
    assert argv.index("--straggler-ratio") < argv.index("--")


def test_last_traceback_skips_torchrun_summary() -> None:
    stderr = "\n".join([
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "/x/train.py", line 12, in <module>',
        "[rank1]:     step()",
        "[rank1]: RuntimeError: shapes do not match",
        "Traceback (most recent call last):",
        '  File "/v/bin/torchrun", line 8, in <module>',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ])  # fmt: skip
    exc = job.last_traceback(stderr)
    assert exc is not None
    assert (exc.type, exc.message) == ("RuntimeError", "shapes do not match")


def test_collective_counts_name_the_rank_that_never_reached_the_collective(tmp_path: Path) -> None:
    folders = {r: tmp_path / str(r) for r in (0, 1)}
    at_hang = {
        0: {"collectives": {"all_reduce": 12}, "waiting": None},
        1: {"collectives": {"all_reduce": 8, "barrier": 1}, "waiting": {"op": "barrier", "n": 1}},
    }
    for r, data in at_hang.items():
        folders[r].mkdir()
        (folders[r] / "at_hang.json").write_text(json.dumps(data))
    diff = StackDiff()
    job.collective_minority(diff, folders, {0: 100, 1: 101})
    assert diff["minority_ranks"] == [1]  # NCCL: rank 0 called all_reduce 12 times, rank 1 only 8
    for r, data in {0: {"all_reduce": 9}, 1: {"all_reduce": 8, "barrier": 1}}.items():
        waits = {"op": "all_reduce", "n": 9} if r == 0 else {"op": "barrier", "n": 1}
        (folders[r] / "at_hang.json").write_text(json.dumps({"collectives": data, "waiting": waits}))
    diff = StackDiff()
    job.collective_minority(diff, folders, {0: 100, 1: 101})
    assert diff["minority_ranks"] == [1]  # gloo: rank 0 waits in all_reduce #9, which rank 1 never entered
    for r, data in {0: {"all_reduce": 12}, 1: {"all_reduce": 12, "barrier": 1}}.items():
        (folders[r] / "at_hang.json").write_text(json.dumps({"collectives": data, "waiting": None}))
    diff = StackDiff()
    job.collective_minority(diff, folders, {0: 100, 1: 101})
    assert diff["minority_ranks"] == [1]  # NCCL: rank 1's barrier paired with an all_reduce of rank 0's


# --- default set --------------------------------------------------------------------------------------


def test_plain_loop_passes(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, job=[PY, "plain_loop.py"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 5 loss" in proc.stdout
    assert "training done" in proc.stdout  # streamed to the terminal
    result = _result(out)
    assert result["verdict"] == "pass"
    assert result["steps_done"] == 5  # the job's optimizer steps
    case = _case(out)
    assert "training done" in (case / "stdout.log").read_text()
    spec = json.loads((case / "spec.json").read_text())
    assert spec["command"]["argv"] == [PY, "plain_loop.py"]
    assert spec["command"]["cwd"] == str(JOBS)
    (pid,) = _job_pids(case)
    probe = json.loads((case / "procs" / f"pid-{pid}" / "probe.json").read_text())
    assert probe["torch"] is True
    assert probe["sigusr1"] == "probe"
    assert probe["model"]["blocks"] == "layers"
    replay = (case / "replay.sh").read_text()
    assert f"cd {JOBS}" in replay
    assert "watch" in replay
    assert "plain_loop.py" in replay


def test_deadlock_in_backward_is_a_python_deadlock_at_step_3(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, "--stall", "3", job=[PY, "deadlock_backward.py"])
    assert proc.returncode == EXIT_HANG, proc.stderr[-2000:]
    result = _result(out)
    assert result["verdict"] == "hang", result["reason"]
    assert result["hang_kind"] == "python-deadlock", result["reason"]
    assert result["evidence"]["location"] == "step 3, backward, layers.1"
    assert "deadlock_backward.py" in result["reason"]
    assert "stats_lock" in result["reason"]
    assert not any(_alive(p) for p in _job_pids(_case(out)))
    # the stalled process's frames, as `run` shows a worker's (report.md's: test_messages.py)
    (pid,) = _job_pids(_case(out))
    stacks = f"cases/watch/procs/pid-{pid}/stacks.txt"
    assert result["evidence"]["stacks_file"] == f"procs/pid-{pid}/stacks.txt"
    assert f"main thread, last stack sample ({stacks}):" in proc.stdout
    assert "deadlock_backward.py:15 in summarize" in proc.stdout


@pytest.mark.slow
def test_raise_is_an_error_with_the_exception(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, job=[PY, "raises.py"])
    assert proc.returncode == 1
    result = _result(out)
    assert result["verdict"] == "error"
    assert "ValueError: batch 2 has 9 features, the model takes 8" in result["reason"]
    assert "raises.py" in result["reason"]


@pytest.mark.parametrize(
    "args, says",
    [
        pytest.param([], "no command after --", id="no-command"),
        pytest.param(["--", "no-such-command-nsa"], "command not found", id="missing-command"),
        pytest.param(["--keep-alive", "--timeout", "soon", "--", "true"], "--timeout", id="timeout-nonsense"),
        pytest.param(
            ["--keep-alive", "--timeout", "-5", "--", "true"], "--timeout -5", id="timeout-negative"
        ),
        pytest.param(["--straggler-ratio", "0.5", "--", "true"], "--straggler-ratio", id="ratio-below-1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # in process (the CLI's own `run_cli`): refused before anything starts, as from the command line
    code = cli_main(["watch", "--out", str(tmp_path / "runs"), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert says in lines[0], err
    assert not (tmp_path / "runs").exists()


def _refused(proc: subprocess.CompletedProcess[str], says: str) -> None:
    """One line on stderr that says `says`, exit code 2."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert says in lines[0], proc.stderr


def _watch_in_process(
    args: list[str | Path], cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> subprocess.CompletedProcess[str]:
    """`nsa-diag watch ARGS` from `cwd` in this process (the CLI's own `run_cli`), as
    test_bad_input_is_one_line_and_exit_2 runs it: a command refused before anything starts differs from
    a subprocess only by the interpreter's start and torch's import (~3 s of CPU each)."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = cli_main(["watch", *map(str, args)])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["nsa-diag", "watch"], code, captured.out, captured.err)


@pytest.mark.parametrize(
    "options, says",
    [
        pytest.param(["--tag", "../../escaped"], "--tag '../../escaped'", id="tag-climbs-out"),
        pytest.param(["--tag", "a/b"], "--tag 'a/b'", id="tag-with-slash"),
        pytest.param(["--name", "../x"], "name:", id="name-climbs-out"),
    ],
)
def test_a_tag_or_name_that_is_no_folder_name_is_refused_like_run(
    tmp_path: Path,
    options: list[str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`watch` checks --tag and --name as `run` and `attach` do: a tag of ``../..`` put the run folder
    two levels above --out; nothing is written anywhere."""
    work = tmp_path / "work"
    work.mkdir()
    args = ["--out", work / "a" / "b" / "runs", *options, "--", "true"]
    proc = _watch_in_process(args, work, monkeypatch, capsys)
    _refused(proc, says)
    assert not any(work.iterdir())


def _plain_file(path: Path) -> str:
    path.write_text("not a program\n")
    return str(path)


def _executable(path: Path, content: bytes) -> str:
    path.write_bytes(content)
    path.chmod(0o755)
    return f"./{path.name}"


@pytest.mark.parametrize(
    "make, says, shell",
    [
        pytest.param(
            lambda d: [_executable(d / "t.py", b"#!/no/such/python3\nprint(1)\n")],
            "#! interpreter /no/such/python3 does not exist",
            False,
            id="shebang-interpreter-missing",
        ),
        pytest.param(
            lambda d: [_executable(d / "t.py", b"#!/usr/bin/env no-such-python-nsa -u\nprint(1)\n")],
            "no-such-python-nsa",
            False,
            id="env-shebang-program-missing",
        ),
        pytest.param(
            lambda d: [_executable(d / "t.py", b"#!" + _plain_file(d / "interp").encode() + b"\n")],
            "is not executable",
            False,
            id="shebang-interpreter-not-executable",
        ),
        pytest.param(
            lambda d: [_executable(d / "run_me", b"echo started\n")],
            "no #! line",
            False,
            id="text-without-shebang",
        ),
        pytest.param(
            lambda d: [_executable(d / "blob", b"\x00\x01\x02 not a program")],
            "no #! line",
            False,
            id="not-an-executable-format",
        ),
        pytest.param(
            lambda d: ["echo", os.fsdecode(b"caf\xe9")],
            "not valid UTF-8",
            True,
            id="argument-not-utf8",
        ),
    ],
)
def test_a_command_that_cannot_start_is_one_line_and_exit_2(
    tmp_path: Path,
    make: Any,
    says: str,
    shell: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The command is checked as exec would take it before a run folder exists: its #! interpreter, its
    format, arguments nsa-diag can record; not judged as a job that failed. In process but for the
    argument that is no UTF-8, which comes through a real command line (bytes decoded by Python)."""
    work = tmp_path / "work"
    work.mkdir()
    command = make(work)
    if shell:
        proc = run_cli("watch", "--out", tmp_path / "runs", "--", *command, cwd=work)
    else:
        proc = _watch_in_process(["--out", tmp_path / "runs", "--", *command], work, monkeypatch, capsys)
    _refused(proc, says)
    assert not (tmp_path / "runs").exists()


def test_ctrl_c_stops_every_process_of_the_job(tmp_path: Path) -> None:
    """SIGINT to nsa-diag: exit 130; the job's processes, one in a session of its own, are gone."""
    out = tmp_path / "runs"
    job = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
        "print('started', flush=True); time.sleep(600)"
    )
    nsa = subprocess.Popen(  # -X faulthandler: a SIGABRT below dumps where nsa-diag is stuck, if it is
        [PY, "-X", "faulthandler", "-m", "nsa_diag", "watch", "--out", str(out), "--", PY, "-c", job],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        pids: list[int] = []
        while time.monotonic() < deadline and len(pids) < 2:
            time.sleep(0.5)
            runs = list(out.glob("*/cases/watch/procs"))
            pids = (
                [int(p.name[4:]) for p in runs[0].glob("pid-*") if (p / "probe.json").exists()]
                if runs
                else []
            )
        assert len(pids) == 2, "the job and its child never started under the probe"
        nsa.send_signal(signal.SIGINT)
        try:
            _, err = nsa.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            nsa.send_signal(signal.SIGABRT)
            _, err = nsa.communicate(timeout=30)
            pytest.fail(f"nsa-diag watch did not end within 60 s of SIGINT; its threads:\n{err[-6000:]}")
    finally:
        if nsa.poll() is None:
            nsa.kill()
    assert nsa.returncode == 130, err[-2000:]
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)]
    assert _result(out)["verdict"] == "error"
    assert "interrupted" in _result(out)["reason"]


@pytest.mark.slow
def test_a_checkpoint_pause_past_a_short_stall_is_a_pause_and_the_job_passes(tmp_path: Path) -> None:
    """The job copies its checkpoint to slow storage for 6 s after step 3, past a 3 s stall: bytes moving
    are work, not a hang: the watch goes on (a pause, if the stall came, names the writes), the job
    passes."""
    env = {"CHECKPOINT_PAUSE_S": "6"}
    proc, out = _watch(tmp_path, "--stall", "3", job=[PY, "checkpoint_pause.py"], env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = _result(out)
    assert result["verdict"] == "pass", result["reason"]
    assert result["steps_done"] == 8
    # bytes moving are work: the stall never comes, or its evidence finds the writes (a pause on record)
    for pause in result["evidence"].get("pauses", []):
        assert "MiB read or written" in pause["why"] or "read or wrote" in pause["why"], pause
    (record,) = result["evidence"]["processes"].values()
    assert (record["role"], record["state"]) == ("training", "exited normally (code 0)")


@pytest.mark.slow
def test_a_wait_entered_between_the_stack_samples_is_a_deadlock(tmp_path: Path) -> None:
    """After its checkpoint the job sleeps 3.6 s (slow storage), then waits for an upload thread that died.
    A 3 s stall's first sample finds it asleep and the second in the wait: the samples disagree, so the
    evidence takes a third, and the last two name the wait (it was `unknown` with two samples that
    disagreed). Where the stall came after the sleep had ended, both samples are in the wait."""
    env = {"SLOW_STORAGE_S": "3.6"}
    proc, out = _watch(tmp_path, "--stall", "3", job=[PY, "upload_thread_dies.py"], env=env)
    assert proc.returncode == EXIT_HANG, proc.stderr[-2000:]
    result = _result(out)
    assert (result["verdict"], result["hang_kind"]) == ("hang", "python-deadlock"), result["reason"]
    assert "called from `uploaded.wait()` at upload_thread_dies.py:" in result["reason"]
    # what a person reads first in the job's output: the thread it waits for died
    assert (
        "; earlier, the job's thread 'upload' died of an uncaught exception: ConnectionError: object store "
        "refused the upload at upload_thread_dies.py:23 in upload"
    ) in result["reason"]
    sleep_line = (
        (JOBS / "upload_thread_dies.py")
        .read_text()
        .splitlines()
        .index("                time.sleep(STORAGE_S)  # the shared filesystem flushes")
    )
    processes = result["evidence"]["processes"]
    (pid,) = [pid for pid, record in processes.items() if record["role"] == "training"]
    workers = [record["state"] for record in processes.values() if record["role"] == "dataloader-worker"]
    assert len(workers) == 2
    assert all(state.startswith("idle") for state in workers), workers
    stacks_txt = _case(out) / "procs" / f"pid-{pid}" / artifacts.STACKS
    first = stack_samples.read_stacks(stacks_txt).samples[0]
    main = focus_thread(parse_faulthandler(first))
    if main is not None and main.python_frames[0].line == sleep_line + 1:  # the first sample in the sleep
        assert "in the last two of 3 stack samples (the first at `time.sleep(STORAGE_S)`" in result["reason"]


@pytest.mark.slow
def test_a_save_blocked_on_a_file_lock_another_job_holds_names_the_lock_and_its_holder(
    tmp_path: Path,
) -> None:
    """The job saves its checkpoint under an exclusive fcntl.flock on a shared folder's lock file, which
    another job holds: it blocks in the kernel at its save. A hang at its own line, waiting for a file lock,
    the lock file and the pid and command of the process that holds it named (it was "cause unclear");
    that process is not the job's, so it is left alone."""
    shared = tmp_path / "shared"
    shared.mkdir()
    hold = "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(300)"  # noqa: E501
    holder = subprocess.Popen(
        [PY, "-c", hold, str(shared / "checkpoints.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        env = {"CHECKPOINT_DIR": str(shared)}
        proc, out = _watch(tmp_path, "--stall", "5", job=[PY, "flock_checkpoint.py"], env=env)
        assert holder.poll() is None  # another job's process: never signalled
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == EXIT_HANG, proc.stderr[-2000:]
    result = _result(out)
    assert (result["verdict"], result["hang_kind"]) == ("hang", "unknown"), result["reason"]
    assert (
        "waiting for a file lock (fcntl) at `fcntl.flock(lock, fcntl.LOCK_EX)` at flock_checkpoint.py:20 in "
        "save_checkpoint"
    ) in result["reason"], result["reason"]
    assert (
        f"file locks other processes hold: {shared / 'checkpoints.lock'} (flock, pid {holder.pid}:"
        in (result["reason"])
    )
    assert result["steps_done"] == 3
    assert not [pid for pid in _job_pids(_case(out)) if _alive(pid)]


@pytest.mark.slow
def test_a_job_waiting_for_its_evaluation_subprocess_names_the_child_and_what_it_does(tmp_path: Path) -> None:
    """The job runs its evaluation as a separate program (subprocess.run) that never finishes: it polls
    for a result file with a sleep. The hang is the job's, at its own line, and the reason says the child
    it waits for and that the child is stuck in its sleep-and-check loop (no work, only sleeps: issue 48;
    a child started by exec, not forked: found by its parent pid). Both are stopped."""
    proc, out = _watch(tmp_path, "--stall", "5", job=[PY, "eval_subprocess.py"])
    assert proc.returncode == EXIT_HANG, proc.stderr[-2000:]
    result = _result(out)
    assert (result["verdict"], result["hang_kind"]) == ("hang", "python-deadlock"), result["reason"]
    assert "blocked in subprocess wait" in result["reason"]
    lines = (JOBS / "eval_subprocess.py").read_text().splitlines()
    line = 1 + next(n for n, text in enumerate(lines) if "subprocess.run(" in text)
    assert f"called from eval_subprocess.py:{line} in main" in result["reason"], result["reason"]
    processes = result["evidence"]["processes"]
    (child,) = [pid for pid, record in processes.items() if record["role"] == "helper"]
    assert result["evidence"]["waits_on"] == [int(child)]
    assert (
        f"the stalled process waits for its child process: pid {child}: stuck (python-deadlock): "
        in (result["reason"])
    ), result["reason"]
    assert "sleeping at <string>:4 in <module>" in processes[child]["state"], processes[child]
    assert "no work, only sleeps" in processes[child]["state"], processes[child]
    assert not [pid for pid in _job_pids(_case(out)) if _alive(pid)]


@pytest.mark.slow
def test_a_helper_process_that_ended_long_ago_does_not_stop_the_job(tmp_path: Path) -> None:
    """The job runs a short-lived Python subprocess before training (its probe reports the subprocess's
    start and end), then trains for 36 s. The helper's beacon stays at `done`: it was judged stalled
    30 s after its exit, and the working job was stopped with the helper's verdict, pass (found with
    torch.compile's own `python -c` helpers under load). A unit whose process has exited is not judged."""
    proc, out = _watch(tmp_path, "--stall", "5", job=[PY, "helper_then_train.py"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = _result(out)
    assert (result["verdict"], result["steps_done"]) == ("pass", 40), result["reason"]
    assert result["reason"] == "the job exited with code 0"
    roles = sorted(record["role"] for record in result["evidence"]["processes"].values())
    assert roles == ["helper", "training"]
    assert "training done" in (_case(out) / "stdout.log").read_text()


# --- slow: one job each -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_checkpoint_pause_under_the_default_stall_passes(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, job=[PY, "checkpoint_pause.py"])  # a 15 s pause, --stall auto
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = _result(out)
    assert result["verdict"] == "pass", result["reason"]
    assert result["steps_done"] == 8
    assert "pauses" not in result["evidence"]  # within the limit: auto's floor for a job is 60 s


@pytest.mark.slow
def test_slow_dataloader_items_are_a_pause_while_the_workers_read_them(tmp_path: Path) -> None:
    # 0.5 MiB/s: a batch takes 12 s to read, which outlasts the stall (3 s) and the evidence after it
    # (3 s alone, up to 9 s on a loaded 2-core machine, when the batch would come in the meantime)
    proc, out = _watch(tmp_path, "--stall", "3", job=[PY, "slow_batches.py", "--mib-per-s", "0.5"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = _result(out)
    assert result["verdict"] == "pass", result["reason"]
    assert result["steps_done"] == 3
    whys = [p["why"] for p in result["evidence"]["pauses"]]
    assert any("its DataLoader worker is producing" in why and "MiB" in why for why in whys), whys
    records = result["evidence"]["processes"].values()
    workers = [r for r in records if r["role"] == "dataloader-worker"]
    assert len(workers) == 2
    assert all(r["state"] == "exited normally (code 0)" and r["verdict"] is None for r in workers), workers


@pytest.mark.slow
def test_a_layer_whose_per_token_loop_outlasts_the_stall_is_slow_not_hung(tmp_path: Path) -> None:
    # each layer's forward must outlast the 5 s stall: at 6144 tokens one took ~5 s on a 2-core machine of
    # 2026-12 (the stall never came), hence 12288; the 25 s timeout comes in one of the eight forwards
    # (the CPU backward of a per-token graph runs in C++ with no Python frame moving: py-spy's native
    # frames tell it works, and this test does not need py-spy)
    job = [PY, "per_token_layer.py", "--seq-len", "12288", "--layers", "8"]
    proc, out = _watch(tmp_path, "--stall", "5", "--timeout", "25", job=job)
    assert proc.returncode == 1
    result = _result(out)
    assert result["verdict"] == "slow", result["reason"]
    assert "moves of the innermost Python frame" in result["reason"]
    assert "forward, layers." in result["reason"]
    assert result["evidence"]["work"]["working"] is True


@pytest.mark.slow
def test_a_deadlock_with_idle_dataloader_workers_names_the_main_process(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, "--stall", "3", job=[PY, "deadlock_workers.py"])
    result = _result(out)
    assert (result["verdict"], result["hang_kind"]) == ("hang", "python-deadlock"), result["reason"]
    assert result["evidence"]["location"] == "step 3, backward, layers.1"
    assert "deadlock_workers.py:16" in result["reason"]
    assert "stats_lock" in result["reason"]
    assert "selectors.py" not in result["reason"]
    assert "waits for" not in result["reason"]
    records = result["evidence"]["processes"].values()
    workers = [r for r in records if r["role"] == "dataloader-worker"]
    assert [r["state"] for r in workers] == ["idle: waiting for indices from the training process"] * 2
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow
def test_a_nan_loss_is_nonfinite_without_a_code_change(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, job=[PY, "nan_loss.py"])
    assert "done" in proc.stdout  # the job ran to its end, unchanged
    result = _result(out)
    assert result["verdict"] == "nonfinite", result["reason"]
    assert (result["nonfinite"]["step"], result["nonfinite"]["value"]) == (3, "nan")
    assert "the tensor backward() was called on" in result["reason"]


@pytest.mark.slow
def test_a_nan_names_the_block_where_it_first_appeared_without_a_code_change(tmp_path: Path) -> None:
    """An all-padding row makes the first global-attention layer's softmax NaN at step 3; the loss ignores
    that row and stays finite, the gradients carry the NaN into the weights, the loss is NaN from step 4.
    The verdict names layers.1 at step 3 (at step 4 every layer is NaN)."""
    proc, out = _watch(tmp_path, job=[PY, "nan_padding_row.py"])
    assert "done" in proc.stdout
    result = _result(out)
    assert result["verdict"] == "nonfinite", result["reason"]
    found = result["nonfinite"]
    assert (found["step"], found["module"], found["module_step"]) == (4, "layers.1", 3), found
    assert (
        "the first non-finite values came out of layers.1 at step 3, whose loss was finite"
        in result["reason"]
    )
    assert "layers.1 (output) step 3" in proc.stdout  # the table's where


@pytest.mark.slow
def test_an_interrupted_watch_keeps_where_the_job_was_and_its_stacks(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    nsa = subprocess.Popen(
        [PY, "-m", "nsa_diag", "watch", "--out", str(out), "--", PY, "slow_steps.py"],
        env=cli_env(), cwd=JOBS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            logs = list(out.glob("*/cases/watch/stdout.log"))
            if logs and "step 4\n" in logs[0].read_text():
                break
            time.sleep(0.2)
        else:
            pytest.fail("the job never logged 4 steps")
        nsa.send_signal(signal.SIGINT)
        nsa.communicate(timeout=60)
    finally:
        if nsa.poll() is None:
            nsa.kill()
    assert nsa.returncode == 130
    result = _result(out)
    assert result["verdict"] == "error"
    assert "interrupted by SIGINT" in result["reason"]
    assert "unknown place" not in result["reason"]
    assert result["where"]["step"] >= 4, result["reason"]
    (stacks,) = result["evidence"]["stacks"]
    assert "slow_steps.py" in (_case(out) / stacks).read_text()


@pytest.mark.slow
def test_an_interrupted_watch_of_a_job_training_in_a_subprocess_says_where_its_steps_were(
    tmp_path: Path,
) -> None:
    """The command runs its training in a subprocess (a helper by its place in the tree) and reports nothing
    itself: the interrupted result still says how far the job got, not only the command's setup."""
    out = tmp_path / "runs"
    wrapper = "import subprocess, sys; subprocess.run([sys.executable, 'slow_steps.py'])"
    nsa = subprocess.Popen(
        [PY, "-m", "nsa_diag", "watch", "--out", str(out), "--", PY, "-c", wrapper],
        env=cli_env(), cwd=JOBS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            logs = list(out.glob("*/cases/watch/stdout.log"))
            if logs and "step 4\n" in logs[0].read_text():
                break
            time.sleep(0.2)
        else:
            pytest.fail("the job never logged 4 steps")
        nsa.send_signal(signal.SIGINT)
        nsa.communicate(timeout=60)
    finally:
        if nsa.poll() is None:
            nsa.kill()
    assert nsa.returncode == 130
    result = _result(out)
    assert "interrupted by SIGINT" in result["reason"]
    assert "no progress reported" not in result["reason"]
    assert "(a helper process): step " in result["reason"], result["reason"]
    assert result["steps_done"] >= 4, result["reason"]


@pytest.mark.slow
def test_slow_job_is_slow_with_an_eta(tmp_path: Path) -> None:
    proc, out = _watch(
        tmp_path, "--stall", "8", "--timeout", "12", "--total-steps", "60", job=[PY, "slow_steps.py"]
    )  # the job needs 18 s of sleeps alone; 12 s leaves a loaded machine room for torch's import
    assert proc.returncode == 1
    result = _result(out)
    assert result["verdict"] == "slow", result["reason"]
    assert result["rate"]["steps_total"] == 60
    assert result["rate"]["eta_s"] > 0
    assert "ETA" in result["reason"]


@pytest.mark.slow
def test_nonfinite_loss_told_to_the_probe_is_nonfinite(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, job=[PY, "nonfinite_loss.py"])
    assert "done" in proc.stdout  # the job ran to its end, unchanged
    result = _result(out)
    assert result["verdict"] == "nonfinite", result["reason"]
    assert result["nonfinite"]["step"] == 3
    assert result["nonfinite"]["value"] == "nan"


@pytest.mark.slow
def test_segfault_is_a_crash(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, job=[PY, "segfault.py"])
    result = _result(out)
    assert result["verdict"] == "crash", result["reason"]
    assert result["signal"] == "SIGSEGV", result["reason"]
    assert "segfault.py" in result["reason"]  # faulthandler's fatal traceback, into the probe's stacks.txt


@pytest.mark.slow
def test_torchrun_rank_skipping_an_all_reduce_is_a_collective_hang_of_minority_rank_1(tmp_path: Path) -> None:
    job = _torchrun("ddp_skip_allreduce.py")
    proc, out = _watch(tmp_path, "--stall", "3", job=job, env={"GLOO_SOCKET_IFNAME": "lo"})
    result = _result(out)
    assert result["verdict"] == "hang", result["reason"]
    # the stuck rank's own wait (a sleep: no work) or the collective of the rank that waits for it
    assert result["hang_kind"] in ("collective", "python-deadlock"), result["reason"]
    assert result["evidence"]["minority_ranks"] == [1]
    assert result["reason"].startswith("rank 1 (pid "), result["reason"]
    case = _case(out)
    assert sorted(p.name for p in (case / "ranks").iterdir()) == ["0", "1"]
    # gloo has no debug pipe: each rank's probe dumped its group's flight recorder at the dump request,
    # read as `nsa-diag fr` reads them; the call sites are the job's lines, past the probe's wrapper
    recorder = result["evidence"]["flight_recorder"]
    assert set(recorder["files"]) == {"0", "1"}
    assert recorder["analysis"]["culprits"] == [1]
    assert "flight recorder: rank 1 (" in result["reason"]
    assert "rank 1 barrier [] at main (ddp_skip_allreduce.py:30)" in result["reason"]
    assert not any(_alive(p) for p in _job_pids(case))


@pytest.mark.slow  # ~30 s each: two gloo ranks importing torch, spawned
def test_a_ddp_job_started_by_mp_spawn_names_the_rank_that_failed(tmp_path: Path) -> None:
    """DDP under torch.multiprocessing.spawn (no torchrun; each process learns its rank at
    init_process_group). Rank 0 alone all-reduces a metric and gloo aborts it: a crash of rank 0 at the
    job's line with gloo's own words, not spawn's exception in the parent; rank 1 was stopped by spawn,
    the resource tracker is a helper. Rank 1 stuck on its data: a hang headed by rank 1, which the flight
    recorder shows never entered the all-reduce rank 0 waits in inside DDP's backward. Rank 1 raising:
    its exception, from inside spawn's, is rank 1's; rank 0 was stopped by spawn."""
    env = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    lines = (JOBS / "spawn_ddp.py").read_text().splitlines()

    def line_of(text: str) -> int:
        return 1 + next(n for n, source in enumerate(lines) if text in source)

    def watch(fault: str) -> tuple[dict[str, Any], Path]:
        _, out = _watch(
            tmp_path / fault, "--stall", "8", job=[PY, "spawn_ddp.py", "--fault", fault],
            env={**env, "MASTER_PORT": str(_free_port())},
        )  # fmt: skip
        return _result(out), out

    result, out = watch("mismatch")
    assert result["verdict"] == "crash", result["reason"]
    assert result["reason"].startswith("rank 0: killed by SIGABRT (Aborted)"), result["reason"]
    assert f"called from spawn_ddp.py:{line_of('dist.all_reduce(metric)')} in worker" in result["reason"]
    assert "C++ exception gloo::EnforceNotMet" in result["reason"]
    assert "collective mismatch" in result["reason"]
    states = {
        r["label"].split(" (")[0]: (r["role"], r["state"]) for r in result["evidence"]["processes"].values()
    }
    assert states["rank 0"] == ("rank", "killed by SIGABRT"), states
    assert states["rank 1"] == ("rank", "killed by SIGTERM"), states
    assert sorted(role for role, _ in states.values()) == ["helper", "launcher", "rank", "rank"], states
    assert not any(_alive(p) for p in _job_pids(_case(out)))

    result, out = watch("stuck")
    assert result["verdict"] == "hang", result["reason"]
    assert result["reason"].startswith("rank 1 (pid "), result["reason"]
    assert f"`x = batches.get()` at spawn_ddp.py:{line_of('batches.get()')} in worker" in result["reason"]
    assert result["evidence"]["minority_ranks"] == [1]
    assert result["evidence"]["flight_recorder"]["analysis"]["culprits"] == [1]
    assert not any(_alive(p) for p in _job_pids(_case(out)))

    result, out = watch("raise")
    assert result["verdict"] == "error", result["reason"]
    raised = line_of('raise RuntimeError("corrupt shard')
    assert result["reason"].startswith(
        f"rank 1: RuntimeError: corrupt shard 17 at spawn_ddp.py:{raised} in worker"
    ), result["reason"]
    states = {r["label"].split(" (")[0]: r["state"] for r in result["evidence"]["processes"].values()}
    assert (states["rank 0"], states["rank 1"]) == ("killed by SIGTERM", "raised RuntimeError"), states


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # ~15 s each: two gloo ranks importing torch
@pytest.mark.parametrize("stuck_rank", [1, -1], ids=["rank-1-stuck", "healthy"])
def test_a_watched_fsdp2_job_passes_or_names_its_stuck_rank(tmp_path: Path, stuck_rank: int) -> None:
    """A user's FSDP2 job (fully_shard per block, then the model; gloo): healthy, it passes with its steps
    counted; when rank 1's batch read blocks at step 3, rank 0 waits in FSDP's all-gather of step 3's
    forward: a collective hang about rank 1, at its read, which rank 0 waits for; no process outlives the
    case."""
    job = _torchrun("fsdp2_stuck_rank.py", "--stuck-rank", str(stuck_rank))
    proc, out = _watch(tmp_path, "--stall", "5", job=job, env={"GLOO_SOCKET_IFNAME": "lo"})
    result = _result(out)
    if stuck_rank < 0:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert result["verdict"] == "pass", result["reason"]
        assert result["steps_done"] == 5
        return
    assert result["verdict"] == "hang", result["reason"]
    # the stuck rank's own wait (a sleep: no work) or the collective of the rank that waits for it
    assert result["hang_kind"] in ("collective", "python-deadlock"), result["reason"]
    assert result["evidence"]["minority_ranks"] == [1]
    # the stuck rank heads the reason; the rank that waits for it is named after it
    assert result["reason"].startswith("rank 1 (pid "), result["reason"]
    assert "rank 0 (pid " in result["reason"]
    assert "waits for it" in result["reason"]
    assert "all_gather" in result["reason"]
    assert "fsdp2_stuck_rank.py:28 in read_batch" in result["reason"]
    assert result["steps_done"] == 2
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow  # ~30 s each: two gloo ranks importing torch, a 20 s evaluation
@pytest.mark.parametrize("spin", [False, True], ids=["evaluates", "spins"])
def test_a_rank_waiting_for_a_rank_that_works_is_paused_not_hung(tmp_path: Path, spin: bool) -> None:
    """Rank 0 alone evaluates for 20 s after step 3 while rank 1 waits in the barrier after it, past the
    stall limit of 4 s. Rank 0 works (its frames move at full CPU): rank 1's wait is a pause, the job
    passes with that pause noted. When rank 0's evaluation never ends in a loop on one line (no work seen:
    a busy loop), the job is hung there, about rank 0."""
    # 20 s of evaluation: the stall (4 s) and the evidence of both ranks after it (3 s alone, up to 9 s on
    # a loaded 2-core machine) end well before it does
    job = _torchrun("ddp_rank0_eval.py", "--eval-s", "20", *(["--spin"] if spin else []))
    proc, out = _watch(tmp_path, "--stall", "4", job=job, env={"GLOO_SOCKET_IFNAME": "lo"})
    result = _result(out)
    if not spin:
        assert proc.returncode == 0, result["reason"]
        assert result["verdict"] == "pass", result["reason"]
        assert result["steps_done"] == 6
        pauses = result["evidence"]["pauses"]
        working = "it waits in a collective for rank(s) still working: rank 0: "
        assert any(p["unit"] == 1 and p["why"].startswith(working) for p in pauses), pauses
        return
    assert result["verdict"] == "hang", result["reason"]
    assert result["hang_kind"] == "python-busy", result["reason"]
    assert result["reason"].startswith("rank 0 (pid "), result["reason"]
    assert "ddp_rank0_eval.py:23 in evaluate" in result["reason"]
    assert result["evidence"]["minority_ranks"] == [0]
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow  # ~35 s healthy, ~25 s stuck
@pytest.mark.parametrize("stuck", [False, True], ids=["healthy", "stuck-worker"])
def test_a_process_waiting_in_a_pool_for_workers_that_work_is_paused(tmp_path: Path, stuck: bool) -> None:
    """Each epoch the job tokenizes its shards in a multiprocessing Pool (10 s of CPU a shard; 6 s in the
    stuck job) while the main process waits in pool.map, past the stall limit of 3 s: it waits for its
    child processes and they work, so it is paused and the job passes. When one worker blocks on a lock
    for ever, the other finishes its shards and idles: then the job is hung, the main process waiting for
    its children, the blocked one named at its line."""
    # shards of 6 s (10 s healthy: epoch 1's pool then works 20 s): a wait for the pool outlasts the 3 s
    # stall and the evidence after it, which takes 3 s alone and up to 9 s beside two more such jobs on 2
    # cores (its py-spy dumps of busy workers); the stuck job's other worker works its 3 shards, 18 s
    shard_s = "6" if stuck else "10"
    job = [PY, "pool_preprocess.py", "--shard-s", shard_s, *(["--stuck"] if stuck else [])]
    proc, out = _watch(tmp_path, "--stall", "3", job=job)
    result = _result(out)
    pauses = result["evidence"].get("pauses", [])
    assert any(
        p["why"].startswith("it waits for its child process(es), which are working: pid ") for p in pauses
    ), (pauses, result["reason"], proc.stderr[-3000:])
    if not stuck:
        assert proc.returncode == 0, result["reason"]
        assert result["verdict"] == "pass", result["reason"]
        return
    assert result["verdict"] == "hang", result["reason"]
    assert result["hang_kind"] == "python-deadlock", result["reason"]
    assert "pool_preprocess.py:48 in main" in result["reason"]
    assert "the stalled process waits for its child process: " in result["reason"]
    assert "at `lock.acquire()` at pool_preprocess.py:26 in tokenize" in result["reason"]
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow  # ~20 s each: a job importing torch, an 8 s tool or a stall
@pytest.mark.parametrize("stuck", [False, True], ids=["tool-works", "tool-stuck"])
def test_a_process_waiting_for_a_program_that_works_is_paused(tmp_path: Path, stuck: bool) -> None:
    """After step 3 the job runs an external program and waits in subprocess.run (a shell loop at full CPU
    for 8 s), past the stall limit of 3 s: it waits for a child that works, so it is paused and the job
    passes (it was a python-deadlock: the program has no probe, and only probed children counted; seen
    as `run --compile inductor` waiting for g++ in CI). When the program only sleeps, the job is hung in
    subprocess's wait, at its call."""
    job = [PY, "external_tool.py", *(["--stuck"] if stuck else [])]
    proc, out = _watch(tmp_path, "--stall", "3", job=job)
    result = _result(out)
    pauses = result["evidence"].get("pauses", [])
    working = [
        p
        for p in pauses
        if p["why"].startswith("it waits for its child process(es), which are working: pid ")
    ]
    if not stuck:
        assert proc.returncode == 0, result["reason"]
        assert result["verdict"] == "pass", result["reason"]
        assert working, pauses
        assert " (sh) at CPU " in working[0]["why"]
        return
    assert not working, pauses
    assert result["verdict"] == "hang", result["reason"]
    assert "external_tool.py:26 in main" in result["reason"]
    assert not any(_alive(p) for p in _job_pids(_case(out)))


def _torchrun(script: str, *args: str) -> list[str]:
    return [str(Path(PY).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", script, *args]


@pytest.mark.slow  # ~70 s: ranks that never report progress are judged by the timeout alone
def test_ranks_waiting_for_a_world_size_the_job_never_started_are_a_hang_that_says_so(tmp_path: Path) -> None:
    """init_process_group(world_size=3) under torchrun's two ranks: both wait in it for ever. Before any
    progress a rank is judged by the timeout (a rank may load data for minutes first); at it, the hang
    names the mismatch the probe noted before the call."""
    job = _torchrun("ddp_wrong_world_size.py")
    proc, out = _watch(tmp_path, "--timeout", "60", job=job, env={"GLOO_SOCKET_IFNAME": "lo"})
    assert proc.returncode == EXIT_HANG, proc.stderr[-2000:]
    result = _result(out)
    assert (result["verdict"], result["hang_kind"]) == ("hang", "collective"), result["reason"]
    mismatch = "init_process_group asked for world_size=3, but the job started 2 ranks (WORLD_SIZE=2)"
    assert mismatch in result["reason"], result["reason"]
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow  # ~25 s each: two gloo ranks importing torch, 8 steps of 0.1-0.4 s
@pytest.mark.parametrize("slow_rank", [1, -1], ids=["rank-1-slow", "healthy"])
def test_a_watched_torchrun_rank_slow_in_its_data_loading_is_a_straggler_and_the_job_passes(
    tmp_path: Path, slow_rank: int
) -> None:
    """Every rank's DataLoader reads a batch in 0.1 s; rank 1's in 0.4 s (slow-rank 1): rank 0 waits for it
    in backward's all-reduce, so both take as long a step; rank 1 is named from the probe's step times,
    its extra time between steps (its data), and the job passes. With neither slow, no rank is named."""
    job = _torchrun("ddp_straggler.py", "--slow-rank", str(slow_rank))
    proc, out = _watch(tmp_path, job=job, env={"GLOO_SOCKET_IFNAME": "lo"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = _result(out)
    assert result["verdict"] == "pass", result["reason"]
    assert result["steps_done"] == 8
    stragglers = result["evidence"]["stragglers"]
    assert stragglers["steps"] == [2, 3, 4, 5, 6, 7, 8]
    assert set(stragglers["own_step_s"]) == {"0", "1"}
    case = _case(out)
    for rank in ("0", "1"):  # each rank's probe timed its 8 steps
        folder = json.loads((case / "ranks" / rank / "rank.json").read_text())["folder"]
        assert len((case / folder / "steps.jsonl").read_text().splitlines()) == 8
    if slow_rank == -1:
        assert stragglers["slow"] == []
        assert "straggler" not in result["reason"]
        return
    (slow,) = stragglers["slow"]
    assert (slow["rank"], slow["phase"]) == (1, "between steps")
    assert slow["ratio"] >= 2
    assert slow["extra_s"] == pytest.approx(0.3, abs=0.15)
    assert result["reason"].startswith("the job exited with code 0; straggler rank 1: ")
    assert "x the other ranks' median step, in between steps (" in result["reason"]


@pytest.mark.slow
def test_torchrun_ddp_unused_parameters_are_grad_missing_by_name_with_the_fix(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, job=_torchrun("ddp_unused_param.py"), env={"GLOO_SOCKET_IFNAME": "lo"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    result = _result(out)
    assert result["verdict"] == "grad-missing", result["reason"]
    assert result["missing_grads"] == ["aux_head.weight", "aux_head.bias"]  # DDP's indices 20 21, named
    assert result["reason"].startswith("ranks 0, 1: DDP: parameters aux_head.weight, aux_head.bias")
    assert "fix: find_unused_parameters=True" in result["reason"]
    assert "ddp_unused_param.py:52 in main" in result["reason"]
    for rank in ("0", "1"):  # each rank's record says its own exception, also the one torchrun stopped
        assert result["evidence"]["processes"][rank]["verdict"] == "grad-missing"
        assert result["evidence"]["rank_exceptions"][rank]["found_by"] == "prefix"
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow  # ~12 s: two gloo ranks importing torch, a DataLoader worker each
def test_torchrun_rank_whose_data_ends_first_is_named_after_its_peers_error(tmp_path: Path) -> None:
    """A user's DDP job whose ranks read their own files (rank 1's hold 4 batches, rank 0's 6): rank 1
    saves and exits 0 after step 4, rank 0's all-reduce in step 5 raises "Connection closed by peer". The
    verdict is rank 0's error at the job's own line, and the reason says rank 1 left the loop first."""
    env = {"GLOO_SOCKET_IFNAME": "lo", "CKPT_DIR": str(tmp_path)}
    proc, out = _watch(tmp_path, job=_torchrun("ddp_uneven_data.py"), env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    result = _result(out)
    assert result["verdict"] == "error", result["reason"]
    assert "Connection closed by peer" in result["reason"]
    assert "called from ddp_uneven_data.py:34 in main" in result["reason"]
    assert "rank 1 exited normally (code 0) after 4 step(s); rank 0 raised in step 5" in result["reason"]
    assert "data sharded unevenly across ranks" in result["reason"]
    assert (tmp_path / "rank1.pt").is_file()  # rank 1 finished its own epoch
    processes = result["evidence"]["processes"]
    assert processes["1"]["state"] == "exited normally (code 0)"
    assert processes["0"]["state"] == "raised RuntimeError"
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow  # ~15 s each: two attempts of two gloo ranks importing torch
@pytest.mark.parametrize("fails_again", [False, True], ids=["passes-on-restart", "fails-again"])
def test_torchrun_ranks_restarted_after_a_failure_are_said_and_followed(
    tmp_path: Path, fails_again: bool
) -> None:
    """A user's DDP job under ``torchrun --max-restarts 1`` that checkpoints each step: rank 1 raises OSError
    in step 3; torchrun restarts both ranks, which resume. When the restart finishes, the job passes and
    the reason says what ended the first attempt; when rank 1 raises again, its last exception is the
    verdict's and the reason says the first attempt ended the same way. The ranks' folders follow the
    restarted processes; no process outlives the watch."""
    env = {"GLOO_SOCKET_IFNAME": "lo", "CKPT_DIR": str(tmp_path), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if fails_again:
        env["FAIL_ALWAYS"] = "1"
    torchrun = [
        str(Path(PY).parent / "torchrun"),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
    ]
    proc, out = _watch(tmp_path, job=[*torchrun, "elastic_retry.py"], env=env)
    result = _result(out)
    case = _case(out)
    first = "rank 1: OSError: shard-003.bin: Input/output error (attempt 0) at elastic_retry.py:35 in main"
    if fails_again:
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert result["verdict"] == "error", result["reason"]
        assert result["reason"].startswith("rank 1: OSError: shard-003.bin: Input/output error (attempt 1)")
        assert "; torchrun had restarted the ranks 1 time: attempt 1 ended the same way" in result["reason"]
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert result["verdict"] == "pass", result["reason"]
        assert f"; torchrun restarted the ranks 1 time: attempt 1 ended with {first}" in result["reason"]
    (ended,) = result["evidence"]["restarts"]
    assert (ended["attempt"], ended["rank"], ended["exception"]["type"]) == (1, 1, "OSError")
    for rank in (0, 1):  # each rank's folder is its restarted process's
        rank_json = json.loads((case / "ranks" / str(rank) / "rank.json").read_text())
        info = json.loads((case / rank_json["folder"] / "probe.json").read_text())
        assert (info["rank"], info["restart_count"]) == (rank, 1)
    assert not any(_alive(p) for p in _job_pids(case))


def test_torchruns_max_restarts_is_read_from_its_command_line() -> None:
    from nsa_diag.launchers.command import max_restarts

    assert max_restarts(["torchrun", "--standalone", "--max-restarts", "3", "train.py"]) == 3
    assert max_restarts(["/venv/bin/python", "-m", "torch.distributed.run", "--max_restarts=2", "t.py"]) == 2
    assert max_restarts(["torchrun", "--nproc-per-node", "2", "train.py"]) == 0
    assert max_restarts(["torchrun", "--max-restarts"]) == 0  # torchrun itself refuses it
    assert max_restarts(["torchrun", "--max-restarts", "x"]) == 0


@pytest.mark.slow  # ~30 s: two attempts of two gloo ranks, a 5 s stall
@pytest.mark.parametrize("restarts", [1, 0], ids=["restarts-left", "no-restart"])
def test_a_hung_torchrun_attempt_with_restarts_left_is_restarted_and_its_hang_kept(
    tmp_path: Path, restarts: int
) -> None:
    """A DDP job under ``torchrun --max-restarts 1`` whose rank 1 hangs reading its shard in step 3 of the
    first attempt, rank 0 waiting in DDP's all-reduce: nothing fails, so torchrun alone would wait for
    ever. watch takes the evidence, kills that attempt's ranks, torchrun restarts them from the last
    checkpoint, the job passes, and its reason keeps the first attempt's hang: rank 1 at its line. Without
    a restart left the hang is the verdict, as before."""
    env = {"GLOO_SOCKET_IFNAME": "lo", "CKPT_DIR": str(tmp_path), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    torchrun = [str(Path(PY).parent / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    job = [*torchrun, "--max-restarts", str(restarts), "elastic_hang.py"]
    proc, out = _watch(tmp_path, "--stall", "5", job=job, env=env)
    result = _result(out)
    line = "called from `threading.Event().wait()` at elastic_hang.py:24 in read_shard"
    if not restarts:
        assert proc.returncode == 4, result["reason"]
        assert result["verdict"] == "hang", result["reason"]
        assert result["reason"].startswith("rank 1 (pid "), result["reason"]
        assert line in result["reason"]
        assert not result["evidence"].get("restarted_hangs")
        return
    assert proc.returncode == 0, (result["reason"], proc.stderr[-2000:])
    assert result["verdict"] == "pass", result["reason"]
    (hang,) = result["evidence"]["restarted_hangs"]
    assert (hang["attempt"], hang["unit"]) == (0, 1), hang
    assert hang["reason"].startswith("rank 1 (pid "), hang["reason"]
    assert line in hang["reason"]
    assert len(hang["stopped"]) >= 2  # both ranks of the attempt
    (ended,) = result["evidence"]["restarts"]
    assert (ended["attempt"], ended["hang"]) == (1, hang["reason"])
    assert "; torchrun restarted the ranks 1 time: attempt 1 ended with a hang (" in result["reason"]
    assert "(nsa-diag stopped its ranks for torchrun to restart)" in result["reason"]
    for rank in (0, 1):  # each rank's folder is its restarted process's, which finished
        rank_json = json.loads((_case(out) / "ranks" / str(rank) / "rank.json").read_text())
        info = json.loads((_case(out) / rank_json["folder"] / "probe.json").read_text())
        assert (info["rank"], info["restart_count"]) == (rank, 1)
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow
def test_torchrun_ddp_with_reentrant_checkpointing_names_the_cause(tmp_path: Path) -> None:
    job = _torchrun("ddp_reentrant_checkpoint.py")
    proc, out = _watch(tmp_path, job=job, env={"GLOO_SOCKET_IFNAME": "lo"})
    result = _result(out)
    assert result["verdict"] == "error", result["reason"]
    assert "DDP: parameter layers.2.mlp.2.bias marked ready twice" in result["reason"]
    assert "reentrant activation checkpointing" in result["reason"]
    assert "find_unused_parameters=True took its parameters" in result["reason"]  # the probe's record
    assert "use_reentrant=False" in result["reason"]
    assert {result["evidence"]["processes"][r]["verdict"] for r in ("0", "1")} == {"error"}


@pytest.mark.slow
def test_a_dataloader_worker_killed_by_the_kernel_is_named_killed(tmp_path: Path) -> None:
    """The kernel kills a DataLoader worker (SIGKILL) as it reads a sample. What the main process raises
    is a race (of 14 runs here: torch's "is killed by signal: Killed" 11 times, "exited unexpectedly" 2, a
    ConnectionResetError in multiprocessing 1; of 30 runs of the job alone, 3 a ConnectionResetError that
    Python could not print, torch's SIGCHLD handler raising into the printing: its dump then "lost
    sys.stderr", once in CI a crash). Torch's first: the worker's record says killed by SIGKILL
    (torch said so on the job's stderr) and the OOM killer is named. The others: the workers that ended
    without a normal exit are named, with the OOM killer, after the job's own error."""
    proc, out = _watch(tmp_path, "--stall", "10", job=[PY, "dataloader_worker_killed.py"])
    assert proc.returncode == 1, proc.stderr[-2000:]
    result = _result(out)
    reason = result["reason"]
    assert result["verdict"] == "error", reason
    workers = [
        r["state"] for r in result["evidence"]["processes"].values() if r["role"] == "dataloader-worker"
    ]
    if "is killed by signal: Killed" in reason:
        assert "the kernel's OOM killer usually does" in reason
        assert "killed by SIGKILL" in workers, workers
    else:
        assert reason.startswith(("RuntimeError: DataLoader worker (pid(s) ", "ConnectionResetError")), reason
        assert "; DataLoader workers ended without a normal exit (pid " in reason, reason
        assert "OOM killer: see dmesg" in reason


@pytest.mark.slow
def test_dataloader_worker_exception_is_an_error_with_its_own_message_and_line(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, job=[PY, "dataloader_bad_sample.py"])
    assert proc.returncode == 1, proc.stderr[-2000:]
    result = _result(out)
    assert result["verdict"] == "error", result["reason"]
    assert result["reason"] == (
        "ValueError: sample 137: corrupt record (expected 16 floats, got 3) (in DataLoader worker process 0) "
        "at dataloader_bad_sample.py:20 in __getitem__ (exit code 1)"
    )
    assert result["steps_done"] == 8  # batches 0-7 came before the one with sample 137
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow  # ~40 s: a job whose beacon says done is judged after the 30 s exit-after-done limit
def test_a_job_that_cannot_exit_is_a_hang_naming_the_thread_it_waits_for(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, "--stall", "5", job=[PY, "exit_thread_never_ends.py"])
    result = _result(out)
    assert result["verdict"] == "hang", result["reason"]
    assert result["hang_kind"] == "python-deadlock", result["reason"]
    assert result["steps_done"] == 20
    assert "the process is exiting and cannot" in result["reason"]
    assert "`item = metrics.get()` at exit_thread_never_ends.py:18 in uploader" in result["reason"]
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow
def test_dataloader_worker_that_blocks_is_named(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, "--stall", "3", job=[PY, "dataloader_block.py"])
    result = _result(out)
    assert result["verdict"] == "hang", result["reason"]
    assert "DataLoader worker" in result["reason"]
    assert "dataloader_block.py" in result["reason"]
    assert result["evidence"]["waits_on"]
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow
def test_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(JOBS / "own_site"), str(Path(__file__).parents[2] / "src")])}
    proc, out = _watch(tmp_path, job=[PY, "own_sitecustomize.py"], env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "user sitecustomize: ran" in proc.stdout
    assert _result(out)["verdict"] == "pass"


@pytest.mark.slow
def test_own_sigusr1_handler_is_never_signalled(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, "--stall", "3", job=[PY, "own_sigusr1.py"])
    result = _result(out)
    assert "got SIGUSR1" not in proc.stdout
    assert result["verdict"] == "hang", result["reason"]
    assert result["hang_kind"] == "python-deadlock", result["reason"]  # stacks from the heartbeat thread
    assert "own_sigusr1.py" in result["reason"]
    (pid,) = _job_pids(_case(out))
    probe = json.loads((_case(out) / "procs" / f"pid-{pid}" / "probe.json").read_text())
    assert probe["sigusr1"] == "user"


@pytest.mark.slow
@pytest.mark.parametrize("code, verdict", [(0, "pass"), (4, "crash")])
def test_job_without_torch_is_judged_by_its_exit_status(tmp_path: Path, code: int, verdict: str) -> None:
    proc, out = _watch(tmp_path, job=[PY, "no_torch.py", str(code)])
    assert "most common: ('the', 3)" in proc.stdout
    result = _result(out)
    assert result["verdict"] == verdict, result["reason"]
    assert result["exit_code"] == code, result["reason"]


@pytest.mark.slow
def test_shell_script_starting_python_is_judged_by_its_exit_and_its_python_child(tmp_path: Path) -> None:
    """The command itself is not Python (no probe: never signalled, never stalled); its Python child is."""
    proc, out = _watch(tmp_path, "--stall", "3", job=["bash", "-c", f"{PY} deadlock_backward.py; echo after"])
    result = _result(out)
    assert result["verdict"] == "hang", result["reason"]
    assert result["hang_kind"] == "python-deadlock", result["reason"]
    assert result["evidence"]["location"] == "step 3, backward, layers.1"
    root = result["evidence"]["root_pid"]
    assert result["reason"].startswith("pid ")
    assert not result["reason"].startswith(f"pid {root} ")  # the Python child decided, not bash
    stacks = _case(out) / "procs" / f"pid-{root}" / "stacks.txt"
    assert not stacks.exists()  # bash has no probe: never sent SIGUSR1, no sample asked of it
    assert not any(_alive(p) for p in _job_pids(_case(out)))


@pytest.mark.slow
@pytest.mark.parametrize("limits", [("--stall", "3"), ("--timeout", "12")], ids=["stall", "timeout"])
def test_a_job_that_execs_into_sleep_is_a_hang_of_a_program_no_longer_python(
    tmp_path: Path, limits: tuple[str, str]
) -> None:
    """3 optimizer steps, then os.execvp("sleep"): the probe's heartbeat stops with the Python image, the
    process lives on as `sleep` (no GIL held by anyone). At a stall, and at a timeout that comes first."""
    proc, out = _watch(tmp_path, *limits, job=[PY, "exec_sleep.py"])
    assert proc.returncode == EXIT_HANG, proc.stderr[-2000:]
    result = _result(out)
    assert result["verdict"] == "hang", result["reason"]
    assert result["hang_kind"] == "unknown", result["reason"]
    assert "exec'd into `sleep 600`" in result["reason"]
    assert "no longer Python" in result["reason"]
    assert "GIL" not in result["reason"]
    assert "sleeping" in result["reason"]  # its state: the kernel's nanosleep, no CPU
    assert result["steps_done"] == 3
    assert result["evidence"]["exec"]["into"].endswith("sleep"), result["evidence"].get("exec")
    assert not any(_alive(p) for p in _job_pids(_case(out)))


def test_an_idle_program_without_progress_at_the_timeout_is_a_hang_not_slow(tmp_path: Path) -> None:
    """`sleep` reports no progress (not Python: no probe) and does nothing: not slow, which needs progress
    or work that went on; idle, it is a hang, and the reason says what was seen."""
    proc, out = _watch(tmp_path, "--timeout", "3", job=["sleep", "60"], timeout=60)
    assert proc.returncode == EXIT_HANG, proc.stderr[-2000:]
    result = _result(out)
    assert result["verdict"] == "hang", result["reason"]
    assert result["hang_kind"] == "unknown", result["reason"]
    assert "no progress reported" in result["reason"]
    assert "progress continued" not in result["reason"]
    assert "`sleep 60` is not Python" in result["reason"]
    assert "idle" in result["reason"]
    assert "CPU 0%" in result["reason"]
    assert "state S" in result["reason"]


def test_a_busy_program_without_progress_at_the_timeout_is_slow_without_claiming_progress(
    tmp_path: Path,
) -> None:
    proc, out = _watch(tmp_path, "--timeout", "3", job=["sh", "-c", "while :; do :; done"], timeout=60)
    assert proc.returncode == 1, proc.stderr[-2000:]
    result = _result(out)
    assert result["verdict"] == "slow", result["reason"]
    assert "no progress reported, and not idle" in result["reason"]
    assert "`sh -c while :; do :; done` is not Python" in result["reason"]
    assert "progress continued" not in result["reason"]


# --- GPU ----------------------------------------------------------------------------------------------


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() < 1, reason="needs CUDA")
def test_gpu_kernel_spin_is_a_cuda_kernel_hang(tmp_path: Path) -> None:
    proc, out = _watch(tmp_path, "--stall", "5", job=[PY, "gpu_spin.py"])
    result = _result(out)
    assert result["verdict"] == "hang", result["reason"]
    assert result["hang_kind"] == "cuda-kernel", result["reason"]


@pytest.mark.skipif(_cuda_devices() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize(
    ("script", "verdict", "says"),
    [
        pytest.param("ddp_unused_param.py", "grad-missing", "aux_head.weight", id="unused"),
        pytest.param("ddp_reentrant_checkpoint.py", "error", "marked ready twice", id="reentrant"),
    ],
)
def test_nccl_ddp_errors_are_named(tmp_path: Path, script: str, verdict: str, says: str) -> None:
    proc, out = _watch(tmp_path, job=_torchrun(script, "--nccl"))
    result = _result(out)
    assert result["verdict"] == verdict, result["reason"]
    assert says in result["reason"]


@pytest.mark.skipif(_cuda_devices() < 2, reason="needs 2 CUDA devices")
def test_nccl_rank_skipping_an_all_reduce_is_a_collective_hang(tmp_path: Path) -> None:
    job = [str(Path(PY).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
           "ddp_skip_allreduce.py", "--nccl"]  # fmt: skip
    proc, out = _watch(tmp_path, "--stall", "5", job=job)
    result = _result(out)
    assert result["verdict"] == "hang", result["reason"]
    # the stuck rank's own wait (a sleep: no work) or the collective of the rank that waits for it
    assert result["hang_kind"] in ("collective", "python-deadlock"), result["reason"]
    assert result["evidence"]["minority_ranks"] == [1]


# --- a small file system: a tmpfs in a mount namespace of our own ----------------------------------------


def _small_fs_argv(mount: Path, size: str, *argv: str | Path) -> list[str]:
    """``argv`` run with a ``size`` tmpfs mounted at ``mount`` (visible to it alone: a mount namespace,
    as root of a user namespace when we are not root)."""
    script = 'mount -t tmpfs -o "size=$1" tmpfs "$2" && shift 2 && exec "$@"'
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "sh", "-c", script, "sh", size, str(mount), *map(str, argv)]


def _can_mount_small_fs(tmp_path: Path) -> bool:
    probe = tmp_path / "probe-mount"
    probe.mkdir()
    try:
        proc = subprocess.run(_small_fs_argv(probe, "1m", "true"), capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _watch_on_small_fs(tmp_path: Path, job: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`nsa-diag watch -- python JOB` with its job's directory and --out on a 20 MB file system; the run
    folder is copied out before the file system goes away with its namespace."""
    if not _can_mount_small_fs(tmp_path):
        pytest.skip("cannot mount a tmpfs here (no mount namespace: unshare refused)")
    mount, kept = tmp_path / "fs", tmp_path / "kept"
    mount.mkdir()
    script = (
        f'cp {JOBS / job} "$1/" && cd "$1" && {PY} -m nsa_diag watch --out "$1/runs" -- {PY} {job} '
        '>"$2/stdout" 2>"$2/stderr"; echo $? >"$2/rc"; df -B1 --output=avail "$1" | tail -1 >"$2/free"; '
        'cp -a "$1/runs" "$2/runs"'
    )
    kept.mkdir()
    subprocess.run(
        _small_fs_argv(mount, "20m", "sh", "-c", script, "sh", mount, kept),
        env=cli_env(),
        timeout=240,
        check=True,
    )
    rc = int((kept / "rc").read_text())
    proc = subprocess.CompletedProcess([], rc, (kept / "stdout").read_text(), (kept / "stderr").read_text())
    return proc, kept


def test_a_job_printing_40_mb_on_a_20_mb_disk_gets_capped_logs_and_its_summary(tmp_path: Path) -> None:
    """The log keeps its head and its tail, with a line saying how much was dropped between them, and
    leaves the case's own files room: result.json, summary.json and summary.md, no temporary file."""
    from nsa_diag.logcap import LOG_HEAD, LOG_TAIL

    proc, kept = _watch_on_small_fs(tmp_path, "prints_40mb.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    out = kept / "runs"
    assert _result(out)["verdict"] == "pass"
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    assert (run / "summary.json").is_file()
    assert (run / "summary.md").is_file()
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name]
    log = (_case(out) / "stdout.log").read_bytes()
    assert len(log) <= LOG_HEAD + LOG_TAIL + 1024
    assert log.startswith(b"first line\n")
    assert log.endswith(b"x\nthe end\n")
    (marker,) = [line for line in log.splitlines() if line.startswith(b"[nsa-diag: ")]
    assert log[LOG_HEAD:].startswith(b"\n" + marker + b"\n")  # on a line of its own, after the head
    tail = len(log) - LOG_HEAD - len(marker) - 2
    assert int(marker.split()[1]) == 11 + 40 * 2**20 + 8 - LOG_HEAD - tail  # the bytes dropped
    assert int((kept / "free").read_text()) >= 2 * 2**20  # room left on the disk
    assert proc.stdout.count("x" * 1023 + "\n") == 40 * 1024  # the terminal still got everything
    assert "x\nthe end\n" in proc.stdout


def test_a_job_that_fills_its_disk_still_gets_its_result_and_summary(tmp_path: Path) -> None:
    """The job's own checkpoint takes the last byte of the disk the run folder is on: the run folder's
    space reserved at its start is given back for its result and summary."""
    proc, kept = _watch_on_small_fs(tmp_path, "fills_disk.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "No space left on device" in proc.stdout  # the job did fill it
    out = kept / "runs"
    assert _result(out)["verdict"] == "pass"
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    assert (run / "summary.json").is_file()
    assert (run / "summary.md").is_file()
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name]
    assert not (run / ".nsa-diag.reserve").exists()


def test_a_capped_log_keeps_its_head_and_tail_and_says_what_it_dropped(tmp_path: Path) -> None:
    from nsa_diag.logcap import CappedLog

    log = CappedLog(tmp_path / "stdout.log", head=100, tail=50, reserve=0)
    lines = [f"line {i:04d}\n".encode() for i in range(1000)]  # 10 bytes each
    for line in lines:
        log.write(line)
    log.close()
    text = (tmp_path / "stdout.log").read_bytes()
    head, marker, tail = text[:100], text[100:].split(b"\n")[0], text[100:].partition(b"\n")[2]
    assert head == b"".join(lines[:10])
    assert tail == b"".join(lines[-5:])
    assert marker.startswith(b"[nsa-diag: 9850 bytes of output dropped here")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compiled_job_passes_and_the_probe_breaks_no_graph(tmp_path: Path, backend: str) -> None:
    """torch.compile in the user's own loop: the probe finds the model's blocks, its hooks stay silent
    inside the traced graph (no graph break of theirs: the job counts Dynamo's), steps come from the
    optimizer. Inductor compiles from an empty cache for longer than the stall limit: not a hang."""
    if backend == "inductor" and shutil.which("g++") is None:
        pytest.skip("inductor on the CPU needs a C++ compiler")
    env = {**os.environ, "COMPILE_BACKEND": backend, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    stall = ["--stall", "5"] if backend == "inductor" else []
    proc, out = _watch(tmp_path, *stall, job=[PY, "compiled_loop.py"], env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "graph breaks 0" in proc.stdout
    result = _result(out)
    assert result["verdict"] == "pass", result["reason"]
    assert result["steps_done"] == 5
    roles = {int(p): info["role"] for p, info in result["evidence"]["processes"].items()}
    (pid,) = [p for p, role in roles.items() if role == "training"]
    assert set(roles) == set(_job_pids(_case(out)))
    if backend == "inductor":  # its compile workers: helpers, never the verdict's process
        assert len(roles) > 1
        assert {role for p, role in roles.items() if p != pid} == {"helper"}
    probe = json.loads((_case(out) / "procs" / f"pid-{pid}" / "probe.json").read_text())
    assert probe["model"]["blocks"] == "layers"
