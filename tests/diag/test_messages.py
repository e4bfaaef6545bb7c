"""Messages a user can trust (issue 26): each message that said what the user did not do, hid the cause or
lost its text is read here as the user reads it.

In process (the CLI's own `run_cli`) wherever the message comes before any case runs; the `--model`
refusals on canned pre-flight facts (`check_model_facts`, the pre-flight itself is tested in
test_user_model.py); `watch` on a command that cannot start (it ends at once). The hang's stack frames
under `watch` are read in test_watch.py's deadlock test, which runs the job anyway.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from diag_cli import run_cli as run_cli_process

from nsa_diag import artifacts
from nsa_diag.app import app, run_cli
from nsa_diag.cases import check_model_facts
from nsa_diag.commands.verify import PROPERTIES, verify
from nsa_diag.errors import EXIT_INTERNAL, EXIT_USAGE, UsageError
from nsa_diag.spec import CaseResult, CaseSpec, ModelFacts, Where

RECORDED = Path(__file__).resolve().parent / "recorded"
MODEL = "mypkg.models:build"

# What the pre-flight finds of three kinds of model: a plain nn.Module, one that holds nsa_core
# NSAAttention modules, an nsa_core.TinyLM (which checkpoints itself).
PLAIN = ModelFacts(model=MODEL, type="PlainLM", layers_attr="layers", layers=2, vocab=64)
WITH_NSA = PLAIN.model_copy(update={"type": "NSAUserLM", "nsa_layers": [0, 1]})
TINYLM = PLAIN.model_copy(update={"type": "TinyLM", "nsa_layers": [0, 1], "self_checkpointing": True})


def _refusal(spec: CaseSpec, facts: ModelFacts, command: str | None = None) -> str:
    with pytest.raises(UsageError) as info:
        check_model_facts(spec, facts, command)
    return str(info.value)


# --- --model refusals name what the user asked for ------------------------------------------------------


@pytest.mark.parametrize(
    "command, says",
    [
        pytest.param(
            "branch", "branch with --model mypkg.models:build: it runs each NSA branch alone", id="branch"
        ),
        pytest.param("scale --per-branch", "scale --per-branch with --model", id="scale-per-branch"),
    ],
)
def test_a_branch_the_command_forced_is_said_as_the_commands(command: str, says: str) -> None:
    # before: "--branch cmp: set nsa_core's NSA attention, ... leave them out", with no --branch given
    message = _refusal(CaseSpec(model=MODEL, overrides={"force_branch": "cmp"}), PLAIN, command)
    assert message.startswith(says), message
    assert "--branch" not in message
    assert "leave them out" not in message
    assert "nsa-diag run --model mypkg.models:build runs the model whole" in message


def test_a_branch_the_user_gave_is_still_said_as_the_flag() -> None:
    message = _refusal(CaseSpec(model=MODEL, overrides={"force_branch": "cmp"}), PLAIN)
    assert message.startswith("--branch cmp: set nsa_core's NSA attention"), message


def test_the_reference_check_names_backend_or_the_flag() -> None:
    spec = CaseSpec(
        model=MODEL, reference_check=True, overrides={"force_branch": "sel", "sel_backend": "gather"}
    )
    assert _refusal(spec, PLAIN, "backend").startswith("backend with --model mypkg.models:build: the check")
    assert _refusal(spec, PLAIN).startswith("--reference-check with --model mypkg.models:build: the check")


def test_verify_without_only_names_the_property_not_an_only_flag() -> None:
    # before: "verify --only backends with --model M: ..." for `verify --model M`
    message = _refusal(CaseSpec(model=MODEL, check="backends"), PLAIN)
    assert message.startswith("verify with --model mypkg.models:build: no property applies to PlainLM"), (
        message
    )
    assert "--only" not in message
    message = _refusal(CaseSpec(model=MODEL, check="causality"), WITH_NSA)
    assert message.startswith("verify's causality property with --model mypkg.models:build:"), message
    assert message.endswith(
        "verify --only backends --model mypkg.models:build checks its NSAAttention modules"
    )
    assert "verify --only backends" not in _refusal(CaseSpec(model=MODEL, check="gc"), PLAIN)


# Which model each --model example of `verify --help` names (its factory's name says which kind it is).
_EXAMPLE_MODELS = {"build_with_nsa_attention": WITH_NSA, "build_tinylm_subclass": TINYLM}


def test_verify_helps_model_examples_are_accepted_for_the_models_they_name() -> None:
    # before: `verify --only causality,prefill --model mypkg.models:build`, refused for any plain model
    lines = [line.strip() for line in (verify.__doc__ or "").splitlines()]
    examples = [
        shlex.split(line) for line in lines if line.startswith("nsa-diag verify") and "--model" in line
    ]
    assert len(examples) == 2, examples
    for argv in examples:
        factory = argv[argv.index("--model") + 1]
        facts = _EXAMPLE_MODELS[factory.rpartition(":")[2]]
        only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else PROPERTIES
        for prop in only:
            check_model_facts(
                CaseSpec(model=factory, check=prop), facts.model_copy(update={"model": factory})
            )


# --- watch: a command that cannot start says why -------------------------------------------------------


def test_watch_of_a_missing_script_quotes_pythons_own_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # before: "exited with code 2 without a result at done", and Python's "can't open file" nowhere
    monkeypatch.chdir(tmp_path)
    code = run_cli(["watch", "--out", str(tmp_path / "runs"), "--json", "--", sys.executable, "nonexist.py"])
    out = capsys.readouterr().out
    assert code == 1, out
    (case,) = json.loads(out)["cases"]
    assert case["verdict"] == "crash"
    assert case["reason"].startswith("exited with code 2 before its first step; its last stderr line: "), case
    assert "can't open file" in case["reason"]
    assert "nonexist.py" in case["reason"]
    assert "without a result" not in case["reason"]


# --- report: a slow case's memory, a watched process's stacks -------------------------------------------


def _watched_slow_run(run_dir: Path) -> None:
    """A run folder as `watch` leaves it for a job past its timeout: the deciding process's stacks under
    procs/pid-<pid>/, the peak memory only in memory_stats.json."""
    case = run_dir / "cases" / "watch"
    (case / "procs" / "pid-4242").mkdir(parents=True)
    (case / "procs" / "pid-4242" / artifacts.STACKS).write_text(
        (RECORDED / "deadlock.faulthandler.txt").read_text()
    )
    artifacts.write_json(case / artifacts.MEMORY_STATS, {"at_hang": {"cpu_peak_rss_bytes": 300 * 2**20}})
    result = CaseResult(
        name="watch",
        spec_hash="0",
        verdict="slow",
        reason="still progressing when the 5 s timeout ran out, at step 2",
        where=Where(phase="forward", step=2),
        evidence={"outcome": "timeout", "stacks_file": "procs/pid-4242/stacks.txt"},
    )
    artifacts.write_json(case / artifacts.RESULT, result)


def test_report_of_a_slow_watched_job_says_at_timeout_and_shows_its_frames(tmp_path: Path) -> None:
    # before: peak memory "(at hang)" for a slow case; no frames for a case whose stacks are a process's
    run_dir = tmp_path / "run"
    _watched_slow_run(run_dir)
    assert run_cli(["report", str(run_dir)]) == 0
    text = (run_dir / "report.md").read_text()
    assert "300.0 MiB (at timeout)" in text
    assert "(at hang)" not in text
    assert "Main thread, last stack sample (`cases/watch/procs/pid-4242/stacks.txt`):" in text
    assert "record_stacks.py:34 in _fault" in text


def test_the_stacks_of_a_verdict_are_its_processes() -> None:
    def result(**evidence: Any) -> CaseResult:
        return CaseResult(name="c", spec_hash="0", verdict="hang", reason="-", evidence=evidence)

    assert result().stacks_file() == "stacks.txt"
    assert result(rank_of_verdict=1).stacks_file() == "ranks/1/stacks.txt"
    assert result(stacks_file="procs/pid-7/stacks.txt").stacks_file() == "procs/pid-7/stacks.txt"


# --- matrix --dry-run: a case's own model ---------------------------------------------------------------


def test_matrix_dry_run_shows_a_cases_own_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # before: model "tiny" for a `model:` case
    path = tmp_path / "mine.yaml"
    path.write_text(
        "cases:\n  - {name: mine, model: 'diag_user_model:build', seq_len: 16}\n  - {name: ours}\n"
    )
    assert run_cli(["matrix", str(path), "--dry-run", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["cases"]}
    assert (rows["mine"]["model"], rows["ours"]["model"]) == ("diag_user_model:build", None)
    assert run_cli(["matrix", str(path), "--dry-run"]) == 0
    table = capsys.readouterr().out
    (mine,) = [line for line in table.splitlines() if "│ mine" in line]
    assert "diag_user_model:build" in mine
    assert "tiny" not in mine


# --- --json: errors as JSON on stdout too ---------------------------------------------------------------


def _json_error(capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], list[str]]:
    captured = capsys.readouterr()
    (line,) = captured.out.strip().splitlines()
    return json.loads(line), captured.err.strip().splitlines()


def test_a_usage_error_with_json_is_a_json_object_on_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before: stdout empty (a script got no JSON)
    assert run_cli(["run", "--json", "--seq-len", "0", "--out", str(tmp_path)]) == EXIT_USAGE
    found, err = _json_error(capsys)
    assert found["exit_code"] == EXIT_USAGE
    assert found["kind"] == "usage"
    assert "--seq-len" in found["error"]
    assert err == [f"nsa-diag: {found['error']}"]
    assert run_cli(["run", "--seq-len", "0", "--out", str(tmp_path)]) == EXIT_USAGE
    assert capsys.readouterr().out == ""  # without --json, stdout stays empty
    # watch's command after -- is the job's, its --json not nsa-diag's
    assert run_cli(["watch", "--keep-alive", "--timeout", "soon", "--", "true", "--json"]) == EXIT_USAGE
    assert capsys.readouterr().out == ""


def test_a_bad_matrix_file_with_json_lists_its_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("defaults: {seq_len: 0}\ncases:\n  - {dtype: fp8}\n")
    assert run_cli(["matrix", str(path), "--json", "--out", str(tmp_path / "runs")]) == EXIT_USAGE
    found, err = _json_error(capsys)
    assert (found["exit_code"], found["kind"]) == (EXIT_USAGE, "config")
    assert found["problems"] == [
        f"{path}:1: defaults.seq_len: Input should be greater than or equal to 1",
        f"{path}:3: cases[0].dtype: Input should be 'fp32', 'bf16' or 'fp16'",
    ]
    assert err[0] == f"nsa-diag: invalid matrix file {path} (2 problem(s)):"
    assert len(err) == 3
    assert not (tmp_path / "runs").exists()


def test_an_internal_error_with_json_is_a_json_object_on_stdout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(**_: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("nsa_diag.evidence.env.collect_env", broken)
    assert run_cli(["env", "--json"]) == EXIT_INTERNAL
    found, err = _json_error(capsys)
    assert found == {
        "error": "internal error: RuntimeError: boom",
        "exit_code": EXIT_INTERNAL,
        "kind": "internal",
    }
    assert err == ["nsa-diag: internal error: RuntimeError: boom (run again with --debug for the traceback)"]


# --- --help: placeholders and flags ---------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"<[A-Za-z][^<>\n]*>")


def _help(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The rendered help, its box drawing and line breaks folded away (a placeholder may wrap)."""
    assert run_cli([*args, "--help"]) == 0
    return " ".join(capsys.readouterr().out.replace("│", " ").split())


