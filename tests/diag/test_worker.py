"""The worker as a real process: ``python -m nsa_diag.worker <case_dir>`` on small CPU cases.

Every case starts at once (module fixture); each test then reads its own case folder: worker_result.json,
progress.jsonl, the beacon, stacks.txt. Cases that hang (deadlock, busy, gil-hog) are checked while alive
and then killed with their process group. One case (`ENTRY_POINT`) runs as ``python -m nsa_diag.worker``;
the others are forked from a server that imported torch once (`diag_worker_fork`: ~4 s of CPU less each),
then start as that command does after its imports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from diag_worker_fork import ForkedWorker, stop_server

from nsa_diag import artifacts
from nsa_diag.beacon import BeaconState, BeaconWriter, read_beacon
from nsa_diag.spec import CaseSpec, Injection, WorkerReport

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

TINY: dict[str, Any] = dict(seq_len=32, batch=2, steps=1, device="cpu")
# name -> CaseSpec fields (over TINY); "inject" takes --inject strings.
CASES: dict[str, dict[str, Any]] = {
    # the hanging ones first: they are checked (and killed) first
    "busy": dict(inject=["busy:layer=1,phase=forward"]),
    "deadlock": dict(inject=["deadlock:layer=1,phase=backward"]),
    "gil-hog": dict(inject=["gil-hog:layer=0,phase=recompute"], overrides=dict(gc="0:1")),
    "pass-gc": dict(steps=2, branch_marks=True, overrides=dict(gc="all")),
    "profile": dict(steps=2, profile=True, overrides=dict(gc="0:1")),
    "nan-forward": dict(inject=["nan:layer=1,phase=forward"]),
    "nan-backward": dict(inject=["nan:layer=1,phase=backward"]),
    "nan-recompute": dict(inject=["nan:layer=1,phase=recompute"], overrides=dict(gc="all")),
    "oom": dict(inject=["oom:layer=1,phase=backward"]),
    "unused-param": dict(inject=["unused-param:layer=1"]),
    "exit": dict(inject=["exit:layer=0,phase=forward"]),
    "segfault": dict(inject=["segfault:layer=1,phase=backward"]),
    "abort": dict(inject=["abort:layer=0,phase=backward"]),
    "slow": dict(steps=3, inject=["slow:layer=0,phase=forward,step=2,seconds=0.3"]),
    "parity": dict(batch=1, reference_check=True, overrides=dict(sel_backend="masked", win_backend="masked")),
    "mismatch": dict(batch=1, seq_len=16, reference_check=True, tolerance=1e-15),
    "parity-bf16": dict(batch=1, dtype="bf16", reference_check=True, overrides=dict(sel_backend="gather")),
    "forced-sel": dict(branch_marks=True, overrides=dict(force_branch="sel")),
    "user-model": dict(steps=2, model="diag_user_model:build", reference_check=True),
    "bad-factory": dict(model="diag_user_model_missing:build"),
    "gpu-spin": dict(inject=["gpu-spin"]),
}


ENTRY_POINT = "pass-gc"  # started as `python -m nsa_diag.worker CASE`, as the runner starts a worker


def _env() -> dict[str, str]:
    paths = [str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _worker(case: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "nsa_diag.worker", str(case)],
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=(case / artifacts.STDOUT).open("wb"),
        stderr=(case / artifacts.STDERR).open("wb"),
        start_new_session=True,
    )


def _forked(case: Path) -> ForkedWorker:
    return ForkedWorker(case, case / artifacts.STDOUT, case / artifacts.STDERR)


def _kill(proc: subprocess.Popen[bytes] | ForkedWorker) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


class Case:
    """One running or finished worker and its case folder."""

    def __init__(self, path: Path, proc: subprocess.Popen[bytes] | ForkedWorker) -> None:
        self.path, self.proc = path, proc

    def wait(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout=timeout)

    def result(self) -> dict[str, Any]:
        self.wait()
        return json.loads((self.path / artifacts.WORKER_RESULT).read_text())

    def progress(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.path / artifacts.PROGRESS).read_text().splitlines()]

    def beacon(self) -> BeaconState | None:
        return read_beacon(self.path / artifacts.BEACON)

    def wait_until(self, where: dict[str, Any], timeout: float = 90) -> BeaconState:
        """Poll the beacon until it reports `where` (all given fields), as the watchdog would."""
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.beacon()
            if state is not None and all(state.where()[k] == v for k, v in where.items()):
                return state
            assert self.proc.poll() is None, f"worker ended ({self.proc.returncode}) at {state}"
            time.sleep(0.05)
        raise AssertionError(f"beacon never reached {where}; last {state}")


# Cases that only a slow test reads (by its name in this module): started only where that test runs
# (`make test` leaves them out; busy's loop would spin a core for the whole module, the others would
# start a worker, ~4 s of CPU, for nothing).
READ_ONLY_BY = {
    "busy": "test_busy_loop_keeps_the_heartbeat_and_the_beacon_at_layer_1_forward",
    "deadlock": "test_deadlock_waits_at_layer_1_backward_and_answers_a_dump_request",
    "abort": "test_process_ending_faults[abort]",
}


@pytest.fixture(scope="module")
def cases(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Case]]:
    selected = {item.name for item in request.session.items if item.path == request.path}
    root = tmp_path_factory.mktemp("worker")
    started: dict[str, Case] = {}
    try:
        for name, fields in CASES.items():
            if name in READ_ONLY_BY and READ_ONLY_BY[name] not in selected:
                continue
            path = root / name
            path.mkdir()
            spec = {**TINY, **fields, "name": name}
            spec["inject"] = [Injection.parse(text) for text in spec.get("inject", [])]
            artifacts.write_json(path / artifacts.SPEC, CaseSpec(**spec))
            started[name] = Case(path, _worker(path) if name == ENTRY_POINT else _forked(path))
        yield started
    finally:
        for case in started.values():
            _kill(case.proc)
        stop_server()


def _events(case: Case, **match: Any) -> list[dict[str, Any]]:
    return [e for e in case.progress() if all(e.get(k) == v for k, v in match.items())]


# --------------------------------------------------------------------------------------- hangs (alive)


def _check_hang(case: Case, kind: str, where: dict[str, Any], *, heartbeat: bool, frame: str) -> None:
    case.wait_until(where)
    # the fault starts just after its progress event: a heartbeat may still tick in between (seen on a
    # loaded CI machine, 0.15 s after the event), so the hang is read from a moment later
    time.sleep(0.5)
    first = case.beacon()
    assert first is not None
    time.sleep(2.0)
    later = case.beacon()
    assert case.proc.poll() is None, "a hang must not end by itself"
    assert later is not None
    assert later.seq == first.seq, "no progress while hung"
    assert later.pid == case.proc.pid
    assert (later.heartbeat > first.heartbeat) is heartbeat
    # a stack sample on request (the runner's SIGUSR1) names the fault's frame
    os.kill(case.proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while frame not in (case.path / artifacts.STACKS).read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert frame in (case.path / artifacts.STACKS).read_text()
    assert case.proc.poll() is None, "SIGUSR1 samples the stacks and changes nothing else"
    fired = _events(case, event="inject")
    assert [(e["kind"], e["layer"], e["phase"]) for e in fired] == [(kind, where["layer"], where["phase"])]
    _kill(case.proc)


@pytest.mark.slow
def test_busy_loop_keeps_the_heartbeat_and_the_beacon_at_layer_1_forward(cases: dict[str, Case]) -> None:
    where = dict(phase="forward", step=1, layer=1, event="begin", module="blocks.1")
    _check_hang(cases["busy"], "busy", where, heartbeat=True, frame="_busy_python_loop")


@pytest.mark.slow  # 50 s; test_runner's deadlock tests stay
def test_deadlock_waits_at_layer_1_backward_and_answers_a_dump_request(cases: dict[str, Case]) -> None:
    case = cases["deadlock"]
    case.wait_until(dict(phase="backward", layer=1))
    (case.path / artifacts.DUMP_REQUEST).touch()
    deadline = time.monotonic() + 10
    while not (case.path / artifacts.DUMP_DONE).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (case.path / artifacts.DUMP_DONE).read_text().strip() == "ok"
    stats = json.loads((case.path / artifacts.MEMORY_STATS).read_text())
    assert {"after_forward", "at_hang"} <= set(stats)
    assert stats["at_hang"]["cpu_rss_bytes"] > 0
    where = dict(phase="backward", step=1, layer=1, event="begin", module="blocks.1")
    _check_hang(case, "deadlock", where, heartbeat=True, frame="_deadlock_lock_acquire")


def test_gil_hog_stops_the_heartbeat_in_layer_0_recompute(cases: dict[str, Case]) -> None:
    where = dict(phase="recompute", step=1, layer=0, event="begin", module="blocks.0")
    _check_hang(cases["gil-hog"], "gil-hog", where, heartbeat=False, frame="_gil_hog_c_read")


# ------------------------------------------------------------------------------------ finished cases


def test_pass_reports_metrics_memory_and_every_progress_event(cases: dict[str, Case]) -> None:
    case = cases["pass-gc"]
    assert case.wait() == 0
    result = case.result()
    assert result["status"] == "ok"
    assert result["device"] == "cpu"
    assert result["steps_done"] == 2
    assert result["exception"] is None
    assert result["missing_grads"] == []
    assert result["nonfinite"] is None
    metrics = result["metrics"]
    assert len(metrics["loss"]) == len(metrics["grad_norm"]) == len(metrics["step_s"]) == 2
    for phase in ("forward", "backward", "optimizer"):
        assert len(metrics["phase_s"][phase]) == 2
    assert metrics["phase_s"]["setup"] > 0
    spec = json.loads((case.path / artifacts.SPEC).read_text())
    assert metrics["tokens_per_s_steps"] == "2.."  # step 1 warms up (kernel compilation): left out
    expected = spec["batch"] * spec["seq_len"] / metrics["step_s"][1]
    assert metrics["tokens_per_s"] == pytest.approx(expected)
    assert metrics["params"] > 0
    assert metrics["dtype"] == "fp32"
    assert metrics["peak_memory"]["cpu_peak_rss_bytes"] > 0
    memory = json.loads((case.path / artifacts.MEMORY_STATS).read_text())
    assert {"after_forward", "after_backward"} <= set(memory)

    events = case.progress()
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    seen = {(e["step"], e["phase"], e["layer"], e["branch"], e["event"]) for e in events}
    for step in (1, 2):
        for layer in (0, 1):
            for phase in ("forward", "backward"):
                for event in ("begin", "end"):
                    assert (step, phase, layer, None, event) in seen
                for branch in ("cmp", "sel", "win"):  # a branch has one mark, where its backward begins
                    assert ((step, phase, layer, branch, "begin") in seen) == (phase == "backward")
                    assert (step, phase, layer, branch, "end") not in seen
            # gc=all: each block re-runs its forward inside backward
            assert (step, "recompute", layer, None, "begin") in seen
    tap = _events(case, step=1, phase="backward", layer=1, branch="sel", event="begin")
    assert tap[0]["module"] == "blocks.1.attn.branch_out.sel"
    ends = _events(case, phase="step", event="end")
    assert [e["loss"] for e in ends] == metrics["loss"]
    assert events[-1]["phase"] == "done"
    assert events[-1]["status"] == "ok"

    beacon = case.beacon()
    assert beacon is not None
    assert beacon.phase == "done"
    assert beacon.seq == len(events)
    assert beacon.pid == case.proc.pid
    assert beacon.heartbeat > 0
    assert (case.path / artifacts.STACKS).read_text() == ""


@pytest.mark.parametrize(
    "name, where, module, seen",
    [
        ("nan-forward", "loss", "blocks.1", "input"),
        ("nan-backward", "grad", "blocks.1", "output gradient"),
        ("nan-recompute", "grad", "blocks.1", "input (recompute)"),
    ],
)
def test_nan_is_nonfinite_with_the_module(
    cases: dict[str, Case], name: str, where: str, module: str, seen: str
) -> None:
    case = cases[name]
    assert case.wait() == 1
    result = case.result()
    assert result["status"] == "nonfinite", result["reason"]
    assert result["nonfinite"] == {"where": where, "module": module, "seen": seen, "step": 1}
    assert module in result["reason"]
    assert _events(case, phase="check", event="begin")[0]["check"] == "nonfinite"


def test_oom_is_oom_where_it_happened(cases: dict[str, Case]) -> None:
    case = cases["oom"]
    assert case.wait() == 1
    result = case.result()
    assert result["status"] == "oom"
    assert "layer 1 backward" in result["reason"]
    assert result["exception"]["type"] in ("RuntimeError", "OutOfMemoryError")
    assert "_oom_allocate" in result["exception"]["traceback"]


def test_unused_param_is_grad_missing_naming_kv_win(cases: dict[str, Case]) -> None:
    result = cases["unused-param"].result()
    assert result["status"] == "grad-missing"
    assert result["missing_grads"] == ["blocks.1.attn.kv_win.weight"]
    assert "blocks.1.attn.kv_win.weight" in result["reason"]


@pytest.mark.parametrize(
    "name, code, fatal",
    [
        pytest.param("exit", 17, None, id="exit"),
        pytest.param("segfault", -signal.SIGSEGV, "Segmentation fault", id="segfault"),
        # faulthandler's fatal-signal path as segfault's, another signal: make test-slow
        pytest.param("abort", -signal.SIGABRT, "Aborted", id="abort", marks=pytest.mark.slow),
    ],
)
def test_process_ending_faults(cases: dict[str, Case], name: str, code: int, fatal: str | None) -> None:
    case = cases[name]
    assert case.wait() == code
    assert not (case.path / artifacts.WORKER_RESULT).exists()
    stacks = (case.path / artifacts.STACKS).read_text()
    if fatal:
        assert f"Fatal Python error: {fatal}" in stacks  # faulthandler wrote the stacks on the way down
        assert "inject.py" in stacks
    state = case.beacon()
    assert state is not None
    assert state.step == 1
    assert state.layer is not None


def test_slow_keeps_progressing(cases: dict[str, Case]) -> None:
    case = cases["slow"]
    assert case.wait() == 0
    result = case.result()
    assert result["status"] == "ok"
    assert result["steps_done"] == 3
    assert min(result["metrics"]["step_s"][1:]) >= 0.3  # steps 2 and 3 sleep; step 1 does not
    assert [e["step"] for e in _events(case, event="inject")] == [2, 3]
    inject = str(Injection.parse(CASES["slow"]["inject"][0]))
    assert result["metrics"]["injections"] == [{"inject": inject, "module": "blocks.0", "fired": 2}]


def test_reference_check_passes_for_masked_backends(cases: dict[str, Case]) -> None:
    case = cases["parity"]
    result = case.result()
    assert result["status"] == "ok", result["reason"]
    parity = result["parity"]
    assert parity["tolerance"] == 1e-4
    assert parity["reference"] == "all reference backends"
    assert 0 <= parity["loss_rel_err"] <= 1e-4
    assert 0 <= parity["grad_rel_err_max"] <= 1e-4
    assert parity["worst_param"].startswith(("blocks.", "embed", "lm_head", "norm"))
    assert _events(case, phase="check", layer=1, event="begin"), "the reference model reports progress too"
    assert len(result["metrics"]["phase_s"]["check"]) == 1


def test_reference_check_in_bf16_is_bounded_by_the_bf16_reference(cases: dict[str, Case]) -> None:
    """In bf16 the bound is twice the bf16 reference's own error against the fp32 reference, plus a floor."""
    result = cases["parity-bf16"].result()
    assert result["status"] == "ok", result["reason"]
    parity = result["parity"]
    assert parity["baseline_grad_rel_err_max"] > 0  # bf16 rounding is visible...
    assert parity["grad_bound"] == 2 * parity["baseline_grad_rel_err_max"] + parity["tolerance"]
    assert parity["grad_rel_err_max"] <= parity["grad_bound"]  # ...and the backend stays within it


