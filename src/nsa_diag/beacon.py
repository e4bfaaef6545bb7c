"""The progress beacon: a small shared-memory record the worker updates and the watchdog reads.

The wire format between a job and the watchdog, so it lives below both sides: our worker
(`nsa_diag.worker`) and the probe in a user's process (`nsa_diag.probe`) write it, the watchdog, the
launchers and the readers of run folders read it. Standard library only: the probe imports it.

The worker maps ``beacon.bin`` in its case folder and writes the latest progress event into it (a seqlock:
the version is odd while a write is under way), and a heartbeat thread bumps a counter ten times a second.
The watchdog maps the same file read-only. Reading needs nothing from the worker: it works while the worker
is wedged in C++ or holds the GIL, which is exactly when a pipe or a log line would fall silent. A
heartbeat that stops while the event counter also stops means the GIL is held (no Python thread can run).

Below the progress events, the heartbeat thread also writes what shows work between two events
(`nsa_diag.probe.liveness`): how often the main thread's innermost Python frame or line moved, the CUDA
caching allocator's cumulative allocation count, each with the time it last changed, and where the main
thread is (``frame``: ``path:line function``) with a few facts about its stack (``FLAG_*``).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

PHASES = ("", "setup", "forward", "backward", "recompute", "optimizer", "step", "check", "done", "export",
          "pre-flight", "pre-flight forward", "pre-flight backward", "pre-flight recompute")  # fmt: skip
BRANCHES = ("", "cmp", "sel", "win")
EVENTS = ("", "begin", "end")
MODULE_BYTES = 96
FRAME_BYTES = 200
MODULE_NAMES_KEPT = 4096  # module names whose beacon bytes are kept (a model's hooked modules: ~5 a layer)
# Facts about the main thread's stack where the heartbeat last saw it move (`BeaconState.flags`).
FLAG_DATALOADER = 1  # a frame of torch/utils/data/dataloader.py: the step waits for its next batch
FLAG_SAVING = 2  # a frame of torch/serialization.py: a checkpoint is written or read
FLAG_DISTRIBUTED = 4  # a frame of torch/distributed/: a collective or a rendezvous
# version, seq, time, step, layer, phase, branch, event, pid, heartbeat, heartbeat_time,
# moves, move_time, allocs, alloc_time, flags, (pad), module, frame
_FORMAT = f"<QQdiiiiiiQdQdQdII{MODULE_BYTES}s{FRAME_BYTES}s"
SIZE = struct.calcsize(_FORMAT)
_HEARTBEAT_OFFSET = struct.calcsize("<QQdiiiiii")  # heartbeat and its time live after the event fields
_LIVENESS = struct.Struct("<QdQdI")  # moves .. flags, after the heartbeat
_LIVENESS_OFFSET = _HEARTBEAT_OFFSET + struct.calcsize("<Qd")
_MODULE_OFFSET = SIZE - MODULE_BYTES - FRAME_BYTES


@dataclass(frozen=True)
class BeaconState:
    """One consistent read of the beacon."""

    seq: int  # progress events so far
    time: float  # wall-clock time of the last event
    step: int | None
    layer: int | None
    phase: str | None
    branch: str | None
    event: str | None
    pid: int
    heartbeat: int  # heartbeat-thread ticks so far
    heartbeat_time: float
    module: str | None
    # Work between progress events (the heartbeat thread's, `nsa_diag.probe.liveness`): moves of the main
    # thread's innermost Python frame or line seen so far and the time of the last; the CUDA caching
    # allocator's allocations so far (0: no CUDA) and when that count last changed; where the main thread
    # was when it last moved, and `FLAG_*` facts about its stack there.
    moves: int = 0
    move_time: float = 0.0
    allocs: int = 0
    alloc_time: float = 0.0
    flags: int = 0
    frame: str | None = None

    def where(self) -> dict[str, object]:
        return {
            "phase": self.phase, "step": self.step, "layer": self.layer,
            "branch": self.branch, "module": self.module, "event": self.event,
        }  # fmt: skip


_PHASE_CODES = {name: i for i, name in enumerate(PHASES)}
_BRANCH_CODES = {name: i for i, name in enumerate(BRANCHES)}
_EVENT_CODES = {name: i for i, name in enumerate(EVENTS)}
_VERSION = struct.Struct("<Q")
_EVENT = struct.Struct("<Qdiiiiii")  # seq .. pid, after the version


class BeaconWriter:
    """The worker's side. Not thread-safe for `update`; `tick` may run in another thread."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "wb") as f:
            f.write(b"\0" * SIZE)
        self._file = open(self.path, "r+b")  # noqa: SIM115 - kept open for the worker's lifetime
        self._map = mmap.mmap(self._file.fileno(), SIZE)
        self._version = 0
        self._seq = 0
        self._heartbeat = 0
        self._pid = os.getpid()  # once: a system call per progress event costs more than the rest of it
        self._names: dict[str | None, bytes] = {}  # module name -> its padded bytes in the beacon
        self.update(phase="setup", event="begin")

    def update(
        self,
        *,
        phase: str | None = None,
        step: int | None = None,
        layer: int | None = None,
        branch: str | None = None,
        event: str | None = None,
        module: str | None = None,
    ) -> int:
        """Record one progress event; returns its sequence number. A few microseconds: the hooks call it
        several times per layer and step, so the codes and the module's bytes are looked up, not built."""
        self._seq += 1
        self._version += 1  # odd: a write is under way
        _VERSION.pack_into(self._map, 0, self._version)
        _EVENT.pack_into(
            self._map, 8,
            self._seq, time.time(),
            -1 if step is None else step, -1 if layer is None else layer,
            _PHASE_CODES.get(phase, 0), _BRANCH_CODES.get(branch, 0), _EVENT_CODES.get(event, 0), self._pid,
        )  # fmt: skip
        name = self._names.get(module)
        if name is None:
            name = (module or "").encode()[:MODULE_BYTES].ljust(MODULE_BYTES, b"\0")
            if len(self._names) < MODULE_NAMES_KEPT:
                self._names[module] = name
        self._map[_MODULE_OFFSET : _MODULE_OFFSET + MODULE_BYTES] = name
        self._version += 1  # even: consistent
        _VERSION.pack_into(self._map, 0, self._version)
        return self._seq

    def tick(self) -> None:
        """One heartbeat (from the heartbeat thread): proves a Python thread can still run."""
        self._heartbeat += 1
        struct.pack_into("<Qd", self._map, _HEARTBEAT_OFFSET, self._heartbeat, time.time())

    def liveness(self, moves: int, move_time: float, allocs: int, alloc_time: float, flags: int) -> None:
        """The heartbeat thread's record of work between progress events (`BeaconState.moves` ...)."""
        _LIVENESS.pack_into(self._map, _LIVENESS_OFFSET, moves, move_time, allocs, alloc_time, flags)

    def frame(self, text: str) -> None:
        """Where the main thread is (``path:line function``), cut to `FRAME_BYTES` keeping the end."""
        raw = text.encode(errors="replace")[-FRAME_BYTES:]
        self._map[SIZE - FRAME_BYTES : SIZE] = raw.ljust(FRAME_BYTES, b"\0")

    def close(self) -> None:
        self._map.close()
        self._file.close()


