"""Run cases in isolated workers under the watchdog: `run_case` and `run_cases`, always a result.

One case: write ``spec.json`` and ``replay.sh``, start ``python -m nsa_diag.worker <case_dir>`` in a new
session (its own process group) with stdin closed and the environment set only here, and watch its
beacon. On a stall or a timeout, gather the evidence before any kill (memory at the hang, two stack
samples a second apart, py-spy, GPU, ``/proc``), then stop every process of the case; classify; write
``result.json``. `run_case` returns a `CaseResult` in every outcome and raises only `KeyboardInterrupt`
when nsa-diag itself gets SIGINT or SIGTERM, after the worker's processes are gone and the case's
``result.json`` (verdict error) is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from nsa_diag import artifacts
from nsa_diag.classify import Evidence, classify
from nsa_diag.evidence import stacks
from nsa_diag.spec import CaseResult, CaseSpec, Where
from nsa_diag.watchdog import (
    HangEvidence,
    StallLimit,
    WatchResult,
    catches_sigusr1,
    configured_limit,
    gather_hang_evidence,
    progress_rate,
    step_limit,
    steps_done,
    terminate_group,
    watch,
)
from nsa_diag.worker.beacon import BeaconState, read_beacon

ProgressCallback = Callable[[BeaconState | None, float], None]
STDERR_TAIL_BYTES = 4096
_CONTROL_FILES = {artifacts.DUMP_REQUEST, artifacts.DUMP_DONE, artifacts.STACK_REQUEST}


class Interrupted(KeyboardInterrupt):
    """nsa-diag got SIGINT or SIGTERM while a case ran; the case's processes have been stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signal_name = signal.Signals(signum).name