def test_reference_check_below_tolerance_is_mismatch(cases: dict[str, Case]) -> None:
    result = cases["mismatch"].result()
    assert result["status"] == "mismatch", result["reason"]
    assert result["parity"]["tolerance"] == 1e-15
    assert max(result["parity"]["loss_rel_err"], result["parity"]["grad_rel_err_max"]) > 1e-15
    assert result["steps_done"] == 0


def test_forced_branch_leaves_idle_parameters_without_grad_missing(cases: dict[str, Case]) -> None:
    case = cases["forced-sel"]
    result = case.result()
    assert result["status"] == "ok", result["reason"]
    assert result["missing_grads"] == []
    assert {e["branch"] for e in case.progress()} == {None, "sel"}  # only the branch it computes is marked


def _trace_ranges(path: Path) -> set[str]:
    """The names of the user ranges (`record_function`) in a Chrome trace."""
    events = json.loads(path.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("cat") == "user_annotation"}


def test_profile_trace_has_step_phase_layer_and_branch_ranges(cases: dict[str, Case]) -> None:
    case = cases["profile"]
    result = case.result()
    assert result["status"] == "ok", result["reason"]
    ranges = _trace_ranges(case.path / artifacts.TRACE)
    expected = {"step 1", "step 2", "forward", "backward", "optimizer"}
    expected |= {"layer 0 forward", "layer 0 recompute", "layer 0 backward", "layer 1 backward"}
    expected |= {
        f"layer 1 {branch} {phase}" for branch in ("cmp", "sel", "win") for phase in ("forward", "backward")
    }
    assert expected <= ranges, sorted(ranges)
    assert "layer 1 recompute" not in ranges  # --gc 0:1 checkpoints layer 0 alone


