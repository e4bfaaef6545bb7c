"""`nsa-diag watch -- CMD`: a user's own command (a script, a torchrun job) under the watchdog."""

from __future__ import annotations

from typing import Annotated

import typer

from nsa_diag._cli_utils import CaseOptions, DebugOpt, JsonOpt, case_options
from nsa_diag.options import CASE_NAME, DDP, EVIDENCE, OUTPUT, WATCHDOG

_JOB = "Your job"


# of the evidence options, a job takes the probe's detail: the others act on nsa-diag's own worker
_NOT_FOR_A_JOB = tuple(name for name in EVIDENCE.names if name != "branch_marks")
# of ddp's, what a straggler is: the ranks of a torchrun job are compared as ddp's are
_NOT_FOR_A_JOB += tuple(name for name in DDP.names if name != "straggler_ratio")


@case_options(
    WATCHDOG,
    EVIDENCE,
    DDP,
    OUTPUT,
    CASE_NAME,
    omit=("junit", *_NOT_FOR_A_JOB),
    defaults={"name": "watch", "timeout": None},
)
def watch(
    options: CaseOptions,
    command: Annotated[
        list[str] | None,
        typer.Argument(
            help="The command to run, after --: python train.py ..., torchrun ..., ./run.sh.",
            show_default=False,
        ),
    ] = None,
    keep_alive: Annotated[
        bool,
        typer.Option(
            "--keep-alive",
            help="After a hang's or a timeout's evidence, leave the job running (it is never stopped).",
            rich_help_panel=_JOB,
        ),
    ] = False,
    total_steps: Annotated[
        int | None,
        typer.Option(
            "--total-steps",
            min=1,
            metavar="N",
            help="Steps the job will run, for a slow job's ETA (or it calls nsa_diag.probe.total_steps).",
            rich_help_panel=_JOB,
        ),
    ] = None,
    json_output: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run your own command under the watchdog: hang or slow, where, why, with evidence; no code change.

    The command runs in its own process group, in this directory, with your environment. Every Python
    process of it (torchrun's ranks and DataLoader workers included) gets a light probe at start-up: a
    heartbeat and progress beacon, faulthandler on SIGUSR1, and once torch is imported hooks on the
    model's blocks and the optimizer step, so progress reads "rank 1, step 5, backward, layers.7".
    No progress and no work for the stall limit is a **hang** (`--stall auto`: 30 s, or 3x the longest
    step, optimizer step to optimizer step, when that is longer; from the start, before the first step
    too), whatever the wait: a lock, a queue, a read, a loop that sleeps and checks for a file that never
    comes. Work keeps a job running however long its pause: a checkpoint written (bytes moving), a
    DataLoader worker producing the batch, child programs or other ranks that work, a moving frame with
    CPU, CUDA allocations, a compile. There is no time box: `watch` runs as long as the job does;
    `--timeout` sets one for a diagnosis run (progress or work past it is **slow**, with its rate and ETA).
    Before anything is stopped, evidence from every process: two stack
    samples, py-spy when installed, /proc, GPU, the NCCL flight recorder, the ranks' minority. The verdict is
    about the training process (or each rank); DataLoader workers, torchrun's agent and helpers are reported
    as what they are. Then the job is stopped (SIGTERM, grace, SIGKILL) unless `--keep-alive`. A job that
    exits gets pass, error (its last traceback), crash, oom or nonfinite (a NaN loss it called backward() on).
    The ranks' step times are compared: a rank consistently slower than the others (`--straggler-ratio`) is
    named, with the phase its extra time is in, also when the job passes. Its output streams here and into
    `<out>/<time>-watch/cases/<name>/` with `replay.sh`.

    Exit code 0 when the job passes, 4 when it hung (a restart may help), 1 for any other verdict (an
    error, a crash: read the traceback), 2 for a bad option or command, 3 for an internal error of
    nsa-diag, 130 on Ctrl-C (the job is stopped).

    Examples:

        nsa-diag watch -- python train.py --lr 3e-4
        nsa-diag watch -- torchrun --nproc-per-node 2 train.py
        nsa-diag watch --stall 120 -- python train.py   # no progress event for minutes: a longer stall
        nsa-diag watch --stall 30 --keep-alive -- ./run_training.sh
        nsa-diag watch --timeout 600 --total-steps 1000 --json -- python train.py
    """
    from nsa_diag.session import Session
    from nsa_diag.session.watch import WatchPlan, build_watch_spec

    spec = build_watch_spec(options, command or [], keep_alive=keep_alive, total_steps=total_steps)
    session = Session(WatchPlan(spec), out=options.out, tag=options.tag, json_output=json_output)
    raise typer.Exit(session.run())
