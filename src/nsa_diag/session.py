"""One invocation of a case command: the run folder, the runner with the live display, the summary.

Every case command ends in `run_session`: it creates the run folder (only now, after every check has
passed), runs the cases one after the other through `nsa_diag.runner.run_cases` while `LiveProgress` shows
on stderr where the worker is, writes summary.json and summary.md, prints the table (or the JSON with
`--json`) on stdout, and returns the exit code: 0 when every case is ok, 1 when not, 130 when interrupted
(the runner has then stopped the case's processes and written its result.json).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from nsa_diag import artifacts, render
from nsa_diag.cases import Expectation, replay_argv
from nsa_diag.spec import CaseResult, CaseSpec


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
) -> int:
    """Run `specs` into a new run folder under `out`, report them, and return the exit code."""
    from nsa_diag.runner import run_cases

    names = [spec.name for spec in specs]
    assert len(set(names)) == len(names), f"case names must be unique: {names}"
    run_dir = artifacts.new_run_dir(command, out, tag)
    err = render.stderr_console()
    err.print(f"nsa-diag {command}: {len(specs)} case(s) into {run_dir}", markup=False, highlight=False)
    started = time.time()
    live = render.LiveProgress(err, specs)
    interrupted = False
    replays = {spec.name: replay_argv(spec, out) for spec in specs}
    results: list[CaseResult] = []
    try:
        with live:
            results = list(
                run_cases(
                    list(specs),
                    run_dir,
                    replay_argv=lambda spec: replays[spec.name],
                    on_case_start=live.case_start,
                    on_progress=live.progress,
                    on_case_end=live.case_end,
                )
            )
    except KeyboardInterrupt:
        interrupted = True
        results = _results_on_disk(run_dir, specs)
        err.print("nsa-diag: interrupted; the running case was stopped", markup=False, highlight=False)

    summary = render.build_summary(
        command,
        run_dir,
        specs,
        results,
        started_at=started,
        expectations=expectations,
        interrupted=interrupted,
    )
    render.write_summary(run_dir, summary)
    if json_output:
        render.print_json(summary)
    else:
        render.render_summary(summary)
    return int(summary["exit_code"])
