"""The case commands: run, branch, backend, selftest, schema.

Bad input must end in one line on stderr, exit code 2 and no run folder; those tests run the real CLI in
a subprocess. Options -> specs, replay command lines and rendering are tested in-process on hand-made
results. The end-to-end tests run real workers on the tiny CPU default (seconds each).
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from diag_cli import run_cli as run_cli_subprocess

from nsa_diag import _cli_utils as cli
from nsa_diag.app import run_cli
from nsa_diag.cases import (
    SELFTEST_KINDS,
    backend_specs,
    branch_specs,
    build_spec,
    parse_backend_list,
    replay_argv,
    selftest_specs,
)
from nsa_diag.errors import EXIT_ABORTED, EXIT_USAGE, UsageError
from nsa_diag.render import LiveProgress, render_summary, summary_markdown, write_summary
from nsa_diag.session import build_summary
from nsa_diag.spec import CaseResult, CaseSpec, Where

CLI_TIMEOUT_S = 180
SRC = Path(__file__).resolve().parents[2] / "src"


def run_nsa_diag(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_cli_subprocess(*args, cwd=cwd, timeout=CLI_TIMEOUT_S, env=env)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# --- bad input: one line, exit 2, nothing written ---------------------------------------------------------


BAD_INPUTS = [
    pytest.param(["run", "--bogus"], "No such option: --bogus", id="unknown-flag"),
    pytest.param(["run", "--inject", "bogus"], "--inject 'bogus'", id="inject-kind"),
    pytest.param(["run", "--inject", "deadlock:layer"], "must be key=value", id="inject-syntax"),
    pytest.param(["run", "--inject", "deadlock:layer=9"], "layers are 0..1", id="inject-layer"),
    pytest.param(["run", "--inject", "nan:phase=recompute"], "checkpointed", id="inject-recompute"),
    pytest.param(["run", "--inject", "skip-collective"], "ddp", id="skip-collective"),
    pytest.param(["run", "--inject", "exit:step=3", "--steps", "2"], "never comes", id="inject-step"),
    pytest.param(["branch", "--heads", "3"], "heads=3 must be divisible", id="geometry-heads"),
    pytest.param(["run", "--block-stride", "3"], "block_stride=3", id="geometry-stride"),
    pytest.param(["run", "--gc", "2:1"], "gc='2:1'", id="gc-range"),
    pytest.param(["run", "--prefill", "sequential", "--gc", "all"], "prefill='sequential'", id="gc-prefill"),
    pytest.param(["run", "--dtype", "fp8"], "fp8", id="dtype"),
    pytest.param(["run", "--seq-len", "1"], "at least 2 tokens", id="seq-len"),
    pytest.param(["run", "--model", "no_such_pkg.models:build"], "cannot import no_such_pkg", id="model"),
    pytest.param(["run", "--model", "json:no_such_factory"], "no attribute", id="model-attr"),
    pytest.param(["run", "--model", "json"], "pkg.module:factory", id="model-syntax"),
    pytest.param(["backend", "--sel", "masked,fast"], "fast not a sel backend", id="backend-list"),
    pytest.param(["branch", "--branch", "sel"], "No such option: --branch", id="branch-has-no-branch"),
    pytest.param(["selftest", "--kinds", "deadlock,hiccup"], "hiccup", id="selftest-kind"),
    pytest.param(["selftest", "--inject", "nan"], "No such option: --inject", id="selftest-inject"),
    pytest.param(  # issue 26: a check that cannot run here is refused, not passed as "skipped"
        ["selftest", "--kinds", "gpu-spin", "--device", "cpu"],
        "it would check nothing",
        id="selftest-gpu-spin",
    ),
    pytest.param(["run", "--tag", "../x"], "--tag", id="tag"),
    pytest.param(["run", "--stall", "0"], "--stall 0", id="stall"),
    pytest.param(
        ["run", "--sel", "triton", "--device", "cpu"], "--sel triton: the Triton kernels need", id="triton"
    ),
    pytest.param(["run", "--memory-snapshot", "--device", "cpu"], "--memory-snapshot: ", id="snapshot-cpu"),
    pytest.param(["ddp", "--memory-snapshot", "--device", "cpu"], "--memory-snapshot: ", id="snapshot-ddp"),
]


@pytest.mark.parametrize(("args", "says"), BAD_INPUTS)
def test_bad_input_is_one_line_exit_2_and_no_run_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    out = tmp_path / "runs"
    assert run_cli([*args, "--out", str(out)]) == EXIT_USAGE
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("nsa-diag: ")
    assert says in lines[0]
    assert captured.out == ""
    assert not out.exists()


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["run", "--bogus"], id="unknown-flag"),
        # refusals of option values, as `model`'s below (each a torch import, ~3 s of CPU): make test-slow;
        # test_bad_input_is_one_line_exit_2_and_no_run_folder refuses the same values in process
        pytest.param(["run", "--inject", "deadlock:layer=x"], id="inject", marks=pytest.mark.slow),
        pytest.param(["branch", "--kv-heads", "3"], id="geometry", marks=pytest.mark.slow),
        pytest.param(["run", "--model", "no_such_pkg.models:build"], id="model"),
    ],
)
def test_bad_input_from_the_shell(tmp_path: Path, args: list[str]) -> None:
    """The same through a real process: exit status, stderr and stdout as a shell sees them."""
    out = tmp_path / "runs"
    done = run_nsa_diag(*args, "--out", str(out))
    assert done.returncode == EXIT_USAGE, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    assert not out.exists()


def test_device_cuda_without_a_gpu_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if _cuda():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "runs"
    # in process, as the bad inputs above: refused before any case (the shell's view: test_bad_input_from_
    # the_shell)
    code = run_cli(["run", "--device", "cuda", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert err.strip().splitlines() == [
        "nsa-diag: --device cuda: torch sees no CUDA device here; use --device cpu or auto"
    ]
    assert not out.exists()


@pytest.mark.parametrize("command", ["run", "branch", "backend", "selftest", "schema"])
def test_every_command_has_help_with_examples_without_torch(command: str) -> None:
    code = (
        "import sys; from nsa_diag.app import run_cli; "
        f"code = run_cli([{command!r}, '--help']); print(code, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env={
            **os.environ,
            "COLUMNS": "200",
            "PYTHONPATH": os.pathsep.join(filter(None, (str(SRC), os.environ.get("PYTHONPATH")))),
        },
        check=True,
    )
    assert "Examples" in done.stdout
    assert f"nsa-diag {command}" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "0 False"


# --- choices, options -> specs, replay ----------------------------------------------------------------------


def test_choices_match_nsa_core() -> None:
    import nsa_core

    triton = nsa_core.TRITON_BACKENDS
    assert tuple(b.value for b in cli.SelBackend) == nsa_core.SEL_BACKENDS + triton
    assert tuple(b.value for b in cli.CmpBackend) == nsa_core.CMP_BACKENDS + triton
    assert tuple(b.value for b in cli.WinBackend) == nsa_core.WIN_BACKENDS + triton
    assert tuple(p.value for p in cli.Prefill) == nsa_core.PREFILL_MODES
    assert tuple(p.value for p in cli.Preset) == tuple(nsa_core.PRESETS)
    assert tuple(b.value for b in cli.Branch if b is not cli.Branch.all) == nsa_core.BRANCHES


@pytest.mark.parametrize(("preset", "seq_len"), [("tiny", 128), ("small", 512), ("m7c-125m", 2048)])
def test_default_seq_len_makes_selection_sparse(preset: str, seq_len: int) -> None:
    spec = build_spec(cli.CaseOptions(preset=cli.Preset(preset)))
    assert spec.seq_len == seq_len
    nsa = spec.nsa_config().nsa
    assert spec.seq_len > nsa.n_sel * nsa.sel_block_len
    assert spec.seq_len > nsa.window


def test_options_become_overrides_and_fields() -> None:
    options = cli.CaseOptions(
        device=cli.Device.cpu,
        layers=3,
        window=16,
        sel=cli.SelBackend.packed,
        branch=cli.Branch.win,
        gc="1:3",
        gc_reentrant=True,
        seq_len=96,
        dtype=cli.Dtype.bf16,
        inject=("deadlock:layer=2,phase=recompute",),
        stall=4,
    )
    spec = build_spec(options, name="x")
    assert spec.overrides == {
        "layers": 3,
        "window": 16,
        "sel_backend": "packed",
        "force_branch": "win",
        "gc": "1:3",
        "gc_reentrant": True,
    }
    assert (spec.name, spec.seq_len, spec.dtype, spec.stall) == ("x", 96, "bf16", 4)
    assert [str(inj) for inj in spec.inject] == ["deadlock:layer=2,phase=recompute"]
    cfg = spec.nsa_config()
    assert cfg.nsa.branches == ("win",)
    assert list(cfg.gc_layers) == [1, 2]


def test_branch_cases_force_each_branch_then_all() -> None:
    specs = branch_specs(cli.CaseOptions())
    assert [s.name for s in specs] == ["cmp", "sel", "win", "all"]
    assert [s.nsa_config().nsa.branches for s in specs] == [
        ("cmp",),
        ("sel",),
        ("win",),
        ("cmp", "sel", "win"),
    ]


def test_backend_cases_default_to_every_non_reference_backend_with_reference_check() -> None:
    specs = backend_specs(cli.CaseOptions(device=cli.Device.cpu), {})
    assert [s.name for s in specs] == [
        "sel-masked",
        "sel-gather",
        "sel-packed",
        "cmp-masked",
        "win-masked",
        "win-chunked",
    ]
    assert all(s.reference_check for s in specs)
    sel_packed = specs[2].nsa_config().nsa
    assert (sel_packed.sel_backend, sel_packed.branches) == ("packed", ("sel",))


def test_cuda_cases_run_triton_where_no_backend_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import nsa_diag.cases as cases

    monkeypatch.setattr(cases, "cuda_available", lambda: True)
    spec = build_spec(cli.CaseOptions(), name="x")  # --device auto on a CUDA machine
    assert spec.overrides == {"sel_backend": "triton", "cmp_backend": "triton", "win_backend": "triton"}
    spec = build_spec(cli.CaseOptions(sel=cli.SelBackend.masked, device=cli.Device.cuda), name="x")
    assert spec.overrides == {"sel_backend": "masked", "cmp_backend": "triton", "win_backend": "triton"}
    assert build_spec(cli.CaseOptions(device=cli.Device.cpu), name="x").overrides == {}
    names = [s.name for s in backend_specs(cli.CaseOptions(), {})]
    assert names == [
        "sel-masked", "sel-gather", "sel-packed", "sel-triton", "cmp-masked", "cmp-triton",
        "win-masked", "win-chunked", "win-triton",
    ]  # fmt: skip
    cpu_names = [s.name for s in backend_specs(cli.CaseOptions(device=cli.Device.cpu), {})]
    assert "sel-triton" not in cpu_names


@pytest.mark.slow
def test_triton_backends_run_in_the_interpreter_on_the_cpu(tmp_path: Path) -> None:
    """`--sel/--cmp/--win triton` end to end in Triton's CPU interpreter, checked against the reference;
    the layers run the fused op, whose branch hooks give `--branch-marks` each branch's backward start in
    the op's order (selection, window, compression)."""
    pytest.importorskip("triton")
    out = tmp_path / "runs"
    args = [
        "run",
        "--sel",
        "triton",
        "--cmp",
        "triton",
        "--win",
        "triton",
        "--device",
        "cpu",
        "--seq-len",
        "40",
        "--branch-marks",
    ]
    done = run_nsa_diag(
        *args, "--reference-check", "--out", str(out), "--json", env={"TRITON_INTERPRET": "1"}
    )
    assert done.returncode == 0, done.stderr
    (case,) = json.loads(done.stdout)["cases"]
    assert case["verdict"] == "pass"
    assert case["parity"]["grad_rel_err_max"] <= case["parity"]["tolerance"]
    progress = _only_run_dir(out) / case["dir"] / "progress.jsonl"
    events = [json.loads(line) for line in progress.read_text().splitlines()]
    marks = [
        (e["layer"], e["branch"], e["module"])
        for e in events
        if e["step"] == 1 and e["phase"] == "backward" and e["branch"] is not None
    ]
    assert marks[:3] == [(1, b, f"blocks.1.attn.branch_out.{b}") for b in ("sel", "win", "cmp")]


