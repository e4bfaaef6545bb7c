"""`nsa-diag scale`'s sweep: series of cases over S (or layers), run one at a time, fitted and reported.

A series holds the points of one branch setting (and one layer count when S is swept), in increasing
order; a point whose verdict is not pass (hang, oom, crash, ...) ends its series: the larger points are
listed as not run, because they would only fail the same way, slower. Each point is an isolated worker
through `nsa_diag.executor.run_cases`, so the run folder looks like any other (cases/<name>/, summary.*),
plus ``scale.json`` and ``scale.png``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nsa_diag import artifacts, render
from nsa_diag._cli_utils import Branch, CaseOptions
from nsa_diag.analysis.memory_model import estimate_peak_memory
from nsa_diag.analysis.scaling import GrowthFit, describe_fit, fit_growth, predict_limit
from nsa_diag.cases import build_spec, replay_argv
from nsa_diag.spec import CaseResult, CaseSpec

SCALE_JSON = "scale.json"
SCALE_PNG = "scale.png"
ABOVE_FIXED_MIN_SHARE = 0.1  # compare the growing part alone only where it is 10% of the peak or more


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


def _peak_bytes(result: CaseResult) -> tuple[int | None, str | None]:
    peak = result.metrics.get("peak_memory") or {}
    for key in ("cuda_max_allocated_bytes", "cpu_peak_rss_bytes"):
        if isinstance(peak.get(key), int):
            return peak[key], key
    return None, None


def _phase(result: CaseResult, phase: str) -> float | None:
    """The phase's time in the last step (step 1 carries one-off warm-up when there are several)."""
    values = (result.metrics.get("phase_s") or {}).get(phase)
    if isinstance(values, list) and values:
        return float(values[-1])
    return None


def device_memory_total(device: str | None) -> tuple[int, str]:
    """Total memory of the device the points ran on, and where the number comes from."""
    if device and device.startswith("cuda"):
        import torch

        index = torch.device(device).index or 0
        return int(torch.cuda.get_device_properties(index).total_memory), f"torch.cuda total ({device})"
    import psutil

    return int(psutil.virtual_memory().total), "psutil total memory (CPU)"


def point_record(x: int, spec: CaseSpec, result: CaseResult | None) -> dict[str, Any]:
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
    record: dict[str, Any] = {"x": x, "case": spec.name, "seq_len": spec.seq_len, "batch": spec.batch}
    record["layers"] = cfg.layers if cfg is not None else None
    record["estimate"] = estimate.to_json() if estimate else None
    if result is None:
        record["verdict"] = "not-run"
        return record
    peak, kind = _peak_bytes(result)
    fwd, bwd = _phase(result, "forward"), _phase(result, "backward")
    record.update(
        verdict=result.verdict,
        reason=result.reason,
        device=result.device,
        peak_memory_bytes=peak,
        peak_memory_kind=kind,
        forward_s=fwd,
        backward_s=bwd,
        step_s=(fwd + bwd) if fwd is not None and bwd is not None else None,
        tokens_per_s=result.metrics.get("tokens_per_s"),
    )
    return record


def _add_estimator_errors(points: list[dict[str, Any]], fit: GrowthFit | None, on_cuda: bool) -> None:
    """Relative errors of the estimate. On CUDA: the total against max allocated. On the CPU, peak RSS
    holds the runtime (torch, Python) the estimator does not model, so the fit's fixed part stands for
    the runtime plus model state: ``estimate_rel_err`` compares the total with that added, and
    ``estimate_above_fixed_rel_err`` compares what grows with S alone, where that is at least
    `ABOVE_FIXED_MIN_SHARE` of the peak (below, it is within RSS noise)."""
    for p in points:
        est, peak = p.get("estimate"), p.get("peak_memory_bytes")
        if not est or not peak:
            continue
        if p.get("verdict") != "pass":  # an oom's peak is what was allocated when it failed, not the need
            continue
        if on_cuda:
            p["estimate_compared"] = "total vs CUDA max allocated"
            p["estimate_rel_err"] = (est["total"] - peak) / peak
            continue
        if fit is None:
            continue
        growing = est["activations"] + est["logits"] + est["transient"]
        p["estimate_compared"] = "fitted fixed part + estimated growing part vs peak RSS"
        p["estimate_rel_err"] = (fit.fixed + growing - peak) / peak
        measured = peak - fit.fixed
        p["estimate_above_fixed_bytes"] = growing
        p["measured_above_fixed_bytes"] = measured
        if measured > ABOVE_FIXED_MIN_SHARE * peak:  # below it, the growing part is lost in RSS noise
            p["estimate_above_fixed_rel_err"] = (growing - measured) / measured


