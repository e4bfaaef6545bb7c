"""The plans a `Session` runs, besides a matrix (`nsa_diag.session.matrix`):

- `CaseList`: a fixed list of cases, one after the other (run, branch, backend, selftest, verify, ddp);
  with ``--repeat N`` each case runs N times as ``<case>-r<i>``;
- `NodePart`: one node's part of a multi-node ddp case, in the run folder the nodes share;
- `Sweep`: `nsa-diag scale`'s series over S (or layers), each run upward until a point does not pass;
  adds ``scale.json`` and ``scale.png`` (`nsa_diag.analysis.sweep` fits, `render.render_scale` shows);
- `Bisection`: `nsa-diag gc-bisect`'s trials, each decided by the one before (`nsa_diag.analysis.bisect`),
  recorded in ``bisect.json`` so that ``--resume`` runs only the trials not yet made.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from nsa_diag import artifacts, render
from nsa_diag.analysis.bisect import STATE_FILE, BisectState, Trial, range_text, smallest_range
from nsa_diag.analysis.repeat import expand
from nsa_diag.analysis.sweep import Budget, ScaleReport, Series, analyse_series, quadratic_culprits
from nsa_diag.cases import build_spec, parse_stall
from nsa_diag.errors import UsageError
from nsa_diag.options import Branch
from nsa_diag.session.core import Plan, Session, read_result
from nsa_diag.spec import CaseResult, CaseSpec, Injection, OverrideValue

if TYPE_CHECKING:
    from nsa_diag.cases import CaseOptions, Expectation
    from nsa_diag.session.followups import FollowUps
    from nsa_diag.summary import RunSummary

SCALE_JSON = "scale.json"
SCALE_PNG = "scale.png"
GRADS_STALL_S = 120.0  # gc-bisect --grads under --stall auto: a check has no training step to measure


# --- a fixed list of cases --------------------------------------------------------------------------------


class CaseList(Plan):
    """The cases in order; with --repeat each one N times (`nsa_diag.analysis.repeat.expand`).
    An interrupted case is summarized with the result the runner wrote for it."""

    def __init__(
        self,
        command: str,
        specs: Sequence[CaseSpec],
        expectations: Mapping[str, Expectation] | None = None,
        *,
        left_out: Mapping[str, str] | None = None,
    ) -> None:
        names = [spec.name for spec in specs]
        assert len(set(names)) == len(names), f"case names must be unique: {names}"
        self.command = command
        self.cases = list(specs)
        self._expected = dict(expectations or {})
        self.left_out = dict(left_out or {})  # checks the command left out here, with why (the summary's)
        self.repeat = 1
        self.runs, self.base_of = expand(self.cases, 1)
        self._results: list[CaseResult] = []

    def prepare(self, follow: FollowUps) -> None:
        self.repeat = follow.repeat
        self.runs, self.base_of = expand(self.cases, follow.repeat)

    def specs(self) -> Sequence[CaseSpec]:
        return self.runs

    def bases(self) -> tuple[Sequence[CaseSpec], Mapping[str, str] | None]:
        return self.cases, self.base_of

    def expectations(self) -> Mapping[str, Expectation] | None:
        return {run: self._expected[base] for run, base in self.base_of.items() if base in self._expected}

    def begin(self, session: Session) -> None:
        times = f" x {self.repeat} repeats" if self.repeat > 1 else ""
        session.note(f"nsa-diag {self.command}: {len(self.cases)} case(s){times} into {session.run_dir}")
        for name, why in self.left_out.items():
            session.note(f"  not checked here: {name} ({why})", soft_wrap=True)

    def extend(self, summary: RunSummary) -> None:
        summary.left_out = self.left_out or None

    def execute(self, session: Session) -> None:
        try:
            with render.LiveProgress(session.err, self.runs) as live:
                for spec in self.runs:
                    self._results.append(session.run_shown(live, spec))
        except KeyboardInterrupt:  # the interrupted case has its result.json too
            found = (read_result(session.run_dir / "cases" / spec.name) for spec in self.runs)
            self._results = [result for result in found if result is not None]
            raise

    def results(self) -> list[CaseResult]:
        return list(self._results)


class NodePart(CaseList):
    """This node's part of a multi-node ddp case (`nsa_diag.launchers.nodes`): the run folder
    ``<out>/ddp-<run id>[-<tag>]`` that every node derives alike and shares, each node under its own lock
    (a second process for the same node rank is refused); env.json in ``nodes/<R>/`` (node 0's also as the
    run's); node 0 writes the summary, a node R > 0 its own in ``nodes/<R>/``. A run that has finished
    (the case has its result.json) is not run again in the same folder: ``--run-id`` names a new one."""

    def __init__(self, spec: CaseSpec, out: Path, tag: str | None = None) -> None:
        super().__init__("ddp", [spec])
        assert spec.ddp is not None
        self.node = spec.ddp.node_rank
        self.nnodes = spec.ddp.nnodes
        self.shared_dir = Path(out) / (f"ddp-{spec.run_id()}" + (f"-{tag}" if tag else ""))
        self.lock_name = artifacts.node_lock(self.node)

    def home(self, run_dir: Path) -> Path:
        return run_dir if self.node == 0 else artifacts.node_dir(run_dir, self.node)

    def env_files(self, run_dir: Path) -> list[Path]:
        own = artifacts.node_dir(run_dir, self.node) / artifacts.ENV
        return [run_dir / artifacts.ENV, own] if self.node == 0 else [own]

    def reopened(self, session: Session) -> None:
        spec = self.cases[0]
        done = session.run_dir / "cases" / spec.name / artifacts.RESULT
        if done.exists():
            raise UsageError(
                f"{session.run_dir}: this run has finished already ({done.relative_to(session.run_dir)}); "
                "give every node a new --run-id (or another --out) to run it again"
            )

    def begin(self, session: Session) -> None:
        session.note(
            f"nsa-diag ddp: node {self.node} of {self.nnodes}, case {self.cases[0].name} into "
            f"{session.run_dir} (shared by the nodes)"
        )


# --- nsa-diag scale ---------------------------------------------------------------------------------------


def _backend(spec: CaseSpec, branch: str) -> str | None:
    if spec.model is not None:
        return None
    nsa = spec.nsa_config().nsa
    if branch == "all":
        return f"sel={nsa.sel_backend},cmp={nsa.cmp_backend},win={nsa.win_backend}"
    return str(getattr(nsa, f"{branch}_backend"))


def build_series(
    options: CaseOptions, seq_lens: Sequence[int], layers: Sequence[int], *, per_branch: bool
) -> list[Series]:
    """The sweep's series: per branch setting (the options' own, then each branch alone with
    `per_branch`), an S series per layer count, or a layers series at the options' S."""
    branches = [options.branch.value] + [
        b for b in ("cmp", "sel", "win") if per_branch and b != options.branch.value
    ]
    series = []
    for branch in branches:
        opts = options.replace(branch=Branch(branch))
        if seq_lens:
            for n_layers in layers or (None,):
                base = f"{branch}" + (f"-L{n_layers}" if n_layers else "")
                points = [
                    (s, build_spec(opts.replace(seq_len=s, layers=n_layers), name=f"{base}-S{s}"))
                    for s in seq_lens
                ]
                series.append(Series(base, branch, _backend(points[0][1], branch), "seq_len", points))
        else:
            points = [(n, build_spec(opts.replace(layers=n), name=f"{branch}-L{n}")) for n in layers]
            series.append(Series(branch, branch, _backend(points[0][1], branch), "layers", points))
    return series


