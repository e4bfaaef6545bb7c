"""The watchdog: pure decisions over beacon reads, the short polling loop, and stopping a case's processes.

`decide` looks at the history of beacon reads and says whether the worker is running, stalled or past
``spec.timeout`` while still making progress (slow). Stalled means no work, not only no progress event:
no new event for the stall limit (heartbeat ticks are not progress) **and** none of the liveness signals
below the block events moved in the recent past (`work_in`): the CUDA caching allocator's allocations, the
main thread's innermost Python frame or line moving while it uses the CPU, bytes read or written
(`nsa_diag.probe.liveness` writes the first two into the beacon; the loop reads /proc for the others). A
unit that works past its stall limit is still running, and `slow` when its time runs out, with what showed
the work. The stall limit is ``spec.stall`` seconds, or with ``--stall auto`` (the default) derived from
the steps measured so far, optimizer step to optimizer step (`stall_limit`). `progress_rate` gives the
rate and the time a slow case would still need.
Both are pure functions of `Observation` lists, tested without processes. `Watcher` is the polling loop, over
the beacons of every unit of a job (one for a worker, one per local rank under torchrun); it can be resumed
after the executor found a stalled unit only paused (a sleep, a checkpoint written, a DataLoader batch read),
with that unit's stall clock started again (`Watcher.rearm`).
`gather_hang_evidence` is the escalation before any kill: memory at the hang (asked of the worker's
heartbeat thread), two faulthandler stack samples a second apart with the CPU% and heartbeat between them,
``/proc`` state, py-spy, GPU state. Stopping the case's processes afterwards is `nsa_diag.stopping`'s.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from nsa_diag import artifacts
from nsa_diag.beacon import FLAG_DATALOADER, FLAG_SAVING, BeaconState, read_beacon
from nsa_diag.evidence import gpu, procfs, stacks
from nsa_diag.records import CaseEvidence, GpuFiles, MemoryDump, Rate, WorkSeen
from nsa_diag.spec import CaseSpec, past_timeout
from nsa_diag.stopping import alive

Status = Literal["running", "stalled", "timeout"]
POLL_S = 0.2
# The worker imports torch and builds the model in phase "setup", which reports no progress inside: until
# setup ends, a stall needs at least this long (a wedged CUDA or NCCL init is still caught). On a loaded
# machine importing torch alone has taken over 20 s.
SETUP_STALL_S = 60.0
# After "done" the worker writes its result and the interpreter shuts down (torch teardown, garbage
# collection): seconds on a loaded machine, which are not a hang of the training step. Longer is one.
EXIT_STALL_S = 30.0
# Writing the profiler's trace and memory timeline, or the CUDA memory snapshot, after the steps ("export"
# phase): no progress inside, and it grows with the recorded history, not with the step (12 s after 1 s
# steps of m7c-125m on an H100). It gets the start-up limit.
EXPORT_STALL_S = 120.0
# --stall auto (the default). Progress events come per block, branch and phase, so what the limit bounds is
# the gap since the last event, and any such gap of a step is at most as long as the whole step: factor x
# the longest step so far is then safe by construction. A step runs from one optimizer step to the next
# (data loading, checkpointing, evaluation and logging included); our worker's first step runs from the end
# of its setup (it loads no data) and includes the one-off warm-up (lazy imports, allocator growth,
# CUDA/cuDNN/Triton warm-up, the reference check).
# - Before the first step (setup: torch import, model build, CUDA/NCCL init): AUTO_START_S.
# - Until a step has been measured: each gap gets AUTO_FIRST_STEP_S (a 125M-parameter block on the CPU at
#   S=2048 takes seconds, not minutes; a wedged step 1 is still caught within two minutes). A user's job
#   (`watch`) has no known start for its first step (its data loader starts before any hook sees it): its
#   first measured step is the second.
# - Then: max(floor, AUTO_FACTOR x the longest step). The factor 3 absorbs a machine that gets loaded
#   mid-run (another job, swapping, CPU frequency, a GC pause) slowing a step two- to threefold. The floor of
#   our worker's cases, AUTO_FLOOR_S 10 s, keeps a millisecond step of a tiny model from being called hung
#   over a scheduling hiccup or a garbage-collection pause, while a hang is still reported within seconds.
# - A user's job (`watch`, issue 48) has one limit from its start: AUTO_JOB_S 30 s of no progress AND no work
#   before its first step (start-up, rendezvous, the first batch) as after it, or 3 x its longest step when
#   that is longer. It pauses between two steps in ways a case never does (a checkpoint save, an evaluation,
#   a slow batch, a compile), but those work: the liveness signals and the executor's pause check (bytes
#   moving, a DataLoader worker producing, child programs or other ranks that work, a moving frame at CPU)
#   keep it running past the limit. What does no work for 30 s (a lock, a queue, a sleep-and-check loop, a
#   read that never returns) is a hang: the verdict comes about half a minute after the fault.
AUTO_START_S = 120.0
AUTO_FIRST_STEP_S = 120.0
AUTO_FACTOR = 3.0
AUTO_FLOOR_S = 10.0
AUTO_JOB_S = 30.0
# Liveness below the block events (`work_in`): a unit past its stall limit that did work in the last
# min(limit, WORK_WINDOW_S) seconds (at least WORK_WINDOW_MIN_S) is still running. Work is any of: a CUDA
# allocation; WORK_IO_BYTES read or written (a checkpoint; a log line is far less); WORK_MOVES_MIN moves of
# the main thread's innermost Python frame or line while the process used WORK_CPU_MIN % of a core (a
# busy loop stays on one line; a wait uses no CPU; a poll loop that wakes now and then moves, but idles).
WORK_WINDOW_S = 20.0
WORK_WINDOW_MIN_S = 2.0
WORK_CPU_MIN = 20.0
WORK_MOVES_MIN = 2
WORK_IO_BYTES = 1 << 20
# A DataLoader worker using this much of a core while its training process waits for a batch is producing
# it (reading, decoding): an idle worker waiting for indices uses none.
BUSY_WORKER_CPU = 50.0
PROC_EVERY_S = 0.5  # how often the polling loop reads /proc (CPU time, I/O bytes) of each unit
HEARTBEAT_STALE_S = 1.0  # the heartbeat ticks every 0.1 s; this long without a tick: it cannot run
DUMP_WAIT_S = 2.0  # how long the worker's heartbeat thread gets to write memory evidence at a hang
SAMPLE_INTERVAL_S = 1.0
# py-spy dumps after the first of a unit that uses the CPU at a stall (each takes ~0.1-0.5 s): C code that
# computes (a CPU backward, a GEMM) shows different functions across them; one that spins, the same.
PYSPY_MORE = 2
_KEEP_TAIL = 160  # observations kept verbatim at the end of a compacted history (32 s of polls: the window)


@dataclass(frozen=True)
class ProcRead:
    """/proc of a unit's process at one read: CPU seconds and bytes read + written so far, and the program
    it runs (None: unknown)."""

    cpu_s: float | None
    io_bytes: int | None
    exe: str | None = None


@dataclass(frozen=True)
class Observation:
    """One beacon read: the wall-clock time of the read and what it said (None: no beacon yet), with /proc of
    the process when the loop read it then."""

    t: float
    state: BeaconState | None
    proc: ProcRead | None = None


@dataclass(frozen=True)
class Work:
    """What a unit did between progress events over the last ``window_s`` seconds (`work_in`)."""

    window_s: float
    moves: int = 0  # of the main thread's innermost Python frame or line (heartbeat ticks, 10 a second)
    allocs: int = 0  # CUDA caching allocator allocations
    cpu_s: float | None = None
    io_bytes: int | None = None
    frame: str | None = None  # where the main thread last moved to (``path:line function``)
    flags: int = 0  # `nsa_diag.beacon.FLAG_*` of its stack there

    @property
    def cpu_percent(self) -> float | None:
        return procfs.cpu_percent(0.0, self.cpu_s, self.window_s) if self.cpu_s is not None else None

    @property
    def signals(self) -> list[str]:
        """The signals that showed work: ``allocs``, ``io``, ``moves``."""
        found = []
        if self.allocs > 0:
            found.append("allocs")
        if (self.io_bytes or 0) >= WORK_IO_BYTES:
            found.append("io")
        if self.moves >= WORK_MOVES_MIN and (self.cpu_percent or 0.0) >= WORK_CPU_MIN:
            found.append("moves")
        return found

    @property
    def working(self) -> bool:
        return bool(self.signals)

    def describe(self) -> str:
        """``"412 CUDA allocations, 37 moves of the innermost Python frame at 98% CPU in the last 20 s"``."""
        parts = []
        if "allocs" in self.signals:
            parts.append(f"{self.allocs} CUDA allocations")
        if "io" in self.signals:
            parts.append(f"{(self.io_bytes or 0) / 2**20:.1f} MiB read or written")
        if "moves" in self.signals:
            parts.append(f"{self.moves} moves of the innermost Python frame at {self.cpu_percent:.0f}% CPU")
        if not parts:
            cpu = "unknown" if self.cpu_percent is None else f"{self.cpu_percent:.0f}%"
            return f"no work in the last {self.window_s:.0f} s ({self.moves} frame moves, CPU {cpu})"
        return ", ".join(parts) + f" in the last {self.window_s:.0f} s"

    def to_json(self) -> WorkSeen:
        """The record of result.json (``evidence.work``)."""
        return WorkSeen(
            window_s=round(self.window_s, 3), working=self.working, signals=self.signals,
            moves=self.moves, allocs=self.allocs, cpu_percent=self.cpu_percent,
            io_bytes=self.io_bytes, frame=self.frame,
            waits_for_batch=bool(self.flags & FLAG_DATALOADER), saving=bool(self.flags & FLAG_SAVING),
            text=self.describe(),
        )  # fmt: skip


@dataclass(frozen=True)
class Decision:
    status: Status
    elapsed_s: float  # since the worker started
    idle_s: float  # since the last progress event, or since the stall clock was started again (a pause)
    stall_limit_s: float  # the limit that applied (spec.stall or auto's, longer during setup and exit)
    limit_reason: str = ""  # how that limit came about, e.g. "auto: 3 x longest step 2.10 s = 6.3 s ..."
    work: Work | None = None  # past the stall limit: the work that kept it running (or its absence)
    silent_s: float | None = None  # since the last progress event, pauses included (None: idle_s)

    @property
    def silence_s(self) -> float:
        """How long the unit has reported no progress, whatever its stall clock says."""
        return self.idle_s if self.silent_s is None else self.silent_s


@dataclass(frozen=True)
class StallLimit:
    seconds: float
    reason: str


def _last_state(history: Sequence[Observation]) -> BeaconState | None:
    for obs in reversed(history):
        if obs.state is not None:
            return obs.state
    return None


def in_setup(state: BeaconState | None) -> bool:
    return state is None or (state.phase == "setup" and state.event != "end")


def is_job(spec: CaseSpec) -> bool:
    """A user's own command (`watch`), not our worker: its steps load data, and it may checkpoint."""
    return spec.command is not None


