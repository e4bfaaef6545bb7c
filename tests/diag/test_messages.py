"""Messages a user can trust (issue 26): each message that said what the user did not do, hid the cause or
lost its text is read here as the user reads it.

In process (the CLI's own `run_cli`) wherever the message comes before any case runs; the `--model`
refusals on canned pre-flight facts (`check_model_facts`, the pre-flight itself is tested in
test_user_model.py); `watch` on a command that cannot start (it ends at once). The hang's stack frames
under `watch` are read in test_watch.py's deadlock test, which runs the job anyway.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer

from nsa_diag.app import app, run_cli
from nsa_diag.cases import check_model_facts
from nsa_diag.errors import UsageError
from nsa_diag.spec import CaseSpec, ModelFacts

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
