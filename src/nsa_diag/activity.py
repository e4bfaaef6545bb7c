"""What a live process tree was doing while `nsa-diag attach` watched it (pure functions over the evidence).

attach watches for a second or two, so it cannot say ``pass`` and it does not say ``hang`` (a verdict
that needs the stall limit to pass): its answer is a **state**, attach's own field, per process and for
the tree:

- ``progressing``: the probe's beacon counted progress events while attach watched (with events/s, steps/s
  and where), or, in a tree where no process has the probe, a process used CPU (>= 20% of a core) while
  its stacks show no wait (a lock, a collective, a GPU sync). Without a beacon, useful work and a busy
  loop look alike: the reason says which was measured.
- ``stalled``: nothing moved: no progress event (with how long since the last one, from the beacon), or
  no CPU, or CPU spent waiting. ``hang_kind`` then says how it is stuck, in `classify`'s words
  (python-deadlock, python-busy, gil-held, cuda-kernel, collective, unknown): the hang kind it would get
  if it stays so.
- ``gone``: the process (the tree) ended while attach watched.

Each process also gets ``kind``, what its stacks show whatever its state (a busy process: python-busy),
from `classify.hang_kind` on the faulthandler dumps (or py-spy's dump where there are none), CPU%, the
main thread's /proc state and wait channel, the beacon's heartbeat and GPU utilisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from nsa_diag.classify import DEADLOCK_CPU_MAX, Evidence, hang_kind
from nsa_diag.evidence import stacks
from nsa_diag.evidence.live import ProcessObservation, TreeObservation
from nsa_diag.evidence.probefiles import location
from nsa_diag.spec import HangKind, Where
from nsa_diag.worker.beacon import BeaconState

State = Literal["progressing", "stalled", "gone"]
# Kinds that are waits: CPU spent in them (a spinning sync, a polling collective) is not progress.
WAITING_KINDS = ("collective", "cuda-kernel", "python-deadlock")
# Runnable (on a CPU or waiting for one) at least this much of the time: it wants to work, even where a
# loaded machine gives it less than DEADLOCK_CPU_MAX of a core (seen: a busy loop at 12% CPU, load 16 on 2
# cores). A blocked wait is runnable ~0% of the time.
RUNNABLE_BUSY_MIN = 50.0
# Which stalled process explains the tree, first match first: a rank in a collective, a GPU wait, a held
# GIL, a lock, a busy loop, then anything else.
KIND_ORDER: tuple[HangKind | None, ...] = (
    "collective", "cuda-kernel", "gil-held", "python-deadlock", "python-busy", "unknown", None,
)  # fmt: skip


@dataclass(frozen=True)
class ProcessActivity:
    """One process's state, kind and reason."""

    pid: int
    state: State
    kind: HangKind | None  # what the stacks show; None for a process attach cannot judge (not Python)
    why: str  # the kind's reason, or what was seen
    progress: dict[str, Any]  # by ("beacon" | "cpu" | None), events_per_s, steps_per_s, step_from/to ...
    location: str | None  # "rank 1, step 5, backward, layers.7" from the beacon
    rank: int | None
    cpu_percent: float | None
    runnable_percent: float | None  # of the main thread: on a CPU or waiting for one
    gpu_percent: float | None
    stalled_for_s: float | None  # since the beacon's last progress event
    python: bool
    leaf: bool  # no child in the observed tree

    def label(self) -> str:
        return f"pid {self.pid}" + (f" (rank {self.rank})" if self.rank is not None else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid, "state": self.state, "kind": self.kind, "why": self.why,
            "progress": self.progress, "location": self.location, "rank": self.rank,
            "cpu_percent": self.cpu_percent, "runnable_percent": self.runnable_percent,
            "gpu_percent": self.gpu_percent,
            "stalled_for_s": self.stalled_for_s,
        }  # fmt: skip


@dataclass(frozen=True)
class TreeActivity:
    """The tree's state: progressing if any process progressed (a beacon, where the tree has one, decides);
    stalled with the hang kind of the process that explains it best (`KIND_ORDER`); gone."""

    state: State
    hang_kind: HangKind | None  # only when stalled
    reason: str
    focus_pid: int | None
    processes: tuple[ProcessActivity, ...]


