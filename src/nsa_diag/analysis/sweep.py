"""`nsa-diag scale`'s analysis: the points of a sweep's series, their growth fits and the estimator's error.

A series holds the points of one branch setting (and one layer count when S is swept), in increasing
order, with the result of each point that ran (the sweep stops a series at its first point that does not
pass: the larger points are listed as not run). Pure: the results come in, scale.json's records go out
(`ScalePoint`, `ScaleFits`, `ScaleSeries`, `ScaleReport`: `nsa_diag.records.Record`s, whose JSON is the
file's); running the points is `nsa_diag.session.plans.Sweep`'s, drawing them
`nsa_diag.render.render_scale`'s and `nsa_diag.plots.plot_scale`'s, reading them back
`nsa_diag.runfolder.length_series`'s.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import Field

from nsa_diag.analysis.memory_model import MemoryEstimate, estimate_peak_memory
from nsa_diag.analysis.scaling import GrowthFit, fit_growth, predict_limit
from nsa_diag.records import PhaseSeconds, Record
from nsa_diag.spec import CaseResult, CaseSpec

ABOVE_FIXED_MIN_SHARE = 0.1  # compare the growing part alone only where it is 10% of the peak or more
Budget = tuple[int, str]  # memory in bytes, and where the number comes from


class ScalePoint(Record):
    """One point of a series: the case at ``x``, its verdict, peak memory and phase times (median of the
    timed steps), and the estimator next to them with its error (`point_record`, `fit_points`)."""

    x: int
    case: str | None = None
    seq_len: int | None = None
    batch: int | None = None
    layers: int | None = None
    estimate: MemoryEstimate | None = None
    verdict: str | None = None  # not-run: the series stopped below it
    reason: str | None = None
    device: str | None = None
    peak_memory_bytes: int | None = None
    peak_memory_kind: str | None = None
    forward_s: float | None = None
    backward_s: float | None = None
    step_s: float | None = None  # forward + backward
    timed_steps: int | None = None
    issue_s: float | None = None  # CUDA: the host's time to issue forward and backward
    host_bound: bool | None = None
    tokens_per_s: float | None = None
    estimate_compared: str | None = None
    estimate_rel_err: float | None = None
    estimate_above_fixed_bytes: int | None = None
    measured_above_fixed_bytes: int | None = None
    estimate_above_fixed_rel_err: float | None = None
    estimate_exceeds_budget: bool | None = None  # an oom point: whether the estimate foresaw it


class MemoryLimit(Record):
    """Where the memory fit reaches the budget: S, the budget and where its number comes from."""

    budget_bytes: int
    budget_source: str
    seq_len: int | None = None  # None: not predictable from the fit


class ScaleFits(Record):
    """The fits of a series' points (`fit_points`): memory and time, the points each used, quadratic
    flags, the estimator's largest errors (or why it was not compared) and the predicted limit."""

    memory_fit: GrowthFit | None = None
    memory_fit_points: list[int] = Field(default_factory=list)
    time_fit: GrowthFit | None = None
    time_fit_points: list[int] = Field(default_factory=list)
    host_bound_points: list[int] = Field(default_factory=list)
    memory_quadratic: bool = False
    time_quadratic: bool = False
    estimate_max_abs_rel_err: float | None = None
    estimate_not_compared: str | None = None
    estimate_above_fixed_max_abs_rel_err: float | None = None
    memory_limit: MemoryLimit | None = None


class ScaleSeries(ScaleFits):
    """One series of scale.json: its branch setting, what grows (``x``), its points and their fits."""

    name: str
    branch: str
    backend: str | None = None
    x: str  # seq_len | layers
    points: list[ScalePoint] = Field(default_factory=list)
    stopped_by: str | None = None


class ScaleReport(Record):
    """scale.json: every series, the quadratic culprits, and the plot (or why there is none)."""

    run_dir: str | None = None
    series: list[ScaleSeries] = Field(default_factory=list)
    culprits: list[str] = Field(default_factory=list)
    plot: str | None = None
    plot_error: str | None = None


@dataclass
class Series:
    """Points of one sweep line: `x_name` ("seq_len" or "layers") grows along `points` (x, spec)."""

    name: str
    branch: str
    backend: str | None
    x_name: str
    points: list[tuple[int, CaseSpec]]
    results: dict[int, CaseResult] = field(default_factory=dict)
    stopped_by: str | None = None


def _peak_bytes(result: CaseResult) -> tuple[int | None, str | None]:
    peak = result.metrics.peak_memory
    return peak.headline() if peak is not None else (None, None)


# On CUDA, a point whose forward and backward the host took at least this fraction of their time to issue
# is host-bound: the GPU waited for Python and kernel launches, and the time is the host's, not the
# model's (m7c-125m in bf16 on an H200: forward 0.053 s at S = 4096 and 0.103 s at 32768, tokens/s rising
# fourfold with S; the plain fit read that as time ~ S^0.3).
HOST_BOUND_FRACTION = 0.9


def _timed(values: list[float]) -> list[float]:
    """The timed steps' values: all but step 1 (one-off warm-up: Triton compiles, cuDNN and the allocator
    settle) when there are several."""
    return values[1:] if len(values) > 1 else values


