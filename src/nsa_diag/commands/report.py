"""`nsa-diag report DIR`: render a run folder as report.md with PNG plots beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_diag._cli_utils import DebugOpt


def report(
    run_dir: Annotated[
        Path, typer.Argument(metavar="DIR", help="A run folder, e.g. nsa-diag-runs/20260101-120000-branch.")
    ],
    json_output: Annotated[
        bool,
        typer.Option("--json", help="Print what was written (report, plots, verdict counts) as JSON."),
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Render a run folder of any command as `DIR/report.md`, with PNG plots beside it (`report-*.png`).

    The report holds the cases table (verdict, where, time, tokens/s, peak memory, parity); for a matrix
    run a verdict grid over its axes (two axes: rows x columns; more: one grid per combination of the
    others); memory and time against sequence length with the fitted growth (from scale.json, or from
    cases that differ only in S); where each failing case was stopped, with its hang kind and the first
    frames of its stack samples (and py-spy's native frames); and the environment. It is read from the
    files alone, so it works on an interrupted run and on a folder copied from another machine. Running
    it again overwrites the report.

    Exit code 0 when the report is written, 2 when DIR is not a run folder.

    Examples:

        nsa-diag report nsa-diag-runs/20260101-120000-matrix-backward
        nsa-diag report "$(ls -d nsa-diag-runs/*-scale | tail -1)"
        nsa-diag report nsa-diag-runs/20260101-120000-branch --json
    """
    from nsa_diag.render import print_json, print_line
    from nsa_diag.report import write_report

    written = write_report(run_dir)
    for note in written["notes"]:  # what could not be read, e.g. a file that is not a regular file: skipped
        typer.echo(f"note: {note}", err=True)
    if json_output:
        print_json(written)
    else:
        print_line(f"report: {written['report']}")
        for plot in written["plots"]:
            print_line(f"plot:   {plot}")
        if written["plot_error"]:
            typer.echo(f"plots could not be drawn: {written['plot_error']}", err=True)
    raise typer.Exit(0)
