"""The watchdog's decisions on synthetic beacon histories (pure).

`decide` must call a worker stalled only when its progress counter stops (heartbeat ticks are not
progress), give setup its grace, and call a worker that keeps progressing past its timeout slow, with a
rate and an ETA. With ``--stall auto`` the limit must follow the first step: the start-up limit before
it, the first-step limit during it, max(floor, factor x its duration) after it; two real cases check that
an auto limit catches a deadlock after step 1 within that limit and lets a slow step run.
(The end of a process group: `test_stopping.py`.)
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from nsa_diag import artifacts
from nsa_diag.beacon import BeaconState
from nsa_diag.executor import run_case
from nsa_diag.spec import CaseSpec, CommandSpec, Injection
from nsa_diag.watchdog import (
    AUTO_FACTOR,
    AUTO_FIRST_STEP_S,
    AUTO_FLOOR_S,
    AUTO_JOB_S,
    AUTO_START_S,
    EXIT_STALL_S,
    EXPORT_STALL_S,
    SETUP_STALL_S,
    Observation,
    ProcRead,
    compact,
    decide,
    first_step_s,
    heartbeat_alive,
    process_ended,
    progress_rate,
    step_intervals,
    steps_done,
)

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
    pid: int = 1234,
) -> BeaconState:
    return BeaconState(
        seq=seq, time=t, step=step, layer=layer, phase=phase, branch=None, event=event, pid=pid,
        heartbeat=heartbeat, heartbeat_time=t if heartbeat_time is None else heartbeat_time, module=None,
    )  # fmt: skip


def spec(**kwargs: object) -> CaseSpec:
    return CaseSpec(**{"stall": 2.0, "timeout": 10.0, "steps": 4, **kwargs})  # type: ignore[arg-type]


def history(*states: tuple[float, BeaconState | None]) -> list[Observation]:
    return [Observation(T0, None), *(Observation(T0 + dt, s) for dt, s in states)]


def test_a_unit_whose_process_exited_has_ended_and_one_alive_has_not() -> None:
    # a helper a job ran and reaped (its beacon at done) is never judged again; this process is alive
    helper = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    gone = int(helper.stdout)
    done = beacon(3, T0 + 0.5, phase="done", step=None)
    assert process_ended(history((1.0, replace(done, pid=gone))))
    assert not process_ended(history((1.0, replace(done, pid=os.getpid()))))
    assert not process_ended(history((1.0, None)))


def test_a_child_that_ended_since_its_evidence_showed_work_counts_as_working(tmp_path: Path) -> None:
    """A Pool's worker that worked while the evidence was taken and ended since (its last task done, while
    the other units were sampled) is judged by that evidence: the process waiting for it is paused. One
    that had ended before (no evidence taken) does not work; nor one whose evidence shows none."""
    from nsa_diag.classify import Evidence
    from nsa_diag.results import Observed, unit_work
    from nsa_diag.watchdog import HangEvidence, WatchResult

    helper = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    gone = int(helper.stdout)
    seen = WatchResult("stalled", history((1.0, beacon(1, T0 + 0.5, phase="setup", pid=gone))), None, None)
    child = Observed("pid 4242", tmp_path, seen, HangEvidence(progressed=True))
    assert process_ended(seen.history)
    worked = Evidence(outcome="stalled", progressed=True)
    assert unit_work(child, worked, progress=False) == "a progress event came while the evidence was taken"
    assert unit_work(child, Evidence(outcome="stalled", progressed=False), progress=False) is None
    assert unit_work(replace(child, hang=None), None, progress=False) is None


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


def test_a_restarted_stall_clock_delays_the_stall_but_the_silence_counts_from_the_last_progress() -> None:
    """After a pause (`Watcher.rearm`) the stall clock starts again; the evidence's "no progress for" is
    the time since the unit's last progress event all the same (a rank that had slept 5 s said 0.0 s)."""
    h = history((1.0, beacon(7, T0 + 1.0)), (2.0, beacon(7, T0 + 1.0)))
    d = decide(h, T0 + 6.0, spec(), since=T0 + 5.0)
    assert d.status == "running"
    assert d.idle_s == pytest.approx(1.0)
    assert d.silence_s == pytest.approx(5.0)
    later = decide(h, T0 + 7.5, spec(), since=T0 + 5.0)
    assert later.status == "stalled"
    assert (later.idle_s, later.silence_s) == (pytest.approx(2.5), pytest.approx(6.5))


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


