"""The one stop routine (`nsa_diag.stopping`) on real processes: nothing of the tree is left alive, also a
process that ignores SIGTERM, left its parent's session or was reparented; a pid that is no longer the
process that was seen is never signalled; the report says what it took, as result.json records it.

The first two tests were `test_watchdog.py`'s tests of ``terminate_group``, which this routine replaced.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import psutil
import pytest

from nsa_diag.guard import CASE_ENV, sweep
from nsa_diag.stopping import ProcessTree, alive, stop_tree

# A process group whose child ignores SIGTERM and whose grandchild sleeps: all must go.
_STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", ignore])
print(child.pid, flush=True)
time.sleep(60)
"""

# A process that ignores SIGTERM and says its pid once it does.
_IGNORE = (
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); "
    "time.sleep(60)"
)
# A parent that ends on SIGTERM, and its child in a session of its own that ignores it.
_LEAVER = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {_IGNORE!r}], start_new_session=True)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@contextlib.contextmanager
def _started(code: str, **kw: object) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``python -c code`` in a session of its own, and the first number it prints; killed afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        **kw,  # type: ignore[call-overload]
    )
    assert proc.stdout is not None
    number = int(proc.stdout.readline())
    try:
        yield proc, number
    finally:
        _kill([proc.pid, number])
        proc.wait()


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def test_a_session_whose_processes_ignore_sigterm_is_killed() -> None:
    with _started(_STUBBORN) as (proc, child):
        assert os.getpgid(child) == proc.pid
        start = time.monotonic()
        report = stop_tree(ProcessTree([proc.pid]), proc, grace_s=0.5)
        assert time.monotonic() - start < 5
        assert report["sigterm"]
        assert report["sigkill"]
        assert proc.returncode == -signal.SIGKILL
        assert report["exit_code"] == -signal.SIGKILL
        assert not report.get("survivors")
        for pid in (proc.pid, child):
            assert _gone(pid)


def test_a_clean_exit_sends_nothing() -> None:
    """Nothing alive: no signal; the exit code is reported (the routine's, for every launcher)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    report = stop_tree(ProcessTree([proc.pid]), proc, grace_s=0.5)
    assert report.model_dump() == {"sigterm": False, "sigkill": False, "exit_code": 0}


def test_a_process_that_ends_on_sigterm_gets_no_sigkill_and_is_named() -> None:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        start = time.monotonic()
        report = stop_tree(ProcessTree([proc.pid]), proc, grace_s=10, name_signalled=True)
        assert time.monotonic() - start < 5  # the grace period ends when the tree does
        assert report.model_dump() == {
            "sigterm": True, "sigkill": False, "signalled": [proc.pid], "exit_code": -signal.SIGTERM,
        }  # fmt: skip
    finally:
        _kill([proc.pid])
        proc.wait()


@pytest.mark.parametrize("follow", [True, False], ids=["follow", "session-only"])
def test_follow_takes_a_child_that_left_the_session_even_reparented(follow: bool) -> None:
    """The parent ends on SIGTERM; its child (a session of its own, ignoring SIGTERM) is reparented then,
    and still SIGKILLed as the tree's. Without ``follow``, the tree is the parent's session alone."""
    with _started(_LEAVER) as (proc, child):
        assert os.getsid(child) == child
        report = stop_tree(ProcessTree([proc.pid], [proc.pid], follow=follow), proc, grace_s=0.5)
        assert proc.returncode == -signal.SIGTERM
        assert _gone(child) is follow
        assert report["sigkill"] is follow
        assert not report.get("survivors")


def test_a_handle_that_is_no_longer_its_process_is_never_signalled() -> None:
    """A process seen earlier has ended and its pid went to another: the tree leaves that one alone."""

    class Ended:
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def is_running(self) -> bool:
            return False

    with _started(_IGNORE) as (other, _):
        report = stop_tree(ProcessTree(pids=[Ended(other.pid)]), grace_s=0.2)
        assert report.model_dump() == {"sigterm": False, "sigkill": False}
        assert alive(other.pid)
        assert stop_tree(ProcessTree(pids=[psutil.Process(other.pid)]), grace_s=0.2)["sigkill"]
        assert _gone(other.pid)


def test_the_sweep_stops_every_marked_process_and_names_it() -> None:
    marker = f"/nowhere/stopping-test-{os.getpid()}"
    with _started(_IGNORE, env={**os.environ, CASE_ENV: marker}) as (marked, _):
        assert sweep(marker, grace_s=0.3) == [marked.pid]
        marked.wait(timeout=5)
        assert marked.returncode == -signal.SIGKILL
        assert sweep(marker, grace_s=0.3) == []
