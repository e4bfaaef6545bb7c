"""torch.compile: the progress hooks inside a traced graph (silent, no graph break), and `run --compile`."""

from __future__ import annotations

import json
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