def test_user_model_factory(cases: dict[str, Case]) -> None:
    case = cases["user-model"]
    result = case.result()
    assert result["steps_done"] == 2
    assert result["metrics"]["params"] > 0
    # no NSAAttention inside: the command refuses --reference-check; the worker's safeguard says not run,
    # and the case is unchecked: its steps passed, the check it was asked for did not run (issue 26)
    assert result["status"] == "unchecked", result["reason"]
    assert result["parity"] == {"checked": False, "why": "UserLM holds no nsa_core NSAAttention module"}
    assert result["reason"].startswith("reference check not run: UserLM holds no nsa_core NSAAttention")
    layers = {e["module"] for e in case.progress() if e.get("layer") is not None}
    assert layers == {"layers.0", "layers.1", "layers.2"}


def test_unimportable_factory_is_an_error(cases: dict[str, Case]) -> None:
    result = cases["bad-factory"].result()
    assert result["status"] == "error"
    assert "cannot import diag_user_model_missing" in result["reason"]


def test_gpu_spin_without_cuda_is_skipped(cases: dict[str, Case]) -> None:
    result = cases["gpu-spin"].result()
    assert result["status"] == "skipped"
    assert result["reason"] == "gpu-spin needs CUDA"


# ------------------------------------------------------------------------------------- bad invocations


