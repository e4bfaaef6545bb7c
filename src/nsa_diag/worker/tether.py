"""Every process of a case dies with nsa-diag, however nsa-diag ends (SIGKILL included).

nsa-diag stops a case's processes itself when it can (`nsa_diag.executor`); when it is killed outright,
nothing of it runs any more, so each child must notice alone. `hold` is the first thing our worker,
torchrun's agent (`nsa_diag.worker.agent`) and each rank (`nsa_diag.worker.ddp`) do:

- on Linux it asks the kernel for SIGKILL when the parent dies (``prctl(PR_SET_PDEATHSIG)``): the worker
  and the agent die with nsa-diag, each rank with the agent. The kernel sends it when the *thread* that
  started the child exits, not the process: nsa-diag starts a case from a thread that outlives it (the
  main thread, or a matrix job thread, which waits for its case to end), torchrun's agent from its main
  thread;
- a parent that died before the prctl would never send it, so `hold` then checks that nsa-diag (the pid
  the launcher put in ``NSA_DIAG_PID``) is still the parent or the grandparent, and dies if not;
- where there is no parent-death signal (not Linux), a daemon thread polls ``os.getppid()`` and dies when
  it changes (the process was orphaned).

Started without ``NSA_DIAG_PID`` (``replay.sh``), a process dies with whatever started it, unchecked.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

import psutil

PARENT_ENV = "NSA_DIAG_PID"  # the nsa-diag process a case belongs to (set by the launchers)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_INTERVAL_S = 0.5  # the parent watch, where there is no parent-death signal
ANCESTORS = 2  # nsa-diag is the parent (worker, agent) or the grandparent (a rank, under the agent)


def die_with_parent() -> bool:
    """SIGKILL this process when its parent (thread) exits; False where the kernel cannot (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _ancestors(depth: int) -> list[int]:
    """This process's parent, grandparent, ... (`depth` of them, fewer at the top)."""
    found = []
    pid = os.getppid()
    for _ in range(depth):
        found.append(pid)
        try:
            pid = psutil.Process(pid).ppid()
        except psutil.Error:
            break
    return found


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    _die()


def hold(nsa_diag_pid: int | None = None) -> None:
    """Tie this process's life to nsa-diag's (module docstring): the parent-death signal, or the parent
    watch; and die now if nsa-diag (`nsa_diag_pid`, default ``NSA_DIAG_PID``) is already gone."""
    if nsa_diag_pid is None:
        with contextlib.suppress(ValueError):
            nsa_diag_pid = int(os.environ.get(PARENT_ENV, ""))
    parent = os.getppid()
    if not die_with_parent():
        threading.Thread(target=_watch_parent, args=(parent,), name="nsa-diag-tether", daemon=True).start()
    if nsa_diag_pid is not None and nsa_diag_pid not in _ancestors(ANCESTORS):
        _die()  # orphaned before the signal was asked for: it will never come