def test_writing_the_profile_after_the_steps_gets_the_export_limit() -> None:
    # m7c-125m with --profile on an H100: 1 s steps (auto limit 10 s), then 12 s writing trace.json
    exporting = history((0.2, beacon(40, T0 + 0.2, phase="export", step=2, event="begin")))
    d = decide(exporting, T0 + 15.0, spec(timeout=100))
    assert (d.status, d.stall_limit_s) == ("running", EXPORT_STALL_S)
    assert decide(exporting, T0 + EXPORT_STALL_S + 1, spec(timeout=200)).status == "stalled"
    written = history((0.2, beacon(41, T0 + 0.2, phase="export", step=2, event="end")))
    assert decide(written, T0 + 3.0, spec(timeout=100)).status == "stalled"  # back to the step's limit


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


# --- --stall auto ----------------------------------------------------------------------------------------


def auto_spec(**kwargs: object) -> CaseSpec:
    return spec(stall="auto", timeout=1e6, **kwargs)


def auto_run(first: float) -> list[Observation]:
    """Setup ends at 5 s, step 1 takes `first` seconds (events every 0.1 s), step 2 starts right after."""
    reads: list[tuple[float, BeaconState | None]] = [
        (1.0, beacon(1, T0 + 1.0, phase="setup", step=None)),
        (5.0, beacon(2, T0 + 5.0, phase="setup", step=None, event="end")),
    ]
    n = max(int(first / 0.1), 1)
    for i in range(1, n):
        reads.append((5.0 + 0.1 * i, beacon(2 + i, T0 + 5.0 + 0.1 * i, step=1, layer=i % 4)))
    reads.append((5.0 + first, beacon(2 + n, T0 + 5.0 + first, step=1, phase="step", event="end")))
    reads.append((5.0 + first + 0.05, beacon(3 + n, T0 + 5.0 + first + 0.05, step=2, phase="step")))
    return history(*reads)


def test_auto_before_the_first_step_allows_the_start_up_limit() -> None:
    d = decide(history(), T0 + AUTO_START_S - 1, auto_spec())
    assert (d.status, d.stall_limit_s) == ("running", AUTO_START_S)
    assert "start-up" in d.limit_reason
    h = history((0.5, beacon(1, T0 + 0.5, phase="setup", step=None)))
    assert decide(h, T0 + 0.5 + AUTO_START_S - 1, auto_spec()).status == "running"
    d = decide(h, T0 + 0.5 + AUTO_START_S + 0.1, auto_spec())
    assert (d.status, d.stall_limit_s) == ("stalled", AUTO_START_S)


def test_auto_during_the_first_step_bounds_each_gap_by_the_first_step_limit() -> None:
    h = history(
        (5.0, beacon(2, T0 + 5.0, phase="setup", step=None, event="end")),
        (5.2, beacon(3, T0 + 5.2, step=1, phase="forward", layer=0)),
    )
    assert first_step_s(h) is None
    d = decide(h, T0 + 5.2 + AUTO_FIRST_STEP_S - 1, auto_spec())
    assert (d.status, d.stall_limit_s) == ("running", AUTO_FIRST_STEP_S)
    assert "step 1 not finished" in d.limit_reason
    assert decide(h, T0 + 5.2 + AUTO_FIRST_STEP_S + 0.1, auto_spec()).status == "stalled"


def test_auto_after_a_fast_first_step_is_the_floor() -> None:
    h = auto_run(first=0.5)
    assert first_step_s(h) == pytest.approx(0.5)
    last = T0 + 5.55
    assert decide(h, last + AUTO_FLOOR_S - 0.1, auto_spec()).status == "running"
    d = decide(h, last + AUTO_FLOOR_S + 0.1, auto_spec())
    assert (d.status, d.stall_limit_s) == ("stalled", AUTO_FLOOR_S)
    assert d.limit_reason == f"auto: 3 x longest step 0.50 s = 1.5 s -> floor {AUTO_FLOOR_S:g} s"