def step_intervals(history: Sequence[Observation], *, from_first_event: bool = True) -> list[float]:
    """Seconds each measured step took, optimizer step to optimizer step, from the beacon's event times.

    The first step starts at the end of setup; when no read caught that, at the first event of step 1
    seen (``from_first_event``: our worker, which loads no data) or it is not measured (a user's job, whose
    data loading comes before any hook). A step ends at the first read that shows it ended (its own event
    time when the read caught the step's end, else the read's time: late by up to one poll). Where several
    steps ended between two reads, the interval is unknown and left out."""
    out: list[float] = []
    start: float | None = None
    done = 0
    for obs in history:
        s = obs.state
        if s is None:
            continue
        if done == 0 and s.phase == "setup":
            start = s.time if s.event == "end" else None
            continue
        if done == 0 and start is None and from_first_event and s.step is not None:
            start = s.time
        d = steps_done(s, sys.maxsize)
        if d > done:
            exact = (s.phase == "step" and s.event == "end") or s.phase == "done"
            t = s.time if exact else obs.t
            if start is not None and d == done + 1:
                out.append(max(t - start, 0.0))
            start, done = t, d
    return out


def first_step_s(history: Sequence[Observation]) -> float | None:
    """Seconds step 1 took (our worker: from the end of setup); None until it ended (`step_intervals`)."""
    intervals = step_intervals(history)
    return intervals[0] if intervals else None


