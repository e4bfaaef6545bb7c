"""What a live process tree was doing while `nsa-diag attach` watched it (pure functions over the evidence).

attach watches for seconds, so it cannot say ``pass`` and it does not say ``hang`` (a verdict that needs
the stall limit to pass): its answer is a **state**, attach's own field, and it never guesses one. CPU
alone is never work: a computation and a spin both use a core. Each process gets, first match wins:

- ``gone``: it ended while attach watched.
- ``progressing``: it showed work: the probe's beacon counted progress events, or its liveness counters
  moved (CUDA allocations; the main thread's innermost frame moving while it used the CPU:
  `nsa_diag.watchdog.Work`); its stack samples (faulthandler or py-spy) have different innermost frames or
  lines while it used `WORK_CPU_MIN` % of a core (or wanted to: runnable `RUNNABLE_BUSY_MIN` % of the time
  on a loaded machine); py-spy's native frames differ between its dumps while it used the CPU (C code
  that computes: `classify.native_moved`); it read or wrote `WORK_IO_BYTES` (/proc's I/O counters).
- ``idle``: it waits by design and is reported as what it is: an idle DataLoader worker (waiting for
  indices in torch's worker loop), torch's launcher (torchrun's agent) waiting on its ranks, a shell
  waiting for its child.
- ``paused``: it does no work and is not stuck (`classify.pause_reason`): **sleeping** (``time.sleep`` in
  its stacks, or without a stack its main thread in the kernel's nanosleep in every round, or in most
  and running in the others: a sleep ends by itself, so it is never a python-deadlock), reading or
  writing a checkpoint, in a disk wait, waiting for a batch its DataLoader worker is busy producing.
- ``stalled``: its evidence shows it stuck: a wait at the same frame in every sample (``collective``,
  ``cuda-kernel``, ``python-deadlock``), a held GIL (``gil-held``), or no CPU, no I/O and nothing else
  moving at all (``unknown``, with its wait channel).
- ``unclear``: it used the CPU and nothing tells work from a spin: no stack at all (no SIGUSR1 handler, no
  py-spy), or the same frame busy in every sample (``python-busy``: one long computation and a busy loop
  look alike from outside).

``kind`` is what its stacks show whatever its state (`classify.hang_kind` on the faulthandler dumps, else
py-spy's), from the samples, CPU%, the main thread's /proc state and wait channel, the beacon's heartbeat
and GPU utilisation.

The tree's state is about its **training processes** (the main process of a script, or each rank:
`nsa_diag.evidence.roles`, from the probe's probe.json where there is one, else /proc: RANK, torchrun's
command line, DataLoader worker stacks, parent and child), never about idle workers, launchers or helpers:

- ``progressing``: a training process progressed (the others that did not are named);
- ``stalled``: a training process is stuck on its own (python-deadlock, gil-held), or every training
  process is stalled or paused and one is stalled. With stacks of several ranks the focus is the minority
  rank, as `watch` names it (`nsa_diag.analysis.ranks.cross_rank_diff`, else the probe's collective counts
  in ``at_hang.json``); ``hang_kind`` is the kind it would get if it stays so;
- ``unclear``: a training process is unclear and none is stuck on its own, e.g. one rank at 100% CPU while
  another sleeps, with no stack of either. The reason says what would settle it (py-spy installed, ptrace
  allowed, signals allowed, or the job under `nsa-diag watch`); ``hang_kind`` is what the stacks show;
- ``paused``: every training process paused;
- ``gone``: the training processes (the tree) ended while attach watched.

A tree without a training process among those watched (``--no-children`` on torchrun's agent or on a
DataLoader worker) is ``unclear``, with what each process is and where to attach instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypedDict

from nsa_diag.analysis.ranks import cross_rank_diff, minority_by_counts, minority_hang_kind
from nsa_diag.beacon import BeaconState
from nsa_diag.classify import (
    DEADLOCK_CPU_MAX,
    SLEEP_NO_WORK,
    Evidence,
    dataloader_worker_idle,
    focus_thread,
    hang_kind,
    native_moved,
    pause_reason,
    waits_on_dataloader,
)
from nsa_diag.evidence import procfs, stacks
from nsa_diag.evidence.live import ProcessInfo, ProcessObservation, TreeObservation
from nsa_diag.evidence.probefiles import location
from nsa_diag.evidence.roles import TRAINING_ROLES, ProcessFacts, Role, assign_roles, describe
from nsa_diag.records import StackDiff, WorkSeen
from nsa_diag.spec import HangKind, Where
from nsa_diag.stackframes import ThreadStack
from nsa_diag.watchdog import WORK_CPU_MIN, WORK_IO_BYTES, Observation, ProcRead, Work, work_in

State = Literal["progressing", "idle", "paused", "stalled", "unclear", "gone"]
TreeState = Literal["progressing", "paused", "stalled", "unclear", "gone"]
# Kinds of a wait at one frame: CPU spent in them (a spinning sync, a polling collective) is not work.
STUCK_KINDS: tuple[HangKind, ...] = ("collective", "cuda-kernel", "gil-held", "python-deadlock")
# Stuck whatever the other processes do: a lock or condition of its own, a held GIL. A rank in a collective
# or a GPU wait may only be waiting for a rank that works.
SELF_STUCK_KINDS: tuple[HangKind, ...] = ("gil-held", "python-deadlock")
# Runnable (on a CPU or waiting for one) at least this much of the time: it wants to work, even where a
# loaded machine gives it less than DEADLOCK_CPU_MAX of a core (seen: a busy loop at 12% CPU, load 16 on 2
# cores). A blocked wait is runnable ~0% of the time.
RUNNABLE_BUSY_MIN = 50.0
# Which stalled process explains the tree, first match first: a rank in a collective, a GPU wait, a held
# GIL, a lock, a busy loop, then anything else.
KIND_ORDER: tuple[HangKind | None, ...] = (
    "collective", "cuda-kernel", "gil-held", "python-deadlock", "python-busy", "unknown", None,
)  # fmt: skip
WATCH_HINT = "the job run under `nsa-diag watch` (its probe counts progress events, allocations, frame moves)"


class ActivityProgress(TypedDict, total=False):
    """What showed a process's progress while attach watched (``by``: beacon, liveness, stacks, native,
    io, or None), with its numbers: the beacon's events and steps, the liveness counters, the frames that
    moved, the bytes read or written."""

    by: str | None
    events: int
    events_per_s: float
    step_from: int | None
    step_to: int | None
    observed_s: float
    steps_per_s: float
    work: WorkSeen
    moved: str
    cpu_percent: float | None
    io_bytes: int


class ProcessActivityJson(TypedDict):
    """`ProcessActivity` as attach's result.json writes it."""

    pid: int
    role: Role
    state: State
    kind: HangKind | None
    why: str
    progress: ActivityProgress
    location: str | None
    rank: int | None
    cpu_percent: float | None
    runnable_percent: float | None
    gpu_percent: float | None
    stalled_for_s: float | None


