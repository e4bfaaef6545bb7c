"""`nsa-diag fr DIR`: a run folder from the flight recorder dumps a job left behind (no job runs).

The dumps are read (`nsa_diag.evidence.flight`), analysed (`nsa_diag.analysis.flight`) and written up:
``result.json`` (the analysis and the files read), ``summary.md`` (a table per process group and the
findings). Everything is checked before the run folder exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nsa_diag import artifacts, render
from nsa_diag.analysis.flight import analyse, rank_names
from nsa_diag.cases import check_output
from nsa_diag.errors import UsageError
from nsa_diag.evidence.flight import find_dumps, load_dump
from nsa_diag.records import FrAnalysis, FrRun

SUMMARY_MD = "summary.md"


@dataclass(frozen=True)
class FrRequest:
    """What `nsa-diag fr` was asked."""

    directory: Path
    prefix: str | None = None
    world_size: int | None = None
    out: Path = artifacts.DEFAULT_OUT
    tag: str | None = None

    def check(self) -> None:
        if self.world_size is not None and self.world_size < 1:
            raise UsageError(f"--world-size {self.world_size}: at least 1")
        check_output(self.out, self.tag)


def summary_markdown(directory: Path, analysis: FrAnalysis) -> str:
    lines = [
        f"# nsa-diag fr {directory}",
        "",
        f"**{_verdict(analysis)}**",
        "",
        f"Dumps of ranks {', '.join(str(r) for r in analysis.ranks)}"
        + (f" of {analysis.world_size}" if analysis.world_size else "")
        + (f"; none from {', '.join(str(r) for r in analysis.missing)}" if analysis.missing else "")
        + ".",
        "",
        *(f"- {line}" for line in analysis.findings),
    ]  # fmt: skip
    for group in analysis.groups:
        lines += ["", f"## group {group.name}" + (f" ({group.desc})" if group.desc else ""), ""]
        lines += ["| rank | last entered | at | last completed (as recorded) |", "|---|---|---|---|"]
        for rank in group.ranks:
            call = group.last_entered.get(str(rank))
            done = group.last_completed.get(str(rank))
            cells = [str(rank), call.describe() if call else "none", (call.site or "") if call else "",
                     "?" if done is None else f"#{done}"]  # fmt: skip
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _verdict(analysis: FrAnalysis) -> str:
    if analysis.culprits:
        return f"culprit: {rank_names(analysis.culprits)}"
    if analysis.suspects:
        return f"cross wait: {rank_names(analysis.suspects)} each wait for another"
    return "no culprit: the dumps agree"


def run_fr(req: FrRequest, *, json_output: bool = False) -> int:
    """Read, analyse, write; the exit code: 1 where a culprit was found, else 0."""
    req.check()
    files = find_dumps(req.directory, req.prefix)
    if req.world_size is not None and (extra := [r for r in files if r >= req.world_size]):
        raise UsageError(f"--world-size {req.world_size}: the folder has dumps of rank(s) {extra}")
    dumps = {rank: load_dump(path) for rank, path in files.items()}
    analysis = analyse(dumps, req.world_size)
    record = FrRun(
        directory=str(req.directory), files={str(r): str(p) for r, p in files.items()}, analysis=analysis,
        exit_code=1 if analysis.culprits or analysis.suspects else 0,
    )  # fmt: skip
    run_dir = artifacts.new_run_dir("fr", req.out, req.tag)
    try:
        artifacts.write_json(run_dir / artifacts.RESULT, record)
        artifacts.write_text(run_dir / SUMMARY_MD, summary_markdown(req.directory, analysis))
    except OSError as exc:
        artifacts.remove_run_dir(run_dir)
        raise UsageError(f"{run_dir}: cannot write the run's files: {exc.strerror or exc}") from None
    if json_output:
        render.print_json(record)
    else:
        render_fr(analysis, run_dir)
    return record.exit_code


def render_fr(analysis: FrAnalysis, run_dir: Path) -> None:
    from rich.markup import escape

    console = render.stdout_console()
    colour = "red" if analysis.culprits or analysis.suspects else "green"
    console.print(f"[bold {colour}]{escape(_verdict(analysis))}[/]")
    for line in analysis.findings:
        console.print(f"- {escape(line)}")
    console.print(f"evidence: {escape(str(run_dir))}")