def step_limit(history: Sequence[Observation], spec: CaseSpec) -> StallLimit:
    """The stall limit for the training steps: ``spec.stall`` seconds, or auto's (module constants)."""
    if spec.stall != "auto":
        return StallLimit(float(spec.stall), f"--stall {spec.stall:g} s")
    job = is_job(spec)
    intervals = step_intervals(history, from_first_event=not job)
    if not intervals:
        if job:
            return StallLimit(
                AUTO_JOB_S, f"auto: {AUTO_JOB_S:g} s of no progress and no work (no step measured yet)"
            )
        return StallLimit(
            AUTO_FIRST_STEP_S, f"auto: first-step limit {AUTO_FIRST_STEP_S:g} s (step 1 not finished yet)"
        )
    longest = max(intervals)
    scaled = AUTO_FACTOR * longest
    reason = f"auto: {AUTO_FACTOR:g} x longest step {longest:.2f} s = {scaled:.1f} s"
    floor = AUTO_JOB_S if job else AUTO_FLOOR_S
    if scaled < floor:
        return StallLimit(floor, reason + f" -> floor {floor:g} s")
    return StallLimit(scaled, reason)


def stall_limit(history: Sequence[Observation], spec: CaseSpec) -> StallLimit:
    """The stall limit where the worker is now: `step_limit`, longer during setup and after "done"."""
    state = _last_state(history)
    if in_setup(state):
        if spec.stall == "auto" and not is_job(spec):  # a job's: its steps' 30 s (issue 48)
            reason = f"auto: start-up limit {AUTO_START_S:g} s (before the first step)"
            return StallLimit(AUTO_START_S, reason)
        if spec.stall != "auto" and spec.stall < SETUP_STALL_S:
            return StallLimit(SETUP_STALL_S, f"--stall {spec.stall:g} s; setup allows {SETUP_STALL_S:g} s")
    limit = step_limit(history, spec)
    if (
        state is not None
        and state.phase == "export"
        and state.event == "begin"
        and limit.seconds < EXPORT_STALL_S
    ):
        return StallLimit(
            EXPORT_STALL_S,
            f"{limit.reason}; writing {state.module or 'artifacts'} allows {EXPORT_STALL_S:g} s",
        )
    if state is not None and state.phase == "done" and limit.seconds < EXIT_STALL_S:
        return StallLimit(EXIT_STALL_S, f"{limit.reason}; the exit after done allows {EXIT_STALL_S:g} s")
    return limit


def configured_limit(spec: CaseSpec) -> StallLimit | None:
    """The limit a case states before it runs (None for auto, which is measured)."""
    return None if spec.stall == "auto" else StallLimit(float(spec.stall), f"--stall {spec.stall:g} s")


def work_window(limit_s: float) -> float:
    """How far back `work_in` looks for a unit whose stall limit is ``limit_s``."""
    return max(WORK_WINDOW_MIN_S, min(limit_s, WORK_WINDOW_S))


