"""From what was recorded of a watched unit (a worker, or one rank) to its `CaseResult`.

The executor (`nsa_diag.executor`) calls `unit_result` once per unit after the job is stopped: the
watchdog's record and decision, the hang evidence taken before any kill, the stop report, and the unit's
own files (``worker_result.json`` as a `WorkerReport`, ``stacks.txt`` through `read_stacks`, the stderr
tail, the setup record of ``progress.jsonl``) become an `Evidence` for `classify`, and the verdict with
everything measured becomes the result. `error_result` and `interrupted_result` are the results of a
case that the toolkit could not finish, or that nsa-diag's own interrupt ended. The JSON shape of the
``evidence`` written into ``result.json`` is fixed here.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from nsa_diag import artifacts
from nsa_diag.beacon import BeaconState, read_beacon
from nsa_diag.classify import (
    Evidence,
    classify,
    hang_kind,
    last_focus,
    pause_reason,
    waits_on_children,
)
from nsa_diag.evidence import stacks
from nsa_diag.records import CaseEvidence, ExecChange, Heartbeat, MainThread, Metrics, StopReport
from nsa_diag.redact import redact_argv
from nsa_diag.spec import BuiltModel, CaseResult, CaseSpec, Where, WorkerReport
from nsa_diag.watchdog import (
    BUSY_WORKER_CPU,
    HangEvidence,
    StallLimit,
    WatchResult,
    Work,
    configured_limit,
    is_job,
    process_ended,
    progress_rate,
    step_limit,
    steps_done,
)
from nsa_diag.wire import AT_HANG_JSON

STDERR_TAIL_BYTES = 4096
_CONTROL_FILES = {artifacts.DUMP_REQUEST, artifacts.DUMP_DONE, artifacts.STACK_REQUEST}


def signal_name(code: int | None) -> str | None:
    """``"SIGSEGV"`` for an exit status -11; None for a normal exit."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def read_worker_report(unit_dir: Path) -> WorkerReport | None:
    """The unit's ``worker_result.json``; None when it wrote none (killed, crashed) or it cannot be read."""
    try:
        return WorkerReport.model_validate(artifacts.read_json(Path(unit_dir) / artifacts.WORKER_RESULT))
    except (OSError, ValueError, ValidationError):
        return None


def stderr_tail(unit_dir: Path) -> str:
    try:
        with open(Path(unit_dir) / artifacts.STDERR, "rb") as f:
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


def device_from_progress(unit_dir: Path) -> str | None:
    """The device the worker reported at the end of setup (for cases that ended without a result)."""
    try:
        with open(Path(unit_dir) / artifacts.PROGRESS, encoding="utf-8") as f:
            for line in f:
                if '"device"' in line:
                    record = json.loads(line)
                    if record.get("phase") == "setup" and record.get("device"):
                        return str(record["device"])
    except (OSError, ValueError):
        return None
    return None


def model_from_progress(unit_dir: Path) -> BuiltModel | None:
    """What the worker found in a ``--model`` it built (its "model built" setup record), or None."""
    try:
        with open(Path(unit_dir) / artifacts.PROGRESS, encoding="utf-8") as f:
            for line in f:
                if '"model built"' in line and '"model"' in line:
                    return BuiltModel.model_validate(json.loads(line)["model"])
    except (OSError, ValueError, KeyError, ValidationError):
        return None
    return None


def last_where(unit_dir: Path) -> Where | None:
    """Where the unit's beacon last was."""
    state = read_beacon(Path(unit_dir) / artifacts.BEACON)
    return Where(**state.where()) if state is not None else None


def _layers(spec: CaseSpec) -> int | None:
    if spec.model is not None:
        return None
    try:
        return int(spec.nsa_config().layers)
    except Exception:
        return None


def _steps(spec: CaseSpec, report: WorkerReport | None, last: BeaconState | None) -> int:
    """Steps done: our worker's own count, else the beacon's; a user's job counts its optimizer steps as
    the probe saw them (its report, written from its exit status, knows none)."""
    if is_job(spec):
        return max(report.steps_done if report else 0, steps_done(last, sys.maxsize))
    return report.steps_done if report else steps_done(last, spec.steps)


MAX_THREAD_NAMES = 1024  # a job's at_hang.json is its own to write: names beyond this are not read