def test_usage_error_without_a_case_folder(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "nsa_diag.worker", str(tmp_path / "missing")],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "usage" in proc.stderr


def test_unreadable_spec_is_an_error_result(tmp_path: Path) -> None:
    (tmp_path / artifacts.SPEC).write_text('{"seq_len": "many"}')
    proc = subprocess.run(
        [sys.executable, "-m", "nsa_diag.worker", str(tmp_path)], env=_env(), capture_output=True, timeout=60
    )
    assert proc.returncode == 1
    result = json.loads((tmp_path / artifacts.WORKER_RESULT).read_text())
    assert result["status"] == "error"
    assert "spec.json" in result["reason"]


# ------------------------------------------------------------------------------------ on a CUDA device

CUDA_CASES: dict[str, dict[str, Any]] = {
    "cuda-bf16-profile": dict(steps=2, dtype="bf16", profile=True, memory_snapshot=True),
    "cuda-fp16": dict(steps=2, dtype="fp16"),
    "cuda-oom": dict(inject=["oom:layer=1,phase=forward"]),
    "cuda-gpu-spin": dict(inject=["gpu-spin:layer=1,phase=backward"]),
    "cuda-deadlock": dict(inject=["deadlock:layer=0,phase=backward"]),
}


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def cuda_cases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Case]]:
    if not _has_cuda():
        pytest.skip("needs a CUDA device")
    root = tmp_path_factory.mktemp("worker-cuda")
    started: dict[str, Case] = {}
    try:
        for name, fields in CUDA_CASES.items():
            path = root / name
            path.mkdir()
            spec = {**TINY, "device": "cuda", **fields, "name": name}
            spec["inject"] = [Injection.parse(text) for text in spec.get("inject", [])]
            artifacts.write_json(path / artifacts.SPEC, CaseSpec(**spec))
            started[name] = Case(path, _worker(path))
        yield started
    finally:
        for case in started.values():
            _kill(case.proc)