def _pyspy_as_faulthandler(text: str) -> str:
    """py-spy's Python frames in faulthandler's layout, so that `classify` reads them as a stack sample."""
    lines = []
    for thread in stacks.parse_pyspy(text):
        number = int(thread.thread_id) if thread.thread_id.isdigit() else 0
        lines.append(f"Thread 0x{number:016x} (most recent call first):")
        lines += [f'  File "{f.file}", line {f.line} in {f.func}' for f in thread.python_frames]
        lines.append("")
    return "\n".join(lines)


def _gpu_percent(ob: ProcessObservation) -> float | None:
    values = [row["sm_util_percent"] for row in ob.gpu if row.get("sm_util_percent") is not None]
    return float(max(values)) if values else None


def _where(state: BeaconState | None) -> Where | None:
    return Where(**state.where()) if state is not None else None  # type: ignore[arg-type]


def _kind(ob: ProcessObservation, cpu: float | None, heartbeat: bool | None) -> tuple[HangKind | None, str]:
    """`classify.hang_kind` of the process's evidence; None for a process that is not Python."""
    thread = ob.main_thread() or {}
    waits = f"main thread {thread.get('state', '?')}" + (
        f" in {thread['wchan']}" if thread.get("wchan") else ""
    )
    if not ob.info.python:
        return None, f"not a Python process; {waits}, CPU {cpu if cpu is not None else '?'}%"
    samples = list(ob.dumps) or ([_pyspy_as_faulthandler(ob.pyspy_text)] if ob.pyspy_text else [])
    threads = [t for text in samples for t in stacks.parse_faulthandler(text)]
    beacons = ob.beacons()
    ev = Evidence(
        outcome="stalled",
        stack_samples=samples,
        pyspy=ob.pyspy_text,
        cpu_percent=cpu,
        heartbeat_advancing=heartbeat,
        gpu_utilization=_gpu_percent(ob),
        main_wchan=thread.get("wchan"),
        main_state=thread.get("state"),
        where=_where(beacons[-1] if beacons else None),
        source_lines=stacks.source_lines(threads),
    )
    kind, why = hang_kind(ev)
    runnable = ob.runnable_percent()
    if kind == "unknown" and cpu is not None and runnable is not None and runnable >= RUNNABLE_BUSY_MIN:
        # A busy loop that a loaded machine gives little CPU: judged by how much it wanted to run.
        starved, starved_why = hang_kind(replace(ev, cpu_percent=runnable))
        if starved == "python-busy":
            loaded = f"CPU {cpu:.0f}% (runnable {runnable:.0f}% of the time: the machine is loaded)"
            kind, why = starved, starved_why.replace(f"CPU {runnable:.0f}%", loaded)
    if not samples:
        why += f"; {waits} (no stack: no SIGUSR1 handler and no py-spy dump)"
    return kind, why


def _beacon_progress(ob: ProcessObservation) -> tuple[dict[str, Any], float | None, bool | None]:
    """(progress record, seconds since the last event, heartbeat advancing) from the beacon reads."""
    reads = [s for s in ob.samples if s.beacon is not None]
    if len(reads) < 2:
        return {}, None, None
    first, last = reads[0], reads[-1]
    b0, b1 = first.beacon, last.beacon
    assert b0 is not None
    assert b1 is not None
    dt = max(last.at - first.at, 1e-9)
    record: dict[str, Any] = {
        "by": "beacon" if b1.seq > b0.seq else None,
        "events": b1.seq - b0.seq,
        "events_per_s": round((b1.seq - b0.seq) / dt, 3),
        "step_from": b0.step,
        "step_to": b1.step,
        "observed_s": round(dt, 3),
    }
    if b0.step is not None and b1.step is not None:
        record["steps_per_s"] = round((b1.step - b0.step) / dt, 3)
    heartbeat = b1.heartbeat > b0.heartbeat if b0.heartbeat > 0 else None
    return record, max(0.0, last.wall - b1.time), heartbeat


def _progress_text(act: ProcessActivity) -> str:
    p = act.progress
    if p.get("by") == "beacon":
        steps = ""
        if p.get("step_from") is not None and p.get("step_to") != p.get("step_from"):
            steps = f", step {p['step_from']} -> {p['step_to']} ({p.get('steps_per_s', 0):.3g} steps/s)"
        at = f", at {act.location}" if act.location else ""
        return f"{act.label()}: {p['events_per_s']:.3g} progress events/s{steps}{at}"
    runnable = (
        f", runnable {act.runnable_percent:.0f}% of the time" if act.runnable_percent is not None else ""
    )
    return (
        f"{act.label()}: CPU {act.cpu_percent or 0:.0f}% of a core{runnable} (no beacon: useful work and a "
        f"busy loop look alike; its stacks: {act.kind or 'none'}, {act.why})"
    )


