"""`nsa-diag attach PID`: evidence from a job that is already running, and what it is doing; stops nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_diag._cli_utils import DebugOpt, typer_annotation
from nsa_diag.cases import CASE_OPTIONS

_WATCH = "Watching"
_OUTPUT = "Output"


def attach(
    pid: Annotated[int, typer.Argument(metavar="PID", help="The process to look at (and its descendants).")],
    samples: Annotated[
        int,
        typer.Option(
            "--samples",
            min=2,
            max=20,
            rich_help_panel=_WATCH,
            help="Rounds of /proc, beacon and stack evidence (CPU time and progress are their differences).",
        ),
    ] = 2,
    interval: Annotated[
        float,
        typer.Option(
            "--interval",
            min=0.1,
            max=60.0,
            metavar="SECONDS",
            rich_help_panel=_WATCH,
            help="Seconds between two rounds.",
        ),
    ] = 1.0,
    children: Annotated[
        bool,
        typer.Option(
            "--children/--no-children",
            rich_help_panel=_WATCH,
            help="Also look at every descendant of PID (torchrun's ranks, DataLoader workers).",
        ),
    ] = True,
    send_signal: Annotated[
        bool,
        typer.Option(
            "--signal/--no-signal",
            rich_help_panel=_WATCH,
            help="Ask processes that handle SIGUSR1 for a faulthandler dump. --no-signal sends nothing, "
            "e.g. to a job whose own SIGUSR1 handler does something else (a SLURM requeue handler).",
        ),
    ] = True,
    out: typer_annotation(CASE_OPTIONS["out"], _OUTPUT) = CASE_OPTIONS["out"].default,  # type: ignore[valid-type]
    tag: typer_annotation(CASE_OPTIONS["tag"], _OUTPUT) = None,  # type: ignore[valid-type]
    json_output: Annotated[
        bool, typer.Option("--json", help="Print result.json to stdout instead of the table.")
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Take evidence from a running job and say what it is doing, without stopping or changing it.

    For PID and its descendants: two rounds a second apart of /proc state, kernel wait channel and CPU
    time, the probe's beacon where the process runs under `nsa-diag watch` ("rank 1, step 5, backward,
    layers.7", with progress events/s), a faulthandler dump from each Python process that handles
    SIGUSR1 (the probe's, or its own `faulthandler.register`; /proc's SigCgt is checked first, since
    SIGUSR1 kills a process without a handler: those get no signal), `py-spy dump` when installed (it
    needs ptrace rights: attach says what to run when they are missing), NVML's GPU memory and
    utilisation per process.

    The answer is a **state**, not a verdict: `progressing` (the beacon counted progress, or without a
    beacon CPU was used outside any wait), `stalled` with the hang kind it would be (python-deadlock,
    python-busy, gil-held, cuda-kernel, collective, unknown), or `gone`. Everything goes to
    `<out>/<time>-attach/` (result.json, summary.md, env.json, processes/<pid>/).

    Exit code 0 when the tree was progressing, 1 when it was stalled or ended, 2 for a PID that does not
    exist, is not yours, is PID 1 or nsa-diag itself.

    Examples:

        nsa-diag attach 12345
        nsa-diag attach "$(pgrep -of train.py)" --json
        nsa-diag attach 12345 --samples 5 --interval 2
        nsa-diag attach 12345 --no-signal --no-children
    """
    from nsa_diag.session.attach import AttachRequest, run_attach

    request = AttachRequest(
        pid=pid, samples=samples, interval_s=interval, children=children, send_signal=send_signal,
        out=Path(out), tag=tag,
    )  # fmt: skip
    raise typer.Exit(run_attach(request, json_output=json_output))
