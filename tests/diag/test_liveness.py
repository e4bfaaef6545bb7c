"""What shows work between progress events, and who is who in a job's process tree.

- `nsa_diag.probe.liveness.LivenessSampler`, run by a real thread against a real main-thread loop: moves
  while the loop computes across lines, none while it sleeps or waits on a lock;
- the probe's `LossWatch`: a NaN loss is recorded at the backward it was called on (CPU);
- `nsa_diag.evidence.roles.assign_roles` on the trees real jobs have (a script with DataLoader workers,
  torchrun with ranks and their workers, a shell that starts Python, torch.multiprocessing.spawn).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from nsa_diag import wire
from nsa_diag.beacon import FLAG_DATALOADER, BeaconWriter, read_beacon
from nsa_diag.evidence.roles import ProcessFacts, assign_roles, describe, training_pids
from nsa_diag.probe import runtime
from nsa_diag.probe.liveness import LivenessSampler, stack_flags


def _sample_while(work: object, tmp_path: Path, seconds: float = 1.0) -> tuple[int, str | None]:
    """Run ``work()`` in this (the main) thread while a sampler thread ticks every 10 ms; moves, frame."""
    beacon = BeaconWriter(tmp_path / "beacon.bin")
    sampler = LivenessSampler(beacon, threading.get_ident())
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            time.sleep(0.01)
            sampler.sample()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        work()  # type: ignore[operator]
    stop.set()
    thread.join()
    state = read_beacon(tmp_path / "beacon.bin")
    assert state is not None
    return state.moves, state.frame


def test_a_loop_of_small_ops_moves_a_sleep_does_not(tmp_path: Path) -> None:
    q = torch.randn(1, 64, 32)

    def per_token() -> None:
        for t in range(64):
            scores = q[:, t : t + 1] @ q[:, : t + 1].transpose(1, 2)
            weights = torch.softmax(scores, dim=-1)
            weights @ q[:, : t + 1]

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    moves, frame = _sample_while(per_token, tmp_path / "a")
    assert moves >= 5, moves
    assert frame is not None  # where it was at the last tick (here: joining the sampler)
    still, _ = _sample_while(lambda: time.sleep(0.3), tmp_path / "b")
    assert still <= 5, still  # the loop's own line between sleeps, now and then, and the join


def test_the_flags_say_the_main_thread_waits_for_a_batch() -> None:
    code = compile("import sys; frame = sys._getframe()", "/x/torch/utils/data/dataloader.py", "exec")
    scope: dict[str, object] = {}
    exec(code, scope)
    assert stack_flags(scope["frame"]) & FLAG_DATALOADER  # type: ignore[arg-type]
    assert not stack_flags(None)


def test_a_nan_loss_is_recorded_where_backward_is_called(tmp_path: Path) -> None:
    probe = runtime.Probe(tmp_path)
    try:
        watch = runtime.LossWatch(probe)
        weight = torch.ones(2, requires_grad=True)
        watch.seen((weight * 2).sum(), torch)  # finite: nothing recorded
        assert not (probe.folder / wire.NONFINITE_JSON).exists()
        probe.sink.step = 3
        watch.seen(torch.log(weight.sum() - 10), torch)
        record = json.loads((probe.folder / wire.NONFINITE_JSON).read_text())
        assert (record["value"], record["step"]) == ("nan", 3)
        assert record["seen"] == "the tensor backward() was called on"
        watch.seen(torch.ones(3, requires_grad=True), torch)  # not a loss (3 elements): ignored
    finally:
        probe._heartbeat_stop = True


def test_the_first_block_whose_output_went_non_finite_is_named_with_its_step(tmp_path: Path) -> None:
    """A NaN born in block 1 at step 2 in rows the loss ignores (a finite loss), which reaches the weights
    and makes step 3's loss NaN: the record names block 1 at step 2, not the first block of step 3 (every
    block is NaN by then). A loss that goes NaN after finite blocks says they were finite."""

    class Block(torch.nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index, self.linear = index, torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)
            if self.index == 1 and probe.sink.step == 2:
                y = y.clone()
                y[0] = float("nan")  # row 0: masked out of the loss below
            return y

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Block(i) for i in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    for case, steps in (("nan", 3), ("finite", 1)):
        probe = runtime.Probe(tmp_path / case)
        try:
            model, watch = Model(), runtime.LossWatch(probe)
            probe.block_watch = runtime.BlockWatch.attach(model, probe.sink)
            for step in range(1, steps + 1):
                probe.sink.step = step
                out = model(torch.ones(2, 2))
                loss = out[1:].sum() if case == "nan" else torch.log(out.sum() - 1e6)
                watch.seen(loss, torch)
                loss.backward()
                with torch.no_grad():  # what an optimizer step does with a NaN gradient
                    for p in model.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
            record = json.loads((probe.folder / wire.NONFINITE_JSON).read_text())
            if case == "nan":
                assert (record["step"], record["module"], record["module_step"]) == (3, "layers.1", 2)
            else:
                assert (record["step"], record["module"]) == (1, None)
            assert record["blocks_checked"] == 3
        finally:
            probe._heartbeat_stop = True


def test_a_gpu_loss_and_its_block_sums_are_read_once_their_event_completes(tmp_path: Path) -> None:
    """The GPU path without a GPU: what `LossWatch.staged` puts behind a step's event (the loss, then
    the blocks' sums: here CPU tensors standing in for the pinned copy) is read when the event says done
    (not before), the first NaN block kept with its step, the loss recorded at its own step."""

    class Event:
        done = False

        def query(self) -> bool:
            return self.done

    probe = runtime.Probe(tmp_path)
    try:
        watch = runtime.LossWatch(probe)
        probe.block_watch = runtime.BlockWatch(probe.sink, ["layers.0", "layers.1"])
        events = []
        for step, middle in ((1, 1.0), (2, float("nan"))):
            probe.block_watch.step = step
            probe.block_watch.by_block = {0: torch.tensor(1.0), 1: torch.tensor(middle)}
            loss = torch.tensor(3.0 if step == 1 else float("nan"))
            names, values = watch.staged(loss, step, torch)
            assert names == ["layers.0", "layers.1"]
            events.append(Event())
            watch.pending.append((step, values, events[-1], names))
        watch.check_pending()
        assert len(watch.pending) == 2  # not done: not read
        assert probe.block_watch.read is None
        for event in events:
            event.done = True
        watch.check_pending()
        assert not watch.pending
        record = json.loads((probe.folder / wire.NONFINITE_JSON).read_text())
        assert (record["step"], record["module"], record["module_step"], record["blocks_checked"]) == (
            2, "layers.1", 2, 2,
        )  # fmt: skip
        watch.pending.append((3, "not a tensor", Event(), []))  # a bad entry: the probe's, said once
        watch.pending[0][2].done = True
        watch.check_pending()
        assert not watch.pending
        assert (
            "AttributeError" in json.loads((probe.folder / wire.PROBE_JSON).read_text())["loss_watch_error"]
        )
    finally:
        probe._heartbeat_stop = True


# --- roles ---------------------------------------------------------------------------------------------


def test_a_script_with_dataloader_workers() -> None:
    roles = assign_roles([
        ProcessFacts(10, 1, ("python", "train.py")),
        ProcessFacts(11, 10, ("python", "train.py"), forked_from=10, role="dataloader-worker"),
        ProcessFacts(12, 10, ("python", "train.py"), forked_from=10, stacks=(
            'File "/x/torch/utils/data/_utils/worker.py", line 300 in _worker_loop'
        )),
        ProcessFacts(13, 10, ("python", "-c", "from multiprocessing.resource_tracker import main")),
    ])  # fmt: skip
    assert roles == {10: "training", 11: "dataloader-worker", 12: "dataloader-worker", 13: "helper"}
    assert training_pids(roles) == [10]


def test_torchrun_its_ranks_and_their_workers() -> None:
    roles = assign_roles([
        ProcessFacts(20, 1, ("/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"), role="launcher"),
        ProcessFacts(21, 20, ("python", "-u", "train.py"), rank=0),
        ProcessFacts(22, 20, ("python", "-u", "train.py"), rank=1),
        ProcessFacts(23, 21, ("python", "-u", "train.py"), rank=0, forked_from=21, role="dataloader-worker"),
        ProcessFacts(24, 21, ("python", "-u", "train.py"), rank=0, forked_from=21),
    ])  # fmt: skip
    assert roles == {20: "launcher", 21: "rank", 22: "rank", 23: "dataloader-worker", 24: "helper"}
    assert describe("rank", 1) == "rank 1"
    assert describe("launcher") == "torch's launcher (torchrun's agent)"


@pytest.mark.parametrize(
    "argv",
    [("python", "-m", "torch.distributed.run", "t.py"), ("python", "/v/torch/distributed/launch.py", "t.py")],
)
def test_torch_launchers_by_command_line(argv: tuple[str, ...]) -> None:
    assert assign_roles([ProcessFacts(30, 1, argv)]) == {30: "launcher"}


def test_a_shell_that_starts_python_and_spawned_ranks() -> None:
    assert assign_roles([
        ProcessFacts(40, 1, ("bash", "-c", "python train.py"), python=False),
        ProcessFacts(41, 40, ("python", "train.py")),
    ]) == {40: "shell", 41: "training"}  # fmt: skip
    # torch.multiprocessing.spawn: the parent waits on children that joined a process group
    assert assign_roles([
        ProcessFacts(50, 1, ("python", "spawn.py")),
        ProcessFacts(51, 50, ("python", "-c", "from multiprocessing.spawn import spawn_main"), rank=0),
        ProcessFacts(52, 50, ("python", "-c", "from multiprocessing.spawn import spawn_main"), rank=1),
    ]) == {50: "launcher", 51: "rank", 52: "rank"}  # fmt: skip
    # its resource tracker, beside the ranks under the launcher, is a helper, not a training process
    tracker = ProcessFacts(
        53, 50, ("python", "-c", "from multiprocessing.resource_tracker import main;main(7)")
    )
    assert assign_roles([
        ProcessFacts(50, 1, ("python", "spawn.py")),
        ProcessFacts(51, 50, ("python", "-c", "from multiprocessing.spawn import spawn_main"), rank=0),
        tracker,
    ])[53] == "helper"  # fmt: skip
