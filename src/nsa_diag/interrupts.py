"""nsa-diag's own interrupts: SIGINT, SIGTERM and SIGHUP, noted from the first moment and never lost.

The signals that stop nsa-diag are SIGINT (Ctrl-C), SIGTERM (``kill``, a job scheduler) and SIGHUP (the
terminal or the ssh session closed): all three end an invocation the same way (`Interrupted`, exit 130),
with the running case stopped and its result.json written (`nsa_diag.executor.InterruptGuard`).

A KeyboardInterrupt raised by Python's default handler can be swallowed by code that happens to run when
it arrives: ``import torch`` initialises NumPy from C++ and only warns when that import fails, pydantic-core
builds validators from Rust, and ``__del__`` methods print exceptions and go on. A Ctrl-C that landed
there was lost and the case ran to its end. So `install` (first thing in `nsa_diag.__main__`, before the
heavy imports) puts a handler in place that *notes* the signal before it raises, and `check` raises again
at the points where losing it would matter: before the run folder is created and before a case starts.
Once noted an interrupt stays noted: the invocation is ending, and no new case may start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_received: list[int] = []  # the first signal noted in this process (at most one entry)
_terminal_fds: list[int] = []  # stdout/stderr that were a terminal when `install` ran


class Interrupted(KeyboardInterrupt):
    """nsa-diag got SIGINT, SIGTERM or SIGHUP (`signal_name`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signal_name = signal.Signals(signum).name


def note(signum: int) -> None:
    """Record `signum` (the first one counts). After SIGHUP the terminal is gone: stdout and stderr that
    were that terminal now go to /dev/null, so that writing the summary does not fail on them."""
    if not _received:
        _received.append(signum)
    if signum == signal.SIGHUP:
        _detach_terminal()


def received() -> int | None:
    """The signal noted first, or None."""
    return _received[0] if _received else None


def check() -> None:
    """Raise `Interrupted` when a signal has been noted (even if its KeyboardInterrupt was swallowed)."""
    signum = received()
    if signum is not None:
        raise Interrupted(signum)


def _importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside an import (a module's top level, below importlib's frames)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _note_and_raise(signum: int, frame: FrameType | None) -> None:
    note(signum)
    if _importing(frame):
        # Inside an import (torch's), the exception may cross C++ (pybind11 calls back into Python) and
        # end the process with std::terminate and SIGABRT. Noted, it is raised by the next `check()`:
        # the session's, before anything is created.
        return
    # A plain KeyboardInterrupt: one that reaches the top while the modules load ends the process as
    # Python ends it for Ctrl-C (CPython checks the exact type), not with a traceback and exit 1.
    raise KeyboardInterrupt


def install() -> None:
    """Note and raise on SIGINT, SIGTERM and SIGHUP from now on (main thread only; else nothing)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _terminal_fds[:] = [fd for fd in (1, 2) if os.isatty(fd)]  # a hung-up terminal no longer says so
    _set(_note_and_raise)


def _set(handler: Handler) -> dict[int, Any]:
    """`handler` for each of `SIGNALS` that is not ignored (nohup's SIGHUP stays ignored, as asked)."""
    previous = {}
    for signum in SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, handler)
    return previous


@contextlib.contextmanager
def handled_by(handler: Handler) -> Iterator[None]:
    """`handler` (which should `note` the signal) for SIGINT, SIGTERM and SIGHUP inside the block, the
    previous handlers after it; in a thread other than the main one nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = _set(handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _detach_terminal() -> None:
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in _terminal_fds:
            with contextlib.suppress(OSError):
                os.dup2(devnull, fd)
        os.close(devnull)
