"""`nsa-diag report DIR` and `nsa-diag compare A B` on real run folders.

One session fixture makes three real runs at once on the tiny CPU preset (S 32..64, batch 1, 2 layers):
a `scale` sweep (three passing points), a `run` with an injected deadlock (a hang after a 5 s stall) named
like the sweep's first point, and a `run` interrupted with SIGINT while it hangs. The other folders are
copies of these, edited by hand: a matrix run (matrix.json as `nsa-diag matrix` writes it, with cases
copied from the sweep, some changed to other verdicts, some never run), a run killed so hard it left no
result.json and no summary.json, and runs with another torch version, allocator setting or verdict.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from diag_cli import cli_env, run_cli

from nsa_diag import artifacts
from nsa_diag.analysis.compare import (
    BETTER,
    CHANGED,
    NOT_COMPARABLE,
    RATIOS,
    SAME,
    WORSE,
    ComparedCase,
    ComparedRun,
    compare_runs,
    not_comparable,
    verdict_change,
)
from nsa_diag.errors import UsageError
from nsa_diag.report import build_report
from nsa_diag.runfolder import CaseRecord, RunFolder, load_run, verdict_grids

TINY = ["--layers", "2", "--batch", "1", "--device", "cpu"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env() -> dict[str, str]:
    return cli_env()


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "nsa_diag", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )


def nsa_diag(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=120)


def _only(folder: Path) -> Path:
    (run_dir,) = folder.iterdir()
    return run_dir


def _injected(folder: Path) -> bool:
    return any('"inject"' in p.read_text() for p in folder.glob("*/cases/*/" + artifacts.PROGRESS))


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real run folders: `scale` (3 passing points), `hang` (the first point's name, deadlocked) and
    `interrupted` (SIGINT while hung), made concurrently."""
    base = tmp_path_factory.mktemp("runs")
    out = {name: base / name for name in ("scale", "hang", "interrupted")}
    procs = {
        "scale": _start("scale", "--seq-lens", "32,48,64", *TINY, "--out", str(out["scale"])),
        "hang": _start(
            "run", "--name", "all-L2-S32", "--seq-len", "32", *TINY,
            "--inject", "deadlock:layer=1", "--stall", "5", "--out", str(out["hang"]),
        ),
        "interrupted": _start(
            "run", "--seq-len", "32", *TINY, "--inject", "deadlock:layer=1", "--stall", "60",
            "--out", str(out["interrupted"]),
        ),
    }  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not _injected(out["interrupted"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        procs["interrupted"].send_signal(signal.SIGINT)
        codes = {name: proc.wait(timeout=150) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert codes == {"scale": 0, "hang": 1, "interrupted": 130}, {
        name: proc.stderr.read() if proc.stderr else "" for name, proc in procs.items()
    }
    return {name: _only(folder) for name, folder in out.items()}


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("report*"))
    return dest


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[last] = value
    path.write_text(json.dumps(data))


# --- report -------------------------------------------------------------------------------------------------


@pytest.mark.slow  # `runs` makes real run folders: 2 min under make test's load (hand-built ones stay)
def test_report_of_a_sweep_has_the_table_the_fit_and_the_plot(runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = _copy(runs["scale"], tmp_path / "scale")
    done = nsa_diag("report", run_dir)
    assert done.returncode == 0, done.stderr
    assert f"report: {run_dir / 'report.md'}" in done.stdout
    text = (run_dir / "report.md").read_text()
    for point in ("all-L2-S32", "all-L2-S48", "all-L2-S64"):
        assert f"| {point} | pass |" in text
    assert "## Memory and time against sequence length" in text
    assert "From scale.json." in text
    assert "memory above the fixed part ~ seq_len^" in text
    assert "![memory and time against sequence length](report-scaling.png)" in text
    assert (run_dir / "report-scaling.png").read_bytes().startswith(PNG_MAGIC)
    env = json.loads((run_dir / "env.json").read_text())
    assert f"| torch | {env['torch']['version']} |" in text
    assert "## Failures" not in text


@pytest.mark.slow  # `runs` makes real run folders: 2 min under make test's load (hand-built ones stay)
def test_report_of_a_hang_shows_where_and_the_stacks(runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = _copy(runs["hang"], tmp_path / "hang")
    done = nsa_diag("report", run_dir, "--json")
    assert done.returncode == 0, done.stderr
    written = json.loads(done.stdout)
    assert written["counts"] == {"hang": 1}
    assert written["plots"][0] == str(run_dir / "report-failures.png")
    text = (run_dir / "report.md").read_text()
    assert "| all-L2-S32 | hang | python-deadlock | layer 1 backward step 1 |" in text
    assert "### all-L2-S32: hang / python-deadlock at layer 1 backward step 1" in text
    assert "stall limit: --stall 5 s" in text
    assert "inject.py:" in text
    assert "_deadlock_lock_acquire" in text
    assert "(at hang)" in text  # peak memory from memory_stats.json, as the step never ended
    assert (run_dir / "report-failures.png").read_bytes().startswith(PNG_MAGIC)
    # the timeline: the worker's slices, still open where it hung (layer 1 backward), then stall and verdict
    assert written["timeline"] == str(run_dir / "timeline.json")
    assert "Timeline: `timeline.json`" in text
    events = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    still_open = [e["name"] for e in events if e["ph"] == "B"]  # ended slices are complete events
    assert still_open[-3:] == ["step 1", "backward", "layer 1 backward"]
    assert written["plots"][-1] == str(run_dir / "report-timeline.png")
    marks = [e["name"] for e in events if e.get("s") == "p"]
    assert marks == ["stall: no progress for 5 s", "verdict: hang"]


@pytest.mark.slow  # `runs` makes real run folders: 2 min under make test's load (hand-built ones stay)
def test_report_of_an_interrupted_run(runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = _copy(runs["interrupted"], tmp_path / "interrupted")
    done = nsa_diag("report", run_dir)
    assert done.returncode == 0, done.stderr
    text = (run_dir / "report.md").read_text()
    assert "- result: not all ok (interrupted), exit code 130" in text
    assert "| case | error | - |" in text
    assert "interrupted by SIGINT" in text


@pytest.mark.slow  # `runs` makes real run folders: 2 min under make test's load (hand-built ones stay)
def test_report_of_a_killed_run_reads_the_case_folders(runs: dict[str, Path], tmp_path: Path) -> None:
    """nsa-diag itself SIGKILLed mid-case: no summary.json, no result.json; progress.jsonl says where."""
    run_dir = _copy(runs["hang"], tmp_path / "20260101-120000-run-killed")
    (run_dir / "summary.json").unlink()
    (run_dir / "cases" / "all-L2-S32" / artifacts.RESULT).unlink()
    done = nsa_diag("report", run_dir)
    assert done.returncode == 0, done.stderr
    text = (run_dir / "report.md").read_text()
    assert text.startswith("# nsa-diag run: `20260101-120000-run-killed`")
    assert "no summary.json: the run did not finish" in text
    assert "| all-L2-S32 | no result | - | last progress: layer 1 backward step 1 |" in text


def _matrix_folder(scale_dir: Path, dest: Path) -> Path:
    """A matrix run over sel_backend x seq_len x batch, as `nsa-diag matrix` leaves it: the gather cases
    are the sweep's; the masked ones are copies with the spec changed and S=64 turned into an oom; the
    batch=2 cases and the listed case `smoke` never ran (an interrupted matrix)."""
    shutil.copytree(
        scale_dir, dest, ignore=shutil.ignore_patterns("cases", "report*", "scale.*", "summary.*")
    )
    cases = []
    for backend in ("gather", "masked"):
        for s in (32, 48, 64):
            for batch in (1, 2):
                name = f"sel_backend={backend}-seq_len={s}-batch={batch}"
                axes = {"sel_backend": backend, "seq_len": s, "batch": batch}
                cases.append({"name": name, "tags": ["grid"], "spec_hash": "0", "axes": axes})
                if batch == 2:
                    continue
                case_dir = dest / "cases" / name
                shutil.copytree(scale_dir / "cases" / f"all-L2-S{s}", case_dir)
                _edit_json(case_dir / artifacts.RESULT, name=name)
                if backend == "masked":
                    _edit_json(case_dir / artifacts.SPEC, **{"overrides.sel_backend": "masked"})
                if backend == "masked" and s == 64:
                    _edit_json(
                        case_dir / artifacts.RESULT, verdict="oom", reason="CUDA out of memory (hand-made)"
                    )
    cases.append({"name": "smoke", "tags": ["smoke"], "spec_hash": "0", "axes": {}})
    matrix = {
        "file": "matrices/hand.yaml",
        "name": "hand",
        "description": None,
        "axes": {"sel_backend": ["gather", "masked"], "seq_len": [32, 48, 64], "batch": [1, 2]},
        "cases": cases,
    }
    (dest / "matrix.json").write_text(json.dumps(matrix))
    return dest


@pytest.mark.slow  # `runs` makes real run folders: 2 min under make test's load (hand-built ones stay)
def test_report_of_a_matrix_has_a_verdict_grid_per_remaining_axis_value(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    run_dir = _matrix_folder(runs["scale"], tmp_path / "20260101-120000-matrix-hand")
    done = nsa_diag("report", run_dir)
    assert done.returncode == 0, done.stderr
    text = (run_dir / "report.md").read_text()
    assert "- matrix: hand (`matrices/hand.yaml`)" in text
    assert "| case | sel_backend | seq_len | batch | tags | verdict |" in text
    assert "| smoke | - | - | - | smoke | not run |" in text
    grid_1, grid_2 = text.split("### batch=1")[1].split("### batch=2")
    assert "| sel_backend \\ seq_len | 32 | 48 | 64 |" in grid_1
    assert "| gather | pass | pass | pass |" in grid_1
    assert "| masked | pass | pass | oom |" in grid_1
    assert "| masked | not run | not run | not run |" in grid_2
    for index in (1, 2):
        assert f"](report-grid-{index}.png)" in text
        assert (run_dir / f"report-grid-{index}.png").read_bytes().startswith(PNG_MAGIC)
    # the gather cases differ only in S: a series, fitted; masked has two passing lengths, too few
    assert "From the cases that differ only in S." in text
    assert "### sel_backend=gather" not in text  # one series: no label needed beyond the command
    assert "| 32 | pass |" in text
    assert "memory above the fixed part ~ seq_len^" in text
    assert (run_dir / "report-scaling.png").read_bytes().startswith(PNG_MAGIC)


TRITON = {"layers": 5, "sel_backend": "triton", "cmp_backend": "triton", "win_backend": "triton"}
GPU_TOTAL = 80 << 30


def _written_matrix(dest: Path, device: str, seq_lens: list[int], peaks: list[int]) -> Path:
    """A matrix run over seq_len of m7c-125m (5 layers, Triton) on `device` as `nsa-diag matrix` leaves
    it, every case passed with the given peak memory; env.json from a machine with an 80 GiB GPU."""
    from nsa_diag.spec import CaseResult, CaseSpec

    cases = []
    for s, peak in zip(seq_lens, peaks, strict=True):
        name = f"seq_len={s}"
        spec = CaseSpec(
            name=name, preset="m7c-125m", overrides=TRITON, seq_len=s, batch=1, device=device.split(":")[0]
        )
        kind = "cuda_max_allocated_bytes" if device.startswith("cuda") else "cpu_peak_rss_bytes"
        metrics = {"peak_memory": {kind: peak}, "phase_s": {"forward": [s / 1e4], "backward": [s / 5e3]}}
        result = CaseResult(
            name=name, spec_hash=spec.spec_hash(), verdict="pass", reason="ok", device=device, metrics=metrics
        )
        (dest / "cases" / name).mkdir(parents=True)
        artifacts.write_json(dest / "cases" / name / artifacts.SPEC, spec.model_dump(mode="json"))
        artifacts.write_json(dest / "cases" / name / artifacts.RESULT, result.model_dump(mode="json"))
        cases.append({"name": name, "tags": [], "spec_hash": spec.spec_hash(), "axes": {"seq_len": s}})
    matrix = {
        "file": "m.yaml",
        "name": "m",
        "description": None,
        "axes": {"seq_len": seq_lens},
        "cases": cases,
    }
    artifacts.write_json(dest / "matrix.json", matrix)
    env = {
        "torch": {"devices": [{"name": "NVIDIA H100", "total_memory_bytes": GPU_TOTAL}]},
        "cpu_memory": {"memory_total_bytes": 64 << 30},
    }
    artifacts.write_json(dest / artifacts.ENV, env)
    return dest


def _no_device_query(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's budget comes from env.json: asking this machine's devices fails the test."""
    from nsa_diag.session import plans

    def refuse(device: str | None) -> tuple[int, str]:
        raise AssertionError(f"the report asked this machine for {device}'s memory")

    monkeypatch.setattr(plans, "device_memory_total", refuse)


def test_matrix_length_series_fits_memory_as_scale_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton on CUDA at S <= 1024: the estimated peak is the optimizer step (flat in S), so, as in
    `scale`, those points stay out of the memory fit: over all five the flat start makes it steep."""
    import nsa_core
    from nsa_diag.analysis.memory_model import estimate_peak_memory
    from nsa_diag.analysis.scaling import QUADRATIC_EXPONENT, fit_growth
    from nsa_diag.runfolder import length_series

    _no_device_query(monkeypatch)
    seq_lens = [512, 1024, 2048, 4096, 8192]
    cfg = nsa_core.preset("m7c-125m", **TRITON)
    estimates = [estimate_peak_memory(cfg, seq_len=s, batch=1, device="cuda:0") for s in seq_lens]
    peaks = [e.total for e in estimates]  # measured as estimated: flat, then linear in S
    assert [e.phase for e in estimates] == ["optimizer"] * 2 + ["backward"] * 3
    all_points = fit_growth(seq_lens, peaks)
    assert all_points is not None
    assert all_points.exponent > QUADRATIC_EXPONENT  # what the report said before: "quadratic"

    run = load_run(_written_matrix(tmp_path / "20260101-120000-matrix-m", "cuda:0", seq_lens, peaks))
    (series,) = length_series(run)
    assert [p["estimate"]["phase"] for p in series["points"]] == [e.phase for e in estimates]
    assert [p["case"] for p in series["points"]] == [f"seq_len={s}" for s in seq_lens]
    assert series["memory_fit_points"] == [2048, 4096, 8192]
    assert series["memory_fit"]["n"] == 3
    assert series["memory_fit"]["exponent"] == pytest.approx(1.0, abs=0.01)
    assert series["memory_quadratic"] is False
    assert series["time_fit"]["n"] == 5  # time is not the optimizer's: every point
    assert series["estimate_max_abs_rel_err"] == pytest.approx(0.0, abs=1e-9)
    assert series["memory_limit"]["budget_bytes"] == GPU_TOTAL
    assert series["memory_limit"]["budget_source"] == "NVIDIA H100 total (env.json)"

    text = build_report(run, {})
    assert "memory above the fixed part ~ seq_len^1.00" in text
    assert "(quadratic)" not in text
    assert "memory fit over [2048, 4096, 8192]: 2 point(s) left out" in text


def test_matrix_length_series_on_the_cpu_fits_every_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU (peak RSS keeps the activations' pages whatever the estimate's phase) every point is
    fitted, as before the estimate was attached: the fit is the plain fit over all of them."""
    from nsa_diag.analysis.scaling import fit_growth
    from nsa_diag.runfolder import length_series

    _no_device_query(monkeypatch)
    seq_lens = [512, 1024, 2048, 4096]
    peaks = [(900 << 20) + 3000 * s**2 for s in seq_lens]
    run = load_run(_written_matrix(tmp_path / "20260101-120000-matrix-m", "cpu", seq_lens, peaks))
    (series,) = length_series(run)
    assert "optimizer" in [p["estimate"]["phase"] for p in series["points"]]
    assert series["memory_fit_points"] == seq_lens
    expected = fit_growth(seq_lens, peaks)
    assert expected is not None
    assert series["memory_fit"] == expected
    assert series["memory_quadratic"] is True
    assert series["memory_limit"]["budget_source"] == "total memory of the machine (env.json)"


def _record(name: str, verdict: str, **axes: Any) -> CaseRecord:
    return CaseRecord(name, Path(name), None, None, {"verdict": verdict, "ok": verdict == "pass"}, axes)


def test_verdict_grids_follow_each_family_of_axes() -> None:
    """Entries of a matrix file can have axes of their own: each family gets its own grids; one axis
    gives a single column; listed cases (no axes) none."""
    cases = [
        _record("a-1", "pass", sel="a", s=1),
        _record("a-2", "hang", sel="a", s=2),
        _record("b-1", "pass", sel="b", s=1),
        _record("gc-all", "pass", gc="all"),
        _record("gc-none", "oom", gc="none"),
        _record("listed", "pass"),
    ]
    run = RunFolder(
        Path("m"), "matrix", None, None, cases, [], matrix={"axes": {"sel": ["b", "a"], "gc": []}}
    )
    first, second = verdict_grids(run)
    assert (first.title, first.row_axis, first.col_axis) == ("sel x s", "sel", "s")
    assert first.rows == ["b", "a"]  # in the order matrix.json declares them
    assert [[[c.name for c in cell] for cell in row] for row in first.cells] == [
        [["b-1"], []],
        [["a-1"], ["a-2"]],
    ]
    assert (second.title, second.row_axis, second.col_axis, second.cols) == ("gc", "gc", None, [None])
    assert [[c.name for c in row[0]] for row in second.cells] == [["gc-all"], ["gc-none"]]


def test_report_refuses_what_is_not_a_run_folder(tmp_path: Path) -> None:
    (tmp_path / "cases" / "empty").mkdir(parents=True)  # no spec.json or result.json in it
    for target in (tmp_path, tmp_path / "missing"):
        done = nsa_diag("report", target)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert "run folder" in done.stderr
    assert not (tmp_path / "report.md").exists()
    with pytest.raises(UsageError, match="not an nsa-diag run folder"):
        load_run(tmp_path)


def test_a_summary_of_another_shape_is_read_around_not_raised_on(tmp_path: Path) -> None:
    run = tmp_path / "20260101-120000-run"
    (run / "cases" / "c").mkdir(parents=True)
    result = {"name": "c", "spec_hash": "0" * 16, "verdict": "pass", "reason": "ok"}
    (run / "cases" / "c" / artifacts.RESULT).write_text(json.dumps(result))
    (run / "summary.json").write_text(json.dumps({"command": "run", "cases": 5, "not_run": 7, "argv": 3}))
    matrix = {"axes": 5, "cases": [{"name": ["x"]}, {"name": "c", "axes": 5, "tags": 5}]}
    (run / "matrix.json").write_text(json.dumps(matrix))

    done = nsa_diag("report", run)
    assert done.returncode == 0, done.stderr
    assert "summary.json: cases is not a JSON array: ignored" in (run / "report.md").read_text()
    (run / "summary.json").write_text("[1, 2")  # there, but unreadable: not said to be missing
    done = nsa_diag("report", run)
    assert done.returncode == 0, done.stderr
    report = (run / "report.md").read_text()
    assert "summary.json could not be used (see Notes)" in report
    assert "no summary.json" not in report
    done = nsa_diag("compare", run, run)
    assert done.returncode == 0, done.stderr
    assert "matrix.json: axes is not a JSON object: ignored" in done.stdout + done.stderr


# --- compare ------------------------------------------------------------------------------------------------


def test_compare_runs_takes_plain_records() -> None:
    """compare is pure: two runs as records (no run folder), cases matched by name, B/A ratios."""
    side = {"verdict": "pass", "ok": True, "peak_memory_bytes": 100, "peak_memory_kind": "rss", "step_s": 2.0}
    spec = {"name": "c", "seq_len": 64}
    a = ComparedRun("A", "run", [ComparedCase("c", side, spec), ComparedCase("only-a", side)], notes=["n"])
    worse = {**side, "verdict": "hang", "ok": False, "peak_memory_bytes": 150, "step_s": 1.0}
    b = ComparedRun("B", "run", [ComparedCase("c", worse, spec)], env={"nsa_diag_version": "x"})
    comparison = compare_runs(a, b)
    assert comparison["a"] == {"run_dir": "A", "command": "run", "cases": 2, "notes": ["n"]}
    (case,) = comparison["cases"]
    assert (case["name"], case["change"]) == ("c", WORSE)
    assert case["ratios"] == {"peak_memory": 1.5, "step_time": 0.5, "tokens_per_s": None}
    assert (comparison["only_in_a"], comparison["worse"], comparison["exit_code"]) == (["only-a"], ["c"], 1)
    assert (comparison["environment"]["a_recorded"], comparison["environment"]["b_recorded"]) == (False, True)


@pytest.mark.slow  # `runs` makes real run folders: 2 min under make test's load (hand-built ones stay)
def test_compare_two_real_runs(runs: dict[str, Path], tmp_path: Path) -> None:
    """The sweep's first point passed; the same case name deadlocked in the other run: worse, exit 1."""
    done = nsa_diag("compare", runs["scale"], runs["hang"], "--out", tmp_path / "compare.md")
    assert done.returncode == 1, done.stderr
    assert "all-L2-S32" in done.stdout
    assert "hang (python-deadlock)" in done.stdout
    assert "only in A: all-L2-S48, all-L2-S64" in done.stdout
    assert "worse in B: all-L2-S32 (exit code 1)" in done.stdout
    # the two runs differ in their specs (stall, inject): said per case
    assert "inject:" in done.stdout
    assert "stall:" in done.stdout
    markdown = (tmp_path / "compare.md").read_text()
    assert "| all-L2-S32 | pass | hang (python-deadlock) | worse |" in markdown

    back = nsa_diag("compare", runs["hang"], runs["scale"], "--json")
    assert back.returncode == 0, back.stderr
    comparison = json.loads(back.stdout)
    (case,) = comparison["cases"]
    assert (case["name"], case["change"]) == ("all-L2-S32", BETTER)
    assert comparison["only_in_b"] == ["all-L2-S48", "all-L2-S64"]
    assert comparison["exit_code"] == 0


@pytest.mark.slow  # `runs` makes real run folders: 2 min under make test's load (hand-built ones stay)
def test_compare_reports_environment_and_ratios_of_an_edited_copy(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The seeds' A/B: the same sweep under another torch, another allocator setting, another GPU."""
    a = runs["scale"]
    b = _copy(a, tmp_path / "b")
    _edit_json(
        b / "env.json",
        **{
            "torch.version": "2.14.0+cu128",
            "torch.cudnn_version": 91000,
            "git.revision": "0123abcd",
            "env_vars": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NSA_DEBUG": "1"},
        },
    )
    s48 = b / "cases" / "all-L2-S48"
    result = json.loads((s48 / artifacts.RESULT).read_text())
    peak = result["metrics"]["peak_memory"]["cpu_peak_rss_bytes"]
    _edit_json(
        s48 / artifacts.RESULT,
        **{
            "metrics.peak_memory.cpu_peak_rss_bytes": peak * 2,
            "metrics.step_s": [s * 3 for s in result["metrics"]["step_s"]],
            "metrics.tokens_per_s": result["metrics"]["tokens_per_s"] / 3,
        },
    )
    _edit_json(s48 / artifacts.SPEC, alloc_conf="max_split_size_mb:128")
    _edit_json(b / "cases" / "all-L2-S64" / artifacts.RESULT, verdict="skipped", reason="no GPU here")

    done = nsa_diag("compare", a, b, "--json")
    assert done.returncode == 0, done.stderr  # nothing got worse: S64 was skipped, not comparable
    comparison = json.loads(done.stdout)
    differs = {f["fact"]: (f["a"], f["b"]) for f in comparison["environment"]["facts"] if f["differs"]}
    a_env = json.loads((a / "env.json").read_text())
    assert differs == {
        "torch": (a_env["torch"]["version"], "2.14.0+cu128"),
        "cuDNN": (None, 91000),
        "git revision": (a_env["git"].get("revision") or a_env["git"]["why"], "0123abcd"),
    }
    variables = {v["name"]: (v["a"], v["b"]) for v in comparison["environment"]["env_vars"]}
    assert variables["PYTORCH_CUDA_ALLOC_CONF"] == (None, "expandable_segments:True")
    assert variables["NSA_DEBUG"] == (None, "1")
    cases = {c["name"]: c for c in comparison["cases"]}
    assert {name: c["change"] for name, c in cases.items()} == {
        "all-L2-S32": SAME,
        "all-L2-S48": SAME,
        "all-L2-S64": NOT_COMPARABLE,
    }
    ratios = cases["all-L2-S48"]["ratios"]
    assert ratios["peak_memory"] == pytest.approx(2.0)
    assert ratios["step_time"] == pytest.approx(3.0)
    assert ratios["tokens_per_s"] == pytest.approx(1 / 3)
    assert cases["all-L2-S48"]["spec_differences"] == [
        {"field": "alloc_conf", "a": None, "b": "max_split_size_mb:128"}
    ]
    assert cases["all-L2-S32"]["ratios"]["peak_memory"] == pytest.approx(1.0)

    table = nsa_diag("compare", a, b)
    assert table.returncode == 0
    assert "2.14.0+cu128" in table.stdout
    assert "$PYTORCH_CUDA_ALLOC_CONF" in table.stdout
    assert "2.00x" in table.stdout
    assert "3.00x" in table.stdout
    assert "alloc_conf: - -> max_split_size_mb:128" in table.stdout


def _one_step(run_dir: Path, tokens_per_s: float) -> None:
    """Make every case of a copied run folder a one-step case: its timings are its warm-up's."""
    for result_path in run_dir.glob("cases/*/" + artifacts.RESULT):
        result = json.loads(result_path.read_text())
        first = result["metrics"]["step_s"][0]
        _edit_json(
            result_path,
            **{"metrics.step_s": [first], "metrics.tokens_per_s": tokens_per_s, "steps_done": 1,
               "metrics.tokens_per_s_steps": "1"},
        )  # fmt: skip
        _edit_json(result_path.with_name(artifacts.SPEC), steps=1)


@pytest.mark.slow  # `runs` makes real run folders: 2 min under make test's load (hand-built ones stay)
def test_compare_of_warm_up_timings_says_not_comparable(runs: dict[str, Path], tmp_path: Path) -> None:
    """Issue 26: two identical runs of one-step cases showed "tokens/s B/A 10.79x", noise from the warm-up
    (Triton compiles, the allocator settles): tokens/s over steps 2.. does not exist there."""
    a, b = _copy(runs["scale"], tmp_path / "a"), _copy(runs["scale"], tmp_path / "b")
    _one_step(a, 1000.0)
    _one_step(b, 10790.0)
    done = nsa_diag("compare", a, b, "--json")
    assert done.returncode == 0, done.stderr
    cases = {c["name"]: c for c in json.loads(done.stdout)["cases"]}
    case = cases["all-L2-S48"]
    assert case["ratios"]["tokens_per_s"] is None
    assert case["ratios"]["step_time"] is None
    assert case["ratios"]["peak_memory"] == pytest.approx(1.0)  # step 1 holds the peak: memory compares
    assert set(case["not_comparable"]) == {"step_time", "tokens_per_s"}
    assert case["not_comparable"]["tokens_per_s"].startswith("warm-up only: one step in A and B")

    table = nsa_diag("compare", a, b, "--out", tmp_path / "compare.md")
    assert table.returncode == 0
    assert "10.79x" not in table.stdout
    assert "not comparable" in table.stdout
    assert "warm-up only: one step in A and B" in table.stdout
    markdown = (tmp_path / "compare.md").read_text()
    assert "| all-L2-S48 |" in markdown
    assert "| 1.00x | not comparable | not comparable | warm-up only: one step in A and B" in markdown


@pytest.mark.slow  # `runs` makes real run folders: 2 min under make test's load (hand-built ones stay)
def test_compare_of_different_shapes_gives_no_ratio(runs: dict[str, Path], tmp_path: Path) -> None:
    """Cases of one name but another shape (S, backend) do different work: no ratio of their memory or
    time, and the spec difference that makes them so is said."""
    b = _copy(runs["scale"], tmp_path / "b")
    _edit_json(b / "cases" / "all-L2-S48" / artifacts.SPEC, seq_len=96)
    spec = json.loads((b / "cases" / "all-L2-S64" / artifacts.SPEC).read_text())
    _edit_json(
        b / "cases" / "all-L2-S64" / artifacts.SPEC, overrides={**spec["overrides"], "sel_backend": "gather"}
    )
    done = nsa_diag("compare", runs["scale"], b, "--json")
    assert done.returncode == 0, done.stderr
    cases = {c["name"]: c for c in json.loads(done.stdout)["cases"]}
    assert cases["all-L2-S32"]["not_comparable"] == {}
    assert cases["all-L2-S32"]["ratios"]["tokens_per_s"] == pytest.approx(1.0)
    for name, why in (("all-L2-S48", "seq_len 48 -> 96"), ("all-L2-S64", "overrides.sel_backend")):
        assert set(cases[name]["ratios"].values()) == {None}
        assert cases[name]["not_comparable"]["peak_memory"].startswith("different shapes: ")
        assert why in cases[name]["not_comparable"]["tokens_per_s"]


@pytest.mark.parametrize(
    ("a", "b", "fields", "apart"),
    [
        pytest.param({"timed_steps": 3}, {"timed_steps": 3}, ["alloc_conf", "stall"], set(), id="same"),
        pytest.param({"timed_steps": 0}, {"timed_steps": 3}, [], {"step_time", "tokens_per_s"}, id="warm-up"),
        pytest.param({"timed_steps": None}, {"timed_steps": None}, [], set(), id="a-watched-job"),
        pytest.param({}, {}, ["dtype"], set(RATIOS), id="dtype"),
        pytest.param({}, {}, ["overrides.gc"], set(RATIOS), id="gc"),
        pytest.param({"device": "cpu"}, {"device": "cuda:0"}, [], set(RATIOS), id="device"),
    ],
)  # fmt: skip
def test_not_comparable(a: dict[str, Any], b: dict[str, Any], fields: list[str], apart: set[str]) -> None:
    differences = [{"field": field, "a": 1, "b": 2} for field in fields]
    assert set(not_comparable(a, b, differences)) == apart


@pytest.mark.parametrize(
    ("a", "b", "change"),
    [
        pytest.param(("pass", None, True), ("pass", None, True), SAME, id="same"),
        pytest.param(("pass", None, True), ("hang", "gil-held", False), WORSE, id="pass-hang"),
        pytest.param(("oom", None, False), ("pass", None, True), BETTER, id="oom-pass"),
        pytest.param(("hang", "python-busy", False), ("hang", "gil-held", False), CHANGED, id="hang-kind"),
        pytest.param(("hang", None, False), ("crash", None, False), CHANGED, id="hang-crash"),
        pytest.param(("pass", None, True), ("skipped", None, False), NOT_COMPARABLE, id="skipped"),
        pytest.param(("pass", None, True), (None, None, False), NOT_COMPARABLE, id="no-result"),
        pytest.param(("pass", None, True), ("not run", None, False), NOT_COMPARABLE, id="not-run"),
        # issue 26: B's check did not run: whether B got worse is not known
        pytest.param(("pass", None, True), ("unchecked", None, False), NOT_COMPARABLE, id="unchecked"),
        # selftest: a detected fault is ok; missing it is worse, although the verdict "passes"
        pytest.param(("hang", "python-deadlock", True), ("pass", None, False), WORSE, id="selftest-miss"),
    ],
)
def test_verdict_change(a: tuple[Any, ...], b: tuple[Any, ...], change: str) -> None:
    def side(values: tuple[Any, ...]) -> dict[str, Any]:
        return dict(zip(("verdict", "hang_kind", "ok"), values, strict=True))

    assert verdict_change(side(a), side(b)) == change


@pytest.mark.slow  # `runs` makes real run folders: 2 min under make test's load (hand-built ones stay)
def test_compare_bad_input_exits_2(runs: dict[str, Path], tmp_path: Path) -> None:
    for args in (
        [runs["scale"], tmp_path / "missing"],
        [tmp_path, runs["scale"]],
        [runs["scale"], runs["hang"], "--out", tmp_path],
    ):
        done = nsa_diag("compare", *args)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
