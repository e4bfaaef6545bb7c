"""The runner end to end with the real worker: verdicts, evidence files, and no process left behind.

Each test runs real cases of the tiny model on the CPU (S=64, one step, stall 2 s) with real injected
faults, real signals and real process groups; and nsa-diag itself is interrupted with SIGINT, SIGTERM and
SIGHUP (a closed terminal) in the middle of a hung case.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nsa_diag import artifacts
from nsa_diag.beacon import BeaconState, read_beacon
from nsa_diag.evidence import gpu, live, procfs, stacks
from nsa_diag.executor import run_case, run_cases
from nsa_diag.spec import CaseResult, CaseSpec, Injection

FAST = {"seq_len": 64, "steps": 1, "stall": 2.0, "timeout": 60.0, "device": "cpu"}
PATIENT = {"stall": 30.0}  # cases that must not hang: a loaded machine may pause a worker for seconds


def make_spec(name: str, *inject: str, **fields: object) -> CaseSpec:
    return CaseSpec(name=name, inject=tuple(Injection.parse(i) for i in inject), **{**FAST, **fields})  # type: ignore[arg-type]


def assert_no_process_left(case_dir: Path) -> None:
    """No child of this process and no process naming the case folder is alive; the case's internal files
    (the beacon that held the worker's pid among them) are gone."""
    mine = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert mine == []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if str(case_dir) in " ".join(proc.info["cmdline"] or ()):
            assert proc.info["status"] == psutil.STATUS_ZOMBIE, proc
    assert [name for name in artifacts.INTERNAL_FILES if (case_dir / name).exists()] == []


def assert_result_file(case_dir: Path, result: CaseResult) -> None:
    on_disk = CaseResult.model_validate(artifacts.read_json(case_dir / artifacts.RESULT))
    assert on_disk == result
    assert artifacts.RESULT in result.files
    assert sorted(result.files) == result.files


def test_pass_through_run_cases(tmp_path: Path) -> None:
    events: list[str] = []
    states: list[BeaconState | None] = []
    spec = make_spec("ok", **PATIENT)
    results = run_cases(
        [spec],
        tmp_path,
        replay_argv={"ok": ["nsa-diag", "run", "--seq-len", "64"]},
        on_case_start=lambda s: events.append(f"start {s.name}"),
        on_progress=lambda state, elapsed: states.append(state),
        on_case_end=lambda r: events.append(f"end {r.verdict}"),
    )
    assert events == ["start ok", "end pass"]
    (result,) = results
    case_dir = tmp_path / "cases" / "ok"
    assert result.verdict == "pass", result.reason
    assert result.exit_code == 0
    assert result.steps_done == 1
    assert result.metrics["loss"]
    assert result.where is not None
    assert result.where.phase == "done"
    assert any(s is not None for s in states)
    for name in (
        artifacts.SPEC,
        artifacts.REPLAY,
        artifacts.PROGRESS,
        artifacts.STDERR,
        artifacts.WORKER_RESULT,
    ):
        assert name in result.files
    assert artifacts.PYSPY not in result.files  # stacks are taken on a hang or slow case only
    assert not set(artifacts.INTERNAL_FILES) & set(result.files)
    assert_result_file(case_dir, result)
    env = artifacts.read_json(tmp_path / artifacts.ENV)
    assert env["torch"]["version"]
    replay = (case_dir / artifacts.REPLAY).read_text()
    assert "nsa-diag run --seq-len 64" in replay
    assert os.access(case_dir / artifacts.REPLAY, os.X_OK)
    assert CaseSpec.model_validate(artifacts.read_json(case_dir / artifacts.SPEC)) == spec
    assert_no_process_left(case_dir)


def test_deadlock_is_a_python_deadlock_at_layer_1_backward_with_two_stack_samples(tmp_path: Path) -> None:
    case_dir = tmp_path / "deadlock"
    result = run_case(make_spec("deadlock", "deadlock:layer=1"), case_dir)
    assert (result.verdict, result.hang_kind) == ("hang", "python-deadlock"), result.reason
    assert "layer 1 backward" in result.reason
    assert "lock acquire" in result.reason
    assert "both stack samples" in result.reason
    assert result.where is not None
    assert (result.where.layer, result.where.phase, result.where.step) == (1, "backward", 1)
    assert result.stall_limit_s == 2.0
    assert result.signal == "SIGTERM"
    stacks_text = (case_dir / artifacts.STACKS).read_text()
    assert stacks_text.count("=== stack sample") == 2
    assert stacks_text.count("_deadlock_lock_acquire") == 2
    ev = result.evidence
    assert ev["outcome"] == "stalled"
    assert ev["cpu_percent"] < 20
    assert ev["heartbeat"]["advancing"] is True
    assert ev["memory_at_hang"]["written"] is True
    assert "at_hang" in artifacts.read_json(case_dir / artifacts.MEMORY_STATS)
    proc = artifacts.read_json(case_dir / artifacts.PROC)
    assert proc["processes"][0]["threads"]
    assert ev["gpu"]["available"] is False
    assert ev["gpu"]["why"]
    if shutil.which("py-spy"):
        assert ev["pyspy"]["taken"] is True
        assert "_deadlock_lock_acquire" in (case_dir / artifacts.PYSPY).read_text()
    # the runner asked the worker for memory evidence at the hang: request and answer are gone with the case
    assert not set(artifacts.INTERNAL_FILES) & set(result.files)
    assert not (case_dir / artifacts.DUMP_REQUEST).exists()
    assert not (case_dir / artifacts.DUMP_DONE).exists()
    assert_result_file(case_dir, result)
    assert_no_process_left(case_dir)


@pytest.mark.parametrize(
    ("inject", "kind"),
    [  # python-busy is also told from recorded evidence (test_classify): its live run in make test-slow
        pytest.param("busy", "python-busy", id="busy", marks=pytest.mark.slow),
        pytest.param("gil-hog", "gil-held", id="gil-hog"),
    ],
)
def test_busy_and_gil_held_hangs_without_pyspy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inject: str, kind: str
) -> None:
    path = os.environ.get("PATH", "").split(os.pathsep)
    monkeypatch.setenv("PATH", os.pathsep.join(d for d in path if not (Path(d) / "py-spy").exists()))
    monkeypatch.setattr(stacks.sysconfig, "get_path", lambda name: str(tmp_path / "no-scripts"))
    case_dir = tmp_path / inject
    result = run_case(make_spec(inject, inject), case_dir)
    assert (result.verdict, result.hang_kind) == ("hang", kind), result.reason
    assert "layer 0 backward" in result.reason
    assert result.evidence["pyspy"]["taken"] is False
    assert "py-spy is not on PATH" in result.evidence["pyspy"]["why"]
    assert artifacts.PYSPY not in result.files
    assert_no_process_left(case_dir)