def work_in(history: Sequence[Observation], now: float, window_s: float) -> Work:
    """The liveness signals' growth over the reads of the last ``window_s`` seconds (`Work`); the first read
    in the window and the last are compared (a beacon of another process, after an exec, counts nothing)."""
    recent = [o for o in history if o.t >= now - window_s and o.state is not None]
    if len(recent) < 2:
        return Work(0.0)
    first, last = recent[0], recent[-1]
    b0, b1 = first.state, last.state
    assert b0 is not None
    assert b1 is not None
    same = b0.pid == b1.pid
    procs = [o for o in recent if o.proc is not None]
    cpu = io = None
    if len(procs) >= 2:
        p0, p1 = procs[0].proc, procs[-1].proc
        assert p0 is not None
        assert p1 is not None
        if p0.cpu_s is not None and p1.cpu_s is not None:
            cpu = max(p1.cpu_s - p0.cpu_s, 0.0)
        if p0.io_bytes is not None and p1.io_bytes is not None:
            io = max(p1.io_bytes - p0.io_bytes, 0)
        span = procs[-1].t - procs[0].t
    else:
        span = last.t - first.t
    return Work(
        window_s=max(span, 1e-9),
        moves=max(b1.moves - b0.moves, 0) if same else 0,
        allocs=max(b1.allocs - b0.allocs, 0) if same else 0,
        cpu_s=cpu,
        io_bytes=io,
        frame=b1.frame,
        flags=b1.flags,
    )


def decide(
    history: Sequence[Observation], now: float, spec: CaseSpec, since: float | None = None
) -> Decision:
    """running | stalled | timeout, from the beacon reads so far (``history[0]`` is the worker's start).

    ``since``: the unit's stall clock starts no earlier than this (`Watcher.rearm`, after a pause)."""
    started = history[0].t
    state = _last_state(history)
    last_progress = started if state is None else min(max(state.time, started), now)
    silent = now - last_progress
    if since is not None:
        last_progress = max(last_progress, min(since, now))
    idle = now - last_progress
    limit = stall_limit(history, spec)
    elapsed = now - started
    status: Status = "running"
    work = None
    if idle >= limit.seconds:
        work = work_in(history, now, work_window(limit.seconds))
        status = "running" if work.working else "stalled"
    if status == "running" and past_timeout(spec, elapsed):
        status = "timeout"
    return Decision(status, elapsed, idle, limit.seconds, limit.reason, work, silent)


def heartbeat_alive(state: BeaconState | None, now: float) -> bool | None:
    """Whether the worker's heartbeat thread ticked within `HEARTBEAT_STALE_S`; None if it never ticked."""
    if state is None or state.heartbeat == 0:
        return None
    return now - state.heartbeat_time < HEARTBEAT_STALE_S


def steps_done(state: BeaconState | None, steps: int) -> int:
    """Completed training steps according to the beacon (steps are numbered from 1), at most ``steps``."""
    if state is None or state.step is None:
        return steps if state is not None and state.phase == "done" and steps < sys.maxsize else 0
    if state.phase == "done" or (state.phase == "step" and state.event == "end"):
        return min(state.step, steps)
    return max(state.step - 1, 0)


def _step_starts(history: Sequence[Observation]) -> dict[int, int]:
    """step -> the lowest beacon seq seen while in that step (approximately the seq of its start)."""
    starts: dict[int, int] = {}
    for obs in history:
        s = obs.state
        if s is not None and s.step is not None:
            starts[s.step] = min(starts.get(s.step, s.seq), s.seq)
    return starts


def _phase_fraction(state: BeaconState, layers: int | None) -> float | None:
    """Where in a step the beacon is, as a fraction, from the phase and layer (forward ~1/3 of a step)."""
    if state.phase == "optimizer" or (state.phase == "step" and state.event == "end"):
        return 0.99
    if not layers or state.layer is None:
        return {"forward": 0.15, "backward": 0.6, "recompute": 0.6}.get(state.phase or "")
    done_layers = min(state.layer + (state.event == "end"), layers) / layers
    if state.phase == "forward":
        return done_layers / 3
    if state.phase in ("backward", "recompute"):  # backward runs from the last layer to the first
        return 1 / 3 + (1 - state.layer / layers) * 2 / 3
    return None


def progress_rate(
    history: Sequence[Observation], now: float, spec: CaseSpec, layers: int | None = None
) -> Rate:
    """Progress events/s, steps/s, steps done and the estimated seconds still needed (``eta_s``).

    The fraction done is (steps done + the fraction of the current step) / steps; the current step's
    fraction comes from the events per step of the steps already done, else from its phase and layer.
    ETA = elapsed / fraction - elapsed.
    """
    started = history[0].t
    elapsed = max(now - started, 1e-9)
    state = _last_state(history)
    first = next((obs for obs in history if obs.state is not None), None)
    rate = Rate(elapsed_s=round(elapsed, 3), steps_total=spec.steps)
    if state is None or first is None or first.state is None:
        rate.steps_done, rate.events_per_s, rate.steps_per_s, rate.fraction_done = 0, 0.0, 0.0, 0.0
        return rate
    done = steps_done(state, spec.steps)
    events_span = max(state.time - first.state.time, 1e-9)
    rate.events = state.seq
    rate.events_per_s = round((state.seq - first.state.seq) / events_span, 3) if state.seq > 1 else 0.0
    rate.steps_done = done
    rate.steps_per_s = round(done / elapsed, 4)
    within = 0.0
    starts = _step_starts(history)
    current = state.step
    if current is not None and done < spec.steps and current in starts:
        finished = [s for s in starts if s < current]
        if finished and current - min(finished) > 0:
            per_step = (starts[current] - starts[min(finished)]) / (current - min(finished))
            if per_step > 0:
                within = min((state.seq - starts[current]) / per_step, 0.99)
        else:
            within = _phase_fraction(state, layers) or 0.0
    fraction = min((done + within) / spec.steps, 1.0)
    rate.fraction_done = round(fraction, 4)
    if 0 < fraction < 1:
        rate.eta_s = round(elapsed / fraction - elapsed, 1)
        rate.estimated_total_s = round(elapsed / fraction, 1)
    return rate