def _phase(phases: PhaseSeconds | None, phase: str) -> float | None:
    """The median of the phase's time over the timed steps."""
    timed = _timed(phases.of(phase)) if phases is not None else []
    return statistics.median(timed) if timed else None


def point_record(x: int, spec: CaseSpec, result: CaseResult | None) -> ScalePoint:
    """One measured point with the estimator next to it."""
    cfg = spec.nsa_config() if spec.model is None else None
    device = (result.device if result is not None else None) or spec.device
    estimate = (
        estimate_peak_memory(
            cfg, seq_len=spec.seq_len, batch=spec.batch, dtype=spec.dtype, device=device, steps=spec.steps
        )
        if cfg is not None
        else None
    )
    record = ScalePoint(
        x=x,
        case=spec.name,
        seq_len=spec.seq_len,
        batch=spec.batch,
        layers=cfg.layers if cfg is not None else None,
        estimate=estimate,
    )
    if result is None:
        record.verdict = "not-run"
        return record
    peak, kind = _peak_bytes(result)
    metrics = result.metrics
    fwd, bwd = _phase(metrics.phase_s, "forward"), _phase(metrics.phase_s, "backward")
    step = fwd + bwd if fwd is not None and bwd is not None else None
    issued = [_phase(metrics.phase_issue_s, phase) for phase in ("forward", "backward")]
    issue = sum(v for v in issued if v is not None) if None not in issued else None
    host_bound = issue >= HOST_BOUND_FRACTION * step if issue is not None and step else None
    return record.model_copy(
        update={
            "verdict": result.verdict,
            "reason": result.reason,
            "device": result.device,
            "peak_memory_bytes": peak,
            "peak_memory_kind": kind,
            "forward_s": fwd,
            "backward_s": bwd,
            "step_s": step,
            "timed_steps": len(_timed(metrics.phase_s.forward if metrics.phase_s is not None else [])),
            "issue_s": issue,
            "host_bound": host_bound,
            "tokens_per_s": metrics.tokens_per_s,
        }
    )


def _add_estimator_errors(points: list[ScalePoint], fit: GrowthFit | None, on_cuda: bool) -> None:
    """Relative errors of the estimate. On CUDA: the total against max allocated. On the CPU, peak RSS
    holds the runtime (torch, Python) the estimator does not model, so the fit's fixed part stands for
    the runtime plus model state: ``estimate_rel_err`` compares the total with that added, and
    ``estimate_above_fixed_rel_err`` compares what grows with S alone, where that is at least
    `ABOVE_FIXED_MIN_SHARE` of the peak (below, it is within RSS noise)."""
    for p in points:
        est, peak = p.estimate, p.peak_memory_bytes
        if not est or not peak:
            continue
        if p.verdict != "pass":  # an oom's peak is what was allocated when it failed, not the need
            continue
        if on_cuda:
            p.estimate_compared = "total vs CUDA max allocated"
            p.estimate_rel_err = (est.total - peak) / peak
            continue
        if fit is None:
            continue
        growing = est.activations + est.logits + est.transient
        p.estimate_compared = "fitted fixed part + estimated growing part vs peak RSS"
        p.estimate_rel_err = (fit.fixed + growing - peak) / peak
        measured = peak - fit.fixed
        p.estimate_above_fixed_bytes = growing
        p.measured_above_fixed_bytes = round(measured)
        if measured > ABOVE_FIXED_MIN_SHARE * peak:  # below it, the growing part is lost in RSS noise
            p.estimate_above_fixed_rel_err = (growing - measured) / measured


def growth_points(passed: list[ScalePoint]) -> list[ScalePoint]:
    """The points whose peak comes from the activations: where the estimate puts a point's peak in the
    optimizer step (parameters, gradients, moments: the same at every S), its peak says nothing of the
    growth, and a flat run of such points ahead of the growing ones makes a power law look steep (the
    Triton backends at S <= 2048 read as "quadratic" that way). On CUDA only: the CPU's peak RSS is a
    high-water mark that keeps the activations' pages whichever phase the estimate names, and its fit has
    the runtime in the fixed part. All points when the estimate is absent."""

    def optimizer_bound(p: ScalePoint) -> bool:
        on_cuda = (p.device or "").startswith("cuda")
        return on_cuda and p.estimate is not None and p.estimate.phase == "optimizer"

    return [p for p in passed if not optimizer_bound(p)]


def _measured(points: list[ScalePoint]) -> list[ScalePoint]:
    """The points that passed with a peak memory: what the memory fit may use."""
    return [p for p in points if p.verdict == "pass" and p.peak_memory_bytes]


