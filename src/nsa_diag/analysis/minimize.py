"""`--minimize`: the smallest configuration that still reproduces a failing case's verdict.

Greedy, one dimension at a time, in this order: layers, sequence length, batch, steps, then the active
branches (all three -> one, through ``force_branch``). For each dimension the smallest allowed value is
tried first; if it does not reproduce, the value is bisected between it and the current one (the sequence
length to within an eighth of its starting value, the others exactly), keeping the smallest value that
reproduces. "Reproduces" means the same verdict, and for a hang the same hang kind. Every trial is a
real case run by the caller's `run_trial` (an isolated worker under the watchdog); the caller decides
where its folder goes.

Injections stay valid: the layers never drop below the deepest injected layer + 1 (nor below the end of a
checkpointed range ``gc A:B``), the steps never below the last injected step. A candidate the spec or
`nsa_diag.cases.check_spec` rejects counts as "does not reproduce" and runs nothing. A user model
(``--model``) keeps its layers and branches: only S, batch and steps shrink. Trials keep the case's
``--stall``: a hang costs its stall limit per trial, so give ``--stall SECONDS`` rather than auto (120 s
until step 1 ends).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nsa_diag.spec import CaseResult, CaseSpec
from nsa_diag.summary import CaseShape, MinimizeRecord, MinimizeTrial

MAX_TRIALS = 30  # a bound on the runs one minimization may take (each is a worker, a hang costs its stall)
SEQ_LEN_FLOOR = 2  # the next-token loss needs two tokens
BRANCHES = ("cmp", "sel", "win")


@dataclass(frozen=True)
class Target:
    """What a trial must show to reproduce the failure."""

    verdict: str
    hang_kind: str | None = None

    @classmethod
    def of(cls, result: CaseResult) -> Target:
        return cls(result.verdict, result.hang_kind if result.verdict == "hang" else None)

    def met_by(self, result: CaseResult) -> bool:
        return result.verdict == self.verdict and (
            self.hang_kind is None or result.hang_kind == self.hang_kind
        )

    def describe(self) -> str:
        return self.verdict + (f" / {self.hang_kind}" if self.hang_kind else "")


def shape(spec: CaseSpec) -> CaseShape:
    """The dimensions minimization shrinks, as they are in `spec`."""
    layers = None
    if spec.model is None:
        layers = spec.nsa_config().layers
    return CaseShape(
        layers=layers,
        seq_len=spec.seq_len,
        batch=spec.batch,
        steps=spec.steps,
        branch=str(spec.overrides.get("force_branch") or "all"),
    )


def layer_floor(spec: CaseSpec) -> int:
    """The fewest layers that keep every injection and the checkpointed range valid."""
    floor = max([1, *(inj.layer + 1 for inj in spec.inject)])
    gc = str(spec.overrides.get("gc") or "none")
    if ":" in gc:
        _, _, end = gc.partition(":")
        if end.strip().isdigit():
            floor = max(floor, int(end))
    return floor


def step_floor(spec: CaseSpec) -> int:
    """The fewest steps in which every injection still fires."""
    return max([1, *(inj.step for inj in spec.inject)])


def candidate(spec: CaseSpec, name: str, **changes: Any) -> CaseSpec | str:
    """`spec` renamed `name` with `changes` (layers and branch go into the model overrides); or, when the
    result would be invalid, the one-line reason."""
    from pydantic import ValidationError

    from nsa_diag.cases import check_spec
    from nsa_diag.errors import UsageError

    data = spec.model_dump()
    overrides = dict(spec.overrides)
    if "layers" in changes:
        overrides["layers"] = changes.pop("layers")
    if "branch" in changes:
        overrides["force_branch"] = changes.pop("branch")
    data.update(name=name, overrides=overrides, **changes)
    try:
        new = CaseSpec.model_validate(data)
        check_spec(new)
    except (ValidationError, UsageError, ValueError) as exc:
        return " ".join(str(exc).split())
    return new


@dataclass
class Minimizer:
    """Shrinks `spec` while `run_trial` still shows `target`; `say` reports each trial."""

    spec: CaseSpec
    target: Target
    run_trial: Callable[[CaseSpec], CaseResult]
    say: Callable[[str], None] = lambda text: None
    max_trials: int = MAX_TRIALS
    trials: list[MinimizeTrial] = field(default_factory=list)
    stopped: str | None = None

    def __post_init__(self) -> None:
        self.current = self.spec

    def _label(self, changes: Mapping[str, int | str]) -> str:
        return f"{len(self.trials) + 1:02d}-" + "-".join(f"{k}{v}" for k, v in changes.items())

    def reproduces(self, **changes: int | str) -> bool:
        """Run the current spec with `changes`; keep it as the current one when it reproduces."""
        if len(self.trials) >= self.max_trials:
            self.stopped = f"stopped after {self.max_trials} trials (the limit)"
            return False
        label = self._label(changes)
        change = ", ".join(f"{k}={v}" for k, v in changes.items())
        spec = candidate(self.current, label, **changes)
        if isinstance(spec, str):
            self.trials.append(
                MinimizeTrial(
                    name=label, change=change, ran=False, reproduces=False, verdict=None, hang_kind=None,
                    reason=f"not valid: {spec}",
                )
            )  # fmt: skip
            self.say(f"  {change}: not valid ({spec})")
            return False
        try:
            result = self.run_trial(spec)
        except KeyboardInterrupt:
            self.trials.append(
                MinimizeTrial(
                    name=label, change=change, ran=True, reproduces=False, verdict=None, hang_kind=None,
                    reason="interrupted while it ran",
                )
            )  # fmt: skip
            raise
        hit = self.target.met_by(result)
        self.trials.append(
            MinimizeTrial(
                name=label, change=change, ran=True, reproduces=hit, verdict=result.verdict,
                hang_kind=result.hang_kind, reason=result.reason, elapsed_s=result.elapsed_s,
            )
        )  # fmt: skip
        kind = f" / {result.hang_kind}" if result.hang_kind else ""
        self.say(f"  {change}: {result.verdict}{kind}" + (" (reproduces)" if hit else ""))
        if hit:
            self.current = spec
        return hit

    def shrink(self, name: str, floor: int, *, coarse: bool = False) -> None:
        """The smallest value of the integer dimension `name` in [floor, current] that reproduces, assuming
        that a value that reproduces keeps reproducing above it (bisection)."""
        value = getattr(shape(self.current), name)
        if value is None or value <= floor or self.reproduces(**{name: floor}):
            return
        low, high = floor, value  # low does not reproduce, high does
        tolerance = max(1, value // 8) if coarse else 1
        while high - low > tolerance and not self.stopped:
            middle = (low + high) // 2
            if self.reproduces(**{name: middle}):
                high = middle
            else:
                low = middle

    def shrink_branch(self) -> None:
        if self.current.model is not None or self.current.overrides.get("force_branch"):
            return
        for branch in BRANCHES:
            if self.stopped or self.reproduces(branch=branch):
                return

    def run(self) -> CaseSpec:
        """Shrink every dimension in turn; the smallest spec that reproduced (the start if none did)."""
        if self.current.model is None:
            self.shrink("layers", layer_floor(self.current))
        self.shrink("seq_len", SEQ_LEN_FLOOR, coarse=True)
        self.shrink("batch", 1)
        self.shrink("steps", step_floor(self.current))
        self.shrink_branch()
        return self.current


def reproduce_argv(spec: CaseSpec, out: Path | None = None) -> list[str]:
    """The `nsa-diag` command line that runs `spec` alone: ``nsa-diag run ...``, or for a correctness
    property ``nsa-diag verify --only PROPERTY ...``; with ``--out`` only when `out` is given."""
    from nsa_diag.cases import replay_argv

    argv = replay_argv(spec, Path(out or "."))[3:]  # drop "python -m nsa_diag"
    argv = argv[:-2]  # replay_argv ends with --out DIR
    if spec.check is not None:
        keep, skip = [], {"--name", "--steps"}
        items = iter(argv[1:])
        for item in items:
            if item in skip:
                next(items, None)
            else:
                keep.append(item)
        argv = ["verify", "--only", spec.check, *keep]
    if out is not None:
        argv += ["--out", str(out)]
    return ["nsa-diag", *argv]


def minimize_case(
    spec: CaseSpec,
    result: CaseResult,
    run_trial: Callable[[CaseSpec], CaseResult],
    *,
    name: str,
    say: Callable[[str], None] = lambda text: None,
    max_trials: int = MAX_TRIALS,
) -> MinimizeRecord:
    """Minimize the failing case (`spec`, `result`); the record summary.json keeps under ``minimize``.

    The smallest spec is renamed `name`; ``command`` is the shell line that reproduces it. An interrupt
    (Ctrl-C) ends the minimization with what it found so far: ``interrupted`` is then true.
    """
    target = Target.of(result)
    minimizer = Minimizer(spec, target, run_trial, say, max_trials)
    interrupted = False
    try:
        minimizer.run()
    except KeyboardInterrupt:
        interrupted = True
        minimizer.stopped = "interrupted"
    smallest = CaseSpec.model_validate({**minimizer.current.model_dump(), "name": name})
    argv = reproduce_argv(smallest)
    start, end = shape(spec), shape(smallest)
    return MinimizeRecord(
        case=spec.name,
        target=target.describe(),
        target_verdict=target.verdict,
        target_hang_kind=target.hang_kind,
        start=start,
        smallest=end,
        reduced=start != end,
        runs=sum(1 for t in minimizer.trials if t.ran),
        trials=minimizer.trials,
        stopped=minimizer.stopped,
        interrupted=interrupted,
        argv=argv,
        command=shlex.join(argv),
        spec=smallest,
    )