def device_memory_total(device: str | None) -> Budget:
    """Total memory of the device the points ran on, and where the number comes from."""
    if device and device.startswith("cuda"):
        import torch

        index = torch.device(device).index or 0
        return int(torch.cuda.get_device_properties(index).total_memory), f"torch.cuda total ({device})"
    import psutil

    return int(psutil.virtual_memory().total), "psutil total memory (CPU)"


class Sweep(Plan):
    """Every series upward, one point at a time; a point that does not pass ends its series (the larger
    ones would only fail the same way, slower). Succeeds when every point that ran passed: the points
    left out above a failure do not count. An interrupted point is left out of the summary."""

    command = "scale"
    stopped = "the running point was stopped"

    def __init__(self, series: list[Series], budget: Budget | None) -> None:
        self.series = series
        self.budget = budget
        self._results: list[CaseResult] = []
        self.report = ScaleReport()

    def specs(self) -> Sequence[CaseSpec]:
        return [spec for s in self.series for _, spec in s.points]

    def begin(self, session: Session) -> None:
        session.note(f"nsa-diag scale: {len(self.specs())} point(s) into {session.run_dir}")

    def execute(self, session: Session) -> None:
        with render.LiveProgress(session.err, self.specs()) as live:
            for s in self.series:
                for x, spec in s.points:
                    result = session.run_shown(live, spec)
                    self._results.append(result)
                    s.results[x] = result
                    if not result.passed:
                        s.stopped_by = f"{result.verdict} at {s.x_name}={x}: {result.reason}"
                        break

    def results(self) -> list[CaseResult]:
        return list(self._results)

    def succeeded(self, summary: RunSummary) -> bool | None:
        return all(r.passed for r in self._results)

    def _total(self, device: str | None) -> Budget:
        return self.budget if self.budget is not None else device_memory_total(device)

    def finish(self, session: Session, summary: RunSummary) -> None:
        """scale.json (the fits), then scale.png; the numbers stand without the picture."""
        analyses = [analyse_series(s, self._total) for s in self.series]
        report = ScaleReport(
            run_dir=str(session.run_dir), series=analyses, culprits=quadratic_culprits(analyses)
        )
        artifacts.write_json(session.run_dir / SCALE_JSON, report)
        try:
            from nsa_diag.plots import plot_scale

            plot_scale(report, session.run_dir / SCALE_PNG)
            report.plot = SCALE_PNG
        except Exception as exc:  # the numbers stand without the picture
            report.plot_error = f"{type(exc).__name__}: {exc}"
        artifacts.write_json(session.run_dir / SCALE_JSON, report)
        self.report = report

    def to_json(self, summary: RunSummary) -> Any:
        return {"summary": summary.to_json(), "scale": self.report.model_dump(mode="json")}

    def render(self, session: Session, summary: RunSummary) -> None:
        render.render_scale(self.report)
        render.render_follow_ups(summary)


