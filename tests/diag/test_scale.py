"""`nsa-diag scale`: the growth fit, the memory estimator, the plot, and real sweeps on the tiny CPU preset.

The fit and the estimator are tested on exact synthetic numbers; the end-to-end sweeps run real workers
(a few seconds each) at small S, so they check the plumbing (points, stop on failure, files), not the
exponents, which need S in the thousands (see the closing note of issue 4).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from diag_cli import run_cli

from nsa_diag.analysis.memory_model import count_params, estimate_peak_memory, plan_reference
from nsa_diag.analysis.scaling import QUADRATIC_EXPONENT, fit_growth, predict_limit
from nsa_diag.analysis.sweep import ScalePoint, ScaleReport
from nsa_diag.commands.scale import parse_budget, parse_int_list
from nsa_diag.errors import UsageError

SEQ_LENS = [256, 512, 1024, 1536, 2048]


def run_nsa_diag(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=240)


@pytest.mark.parametrize(
    ("exponent", "quadratic"),
    [pytest.param(2.0, True, id="k2"), pytest.param(1.0, False, id="k1"), pytest.param(1.5, True, id="k1.5")],
)
def test_fit_recovers_exponent_above_fixed_part(exponent: float, quadratic: bool) -> None:
    fixed = 4e8  # a CPU worker's runtime; the growing part reaches ~150 MB at S=2048, as in a real sweep
    coef = 1.5e8 / 2048**exponent
    ys = [fixed + coef * s**exponent * (1 + 0.002 * (-1) ** i) for i, s in enumerate(SEQ_LENS)]
    fit = fit_growth(SEQ_LENS, ys)
    assert fit is not None
    assert fit.ci95 is not None
    assert fit.exponent == pytest.approx(exponent, abs=0.05)
    assert fit.ci95[0] <= fit.exponent <= fit.ci95[1]
    assert fit.fixed == pytest.approx(fixed, rel=0.02)
    assert fit.quadratic is quadratic
    assert (exponent > QUADRATIC_EXPONENT) is quadratic


def test_time_fit_is_plain_log_log_and_limit_inverts_the_fit() -> None:
    fit = fit_growth(SEQ_LENS, [1e-6 * s**2 for s in SEQ_LENS], with_fixed=False)
    assert fit is not None
    assert fit.fixed == 0
    assert fit.exponent == pytest.approx(2.0)
    assert fit.ci95 == pytest.approx((2.0, 2.0), abs=1e-6)
    memory = fit_growth(SEQ_LENS, [1e8 + 10.0 * s**2 for s in SEQ_LENS])
    assert memory is not None
    at = predict_limit(memory, 1e8 + 10.0 * 8192**2)
    assert at == pytest.approx(8192, rel=0.01)
    assert predict_limit(memory, 5e7) is None  # the budget is below the fixed part
    assert fit_growth([256, 512], [1.0, 2.0]) is None  # a fixed part needs 3 points


def test_estimator_grows_as_the_backend_says() -> None:
    import nsa_core

    def activations(backend: str, s: int) -> int:
        cfg = nsa_core.preset("tiny", sel_backend=backend, force_branch="sel")
        return estimate_peak_memory(cfg, seq_len=s, batch=1).per_branch["sel"]

    assert activations("masked", 4096) / activations("masked", 2048) == pytest.approx(4, rel=0.1)
    assert activations("gather", 4096) / activations("gather", 2048) == pytest.approx(2, rel=0.1)
    assert activations("triton", 4096) / activations("triton", 2048) == pytest.approx(2, rel=0.01)
    assert activations("triton", 4096) < activations("gather", 4096) / 4  # no gathered keys, no scores
    triton = nsa_core.preset("m7c-125m", sel_backend="triton", cmp_backend="triton", win_backend="triton")
    totals = [
        estimate_peak_memory(triton, seq_len=s, batch=1, dtype="bf16").total for s in (8192, 16384, 32768)
    ]
    assert totals[2] - totals[1] == pytest.approx(2 * (totals[1] - totals[0]), rel=0.01)  # linear in S


def test_estimator_counts_what_lives_at_the_peak() -> None:
    import nsa_core

    cfg = nsa_core.preset("tiny", sel_backend="masked", win_backend="masked")
    one = estimate_peak_memory(cfg, seq_len=2048, batch=1)
    two = estimate_peak_memory(cfg, seq_len=2048, batch=1, steps=2)
    cuda = estimate_peak_memory(cfg, seq_len=2048, batch=1, device="cuda:0")
    assert two.total - one.total == one.optimizer  # AdamW's moments sit under step 2's activations
    assert cuda.total - one.total == cuda.workspace > 0  # the cuBLAS workspaces exist only on CUDA
    # the masked branches keep 8 bytes per fp32 score (exp and probabilities), 6 under bf16 autocast
    scores = 2048 * cfg.heads * 2048
    half = estimate_peak_memory(cfg, seq_len=2048, batch=1, dtype="bf16")
    assert one.per_branch["win"] - half.per_branch["win"] == pytest.approx(2 * scores, rel=0.05)  # + k, v, o


def test_estimator_counts_parameters_and_checkpointing() -> None:
    import nsa_core
    from nsa_core.models.tiny_lm import TinyLM

    cfg = nsa_core.preset("tiny")
    assert count_params(cfg) == sum(p.numel() for p in TinyLM(cfg).parameters())
    plain = estimate_peak_memory(cfg, seq_len=1024, batch=2)
    checkpointed = estimate_peak_memory(nsa_core.preset("tiny", gc="all"), seq_len=1024, batch=2)
    assert plain.params == 4 * count_params(cfg)
    assert plain.optimizer == 2 * plain.params
    assert checkpointed.activations < plain.activations


def test_option_parsing() -> None:
    assert parse_int_list("--seq-lens", "256,64,128,64") == (64, 128, 256)
    assert parse_budget("8GiB") == (8 * 2**30, "--memory-budget 8GiB")
    assert parse_budget("500MB")[0] == 500 * 10**6
    for bad in ("64,x", "0,64", ","):
        with pytest.raises(UsageError, match="--seq-lens"):
            parse_int_list("--seq-lens", bad)
    with pytest.raises(UsageError, match="--memory-budget"):
        parse_budget("lots")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    from nsa_diag.plots import plot_scale

    points = [
        {
            "x": s,
            "peak_memory_bytes": int(4e8 + 30 * s * s),
            "step_s": 1e-6 * s * s,
            "estimate": {"total": 30 * s * s},
        }
        for s in SEQ_LENS
    ]
    fit = fit_growth(SEQ_LENS, [p["peak_memory_bytes"] for p in points])
    report = {
        "series": [
            {"name": "sel", "branch": "sel", "backend": "masked", "x": "seq_len", "points": points,
             "memory_fit": fit, "time_fit": None}
        ]
    }  # fmt: skip
    path = plot_scale(ScaleReport.model_validate(report), tmp_path / "scale.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_scale_sweep_end_to_end(tmp_path: Path) -> None:
    proc = run_nsa_diag(
        "scale", "--seq-lens", "64,128,256", "--sel", "masked", "--branch", "sel",
        "--memory-budget", "64GiB", "--out", str(tmp_path), "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    (series,) = data["scale"]["series"]
    assert (series["branch"], series["backend"], series["x"]) == ("sel", "masked", "seq_len")
    assert [p["verdict"] for p in series["points"]] == ["pass"] * 3
    point = series["points"][-1]
    assert point["peak_memory_bytes"] > 0
    assert point["forward_s"] > 0
    assert point["backward_s"] > 0
    assert point["estimate"]["total"] > 0
    assert series["memory_fit"] is not None
    assert series["memory_limit"]["budget_source"].startswith("--memory")
    run_dir = Path(data["summary"]["run_dir"])
    for name in ("scale.json", "scale.png", "summary.json", "summary.md"):
        assert (run_dir / name).is_file(), name


@pytest.mark.slow
def test_a_failing_point_ends_its_series(tmp_path: Path) -> None:
    proc = run_nsa_diag(
        "scale", "--seq-lens", "64,128", "--layers", "2", "--inject", "oom:layer=1",
        "--out", str(tmp_path), "--json",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    (series,) = json.loads(proc.stdout)["scale"]["series"]
    assert [p["verdict"] for p in series["points"]] == ["oom", "not-run"]
    assert series["stopped_by"].startswith("oom at seq_len=64")
    assert series["memory_fit"] is None
    oom = series["points"][0]
    assert "estimate_rel_err" not in oom  # the peak at an oom is what was allocated, not what was needed
    assert oom["estimate_exceeds_budget"] is False  # an injected oom: the estimate did not foresee it


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param((), "give --seq-lens", id="nothing-to-sweep"),
        pytest.param(("--seq-lens", "64,abc"), "--seq-lens '64,abc'", id="bad-list"),
        pytest.param(("--seq-lens", "64,128", "--memory-budget", "lots"), "--memory-budget", id="bad-budget"),
    ],
)
def test_bad_sweep_options_exit_2_without_a_run_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    from nsa_diag.app import run_cli

    assert run_cli(["scale", *args, "--out", str(tmp_path / "runs")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_estimator_names_the_phase_of_the_peak_and_the_fit_skips_optimizer_bound_points() -> None:
    import nsa_core
    from nsa_diag.analysis.sweep import growth_points

    triton = nsa_core.preset(
        "m7c-125m", layers=5, sel_backend="triton", cmp_backend="triton", win_backend="triton"
    )
    small = estimate_peak_memory(triton, seq_len=512, batch=1, device="cuda:0")
    big = estimate_peak_memory(triton, seq_len=8192, batch=1, device="cuda:0")
    assert (small.phase, big.phase) == ("optimizer", "backward")
    cpu = estimate_peak_memory(triton, seq_len=512, batch=1)
    assert small.total - cpu.total == 4 * count_params(triton) + (
        64 << 20
    )  # AdamW's foreach temporaries, cuBLAS
    points = [
        ScalePoint(x=512, device="cuda:0", estimate=small),
        ScalePoint(x=8192, device="cuda:0", estimate=big),
        ScalePoint(x=512, device="cpu", estimate=cpu),  # peak RSS: every point counts
        ScalePoint(x=1024, device="cuda:0", estimate=None),
    ]
    assert [p["x"] for p in growth_points(points)] == [8192, 512, 1024]


# --- a parity check's reference, sized to the case (issue 15 #14) ---------------------------------------


def _forced(backend: str, branch: str) -> Any:
    import nsa_core

    cfg = nsa_core.preset("m7c-125m")
    return replace(cfg, nsa=replace(cfg.nsa, force_branch=branch, **{f"{branch}_backend": backend}))


def test_the_reference_is_dense_where_it_fits_and_lean_where_not() -> None:
    cfg = _forced("triton", "win")
    size = {"seq_len": 8192, "batch": 1, "dtype": "bf16", "device": "cuda"}
    unlimited = plan_reference(cfg, **size, budget_bytes=None)
    assert (unlimited.fits, unlimited.lean) == (True, False)
    assert set(unlimited.backends.values()) == {"reference"}
    assert unlimited.margin == 2  # the per-token reference must fit twice over
    assert unlimited.fallback is not None  # tried if the dense one runs out of memory anyway
    assert unlimited.fallback.backends["win"] == "chunked"
    # Below the dense need: the window branch is checked by chunked (linear in S), which does fit.
    lean = plan_reference(cfg, **size, budget_bytes=2 * unlimited.need_bytes - 1)
    assert lean.lean
    assert lean.backends["win"] == "chunked"
    assert lean.need_bytes < unlimited.need_bytes / 2
    assert lean.fits
    # Smaller than any reference: the check cannot run, and says why.
    none = plan_reference(cfg, **size, budget_bytes=1 << 30)
    assert not none.fits
    assert "of 1.0 GiB free" in none.describe()


def test_a_lean_reference_is_never_the_backend_under_test() -> None:
    dense = plan_reference(_forced("gather", "sel"), seq_len=8192, batch=1, dtype="fp32", device="cuda",
                           budget_bytes=None)  # fmt: skip
    plan = plan_reference(_forced("gather", "sel"), seq_len=8192, batch=1, dtype="fp32", device="cuda",
                          budget_bytes=dense.need_bytes - 1)  # fmt: skip
    assert plan.backends["sel"] == "packed"
    chunked = plan_reference(_forced("chunked", "win"), seq_len=8192, batch=1, dtype="fp32", device="cuda",
                             budget_bytes=1)  # fmt: skip
    assert chunked.backends["win"] == "reference"  # no other lean window backend: the dense one, not fitting
    assert not chunked.fits


def test_a_reference_too_slow_for_the_case_is_lean_whatever_the_memory() -> None:
    # m7c-125m's selection reference at S = 2048 loops ~1.6 million times per forward (3.5 min on an H200).
    cfg = _forced("triton", "sel")
    plan = plan_reference(cfg, seq_len=2048, batch=1, dtype="bf16", device="cuda", budget_bytes=None)
    assert plan.lean
    assert plan.backends["sel"] == "gather"
    small = plan_reference(cfg, seq_len=256, batch=1, dtype="bf16", device="cuda", budget_bytes=None)
    assert small.backends["sel"] == "reference"


# --- host-bound points on the GPU (issue 15 #13) --------------------------------------------------------


def _point(x: int, fwd: list[float], bwd: list[float], issue: tuple[list[float], list[float]] | None) -> Any:
    """A point as `point_record` makes it from a worker's result with these phase times."""
    from nsa_diag.analysis.sweep import point_record
    from nsa_diag.spec import CaseResult, CaseSpec

    metrics: dict[str, Any] = {
        "phase_s": {"forward": fwd, "backward": bwd},
        "tokens_per_s": 1.0,
        "peak_memory": {"cuda_max_allocated_bytes": 1000 * x},
    }
    if issue is not None:
        metrics["phase_issue_s"] = {"forward": issue[0], "backward": issue[1]}
    spec = CaseSpec(name=f"S{x}", seq_len=x, device="cpu")
    result = CaseResult(
        name=spec.name,
        spec_hash=spec.spec_hash(),
        verdict="pass",
        reason="ok",
        device="cuda:0",
        metrics=metrics,
    )
    return point_record(x, spec, result)