def read_beacon(path: Path, retries: int = 50) -> BeaconState | None:
    """A consistent snapshot of the beacon at ``path``, or None if it does not exist (yet)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SIZE)
    except FileNotFoundError:
        return None
    for _ in range(retries):
        if len(raw) < SIZE:
            return None
        v1 = struct.unpack_from("<Q", raw, 0)[0]
        values = struct.unpack(_FORMAT, raw)
        if v1 % 2 == 0 and values[0] == v1:
            break
        time.sleep(0.001)
        with open(path, "rb") as f:
            raw = f.read(SIZE)
    else:
        return None
    (_, seq, t, step, layer, phase, branch, event, pid, heartbeat, heartbeat_time,
     moves, move_time, allocs, alloc_time, flags, _pad, module, frame) = values  # fmt: skip
    return BeaconState(
        seq=seq,
        time=t,
        step=None if step < 0 else step,
        layer=None if layer < 0 else layer,
        phase=PHASES[phase] or None if 0 <= phase < len(PHASES) else None,
        branch=BRANCHES[branch] or None if 0 <= branch < len(BRANCHES) else None,
        event=EVENTS[event] or None if 0 <= event < len(EVENTS) else None,
        pid=pid,
        heartbeat=heartbeat,
        heartbeat_time=heartbeat_time,
        module=module.rstrip(b"\0").decode(errors="replace") or None,
        moves=moves,
        move_time=move_time,
        allocs=allocs,
        alloc_time=alloc_time,
        flags=flags,
        frame=frame.rstrip(b"\0").decode(errors="replace") or None,
    )