# --- nsa-diag gc-bisect -----------------------------------------------------------------------------------


class _GradsFields(TypedDict, total=False):
    """The `CaseSpec` fields of ``--grads``' trials beyond their checkpointing."""

    check: str
    inject: tuple[Injection, ...]
    stall: float


def _trial_spec(base: CaseSpec, name: str, overrides: Mapping[str, OverrideValue], **fields: Any) -> CaseSpec:
    data = base.model_dump()
    data.update(name=name, overrides={**base.overrides, **overrides}, **fields)
    return CaseSpec.model_validate(data)


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def grads_conclusion(layers: int, differ: list[int], same: list[int], failed: list[str]) -> str:
    """gc-bisect --grads' one line: what the comparisons that ran showed, and only that (a layer whose
    comparison ended otherwise is named as not compared; none compared is said as such, no headline)."""
    parts = []
    if differ:
        parts.append(
            "gradients differ from no checkpointing when checkpointing layer(s) "
            + ", ".join(map(str, differ))
        )
    if same and not differ:
        which = "any single layer" if len(same) == layers else "layer(s) " + ", ".join(map(str, same))
        parts.append(f"checkpointing {which} gives the gradients of no checkpointing")
    if failed:
        parts.append(
            ("no layer's gradients were compared" if not (differ or same) else "not compared")
            + ": "
            + "; ".join(failed)
        )
    return "; ".join(parts)


def new_bisection(spec: CaseSpec, *, out: Path, grads: bool, layers: int | None = None) -> BisectState:
    """The state of a new bisection of `spec` (``--grads``: the per-layer gradient comparison); ``layers``:
    the layer count of a ``--model`` (its pre-flight's), else the spec's config's."""
    from nsa_core.config import parse_gc
    from nsa_diag.errors import UsageError

    layers = spec.nsa_config().layers if layers is None else layers
    gc_layers = parse_gc(str(spec.overrides.get("gc", "none")), layers)
    if not grads and not len(gc_layers):
        raise UsageError("gc-bisect needs checkpointing to bisect: add --gc all or --gc A:B")
    start = (gc_layers.start, gc_layers.stop) if len(gc_layers) else (0, layers)
    return BisectState(
        mode="grads" if grads else "range",
        spec=spec,
        out=str(Path(out).resolve()),
        layers=layers,
        start=start,
    )


def resumed_bisection(run_dir: Path) -> BisectState:
    """The state of the bisection in `run_dir` (`UsageError` when it is not a gc-bisect run folder)."""
    from nsa_diag.errors import UsageError

    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise UsageError(f"--resume {run_dir}: no {STATE_FILE} there (not a gc-bisect run folder)")
    try:
        state = BisectState.model_validate(artifacts.read_json(path))  # its spec: the trials' base case
    except (OSError, ValueError) as exc:  # unreadable, not JSON, or not a bisection's state (pydantic's)
        why = exc.strerror if isinstance(exc, OSError) else " ".join(str(exc).split())[:200]
        raise UsageError(f"--resume {run_dir}: its {STATE_FILE} cannot be resumed: {why}") from None
    return state