def thread_names(unit_dir: Path) -> dict[str, str]:
    """The probe's names of the unit's threads at the hang (``at_hang.json``'s ``threads``): id -> name; {}
    where there is none or it is not what the probe writes (a job-written file is evidence, never a crash)."""
    try:
        data = artifacts.read_json(Path(unit_dir) / AT_HANG_JSON)
    except (OSError, ValueError):
        return {}
    threads = data.get("threads") if isinstance(data, dict) else None
    if not isinstance(threads, dict):
        return {}
    named = ((k, v) for k, v in threads.items() if isinstance(k, str) and isinstance(v, str))
    return {k[:40]: v[:80] for k, v in itertools.islice(named, MAX_THREAD_NAMES)}


def unit_evidence(
    spec: CaseSpec,
    unit_dir: Path,
    watched: WatchResult,
    hang: HangEvidence | None,
    *,
    exit_code: int | None = None,
    elapsed: float = 0.0,
    workers: dict[str, str | None] | None = None,
) -> Evidence:
    """What `classify` looks at for one unit: its watch record, its hang evidence and its files."""
    last = watched.last_state
    report = read_worker_report(unit_dir)
    if report is None and is_job(spec) and exit_code == 0:  # a process of a user's job that ended well
        report = WorkerReport(status="ok", reason="exited with code 0")
    stack_file = stacks.read_stacks(Path(unit_dir) / artifacts.STACKS)
    decision = watched.decision
    now = watched.history[-1].t
    rate = progress_rate(watched.history, now, spec, _layers(spec)) if watched.outcome == "timeout" else None
    exe = hang.exe if hang else None
    return Evidence(
        outcome=watched.outcome,
        exit_code=exit_code,
        signal=signal_name(exit_code) if watched.outcome == "exited" else None,
        worker_result=report,
        stack_samples=hang.samples if hang else (),
        fatal_stack=stack_file.fatal,
        pyspy=hang.pyspy_text if hang else None,
        pyspy_more=tuple(hang.pyspy_more) if hang else (),
        cpu_percent=hang.cpu_percent if hang else None,
        heartbeat_advancing=hang.heartbeat_advancing if hang else None,
        gpu_utilization=hang.gpu_utilization if hang else None,
        main_wchan=hang.main_wchan if hang else None,
        file_locks=hang.file_locks if hang else (),
        children_working=tuple(hang.children_working) if hang else (),
        children_idle=tuple(hang.children_idle) if hang else (),
        main_state=hang.main_state if hang else None,
        where=Where(**last.where()) if last is not None else None,
        stalled_for_s=decision.silence_s if decision is not None else None,
        elapsed_s=elapsed,
        timeout_s=spec.timeout,
        rate=rate,
        progressed=hang.progressed if hang else None,
        longest_gap_s=watched.longest_gap_s,
        source_lines=stacks.source_lines(stack_file.threads()),
        loops=stacks.enclosing_loops(stack_file.threads()),
        withs=stacks.enclosing_withs(stack_file.threads()),
        thread_names=thread_names(unit_dir),
        stderr_tail=stderr_tail(unit_dir),
        io_bytes=hang.io_bytes if hang else None,
        work=watched.work,
        workers=workers or {},
        program=" ".join(redact_argv(hang.argv)) if hang and hang.argv else None,
        exe=exe,
        exec_from=watched.first_exe if exe and watched.first_exe not in (None, exe) else None,
    )


@dataclass(frozen=True)
class Observed:
    """One unit as the executor saw it at a stall: its folder, watch record and hang evidence."""

    label: str
    folder: Path
    watched: WatchResult
    hang: HangEvidence | None


def worker_activity(spec: CaseSpec, worker: Observed) -> str | None:
    """What a DataLoader worker is doing, when it is producing a batch (not idle, not stuck): its pause or
    work (`classify.pause_reason`, the liveness window as `window_work` reads it: a worker that produced
    its batch and idles keeps its earlier moves there), or its CPU; None when it is idle or stuck."""
    ev = unit_evidence(spec, worker.folder, worker.watched, worker.hang)
    why = pause_reason(ev) or window_work(worker.watched.work, worker.hang)
    if why is None and worker.hang is not None and (worker.hang.cpu_percent or 0.0) >= BUSY_WORKER_CPU:
        why = f"CPU {worker.hang.cpu_percent:.0f}%"
    return why


