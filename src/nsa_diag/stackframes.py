"""One thread's stack as parsed from a faulthandler or py-spy dump: `Frame`, `ThreadStack`, and the pure
questions asked of them (`innermost_native`, `gpu_wait`).

Plain records, standard library only, below the evidence that takes the dumps (`nsa_diag.evidence.stacks`
parses them into these) and the analyses that read them (`nsa_diag.analysis.ranks`, `nsa_diag.classify`):
an analysis gets the threads, never the module that takes them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Frame:
    """One frame; ``line`` is 0 where it is unknown, ``native`` for C/C++ frames (py-spy)."""

    file: str
    line: int
    func: str
    native: bool = False

    @property
    def key(self) -> str:
        return f"{self.file}:{self.line}"

    def short(self) -> str:
        """``inject.py:42 in _deadlock`` (``lock_PyThread_acquire_lock (libpython3.11.so)`` if native)."""
        if self.native:
            return f"{self.func} ({os.path.basename(self.file)})"
        return f"{os.path.basename(self.file)}:{self.line} in {self.func}"


@dataclass(frozen=True)
class ThreadStack:
    """The frames of one thread, most recent call first."""

    thread_id: str
    frames: tuple[Frame, ...]
    current: bool = False  # faulthandler: the thread that ran the handler; py-spy: holds the GIL
    name: str | None = None
    status: str | None = None  # py-spy: "idle", "active", "active+gil"

    @property
    def top(self) -> Frame | None:
        return self.frames[0] if self.frames else None

    @property
    def python_frames(self) -> tuple[Frame, ...]:
        return tuple(f for f in self.frames if not f.native)

    @property
    def is_main(self) -> bool:
        """The interpreter's main thread: its outermost Python frame is a module body or runpy (``python
        -m``: ``<frozen runpy>`` in faulthandler's dumps since Python 3.11, ``runpy.py`` before and in
        py-spy's)."""
        outer = self.python_frames[-1:] or ()
        return any(
            f.func == "<module>" or f.file.endswith("runpy.py") or f.file == "<frozen runpy>" for f in outer
        )

    @property
    def started_by_threading(self) -> bool:
        return any(
            f.file.endswith("threading.py") and f.func.rpartition(".")[2] == "_bootstrap" for f in self.frames
        )


# A thread waiting for the GPU: torch's Python synchronize, or a CUDA runtime/driver call that waits (the
# driver's own frames, unnamed, are in libcuda).
CUDA_SYNC_PY = (("torch/cuda/__init__.py", "synchronize"), ("torch/cuda/streams.py", "synchronize"))
CUDA_SYNC_NATIVE = ("Synchronize", "cudaMemcpy", "cuMemcpy", "libcuda.so", "cudaStreamWait", "cuStreamWait")


def innermost_native(thread: ThreadStack | None) -> list[Frame]:
    """The native frames above the innermost Python frame (what the Python line is blocked in)."""
    frames: list[Frame] = []
    for frame in thread.frames if thread else ():
        if not frame.native:
            break
        frames.append(frame)
    return frames


def gpu_wait(thread: ThreadStack | None, native: Sequence[Frame] | None = None) -> Frame | None:
    """The frame of a device sync the thread waits in (one of its three innermost Python frames, or a
    native frame above them: ``native``, default the thread's own), or None."""
    for frame in thread.python_frames[:3] if thread else ():
        path = frame.file.replace("\\", "/")
        if any(path.endswith(suffix) and frame.func == func for suffix, func in CUDA_SYNC_PY):
            return frame
    frames = innermost_native(thread) if native is None else native
    return next((f for f in frames if any(n in f.func or n in f.file for n in CUDA_SYNC_NATIVE)), None)