@dataclass(frozen=True)
class ProcessActivity:
    """One process's state, kind and reason."""

    pid: int
    state: State
    kind: HangKind | None  # what the stacks show; None for a process attach cannot judge (not Python)
    why: str  # what shows the state
    progress: ActivityProgress
    location: str | None  # "rank 1, step 5, backward, layers.7" from the beacon
    rank: int | None
    cpu_percent: float | None
    runnable_percent: float | None  # of the main thread: on a CPU or waiting for one
    gpu_percent: float | None
    stalled_for_s: float | None  # since the beacon's last progress event
    python: bool
    leaf: bool  # no child in the observed tree
    role: Role = "training"
    stack_samples: int = 0  # faulthandler or py-spy samples of it (0: no stack at all)
    thread: ThreadStack | None = field(default=None, compare=False)  # its focus thread, last sample

    def label(self) -> str:
        if self.role == "rank" or (self.role == "training" and self.rank is not None):
            return f"rank {self.rank} (pid {self.pid})"
        if self.role == "training":
            return f"pid {self.pid}"
        return f"pid {self.pid} ({describe(self.role)})"

    def to_json(self) -> ProcessActivityJson:
        return {
            "pid": self.pid, "role": self.role, "state": self.state, "kind": self.kind, "why": self.why,
            "progress": self.progress, "location": self.location, "rank": self.rank,
            "cpu_percent": self.cpu_percent, "runnable_percent": self.runnable_percent,
            "gpu_percent": self.gpu_percent, "stalled_for_s": self.stalled_for_s,
        }  # fmt: skip


