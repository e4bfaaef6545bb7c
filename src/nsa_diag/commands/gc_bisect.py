"""`nsa-diag gc-bisect`: the smallest checkpointed layer range that reproduces a failure, or, with `--grads`,
the layers whose checkpointing changes the gradients."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from nsa_diag._cli_utils import CaseOptions, DebugOpt, JsonOpt, case_options
from nsa_diag.options import EVIDENCE, FAULTS, MODEL, NSA, OUTPUT, TRAINING, WATCHDOG

GRADS_STALL_S = 120.0  # --stall auto in --grads mode: a check has no training step to measure


def _trial_spec(base: Any, name: str, overrides: dict[str, Any], **fields: Any) -> Any:
    from nsa_diag.spec import CaseSpec

    data = base.model_dump()
    data.update(name=name, overrides={**base.overrides, **overrides}, **fields)
    return CaseSpec.model_validate(data)


class Bisector:
    """Runs the trials of one bisection into its run folder, recording each in ``bisect.json``."""

    def __init__(self, run_dir: Path, state: Any) -> None:
        from nsa_diag import render
        from nsa_diag.spec import CaseSpec

        self.run_dir, self.state = run_dir, state
        self.base = CaseSpec.model_validate(state.spec)
        self.err = render.stderr_console()
        self.specs: list[Any] = []
        self.results: list[Any] = []

    def save(self) -> None:
        from nsa_diag import artifacts
        from nsa_diag.analysis.bisect import STATE_FILE

        artifacts.write_json(self.run_dir / STATE_FILE, self.state.model_dump(mode="json"))

    def say(self, text: str) -> None:
        self.err.print(text, markup=False, highlight=False, soft_wrap=True)

    def run(self, gc: str, name: str, overrides: dict[str, Any], **fields: Any) -> Any:
        """The trial of `gc`: recorded (resume) or run now as an isolated case."""
        from nsa_diag import artifacts
        from nsa_diag.analysis.bisect import Trial
        from nsa_diag.cases import replay_argv
        from nsa_diag.executor import run_case
        from nsa_diag.spec import CaseResult

        spec = _trial_spec(self.base, name, overrides, **fields)
        done = self.state.trial(gc)
        case_dir = artifacts.case_dir(self.run_dir, name)
        if done is not None:
            self.say(f"  gc {gc}: {done.verdict} (recorded)")
            result = CaseResult.model_validate(artifacts.read_json(case_dir / artifacts.RESULT))
        else:
            self.say(f"  gc {gc}: running case {name} ...")
            result = run_case(spec, case_dir, replay_argv=replay_argv(spec, Path(self.state.out)))
            done = Trial(gc=gc, case=name, verdict=result.verdict, reason=result.reason, parity=result.parity)
            self.state.trials.append(done)
            self.save()
            self.say(f"  gc {gc}: {result.verdict} ({result.reason})")
        self.specs.append(spec)
        self.results.append(result)
        return done

    # ---------------------------------------------------------------------------------------- modes

    def bisect(self) -> int:
        from nsa_diag.analysis.bisect import range_text, smallest_range

        state = self.state
        start = self.run(self.base.overrides.get("gc", "none"), "start", {})
        state.target = start.verdict
        if start.verdict == "pass":
            state.conclusion = f"the case passes with gc {self.base.overrides.get('gc')}: nothing to bisect"
            return 1
        none = self.run("none", "gc-none", {"gc": "none", "gc_reentrant": False})
        if none.verdict != "pass":
            state.conclusion = (
                f"fails without checkpointing too ({none.verdict}: {none.reason}): "
                "not a checkpointing problem"
            )
            return 1

        def reproduces(a: int, b: int) -> bool:
            text = range_text(a, b)
            return self.run(text, f"gc-{a}-{b}", {"gc": text}).verdict == state.target

        lo, hi = smallest_range(*state.start, reproduces)
        state.found = (lo, hi)
        what = f"layer {lo}" if hi - lo == 1 else f"layers {lo}..{hi - 1}"
        state.conclusion = (
            f"checkpointing {what} alone (gc {range_text(lo, hi)}) reproduces {state.target}; "
            f"no checkpointing passes ({len(state.trials)} runs)"
        )
        return 0

    def grads(self) -> int:
        from nsa_diag.cases import parse_stall

        state = self.state
        fields: dict[str, Any] = {"check": "gc", "inject": ()}
        if parse_stall(self.base.stall) == "auto":
            fields["stall"] = GRADS_STALL_S
        differ, failed = [], []
        for layer in range(state.layers):
            gc = f"{layer}:{layer + 1}"
            trial = self.run(gc, f"grads-L{layer}", {"gc": gc}, **fields)
            if trial.verdict == "mismatch":
                differ.append(layer)
            elif trial.verdict != "pass":
                failed.append(f"layer {layer}: {trial.verdict}")
        state.layers_differ = differ
        text = (
            "gradients differ from no checkpointing when checkpointing layer(s) "
            + ", ".join(map(str, differ))
            if differ
            else "checkpointing any single layer gives the gradients of no checkpointing"
        )
        state.conclusion = text + (f"; not compared: {', '.join(failed)}" if failed else "")
        return 1 if differ or failed else 0


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
    checkpointed against no checkpointing (float64 on the CPU) and name the layers whose gradients differ.

    Exit code 0 when a range is found (or, with `--grads`, no gradient differs), 1 when not, 2 for a bad
    option.

    Examples:

        nsa-diag gc-bisect --layers 4 --gc all --inject deadlock:layer=2,phase=recompute --stall 3
        nsa-diag gc-bisect --layers 4 --grads
        nsa-diag gc-bisect --resume nsa-diag-runs/20260101-120000-gc-bisect
        nsa-diag gc-bisect --layers 4 --gc all --inject nan:layer=1,phase=recompute --junit bisect.xml
    """
    from nsa_diag import artifacts, render
    from nsa_diag.analysis.bisect import STATE_FILE, BisectState
    from nsa_diag.cases import build_spec, check_options
    from nsa_diag.errors import UsageError
    from nsa_diag.evidence.env import collect_env
    from nsa_diag.session import check_follow_ups, follow_up

    follow = check_follow_ups(options)  # --junit
    if resume is not None:
        path = Path(resume) / STATE_FILE
        if not path.is_file():
            raise UsageError(f"--resume {resume}: no {STATE_FILE} there (not a gc-bisect run folder)")
        state = BisectState.model_validate(artifacts.read_json(path))
        run_dir = Path(resume)
    else:
        check_options(options)
        spec = build_spec(options, name="start")
        cfg = spec.nsa_config()
        gc_layers = cfg.gc_layers
        if not grads and not len(gc_layers):
            raise UsageError("gc-bisect needs checkpointing to bisect: add --gc all or --gc A:B")
        start = (gc_layers.start, gc_layers.stop) if len(gc_layers) else (0, cfg.layers)
        state = BisectState(
            mode="grads" if grads else "range",
            spec=spec.model_dump(mode="json"),
            out=str(Path(options.out).resolve()),
            layers=cfg.layers,
            start=start,
        )
        run_dir = artifacts.new_run_dir("gc-bisect", options.out, options.tag)
        artifacts.write_json(run_dir / artifacts.ENV, collect_env())
    bisector = Bisector(run_dir, state)
    bisector.save()
    bisector.say(f"nsa-diag gc-bisect ({state.mode}) into {run_dir}")
    started = time.time()
    code = bisector.grads() if state.mode == "grads" else bisector.bisect()
    state.done = True
    bisector.save()
    summary = render.build_summary("gc-bisect", run_dir, bisector.specs, bisector.results, started_at=started)
    summary["bisect"] = state.model_dump(mode="json", exclude={"spec"})
    summary["exit_code"] = code
    summary = follow_up(summary, run_dir, bisector.specs, bisector.results, follow=follow, out=options.out)
    render.write_summary(run_dir, summary)
    if json_output:
        render.print_json(summary)
    else:
        typer.echo(f"gc-bisect: {state.conclusion}")
        typer.echo(f"run folder: {run_dir}")
    raise typer.Exit(code)