def stalled_pause(
    spec: CaseSpec,
    stalled: Observed,
    workers: list[Observed],
    ranks: Sequence[Observed] = (),
    children: Sequence[Observed] = (),
) -> str | None:
    """Why the unit that stalled is not stuck (`classify.pause_reason`, with its DataLoader workers' own
    activity), or None: then it is hung.

    ``children``: its other child processes. A process that waits for its children (`waits_on_children`: a
    Pool's map, subprocess.run, a ProcessPoolExecutor) is paused while one of them works (`unit_work`);
    one that only sleeps does not count.

    ``ranks``: the job's other ranks. A rank blocked in a collective waits for them: while each of them
    works (`unit_work`) or is blocked in a collective too, and one works, the collective can still
    complete (rank 0 evaluates for minutes while rank 1 waits in the barrier after it). A rank that only
    sleeps does not count: the sleep of a rank the others wait for is what a hung read looks like too."""
    activity = {w.label: worker_activity(spec, w) for w in workers}
    ev = unit_evidence(spec, stalled.folder, stalled.watched, stalled.hang, workers=activity)
    why = pause_reason(ev)
    if why is not None:
        return why
    if children and waits_on_children(last_focus(ev)):
        works = {c.label: unit_work(c, _evidence(spec, c), progress=False) for c in children}
        busy = [f"{label}: {work}" for label, work in works.items() if work]
        if busy:
            return "it waits for its child process(es), which are working: " + "; ".join(busy)
    if not ranks or hang_kind(ev)[0] != "collective":
        return None
    working = []
    for other in ranks:
        other_ev = _evidence(spec, other)
        work = unit_work(other, other_ev)
        if work is not None:
            working.append(f"{other.label}: {work}")
        elif other_ev is None or hang_kind(other_ev)[0] != "collective":
            return None  # stuck elsewhere (or not seen): the collective cannot complete
    if not working:
        return None
    return "it waits in a collective for rank(s) still working: " + "; ".join(working)


def _evidence(spec: CaseSpec, unit: Observed) -> Evidence | None:
    # what `classify` looks at for a unit whose evidence was taken at the stall; None where none was
    return unit_evidence(spec, unit.folder, unit.watched, unit.hang) if unit.hang is not None else None


def unit_work(unit: Observed, ev: Evidence | None, progress: bool = True) -> str | None:
    """What shows a unit (another rank, a child process; ``ev`` its `_evidence`) working at a stall: with
    ``progress``, progress within its own stall limit (a rank's steps; a helper's start-up events are not
    progress); the work of `classify.pause_reason` and of its liveness window; None when nothing does, or
    the process had ended before its evidence was taken. One that ended since is judged by that evidence:
    a Pool's worker that finished its last task while the others were sampled (the main process it worked
    for goes on), not a process that never worked."""
    if ev is None and process_ended(unit.watched.history):
        return None
    decision = unit.watched.decision
    if (
        progress
        and decision is not None
        and decision.status == "running"
        and decision.work is None
        and decision.silence_s < decision.stall_limit_s  # since its last progress, pauses included
        and unit.watched.last_state is not None
    ):
        limit = decision.stall_limit_s
        return f"progress {decision.silence_s:.0f} s ago, within its stall limit of {limit:.0f} s"
    why = pause_reason(ev) if ev is not None else None
    return why or window_work(unit.watched.work, unit.hang)


IDLE_CPU_MAX = 5.0  # percent of a core: a process that waits uses (almost) none


def window_work(work: Work | None, hang: HangEvidence | None) -> str | None:
    """The work of a unit's liveness window (`Work.describe`), or None: none, or only frame moves while the
    process no longer uses the CPU as its evidence is taken (a Pool worker that finished its tasks and
    idles keeps its earlier moves in the window for up to 20 s): under `IDLE_CPU_MAX`, what an idle process
    uses; a working one on a machine shared by more busy processes than cores gets a smaller share, not
    none."""
    if work is None or not work.working:
        return None
    cpu_now = hang.cpu_percent if hang is not None else None
    if work.signals == ["moves"] and cpu_now is not None and cpu_now < IDLE_CPU_MAX:
        return None
    return work.describe()