def _commands() -> dict[str, Any]:
    group = typer.main.get_command(app)
    return {"": group, **group.commands}  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", list(_commands()))
def test_help_keeps_every_placeholder_and_shows_no_type_for_a_flag(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: `ddp --help` showed "/ddp-" and "ranks//" (Markdown took <out> and <ID> for HTML tags), and
    # every flag "<bool>"
    monkeypatch.setenv("COLUMNS", "200")
    command = _commands()[name]
    sources = [command.help or "", *(getattr(p, "help", None) or "" for p in command.params)]
    placeholders = {found for text in sources for found in _PLACEHOLDER.findall(" ".join(text.split()))}
    shown = _help([name] if name else [], capsys)
    missing = sorted(p for p in placeholders if p not in shown)
    assert not missing, f"{name or 'nsa-diag'} --help lost {missing}: put them in `backticks`"
    assert "<bool>" not in shown
    assert "--help -h Show this message and exit." in shown


def test_ddp_help_shows_its_run_folder_placeholders(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    shown = _help(["ddp"], capsys)
    for text in ("<out>/ddp-<run id>", "ranks/<global rank>/", "<out>/ddp-<ID>", "cases/<name>/ranks/<r>/"):
        assert text in shown, text


def test_a_model_factorys_refusal_withholds_a_secret_on_the_console(tmp_path: Path) -> None:
    """A factory whose error repeats HF_TOKEN's value: the console line (and --json's error object) reads
    ``<withheld>`` as the files would; the rest of the refusal is kept."""
    (tmp_path / "leaky_model.py").write_text(
        "import os\n\n\ndef build(spec):\n"
        "    raise RuntimeError(f\"the hub refused token {os.environ['HF_TOKEN']}\")\n"
    )
    secret = "hf-s3cr3t-value"
    args = ["run", "--model", "leaky_model:build", "--device", "cpu", "--out", "runs", "--json"]
    done = run_cli_process(*args, cwd=tmp_path, env={"HF_TOKEN": secret}, timeout=120)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert secret not in done.stderr + done.stdout
    (line,) = done.stderr.splitlines()
    assert line.endswith(f"the factory raised RuntimeError: the hub refused token {artifacts.WITHHELD}"), line
    assert json.loads(done.stdout)["error"].endswith(f"the hub refused token {artifacts.WITHHELD}")
    assert not (tmp_path / "runs").exists()
