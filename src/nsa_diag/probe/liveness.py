"""Work between progress events, seen from inside the process by its heartbeat thread (standard library).

Progress events come per block; one block's forward may take minutes (a per-token loop at S=2048) while the
process works all along. A hang is no work, not "no block event", so the heartbeat thread of our worker
and of the probe (`nsa_diag.probe.runtime`) also records, at every tick (0.1 s), into the beacon
(`nsa_diag.beacon.BeaconWriter.liveness`):

- **moves**: how many ticks found the main thread's innermost Python frame at another (code, line) than the
  tick before, and when it last moved; with where it is (``path:line function``) and `FLAG_*` facts about
  its stack (waiting for a DataLoader batch, writing a checkpoint, in torch.distributed);
- **allocs**: the CUDA caching allocator's cumulative allocation count, summed over the devices (read every
  `ALLOC_EVERY` ticks once CUDA is initialised; never initialises it), and when it last changed. Every
  kernel a step issues from Python allocates its output: a loop of small ops on the GPU moves it.

Each tick holds the GIL for a few microseconds (one ``sys._current_frames()``; the stack is walked only
when the innermost position moved). The watchdog (`nsa_diag.watchdog`) reads the counts with the process's
CPU time and I/O bytes from /proc, and calls the process working while any of them moves (the rules are
there). A C call that holds the GIL stops the heartbeat thread, and the counts with it: that is gil-held.
"""

from __future__ import annotations

import sys
import time
from types import FrameType
from typing import Any, Protocol

from nsa_diag.beacon import FLAG_DATALOADER, FLAG_DISTRIBUTED, FLAG_SAVING

ALLOC_EVERY = 5  # ticks between two reads of the CUDA allocator's counters (0.5 s at the 0.1 s heartbeat)
STACK_DEPTH = 64  # frames walked for the flags, innermost first
_FLAG_PATHS = (
    ("torch/utils/data/dataloader.py", FLAG_DATALOADER),
    ("torch/serialization.py", FLAG_SAVING),
    ("torch/distributed/", FLAG_DISTRIBUTED),
)


class LivenessWriter(Protocol):
    """What the sampler writes to (`nsa_diag.beacon.BeaconWriter`)."""

    def liveness(self, moves: int, move_time: float, allocs: int, alloc_time: float, flags: int) -> None: ...

    def frame(self, text: str) -> None: ...


def stack_flags(frame: FrameType | None) -> int:
    """`FLAG_*` of the stack from ``frame`` outwards (`STACK_DEPTH` frames at most)."""
    flags = 0
    for _ in range(STACK_DEPTH):
        if frame is None:
            break
        path = frame.f_code.co_filename.replace("\\", "/")
        for needle, flag in _FLAG_PATHS:
            if needle in path:
                flags |= flag
        frame = frame.f_back
    return flags


def cuda_allocations() -> int:
    """The CUDA caching allocator's cumulative allocation count over every device, 0 without CUDA (or
    before the process initialised it: this never does)."""
    torch: Any = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is None or not cuda.is_initialized():
        return 0
    total = 0
    for device in range(cuda.device_count()):
        stats = cuda.memory_stats(device)
        total += int(stats.get("allocation.all.allocated", 0))
    return total


class LivenessSampler:
    """Called by a heartbeat thread once per tick (`sample`): updates the beacon's liveness fields."""

    def __init__(self, writer: LivenessWriter, main_thread: int) -> None:
        self.writer = writer
        self.main_thread = main_thread
        self.position: tuple[int, int] | None = None  # (id of the code object, line)
        self.moves = 0
        self.move_time = 0.0
        self.allocs = 0
        self.alloc_time = 0.0
        self.flags = 0
        self.ticks = 0
        self.alloc_error: str | None = None  # why the allocator could not be read (once), else None

    def sample(self) -> None:
        now = time.time()
        frame = sys._current_frames().get(self.main_thread)
        if frame is not None:
            position = (id(frame.f_code), frame.f_lineno)
            if position != self.position:
                if self.position is not None:
                    self.moves += 1
                    self.move_time = now
                self.position = position
                self.flags = stack_flags(frame)
                code = frame.f_code
                self.writer.frame(f"{code.co_filename}:{frame.f_lineno} {code.co_name}")
        del frame
        if self.ticks % ALLOC_EVERY == 0 and self.alloc_error is None:
            try:
                allocs = cuda_allocations()
            except Exception as exc:  # a torch without these statistics: the other signals remain
                self.alloc_error = f"{type(exc).__name__}: {exc}"
                allocs = self.allocs
            if allocs != self.allocs:
                self.allocs, self.alloc_time = allocs, now
        self.ticks += 1
        self.writer.liveness(self.moves, self.move_time, self.allocs, self.alloc_time, self.flags)