def test_auto_after_a_slow_first_step_is_factor_times_it() -> None:
    h = auto_run(first=20.0)
    assert first_step_s(h) == pytest.approx(20.0)
    limit = AUTO_FACTOR * 20.0
    last = T0 + 25.05
    assert decide(h, last + limit - 1, auto_spec()).status == "running"  # a fixed 30 s would call it hung
    d = decide(h, last + limit + 0.1, auto_spec())
    assert (d.status, d.stall_limit_s) == ("stalled", pytest.approx(limit))
    assert d.limit_reason == "auto: 3 x longest step 20.00 s = 60.0 s"


def test_auto_first_step_end_seen_only_as_step_2_and_exit_after_done() -> None:
    h = history(
        (4.0, beacon(2, T0 + 4.0, phase="setup", step=None, event="end")),
        (4.5, beacon(3, T0 + 4.5, step=1)),
        (10.0, beacon(9, T0 + 10.0, step=2, phase="forward")),  # the end of step 1 fell between reads
    )
    assert first_step_s(h) == pytest.approx(6.0)
    assert decide(h, T0 + 10.0 + 17.9, auto_spec()).stall_limit_s == pytest.approx(18.0)
    done = [*h, Observation(T0 + 12.0, beacon(20, T0 + 12.0, phase="done", step=None, event="end"))]
    d = decide(done, T0 + 12.0 + EXIT_STALL_S - 1, auto_spec())
    assert (d.status, d.stall_limit_s) == ("running", EXIT_STALL_S)
    assert d.limit_reason.startswith("auto: 3 x longest step 6.00 s")


def test_a_number_is_the_limit_and_says_so() -> None:
    h = auto_run(first=20.0)
    d = decide(h, T0 + 25.05 + 2.1, spec(stall=2.0, timeout=1e6))
    assert (d.status, d.stall_limit_s, d.limit_reason) == ("stalled", 2.0, "--stall 2 s")
    d = decide(history(), T0 + 1.0, spec(stall=2.0))
    assert (d.stall_limit_s, d.limit_reason) == (
        SETUP_STALL_S,
        f"--stall 2 s; setup allows {SETUP_STALL_S:g} s",
    )