def _compact_key(state: BeaconState) -> tuple[int | None, bool, bool]:
    return state.step, state.phase == "setup", state.phase == "step" and state.event == "end"


def compact(history: list[Observation], keep_tail: int = _KEEP_TAIL) -> list[Observation]:
    """The history with what `decide`, `progress_rate` and `first_step_s` need: the start, the first read
    of setup, of every step and of every step's end, the last read of setup, then the last ``keep_tail``
    reads (keeps a long run's polling O(1) per poll)."""
    if len(history) <= 4 * keep_tail:
        return history
    head = history[:-keep_tail]
    first: dict[tuple[int | None, bool, bool], int] = {}
    last_setup = 0
    for i, obs in enumerate(head[1:], start=1):
        if obs.state is not None:
            first.setdefault(_compact_key(obs.state), i)
            if obs.state.phase == "setup":
                last_setup = i
    kept = sorted({0, last_setup, *first.values()})
    return [head[i] for i in kept] + history[-keep_tail:]


@dataclass
class WatchResult:
    """One unit's record of the polling loop: the case's outcome, its beacon reads, its last decision."""

    outcome: Literal["exited", "stalled", "timeout"]
    history: list[Observation]
    decision: Decision | None  # None when the job exited by itself
    exit_code: int | None
    # The longest time between two progress events seen after setup (events between two reads count as
    # one gap, so it errs long); None before two such events. At the timeout, an idle time longer than
    # any gap before is unprecedented: with a stuck stack, a hang rather than a slow step.
    longest_gap_s: float | None = None
    # The unit's work over the last window when the loop ended (`work_in`); None when the job exited.
    work: Work | None = None
    # The program the unit's process ran when the loop first read its /proc (Python, for a probed process):
    # a different one at the evidence means it exec'd another program (`HangEvidence.exe`).
    first_exe: str | None = None

    @property
    def last_state(self) -> BeaconState | None:
        return _last_state(self.history)


@dataclass
class Watched:
    """What the polling loop saw: how the job ended, each unit's record, and the unit that decided it."""

    outcome: Literal["exited", "stalled", "timeout"]
    units: list[WatchResult]  # one per beacon given to `watch`, in that order
    decider: int | None  # the index of the unit that stalled (or ran out of time) first; None: exited