@pytest.mark.gpu
def test_cuda_gpu_spin_hangs_in_the_kernel_with_the_heartbeat_alive(cuda_cases: dict[str, Case]) -> None:
    case = cuda_cases["cuda-gpu-spin"]
    case.wait_until(dict(phase="backward", layer=1))
    (case.path / artifacts.DUMP_REQUEST).touch()
    deadline = time.monotonic() + 10
    while not (case.path / artifacts.DUMP_DONE).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (case.path / artifacts.DUMP_DONE).read_text().strip() == "ok"
    stats = json.loads((case.path / artifacts.MEMORY_STATS).read_text())
    assert "allocated_bytes.all.current" in stats["at_hang"]
    assert "=== at_hang" in (case.path / artifacts.MEMORY_SUMMARY).read_text()
    where = dict(phase="backward", step=1, layer=1, event="begin", module="blocks.1")
    _check_hang(case, "gpu-spin", where, heartbeat=True, frame="_gpu_spin_synchronize")


@pytest.mark.gpu
def test_cuda_deadlock_in_autograd_thread_is_located(cuda_cases: dict[str, Case]) -> None:
    where = dict(phase="backward", step=1, layer=0, event="begin", module="blocks.0")
    case = cuda_cases["cuda-deadlock"]
    _check_hang(case, "deadlock", where, heartbeat=True, frame="_deadlock_lock_acquire")