class _InterruptGuard:
    """SIGINT/SIGTERM -> `Interrupted` while a case runs; held back inside `deferred` (starting the worker,
    stopping it), so an interrupt can never leave a worker started but unknown, or half stopped."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._depth = 0
        self._closing = False
        self.pending: int | None = None

    def __enter__(self) -> _InterruptGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._depth or self._closing:
            self.pending = self.pending or signum
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self.pending is not None and not self._depth and not self._closing:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)

    def close(self) -> None:
        """From now on signals are only noted: the cleanup after an interrupt runs to its end."""
        self._closing = True


def worker_env(spec: CaseSpec) -> dict[str, str]:
    """The environment variables the spec sets for its worker (also exported by ``replay.sh``)."""
    env = {}
    if spec.alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = spec.alloc_conf
    if spec.launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    return env


def _child_env(spec: CaseSpec, extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **worker_env(spec), **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
    # The worker imports the same nsa_diag as this process, installed or not.
    source_root = str(Path(__file__).resolve().parents[1])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if source_root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([source_root, *paths])
    return env


def worker_argv(case_dir: Path) -> list[str]:
    return [sys.executable, "-m", "nsa_diag.worker", str(case_dir)]


def _start_worker(
    spec: CaseSpec, case_dir: Path, extra_env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with (
        artifacts.open_append(case_dir / artifacts.STDOUT, binary=True) as out,
        artifacts.open_append(case_dir / artifacts.STDERR, binary=True) as err,
    ):
        return subprocess.Popen(
            worker_argv(case_dir),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=_child_env(spec, extra_env),
            start_new_session=True,
        )


# --- result -------------------------------------------------------------------------------------------


def _signal_name(code: int | None) -> str | None:
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _read_worker_result(case_dir: Path) -> dict[str, Any] | None:
    try:
        data = artifacts.read_json(case_dir / artifacts.WORKER_RESULT)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stderr_tail(case_dir: Path) -> str:
    try:
        with open(case_dir / artifacts.STDERR, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - STDERR_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def case_files(case_dir: Path) -> list[str]:
    """The artifact files of the case folder (relative paths; control and temporary files left out)."""
    files = []
    for path in sorted(Path(case_dir).rglob("*")):
        rel = path.relative_to(case_dir).as_posix()
        if path.is_file() and not path.name.startswith(".") and path.name not in _CONTROL_FILES:
            files.append(rel)
    return files


def _finish(case_dir: Path, result: CaseResult) -> CaseResult:
    artifacts.write_json(case_dir / artifacts.RESULT, result)  # result.json lists itself
    result = result.model_copy(update={"files": case_files(case_dir)})
    artifacts.write_json(case_dir / artifacts.RESULT, result)
    return result


def _device_from_progress(case_dir: Path) -> str | None:
    """The device the worker reported at the end of setup (for cases that ended without a result)."""
    try:
        with open(case_dir / artifacts.PROGRESS, encoding="utf-8") as f:
            for line in f:
                if '"device"' in line:
                    record = json.loads(line)
                    if record.get("phase") == "setup" and record.get("device"):
                        return str(record["device"])
    except (OSError, ValueError):
        return None
    return None


def _layers(spec: CaseSpec) -> int | None:
    if spec.model is not None:
        return None
    try:
        return int(spec.nsa_config().layers)
    except Exception:
        return None


def _build_result(
    spec: CaseSpec,
    case_dir: Path,
    watched: WatchResult,
    hang: HangEvidence | None,
    stop: dict[str, Any],
    elapsed: float,
) -> CaseResult:
    last = next((o.state for o in reversed(watched.history) if o.state is not None), None)
    where = Where(**last.where()) if last is not None else None
    code = stop.get("exit_code")
    worker_result = _read_worker_result(case_dir)
    stacks_path = case_dir / artifacts.STACKS
    text = stacks_path.read_text(errors="replace") if stacks_path.exists() else ""
    samples, fatal = stacks.split_samples(text)
    decision = watched.decision
    now = watched.history[-1].t
    rate = progress_rate(watched.history, now, spec, _layers(spec)) if watched.outcome == "timeout" else None
    threads = [t for text in [*samples, fatal or ""] for t in stacks.parse_faulthandler(text)]
    ev = Evidence(
        outcome=watched.outcome,
        exit_code=code,
        signal=_signal_name(code) if watched.outcome == "exited" else None,
        worker_result=worker_result,
        stack_samples=hang.samples if hang else (),
        fatal_stack=fatal,
        pyspy=hang.pyspy_text if hang else None,
        cpu_percent=hang.cpu_percent if hang else None,
        heartbeat_advancing=hang.heartbeat_advancing if hang else None,
        gpu_utilization=hang.gpu_utilization if hang else None,
        main_wchan=hang.main_wchan if hang else None,
        main_state=hang.main_state if hang else None,
        where=where,
        stalled_for_s=decision.idle_s if decision is not None else None,
        elapsed_s=elapsed,
        timeout_s=spec.timeout,
        rate=rate,
        source_lines=stacks.source_lines(threads),
        stderr_tail=_stderr_tail(case_dir),
    )
    verdict = classify(ev)
    evidence: dict[str, Any] = {"outcome": watched.outcome, "stop": stop}
    if hang is not None:
        evidence.update(
            cpu_percent=hang.cpu_percent,
            heartbeat={
                "advancing": hang.heartbeat_advancing,
                "before_samples": hang.heartbeat_before,
                "between_samples": hang.heartbeat_between,
            },
            main_thread={"state": hang.main_state, "wchan": hang.main_wchan},
            gpu_utilization=hang.gpu_utilization,
            stack_samples=len(hang.samples),
            **hang.notes,
        )
    if fatal:
        evidence["fatal_error"] = stacks.fatal_error(fatal)
    wr = worker_result or {}
    # The limit that decided a stall or timeout; for a worker that exited, the one its steps ran under.
    if decision is not None:
        limit = StallLimit(decision.stall_limit_s, decision.limit_reason)
    else:
        limit = step_limit(watched.history, spec)
    return CaseResult(
        name=spec.name,
        spec_hash=spec.spec_hash(),
        verdict=verdict.verdict,
        reason=verdict.reason,
        hang_kind=verdict.hang_kind,
        where=where,
        elapsed_s=round(elapsed, 3),
        stall_limit_s=round(limit.seconds, 3),
        stall_reason=verdict.reason.partition("; ")[2] or None if verdict.verdict == "hang" else None,
        stall_limit_reason=limit.reason,
        timeout_s=spec.timeout,
        device=wr.get("device") or _device_from_progress(case_dir),
        exit_code=code,
        signal=_signal_name(code),
        steps_done=int(wr.get("steps_done", steps_done(last, spec.steps))),
        metrics=wr.get("metrics") or {},
        rate=rate,
        missing_grads=list(wr.get("missing_grads") or []),
        nonfinite=wr.get("nonfinite"),
        parity=wr.get("parity"),
        evidence=evidence,
    )


def _error_result(spec: CaseSpec, reason: str, elapsed: float, evidence: dict[str, Any]) -> CaseResult:
    return CaseResult(
        name=spec.name,
        spec_hash=spec.spec_hash(),
        verdict="error",
        reason=" ".join(reason.split()),
        elapsed_s=round(elapsed, 3),
        **_configured_limit_fields(spec),
        timeout_s=spec.timeout,
        evidence=evidence,
    )


def _configured_limit_fields(spec: CaseSpec) -> dict[str, Any]:
    """stall_limit_s and its reason for a case that ended before the watchdog measured anything."""
    limit = configured_limit(spec)
    if limit is None:
        return {"stall_limit_s": None, "stall_limit_reason": "auto: not measured (the case ended first)"}
    return {"stall_limit_s": limit.seconds, "stall_limit_reason": limit.reason}


def _stop(proc: subprocess.Popen[bytes] | None) -> dict[str, Any]:
    if proc is None:
        return {"started": False}
    report = terminate_group(proc)
    report["exit_code"] = proc.returncode
    return report


def _last_where(case_dir: Path) -> Where | None:
    state = read_beacon(case_dir / artifacts.BEACON)
    return Where(**state.where()) if state is not None else None


def _last_sample(proc: subprocess.Popen[bytes], case_dir: Path) -> bool:
    """One quick stack sample of an interrupted worker (a user's Ctrl-C on a hung run wants to see where)."""
    if proc.poll() is not None or not catches_sigusr1(proc.pid):
        return False
    path = case_dir / artifacts.STACKS
    return stacks.take_sample(proc.pid, case_dir, path, 1, None, note="nsa-diag interrupted") is not None


def _interrupted(
    spec: CaseSpec, case_dir: Path, proc: subprocess.Popen[bytes] | None, by: str, t0: float
) -> CaseResult:
    """The result of a case whose nsa-diag got SIGINT/SIGTERM: one stack sample, then stop the worker."""
    sampled = proc is not None and _last_sample(proc, case_dir)
    stop = _stop(proc)
    where = _last_where(case_dir)
    elapsed = time.monotonic() - t0
    evidence = Evidence(outcome="interrupted", interrupted_by=by, elapsed_s=elapsed, where=where)
    return CaseResult(
        name=spec.name,
        spec_hash=spec.spec_hash(),
        verdict="error",
        reason=classify(evidence).reason,
        where=where,
        elapsed_s=round(elapsed, 3),
        **_configured_limit_fields(spec),
        timeout_s=spec.timeout,
        device=_device_from_progress(case_dir),
        exit_code=stop.get("exit_code"),
        signal=_signal_name(stop.get("exit_code")),
        evidence={
            "outcome": "interrupted",
            "interrupted_by": by,
            "stack_samples": int(sampled),
            "stop": stop,
        },
    )


# --- entry points -------------------------------------------------------------------------------------


def run_case(
    spec: CaseSpec,
    case_dir: Path,
    *,
    replay_argv: Sequence[str] | None = None,
    on_progress: ProgressCallback | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> CaseResult:
    """Run one case in ``case_dir``; the result (also written to ``result.json``) whatever happened.

    ``replay_argv`` is the command line ``replay.sh`` runs (default: the worker on this case folder).
    ``extra_env``: variables for this worker only, not in ``replay.sh`` (``nsa-diag matrix --jobs`` gives
    each case its own GPU through ``CUDA_VISIBLE_DEVICES``). From a thread other than the main one no
    signal handler is installed; ``on_progress`` may raise `Interrupted` there to stop the case.
    Raises `Interrupted` (a KeyboardInterrupt) on SIGINT/SIGTERM, after stopping the worker.
    """
    case_dir = Path(case_dir)
    case_dir.mkdir(parents=True, exist_ok=True)
    if spec.ddp is not None:  # issue 6: several ranks through torchrun, each watched (nsa_diag.distributed)
        from nsa_diag.distributed import run_ddp_case

        return run_ddp_case(
            spec, case_dir, replay_argv=replay_argv, on_progress=on_progress, extra_env=extra_env
        )
    started, t0 = time.time(), time.monotonic()
    proc: subprocess.Popen[bytes] | None = None
    guard = _InterruptGuard()
    with guard:
        try:
            artifacts.write_json(case_dir / artifacts.SPEC, spec)
            argv = list(replay_argv or worker_argv(case_dir.resolve()))
            artifacts.write_replay(case_dir / artifacts.REPLAY, argv, worker_env(spec))
            with guard.deferred():
                proc = _start_worker(spec, case_dir, extra_env)
            watched = watch(proc, case_dir / artifacts.BEACON, spec, started, on_progress)
            hang = None
            if watched.outcome != "exited":
                last = next((o.state for o in reversed(watched.history) if o.state is not None), None)
                hang = gather_hang_evidence(proc, case_dir, spec, last)
            with guard.deferred():
                stop = _stop(proc)
            result = _build_result(spec, case_dir, watched, hang, stop, time.monotonic() - t0)
        except KeyboardInterrupt as exc:
            guard.close()
            result = _interrupted(spec, case_dir, proc, getattr(exc, "signal_name", "SIGINT"), t0)
            _finish(case_dir, result)
            raise
        except Exception as exc:  # a bug of the toolkit: the case still gets its result, the worker its end
            guard.close()
            stop = _stop(proc)
            result = _error_result(
                spec,
                f"nsa-diag internal error while running the case: {type(exc).__name__}: {exc}",
                time.monotonic() - t0,
                {"outcome": "internal-error", "traceback": traceback.format_exc(), "stop": stop},
            )
        with guard.deferred():  # an interrupt now comes after the result is on disk
            return _finish(case_dir, result)


def run_cases(
    specs: Sequence[CaseSpec],
    run_dir: Path,
    *,
    replay_argv: Callable[[CaseSpec], Sequence[str]] | Mapping[str, Sequence[str]] | None = None,
    on_case_start: Callable[[CaseSpec], None] | None = None,
    on_progress: ProgressCallback | None = None,
    on_case_end: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Run ``specs`` one after the other into ``run_dir/cases/<name>/``; writes ``run_dir/env.json``.

    ``replay_argv``: per case, the command line of its ``replay.sh`` (a function of the spec, or a
    mapping by case name). Raises `Interrupted` when interrupted (the running case has its result.json).
    """
    from nsa_diag.evidence.env import collect_env

    run_dir = Path(run_dir)
    artifacts.write_json(run_dir / artifacts.ENV, collect_env())
    results = []
    for spec in specs:
        if on_case_start is not None:
            on_case_start(spec)
        if callable(replay_argv):
            argv: Sequence[str] | None = replay_argv(spec)
        else:
            argv = (replay_argv or {}).get(spec.name)
        result = run_case(
            spec, artifacts.case_dir(run_dir, spec.name), replay_argv=argv, on_progress=on_progress
        )
        results.append(result)
        if on_case_end is not None:
            on_case_end(result)
    return results
