"""`watch`'s status line (`nsa_diag.session.status.JobStatus`), fed beacon reads as the watchdog feeds it:
what it says of a job's steps, rate, slowdown, ETA and a pause, how often, and that its memory is bounded.
"""

from __future__ import annotations

import io
import time

import pytest

from nsa_diag.beacon import FLAG_SAVING, BeaconState
from nsa_diag.session import status as status_mod
from nsa_diag.session.status import JobStatus


def beacon(seq: int, t: float, step: int, *, end: bool = True, flags: int = 0) -> BeaconState:
    return BeaconState(
        seq=seq, time=t, step=step, layer=None, phase="step" if end else "forward", branch=None,
        event="end" if end else "begin", pid=1, heartbeat=seq, heartbeat_time=t, module=None, flags=flags,
    )  # fmt: skip


def feed(status: JobStatus, durations: list[float], monkeypatch: pytest.MonkeyPatch) -> float:
    """Steps of these durations, as the watchdog sees them end; the clock is the fake's."""
    now = 1000.0
    monkeypatch.setattr(status_mod.time, "time", lambda: now)
    status(beacon(2, now, 0, end=False), 0.0)
    for i, seconds in enumerate(durations, start=1):
        now += seconds
        status(beacon(2 + i, now, i), now - 1000.0)
    return now


def test_a_job_that_slows_down_gets_its_trend_and_an_eta_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps from 0.3 s to 0.9 s: the mean rate would promise too soon an end; the trend does not."""
    err = io.StringIO()
    status = JobStatus(err, total_steps=400, every_s=1e9)
    durations = [0.3 + 0.6 * i / 199 for i in range(200)]
    feed(status, durations, monkeypatch)
    slower = status.slowdown()
    assert slower is not None
    assert slower == pytest.approx(1.66, abs=0.01)  # the last 100 steps' mean over the first 100's
    eta = status.eta_s()
    assert eta is not None
    # the last steps' durations continued along their line: about 200 steps of 0.9 s and more
    assert 200 * 0.9 < eta < 200 * 1.6
    line = status.line(None, 60.0, None)
    assert "slower than the first 100" in line
    assert "ETA 3m" in line or "ETA 4m" in line


def test_a_quiet_job_is_said_at_once_with_why_and_then_only_now_and_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    err = io.StringIO()
    status = JobStatus(err, every_s=1e9)
    now = feed(status, [0.5] * 5, monkeypatch)
    assert err.getvalue() == ""  # nothing due yet
    monkeypatch.setattr(status_mod.time, "time", lambda: now + 15.0)
    status(beacon(7, now, 5, flags=FLAG_SAVING), 30.0)
    (line,) = err.getvalue().splitlines()
    assert line.startswith("nsa-diag watch 0m30s: step 5")
    assert "no progress for 15 s: writing or reading a checkpoint" in line
    status(beacon(7, now, 5, flags=FLAG_SAVING), 31.0)
    assert len(err.getvalue().splitlines()) == 1  # still quiet: said once


def test_its_memory_is_bounded_over_a_long_run(monkeypatch: pytest.MonkeyPatch) -> None:
    status = JobStatus(io.StringIO(), every_s=1e9)
    feed(status, [0.001] * 20_000, monkeypatch)
    assert len(status.first) == status_mod.FIRST_STEPS
    assert len(status.last) == status_mod.LAST_STEPS
    assert status.done == 20_000


def test_a_line_comes_every_so_often(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    status = JobStatus(err, every_s=0.0)
    status(None, 1.0)
    assert err.getvalue().startswith("nsa-diag watch 0m01s: starting (no progress reported yet)")
    assert time.monotonic() - status.said_at < 5


def test_on_a_terminal_the_line_lives_on_its_last_row_and_goes_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pseudo-terminal of 24 rows: the rows above the last become the scroll region (the job's output
    scrolls there), each update rewrites row 24 between a cursor save and restore, and closing gives the
    terminal its 24 rows back with the row cleared. Another process's output in between keeps its place."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    monkeypatch.setenv("TERM", "xterm")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    err = os.fdopen(slave, "w")
    try:
        status = JobStatus(err, every_s=0.0)
        assert status.live is not None
        status(None, 1.0)
        os.write(slave, b"step 1 loss 4.2\n")  # the job's output, echoed by the log process
        status(beacon(3, time.time(), 1), 2.0)
        status.close()
        status.close()  # once is enough: nothing more
        out = b""
        while True:
            import select

            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                break
            out += os.read(master, 65536)
    finally:
        err.close()
        os.close(master)
    text = out.decode()
    assert text.startswith("\r\n\x1b7\x1b[1;23r\x1b8\x1b[1A"), repr(text[:40])  # room, then the region
    assert text.count("\x1b[1;23r") == 1  # set once
    first = "\x1b7\x1b[24;1H\x1b[2Knsa-diag watch 0m01s: starting (no progress reported yet)\x1b8"
    assert first in text
    assert (
        text.index(first)
        < text.index("step 1 loss 4.2")
        < text.index("\x1b[24;1H\x1b[2Knsa-diag watch 0m02s")
    )
    assert text.endswith("\x1b7\x1b[r\x1b[24;1H\x1b[2K\x1b8")  # the whole height back, the row cleared
    assert "\n" not in text.split("step 1 loss 4.2")[1].replace("\r\n", "", 1)  # the line adds no newline


def test_a_dumb_terminal_gets_the_periodic_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import pty

    monkeypatch.setenv("TERM", "dumb")
    master, slave = pty.openpty()
    err = os.fdopen(slave, "w")
    try:
        assert JobStatus(err).live is None
        assert JobStatus(err).every_s == status_mod.EVERY_S
    finally:
        err.close()
        os.close(master)