def test_compact_keeps_the_first_step_measurement() -> None:
    reads: list[tuple[float, BeaconState | None]] = [
        (0.2 * i, beacon(i + 1, T0 + 0.2 * i, phase="setup", step=None)) for i in range(1, 29)
    ]
    reads.append((5.8, beacon(30, T0 + 5.8, phase="setup", step=None, event="end")))
    reads += [(6.0 + 0.2 * i, beacon(31 + i, T0 + 6.0 + 0.2 * i, step=1 + i // 50)) for i in range(1000)]
    h = history(*reads)
    small = compact(h, keep_tail=20)
    assert len(small) < 60
    assert first_step_s(small) == first_step_s(h) == pytest.approx(16.0 - 5.8)  # setup's end to step 2
    assert decide(small, T0 + 300.0, auto_spec()) == decide(h, T0 + 300.0, auto_spec())


# End to end: a real worker of the tiny model on the CPU under --stall auto.

_MEASURED = re.compile(r"longest step (\d+\.\d+) s")
_IDLE = re.compile(r"no progress for (\d+\.\d+) s")


def _steps_from_progress(case_dir: Path) -> list[float]:
    """Each step's duration, optimizer step to optimizer step (step 1 from the end of setup), from the
    worker's own progress.jsonl."""
    bounds: list[float] = []
    for line in (case_dir / artifacts.PROGRESS).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("phase") == "setup" and rec.get("event") == "end":
            bounds = [rec["t"]]
        if rec.get("phase") == "step" and rec.get("event") == "end" and bounds:
            bounds.append(rec["t"])
    assert len(bounds) >= 2
    return [b - a for a, b in itertools.pairwise(bounds)]


def _first_step_from_progress(case_dir: Path) -> float:
    """Setup end to the end of step 1, from the worker's own progress.jsonl."""
    return _steps_from_progress(case_dir)[0]


@pytest.mark.slow
def test_auto_calls_a_deadlock_after_step_1_a_hang_within_the_computed_limit(tmp_path: Path) -> None:
    case = CaseSpec(
        name="auto-deadlock", seq_len=64, steps=2, device="cpu", timeout=120.0,
        inject=(Injection.parse("deadlock:layer=1,step=2"),),
    )  # fmt: skip
    assert case.stall == "auto"
    result = run_case(case, tmp_path / "c")
    assert (result.verdict, result.hang_kind) == ("hang", "python-deadlock"), result.reason
    assert result.stall_limit_reason is not None
    measured = _MEASURED.search(result.stall_limit_reason)
    assert measured, result.stall_limit_reason
    first = float(measured.group(1))
    assert first == pytest.approx(_first_step_from_progress(tmp_path / "c"), abs=0.5)
    assert result.stall_limit_s == pytest.approx(max(AUTO_FLOOR_S, AUTO_FACTOR * first), abs=0.02)
    idle = _IDLE.search(result.reason)
    assert idle, result.reason
    assert result.stall_limit_s - 0.05 <= float(idle.group(1)) < result.stall_limit_s + 3.0  # reason: 0.1 s
    on_disk = artifacts.read_json(tmp_path / "c" / artifacts.RESULT)
    assert on_disk["stall_limit_reason"] == result.stall_limit_reason


@pytest.mark.slow
def test_auto_lets_a_slow_step_run_and_calls_it_slow(tmp_path: Path) -> None:
    # Every step sleeps 4 s in layer 0's backward: the first step measures it, so the limit rises above
    # the floor and the 4 s gaps of later steps are progress, not a hang. The timeout leaves room for the
    # first step on a loaded CI machine (start-up there took over 16 s with three test workers on 2 cores).
    case = CaseSpec(
        name="auto-slow", seq_len=64, steps=20, device="cpu", timeout=40.0,
        inject=(Injection.parse("slow:layer=0,seconds=4"),),
    )  # fmt: skip
    result = run_case(case, tmp_path / "c")
    assert result.verdict == "slow", result.reason
    assert result.steps_done >= 1
    assert result.stall_limit_s is not None
    assert result.stall_limit_s > AUTO_FLOOR_S
    assert result.stall_limit_reason is not None
    measured = _MEASURED.search(result.stall_limit_reason)
    assert measured, result.stall_limit_reason
    longest = float(measured.group(1))
    assert longest >= 4.0
    # the longest step seen when the limit was last computed: step 1 (warm-up), or a later step that a
    # loaded machine slowed more
    steps = _steps_from_progress(tmp_path / "c")
    assert any(abs(longest - step) <= 0.5 for step in steps), (longest, steps)
    assert longest >= steps[0] - 0.5
    assert result.stall_limit_s == pytest.approx(AUTO_FACTOR * longest, abs=0.02)


# --- work below the block events (liveness), steps of a user's job, pauses -----------------------------


def live(seq: int, t: float, *, moves: int = 0, allocs: int = 0, flags: int = 0, **kw: object) -> BeaconState:
    """A beacon whose heartbeat thread reports liveness counters (`nsa_diag.probe.liveness`)."""
    from dataclasses import replace

    return replace(beacon(seq, t, **kw), moves=moves, allocs=allocs, flags=flags)  # type: ignore[arg-type]


def stuck_in_layer(*, moves_per_read: int = 0, allocs_per_read: int = 0, cpu_per_read: float = 0.0) -> list:
    """Layer 0's forward began at T0 + 1 and no event came since; 30 reads 0.2 s apart with the given growth
    of the liveness counters and of the process's CPU seconds."""
    reads = []
    for i in range(1, 31):
        t = 1.0 + 0.2 * i
        state = live(5, T0 + 1.0, layer=0, moves=moves_per_read * i, allocs=allocs_per_read * i)
        reads.append(Observation(T0 + t, state, ProcRead(cpu_per_read * i, 1000)))
    return [Observation(T0, None), *reads]


def test_a_unit_that_works_past_its_stall_limit_is_running_and_slow_at_the_timeout() -> None:
    cases = {
        "allocs": stuck_in_layer(allocs_per_read=12),  # a GPU loop of small ops: each allocates
        "moves": stuck_in_layer(moves_per_read=1, cpu_per_read=0.19),  # a Python per-token loop at 95%
    }
    for signal_name, h in cases.items():
        d = decide(h, T0 + 7.0, spec(stall=3.0, timeout=100))
        assert d.status == "running", signal_name
        assert d.work is not None
        assert d.work.signals == [signal_name]
        assert "in the last 3 s" in d.work.describe()
        assert decide(h, T0 + 7.0, spec(stall=3.0, timeout=5)).status == "timeout"  # slow, not hang


def test_cpu_alone_or_a_still_frame_is_no_work_and_a_moving_frame_without_cpu_is_a_poll() -> None:
    for h in (
        stuck_in_layer(cpu_per_read=0.2),  # busy, but on one line: a spin
        stuck_in_layer(moves_per_read=1),  # moves, no CPU: a loop that sleeps between polls
        stuck_in_layer(),
    ):
        d = decide(h, T0 + 7.0, spec(stall=3.0, timeout=100))
        assert d.status == "stalled"
        assert d.work is not None
        assert not d.work.working
        assert d.work.describe().startswith("no work in the last 3 s")


def test_io_bytes_are_work() -> None:
    h = [Observation(T0, None)] + [
        Observation(T0 + 1 + 0.2 * i, live(5, T0 + 1.0), ProcRead(0.0, i * (1 << 19))) for i in range(1, 31)
    ]
    d = decide(h, T0 + 7.0, spec(stall=3.0, timeout=100))
    assert d.status == "running"
    assert d.work is not None
    assert d.work.signals == ["io"]


def test_rearm_starts_the_stall_clock_again() -> None:
    h = stuck_in_layer()
    assert decide(h, T0 + 7.0, spec(stall=3.0, timeout=100)).status == "stalled"
    d = decide(h, T0 + 7.0, spec(stall=3.0, timeout=100), since=T0 + 5.0)
    assert (d.status, d.idle_s) == ("running", pytest.approx(2.0))


def job_spec(**kwargs: object) -> CaseSpec:
    return spec(command=CommandSpec(argv=("python", "train.py"), cwd="/tmp"), **kwargs)


def test_a_jobs_steps_run_optimizer_step_to_optimizer_step_and_one_limit_holds_from_its_start() -> None:
    # The first hook of step 1 comes after the DataLoader's first batch: a job's step 1 is not measured.
    h = history(
        (0.5, beacon(2, T0 + 0.4, step=1)),
        (0.6, beacon(9, T0 + 0.55, phase="step", event="end", step=1)),
        (3.7, beacon(10, T0 + 3.6, step=2)),  # 3 s reading the next batch
        (3.8, beacon(19, T0 + 3.75, phase="step", event="end", step=2)),
    )
    assert step_intervals(h, from_first_event=False) == [pytest.approx(3.2)]
    assert step_intervals(h)[0] == pytest.approx(0.15)  # our worker's rule: from step 1's first event
    d = decide(h, T0 + 4.0, job_spec(stall="auto", timeout=600))
    assert d.stall_limit_s == AUTO_JOB_S
    assert d.limit_reason == "auto: 3 x longest step 3.20 s = 9.6 s -> floor 30 s"
    before = decide(h[:3], T0 + 1.0, job_spec(stall="auto", timeout=600))
    assert before.stall_limit_s == AUTO_JOB_S
    assert "no step measured yet" in before.limit_reason
    # before any progress (start-up, rendezvous, the first batch): the same limit, not a longer one
    start = decide(history(), T0 + AUTO_JOB_S + 0.1, job_spec(stall="auto", timeout=None))
    assert (start.status, start.stall_limit_s) == ("stalled", AUTO_JOB_S)
    slow_steps = history(
        (0.5, beacon(2, T0 + 0.4, step=1)),
        (0.6, beacon(9, T0 + 0.55, phase="step", event="end", step=1)),
        (20.7, beacon(19, T0 + 20.6, phase="step", event="end", step=2)),
    )
    assert decide(slow_steps, T0 + 21.0, job_spec(stall="auto")).stall_limit_s == pytest.approx(3 * 20.05)


def test_a_job_without_a_time_box_never_times_out() -> None:
    h = history((0.5, beacon(2, T0 + 0.4, step=1)), (1e5, beacon(3, T0 + 1e5 - 0.1, step=1)))
    assert decide(h, T0 + 1e5, job_spec(stall="auto", timeout=None)).status == "running"
    assert decide(h, T0 + 1e5, job_spec(stall="auto", timeout=600)).status == "timeout"


def test_steps_done_of_a_job_are_not_capped_by_the_cases_steps() -> None:
    state = beacon(400, T0, phase="step", event="end", step=20)
    assert steps_done(state, 1) == 1
    assert steps_done(state, sys.maxsize) == 20