def test_a_deadlock_is_a_hang_when_the_timeout_comes_before_the_stall_limit(tmp_path: Path) -> None:
    # Issue 15 #1: in step 1 the auto limit is 120 s, so the timeout decides; an idle worker is not
    # "still progressing". (15 s: start-up on a loaded machine takes seconds of it.)
    case_dir = tmp_path / "deadlock"
    result = run_case(make_spec("deadlock", "deadlock:layer=1", stall="auto", timeout=15.0), case_dir)
    assert (result.verdict, result.hang_kind) == ("hang", "python-deadlock"), result.reason
    assert "when the 15 s timeout ran out" in result.reason
    assert result.evidence["outcome"] == "timeout"
    assert result.evidence["progressed_during_evidence"] is False
    assert_no_process_left(case_dir)


@pytest.mark.slow
def test_slow_is_told_from_a_hang_with_rate_and_eta(tmp_path: Path) -> None:
    case_dir = tmp_path / "slow"
    # the timeout covers start-up too (a CUDA build of torch, or a loaded CI machine, takes over 15 s):
    # leave room for some steps; 200 steps need 60 s of sleeps alone. The stall limit is far above the
    # 0.3 s steps (a loaded CI machine once left a 4.1 s gap between two events)
    spec = make_spec("slow", "slow:seconds=0.3", steps=200, stall=10.0, timeout=30.0)
    result = run_case(spec, case_dir)
    assert result.verdict == "slow", result.reason
    assert result.hang_kind is None
    assert "30 s timeout" in result.reason
    assert result.rate is not None
    assert 0 < result.rate["fraction_done"] < 1
    assert result.rate["eta_s"] > 0
    assert result.rate["steps_per_s"] > 0
    assert "needs about" in result.reason
    assert (case_dir / artifacts.STACKS).read_text().count("=== stack sample") == 2
    assert_no_process_left(case_dir)