def unit_result(
    spec: CaseSpec,
    unit_dir: Path,
    watched: WatchResult,
    hang: HangEvidence | None,
    stop: StopReport,
    elapsed: float,
    workers: dict[str, str | None] | None = None,
) -> CaseResult:
    """The classified result of one unit, from its watch record, its hang evidence and its files."""
    last = watched.last_state
    where = Where(**last.where()) if last is not None else None
    code = stop.exit_code
    decision = watched.decision
    ev = unit_evidence(spec, unit_dir, watched, hang, exit_code=code, elapsed=elapsed, workers=workers)
    report, rate = ev.worker_result, ev.rate
    stack_file = stacks.read_stacks(Path(unit_dir) / artifacts.STACKS)
    verdict = classify(ev)
    evidence = CaseEvidence(outcome=watched.outcome, stop=stop)
    if hang is not None:  # what was gathered before any kill
        evidence.add(
            CaseEvidence(
                cpu_percent=hang.cpu_percent,
                heartbeat=Heartbeat(
                    advancing=hang.heartbeat_advancing,
                    before_samples=hang.heartbeat_before,
                    between_samples=hang.heartbeat_between,
                ),
                main_thread=MainThread(state=hang.main_state, wchan=hang.main_wchan),
                gpu_utilization=hang.gpu_utilization,
                stack_samples=len(hang.samples),
                progressed_during_evidence=hang.progressed,
                longest_progress_gap_s=watched.longest_gap_s,
                io_bytes_during_evidence=hang.io_bytes,
            )
        )
        evidence.add(hang.notes)
    if watched.work is not None:
        evidence.work = watched.work.to_json()
    if ev.exec_from is not None:  # the process runs another program than the one first seen
        evidence.exec = ExecChange(from_=ev.exec_from, into=ev.exe, argv=hang.argv if hang else [])
    if hang is not None:  # what it was doing, when that was not being stuck (a DataLoader worker reading)
        evidence.activity = pause_reason(ev) or window_work(watched.work, hang)
    if stack_file.fatal:
        evidence.fatal_error = stacks.fatal_error(stack_file.fatal)
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
        device=(report.device if report else None) or device_from_progress(unit_dir),
        exit_code=code,
        signal=signal_name(code),
        steps_done=_steps(spec, report, last),
        metrics=report.metrics if report else Metrics(),
        rate=rate,
        missing_grads=list(report.missing_grads) if report else [],
        nonfinite=report.nonfinite if report else None,
        parity=report.parity if report else None,
        evidence=evidence,
        model=model_from_progress(unit_dir) if spec.model is not None else None,
    )


def error_result(spec: CaseSpec, reason: str, elapsed: float, evidence: CaseEvidence) -> CaseResult:
    """verdict error with ``reason`` (one line) for a case that ended before anything was classified."""
    limit_s, limit_reason = _configured_limit(spec)
    return CaseResult(
        name=spec.name,
        spec_hash=spec.spec_hash(),
        verdict="error",
        reason=" ".join(reason.split()),
        elapsed_s=round(elapsed, 3),
        stall_limit_s=limit_s,
        stall_limit_reason=limit_reason,
        timeout_s=spec.timeout,
        evidence=evidence,
    )


def _configured_limit(spec: CaseSpec) -> tuple[float | None, str]:
    """stall_limit_s and its reason for a case that ended before the watchdog measured anything."""
    limit = configured_limit(spec)
    if limit is None:
        return None, "auto: not measured (the case ended first)"
    return limit.seconds, limit.reason


def interrupted_result(
    spec: CaseSpec, unit_dir: Path, by: str, elapsed: float, stop: StopReport, sampled: bool
) -> CaseResult:
    """The result of a one-unit case whose nsa-diag got SIGINT/SIGTERM (``by``), after it was stopped:
    where its beacon last was, and whether one last stack sample was taken (``sampled``)."""
    where = last_where(unit_dir)
    evidence = Evidence(outcome="interrupted", interrupted_by=by, elapsed_s=elapsed, where=where)
    limit_s, limit_reason = _configured_limit(spec)
    return CaseResult(
        name=spec.name,
        spec_hash=spec.spec_hash(),
        verdict="error",
        reason=classify(evidence).reason,
        where=where,
        elapsed_s=round(elapsed, 3),
        stall_limit_s=limit_s,
        stall_limit_reason=limit_reason,
        timeout_s=spec.timeout,
        device=device_from_progress(unit_dir),
        exit_code=stop.exit_code,
        signal=signal_name(stop.exit_code),
        model=model_from_progress(unit_dir) if spec.model is not None else None,
        evidence=CaseEvidence(
            outcome="interrupted", interrupted_by=by, stack_samples=int(sampled), stop=stop
        ),
    )