@pytest.mark.gpu
def test_cuda_bf16_profile_and_memory_snapshot(cuda_cases: dict[str, Case]) -> None:
    case = cuda_cases["cuda-bf16-profile"]
    result = case.result()
    assert result["status"] == "ok", result["reason"]
    assert result["device"].startswith("cuda")
    assert result["metrics"]["peak_memory"]["cuda_max_allocated_bytes"] > 0
    assert {"step 2", "backward", "layer 1 sel backward"} <= _trace_ranges(case.path / artifacts.TRACE)
    assert (case.path / artifacts.MEMORY_SNAPSHOT).stat().st_size > 0
    timeline = (case.path / artifacts.MEMORY_TIMELINE).exists()
    assert timeline or any(artifacts.MEMORY_TIMELINE in n for n in result["metrics"].get("notes", []))
    memory = json.loads((case.path / artifacts.MEMORY_STATS).read_text())
    assert memory["after_backward"]["allocated_bytes.all.peak"] > 0
    assert "=== after_forward" in (case.path / artifacts.MEMORY_SUMMARY).read_text()


@pytest.mark.gpu
def test_cuda_fp16_uses_a_grad_scaler(cuda_cases: dict[str, Case]) -> None:
    result = cuda_cases["cuda-fp16"].result()
    assert result["status"] == "ok", result["reason"]
    assert result["metrics"]["scaler_skipped_steps"] == 0


