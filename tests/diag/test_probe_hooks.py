"""The progress hooks (`nsa_diag.probe.hooks`) in process, on real autograd: what they add to a step (nothing
to the graph), where their events fall (nested per layer and branch, once per backward also under gradient
checkpointing), models whose layers take and return other things than one tensor, and how `Progress`
writes its lines (queued layer events, written by the loop's events, notes and the heartbeat)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nsa_core
from nsa_diag.beacon import BeaconWriter, read_beacon
from nsa_diag.probe.hooks import attach_progress
from nsa_diag.worker.probes import Heartbeat, Progress, report_compiles


class Sink:
    """A `ProgressSink` that keeps the events: (phase, layer, branch, module, event)."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.in_backward = False

    @property
    def forward_phase(self) -> str:
        return "recompute" if self.in_backward else "forward"

    @property
    def backward_phase(self) -> str:
        return "backward"

    def event(self, phase: str, event: str | None = None, *, layer: int | None = None,
              branch: str | None = None, module: str | None = None, **extra: Any) -> int:  # fmt: skip
        self.events.append((phase, layer, branch, module, event))
        return len(self.events)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens[:, :-1])
    logits = out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _step(model: nn.Module, sink: Sink, tokens: torch.Tensor) -> None:
    loss = _loss(model, tokens)
    sink.in_backward = True
    loss.backward()
    sink.in_backward = False


def _nodes(loss: torch.Tensor) -> Counter[str]:
    seen, stack, names = set(), [loss.grad_fn], Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names[node.name()] += 1
        stack.extend(fn for fn, _ in node.next_functions)
    return names


def _tiny(**overrides: Any) -> nn.Module:
    torch.manual_seed(0)
    return nsa_core.TinyLM(nsa_core.preset("tiny", **overrides))


TOKENS = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))


def test_probes_add_no_autograd_node_and_no_op() -> None:
    """The step computes exactly what it computes without the probe (full module backward hooks added two
    BackwardHookFunction nodes per hooked module: 28 for these two layers, 168 for m7c-125m)."""
    model = _tiny()
    plain = _nodes(_loss(model, TOKENS))
    handles = attach_progress(model, Sink(), branches=True)
    probed = _nodes(_loss(model, TOKENS))
    for handle in handles:
        handle.remove()
    assert probed["BackwardHookFunctionBackward"] == 0
    assert probed == plain


def _check_nested(events: list[tuple[Any, ...]]) -> None:
    """Every block's begin is closed by its end, and a branch's mark (a begin, no end) falls inside its own
    layer's block: at any moment the open block and the last mark name the place."""
    open_: list[tuple[Any, ...]] = []
    for phase, layer, branch, _, event in events:
        if branch is not None:
            assert event == "begin", f"{event} of branch {branch}: branches have begin marks only"
            assert open_, f"mark of {phase, layer, branch} outside any block"
            assert open_[-1] == (phase, layer), f"mark of {phase, layer, branch} in {open_}"
        elif event == "begin":
            open_.append((phase, layer))
        else:
            assert open_, f"{event} of {phase, layer} with nothing open"
            assert open_[-1] == (phase, layer), f"{event} of {phase, layer} in {open_}"
            open_.pop()
    assert not open_


def test_events_nest_per_layer_with_a_backward_mark_per_branch() -> None:
    model, sink = _tiny(), Sink()
    attach_progress(model, sink, branches=True)
    _step(model, sink, TOKENS)
    assert len(sink.events) == 2 * 7  # per layer: block begin and end both ways, a backward mark per branch
    _check_nested([e for e in sink.events if e[0] == "forward"])
    _check_nested([e for e in sink.events if e[0] == "backward"])
    assert all(e[2] is None for e in sink.events if e[0] == "forward")
    backward = [e for e in sink.events if e[0] == "backward"]
    assert backward[0] == ("backward", 1, None, "blocks.1", "begin")
    assert backward[-1] == ("backward", 0, None, "blocks.0", "end")
    marks = [e[2] for e in backward if e[1] == 1 and e[2] is not None]
    assert sorted(marks) == ["cmp", "sel", "win"]
    assert ("backward", 1, "sel", "blocks.1.attn.branch_out.sel", "begin") in backward


def test_blocks_alone_by_default() -> None:
    model, sink = _tiny(), Sink()
    attach_progress(model, sink)
    _step(model, sink, TOKENS)
    assert len(sink.events) == 2 * 4
    assert all(e[2] is None for e in sink.events)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_layers_report_backward_once_and_their_recompute(reentrant: bool) -> None:
    """The forward a checkpoint re-runs inside backward is `recompute`; the hooks it installs again do not
    report a second backward end (non-reentrant: its graph is never differentiated)."""
    model, sink = _tiny(gc="all", gc_reentrant=reentrant), Sink()
    attach_progress(model, sink, branches=True)
    _step(model, sink, TOKENS)
    _check_nested([e for e in sink.events if e[0] == "backward"])
    for layer in (0, 1):
        begins = [e for e in sink.events if e[1:3] == (layer, None) and e[4] == "begin"]
        assert [e[0] for e in begins] == ["forward", "recompute", "backward"] if reentrant else [
            "forward", "backward", "recompute"]  # fmt: skip
        ends = [e for e in sink.events if e[0] == "backward" and e[1:3] == (layer, None) and e[4] == "end"]
        assert len(ends) == 1