def test_phase_times_are_the_median_of_the_steps_after_the_warm_up() -> None:
    p = _point(64, [9.0, 0.2, 0.4, 0.3], [9.0, 0.5, 0.5, 0.7], None)
    assert (p["forward_s"], p["backward_s"], p["timed_steps"]) == (0.3, 0.5, 3)
    assert p["host_bound"] is None  # the CPU: no issue times


def test_host_bound_points_are_left_out_of_the_time_fit() -> None:
    from nsa_diag.analysis.sweep import fit_points, host_bound_note

    # 4096 and 8192: the host took all of the phase to issue it (the GPU waited): flat, not the model's.
    points = [
        _point(4096, [1, 0.05, 0.05], [1, 0.07, 0.07], ([1, 0.05, 0.05], [1, 0.069, 0.069])),
        _point(8192, [1, 0.05, 0.05], [1, 0.08, 0.08], ([1, 0.049, 0.049], [1, 0.079, 0.079])),
        _point(16384, [1, 0.10, 0.10], [1, 0.20, 0.20], ([1, 0.05, 0.05], [1, 0.07, 0.07])),
        _point(32768, [1, 0.20, 0.20], [1, 0.40, 0.40], ([1, 0.05, 0.05], [1, 0.07, 0.07])),
    ]
    assert [p["host_bound"] for p in points] == [True, True, False, False]
    series = fit_points(points, "seq_len", lambda device: None)
    assert series["time_fit_points"] == [16384, 32768]
    assert series["host_bound_points"] == [4096, 8192]
    assert series["time_fit"]["exponent"] == pytest.approx(1.0)
    note = host_bound_note(series)
    assert note is not None
    assert "host-bound [4096, 8192]" in note


def test_an_estimator_comparison_that_did_not_run_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26: where the estimator's error was measured at no point (a --model has no estimate; on the
    CPU it needs the memory fit), the sweep says so, with why, instead of leaving the line out."""
    from nsa_diag.analysis.sweep import fit_points
    from nsa_diag.render import render_scale

    measured = [_point(x, [1, 0.1], [1, 0.2], None) for x in (64, 128)]
    assert fit_points(measured, "seq_len", lambda device: None)["estimate_not_compared"] is None  # CUDA
    points = [_point(x, [1, 0.1], [1, 0.2], None) for x in (64, 128)]
    for p in points:
        p.estimate = None  # as for a --model
    series = fit_points(points, "seq_len", lambda device: None)
    assert series["estimate_max_abs_rel_err"] is None
    assert series["estimate_not_compared"].startswith("no estimate: the estimator models nsa_core's model")
    head = {"name": "all", "branch": "all", "backend": None, "x": "seq_len", "points": points}
    scale = {"series": [{**head, "stopped_by": None, **series.given()}], "culprits": []}
    render_scale(ScaleReport.model_validate(scale))
    assert "estimator: not compared: no estimate" in capsys.readouterr().out
