"""One invocation of a case command: the run folder, the runner with the live display, the summary.

Every case command ends in `run_session`: it creates the run folder (only now, after every check has
passed), runs the cases one after the other through `nsa_diag.executor.run_cases` while `LiveProgress` shows
on stderr where the worker is, writes summary.json and summary.md, prints the table (or the JSON with
`--json`) on stdout, and returns the exit code: 0 when every case is ok, 1 when not, 130 when interrupted
(the runner has then stopped the case's processes and written its result.json).

Given the command's `CaseOptions` (``options=``), it also honours the follow-up options (`follow_up`):

- ``--repeat N``: every case runs N times as ``cases/<case>-r<i>`` (`nsa_diag.analysis.repeat`);
  summary.json gets ``repeats`` (verdict counts, hang probability and interval, time to hang, transient);
- ``--minimize``: each failing case is shrunk by real runs under ``minimize/<case>/<trial>/``
  (`nsa_diag.analysis.minimize`); summary.json's ``minimize`` holds the trials and the smallest command;
- ``--triage``: each oom case is rerun with allocator settings under ``triage/<case>/<variant>/`` and
  classified (`nsa_diag.analysis.triage`); summary.json's ``triage``;
- ``--junit FILE``: the case results as JUnit XML (`nsa_diag.junit`).

Follow-ups change no verdict and no exit code, except that an interrupt during them exits 130.
Commands with their own loop (`scale`, `gc-bisect`) call `check_follow_ups` before creating their run
folder and `follow_up` before writing their summary.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nsa_diag import artifacts, render
from nsa_diag.cases import Expectation, replay_argv
from nsa_diag.errors import EXIT_ABORTED, UsageError
from nsa_diag.spec import CaseResult, CaseSpec

if TYPE_CHECKING:
    from rich.console import Console

    from nsa_diag._cli_utils import CaseOptions

MINIMIZE_DIR = "minimize"
TRIAGE_DIR = "triage"
REPRODUCE = "reproduce.sh"  # minimize/<case>/reproduce.sh: the smallest reproducing command


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


def _results_on_disk(run_dir: Path, specs: Sequence[CaseSpec]) -> list[CaseResult]:
    """The result.json of every case that has one (after an interrupt, the runner returned nothing)."""
    results = []
    for spec in specs:
        path = Path(run_dir) / "cases" / spec.name / artifacts.RESULT
        try:
            results.append(CaseResult.model_validate(artifacts.read_json(path)))
        except (OSError, ValueError):
            continue
    return results


def run_session(
    command: str,
    specs: Sequence[CaseSpec],
    *,
    out: Path,
    tag: str | None,
    json_output: bool,
    expectations: Mapping[str, Expectation] | None = None,
    options: CaseOptions | None = None,
) -> int:
    """Run `specs` into a new run folder under `out`, report them, and return the exit code.

    `options`: the command's case options, for the follow-ups (--repeat, --minimize, --triage, --junit).
    """
    from nsa_diag.analysis.repeat import expand
    from nsa_diag.executor import run_cases

    names = [spec.name for spec in specs]
    assert len(set(names)) == len(names), f"case names must be unique: {names}"
    follow = check_follow_ups(options)
    runs, base_of = expand(specs, follow.repeat)
    expectations = expectations or {}
    run_expectations = {
        run.name: expectations[base_of[run.name]] for run in runs if base_of[run.name] in expectations
    }
    run_dir = artifacts.new_run_dir(command, out, tag)
    err = render.stderr_console()
    times = f" x {follow.repeat} repeats" if follow.repeat > 1 else ""
    err.print(
        f"nsa-diag {command}: {len(specs)} case(s){times} into {run_dir}", markup=False, highlight=False
    )
    started = time.time()
    live = render.LiveProgress(err, runs)
    interrupted = False
    replays = {spec.name: replay_argv(spec, out) for spec in runs}
    results: list[CaseResult] = []
    try:
        with live:
            results = list(
                run_cases(
                    runs,
                    run_dir,
                    replay_argv=lambda spec: replays[spec.name],
                    on_case_start=live.case_start,
                    on_progress=live.progress,
                    on_case_end=live.case_end,
                )
            )
    except KeyboardInterrupt:
        interrupted = True
        results = _results_on_disk(run_dir, runs)
        err.print("nsa-diag: interrupted; the running case was stopped", markup=False, highlight=False)

    summary = render.build_summary(
        command,
        run_dir,
        runs,
        results,
        started_at=started,
        expectations=run_expectations,
        interrupted=interrupted,
    )
    summary = follow_up(summary, run_dir, specs, results, follow=follow, out=out, base_of=base_of, err=err)
    render.write_summary(run_dir, summary)
    if json_output:
        render.print_json(summary)
    else:
        render.render_summary(summary)
        render.render_follow_ups(summary)
    return int(summary["exit_code"])


def follow_up(
    summary: dict[str, Any],
    run_dir: Path,
    specs: Sequence[CaseSpec],
    results: Sequence[CaseResult],
    *,
    follow: FollowUps,
    out: Path,
    base_of: Mapping[str, str] | None = None,
    err: Console | None = None,
) -> dict[str, Any]:
    """Add the follow-ups to `summary` (built over `results`; `specs` are the cases before repeating,
    `base_of` maps a run's name to its case's): repeats, minimize, triage, and the JUnit file."""
    err = err or render.stderr_console()
    base_of = dict(base_of or {r.name: r.name for r in results})
    if follow.repeat > 1:
        summary["repeats"] = _repeats(summary, run_dir, specs, results, base_of, follow.repeat)
    if not summary["interrupted"] and (follow.minimize or follow.triage):
        failing = _failing(summary, specs, results, base_of)
        stopped = False
        try:
            if follow.minimize:
                summary["minimize"] = []
                stopped = _minimize(summary["minimize"], run_dir, failing, out, err)
            if follow.triage and not stopped:
                summary["triage"] = []
                stopped = _triage(summary["triage"], run_dir, failing, out, err)
        except KeyboardInterrupt:
            stopped = True  # between two runs; the records made so far are in the summary
        if stopped:
            summary.update(interrupted=True, ok=False, exit_code=EXIT_ABORTED)
            err.print("nsa-diag: interrupted; the follow-up runs were stopped", markup=False, highlight=False)
    if follow.junit is not None:
        from nsa_diag.junit import write_junit

        judged = {c["name"]: c["ok"] for c in summary["cases"] if "expected" in c}  # selftest expectations
        write_junit(follow.junit, summary["command"], results, elapsed_s=summary.get("elapsed_s"), ok=judged)
        summary["junit"] = str(follow.junit)
    return summary


def _repeats(
    summary: Mapping[str, Any],
    run_dir: Path,
    specs: Sequence[CaseSpec],
    results: Sequence[CaseResult],
    base_of: Mapping[str, str],
    repeat: int,
) -> dict[str, Any]:
    from nsa_diag.analysis.repeat import hang_timing, repeats_section

    timings = {
        r.name: hang_timing(
            Path(run_dir) / "cases" / r.name, r.stall_limit_s, r.where.step if r.where else None
        )
        for r in results
        if r.verdict == "hang"
    }
    return repeats_section(summary["cases"], base_of, [s.name for s in specs], repeat, timings)


@dataclass
class _Failing:
    spec: CaseSpec
    result: CaseResult  # the first run of the case that did not go as expected (or went oom)
    case_dir: Path
    not_ok: bool
    oom: CaseResult | None


def _failing(
    summary: Mapping[str, Any],
    specs: Sequence[CaseSpec],
    results: Sequence[CaseResult],
    base_of: Mapping[str, str],
) -> list[_Failing]:
    """Per case, its first run that was not ok (nothing to reproduce in a skipped one) and its first oom."""
    ok = {entry["name"]: entry["ok"] for entry in summary["cases"]}
    run_dir = Path(summary["run_dir"])
    found = []
    for spec in specs:
        runs = [r for r in results if base_of.get(r.name) == spec.name]
        bad = next((r for r in runs if not ok.get(r.name, r.passed) and r.verdict != "skipped"), None)
        oom = next((r for r in runs if r.verdict == "oom"), None)
        first = bad or oom
        if first is not None:
            found.append(_Failing(spec, first, run_dir / "cases" / first.name, bad is not None, oom))
    return found


def _trial_runner(folder: Path, out: Path, err: Console) -> Any:
    """Runs one follow-up case into ``folder/<its name>/`` with the live display; returns its result."""
    from nsa_diag.executor import run_case

    def run_trial(spec: CaseSpec) -> CaseResult:
        live = render.LiveProgress(err, [spec])
        with live:
            live.case_start(spec)
            result = run_case(
                spec, Path(folder) / spec.name, replay_argv=replay_argv(spec, out), on_progress=live.progress
            )
            live.case_end(result)
        return result

    return run_trial


def _say(err: Console) -> Any:
    return lambda text: err.print(text, markup=False, highlight=False, soft_wrap=True)


def _minimize(
    records: list[dict[str, Any]], run_dir: Path, failing: Sequence[_Failing], out: Path, err: Console
) -> bool:
    """Minimize each failing case, appending its record to `records`; True when interrupted."""
    import sys

    from nsa_diag.analysis.minimize import MAX_TRIALS, Target, minimize_case

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
            case.spec,
            case.result,
            _trial_runner(folder, out, err),
            name=f"{case.spec.name}-min",
            say=_say(err),
        )
        record["dir"] = f"{MINIMIZE_DIR}/{case.spec.name}"
        records.append(record)
        if record["interrupted"]:
            return True
        argv = [sys.executable, "-m", "nsa_diag", *record["argv"][1:]]
        artifacts.write_replay(folder / REPRODUCE, argv)
        record["reproduce"] = f"{record['dir']}/{REPRODUCE}"
        err.print(f"  smallest reproducing command: {record['command']}", markup=False, highlight=False)
    return False


def _triage(
    records: list[dict[str, Any]], run_dir: Path, failing: Sequence[_Failing], out: Path, err: Console
) -> bool:
    """Triage each case that went oom, appending its record to `records`; True when interrupted."""
    from nsa_diag.analysis.triage import triage_case

    for case in failing:
        if case.oom is None:
            continue
        folder = Path(run_dir) / TRIAGE_DIR / case.spec.name
        err.print(f"triage {case.spec.name} (oom)", markup=False, highlight=False)
        oom_dir = Path(run_dir) / "cases" / case.oom.name
        record = triage_case(case.spec, case.oom, oom_dir, _trial_runner(folder, out, err), say=_say(err))
        record["dir"] = f"{TRIAGE_DIR}/{case.spec.name}"
        records.append(record)
        err.print(f"  {record['class']}: {record['why']}", markup=False, highlight=False, soft_wrap=True)
        if record["interrupted"]:
            return True
    return False