class TupleBlock(nn.Module):
    """A layer in the manner of Hugging Face: hidden states by keyword, a tuple out."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ff = nn.Linear(dim, dim)

    def forward(self, *, hidden_states: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[Any, ...]:
        return (hidden_states + self.ff(hidden_states), None)


class DictLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TupleBlock(dim) for _ in range(3))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(hidden_states=x)[0]
        return {"logits": self.head(x)}


def test_layers_taking_keywords_and_returning_tuples_report_backward() -> None:
    model, sink = DictLM(), Sink()
    attach_progress(model, sink)
    _step(model, sink, TOKENS)
    backward = [(e[1], e[4]) for e in sink.events if e[0] == "backward"]
    assert backward == [(2, "begin"), (2, "end"), (1, "begin"), (1, "end"), (0, "begin"), (0, "end")]


def test_a_leaf_input_fed_every_step_keeps_one_hook_and_reports_each_backward() -> None:
    """A tensor that outlives the step (a leaf requiring grad, fed again each step) gets one hook, not one
    more per forward, and each backward still ends once."""
    model = nn.Module()
    model.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    sink = Sink()
    attach_progress(model, sink)
    for _ in range(3):
        model.layers(x).sum().backward()
    assert x._backward_hooks is not None
    assert len(x._backward_hooks) == 1
    ends = [e[1] for e in sink.events if e[0] == "backward" and e[4] == "end"]
    assert ends == [1, 0] * 3


# ------------------------------------------------------------------------------------------- Progress


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_progress_queues_layer_lines_until_a_loop_event_and_writes_notes_at_once(tmp_path: Path) -> None:
    beacon = BeaconWriter(tmp_path / "beacon.bin")
    path = tmp_path / "progress.jsonl"
    with path.open("a", buffering=1, encoding="utf-8") as stream:
        progress = Progress(beacon, stream)
        progress.step = 3
        progress.event("backward", "begin", layer=1, branch="sel", module="blocks.1.attn.branch_out.sel")
        state = read_beacon(tmp_path / "beacon.bin")
        assert state is not None
        assert state.where()["module"] == "blocks.1.attn.branch_out.sel"  # the beacon at once
        assert len(_lines(path)) == 1, "the layer event's line waits"
        progress.note("inject", kind="nan")
        progress.event("backward", "end", layer=1, module="blocks.1")
        progress.event("optimizer", "begin")
        lines = _lines(path)
        assert [r["seq"] for r in lines] == [1, 2, 2, 3, 4]  # in order; a note carries the last seq
        assert (lines[1]["module"], lines[1]["step"]) == ("blocks.1.attn.branch_out.sel", 3)
        assert lines[2]["event"] == "inject"
        assert progress.where == {"phase": "optimizer", "step": 3, "layer": None, "branch": None,
                                  "module": None, "event": "begin"}  # fmt: skip

        heartbeat = Heartbeat(beacon, tmp_path, on_dump=lambda: None, progress=progress)
        heartbeat.start()
        try:
            progress.event("forward", "begin", layer=0, module="blocks.0")
            deadline = time.monotonic() + 5
            while len(_lines(path)) < 6 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _lines(path)[-1]["module"] == "blocks.0", "the heartbeat writes queued lines"
        finally:
            heartbeat.stopped = True
            heartbeat.join()
    beacon.close()


def test_a_compiled_triton_kernel_is_progress_at_the_same_place(tmp_path: Path) -> None:
    """`report_compiles`: Triton's post-compile hook repeats the last event (a CUDA case's first step
    compiles kernels between two hook events), and calls a hook that was already set."""
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no post-compile hook")
    beacon = BeaconWriter(tmp_path / "beacon.bin")
    with (tmp_path / "progress.jsonl").open("a", encoding="utf-8") as stream:
        progress = Progress(beacon, stream)
        progress.step = 1
        progress.event("backward", "begin", layer=1, module="blocks.1")
        earlier: list[dict[str, Any]] = []
        saved = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = lambda **kwargs: earlier.append(kwargs)
        try:
            assert report_compiles(progress)
            seq = progress.seq
            knobs.runtime.jit_post_compile_hook(key="k", repr="kernel")
        finally:
            knobs.runtime.jit_post_compile_hook = saved
    assert progress.seq == seq + 1
    state = read_beacon(tmp_path / "beacon.bin")
    assert state is not None
    assert (state.seq, state.phase, state.layer, state.module) == (seq + 1, "backward", 1, "blocks.1")
    assert earlier == [{"key": "k", "repr": "kernel"}]
