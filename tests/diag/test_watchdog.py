"""The watchdog's decisions on synthetic beacon histories (pure), and the end of a process group (real).

`decide` must call a worker stalled only when its progress counter stops (heartbeat ticks are not
progress), give setup its grace, and call a worker that keeps progressing past its timeout slow, with a
rate and an ETA. `terminate_group` must leave nothing of a case alive, also a child that ignores SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from nsa_diag.spec import CaseSpec
from nsa_diag.watchdog import (
    EXIT_STALL_S,
    SETUP_STALL_S,
    Observation,
    compact,
    decide,
    heartbeat_alive,
    progress_rate,
    steps_done,
    terminate_group,
)
from nsa_diag.worker.beacon import BeaconState

T0 = 1_000_000.0


def beacon(
    seq: int,
    t: float,
    *,
    phase: str | None = "forward",
    step: int | None = 1,
    layer: int | None = None,
    event: str | None = "begin",
    heartbeat: int = 10,
    heartbeat_time: float | None = None,
) -> BeaconState:
    return BeaconState(
        seq=seq, time=t, step=step, layer=layer, phase=phase, branch=None, event=event, pid=1234,
        heartbeat=heartbeat, heartbeat_time=t if heartbeat_time is None else heartbeat_time, module=None,
    )  # fmt: skip


def spec(**kwargs: object) -> CaseSpec:
    return CaseSpec(**{"stall": 2.0, "timeout": 10.0, "steps": 4, **kwargs})  # type: ignore[arg-type]


def history(*states: tuple[float, BeaconState | None]) -> list[Observation]:
    return [Observation(T0, None), *(Observation(T0 + dt, s) for dt, s in states)]


def test_running_while_progress_is_recent() -> None:
    h = history((0.5, beacon(1, T0 + 0.4, phase="setup")), (1.0, beacon(5, T0 + 0.9)))
    assert decide(h, T0 + 1.0, spec()).status == "running"


def test_stalled_when_the_progress_counter_stops_although_the_heartbeat_ticks() -> None:
    stuck = [
        (1.0 + 0.2 * i, beacon(7, T0 + 1.0, heartbeat=10 + i, heartbeat_time=T0 + 1.0 + 0.2 * i))
        for i in range(12)
    ]
    h = history(*stuck)
    assert decide(h, T0 + 2.9, spec()).status == "running"
    d = decide(h, T0 + 3.1, spec())
    assert d.status == "stalled"
    assert d.idle_s == pytest.approx(2.1)
    assert d.stall_limit_s == 2.0


def test_setup_gets_a_longer_stall_limit_and_so_does_a_missing_beacon() -> None:
    h = history((0.2, beacon(1, T0 + 0.1, phase="setup", step=None)))
    assert decide(h, T0 + 10.0, spec()).status == "running"
    assert decide(h, T0 + SETUP_STALL_S + 1, spec(timeout=100)).status == "stalled"
    assert decide(history(), T0 + 10.0, spec()).status == "running"
    d = decide(history(), T0 + SETUP_STALL_S + 0.1, spec(timeout=100))
    assert (d.status, d.stall_limit_s) == ("stalled", SETUP_STALL_S)
    ended = history((0.2, beacon(2, T0 + 0.1, phase="setup", step=None, event="end")))
    assert decide(ended, T0 + 2.2, spec()).status == "stalled"


def test_the_exit_after_done_gets_a_longer_stall_limit() -> None:
    h = history((0.2, beacon(40, T0 + 0.2, phase="done", step=None, event="end")))
    assert decide(h, T0 + 5.0, spec()).status == "running"
    d = decide(h, T0 + EXIT_STALL_S + 1, spec(timeout=100))
    assert (d.status, d.stall_limit_s) == ("stalled", EXIT_STALL_S)


def test_a_user_stall_longer_than_the_setup_grace_wins() -> None:
    h = history((0.2, beacon(1, T0 + 0.1, phase="setup", step=None)))
    assert decide(h, T0 + SETUP_STALL_S + 5, spec(stall=SETUP_STALL_S + 10, timeout=600)).status == "running"


def test_timeout_while_progress_continues_is_slow_and_stall_wins_over_timeout() -> None:
    h = history(*[(t, beacon(int(t * 10), T0 + t)) for t in (2.0, 5.0, 9.0, 10.4)])
    assert decide(h, T0 + 10.5, spec()).status == "timeout"
    assert decide(h, T0 + 12.5, spec()).status == "stalled"


def test_steps_done_from_the_beacon() -> None:
    assert steps_done(None, 4) == 0
    assert steps_done(beacon(3, T0, step=1, phase="forward"), 4) == 0
    assert steps_done(beacon(3, T0, step=2, phase="backward"), 4) == 1
    assert steps_done(beacon(3, T0, step=2, phase="step", event="end"), 4) == 2
    assert steps_done(beacon(3, T0, step=None, phase="done", event="end"), 4) == 4


def test_rate_and_eta_from_events_per_step() -> None:
    # Each step is 100 events and takes 2 s; at t=5 the worker is half way through step 3 of 4.
    reads = [(float(t), beacon(1 + 50 * t, T0 + t, step=t // 2 + 1)) for t in range(0, 6)]
    h = history(*reads)
    rate = progress_rate(h, T0 + 5.0, spec(steps=4))
    assert rate["steps_done"] == 2
    assert rate["fraction_done"] == pytest.approx(2.5 / 4)
    assert rate["eta_s"] == pytest.approx(5.0 / (2.5 / 4) - 5.0, abs=0.1)
    assert rate["events_per_s"] == pytest.approx(50.0)
    assert rate["steps_per_s"] == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("phase", "layer", "fraction"),
    [("forward", 1, 1 / 4 / 3), ("backward", 3, 1 / 3 + 1 / 4 * 2 / 3), ("optimizer", None, 0.99)],
)
def test_rate_in_the_first_step_comes_from_phase_and_layer(
    phase: str, layer: int | None, fraction: float
) -> None:
    h = history(
        (1.0, beacon(2, T0 + 1.0, step=1, phase="step")),
        (4.0, beacon(9, T0 + 4.0, phase=phase, layer=layer, event="begin")),
    )
    rate = progress_rate(h, T0 + 4.0, spec(steps=2), layers=4)
    assert rate["fraction_done"] == pytest.approx(fraction / 2, abs=1e-3)
    assert rate["eta_s"] > 0


def test_rate_without_any_beacon() -> None:
    rate = progress_rate(history(), T0 + 3.0, spec())
    assert rate["steps_done"] == 0
    assert "eta_s" not in rate


def test_heartbeat_alive() -> None:
    assert heartbeat_alive(None, T0) is None
    assert heartbeat_alive(beacon(1, T0, heartbeat=0), T0) is None
    assert heartbeat_alive(beacon(1, T0, heartbeat=5, heartbeat_time=T0 - 0.3), T0) is True
    assert heartbeat_alive(beacon(1, T0, heartbeat=5, heartbeat_time=T0 - 1.5), T0) is False


def test_compact_keeps_start_first_read_of_every_step_and_the_tail() -> None:
    reads = [(0.2 * i, beacon(i + 1, T0 + 0.2 * i, step=1 + i // 100)) for i in range(1000)]
    h = history(*reads)
    small = compact(h, keep_tail=20)
    assert small[0] == h[0]
    assert small[-20:] == h[-20:]
    assert len(small) < 40
    firsts: dict[int, int] = {}
    for o in small:
        if o.state is not None and o.state.step is not None:
            firsts.setdefault(o.state.step, o.state.seq)
    assert firsts == {s: 1 + 100 * (s - 1) for s in range(1, 11)}
    assert decide(small, T0 + 200.0, spec(timeout=1e6)) == decide(h, T0 + 200.0, spec(timeout=1e6))
    assert progress_rate(small, T0 + 200.0, spec(steps=20)) == progress_rate(h, T0 + 200.0, spec(steps=20))


# A process group whose child ignores SIGTERM and whose grandchild sleeps: all must go.
_STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", ignore])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_terminate_group_kills_every_process_of_the_session() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUBBORN],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert os.getpgid(child) == proc.pid
    start = time.monotonic()
    report = terminate_group(proc, grace_s=0.5)
    assert time.monotonic() - start < 5
    assert report["sigterm"]
    assert report["sigkill"]
    assert proc.returncode == -signal.SIGKILL
    assert not report.get("survivors")
    for pid in (proc.pid, child):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_terminate_group_after_a_clean_exit_sends_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    report = terminate_group(proc, grace_s=0.5)
    assert report == {"sigterm": False, "sigkill": False}
