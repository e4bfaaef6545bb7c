"""`nsa-diag gc-bisect`: the bisection logic, an injected recompute deadlock in one layer of four, resume,
a failure without checkpointing, and `--grads` on a model with the seeds' wrong-layer recompute."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from diag_cli import preflight_in_process, run_cli_json

from nsa_diag.analysis.bisect import STATE_FILE, smallest_range
from nsa_diag.app import run_cli
from nsa_diag.session.plans import grads_conclusion

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def nsa_diag(*args: str, timeout: float = 240) -> tuple[int, dict[str, Any], str]:
    """The CLI in a subprocess, planted models importable: code, JSON summary, stderr."""
    return run_cli_json(*args, timeout=timeout)


@pytest.mark.parametrize(
    ("layers", "culprit", "expected"),
    [(4, {2}, (2, 3)), (8, {0}, (0, 1)), (8, {7}, (7, 8)), (12, {5, 6}, (5, 7)), (8, {1, 6}, (1, 7))],
)
def test_smallest_range(layers: int, culprit: set[int], expected: tuple[int, int]) -> None:
    tried: list[tuple[int, int]] = []

    def reproduces(a: int, b: int) -> bool:  # fails when every culprit layer is checkpointed
        tried.append((a, b))
        return culprit <= set(range(a, b))

    assert smallest_range(0, layers, reproduces) == expected
    if len(culprit) == 1:
        assert len(tried) <= 2 * (layers - 1).bit_length()  # O(log L)


@pytest.mark.slow
def test_gc_bisect_names_the_layer_and_resumes(tmp_path: Path) -> None:
    args = ("gc-bisect", "--layers", "4", "--gc", "all", "--inject", "deadlock:layer=2,phase=recompute")
    # a stall long enough for a healthy step on a loaded 2-core CI machine (2 s was not: "gc none" was
    # called hung in its first forward at 10% CPU)
    code, summary, err = nsa_diag(*args, "--stall", "5", "--out", str(tmp_path))
    assert code == 0, err
    run_dir = Path(summary["run_dir"])
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert state["found"] == [2, 3]
    assert state["target"] == "hang"
    assert state["done"]
    assert "layer 2 alone (gc 2:3)" in state["conclusion"]
    tried = [trial["gc"] for trial in state["trials"]]
    assert tried == ["all", "none", "0:2", "2:4", "2:3"]

    code, again, err = nsa_diag("gc-bisect", "--resume", str(run_dir))  # everything recorded: no new run
    assert code == 0
    assert err.count("(recorded)") == len(tried)
    assert "running case" not in err
    assert again["bisect"]["found"] == [2, 3]


@pytest.mark.slow  # 21 s; the other gc-bisect verdicts stay
def test_gc_bisect_says_when_it_fails_without_checkpointing(tmp_path: Path) -> None:
    args = ("gc-bisect", "--layers", "2", "--gc", "all", "--inject", "nan:layer=1,phase=forward")
    code, summary, _ = nsa_diag(*args, "--out", str(tmp_path))
    assert code == 1
    assert summary["bisect"]["conclusion"].startswith("fails without checkpointing too (nonfinite")
    assert [t["gc"] for t in summary["bisect"]["trials"]] == ["all", "none"]


@pytest.mark.slow
def test_gc_bisect_grads_names_wrong_recompute_layers(tmp_path: Path) -> None:
    args = ("gc-bisect", "--grads", "--layers", "3", "--model", "diag_planted:wrong_recompute_lm")
    code, summary, _ = nsa_diag(*args, "--out", str(tmp_path))
    assert code == 1
    bisect = summary["bisect"]
    # every recompute re-runs the last block: checkpointing layer 0 or 1 alone corrupts the gradients
    assert bisect["layers_differ"] == [0, 1]
    assert "layer(s) 0, 1" in bisect["conclusion"]


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("{not json", id="not-json"),
        pytest.param('{"spec": 5}', id="wrong-shape"),
        pytest.param("[]", id="not-an-object"),
    ],
)
def test_resume_of_a_corrupt_state_is_one_line_and_exit_2(
    content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # in process (the CLI's own `run_cli`), as test_grads_refuses_what_it_cannot_apply: refused before any
    # trial runs, so a subprocess would add only its start-up (a torch import, ~3 s of CPU)
    (tmp_path / STATE_FILE).write_text(content)
    code = run_cli(["gc-bisect", "--resume", str(tmp_path), "--json"])
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert code == 2, err
    assert summary["kind"] == "usage"  # --json: the error is an object on stdout too
    assert "cannot be resumed" in summary["error"]
    (line,) = err.splitlines()
    assert line.startswith(f"nsa-diag: --resume {tmp_path}: its {STATE_FILE} cannot be resumed: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(  # verify refuses this model for its gc property; gc-bisect --grads ran 3 errors
            ["--model", "diag_user_model:build"],
            "gc-bisect --grads with --model diag_user_model:build: the comparison rebuilds the model",
            id="model",
        ),
        pytest.param(
            ["--inject", "nan:layer=1", "--steps", "2"],
            "--inject, --steps with gc-bisect --grads",
            id="steps",
        ),
        pytest.param(["--reference-check"], "--reference-check with gc-bisect --grads", id="reference"),
    ],
)
def test_grads_refuses_what_it_cannot_apply(
    args: list[str],
    says: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 26: one line, exit 2, nothing written, before any comparison (none would have run)."""
    preflight_in_process(monkeypatch)  # the model's pre-flight, without a child importing torch again
    out = tmp_path / "runs"
    code = run_cli(["gc-bisect", "--grads", *args, "--seq-len", "16", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert says in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("differ", "same", "failed", "conclusion"),
    [
        pytest.param([], [0, 1, 2], [], "checkpointing any single layer gives the gradients of no "
                     "checkpointing", id="all-same"),
        pytest.param([1], [0, 2], [], "gradients differ from no checkpointing when checkpointing layer(s) 1",
                     id="one-differs"),
        pytest.param([], [0, 2], ["layer 1: error (boom)"], "checkpointing layer(s) 0, 2 gives the gradients "
                     "of no checkpointing; not compared: layer 1: error (boom)", id="some-not-compared"),
        pytest.param([], [], ["layer 0: error (a)", "layer 1: error (b)", "layer 2: unchecked (c)"],
                     "no layer's gradients were compared: layer 0: error (a); layer 1: error (b); layer 2: "
                     "unchecked (c)", id="none-compared"),
    ],
)  # fmt: skip
def test_grads_conclusion_claims_only_what_was_compared(
    differ: list[int], same: list[int], failed: list[str], conclusion: str
) -> None:
    """Issue 26: three workers that all errored were headlined "checkpointing any single layer gives the
    gradients of no checkpointing; not compared: ...": a claim of a comparison that never happened."""
    assert grads_conclusion(3, differ, same, failed) == conclusion