class Bisection(Plan):
    """The trials of one bisection, each recorded in ``bisect.json`` as it ends; a resumed bisection
    replays the recorded ones (their results read back) and runs only the rest. Succeeds when a range
    is found (``--grads``: when no gradient differs). An interrupt ends the invocation (bisect.json holds
    what ran: resume it)."""

    command = "gc-bisect"
    catches_interrupt = False
    refresh_env = False  # a resumed bisection keeps the environment it began in

    def __init__(self, state: BisectState, *, resume_dir: Path | None = None) -> None:
        self.state = state
        self.resume_dir = resume_dir
        self.base = state.spec
        self.ran: list[CaseSpec] = []
        self._results: list[CaseResult] = []
        self._session: Session | None = None
        self.found = False

    def specs(self) -> Sequence[CaseSpec]:
        return self.ran

    def results(self) -> list[CaseResult]:
        return list(self._results)

    def save(self, session: Session) -> None:
        artifacts.write_json(session.run_dir / STATE_FILE, self.state.model_dump(mode="json"))

    def reopened(self, session: Session) -> None:
        self.state = resumed_bisection(session.run_dir)
        self.base = self.state.spec

    def begin(self, session: Session) -> None:
        self.save(session)
        session.note(f"nsa-diag gc-bisect ({self.state.mode}) into {session.run_dir}", soft_wrap=True)

    def execute(self, session: Session) -> None:
        self._session = session
        self.found = self._grads() if self.state.mode == "grads" else self._bisect()
        self.state.done = True
        self.save(session)

    def _trial(self, gc: str, name: str, overrides: Mapping[str, OverrideValue], **fields: Any) -> Trial:
        """The trial of `gc`: recorded (resume) or run now as an isolated case."""
        session = self._session
        assert session is not None
        spec = _trial_spec(self.base, name, overrides, **fields)
        done = self.state.trial(gc)
        if done is not None:
            session.note(f"  gc {gc}: {done.verdict} (recorded)", soft_wrap=True)
            result = CaseResult.model_validate(artifacts.read_json(session.case_dir(name) / artifacts.RESULT))
        else:
            session.note(f"  gc {gc}: running case {name} ...", soft_wrap=True)
            result = session.run_case(spec)
            done = Trial(gc=gc, case=name, verdict=result.verdict, reason=result.reason, parity=result.parity)
            self.state.trials.append(done)
            self.save(session)
            session.note(f"  gc {gc}: {result.verdict} ({result.reason})", soft_wrap=True)
        self.ran.append(spec)
        self._results.append(result)
        return done

    def _bisect(self) -> bool:
        state = self.state
        start = self._trial(self.base.overrides.get("gc", "none"), "start", {})
        state.target = start.verdict
        if start.verdict == "pass":
            state.conclusion = f"the case passes with gc {self.base.overrides.get('gc')}: nothing to bisect"
            return False
        if start.verdict == "unchecked":  # its check did not run: no failure to bisect, nor a pass
            state.conclusion = f"the case's check did not run ({start.reason}): nothing to bisect"
            return False
        none = self._trial("none", "gc-none", {"gc": "none", "gc_reentrant": False})
        if none.verdict == "unchecked":
            state.conclusion = (
                f"without checkpointing the case's check did not run ({none.reason}): whether checkpointing "
                f"causes {state.target} is not known"
            )
            return False
        if none.verdict != "pass":
            state.conclusion = (
                f"fails without checkpointing too ({none.verdict}: {none.reason}): "
                "not a checkpointing problem"
            )
            return False

        def reproduces(a: int, b: int) -> bool:
            text = range_text(a, b)
            return self._trial(text, f"gc-{a}-{b}", {"gc": text}).verdict == state.target

        lo, hi = smallest_range(*state.start, reproduces)
        state.found = (lo, hi)
        what = f"layer {lo}" if hi - lo == 1 else f"layers {lo}..{hi - 1}"
        state.conclusion = (
            f"checkpointing {what} alone (gc {range_text(lo, hi)}) reproduces {state.target}; "
            f"no checkpointing passes ({len(state.trials)} runs)"
        )
        return True

    def _grads(self) -> bool:
        state = self.state
        fields = _GradsFields(check="gc", inject=())
        if parse_stall(self.base.stall) == "auto":
            fields["stall"] = GRADS_STALL_S
        differ, same, failed = [], [], []
        for layer in range(state.layers):
            gc = f"{layer}:{layer + 1}"
            trial = self._trial(gc, f"grads-L{layer}", {"gc": gc}, **fields)
            if trial.verdict == "mismatch":
                differ.append(layer)
            elif trial.verdict == "pass":
                same.append(layer)
            else:
                failed.append(f"layer {layer}: {trial.verdict} ({_short(trial.reason)})")
        state.layers_differ = differ
        state.conclusion = grads_conclusion(state.layers, differ, same, failed)
        return not (differ or failed)

    def extend(self, summary: RunSummary) -> None:
        summary.bisect = self.state.model_dump(mode="json", exclude={"spec"})

    def succeeded(self, summary: RunSummary) -> bool | None:
        return self.found

    def render(self, session: Session, summary: RunSummary) -> None:
        sys.stdout.write(f"gc-bisect: {self.state.conclusion}\nrun folder: {summary.run_dir}\n")