@dataclass(frozen=True)
class TreeActivity:
    """The tree's state (module docstring), the hang kind of its focus process, and one reason."""

    state: TreeState
    hang_kind: HangKind | None  # stalled or unclear: what the focus process's stacks show
    reason: str
    focus_pid: int | None
    processes: tuple[ProcessActivity, ...]
    minority_ranks: tuple[int, ...] = ()
    stack_diff: StackDiff | None = None  # `cross_rank_diff` of the ranks, when stalled


# --- one process ----------------------------------------------------------------------------------------


def _pyspy_as_faulthandler(text: str) -> str:
    """py-spy's Python frames in faulthandler's layout, so that `classify` reads them as a stack sample."""
    lines = []
    for thread in stacks.parse_pyspy(text):
        number = int(thread.thread_id) if thread.thread_id.isdigit() else 0
        lines.append(f"Thread 0x{number:016x} (most recent call first):")
        lines += [f'  File "{f.file}", line {f.line} in {f.func}' for f in thread.python_frames]
        lines.append("")
    return "\n".join(lines)


def stack_samples(ob: ProcessObservation) -> list[str]:
    """The process's stack samples as faulthandler texts: its SIGUSR1 dumps, else the rounds' py-spy dumps,
    else the final py-spy dump (one sample)."""
    if ob.dumps:
        return list(ob.dumps)
    if ob.pyspy_samples:
        return [_pyspy_as_faulthandler(text) for text in ob.pyspy_samples]
    return [_pyspy_as_faulthandler(ob.pyspy_text)] if ob.pyspy_text else []


def _gpu_percent(ob: ProcessObservation) -> float | None:
    values = [row["sm_util_percent"] for row in ob.gpu if row.get("sm_util_percent") is not None]
    return float(max(values)) if values else None


def _where(state: BeaconState | None) -> Where | None:
    return Where(**state.where()) if state is not None else None  # type: ignore[arg-type]


def _rank_of(info: ProcessInfo) -> int | None:
    """The process's rank: its probe's, else the RANK variable torchrun gives each worker."""
    if info.probe is not None and info.probe.rank is not None:
        return info.probe.rank
    value = info.env_vars.get("RANK", "")
    return int(value) if value.isdigit() else None


def _waits(ob: ProcessObservation) -> str:
    thread = ob.main_thread() or {}
    wchan = thread.get("wchan")
    text = f"main thread {thread.get('state', '?')}" + (f" in {wchan}" if wchan else "")
    if procfs.waits_for_file_lock(wchan):
        held = "; ".join(ob.file_locks) or "none this user can read"
        text += f" (a file lock wait: file locks other processes hold: {held})"
    return text