def growth_points(passed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points whose peak comes from the activations: where the estimate puts a point's peak in the
    optimizer step (parameters, gradients, moments: the same at every S), its peak says nothing of the
    growth, and a flat run of such points ahead of the growing ones makes a power law look steep (the
    Triton backends at S <= 2048 read as "quadratic" that way). On CUDA only: the CPU's peak RSS is a
    high-water mark that keeps the activations' pages whichever phase the estimate names, and its fit has
    the runtime in the fixed part. All points when the estimate is absent."""

    def optimizer_bound(p: dict[str, Any]) -> bool:
        on_cuda = (p.get("device") or "").startswith("cuda")
        return on_cuda and (p.get("estimate") or {}).get("phase") == "optimizer"

    return [p for p in passed if not optimizer_bound(p)]


def _measured(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points that passed with a peak memory: what the memory fit may use."""
    return [p for p in points if p.get("verdict") == "pass" and p.get("peak_memory_bytes")]


def fit_points(
    points: list[dict[str, Any]], x_name: str, total: Callable[[str | None], tuple[int, str] | None]
) -> dict[str, Any]:
    """The fits, estimator errors, quadratic flags and predicted limit of a series' points (as
    `point_record` makes them), in scale.json's keys; the estimator's errors are added to the points.
    The memory fit is over `growth_points`, named in ``memory_fit_points``. `total(device)`: the memory
    budget (bytes, where it comes from) of the device the points ran on, asked only where it is used;
    None where it is not known leaves the limit and the oom points' foresight out."""
    passed = _measured(points)
    growing = growth_points(passed)
    memory_fit = fit_growth(
        [p["x"] for p in growing], [p["peak_memory_bytes"] for p in growing], with_fixed=True
    )
    time_fit = fit_growth(
        [p["x"] for p in passed if p.get("step_s")],
        [p["step_s"] for p in passed if p.get("step_s")],
        with_fixed=False,
    )
    on_cuda = any((p.get("device") or "").startswith("cuda") for p in passed)
    _add_estimator_errors(points, memory_fit, on_cuda)
    errors = [abs(p["estimate_rel_err"]) for p in points if "estimate_rel_err" in p]
    above = [abs(p["estimate_above_fixed_rel_err"]) for p in points if "estimate_above_fixed_rel_err" in p]
    ooms = [p for p in points if p["verdict"] == "oom" and p.get("estimate")]
    wants_limit = memory_fit is not None and x_name == "seq_len"
    budget = None
    if ooms or wants_limit:  # asked only where used: `scale` on CUDA queries the device through torch
        budget = total(next((p.get("device") for p in points if p.get("device")), None))
    if budget is not None:
        for p in ooms:  # did the estimate see it coming?
            p["estimate_exceeds_budget"] = p["estimate"]["total"] > budget[0]
    limit: dict[str, Any] | None = None
    if wants_limit and budget is not None:
        assert memory_fit is not None
        at = predict_limit(memory_fit, budget[0])
        limit = {"budget_bytes": budget[0], "budget_source": budget[1], "seq_len": int(at) if at else None}
    return {
        "memory_fit": memory_fit.to_json() if memory_fit else None,
        "memory_fit_points": [p["x"] for p in growing],
        "time_fit": time_fit.to_json() if time_fit else None,
        "memory_quadratic": bool(memory_fit and memory_fit.quadratic),
        "time_quadratic": bool(time_fit and time_fit.quadratic),
        "estimate_max_abs_rel_err": max(errors) if errors else None,
        "estimate_above_fixed_max_abs_rel_err": max(above) if above else None,
        "memory_limit": limit,
    }


def analyse_series(series: Series, budget: tuple[int, str] | None) -> dict[str, Any]:
    """The series' points, fits, quadratic flag and predicted limit, as written to scale.json; the
    budget is `--memory`'s, or the device's total (`device_memory_total`)."""
    points = [point_record(x, spec, series.results.get(x)) for x, spec in series.points]

    def total(device: str | None) -> tuple[int, str]:
        return budget if budget is not None else device_memory_total(device)

    return {
        "name": series.name,
        "branch": series.branch,
        "backend": series.backend,
        "x": series.x_name,
        "points": points,
        "stopped_by": series.stopped_by,
        **fit_points(points, series.x_name, total),
    }


def quadratic_culprits(analyses: list[dict[str, Any]]) -> list[str]:
    """`--per-branch`: the branch and backend of each series whose memory or time grows quadratically."""
    lines = []
    for a in analyses:
        if a["x"] != "seq_len" or a["branch"] == "all":
            continue
        for what in ("memory", "time"):
            if a[f"{what}_quadratic"]:
                fit = a[f"{what}_fit"]
                lines.append(
                    f"{what} grows quadratically in branch {a['branch']} (backend {a['backend']}): "
                    f"exponent {fit['exponent']:.2f}"
                )
    return lines


def run_sweep(
    series: list[Series],
    *,
    out: Path,
    tag: str | None,
    budget: tuple[int, str] | None,
    json_output: bool,
    follow: Any = None,
) -> int:
    """Run every series upward, stopping a series at its first point that does not pass; report.

    `follow`: the `nsa_diag.session.FollowUps` (--minimize, --triage, --junit) applied to the points run.
    """
    from nsa_diag.executor import run_cases

    specs = [spec for s in series for _, spec in s.points]
    run_dir = artifacts.new_run_dir("scale", out, tag)
    err = render.stderr_console()
    err.print(f"nsa-diag scale: {len(specs)} point(s) into {run_dir}", markup=False, highlight=False)
    started = time.time()
    live = render.LiveProgress(err, specs)
    results: list[CaseResult] = []
    interrupted = False
    try:
        with live:
            for s in series:
                for x, spec in s.points:
                    (result,) = run_cases(
                        [spec],
                        run_dir,
                        replay_argv=lambda sp: replay_argv(sp, out),
                        on_case_start=live.case_start,
                        on_progress=live.progress,
                        on_case_end=live.case_end,
                    )
                    results.append(result)
                    s.results[x] = result
                    if not result.passed:
                        s.stopped_by = f"{result.verdict} at {s.x_name}={x}: {result.reason}"
                        break
    except KeyboardInterrupt:
        interrupted = True
        err.print("nsa-diag: interrupted; the running point was stopped", markup=False, highlight=False)

    summary = render.build_summary(
        "scale", run_dir, specs, results, started_at=started, interrupted=interrupted
    )
    if not interrupted:
        # points above a failure were left out on purpose; only failures decide the exit code
        summary["exit_code"] = 0 if all(r.passed for r in results) else 1
    if follow is not None:
        from nsa_diag.session import follow_up

        summary = follow_up(summary, run_dir, specs, results, follow=follow, out=out, err=err)
    render.write_summary(run_dir, summary)
    analyses = [analyse_series(s, budget) for s in series]
    report = {"run_dir": str(run_dir), "series": analyses, "culprits": quadratic_culprits(analyses)}
    artifacts.write_json(run_dir / SCALE_JSON, report)
    try:
        from nsa_diag.plots import plot_scale

        plot_scale(report, run_dir / SCALE_PNG)
        report["plot"] = SCALE_PNG
    except Exception as exc:  # the numbers stand without the picture
        report["plot_error"] = f"{type(exc).__name__}: {exc}"
    artifacts.write_json(run_dir / SCALE_JSON, report)
    if json_output:
        render.print_json({"summary": summary, "scale": report})
    else:
        render_scale(report)
        render.render_follow_ups(summary)
    return int(summary["exit_code"])


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def _above_errors(points: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{p['x']}: {p['estimate_above_fixed_rel_err']:+.0%}"
        for p in points
        if "estimate_above_fixed_rel_err" in p
    )


def _estimate_cell(point: dict[str, Any]) -> str:
    if "estimate_exceeds_budget" in point:  # an oom point: the estimate foresaw it, or not
        return "foresaw oom" if point["estimate_exceeds_budget"] else "missed oom"
    return _pct(point.get("estimate_rel_err"))


def fit_points_note(series: dict[str, Any]) -> str | None:
    """Which points the memory fit used, where `growth_points` left some passed ones out; else None."""
    measured = _measured(series["points"])
    used = series.get("memory_fit_points")
    if used is None or len(measured) <= len(used):
        return None
    return (
        f"memory fit over {used}: {len(measured) - len(used)} point(s) left out, whose estimated peak is"
        " the optimizer step (the same at every S)"
    )


def render_scale(report: dict[str, Any]) -> None:
    """The sweep as a table on stdout, then one line per fit, the culprits and the predicted limits."""
    from rich.table import Table

    console = render.stdout_console()
    for a in report["series"]:
        table = Table(title=f"{a['name']} (branch {a['branch']}, backend {a['backend'] or '-'})")
        for column in (a["x"], "verdict", "peak memory", "estimate", "est. error", "fwd", "bwd", "tokens/s"):
            table.add_column(column)
        for p in a["points"]:
            est = p.get("estimate") or {}
            tokens = p.get("tokens_per_s")
            table.add_row(
                str(p["x"]),
                p["verdict"],
                render.format_bytes(p.get("peak_memory_bytes")),
                render.format_bytes(est.get("total")),
                _estimate_cell(p),
                "-" if p.get("forward_s") is None else f"{p['forward_s']:.3f} s",
                "-" if p.get("backward_s") is None else f"{p['backward_s']:.3f} s",
                "-" if tokens is None else f"{tokens:,.0f}",
            )
        console.print(table)
        note = fit_points_note(a)
        if note:
            console.print(f"  {note}", markup=False, highlight=False)
        for what in ("memory", "time"):
            fit = a[f"{what}_fit"]
            gfit = None
            if fit:
                ci = tuple(fit["ci95"]) if fit["ci95"] else None
                gfit = GrowthFit(fit["exponent"], ci, fit["fixed"], fit["coef"], fit["n"], fit["r2"])
            text = describe_fit(what + (" above the fixed part" if what == "memory" else ""), gfit)
            console.print("  " + text.replace("x^", f"{a['x']}^"), markup=False, highlight=False)
        if a["memory_fit"]:
            console.print(
                f"  fixed part {render.format_bytes(int(a['memory_fit']['fixed']))}",
                markup=False,
                highlight=False,
            )
        if a["estimate_max_abs_rel_err"] is not None:
            compared = next((p["estimate_compared"] for p in a["points"] if "estimate_compared" in p), "")
            above = a["estimate_above_fixed_max_abs_rel_err"]
            console.print(
                f"  estimator: largest error {a['estimate_max_abs_rel_err']:.0%} ({compared})"
                + (f"; of the growing part alone, per point: {_above_errors(a['points'])}" if above else ""),
                markup=False,
                highlight=False,
            )
        limit = a["memory_limit"]
        if limit:
            at = limit["seq_len"]
            console.print(
                f"  memory runs out at S ≈ {at:,} ({limit['budget_source']}, "
                f"{render.format_bytes(limit['budget_bytes'])})"
                if at
                else f"  memory limit: not predictable from the fit ({limit['budget_source']})",
                markup=False,
                highlight=False,
            )
        if a["stopped_by"]:
            console.print(f"  sweep stopped: {a['stopped_by']}", markup=False, highlight=False)
    for line in report["culprits"]:
        console.print(line, markup=False, highlight=False)