@pytest.mark.gpu
def test_cuda_oom_is_oom(cuda_cases: dict[str, Case]) -> None:
    result = cuda_cases["cuda-oom"].result()
    assert result["status"] == "oom", result["reason"]
    assert result["exception"]["type"] == "OutOfMemoryError"
    assert "layer 1 forward" in result["reason"]


# ------------------------------------------------------------ the reference check's size (in this process)


def _trained(tmp_path: Path, budget: int | None, **fields: Any) -> WorkerReport:
    """A reference-checked case run by the `Trainer` in this process, the memory a check may use set to
    `budget` bytes (what a full GPU leaves it)."""
    from nsa_diag.worker.probes import MemoryRecorder, Progress
    from nsa_diag.worker.train import Trainer

    spec = CaseSpec(name="check", reference_check=True, **{**TINY, **fields})
    beacon = BeaconWriter(tmp_path / artifacts.BEACON)
    with artifacts.open_append(tmp_path / artifacts.PROGRESS) as stream:
        trainer = Trainer(spec, tmp_path, Progress(beacon, stream), MemoryRecorder(tmp_path))
        trainer._free_memory_bytes = lambda: budget  # type: ignore[method-assign]
        return trainer.run(time.perf_counter())


def _need(seq_len: int, batch: int, **overrides: Any) -> int:
    """What the reference check of the tiny preset needs at the case's size (bytes, margin included)."""
    from nsa_diag.analysis.memory_model import plan_reference

    cfg = CaseSpec(name="x", overrides=overrides).nsa_config()
    plan = plan_reference(cfg, seq_len=seq_len, batch=batch, dtype="fp32", device="cpu", budget_bytes=None)
    return int(plan.need_bytes * plan.margin)


def test_a_reference_that_fits_only_smaller_is_checked_there_and_says_so(tmp_path: Path) -> None:
    """Issue 26: the same weights, on the batch's first row and the model's first layer, beside a copy of
    the model run again there: a pass that says at which size, never one at a size it did not check."""
    report = _trained(tmp_path, int(0.7 * _need(128, 2)), seq_len=128, batch=2)
    assert report.status == "ok", report.reason
    parity = report.parity
    assert parity is not None
    assert parity["reduced"]["batch"] == 1
    assert parity["reduced"]["what"] in report.reason
    assert "reference would not fit" in parity["reduced"]["why"]
    assert parity["grad_rel_err_max"] <= parity["grad_bound"]
    assert "reference check at batch 1 of 2" in report.reason


def test_a_reference_that_fits_at_no_size_is_unchecked(tmp_path: Path) -> None:
    report = _trained(tmp_path, 0, seq_len=128)
    assert report.status == "unchecked"
    assert report.steps_done == 1  # the steps ran and passed: only the check did not
    assert report.parity is not None
    assert report.parity["checked"] is False
    assert report.reason.startswith("reference check not run: the reference would not fit, at the case's")


def test_smaller_check_sizes_keep_selection_sparse() -> None:
    from nsa_diag.analysis.memory_model import CheckSize, smaller_sizes, smallest_sparse_seq_len

    cfg = CaseSpec(name="x", preset="m7c-125m").nsa_config()
    full = CheckSize(batch=2, seq_len=2048, layers=12)
    sizes = smaller_sizes(full, min_seq_len=smallest_sparse_seq_len(cfg), fewer_layers=True)
    assert sizes[0] == CheckSize(1, 2048, 12)  # rows first: each is computed as in the case
    assert sizes[-1] == CheckSize(1, 1088, 1)  # n_sel·l' + l' = 1088 > window + block: still sparse
    assert sizes[-1].describe(full) == "batch 1 of 2, the first 1 of 12 layers, the first 1088 of 2048 tokens"
    user = smaller_sizes(full, min_seq_len=1088, fewer_layers=False)  # a --model keeps its layers
    assert {size.layers for size in user} == {12}