@pytest.mark.parametrize(
    ("inject", "signal_name", "words"),
    [
        pytest.param("segfault", "SIGSEGV", "killed by SIGSEGV (Segmentation fault)", id="segfault"),
        pytest.param("exit", None, "exited with code 17 without a result", id="exit"),
    ],
)
def test_crashes(tmp_path: Path, inject: str, signal_name: str | None, words: str) -> None:
    case_dir = tmp_path / inject
    result = run_case(make_spec(inject, inject, **PATIENT), case_dir)
    assert result.verdict == "crash", result.reason
    assert result.signal == signal_name
    assert words in result.reason
    assert "layer 0 backward step 1" in result.reason
    assert artifacts.WORKER_RESULT not in result.files
    assert_result_file(case_dir, result)
    assert_no_process_left(case_dir)


def _wait_for(predicate: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


@pytest.mark.parametrize(
    "signum",
    [  # SIGTERM and SIGHUP take the same path as SIGINT (SIGHUP from the CLI: test_processes): make test-slow
        pytest.param(signal.SIGINT, id="SIGINT"),
        pytest.param(signal.SIGTERM, id="SIGTERM", marks=pytest.mark.slow),
        pytest.param(signal.SIGHUP, id="SIGHUP", marks=pytest.mark.slow),
    ],
)
def test_interrupting_nsa_diag_stops_the_worker_and_writes_the_result(tmp_path: Path, signum: int) -> None:
    argv = [sys.executable, "-m", "nsa_diag", "run", "--inject", "deadlock:layer=1", "--stall", "60"]
    argv += ["--seq-len", "64", "--device", "cpu", "--out", str(tmp_path)]
    cli = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:

        def hung() -> bool:
            beacons = list(tmp_path.glob("*/cases/*/" + artifacts.BEACON))
            state = read_beacon(beacons[0]) if beacons else None
            return state is not None and (state.layer, state.phase) == (1, "backward")

        _wait_for(hung, 60)
        time.sleep(0.3)
        cli.send_signal(signum)
        out, err = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 130, err.decode()
    (case_dir,) = tmp_path.glob("*/cases/*")
    result = json.loads((case_dir / artifacts.RESULT).read_text())
    assert result["verdict"] == "error"
    assert result["reason"].startswith(f"interrupted by {signal.Signals(signum).name} after ")
    assert "layer 1 backward" in result["reason"]
    assert result["evidence"]["stack_samples"] == 1
    stacks_text = (case_dir / artifacts.STACKS).read_text()
    assert "(nsa-diag interrupted)" in stacks_text
    assert "_deadlock_lock_acquire" in stacks_text
    assert_no_process_left(case_dir)


# --- evidence readers -----------------------------------------------------------------------------------


def test_procfs_reads_state_cpu_and_threads_of_a_live_process() -> None:
    stat = procfs.parse_stat("123 (a (weird) name) S 1 123 123 0 -1 0 0 0 0 0 250 50 0 0 20 0 3 0 0 0 0")
    assert (stat["comm"], stat["state"], stat["pgrp"], stat["session"]) == ("a (weird) name", "S", 123, 123)
    assert stat["utime_s"] == pytest.approx(250 / procfs.CLOCK_TICKS)
    assert stat["num_threads"] == 3
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        _wait_for(lambda: (procfs.read_stat(sleeper.pid) or {}).get("state") == "S", 10)
        snapshot = procfs.group_snapshot(sleeper.pid)
        (process,) = snapshot["processes"]
        assert process["pid"] == sleeper.pid
        assert process["state_name"] == "sleeping"
        assert "VmRSS" in process["status"]
        main = procfs.main_thread(process)
        assert main is not None
        assert main["state"] == "S"
        assert procfs.cpu_seconds(sleeper.pid) is not None
        assert procfs.session_pids(sleeper.pid) == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert procfs.read_stat(sleeper.pid) is None
    assert procfs.process_snapshot(sleeper.pid) == {"pid": sleeper.pid, "gone": True}
    assert procfs.cpu_percent(1.0, 1.5, 1.0) == 50.0
    assert procfs.cpu_percent(None, 1.5, 1.0) is None


def test_gpu_evidence_answers_or_says_why() -> None:
    snapshot = gpu.nvml_snapshot()
    if snapshot["available"]:
        assert snapshot["gpus"]
        assert "utilization_gpu_percent" in snapshot["gpus"][0]
    else:
        assert snapshot["why"]
    text, why = gpu.nvidia_smi()
    assert (text is None) != (why is None)


def test_gpu_utilization_of_the_case() -> None:
    snapshot = {
        "available": True,
        "gpus": [
            {"index": 0, "utilization_gpu_percent": 5, "processes": [{"pid": 11}]},
            {"index": 1, "utilization_gpu_percent": 100, "processes": [{"pid": 99}]},
        ],
    }
    assert gpu.worker_utilization(snapshot, [11]) == 5.0
    assert gpu.worker_utilization(snapshot, [42]) == 100.0  # pids not visible (container): busiest GPU
    assert gpu.worker_utilization({"available": False, "why": "no GPU"}, [11]) is None


def test_pyspy_off_path_is_the_one_installed_beside_nsa_diag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A virtual environment run without activating it (pipx's, uv tool's): py-spy, a dependency, is in its
    scripts folder but not on PATH; that one runs. With neither, the reason says what to install."""
    scripts = tmp_path / "venv-bin"
    scripts.mkdir()
    (scripts / "py-spy").write_text("#!/bin/sh\n")
    (scripts / "py-spy").chmod(0o755)
    monkeypatch.setattr(stacks.sysconfig, "get_path", lambda name: str(scripts))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert stacks.pyspy_exe() == str(scripts / "py-spy")
    monkeypatch.setattr(stacks.sysconfig, "get_path", lambda name: str(tmp_path / "empty"))
    assert stacks.pyspy_exe() is None
    assert (
        stacks.pyspy_missing() == f"py-spy is not on PATH, nor beside nsa-diag's Python; {stacks.PYSPY_HINT}"
    )
    assert stacks.pyspy_dump(1, tmp_path / "none.txt")["why"] == stacks.pyspy_missing()
    advice = live.pyspy_advice([5], installed=False, refused=False, ptrace={"ptrace_scope": 0})
    assert advice is not None
    assert advice.startswith("py-spy is not installed (a dependency of nsa-diag: `pip install py-spy`)")


def test_pyspy_dump_or_why_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        taken = stacks.pyspy_dump(sleeper.pid, tmp_path / "pyspy.txt")
        if stacks.pyspy_exe():
            assert taken["taken"] is True, taken
            threads = stacks.parse_pyspy((tmp_path / "pyspy.txt").read_text())
            assert any(t.is_main for t in threads)
        else:
            assert "py-spy is not on PATH" in taken["why"]
        monkeypatch.setenv("PATH", str(tmp_path))
        monkeypatch.setattr(stacks.sysconfig, "get_path", lambda name: str(tmp_path / "no-scripts"))
        missing = stacks.pyspy_dump(sleeper.pid, tmp_path / "none.txt")
        assert missing == {"taken": False, "why": stacks.pyspy_missing()}
        assert missing["why"].startswith("py-spy is not on PATH, nor beside")
    finally:
        sleeper.kill()
        sleeper.wait()