def _beacon_progress(ob: ProcessObservation) -> tuple[ActivityProgress, float | None, bool | None]:
    """(progress record, seconds since the last event, heartbeat advancing) from the beacon reads."""
    reads = [s for s in ob.samples if s.beacon is not None]
    if len(reads) < 2:
        return ActivityProgress(), None, None
    first, last = reads[0], reads[-1]
    b0, b1 = first.beacon, last.beacon
    assert b0 is not None
    assert b1 is not None
    dt = max(last.at - first.at, 1e-9)
    record = ActivityProgress(
        by="beacon" if b1.seq > b0.seq else None,
        events=b1.seq - b0.seq,
        events_per_s=round((b1.seq - b0.seq) / dt, 3),
        step_from=b0.step,
        step_to=b1.step,
        observed_s=round(dt, 3),
    )
    if b0.step is not None and b1.step is not None:
        record["steps_per_s"] = round((b1.step - b0.step) / dt, 3)
    heartbeat = b1.heartbeat > b0.heartbeat if b0.heartbeat > 0 else None
    return record, max(0.0, last.wall - b1.time), heartbeat


def _liveness(ob: ProcessObservation) -> Work | None:
    """The probe's liveness counters over the rounds (`nsa_diag.watchdog.work_in`); None without a beacon."""
    history = [
        Observation(
            s.at, s.beacon, ProcRead(s.proc.get("utime_s", 0.0) + s.proc.get("stime_s", 0.0), s.io_bytes)
        )
        for s in ob.samples
        if s.beacon is not None and not s.proc.get("gone")
    ]
    if len(history) < 2:
        return None
    return work_in(history, history[-1].t, history[-1].t - history[0].t + 1.0)


def _wants_cpu(cpu: float | None, runnable: float | None) -> bool:
    return (cpu or 0.0) >= DEADLOCK_CPU_MAX or (runnable or 0.0) >= RUNNABLE_BUSY_MIN


def _cpu_text(cpu: float | None, runnable: float | None) -> str:
    text = f"CPU {cpu:.0f}%" if cpu is not None else "CPU ?%"
    if runnable is not None and runnable >= RUNNABLE_BUSY_MIN and (cpu or 0.0) < DEADLOCK_CPU_MAX:
        text += f" (runnable {runnable:.0f}% of the time: the machine is loaded)"
    return text


def _moved(focus: Sequence[ThreadStack | None], cpu: float | None, runnable: float | None) -> str | None:
    """The innermost frames of two samples that differ while the process used (or wanted) the CPU."""
    tops = [t.python_frames[0] for t in focus if t is not None and t.python_frames]
    if len(tops) < 2 or not ((cpu or 0.0) >= WORK_CPU_MIN or (runnable or 0.0) >= RUNNABLE_BUSY_MIN):
        return None
    other = next((f for f in tops[1:] if (f.file, f.line) != (tops[0].file, tops[0].line)), None)
    return f"{tops[0].short()} -> {other.short()}" if other is not None else None


def _kind(ev: Evidence, runnable: float | None) -> tuple[HangKind, str]:
    """`classify.hang_kind`, with a busy loop that a loaded machine gives little CPU judged by how much it
    wanted to run."""
    kind, why = hang_kind(ev)
    cpu = ev.cpu_percent
    if kind == "unknown" and cpu is not None and runnable is not None and runnable >= RUNNABLE_BUSY_MIN:
        starved, starved_why = hang_kind(replace(ev, cpu_percent=runnable))
        if starved == "python-busy":
            kind, why = starved, starved_why.replace(f"CPU {runnable:.0f}%", _cpu_text(cpu, runnable))
    return kind, why


def _sleeping(ob: ProcessObservation, cpu: float | None) -> str | None:
    """Without a stack: its main thread in the kernel's nanosleep (``time.sleep``) in every round, or in
    most and running in the others (a loop that naps, caught awake between two naps)."""
    rounds = ob.main_threads()
    naps = [t.get("wchan") or "" for t in rounds if "nanosleep" in (t.get("wchan") or "")]
    awake = [t for t in rounds if not t.get("wchan")]  # running or runnable: /proc gives no wait channel
    if len(naps) < 2 or 2 * len(naps) < len(rounds) or len(naps) + len(awake) < len(rounds):
        return None
    if (cpu or 0.0) >= DEADLOCK_CPU_MAX:
        return None
    rounds_text = (
        "in every round" if not awake else f"in {len(naps)} of {len(rounds)} rounds (running in the others)"
    )
    return (
        f"sleeping: its main thread in the kernel's {naps[-1]} {rounds_text}, "
        f"{_cpu_text(cpu, None)} (no stack): {SLEEP_NO_WORK} while attach watched"
    )