def fit_points(
    points: list[ScalePoint], x_name: str, total: Callable[[str | None], Budget | None]
) -> ScaleFits:
    """The fits, estimator errors, quadratic flags and predicted limit of a series' points (as
    `point_record` makes them), in scale.json's keys; the estimator's errors are added to the points.
    The memory fit is over `growth_points`, named in ``memory_fit_points``. `total(device)`: the memory
    budget (bytes, where it comes from) of the device the points ran on, asked only where it is used;
    None where it is not known leaves the limit and the oom points' foresight out."""
    passed = _measured(points)
    growing = growth_points(passed)
    memory_fit = fit_growth(
        [p.x for p in growing], [p.peak_memory_bytes or 0 for p in growing], with_fixed=True
    )
    timed = [p for p in passed if p.step_s and not p.host_bound]
    time_fit = fit_growth([p.x for p in timed], [p.step_s or 0.0 for p in timed], with_fixed=False)
    on_cuda = any((p.device or "").startswith("cuda") for p in passed)
    _add_estimator_errors(points, memory_fit, on_cuda)
    errors = [abs(p.estimate_rel_err) for p in points if p.estimate_rel_err is not None]
    above = [abs(e) for p in points if (e := p.estimate_above_fixed_rel_err) is not None]
    ooms = [p for p in points if p.verdict == "oom" and p.estimate]
    wants_limit = memory_fit is not None and x_name == "seq_len"
    budget = None
    if ooms or wants_limit:  # asked only where used: `scale` on CUDA queries the device through torch
        budget = total(next((p.device for p in points if p.device), None))
    if budget is not None:
        for p in ooms:  # did the estimate see it coming?
            assert p.estimate is not None
            p.estimate_exceeds_budget = p.estimate.total > budget[0]
    limit: MemoryLimit | None = None
    if wants_limit and budget is not None:
        assert memory_fit is not None
        at = predict_limit(memory_fit, budget[0])
        limit = MemoryLimit(budget_bytes=budget[0], budget_source=budget[1], seq_len=int(at) if at else None)
    return ScaleFits(
        memory_fit=memory_fit,
        memory_fit_points=[p.x for p in growing],
        time_fit=time_fit,
        time_fit_points=[p.x for p in timed],
        host_bound_points=[p.x for p in passed if p.host_bound],
        memory_quadratic=bool(memory_fit and memory_fit.quadratic),
        time_quadratic=bool(time_fit and time_fit.quadratic),
        estimate_max_abs_rel_err=max(errors) if errors else None,
        estimate_not_compared=None if errors else _not_compared(points, passed, on_cuda),
        estimate_above_fixed_max_abs_rel_err=max(above) if above else None,
        memory_limit=limit,
    )


def _not_compared(points: list[ScalePoint], passed: list[ScalePoint], on_cuda: bool) -> str:
    """Why the estimator's error was measured at no point of a series (said, never left blank)."""
    if not any(p.estimate for p in points):
        return "no estimate: the estimator models nsa_core's model, not a --model"
    if not passed:
        return "no point passed with a measured peak memory"
    if not on_cuda:
        return (
            "on the CPU the estimate is compared above the memory fit's fixed part (peak RSS holds the "
            "runtime), and there is no memory fit: it needs 3 passing points"
        )
    return "no point with both an estimate and a measured peak"


def analyse_series(series: Series, total: Callable[[str | None], Budget | None]) -> ScaleSeries:
    """The series' points, fits, quadratic flag and predicted limit, as written to scale.json;
    `total(device)` is the memory budget (`--memory-budget`, or the device's total), asked only where used."""
    points = [point_record(x, spec, series.results.get(x)) for x, spec in series.points]
    analysed = ScaleSeries(
        name=series.name,
        branch=series.branch,
        backend=series.backend,
        x=series.x_name,
        points=points,
        stopped_by=series.stopped_by,
    )
    analysed.add(fit_points(points, series.x_name, total))
    return analysed


def quadratic_culprits(analyses: list[ScaleSeries]) -> list[str]:
    """`--per-branch`: the branch and backend of each series whose memory or time grows quadratically."""
    lines = []
    for a in analyses:
        if a.x != "seq_len" or a.branch == "all":
            continue
        for what, quadratic, fit in (
            ("memory", a.memory_quadratic, a.memory_fit),
            ("time", a.time_quadratic, a.time_fit),
        ):
            if quadratic and fit is not None:
                lines.append(
                    f"{what} grows quadratically in branch {a.branch} (backend {a.backend}): "
                    f"exponent {fit.exponent:.2f}"
                )
    return lines


def host_bound_note(series: ScaleFits) -> str | None:
    """Which points the time fit left out as host-bound; None when none was."""
    bound = series.host_bound_points
    if not bound:
        return None
    return (
        f"time fit over {series.time_fit_points}: {len(bound)} point(s) left out, host-bound "
        f"{bound} (the host took >= {HOST_BOUND_FRACTION:.0%} of forward + backward to issue the work: the "
        "GPU waited for Python and kernel launches, so their time is not the model's)"
    )


def fit_points_note(series: ScaleSeries) -> str | None:
    """Which points the memory fit used, where `growth_points` left some passed ones out; else None."""
    measured = _measured(series.points)
    used = series.memory_fit_points if "memory_fit_points" in series else None
    if used is None or len(measured) <= len(used):
        return None
    return (
        f"memory fit over {used}: {len(measured) - len(used)} point(s) left out, whose estimated peak is"
        " the optimizer step (the same at every S)"
    )