class ProcessHandle(Protocol):
    """What the watchdog needs of a process: a `subprocess.Popen`, or a pid another process started."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


def _judge(decision: Decision, has_beacon: bool, spec: CaseSpec) -> Decision:
    """A unit without a beacon (a process that does not report progress) is never stalled: only the
    timeout applies to it; its hangs show in the evidence, not in missing progress events."""
    if has_beacon or decision.status != "stalled":
        return decision
    return replace(decision, status="timeout" if past_timeout(spec, decision.elapsed_s) else "running")


def process_ended(history: Sequence[Observation]) -> bool:
    """Whether the unit's process has exited (its beacon names it; /proc has no entry for it, or a zombie
    not reaped yet). Such a unit is never judged again: its beacon stays where the process left it (at
    ``done`` for a helper a job ran and reaped, such as a ``python -c`` check of torch.compile's), and a
    stall of it would stop a job that is working. The job's own end is `Watcher`'s ``proc``."""
    state = _last_state(history)
    return state is not None and state.pid > 0 and not alive(state.pid)


def reports_progress(beacon: Path | None, history: Sequence[Observation], optional: bool) -> bool:
    """Whether a unit is judged by its progress: it has a beacon, and with ``optional`` beacons (a user's
    job, `nsa_diag.launchers.command`) that beacon has recorded a progress event beyond its start. A
    probed process that never reports one (torchrun's agent, a DataLoader worker, a tokenizer) is judged
    by the timeout alone, like a process without the probe."""
    if beacon is None:
        return False
    if not optional:
        return True
    state = _last_state(history)
    return state is not None and state.seq > 1


BeaconSource = Sequence[Path | None] | Callable[[], Sequence[Path | None]]


def _longest_gap(longest: float | None, before: BeaconState | None, now: BeaconState | None) -> float | None:
    """``longest`` updated with the gap from the event ``before`` to a new one ``now`` (after setup)."""
    if before is None or now is None or now.seq <= before.seq or in_setup(before):
        return longest
    gap = max(now.time - before.time, 0.0)
    return gap if longest is None else max(longest, gap)


def read_proc(pid: int) -> ProcRead:
    """/proc of ``pid`` now: CPU seconds and I/O bytes so far, and its program."""
    return ProcRead(procfs.cpu_seconds(pid), procfs.io_bytes(pid), procfs.exe(pid))


class Watcher:
    """The polling loop over a job (``proc``) and every unit's beacon: `run` returns when the job exits, a
    unit stalls or the timeout passes. A single worker is one unit; torchrun's local ranks are one each.
    Every unit is judged by `decide`; the first unit to stall (the longest idle) decides, else the first
    past the timeout. ``on_progress`` gets the unit furthest behind (lowest beacon seq) and the seconds
    since ``started``. Each unit's process (the beacon's pid) has its /proc read every `PROC_EVERY_S`.

    ``beacons`` may be a function, asked at every poll, for a job whose processes appear over time (a
    user's command: torchrun starts its ranks later, a DataLoader forks workers): its list only grows, and
    `Watched.units` follows its last answer. ``optional_beacons``: see `reports_progress`; ``training``,
    asked after ``beacons`` at every poll, says which of those units are training processes (the main
    process, a rank): they are judged from their start, before their first progress event too (issue 48:
    a hang in start-up, a rendezvous or the first batch is a hang by the same rule as any other).

    After a stall that the executor found to be a pause, `rearm` starts that unit's stall clock again and
    `run` goes on where it stopped (the histories are kept)."""

    def __init__(
        self,
        proc: ProcessHandle,
        beacons: BeaconSource,
        spec: CaseSpec,
        started: float,
        on_progress: Callable[[BeaconState | None, float], None] | None = None,
        poll_s: float = POLL_S,
        optional_beacons: bool = False,
        training: Callable[[], Sequence[bool]] | None = None,
    ) -> None:
        self.proc, self.beacons, self.spec, self.started = proc, beacons, spec, started
        self.on_progress, self.poll_s, self.optional = on_progress, poll_s, optional_beacons
        self.training = training
        self.histories: list[list[Observation]] = []
        self.gaps: list[float | None] = []
        self.since: list[float | None] = []
        self.proc_read_at: list[float] = []
        self.first_exes: list[str | None] = []

    def _judged(self, beacons: Sequence[Path | None], training: Sequence[bool]) -> list[bool]:
        """Whether each unit is judged by its progress. Where the job names its training processes
        (``training``), those and only those, from their start: a helper, a Pool's or a DataLoader's worker
        idles by design between its tasks, and is judged through the training process that waits on it
        (the executor's pause check), never as the culprit. Where it names none yet (a shell that has not
        started Python), `reports_progress`."""
        if any(training):
            return [b is not None and i < len(training) and training[i] for i, b in enumerate(beacons)]
        return [reports_progress(b, h, self.optional) for b, h in zip(beacons, self.histories, strict=True)]

    def rearm(self, index: int, now: float | None = None) -> None:
        """Unit ``index``'s stall clock starts again at ``now`` (it paused; it did not hang)."""
        self.since[index] = time.time() if now is None else now

    def _read(self, now: float) -> list[Path | None]:
        current = list(self.beacons() if callable(self.beacons) else self.beacons)
        new = current[len(self.histories) :]
        self.histories += [[Observation(self.started, None)] for _ in new]
        self.gaps += [None for _ in new]
        self.since += [None for _ in new]
        self.proc_read_at += [0.0 for _ in new]
        self.first_exes += [None for _ in new]
        for i, beacon in enumerate(current):
            state = read_beacon(beacon) if beacon is not None else None
            proc = None
            if state is not None and state.pid > 0 and now - self.proc_read_at[i] >= PROC_EVERY_S:
                proc, self.proc_read_at[i] = read_proc(state.pid), now
                self.first_exes[i] = self.first_exes[i] or proc.exe
            self.gaps[i] = _longest_gap(self.gaps[i], _last_state(self.histories[i]), state)
            self.histories[i] = compact([*self.histories[i], Observation(now, state, proc)])
        return current

    def run(self) -> Watched:
        spec = self.spec
        while True:
            code = self.proc.poll()
            now = time.time()
            beacons_now = self._read(now)
            histories = self.histories
            training = list(self.training()) if self.training is not None else []
            judged = self._judged(beacons_now, training)
            if self.on_progress is not None:
                # of a job, its training processes' (not torchrun's agent's, nor a DataLoader worker's)
                followed = [h for h, j in zip(histories, judged, strict=True) if j or not any(training)]
                states = [h[-1].state for h in followed if h[-1].state is not None]
                behind = min(states, key=lambda s: s.seq) if states else None
                self.on_progress(behind, now - self.started)
            if code is not None:
                units = [
                    WatchResult("exited", list(h), None, code, g, first_exe=exe)
                    for h, g, exe in zip(histories, self.gaps, self.first_exes, strict=True)
                ]
                return Watched("exited", units, None)
            decisions = [
                _judge(decide(h, now, spec, since), j, spec)
                for h, j, since in zip(histories, judged, self.since, strict=True)
            ]
            # a unit whose process has exited neither stalls nor times out (`process_ended`)
            decisions = [
                replace(d, status="running") if d.status != "running" and process_ended(h) else d
                for d, h in zip(decisions, histories, strict=True)
            ]
            # A unit that has not reported yet is in setup (the start-up limit), not a hang of the others.
            stalled = [i for i, d in enumerate(decisions) if d.status == "stalled"]
            timed_out = [i for i, d in enumerate(decisions) if d.status == "timeout"]
            if not decisions and past_timeout(spec, now - self.started):  # no unit (yet): the job's own limit
                return Watched("timeout", [], None)
            if stalled or timed_out:
                status: Literal["stalled", "timeout"] = "stalled" if stalled else "timeout"
                first = max(stalled, key=lambda i: decisions[i].idle_s) if stalled else timed_out[0]
                units = []
                for h, d, g, exe, j in zip(
                    histories, decisions, self.gaps, self.first_exes, judged, strict=True
                ):
                    # since the last progress event only: the work of a unit that made progress is that;
                    # a unit not judged by its progress (a Pool's worker) shows its work over the window
                    window = (
                        min(work_window(d.stall_limit_s), d.idle_s) if j else work_window(d.stall_limit_s)
                    )
                    work = d.work or (work_in(h, now, window) if window >= WORK_WINDOW_MIN_S else None)
                    units.append(WatchResult(status, list(h), d, None, g, work, exe))
                return Watched(status, units, first)
            time.sleep(self.poll_s)


def watch(
    proc: ProcessHandle,
    beacons: BeaconSource,
    spec: CaseSpec,
    started: float,
    on_progress: Callable[[BeaconState | None, float], None] | None = None,
    poll_s: float = POLL_S,
    optional_beacons: bool = False,
) -> Watched:
    """`Watcher.run` once (a job watched to its first exit, stall or timeout)."""
    return Watcher(proc, beacons, spec, started, on_progress, poll_s, optional_beacons).run()


# --- the escalation: evidence before any kill ----------------------------------------------------------


@dataclass
class HangEvidence:
    """What was gathered from a stalled or slow worker before it was stopped."""

    samples: list[str] = field(default_factory=list)
    cpu_percent: float | None = None
    heartbeat_before: bool | None = None
    heartbeat_between: bool | None = None
    gpu_utilization: float | None = None
    main_wchan: str | None = None
    main_state: str | None = None
    pyspy_text: str | None = None
    pyspy_more: list[str] = field(default_factory=list)  # dumps after the first, of a unit using the CPU
    io_bytes: int | None = None  # read + written between the two samples (/proc)
    # Whether a progress event came while the evidence was taken (after the watchdog's last read): a slow
    # step goes on, a stuck one does not. None: the worker never wrote its beacon.
    progressed: bool | None = None
    exe: str | None = None  # the program the process runs (/proc/<pid>/exe), and its command line
    argv: list[str] = field(default_factory=list)
    file_locks: list[str] = field(default_factory=list)  # held by other processes, when it waits in filelock
    # its descendants that used the CPU between the two samples ("pid 4242 (cc1plus) at CPU 97%")
    children_working: list[str] = field(default_factory=list)
    # those that did not ("pid 4243 `cat /mnt/pipe` at CPU 0%"): what a process waiting for them waits on
    children_idle: list[str] = field(default_factory=list)
    # what else was gathered (memory at the hang, py-spy, GPU files, why stacks were not sampled), as the
    # case's evidence writes it
    notes: CaseEvidence = field(default_factory=CaseEvidence)

    @property
    def heartbeat_advancing(self) -> bool | None:
        """Whether the heartbeat thread runs. The read before any request or signal decides: between
        the samples the thread may be busy writing the memory evidence (a large CUDA snapshot)."""
        return self.heartbeat_before if self.heartbeat_before is not None else self.heartbeat_between


def catches_sigusr1(pid: int) -> bool | None:
    """Whether ``pid`` has a SIGUSR1 handler (faulthandler registered); None if /proc cannot say."""
    snapshot = procfs.process_snapshot(pid)
    mask = snapshot.get("status", {}).get("SigCgt")
    if mask is None:
        return None
    return bool(int(mask, 16) & (1 << (signal.SIGUSR1 - 1)))


def _request_memory_dump(case_dir: Path, proc: ProcessHandle, heartbeat: bool | None) -> MemoryDump:
    """Ask the worker's heartbeat thread for memory evidence; a stopped heartbeat cannot answer."""
    artifacts.write_text(case_dir / artifacts.DUMP_REQUEST, time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
    if heartbeat is False:
        return MemoryDump(written=False, why="the heartbeat thread has stopped (GIL held): it cannot answer")
    deadline = time.monotonic() + DUMP_WAIT_S
    done = case_dir / artifacts.DUMP_DONE
    while time.monotonic() < deadline and proc.poll() is None:
        if done.exists():
            return MemoryDump(written=True, answer=done.read_text(errors="replace").strip())
        time.sleep(0.05)
    return MemoryDump(written=False, why=f"the worker did not answer within {DUMP_WAIT_S:g} s")


def _heartbeat(case_dir: Path) -> int | None:
    state = read_beacon(case_dir / artifacts.BEACON)
    return None if state is None else state.heartbeat


def gather_hang_evidence(
    proc: ProcessHandle,
    case_dir: Path,
    spec: CaseSpec,
    last: BeaconState | None,
    may_signal: str | None = None,
    look_again: Callable[[Sequence[str]], bool] | None = None,
) -> HangEvidence:
    """Everything before the kill: memory at the hang, two stack samples (a third where they disagree on a
    quiet process: ``look_again``), GPU, /proc, py-spy (twice for a unit that uses the CPU). Called again
    for a unit that paused (`Watcher.rearm`): each call's samples are numbered after those already in
    stacks.txt, and ``samples`` holds this call's alone.

    ``may_signal``: None when the process's SIGUSR1 is faulthandler's (our worker, a probed process);
    else why no SIGUSR1 may be sent (a process of a user's job with its own handler, or no probe):
    its stacks then come from py-spy alone.

    ``look_again(samples)``: whether the two samples disagree on where the job is (`classify.
    samples_disagree`); then, with the CPU under `WORK_CPU_MIN` (a wait, not work), a third sample one
    interval later."""
    pid = proc.pid
    ev = HangEvidence(
        heartbeat_before=heartbeat_alive(read_beacon(case_dir / artifacts.BEACON) or last, time.time())
    )
    ev.notes.memory_at_hang = _request_memory_dump(case_dir, proc, ev.heartbeat_before)
    stacks_path = case_dir / artifacts.STACKS
    if may_signal is None:
        sampling = catches_sigusr1(pid) is not False
        if not sampling:
            ev.notes.stack_samples_why = (
                "not taken: the worker had not registered faulthandler for SIGUSR1 yet"
            )
    else:  # no signal; a probe's heartbeat thread, when it runs, dumps the stacks from Python instead
        sampling = ev.heartbeat_before is True
        how = "taken by the probe's heartbeat thread" if sampling else "not taken"
        ev.notes.stack_samples_why = f"no SIGUSR1 ({may_signal}): {how}"

    signal_ok = may_signal is None
    before = len(stacks.read_stacks(stacks_path).samples)
    first = before + 1
    t0 = time.monotonic()
    cpu0, io0, kids0 = procfs.cpu_seconds(pid), procfs.io_bytes(pid), procfs.descendants_cpu(pid)
    beat0 = _heartbeat(case_dir)
    writers = []  # who wrote each stack sample
    if sampling:
        writers.append(
            stacks.take_sample(pid, case_dir, stacks_path, first, ev.heartbeat_before, signal_ok=signal_ok)
        )
    snapshot = (
        gpu.nvml_snapshot()
        if spec.device != "cpu"
        else {"available": False, "why": "not queried: the case runs with --device cpu"}
    )
    time.sleep(max(0.0, t0 + SAMPLE_INTERVAL_S - time.monotonic()))
    # CPU time, heartbeat and thread states before the second signal, whose handler runs for a moment.
    cpu1, io1, t1 = procfs.cpu_seconds(pid), procfs.io_bytes(pid), time.monotonic()
    ev.children_working, ev.children_idle = procfs.descendants_work(kids0, pid, t1 - t0, WORK_CPU_MIN)
    beat1 = _heartbeat(case_dir)
    proc_json = procfs.group_snapshot(pid)
    if sampling:
        writers.append(
            stacks.take_sample(
                pid, case_dir, stacks_path, first + 1, ev.heartbeat_before, signal_ok=signal_ok
            )
        )
    ev.cpu_percent = procfs.cpu_percent(cpu0, cpu1, t1 - t0)
    quiet = ev.cpu_percent is None or ev.cpu_percent < WORK_CPU_MIN
    taken = stacks.read_stacks(stacks_path).samples[before:] if sampling and quiet else ()
    if look_again is not None and len(taken) == 2 and look_again(taken):
        time.sleep(SAMPLE_INTERVAL_S)
        writers.append(
            stacks.take_sample(
                pid, case_dir, stacks_path, first + 2, ev.heartbeat_before, signal_ok=signal_ok
            )
        )
    if "heartbeat thread" in writers:
        ev.notes.stack_samples_written_by = writers  # the SIGUSR1 handler did not answer
    ev.exe, ev.argv = procfs.exe(pid), procfs.cmdline(pid)
    ev.io_bytes = io1 - io0 if io0 is not None and io1 is not None else None
    if beat0 is not None and beat1 is not None and beat0 > 0:
        ev.heartbeat_between = beat1 > beat0
    ev.notes.heartbeat_ticks_between_samples = None if beat0 is None or beat1 is None else beat1 - beat0

    main = next((p for p in proc_json.get("processes", ()) if p.get("pid") == pid), None)
    if main is None and proc_json.get("available"):  # not a session leader (a job's child process)
        main = procfs.process_snapshot(pid)
        proc_json["processes"] = [*proc_json["processes"], main]
    thread = procfs.main_thread(main) if main else None
    if thread is not None:
        ev.main_wchan, ev.main_state = thread["wchan"], thread["state"]
    artifacts.write_json(case_dir / artifacts.PROC, proc_json)

    pyspy = stacks.pyspy_dump(pid, case_dir / artifacts.PYSPY)
    ev.notes.pyspy = pyspy
    if pyspy.taken:
        ev.pyspy_text = (case_dir / artifacts.PYSPY).read_text(errors="replace")
        if (ev.cpu_percent or 0.0) >= WORK_CPU_MIN:  # computing in C, or spinning in a wait: look again
            for _ in range(PYSPY_MORE):
                more = stacks.pyspy_dump(pid, case_dir / artifacts.PYSPY_MORE)
                if not more.taken:
                    break
                ev.pyspy_more.append((case_dir / artifacts.PYSPY_MORE).read_text(errors="replace"))

    ev.gpu_utilization = gpu.worker_utilization(snapshot, procfs.session_pids(pid))
    ev.notes.gpu = _gpu_files(case_dir, snapshot)
    ev.samples = list(stacks.read_stacks(stacks_path).samples[before:])
    # who holds the lock it may wait for: in filelock's polling loop, or blocked in the kernel on one
    if procfs.may_wait_for_file_lock(ev.samples, ev.main_wchan):
        ev.file_locks = procfs.held_file_locks(pid)
        ev.notes.file_locks = ev.file_locks
    after = read_beacon(case_dir / artifacts.BEACON)
    if after is not None:
        ev.progressed = last is None or after.seq > last.seq
    return ev


def _gpu_files(case_dir: Path, snapshot: dict[str, Any]) -> GpuFiles:
    if not snapshot.get("available"):
        return GpuFiles(available=False, why=snapshot.get("why"))
    artifacts.write_json(case_dir / artifacts.GPU, snapshot)
    text, why = gpu.nvidia_smi()
    if text is not None:
        artifacts.write_text(case_dir / artifacts.NVIDIA_SMI, text)
    return GpuFiles(available=True, file=artifacts.GPU, nvidia_smi=artifacts.NVIDIA_SMI if text else why)
