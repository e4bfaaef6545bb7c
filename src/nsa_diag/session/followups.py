"""The follow-ups of a session, after its cases ran: --repeat, --minimize, --triage (and their checks).

- ``--repeat N``: every case ran N times as ``cases/<case>-r<i>`` (`nsa_diag.analysis.repeat`);
  summary.json gets ``repeats`` (verdict counts, hang probability and interval, time to hang, transient);
- ``--minimize``: each failing case is shrunk by real runs under ``minimize/<case>/<trial>/``
  (`nsa_diag.analysis.minimize`); summary.json's ``minimize`` holds the trials and the smallest command;
- ``--triage``: each oom case is rerun with allocator settings under ``triage/<case>/<variant>/`` and
  classified (`nsa_diag.analysis.triage`); summary.json's ``triage``.

The analyses are pure; what they need from files, the GPU and real runs comes from here: the hang timings
(``progress.jsonl``), the out-of-memory message (``worker_result.json``), the device's memory (NVML,
psutil) and the trial runs (the session's `TrialRunner`). Follow-ups change no verdict; an interrupt
during them marks the summary interrupted (exit 130). ``--junit`` is the session's own.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nsa_diag import artifacts
from nsa_diag.analysis.minimize import MAX_TRIALS, Target, minimize_case
from nsa_diag.analysis.repeat import HangTiming, repeats_section
from nsa_diag.analysis.triage import triage_oom
from nsa_diag.errors import UsageError
from nsa_diag.evidence import gpu
from nsa_diag.spec import CaseResult, CaseSpec
from nsa_diag.summary import MinimizeRecord, RepeatsSection, TriageRecord

if TYPE_CHECKING:
    from rich.console import Console

    from nsa_diag.cases import CaseOptions
    from nsa_diag.summary import RunSummary

MINIMIZE_DIR = "minimize"
TRIAGE_DIR = "triage"
REPRODUCE = "reproduce.sh"  # minimize/<case>/reproduce.sh: the smallest reproducing command

TrialRunner = Callable[[Path], Callable[[CaseSpec], CaseResult]]  # folder -> runs a trial into it
Say = Callable[[str], None]


@dataclass(frozen=True)
class FollowUps:
    """The follow-up options of one invocation (defaults: none)."""

    repeat: int = 1
    minimize: bool = False
    triage: bool = False
    junit: Path | None = None

    @classmethod
    def of(cls, options: CaseOptions | None) -> FollowUps:
        if options is None:
            return cls()
        return cls(options.repeat, options.minimize, options.triage, options.junit)


def check_follow_ups(follow: FollowUps | CaseOptions | None) -> FollowUps:
    """The follow-up options, checked before any run folder exists (`UsageError` in one line)."""
    if not isinstance(follow, FollowUps):
        follow = FollowUps.of(follow)
    if follow.repeat < 1:
        raise UsageError(f"--repeat {follow.repeat}: must be at least 1")
    if follow.junit is not None:
        path = Path(follow.junit)
        if path.is_dir():
            raise UsageError(f"--junit {path}: is a folder; give a file name, e.g. {path / 'junit.xml'}")
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise UsageError(f"--junit {path}: {parent} is not a folder")
    return follow


def follow_up(
    summary: RunSummary,
    run_dir: Path,
    specs: Sequence[CaseSpec],
    results: Sequence[CaseResult],
    *,
    follow: FollowUps,
    base_of: Mapping[str, str] | None,
    run_trials: TrialRunner,
    err: Console,
) -> None:
    """Add the follow-ups' sections to `summary` (built over `results`; `specs` are the cases before
    repeating, `base_of` maps a run's name to its case's): repeats, minimize, triage. An interrupt
    during the minimize or triage runs marks the summary interrupted."""
    base_of = dict(base_of or {r.name: r.name for r in results})
    if follow.repeat > 1:
        summary.repeats = _repeats(summary, run_dir, specs, results, base_of, follow.repeat)
    if summary.interrupted or not (follow.minimize or follow.triage):
        return
    failing = _failing(summary, run_dir, specs, results, base_of)
    stopped = False
    try:
        if follow.minimize:
            summary.minimize = []
            stopped = _minimize(summary.minimize, run_dir, failing, run_trials, err)
        if follow.triage and not stopped:
            summary.triage = []
            stopped = _triage(summary.triage, run_dir, failing, run_trials, err)
    except KeyboardInterrupt:
        stopped = True  # between two runs; the records made so far are in the summary
    if stopped:
        summary.mark_interrupted()
        err.print("nsa-diag: interrupted; the follow-up runs were stopped", markup=False, highlight=False)


# --- --repeat ------------------------------------------------------------------------------------------


def hang_timing(case_dir: Path, stall_limit_s: float | None, step: int | None = None) -> HangTiming | None:
    """When a hung run stopped progressing and when the watchdog called it, in seconds from the worker's
    first progress record (``progress.jsonl``), and the `step` it hung in; None when there is no progress."""
    first = last = None
    try:
        with open(Path(case_dir) / "progress.jsonl", encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a killed worker may leave one partial last line
                if not isinstance(record, dict) or not isinstance(record.get("t"), int | float):
                    continue
                first = record["t"] if first is None else first
                if "phase" in record:  # progress events; notes (a fault firing) leave the stall timer alone
                    last = record["t"]
    except OSError:
        return None
    if first is None or last is None:
        return None
    onset = last - first
    detected = onset + (stall_limit_s or 0.0)
    return HangTiming(onset_s=round(onset, 3), detected_s=round(detected, 3), step=step)


def _repeats(
    summary: RunSummary,
    run_dir: Path,
    specs: Sequence[CaseSpec],
    results: Sequence[CaseResult],
    base_of: Mapping[str, str],
    repeat: int,
) -> RepeatsSection:
    timings = {
        r.name: hang_timing(
            Path(run_dir) / "cases" / r.name, r.stall_limit_s, r.where.step if r.where else None
        )
        for r in results
        if r.verdict == "hang"
    }
    entries = [case.to_json() for case in summary.cases]
    return repeats_section(entries, base_of, [s.name for s in specs], repeat, timings)


# --- --minimize and --triage ------------------------------------------------------------------------------


@dataclass
class _Failing:
    spec: CaseSpec
    result: CaseResult  # the first run of the case that did not go as expected (or went oom)
    case_dir: Path
    not_ok: bool
    oom: CaseResult | None


def _failing(
    summary: RunSummary,
    run_dir: Path,
    specs: Sequence[CaseSpec],
    results: Sequence[CaseResult],
    base_of: Mapping[str, str],
) -> list[_Failing]:
    """Per case, its first run that was not ok (nothing to reproduce in a skipped one, nor in an unchecked
    one: its steps passed) and its first oom."""
    ok = {entry.name: entry.ok for entry in summary.cases}
    found = []
    for spec in specs:
        runs = [r for r in results if base_of.get(r.name) == spec.name]
        bad = next(
            (r for r in runs if not ok.get(r.name, r.passed) and r.verdict not in ("skipped", "unchecked")),
            None,
        )
        oom = next((r for r in runs if r.verdict == "oom"), None)
        first = bad or oom
        if first is not None:
            found.append(_Failing(spec, first, Path(run_dir) / "cases" / first.name, bad is not None, oom))
    return found


def _say(err: Console) -> Say:
    return lambda text: err.print(text, markup=False, highlight=False, soft_wrap=True)


def _minimize(
    records: list[MinimizeRecord],
    run_dir: Path,
    failing: Sequence[_Failing],
    run_trials: TrialRunner,
    err: Console,
) -> bool:
    """Minimize each failing case, appending its record to `records`; True when interrupted."""
    for case in failing:
        if not case.not_ok:
            continue
        folder = Path(run_dir) / MINIMIZE_DIR / case.spec.name
        err.print(
            f"minimize {case.spec.name} ({Target.of(case.result).describe()}): up to {MAX_TRIALS} runs "
            f"into {folder}",
            markup=False,
            highlight=False,
        )
        record = minimize_case(
            case.spec, case.result, run_trials(folder), name=f"{case.spec.name}-min", say=_say(err)
        )
        record.dir = f"{MINIMIZE_DIR}/{case.spec.name}"
        records.append(record)
        if record.interrupted:
            return True
        argv = [sys.executable, "-m", "nsa_diag", *record.argv[1:]]
        artifacts.write_replay(folder / REPRODUCE, argv)
        record.reproduce = f"{record.dir}/{REPRODUCE}"
        err.print(f"  smallest reproducing command: {record.command}", markup=False, highlight=False)
    return False


def _triage(
    records: list[TriageRecord],
    run_dir: Path,
    failing: Sequence[_Failing],
    run_trials: TrialRunner,
    err: Console,
) -> bool:
    """Triage each case that went oom, appending its record to `records`; True when interrupted."""
    for case in failing:
        if case.oom is None:
            continue
        folder = Path(run_dir) / TRIAGE_DIR / case.spec.name
        err.print(f"triage {case.spec.name} (oom)", markup=False, highlight=False)
        oom_dir = Path(run_dir) / "cases" / case.oom.name
        record = triage_case(case.spec, case.oom, oom_dir, run_trials(folder), say=_say(err))
        record.dir = f"{TRIAGE_DIR}/{case.spec.name}"
        records.append(record)
        err.print(f"  {record.kind}: {record.why}", markup=False, highlight=False, soft_wrap=True)
        if record.interrupted:
            return True
    return False


def triage_case(
    spec: CaseSpec,
    result: CaseResult,
    case_dir: Path,
    run_trial: Callable[[CaseSpec], CaseResult],
    *,
    say: Say = lambda text: None,
) -> TriageRecord:
    """`nsa_diag.analysis.triage.triage_oom` of the oom case in `case_dir`: its worker's message, and
    the device's memory from NVML (CUDA) or psutil (the CPU) where the message does not say it."""

    def device_total(on_cuda: bool) -> int | None:
        return cuda_device_total(result.device) if on_cuda else machine_memory_total()

    message = oom_message(case_dir, result)
    return triage_oom(spec, result, message, run_trial, device_total=device_total, say=say)


def oom_message(case_dir: Path, result: CaseResult) -> str:
    """The full out-of-memory message of the worker (``worker_result.json``), else the result's reason."""
    try:
        data = artifacts.read_json(Path(case_dir) / artifacts.WORKER_RESULT)
        message = (data.get("exception") or {}).get("message")
    except (OSError, ValueError, AttributeError):
        message = None
    return str(message or result.reason)


def machine_memory_total() -> int | None:
    """This machine's memory (the CPU's device total), or None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().total)


def cuda_device_total(device: str | None) -> int | None:
    """The total memory of the worker's CUDA device from NVML (no CUDA context in this process, which
    would take device memory from the reruns); the index goes through CUDA_VISIBLE_DEVICES when numeric."""
    index = int(device.partition(":")[2] or 0) if device and device.startswith("cuda") else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        if index >= len(visible) or not visible[index].isdigit():
            return None
        index = int(visible[index])
    snapshot = gpu.nvml_snapshot()
    gpus = snapshot.get("gpus") or []
    found = next((g for g in gpus if g.get("index") == index), None)
    total = found.get("memory_total_bytes") if found else None
    return int(total) if isinstance(total, int) else None
