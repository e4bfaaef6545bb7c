"""torch.compile: the progress hooks inside a traced graph (silent, no graph break), and `run --compile`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from nsa_diag.app import run_cli
from nsa_diag.probe.hooks import attach_progress


class _Sink:
    forward_phase, backward_phase = "forward", "backward"

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def event(self, phase, event=None, **where) -> int:
        self.events.append((phase, event, where.get("layer")))
        return len(self.events)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


@pytest.mark.slow  # Dynamo's first compile: ~5 s of CPU (make test keeps the eager hooks' own tests)
def test_block_hooks_are_silent_inside_a_compiled_graph_and_break_none() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, sink = _Stack(), _Sink()
    attach_progress(model, sink)
    model(torch.randn(2, 8)).backward()  # eager: every block reports
    assert [e[:2] for e in sink.events] == [("forward", "begin"), ("forward", "end")] * 2 + [
        ("backward", "begin"), ("backward", "end")
    ] * 2  # fmt: skip
    sink.events.clear()
    compiled = torch.compile(model, backend="eager")
    for _ in range(2):
        compiled(torch.randn(2, 8)).backward()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert sink.events == []  # inside the graph the hooks are traced as nothing


@pytest.mark.slow
def test_run_compile_passes_and_says_its_graph_breaks(tmp_path: Path) -> None:
    code = run_cli(["run", "--compile", "eager", "--steps", "2", "--out", str(tmp_path), "--name", "c"])
    assert code == 0
    (case,) = tmp_path.glob("*-run/cases/c")
    result = json.loads((case / "result.json").read_text())
    assert result["verdict"] == "pass", result["reason"]
    assert "torch.compile (backend eager): 0 graph break(s)" in json.dumps(result)
    assert "--compile eager" in (case / "replay.sh").read_text()


@pytest.mark.slow  # inductor's first compile of the tiny model: ~60 s of the 2-core CPU
@pytest.mark.timeout(1000)
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on the CPU needs a C++ compiler")
def test_run_compile_inductor_outlives_a_stall_shorter_than_its_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor with a cold cache compiles for most of a minute, longer than --stall 15: its compilations'
    start and end are progress, so the case is not called hung, and it passes with its graph breaks."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    # the timeout is not what is tested: on a loaded 2-core machine (CI's slow tests three at a time) the
    # compile once outlasted the default 300 s, and the case was rightly "slow: still working"
    args = ["run", "--compile", "inductor", "--steps", "3", "--stall", "15", "--timeout", "900"]
    args += ["--out", str(tmp_path / "runs")]
    assert run_cli([*args, "--name", "ind"]) == 0
    (case,) = (tmp_path / "runs").glob("*-run/cases/ind")
    result = json.loads((case / "result.json").read_text())
    assert result["verdict"] == "pass", result["reason"]
    assert result["steps_done"] == 3
    assert "torch.compile (backend inductor): 0 graph break(s)" in json.dumps(result)
    assert any((tmp_path / "inductor-cache").iterdir())  # it compiled here, from nothing


@pytest.mark.slow  # Dynamo's compile of the tiny model (eager backend), then a 5 s stall
def test_a_hang_inside_a_compiled_model_gets_the_eager_verdict_at_its_step_and_phase(tmp_path: Path) -> None:
    """A lock that is never released, taken in layer 1's forward of a compiled model: the same verdict as
    eager (python-deadlock), placed by the step and the phase (the block hooks are silent in the graph)
    and by the stacks, whose frames show the lock and Dynamo's resume function around it."""
    args = ["run", "--compile", "eager", "--inject", "deadlock:layer=1,phase=forward", "--stall", "5"]
    assert run_cli([*args, "--steps", "2", "--out", str(tmp_path), "--name", "d"]) == 1
    (case,) = tmp_path.glob("*-run/cases/d")
    result = json.loads((case / "result.json").read_text())
    assert (result["verdict"], result["hang_kind"]) == ("hang", "python-deadlock"), result["reason"]
    assert (result["where"]["phase"], result["where"]["step"]) == ("forward", 1)
    assert "_deadlock_lock_acquire" in result["reason"]
    assert "torch_dynamo_resume_in" in (case / "stacks.txt").read_text()