def judge_process(
    ob: ProcessObservation, role: Role = "training", leaf: bool = True,
    workers: Mapping[str, str | None] | None = None,
) -> ProcessActivity:  # fmt: skip
    """The state, kind and reason of one observed process (module docstring). ``workers``: what its
    DataLoader workers are doing (a label -> what shows their work, None when they do none)."""
    cpu, runnable = ob.cpu_percent(), ob.runnable_percent()
    beacons = ob.beacons()
    progress, stalled_for, heartbeat = _beacon_progress(ob)
    samples = stack_samples(ob)
    focus = [focus_thread(threads) for threads in map(stacks.parse_faulthandler, samples) if threads]

    def act(
        state: State, kind: HangKind | None, why: str, record: ActivityProgress | None = None
    ) -> ProcessActivity:
        return ProcessActivity(
            pid=ob.pid, state=state, kind=kind, why=why, progress=progress if record is None else record,
            location=location(ob.info.probe, beacons[-1] if beacons else None), rank=_rank_of(ob.info),
            cpu_percent=cpu, runnable_percent=runnable, gpu_percent=_gpu_percent(ob),
            stalled_for_s=round(stalled_for, 3) if stalled_for is not None else None, python=ob.info.python,
            leaf=leaf, role=role, stack_samples=len(focus), thread=focus[-1] if focus else None,
        )  # fmt: skip

    if ob.gone:
        stalled_for = None
        return act("gone", None, "it ended while attach watched", ActivityProgress())
    thread = ob.main_thread() or {}
    threads = [t for threads in map(stacks.parse_faulthandler, samples) for t in threads]
    ev = Evidence(
        outcome="stalled", stack_samples=samples, pyspy=ob.pyspy_text, pyspy_more=ob.pyspy_more,
        cpu_percent=cpu, heartbeat_advancing=heartbeat, gpu_utilization=_gpu_percent(ob),
        main_wchan=thread.get("wchan"), main_state=thread.get("state"),
        where=_where(beacons[-1] if beacons else None), source_lines=stacks.source_lines(threads),
        loops=stacks.enclosing_loops(threads), workers=dict(workers or {}), file_locks=ob.file_locks,
    )  # fmt: skip
    if ob.info.python:
        kind: HangKind | None
        kind, why = _kind(ev, runnable)
        if not samples:
            seen = why if kind != "unknown" else f"nothing moved: {_cpu_text(cpu, runnable)}"
            why = f"{seen}; {_waits(ob)} (no stack: no SIGUSR1 handler's dump and no py-spy dump)"
    else:
        kind, why = None, f"not a Python process; {_waits(ob)}, {_cpu_text(cpu, runnable)}"

    # work
    if progress.get("by") == "beacon":
        return act("progressing", kind, why)
    work = _liveness(ob)
    if work is not None and work.working:
        return act(
            "progressing",
            kind,
            f"working: {work.describe()}",
            ActivityProgress(**progress, by="liveness", work=work.to_json()),
        )
    moved = _moved(focus, cpu, runnable)
    if moved:
        text = f"its innermost frame moved between the stack samples ({moved}), {_cpu_text(cpu, runnable)}"
        return act("progressing", kind, text, ActivityProgress(by="stacks", moved=moved, cpu_percent=cpu))
    native = native_moved(ev)
    if native:
        cpu_text = _cpu_text(cpu, runnable)
        text = f"its native frames moved between py-spy dumps ({native}), {cpu_text}: C code that computes"
        return act("progressing", kind, text, ActivityProgress(by="native", moved=native, cpu_percent=cpu))
    io = ob.io_bytes()
    if io is not None and io >= WORK_IO_BYTES:
        return act(
            "progressing",
            kind,
            f"it read or wrote {io / 2**20:.1f} MiB while watched",
            ActivityProgress(by="io", io_bytes=io),
        )

    # waiting by design
    last = focus[-1] if focus else None
    if role == "dataloader-worker" and dataloader_worker_idle(last):
        return act("idle", kind, "idle DataLoader worker: waiting for indices from its training process")
    if role == "launcher":
        return act("idle", kind, "torch's launcher (torchrun's agent): waiting on its ranks")
    if role == "shell":
        return act("idle", kind, "the shell command: waiting for its child process")

    # not working, not stuck
    pause = pause_reason(ev) if samples else _sleeping(ob, cpu)
    if pause is None and samples and why.startswith("sleeping"):  # a sleep: no work, for as long as seen
        pause = f"{why}, while attach watched (under watch, no work for the stall limit is a hang)"
    if pause:
        return act("paused", kind, pause)

    stale = f"no progress event for {stalled_for:.1f} s; " if progress and stalled_for is not None else ""
    if kind in STUCK_KINDS:
        return act("stalled", kind, stale + why)
    if _wants_cpu(cpu, runnable):
        if not samples:
            why = (
                f"{_cpu_text(cpu, runnable)} of a core, and no stack to tell work from a spin: {_waits(ob)} "
                "(no SIGUSR1 handler's dump and no py-spy dump)"
            )
        elif kind == "python-busy":
            why += ": one long computation and a busy loop look alike from outside"
        return act("unclear", kind, stale + why)
    return act("stalled", kind, stale + why)


