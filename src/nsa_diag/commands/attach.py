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
        int | None,
        typer.Option(
            "--samples",
            min=2,
            max=60,
            show_default="rounds for up to 10 s",
            rich_help_panel=_WATCH,
            help="Take exactly this many rounds of /proc, beacon and stack evidence (CPU time and progress "
            "are their differences). By default attach takes a round every --interval for up to 10 s and "
            "ends at the first round that shows work.",
        ),
    ] = None,
    interval: Annotated[
        float,
        typer.Option(
            "--interval",
            min=0.1,
            max=60.0,
            metavar="SECONDS",
            rich_help_panel=_WATCH,
            help="Seconds between two rounds (the default watch of up to 10 s keeps its length).",
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
    allow_other_user: Annotated[
        bool,
        typer.Option(
            "--allow-other-user",
            rich_help_panel=_WATCH,
            help="As root, look into a process of another user too (it may get SIGUSR1 and be read with "
            "ptrace, as your own would). Without it another user's process is refused (exit 2), as root "
            "as for anyone else.",
        ),
    ] = False,
    out: typer_annotation(CASE_OPTIONS["out"], _OUTPUT) = CASE_OPTIONS["out"].default,  # type: ignore[valid-type]
    tag: typer_annotation(CASE_OPTIONS["tag"], _OUTPUT) = None,  # type: ignore[valid-type]
    json_output: Annotated[
        bool, typer.Option("--json", help="Print result.json to stdout instead of the table.")
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Take evidence from a running job and say what it is doing, without stopping or changing it.

    For PID and its descendants, a round every second for up to 10 s (ending at the first round that shows
    work; --samples and --interval change that): /proc state, kernel wait channel, CPU time and I/O bytes,
    the probe's beacon where the process runs under `nsa-diag watch` ("rank 1, step 5, backward,
    layers.7", with progress events/s); at 0, 1, 4, 7 and 10 s a faulthandler dump from each Python process
    that handles SIGUSR1 (the probe's, or its own `faulthandler.register`; /proc's SigCgt is checked first,
    since SIGUSR1 kills a process without a handler: those get no signal) and a `py-spy dump` of each
    other one (py-spy needs ptrace rights: attach says once what to run when they are missing); at the
    end `py-spy dump --native`, NVML's GPU memory and utilisation per process.

    The answer is a **state** of the training processes (the main process, or each rank; DataLoader
    workers, torchrun's agent and helpers are shown as what they are), not a verdict, and CPU alone is
    never progress: `progressing` (work seen: progress events, allocations, stacks that moved while using
    CPU, I/O), `paused` (sleeping, a checkpoint, a batch being loaded), `stalled` with the hang kind it
    would be (python-deadlock, gil-held, cuda-kernel, collective, unknown) and, for ranks, the minority
    rank, `unclear` (CPU used and nothing to tell work from a spin; the reason says what would settle it),
    or `gone`. Everything goes to `<out>/<time>-attach/` (result.json, summary.md, env.json,
    processes/PID/).

    Exit code 0 when the tree was progressing; 1 when it was stalled, unclear, paused or ended; 2 for a PID
    that does not exist, is not yours (as root too, unless --allow-other-user), is PID 1 or nsa-diag itself.

    Examples:

        nsa-diag attach 12345
        nsa-diag attach "$(pgrep -of train.py)" --json
        nsa-diag attach 12345 --samples 5 --interval 2
        nsa-diag attach 12345 --no-signal --no-children
    """
    from nsa_diag.session.attach import AttachRequest, run_attach

    request = AttachRequest(
        pid=pid, samples=samples, interval_s=interval, children=children, send_signal=send_signal,
        out=Path(out), tag=tag, allow_other_user=allow_other_user,
    )  # fmt: skip
    raise typer.Exit(run_attach(request, json_output=json_output))