def test_backend_lists_choose_the_cases() -> None:
    lists = {
        "sel": parse_backend_list("sel", "masked, gather,masked"),
        "win": parse_backend_list("win", "reference"),
    }
    assert [s.name for s in backend_specs(cli.CaseOptions(), lists)] == [
        "sel-masked",
        "sel-gather",
        "win-reference",
    ]
    with pytest.raises(UsageError, match="not a cmp backend"):
        parse_backend_list("cmp", "gather")


def test_selftest_cases_expect_each_verdict() -> None:
    cases = selftest_specs(cli.CaseOptions(stall=3.0), SELFTEST_KINDS, cuda=False)
    by_name = {spec.name: (spec, expected) for spec, expected in cases}
    assert set(by_name) == set(SELFTEST_KINDS)
    for spec, _ in cases:
        (inj,) = spec.inject
        assert (inj.kind, inj.layer, inj.phase, inj.step) == (spec.name, 1, "backward", 1)
    slow, expected = by_name["slow"]
    assert expected.verdict == "slow"
    assert slow.timeout == 6.0
    assert slow.steps * slow.inject[0].seconds >= 4 * slow.timeout  # far too long to finish: slow, not pass
    assert slow.inject[0].seconds < slow.stall  # progress between sleeps: not a hang
    assert (
        by_name["gpu-spin"][1].describe() == "hang / cuda-kernel"
    )  # never expected "skipped": a pass of nothing
    assert by_name["deadlock"][1].describe() == "hang / python-deadlock"
    assert by_name["gil-hog"][1].met_by("hang", "gil-held")
    assert not by_name["gil-hog"][1].met_by("hang", "python-deadlock")
    cuda_cases = {s.name: e for s, e in selftest_specs(cli.CaseOptions(), ["gpu-spin"], cuda=True)}
    assert cuda_cases["gpu-spin"].hang_kind == "cuda-kernel"