# --- the tree -------------------------------------------------------------------------------------------


def _facts(ob: ProcessObservation) -> ProcessFacts:
    info = ob.info
    texts = [*ob.dumps, *ob.pyspy_samples, *([ob.pyspy_text] if ob.pyspy_text else [])]
    return replace(_info_facts(info), stacks="\n".join(texts))


def _info_facts(info: ProcessInfo) -> ProcessFacts:
    probe = info.probe
    return ProcessFacts(
        pid=info.pid, ppid=info.ppid, argv=info.cmdline, python=info.python, rank=_rank_of(info),
        role=probe.role if probe is not None else None,
        forked_from=probe.forked_from if probe is not None else None,
    )  # fmt: skip


def tree_roles(tree: TreeObservation) -> dict[int, Role]:
    """What each process of the tree is (`nsa_diag.evidence.roles.assign_roles`), the unobserved
    descendants (``--no-children``) included for what the observed ones are."""
    return assign_roles([*map(_facts, tree.processes), *map(_info_facts, tree.relatives)])


def _progress_text(act: ProcessActivity) -> str:
    p = act.progress
    if p.get("by") == "beacon":
        steps = ""
        if p.get("step_from") is not None and p.get("step_to") != p.get("step_from"):
            steps = f", step {p['step_from']} -> {p['step_to']} ({p.get('steps_per_s', 0):.3g} steps/s)"
        at = f", at {act.location}" if act.location else ""
        return f"{act.label()}: {p['events_per_s']:.3g} progress events/s{steps}{at}"
    return f"{act.label()}: {act.why}"


def _focus(candidates: Sequence[ProcessActivity]) -> ProcessActivity:
    """The stalled process that explains the tree: by `KIND_ORDER`, a leaf before its parents."""
    return min(candidates, key=lambda a: (KIND_ORDER.index(a.kind), not a.leaf, a.pid))


def _settle(tree: TreeObservation, unclear: Sequence[ProcessActivity]) -> str:
    """What would settle an unclear state, from what was missing: a stack at all (py-spy, ptrace, signals),
    native frames a few dumps apart for one busy at a frame (py-spy), the probe's counters (watch)."""
    caught = {ob.pid for ob in tree.processes if ob.info.sigusr1_caught}
    parts = []
    if not tree.pyspy_installed:
        parts.append(
            "py-spy installed (`pip install py-spy`: every Python process's stack and native frames)"
        )
    elif tree.pyspy_refused:
        parts.append("ptrace allowed for py-spy (the note says how)")
    blind = [a.pid for a in unclear if not a.stack_samples]
    handled = [pid for pid in blind if pid in caught]
    if handled and not tree.send_signal:
        parts.append(
            f"signals allowed (pid {', '.join(map(str, handled))} handles SIGUSR1: drop --no-signal)"
        )
    parts.append(WATCH_HINT)
    return " or ".join(parts)


