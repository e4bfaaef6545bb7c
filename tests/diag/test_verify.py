"""`nsa-diag verify`: the properties hold on the tiny preset (float64, CPU) and a planted bug is named."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from diag_cli import cli_env, run_cli_json

from nsa_diag.commands.verify import PROPERTIES, parse_properties, verify_seq_len
from nsa_diag.errors import UsageError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def nsa_diag(*args: str, timeout: float = 240) -> tuple[int, dict[str, Any], str]:
    """The CLI in a subprocess, planted models importable: code, JSON summary, stderr."""
    return run_cli_json(*args, timeout=timeout)


def results(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    run_dir = Path(summary["run_dir"])
    return {
        path.parent.name: json.loads(path.read_text()) for path in (run_dir / "cases").glob("*/result.json")
    }


def test_verify_seq_len_is_sparse_and_off_block_lengths() -> None:
    import nsa_core

    for name in nsa_core.PRESETS:
        cfg = nsa_core.preset(name)
        nsa = cfg.nsa
        s = verify_seq_len(cfg)
        assert s > nsa.n_sel * nsa.sel_block_len
        assert s > nsa.window
        assert all(s % length for length in (nsa.block_len, nsa.block_stride, nsa.sel_block_len))


def test_parse_properties() -> None:
    assert parse_properties(None) == PROPERTIES
    assert parse_properties("gc, causality") == ("gc", "causality")
    with pytest.raises(UsageError, match="nope"):
        parse_properties("gc,nope")


@pytest.mark.slow
def test_verify_passes_on_tiny(tmp_path: Path) -> None:
    code, summary, err = nsa_diag("verify", "--out", str(tmp_path))
    assert code == 0, err
    found = results(summary)
    assert set(found) == set(PROPERTIES)
    for name, result in found.items():
        assert result["verdict"] == "pass", result["reason"]
        parity = result["parity"]
        assert parity["property"] == name
        assert parity["precision"] == "float64"
        assert parity["max_err"] <= parity["bound"] == 1e-9
    assert found["backends"]["parity"]["against"] == "reference"
    assert {"sel=masked", "sel=gather", "sel=packed", "cmp=masked", "win=chunked"} <= set(
        found["backends"]["parity"]["errors"]
    )
    assert {"gc all", "gc all reentrant", "gc 1:2", "gc 1:2 reentrant"} == set(
        found["gc"]["parity"]["errors"]
    )
    assert found["causality"]["parity"]["errors"]  # several cut points


def _planted_causality(tmp_path: Path) -> dict[str, Any]:
    code, summary, _ = nsa_diag(
        "verify", "--only", "causality,gc", "--model", "diag_planted:peeking_lm", "--out", str(tmp_path)
    )
    assert code == 1
    return summary


@pytest.mark.slow  # 24 s; verify's other properties stay
def test_verify_names_a_planted_causality_bug(tmp_path: Path) -> None:
    found = results(_planted_causality(tmp_path))
    assert found["gc"]["verdict"] == "pass"
    causality = found["causality"]
    assert causality["verdict"] == "mismatch"
    assert causality["reason"].startswith("causality:")
    assert causality["parity"]["property"] == "causality"
    assert causality["parity"]["max_err"] > 1e-3
    assert "logits before t differ" in causality["parity"]["where"]


@pytest.mark.slow
def test_the_replay_of_a_verify_case_checks_the_property_again(tmp_path: Path) -> None:
    """Issue 15 #9: the replay checks the property again (it replayed a training step, which passed)."""
    summary = _planted_causality(tmp_path)
    replay = Path(summary["run_dir"]) / "cases" / "causality" / "replay.sh"
    assert " verify --only causality " in replay.read_text()
    again = subprocess.run(
        ["bash", str(replay), "--json"], capture_output=True, text=True, env=cli_env(planted=True),
        cwd=ROOT, stdin=subprocess.DEVNULL, timeout=240, check=False,
    )  # fmt: skip
    assert again.returncode == 1, again.stderr
    assert [case["verdict"] for case in json.loads(again.stdout)["cases"]] == ["mismatch"]


def test_a_property_that_compared_nothing_is_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: a property with nothing to compare (no cut point, no backend) showed "largest relative
    error 0 (bound 1e-9)" and passed; it is unchecked, with why, and its parity says not checked."""
    from types import SimpleNamespace

    from nsa_diag.worker import checks
    from nsa_diag.worker.outcome import CaseFailed

    def built(self: checks.Checker, trainer: Any) -> None:
        self.precision = "float64"

    monkeypatch.setattr(checks.Checker, "__init__", built)
    monkeypatch.setattr(
        checks.Checker, "causality", lambda self: {"max_err": 0.0, "where": "-", "bound": 1e-9, "errors": {}}
    )
    with pytest.raises(CaseFailed) as failed:
        checks.run_check(SimpleNamespace(spec=SimpleNamespace(check="causality")))  # type: ignore[arg-type]
    assert failed.value.status == "unchecked"
    assert failed.value.reason == (
        "causality: nothing to compare (no position t with 1 <= t < S to change the tokens from)"
    )
    assert failed.value.parity is not None
    assert failed.value.parity.checked is False