def test_selftest_without_cuda_leaves_gpu_spin_out_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: without CUDA the default selftest runs every kind but gpu-spin and says that one was not
    checked (summary.json's `left_out`, the table, the status line); it counted a skipped gpu-spin ok."""
    from nsa_diag.session import Session

    plans = []
    monkeypatch.setattr(Session, "run", lambda self: plans.append(self.plan) or 0)
    assert run_cli(["selftest", "--device", "cpu"]) == 0
    (plan,) = plans
    assert [spec.name for spec in plan.specs()] == [k for k in SELFTEST_KINDS if k != "gpu-spin"]
    assert plan.left_out == {"gpu-spin": "it spins a CUDA kernel; --device cpu"}


def test_unchecked_and_skipped_are_counted_apart(tmp_path: Path) -> None:
    """Issue 26: a case whose check did not run is `unchecked`: not ok (exit 1), counted apart, a JUnit
    failure; a case skipped here that met its expectation says "skipped", not "yes", and "all ok" says so."""
    import xml.etree.ElementTree as ET

    from rich.console import Console

    from nsa_diag.junit import junit_xml

    why = "reference check not run: the reference would not fit, at the case's size nor smaller: ..."
    parity = {"checked": False, "why": "the reference would not fit"}
    results = [_result("sel-masked", "pass"), _result("sel-triton", "unchecked", reason=why, parity=parity)]
    specs = [CaseSpec(name=r.name) for r in results]
    summary = build_summary("backend", tmp_path, specs, results, started_at=0.0)
    assert (summary.ok, summary.exit_code, summary.counts) == (False, 1, {"pass": 1, "unchecked": 1})
    assert summary.status() == "not all ok; 1 check(s) did not run"
    buffer = io.StringIO()
    render_summary(summary, Console(file=buffer, width=220, color_system=None))
    text = buffer.getvalue()
    assert "not run" in text  # the parity cell
    assert f"sel-triton: {why}" in text
    assert "1 pass, 1 unchecked (not all ok; 1 check(s) did not run)" in text
    assert "- result: not all ok; 1 check(s) did not run, exit code 1" in summary_markdown(summary)
    suite = ET.fromstring(junit_xml("backend", results)).find("testsuite")
    assert suite is not None
    assert (suite.get("failures"), suite.get("skipped")) == ("1", "0")
    failure = suite.find("testcase[@name='sel-triton']/failure")
    assert failure is not None
    assert failure.get("type") == "unchecked"

    from nsa_diag.cases import Expectation

    skipped = [_result("gpu", "skipped", reason="needs CUDA"), _result("nan", "nonfinite")]
    expected = {"gpu": Expectation("gpu", "skipped"), "nan": Expectation("nan", "nonfinite")}
    summary = build_summary(
        "matrix", tmp_path, [CaseSpec(name=r.name) for r in skipped], skipped, started_at=0.0,
        expectations=expected,
    )  # fmt: skip
    assert summary.exit_code == 0  # a matrix case skipped for want of a GPU is ok (README), and said so
    assert summary.status() == "all ok; 1 skipped here"
    buffer = io.StringIO()
    render_summary(summary, Console(file=buffer, width=220, color_system=None))
    (gpu_row,) = [line for line in buffer.getvalue().splitlines() if line.startswith("│ gpu")]
    assert "skipped" in gpu_row.split("│")[5]  # the ok column
    assert "yes" not in gpu_row
    assert "| gpu | skipped | skipped | - | skipped |" in summary_markdown(summary)


def test_replay_argv_names_what_differs(tmp_path: Path) -> None:
    options = cli.CaseOptions(
        sel=cli.SelBackend.masked,
        branch=cli.Branch.sel,
        gc="all",
        gc_reentrant=True,
        steps=2,
        inject=("slow:seconds=0.5,step=2",),
        reference_check=True,
        alloc_conf="expandable_segments:True",
    )
    argv = replay_argv(build_spec(options, name="sel-masked"), tmp_path)
    assert argv[:4] == [sys.executable, "-m", "nsa_diag", "run"]
    text = " ".join(argv)
    for part in (
        "--name sel-masked",
        "--sel masked",
        "--branch sel",
        "--gc all",
        "--gc-reentrant",
        "--steps 2",
        "--seq-len 128",
        "--stall auto",
        "--inject slow:step=2,seconds=0.5",
        "--reference-check",
        "--alloc-conf expandable_segments:True",
        f"--out {tmp_path.resolve()}",
    ):
        assert part in text
    assert "--dtype" not in text  # the default is left out


# --- schema -------------------------------------------------------------------------------------------------


def test_schema_prints_the_case_spec_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "CaseSpec"
    assert schema["additionalProperties"] is False
    assert {"seq_len", "stall", "timeout", "inject", "overrides"} <= set(schema["properties"])
    assert run_cli(["schema", "result"]) == 0
    assert "verdict" in json.loads(capsys.readouterr().out)["properties"]


# --- rendering from hand-made results ---------------------------------------------------------------------


def _result(name: str, verdict: str, **fields: object) -> CaseResult:
    return CaseResult(
        name=name,
        spec_hash="0" * 16,
        verdict=verdict,
        reason=fields.pop("reason", f"{name} {verdict}"),
        **fields,
    )  # type: ignore[arg-type]


def _results() -> list[CaseResult]:
    ok_metrics = {
        "tokens_per_s": 12345.6,
        "loss": [5.61, 5.52],
        "peak_memory": {"cpu_peak_rss_bytes": 300 * 2**20},
    }
    return [
        _result("cmp", "pass", elapsed_s=2.5, metrics=ok_metrics, device="cpu"),
        _result(
            "sel",
            "hang",
            hang_kind="python-deadlock",
            where=Where(phase="backward", step=1, layer=1, branch="sel"),
            reason="no progress for 5.0 s at layer 1 backward (step 1); blocked in threading lock acquire",
            elapsed_s=9.0,
        ),
        _result(
            "win",
            "mismatch",
            parity={
                "loss_rel_err": 2e-3,
                "grad_rel_err_max": 0.5,
                "worst_param": "blocks.0.attn.kv_win.weight",
            },
        ),
    ]


STACK_SAMPLE = """=== stack sample 1 at 2026-01-01T00:00:00+00:00
Thread 0x00007f0000000001 (most recent call first):
  File "/x/threading.py", line 1045 in _bootstrap_inner
  File "/x/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/x/nsa_diag/worker/inject.py", line 70 in _deadlock_lock_acquire
  File "/x/nsa_diag/worker/train.py", line 310 in _backward
  File "/x/nsa_diag/worker/__main__.py", line 8 in <module>
"""


def test_summary_counts_and_exit_code(tmp_path: Path) -> None:
    (tmp_path / "cases/sel").mkdir(parents=True)
    (tmp_path / "cases/sel/stacks.txt").write_text(STACK_SAMPLE)
    specs = [CaseSpec(name=n) for n in ("cmp", "sel", "win", "all")]
    summary = build_summary("branch", tmp_path, specs, _results(), started_at=0.0)
    assert summary["counts"] == {"pass": 1, "hang": 1, "mismatch": 1}
    assert summary["not_run"] == ["all"]
    assert (summary["ok"], summary["exit_code"]) == (False, 1)
    cmp, sel, _ = summary["cases"]
    assert (cmp["tokens_per_s"], cmp["loss"], cmp["peak_memory_bytes"]) == (12345.6, 5.52, 300 * 2**20)
    assert sel["where"] == "layer 1 backward (branch sel) step 1"
    assert sel["replay"] == "cases/sel/replay.sh"
    assert sel["stack"] == [
        "inject.py:70 in _deadlock_lock_acquire",
        "train.py:310 in _backward",
        "__main__.py:8 in <module>",
    ]
    assert "stack" not in cmp  # a passing case has no stack samples

    passing = build_summary("run", tmp_path, specs[:1], _results()[:1], started_at=0.0)
    assert (passing["ok"], passing["exit_code"]) == (True, 0)
    interrupted = build_summary("run", tmp_path, specs[:1], [], started_at=0.0, interrupted=True)
    assert interrupted["exit_code"] == EXIT_ABORTED

    write_summary(tmp_path, summary)
    assert json.loads((tmp_path / "summary.json").read_text())["counts"] == summary["counts"]
    markdown = (tmp_path / "summary.md").read_text()
    assert markdown == summary_markdown(summary)
    assert "| sel | hang | python-deadlock | layer 1 backward (branch sel) step 1 |" in markdown
    assert "`cases/sel/replay.sh`" in markdown
    assert "  inject.py:70 in _deadlock_lock_acquire" in markdown


def test_table_shows_verdicts_reasons_and_parity(tmp_path: Path) -> None:
    from rich.console import Console

    specs = [CaseSpec(name=n) for n in ("cmp", "sel", "win")]
    summary = build_summary("backend", tmp_path, specs, _results(), started_at=0.0)
    buffer = io.StringIO()
    render_summary(summary, Console(file=buffer, width=220, color_system=None))
    text = buffer.getvalue()
    for part in (
        "python-deadlock",
        "12,346",
        "5.5200",
        "300.0 MiB",
        "loss 2.0e-03 · grad 5.0e-01",
        "mismatch",
    ):
        assert part in text
    assert "blocked in threading lock acquire" in text
    assert f"reproduce sel: {tmp_path / 'cases/sel/replay.sh'}" in text


def test_selftest_table_marks_misses(tmp_path: Path) -> None:
    from rich.console import Console

    cases = selftest_specs(cli.CaseOptions(stall=3.0), ["deadlock", "nan"], cuda=False)
    results = [
        _result("deadlock", "hang", hang_kind="python-busy"),
        _result("nan", "nonfinite", nonfinite={"where": "loss", "module": "blocks.1", "step": 1}),
    ]
    summary = build_summary(
        "selftest",
        tmp_path,
        [s for s, _ in cases],
        results,
        started_at=0.0,
        expectations={s.name: e for s, e in cases},
    )
    assert [c["ok"] for c in summary["cases"]] == [False, True]
    assert summary["cases"][1]["where"] == "blocks.1 (loss) step 1"  # the first non-finite module
    assert summary["exit_code"] == 1
    buffer = io.StringIO()
    render_summary(summary, Console(file=buffer, width=220, color_system=None))
    assert "hang / python-deadlock" in buffer.getvalue()
    assert "NO" in buffer.getvalue()


def test_live_progress_off_a_terminal_prints_one_line_per_start_and_end() -> None:
    from rich.console import Console

    from nsa_diag.beacon import BeaconState

    buffer = io.StringIO()
    specs = [CaseSpec(name="cmp", stall=3)]
    state = BeaconState(1, 0.0, 1, 1, "backward", "sel", "begin", 1, 1, 0.0, None)
    with LiveProgress(Console(file=buffer, width=200, color_system=None), specs) as live:
        live.case_start(specs[0])
        live.progress(state, 1.5)
        live.case_end(_result("cmp", "pass", elapsed_s=1.5))
    assert buffer.getvalue().splitlines() == [
        "[1/1] cmp: running (stall 3 s, timeout 300 s)",
        "[1/1] cmp: pass in 1.5 s",
    ]


def test_matrix_progress_off_a_terminal_prints_one_line_per_start_and_end() -> None:
    from rich.console import Console

    from nsa_diag.matrix import MatrixCase
    from nsa_diag.session.matrix import MatrixProgress

    buffer = io.StringIO()
    case = MatrixCase(CaseSpec(name="seq_len=2048", stall="auto"))
    with MatrixProgress(Console(file=buffer, width=200, color_system=None), 2, already=1) as live:
        live.start(case, "0")
        live.update(case.name, None, 0.5)
        live.end(_result(case.name, "hang", elapsed_s=12.0, hang_kind="python-deadlock"))
    assert buffer.getvalue().splitlines() == [
        "[2/2] seq_len=2048: running on GPU 0 (stall auto, timeout 300 s)",
        "[2/2] seq_len=2048: hang (python-deadlock) in 12.0 s",
    ]


def test_live_displays_on_a_terminal_redraw_and_stop() -> None:
    """On a terminal both displays run a transient rich Live: updated while cases run, gone after."""
    from rich.console import Console

    from nsa_diag.beacon import BeaconState
    from nsa_diag.matrix import MatrixCase
    from nsa_diag.session.matrix import MatrixProgress

    state = BeaconState(1, 0.0, 1, 1, "backward", "sel", "begin", 1, 1, 0.0, None)
    spec = CaseSpec(name="cmp", stall=3)
    buffer = io.StringIO()
    console = Console(file=buffer, width=200, force_terminal=True, color_system=None)
    with LiveProgress(console, [spec]) as live:
        assert live.live
        live.case_start(spec)
        live.progress(state, 1.5)
        live.case_end(_result("cmp", "pass", elapsed_s=1.5))
    assert not live.live
    assert "[1/1] cmp: pass in 1.5 s" in buffer.getvalue()
    buffer = io.StringIO()
    console = Console(file=buffer, width=200, force_terminal=True, color_system=None)
    with MatrixProgress(console, 1) as matrix:
        assert matrix.live
        matrix.start(MatrixCase(spec), None)
        matrix.update("cmp", state, 0.5)
        matrix.end(_result("cmp", "pass", elapsed_s=0.5))
    assert not matrix.live
    assert "[1/1] cmp: pass in 0.5 s" in buffer.getvalue()


# --- end to end: real workers on the tiny CPU default ------------------------------------------------------


def _only_run_dir(out: Path) -> Path:
    (run_dir,) = out.iterdir()
    return run_dir


# make test-slow: make test runs `nsa-diag run` end to end in test_readme (the README's example: exit 0,
# "1 pass (all ok)", then report on its folder), test_cli (the console script, every artifact read for
# secrets) and test_runner (result.json of a passing case)
@pytest.mark.slow
def test_run_passes_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    done = run_nsa_diag("run", "--device", "cpu", "--steps", "2", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["command"], summary["ok"], summary["exit_code"]) == ("run", True, 0)
    (case,) = summary["cases"]
    assert (case["name"], case["verdict"], case["steps_done"]) == ("case", "pass", 2)
    assert case["tokens_per_s"] > 0
    run_dir = _only_run_dir(out)
    assert run_dir.name.endswith("-run")
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    for name in ("summary.md", "env.json", "cases/case/spec.json", "cases/case/result.json"):
        assert (run_dir / name).is_file(), name
    result = CaseResult.model_validate_json((run_dir / "cases/case/result.json").read_text())
    assert result.verdict == "pass"
    assert "[1/1] case: pass" in done.stderr  # the progress lines (stderr is not a terminal here)


@pytest.mark.slow
def test_branch_runs_four_passing_cases_and_replay_reproduces_one(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    done = run_nsa_diag("branch", "--device", "cpu", "--out", str(out), "--tag", "demo")
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout
    for name in ("cmp", "sel", "win", "all"):
        assert f"│ {name} " in table
    assert table.count("│ pass ") == 4
    run_dir = _only_run_dir(out)
    assert run_dir.name.endswith("-branch-demo")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["counts"] == {"pass": 4}
    original = CaseSpec.model_validate_json((run_dir / "cases/sel/spec.json").read_text())
    assert original.nsa_config().nsa.branches == ("sel",)

    replay = run_dir / "cases/sel/replay.sh"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(SRC), os.environ.get("PYTHONPATH")))),
        "COLUMNS": "200",
    }
    again = subprocess.run(
        [str(replay)], capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S, check=False
    )
    assert again.returncode == 0, again.stderr
    (replay_dir,) = (path for path in out.iterdir() if path != run_dir)
    replayed = CaseSpec.model_validate_json((replay_dir / "cases/sel/spec.json").read_text())
    assert replayed.spec_hash() == original.spec_hash()


