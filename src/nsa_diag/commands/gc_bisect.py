"""`nsa-diag gc-bisect`: the smallest checkpointed layer range that reproduces a failure, or, with `--grads`,
the layers whose checkpointing changes the gradients."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_diag._cli_utils import CaseOptions, DebugOpt, JsonOpt, case_options
from nsa_diag.options import CHECK_OMITS, EVIDENCE, FAULTS, MODEL, NSA, OUTPUT, TRAINING, WATCHDOG


def check_grads_options(options: CaseOptions) -> None:
    """`--grads` compares gradients without training: refuse the options that act on training steps (one
    line, exit 2), as `verify` does not take them."""
    from nsa_diag.cases import CASE_OPTIONS
    from nsa_diag.errors import UsageError

    def given(name: str) -> bool:
        opt = CASE_OPTIONS[name]
        return opt.from_command_line(getattr(options, name)) != opt.from_command_line(opt.default)

    flags = [CASE_OPTIONS[name].flag for name in CHECK_OMITS if given(name)]
    if flags:
        raise UsageError(
            f"{', '.join(flags)} with gc-bisect --grads: the gradient comparison runs no training step "
            "(one forward and backward per checkpointed layer), so they would apply to nothing; "
            "leave them out"
        )


# FOLLOW_UPS (--repeat, --minimize, --triage) is left out: a bisection is itself a minimization, and each of
# its trials is one decision (a trial repeated until it fails would change what "reproduces" means).
@case_options(MODEL, NSA, TRAINING, WATCHDOG, FAULTS, EVIDENCE, OUTPUT, omit=("branch",))
def gc_bisect(
    options: CaseOptions,
    grads: Annotated[
        bool,
        typer.Option(
            "--grads", help="Compare every gradient with checkpointing on each single layer vs none."
        ),
    ] = False,
    resume: Annotated[
        Path | None,
        typer.Option("--resume", metavar="RUN_DIR", help="Continue the bisection of this run folder."),
    ] = None,
    json_output: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Find the smallest contiguous checkpointed layer range that still reproduces a failing case's verdict.

    The case (with `--gc all` or `--gc A:B`) runs first; if it passes there is nothing to bisect. Then it
    runs without checkpointing: if it fails too, that is said at once (exit 1). Otherwise the range is
    halved, keeping the half that reproduces the same verdict; when neither half does alone, it shrinks
    from each end: O(log L) runs. Every run is an isolated case in the run folder; `bisect.json` records
    them, and `--resume RUN_DIR` continues an interrupted bisection where it stopped.

    `--grads`: instead, for each single layer, compare every parameter's gradient with that layer
    checkpointed against no checkpointing (float64 on the CPU) and name the layers whose gradients differ
    (a `--model` must be an nsa_core.TinyLM or subclass; `--inject`, `--steps`, `--reference-check`,
    `--profile` and `--memory-snapshot` are refused: no training step runs). A layer whose comparison
    did not run is named as not compared, and the conclusion covers only the layers compared.

    Exit code 0 when a range is found (or, with `--grads`, no gradient differs), 1 when not, 2 for a bad
    option.

    Examples:

        nsa-diag gc-bisect --layers 4 --gc all --inject deadlock:layer=2,phase=recompute --stall 3
        nsa-diag gc-bisect --layers 4 --grads
        nsa-diag gc-bisect --resume nsa-diag-runs/20260101-120000-gc-bisect
        nsa-diag gc-bisect --layers 4 --gc all --inject nan:layer=1,phase=recompute --junit bisect.xml
    """
    from nsa_diag.cases import build_spec, check_options
    from nsa_diag.errors import UsageError
    from nsa_diag.launchers.preflight import check_user_model
    from nsa_diag.session import Session, check_follow_ups
    from nsa_diag.session.plans import Bisection, new_bisection, resumed_bisection

    follow = check_follow_ups(options)  # --junit
    if resume is not None:
        state = resumed_bisection(resume)
    else:
        check_options(options)
        if grads:
            check_grads_options(options)
        spec = build_spec(options, name="start")
        facts = check_user_model([spec])  # a --model: its own layer count is what gets bisected
        if grads and facts is not None and not facts.self_checkpointing:
            raise UsageError(
                f"gc-bisect --grads with --model {spec.model}: the comparison rebuilds the model from its "
                "nsa_core config with each layer checkpointed, which needs an nsa_core.TinyLM (or "
                f"subclass); {facts.type} is not one (gc-bisect --gc all bisects a failure on any model)"
            )
        state = new_bisection(spec, out=options.out, grads=grads, layers=facts.layers if facts else None)
    plan = Bisection(state, resume_dir=resume)
    session = Session(
        plan,
        out=options.out,
        tag=options.tag,
        json_output=json_output,
        follow=follow,
        replay_out=Path(state.out),
    )
    raise typer.Exit(session.run())