def _others(acts: Sequence[ProcessActivity], focus: ProcessActivity | None) -> list[str]:
    """The other processes in a few words: training processes with their state, the rest as what they are."""
    texts = []
    for a in acts:
        if a is focus or a.state == "gone":
            continue
        if a.role in TRAINING_ROLES:
            kind = f" ({a.kind})" if a.kind and a.state in ("stalled", "unclear") else ""
            texts.append(f"{a.label()}: {a.state}{kind}, {a.why}")
        else:
            texts.append(f"pid {a.pid}: {a.why}" if a.state == "idle" else f"{a.label()}: {a.state}, {a.why}")
    return texts


def _waits_for(
    focus: ProcessActivity, acts: Sequence[ProcessActivity], parents: Mapping[int, int | None]
) -> str:
    """The DataLoader workers the focus process waits on for its next batch, with what they do."""
    if not waits_on_dataloader(focus.thread):
        return ""
    workers = [a for a in acts if a.role == "dataloader-worker" and parents.get(a.pid) == focus.pid]
    if not workers:
        return ""
    said = "; ".join(f"pid {a.pid}: {a.state}, {a.why}" for a in workers)
    return f"; it waits for its next batch from its DataLoader worker(s): {said}"


def _minority(
    tree: TreeObservation, training: Sequence[ProcessActivity]
) -> tuple[list[int], StackDiff | None]:
    """The ranks' minority from their focus threads (`cross_rank_diff`), else from the probe's collective
    counts (``at_hang.json``, where a watchdog left one for every rank)."""
    ranks = {a.rank: a for a in training if a.role == "rank" and a.rank is not None}
    if len(ranks) < 2:
        return [], None
    diff = cross_rank_diff({r: a.thread for r, a in ranks.items()}, {})
    if not diff.minority_ranks:
        at_hang = {ob.info.pid: ob.at_hang for ob in tree.processes if ob.at_hang}
        by_rank = {r: at_hang[a.pid] for r, a in ranks.items() if a.pid in at_hang}
        if len(by_rank) == len(ranks):
            minority_by_counts(diff, by_rank)
    if not diff.minority_ranks:
        # py-spy's native frames (not in the focus threads) showed some ranks waiting for the GPU: under
        # NCCL, a collective whose partner never comes waits there; the ranks that do not are waited for
        waiting = sorted(r for r, a in ranks.items() if a.kind in ("cuda-kernel", "collective"))
        if waiting and len(waiting) < len(ranks):
            odd = sorted(r for r in ranks if r not in waiting)
            who = ", ".join(map(str, waiting))
            diff.minority_ranks, diff.majority_ranks = odd, waiting
            diff.basis = (
                f"rank(s) {who} wait for the GPU or in a collective, the others do not (an NCCL "
                "collective whose partner never comes waits on the device)"
            )
    return list(diff.minority_ranks), diff


def _no_training(acts: Sequence[ProcessActivity], parents: Mapping[int, int | None]) -> str:
    texts = []
    for a in acts:
        if a.state == "gone":
            continue
        where = ""
        if a.role == "dataloader-worker" and parents.get(a.pid):
            where = f"; attach its training process, pid {parents[a.pid]}"
        elif a.role == "launcher":
            where = "; attach it without --no-children, or attach a rank"
        said = a.why if a.state == "idle" else f"{a.state}, {a.why}"
        texts.append(f"pid {a.pid}: {said}{where}")
    return "no training process among the processes watched: " + "; ".join(texts)