@pytest.mark.slow
def test_replay_of_a_model_case_runs_from_any_directory(tmp_path: Path) -> None:
    # The user's project: a --model module in the working directory, paths with spaces; replay.sh is run
    # from elsewhere with neither that directory nor src on PYTHONPATH, and no GPU pinning of its own.
    project = tmp_path / "my project"
    project.mkdir()
    shutil.copy(Path(__file__).with_name("diag_user_model.py"), project / "my_models.py")
    out = tmp_path / "runs dir"
    done = run_nsa_diag(
        "run", "--model", "my_models:build", "--steps", "1", "--device", "cpu", "--out", str(out),
        cwd=project, env={"CUDA_VISIBLE_DEVICES": "7"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = _only_run_dir(out)
    replay = run_dir / "cases/case/replay.sh"
    lines = replay.read_text().splitlines()
    assert f"cd {shlex.quote(str(project.resolve()))}" in lines
    assert any(line.startswith("export PYTHONPATH=") and str(SRC) in line for line in lines)
    assert "export CUDA_VISIBLE_DEVICES=7" in lines
    assert "export PYTHONSAFEPATH=1" in lines
    assert shlex.quote(str(out.resolve())) in lines[-1]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    again = subprocess.run(
        [str(replay)], capture_output=True, text=True, cwd=elsewhere, env=env, timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    (replay_dir,) = (path for path in out.iterdir() if path != run_dir)
    original = CaseSpec.model_validate_json((run_dir / "cases/case/spec.json").read_text())
    replayed = CaseSpec.model_validate_json((replay_dir / "cases/case/spec.json").read_text())
    assert replayed.spec_hash() == original.spec_hash()
    assert list(elsewhere.iterdir()) == []


# 10 s of CPU and a stall waited out: make test-slow. test_runner.py's deadlock test runs the same case
# (verdict, hang kind, layer 1 backward, the stack samples), test_watch.py's deadlock test the CLI's table
# of a hang with its main thread's last stack sample, and test_summary_counts_and_exit_code above a run's
# exit code and summary for one
@pytest.mark.slow
def test_run_reports_a_deadlock_as_a_hang_with_where(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    done = run_nsa_diag(
        "run", "--device", "cpu", "--inject", "deadlock:layer=1", "--stall", "3", "--out", str(out)
    )
    assert done.returncode == 1, done.stderr
    assert "hang" in done.stdout
    assert "python-deadlock" in done.stdout
    assert "layer 1 backward" in done.stdout
    assert "in _deadlock_lock_acquire" in done.stdout  # the main thread's frames from the stack sample
    assert "reproduce case:" in done.stdout
    result = json.loads((_only_run_dir(out) / "cases/case/result.json").read_text())
    assert (result["verdict"], result["hang_kind"]) == ("hang", "python-deadlock")


@pytest.mark.slow
def test_selftest_subset_is_all_correct(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    done = run_nsa_diag(
        "selftest", "--kinds", "nan,exit,unused-param", "--device", "cpu", "--out", str(out), "--json"
    )
    summary = json.loads(done.stdout)
    assert done.returncode == 0, json.dumps(summary["cases"], indent=1)
    assert [(c["name"], c["verdict"], c["ok"]) for c in summary["cases"]] == [
        ("nan", "nonfinite", True),
        ("exit", "crash", True),
        ("unused-param", "grad-missing", True),
    ]


def test_backend_whose_reference_fits_nowhere_is_unchecked_not_pass(tmp_path: Path) -> None:
    """Issue 26: `backend` on a GPU the training step fills said `sel-triton pass ... reference check NOT
    run`, exit 0. A worker that sees no memory free for the check (diag_planted:no_room_lm) stands in."""
    out, junit = tmp_path / "runs", tmp_path / "backend.xml"
    done = run_cli_subprocess(
        "backend", "--model", "diag_planted:no_room_lm", "--sel", "gather", "--device", "cpu",
        "--out", str(out), "--junit", str(junit), timeout=CLI_TIMEOUT_S, planted=True,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "sel-gather: reference check not run: the reference would not fit" in done.stdout
    assert "1 unchecked (not all ok; 1 check(s) did not run)" in done.stdout
    assert " pass" not in done.stdout
    result = json.loads((_only_run_dir(out) / "cases/sel-gather/result.json").read_text())
    assert (result["verdict"], result["steps_done"], result["parity"]["checked"]) == ("unchecked", 1, False)
    summary = json.loads((_only_run_dir(out) / "summary.json").read_text())
    assert (summary["counts"], summary["exit_code"]) == ({"unchecked": 1}, 1)
    assert '<failure type="unchecked"' in junit.read_text()


@pytest.mark.slow  # 20 s; test_backend_whose_reference_fits_nowhere_is_unchecked_not_pass stays
def test_backend_checks_parity_against_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    done = run_nsa_diag("backend", "--win", "masked", "--device", "cpu", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    (case,) = json.loads(done.stdout)["cases"]
    assert (case["name"], case["verdict"]) == ("win-masked", "pass")
    parity = case["parity"]
    assert parity["grad_rel_err_max"] <= parity["tolerance"]
    spec = CaseSpec.model_validate_json((_only_run_dir(out) / "cases/win-masked/spec.json").read_text())
    assert spec.reference_check
    assert spec.overrides == {"force_branch": "win", "win_backend": "masked"}