def _rank(ob: ProcessObservation) -> int | None:
    """The process's rank: its probe's, else the RANK variable torchrun gives each worker."""
    if ob.info.probe is not None and ob.info.probe.rank is not None:
        return ob.info.probe.rank
    value = ob.info.env_vars.get("RANK", "")
    return int(value) if value.isdigit() else None


def judge_process(ob: ProcessObservation, leaf: bool = True) -> ProcessActivity:
    """The state, kind and reason of one observed process."""
    cpu = ob.cpu_percent()
    progress, stalled_for, heartbeat = _beacon_progress(ob)
    beacons = ob.beacons()
    probe = ob.info.probe
    common = {
        "pid": ob.pid, "location": location(probe, beacons[-1] if beacons else None),
        "rank": _rank(ob), "cpu_percent": cpu, "runnable_percent": ob.runnable_percent(),
        "gpu_percent": _gpu_percent(ob),
        "python": ob.info.python, "leaf": leaf,
    }  # fmt: skip
    if ob.gone:
        return ProcessActivity(
            state="gone", kind=None, why="it ended while attach watched", progress={}, stalled_for_s=None,
            **common,
        )  # fmt: skip
    kind, why = _kind(ob, cpu, heartbeat)
    if progress:  # a beacon decides
        state: State = "progressing" if progress["by"] == "beacon" else "stalled"
        if state == "stalled" and stalled_for is not None:
            why = f"no progress event for {stalled_for:.1f} s; {why}"
    else:
        runnable = ob.runnable_percent()
        wants_cpu = (cpu or 0.0) >= DEADLOCK_CPU_MAX or (runnable or 0.0) >= RUNNABLE_BUSY_MIN
        busy = wants_cpu and kind not in WAITING_KINDS
        state = "progressing" if busy and ob.info.python else "stalled"
        progress = {
            "by": "cpu" if state == "progressing" else None,
            "cpu_percent": cpu,
            "runnable_percent": runnable,
        }
        stalled_for = None
    return ProcessActivity(
        state=state, kind=kind, why=why, progress=progress,
        stalled_for_s=round(stalled_for, 3) if stalled_for is not None else None, **common,
    )  # fmt: skip


def _focus(candidates: Sequence[ProcessActivity]) -> ProcessActivity:
    """The stalled process that explains the tree: by `KIND_ORDER`, a leaf before its parents."""
    return min(candidates, key=lambda a: (KIND_ORDER.index(a.kind), not a.leaf, a.pid))


def judge_tree(tree: TreeObservation) -> TreeActivity:
    """The tree's state, hang kind and one-line reason."""
    parents = {ob.info.ppid for ob in tree.processes}
    acts = tuple(judge_process(ob, leaf=ob.pid not in parents) for ob in tree.processes)
    live = [a for a in acts if a.state != "gone"]
    if not live:
        return TreeActivity("gone", None, f"PID {tree.root} ended while attach watched", None, acts)
    with_beacon = [a for a in live if a.progress.get("events") is not None]
    movers = [a for a in (with_beacon or live) if a.state == "progressing"]
    if movers:
        text = "; ".join(_progress_text(a) for a in movers)
        stalled = [a for a in live if a.state == "stalled" and (a in with_beacon or not with_beacon)]
        also = (
            f" (not progressing: {', '.join(a.label() for a in stalled)})" if stalled and with_beacon else ""
        )
        return TreeActivity("progressing", None, f"progressing: {text}{also}", movers[0].pid, acts)
    python = [a for a in live if a.python]
    focus = _focus(with_beacon or python or live)
    at = f" at {focus.location}" if focus.location else ""
    reason = f"not progressing while watched: {focus.label()}{at}: {focus.why}"
    elsewhere = [a for a in live if a.rank is not None and a is not focus and a.kind != focus.kind]
    if elsewhere:  # the ranks that are not where the focus rank is: the minority, or the cause
        reason += "; " + "; ".join(f"{a.label()}: {a.kind}, {a.why}" for a in elsewhere)
    return TreeActivity("stalled", focus.kind, reason, focus.pid, acts)