def judge_tree(tree: TreeObservation) -> TreeActivity:
    """The tree's state, hang kind and one-line reason (module docstring)."""
    roles = tree_roles(tree)
    parents = {ob.pid: ob.info.ppid for ob in tree.processes}
    parents.update({info.pid: info.ppid for info in tree.relatives})
    by_pid: dict[int, ProcessActivity] = {}
    for ob in sorted(tree.processes, key=lambda ob: roles.get(ob.pid) != "dataloader-worker"):
        workers = {
            a.label(): (a.why if a.state == "progressing" else None)
            for a in by_pid.values()
            if a.role == "dataloader-worker" and parents.get(a.pid) == ob.pid
        }
        leaf = ob.pid not in parents.values()
        by_pid[ob.pid] = judge_process(ob, roles.get(ob.pid, "training"), leaf, workers)
    acts = tuple(by_pid[ob.pid] for ob in tree.processes)
    live = [a for a in acts if a.state != "gone"]
    training = [a for a in acts if a.role in TRAINING_ROLES]
    live_training = [a for a in training if a.state != "gone"]
    if not live or (training and not live_training):
        what = "its training processes" if live else f"PID {tree.root}"
        return TreeActivity("gone", None, f"{what} ended while attach watched", None, acts)
    if not live_training:
        return TreeActivity("unclear", None, _no_training(acts, parents), None, acts)

    movers = [a for a in live_training if a.state == "progressing"]
    if movers:
        text = "; ".join(_progress_text(a) for a in movers)
        rest = [a for a in live_training if a.state != "progressing"]
        also = (
            f" (not progressing: {'; '.join(f'{a.label()}: {a.state}, {a.why}' for a in rest)})"
            if rest
            else ""
        )
        return TreeActivity("progressing", None, text + also, movers[0].pid, acts)

    stalled = [a for a in live_training if a.state == "stalled"]
    unclear = [a for a in live_training if a.state == "unclear"]
    stuck = [a for a in stalled if a.kind in SELF_STUCK_KINDS]
    if unclear and not stuck:
        focus = max(unclear, key=lambda a: (a.cpu_percent or 0.0, -a.pid))
        others = "; ".join(_others(acts, focus))
        reason = f"{focus.label()}: {focus.why}" + (f"; {others}" if others else "")
        reason += f"; what would settle it: {_settle(tree, unclear)}"
        return TreeActivity("unclear", focus.kind, reason, focus.pid, acts)
    if stalled:
        minority, diff = _minority(tree, live_training)
        ranks = {a.rank: a for a in live_training if a.role == "rank"}
        focus = ranks[minority[0]] if minority and minority[0] in ranks else _focus(stuck or stalled)
        kind = focus.kind
        if minority:
            counted = str((diff or {}).get("basis", "")).startswith("collective counts")
            kinds = {r: a.kind for r, a in ranks.items() if r is not None}
            kind = minority_hang_kind(kinds, minority, counted, kind)  # type: ignore[assignment]
        at = f" at {focus.location}" if focus.location else ""
        reason = f"{focus.label()}{at}: {focus.why}"
        if minority:
            div = ((diff or {}).get("first_divergent_frame") or {}).get(str(minority[0])) or {}
            frame = f", first divergent frame {div['frame']}" if div.get("frame") else ""
            reason += (
                f"; minority rank(s) {', '.join(map(str, minority))}{frame} ({(diff or {}).get('basis')})"
            )
        reason += _waits_for(focus, acts, parents)
        others = _others(acts, focus)
        reason += f"; {'; '.join(others)}" if others else ""
        return TreeActivity("stalled", kind, reason, focus.pid, acts, tuple(minority), diff)
    focus = live_training[0]
    others = _others(acts, focus)
    reason = f"{focus.label()}: {focus.why}" + (f"; {'; '.join(others)}" if others else "")
    return TreeActivity("paused", None, reason, focus.pid, acts)
