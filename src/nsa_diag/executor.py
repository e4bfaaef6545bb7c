"""The one place a case is run: `run_case(spec, case_dir, launcher)` and `run_cases`, always a result.

Whatever hosts the job (our worker, torchrun's ranks, a user's own command), a case runs the same way,
through the job protocol of its launcher (`nsa_diag.launchers.base`): write ``spec.json`` and
``replay.sh`` from the launcher's `LaunchPlan`, start the job in a new session with stdin closed, and
watch every unit's beacon (`nsa_diag.watchdog.watch`). On a stall or a timeout, gather the evidence before
any kill: the launcher's own (NCCL flight recorder), then for every live process memory at the hang, two
stack samples a second apart, py-spy, GPU and ``/proc`` (in parallel when there are several); then stop
every process of the job, and let the launcher judge what was seen (`Launcher.outcome`: each unit
classified by `nsa_diag.results.unit_result`, then combined); write ``result.json``. A unit that
stalled but is only paused (it sleeps, writes a checkpoint, computes between two progress events, or
waits for a batch its DataLoader worker is producing: `nsa_diag.results.stalled_pause`) is not stopped:
the watch goes on with that unit's stall clock started again, and result.json lists the pauses.

`run_case` returns a `CaseResult` in every outcome and raises only `Interrupted` (a KeyboardInterrupt)
when nsa-diag itself gets SIGINT, SIGTERM or SIGHUP (`nsa_diag.interrupts`), after the job's processes
are gone and the case's ``result.json`` (verdict error) is written. `InterruptGuard` holds those signals
back while a job starts or stops, so an interrupt never leaves a job started but unknown, or half stopped.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

from nsa_diag import artifacts, interrupts
from nsa_diag.beacon import BeaconState, read_beacon
from nsa_diag.classify import samples_disagree
from nsa_diag.evidence.env import collect_env
from nsa_diag.evidence.roles import TRAINING_ROLES
from nsa_diag.guard import CASE_ENV, Guardian, sweep
from nsa_diag.interrupts import Interrupted
from nsa_diag.launchers import (
    JobEnd,
    Launcher,
    LaunchPlan,
    Stage,
    Unit,
    dataloader_workers,
    default_launcher,
    observed_units,
    pinned_env,
)
from nsa_diag.records import CaseEvidence, JobNotes, Pause, RestartedHang, StopReport
from nsa_diag.results import case_files, error_result, signal_name, stalled_pause
from nsa_diag.spec import CaseResult, CaseSpec
from nsa_diag.watchdog import (
    BeaconSource,
    HangEvidence,
    ProcessHandle,
    Watched,
    Watcher,
    WatchResult,
    gather_hang_evidence,
)

ProgressCallback = Callable[[BeaconState | None, float], None]
EVIDENCE_JOIN_S = 60.0  # per unit, when several are sampled at once: one wedged sampler must not hold all


class InterruptGuard:
    """SIGINT/SIGTERM/SIGHUP -> `Interrupted` while a case runs; held back inside `deferred` (starting the
    job, stopping it), so an interrupt can never leave a job started but unknown, or half stopped. Every
    signal is noted (`nsa_diag.interrupts.note`) first: one noted before the case, even one whose
    KeyboardInterrupt some library swallowed, stops it before it starts."""

    def __init__(self) -> None:
        self._handlers = interrupts.handled_by(self._handle)
        self._depth = 0
        self._closing = False

    def __enter__(self) -> InterruptGuard:
        self._handlers.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._handlers.__exit__(None, None, None)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        interrupts.note(signum)
        if self._depth or self._closing:
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if not self._depth and not self._closing:
            interrupts.check()

    def close(self) -> None:
        """From now on signals are only noted: the cleanup after an interrupt runs to its end."""
        self._closing = True


def _swept(result: CaseResult, stop: StopReport, marker: str) -> CaseResult:
    """After the job was stopped: stop what of it is left by the case's marker (a process that left the
    job's session or process group: a daemon), and name it in the result. A job left running on purpose
    (``watch --keep-alive``: its stop report says so) is left alone."""
    if stop.kept_alive:
        return result
    swept = sweep(marker)
    if not swept:
        return result
    stop = (result.evidence.stop or StopReport()).model_copy(update={"swept": swept})
    evidence = result.evidence.model_copy(update={"stop": stop})
    note = (
        f"; nsa-diag also stopped pid(s) {', '.join(map(str, swept))} of the case, which had left the job's "
        "process group or session (found by the case's marker in their environment)"
    )
    return result.model_copy(update={"evidence": evidence, "reason": result.reason + note})


def _release(guardian: Guardian | None) -> None:
    if guardian is not None:
        guardian.release()


def _write_case_files(spec: CaseSpec, plan: LaunchPlan, replay_argv: Sequence[str] | None) -> None:
    """spec.json, and replay.sh: the caller's command (default: the plan's) with the plan's variables and,
    of the job's environment, the `REPLAY_PINNED` ones; it runs in this working directory."""
    artifacts.write_json(plan.home / artifacts.SPEC, spec)
    replay_env = {**plan.replay_env, **pinned_env(plan.env)}
    replay = list(replay_argv or plan.replay_argv)
    artifacts.write_replay(plan.home / artifacts.REPLAY, replay, replay_env, cwd=Path.cwd())


def _finish(case_dir: Path, result: CaseResult, launcher: Launcher) -> CaseResult:
    """Remove the job's internal files, then write result.json with the files the case leaves."""
    try:
        internal = launcher.internal_files(case_dir)
    except Exception:  # a launcher's bug must not cost the case its result.json
        internal = []
    artifacts.remove_files(internal)
    path = launcher.home(case_dir) / artifacts.RESULT
    artifacts.write_json(path, result)  # result.json lists itself
    result = result.model_copy(update={"files": case_files(case_dir)})
    artifacts.write_json(path, result)
    return result


def gather_evidence(
    spec: CaseSpec,
    units: Sequence[Unit],
    watched: Sequence[WatchResult],
    targets: Mapping[int, ProcessHandle],
) -> dict[int, HangEvidence]:
    """The watchdog's evidence of every process in ``targets`` (by unit key), before any kill. One unit is
    sampled here; several in parallel threads, each sampling its own pid, so that all are taken at the
    same moment of the hang."""
    by_key = {u.key: (u, w) for u, w in zip(units, watched, strict=True)}
    out: dict[int, HangEvidence] = {}

    def one(key: int) -> None:
        unit, w = by_key[key]
        out[key] = gather_hang_evidence(
            targets[key], unit.folder, spec, w.last_state, unit.no_signal, look_again=samples_disagree
        )

    if len(units) == 1:
        for key in targets:
            one(key)
        return out
    threads = [threading.Thread(target=one, args=(key,), daemon=True) for key in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=EVIDENCE_JOIN_S)
    return out


def _exit_text(code: int) -> str:
    """An exit status as a pause says it: "exit code 0", "killed by SIGKILL"."""
    name = signal_name(code)
    return f"killed by {name}" if name else f"exit code {code}"


def _progressed_since(unit: Unit, seen: WatchResult) -> bool:
    """Whether the unit that stalled reported progress after the watcher's last read, by the end of every
    unit's evidence, not of its own alone: the others' (py-spy dumps of busy processes, seconds each on a
    loaded machine) can outlast the wait it was stalled in (a Pool's map that returned meanwhile)."""
    if unit.beacon is None:
        return False
    after, last = read_beacon(unit.beacon), seen.last_state
    return after is not None and (last is None or after.seq > last.seq)


def _pause(
    spec: CaseSpec, units: Sequence[Unit], watched: Watched, hangs: Mapping[int, HangEvidence]
) -> str | None:
    """Why the unit that stalled is only paused (`nsa_diag.results.stalled_pause`), or None: it is hung."""
    if watched.outcome != "stalled" or watched.decider is None:
        return None
    observed = observed_units(units, watched.units, hangs)
    key = units[watched.decider].key

    def is_rank(unit: Unit) -> bool:  # torchrun's ranks under `ddp`; a watched job's by their role
        return unit.role == "rank" or (unit.role is None and spec.ddp is not None)

    others = [u for u in units if u.key != key and is_rank(u)] if is_rank(units[watched.decider]) else []
    ranks = [replace(observed[u.key], label=f"rank {u.key}") for u in others]
    # its Python child processes (a Pool's workers, a subprocess.run of python): not its DataLoader workers
    # (`dataloader_workers`), nor a program without a probe (a shell, a service written in Go)
    children = [
        replace(observed[u.key], label=f"pid {u.key}")
        for u in units
        if u.parent == key and u.role == "helper"
    ]
    why = stalled_pause(spec, observed[key], dataloader_workers(key, units, observed), ranks, children)
    if why is None and _progressed_since(units[watched.decider], watched.units[watched.decider]):
        why = "it reported progress while the evidence of the job's processes was taken"
    return why


def _restart_hung(end: JobEnd, launcher: Launcher, elapsed: float) -> RestartedHang | None:
    """A hang the job's own launcher can restart (`Launcher.restart_hung`: torchrun with restarts left):
    the verdict the job would get if stopped now (`Launcher.outcome`: the culprit rank, its line), kept,
    and the hung attempt's ranks killed so that torchrun starts the next; None where the launcher cannot
    (or the watch did not stall): the job is then stopped."""
    if end.watched.outcome != "stalled" or end.decider is None or not launcher.can_restart():
        return None
    # the ranks' flight recorders, analysed as after a stop: what names the rank the others wait for
    notes = end.notes.model_copy(deep=True)
    notes.add(launcher.evidence(end.case_dir, Stage.STOPPED).notes)
    judged = launcher.outcome(replace(end, notes=notes))
    if judged.verdict != "hang":
        return None
    restart = launcher.restart_hung()
    if restart is None:
        return None
    attempt, killed = restart
    minority = judged.evidence.minority_ranks
    culprit = minority[0] if len(minority) == 1 else end.decider
    return RestartedHang(
        attempt=attempt, unit=culprit, at_s=round(elapsed, 1), hang_kind=judged.hang_kind,
        reason=judged.reason, stopped=killed,
    )  # fmt: skip


@dataclass(frozen=True)
class _Watch:
    """What watching a job found: how it ended, the units watched, their evidence at a hang, the notes."""

    watched: Watched
    units: list[Unit]
    hangs: dict[int, HangEvidence]
    notes: JobNotes


def _watch(
    spec: CaseSpec,
    case_dir: Path,
    launcher: Launcher,
    proc: ProcessHandle,
    started: float,
    on_progress: ProgressCallback | None,
) -> _Watch:
    """Watch the job until it exits, stalls or runs out of time; at a stall or timeout take the evidence
    before any kill, and where the unit that stalled is only paused, watch on (the pauses in the notes)."""
    training = None
    if launcher.units_appear:  # a user's job: its processes come and go; asked again at every poll
        seen: list[Unit] = []

        def beacons() -> list[Path | None]:
            seen[:] = launcher.units(case_dir)
            return [u.beacon for u in seen]

        def training() -> list[bool]:  # of the units `beacons` just gave: judged from their start
            return [u.role in TRAINING_ROLES for u in seen]

        source: BeaconSource = beacons
    else:
        source = [u.beacon for u in launcher.units(case_dir)]
    watcher = Watcher(
        proc, source, spec, started, on_progress, optional_beacons=launcher.units_appear, training=training
    )
    pauses: list[Pause] = []
    restarted_hangs: list[RestartedHang] = []
    while True:
        watched = watcher.run()
        units = launcher.units(case_dir)[: len(watched.units)]
        notes = launcher.evidence(case_dir, Stage.WATCHED, units).notes
        hangs: dict[int, HangEvidence] = {}
        if watched.outcome == "exited":
            break
        taken = launcher.evidence(case_dir, Stage.HANG, units)
        notes.add(taken.notes)
        hangs = gather_evidence(spec, units, watched.units, taken.targets)
        # a job that ended by itself while its evidence was taken was not hung: its end decides
        code = proc.poll() if watched.outcome == "stalled" else None
        paused = (
            f"it ended by itself ({_exit_text(code)}) while the evidence was taken"
            if code is not None
            else _pause(spec, units, watched, hangs)
        )
        if paused is None:
            t0 = time.monotonic() - (time.time() - started)
            end = JobEnd(case_dir, units, watched, hangs, StopReport(), notes, t0)
            restarted = _restart_hung(end, launcher, time.time() - started)
            if restarted is None:
                break
            restarted_hangs.append(restarted)
            assert watched.decider is not None
            watcher.rearm(watched.decider)
            continue
        assert watched.decider is not None
        decision = watched.units[watched.decider].decision
        pauses.append(
            Pause(
                unit=units[watched.decider].key, at_s=round(time.time() - started, 1),
                idle_s=round(decision.idle_s, 1) if decision else None, why=paused,
            )
        )  # fmt: skip
        watcher.rearm(watched.decider)
    if pauses:
        notes.pauses = pauses
    if restarted_hangs:
        notes.restarted_hangs = restarted_hangs
    return _Watch(watched, units, hangs, notes)


# --- entry points -------------------------------------------------------------------------------------


def run_case(
    spec: CaseSpec,
    case_dir: Path,
    launcher: Launcher | None = None,
    *,
    replay_argv: Sequence[str] | None = None,
    on_progress: ProgressCallback | None = None,
    extra_env: Mapping[str, str] | None = None,
    record_if_killed: bool = True,
) -> CaseResult:
    """Run one case in ``case_dir``; the result (also written to ``result.json``) whatever happened.

    ``launcher``: how the job starts and what it has (a fresh one per case); None picks
    `nsa_diag.launchers.default_launcher` (torchrun when ``spec.ddp`` is set, else our worker).
    ``replay_argv`` is the command line ``replay.sh`` runs (default: the launcher's own command).
    ``extra_env``: variables for this job (``nsa-diag matrix --jobs`` gives each case its own GPU through
    ``CUDA_VISIBLE_DEVICES``); ``replay.sh`` keeps only those of `REPLAY_PINNED`, the device among them.
    From a thread other than the main one no signal handler is installed; ``on_progress`` may raise
    `Interrupted` there to stop the case.
    Raises `Interrupted` (a KeyboardInterrupt) on SIGINT/SIGTERM/SIGHUP, after stopping the job (also
    when one was noted before the case: it then never starts, and its result.json says so).
    """
    case_dir = Path(case_dir)
    case_dir.mkdir(parents=True, exist_ok=True)
    launcher = launcher if launcher is not None else default_launcher(spec)
    started, t0 = time.time(), time.monotonic()
    guard = InterruptGuard()
    # Every process of the case carries it (`nsa_diag.guard`): the launcher's own folder, so that a node of
    # a multi-node case, which shares the case folder with the others, never sweeps another node's ranks
    # (two nodes on one host).
    marker = str(launcher.home(case_dir).resolve())
    guardian: Guardian | None = None
    with guard:
        try:
            interrupts.check()  # noted before this case (e.g. while torch was imported): it never starts
            plan = launcher.plan(case_dir, extra_env)
            plan = replace(plan, env={**plan.env, CASE_ENV: marker})
            _write_case_files(spec, plan, replay_argv)
            with guard.deferred():
                guardian = Guardian(marker, record=record_if_killed)
                proc = launcher.start(plan)
            seen = _watch(spec, case_dir, launcher, proc, started, on_progress)
            seen.notes.add(launcher.evidence(case_dir, Stage.STOPPING).notes)
            with guard.deferred():
                stop = launcher.stop()
            seen.notes.add(launcher.evidence(case_dir, Stage.STOPPED).notes)
            end = JobEnd(case_dir, seen.units, seen.watched, seen.hangs, stop, seen.notes, t0)
            result = _swept(launcher.outcome(end), stop, marker)
        except KeyboardInterrupt as exc:
            guard.close()
            by = getattr(exc, "signal_name", "SIGINT")
            sampled = launcher.evidence(case_dir, Stage.INTERRUPTED).sampled
            stop = launcher.stop()
            result = launcher.interrupted(case_dir, by, time.monotonic() - t0, stop, sampled)
            result = _swept(result, stop, marker)
            _finish(case_dir, result, launcher)
            _release(guardian)
            raise
        except Exception as exc:  # a bug of the toolkit: the case still gets its result, the job its end
            guard.close()
            stop = launcher.stop()
            result = error_result(
                spec,
                f"nsa-diag internal error while running the {launcher.label}: {type(exc).__name__}: {exc}",
                time.monotonic() - t0,
                CaseEvidence(outcome="internal-error", traceback=traceback.format_exc(), stop=stop),
            )
            result = _swept(result, stop, marker)
        with guard.deferred():  # an interrupt now comes after the result is on disk
            _release(guardian)
            return _finish(case_dir, result, launcher)


def run_cases(
    specs: Sequence[CaseSpec],
    run_dir: Path,
    *,
    replay_argv: Callable[[CaseSpec], Sequence[str]] | Mapping[str, Sequence[str]] | None = None,
    on_case_start: Callable[[CaseSpec], None] | None = None,
    on_progress: ProgressCallback | None = None,
    on_case_end: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Run ``specs`` one after the other into ``run_dir/cases/<name>/``; writes ``run_dir/env.json``.

    ``replay_argv``: per case, the command line of its ``replay.sh`` (a function of the spec, or a
    mapping by case name). Raises `Interrupted` when interrupted (the running case has its result.json).
    """
    run_dir = Path(run_dir)
    artifacts.write_json(run_dir / artifacts.ENV, collect_env())
    results = []
    for spec in specs:
        if on_case_start is not None:
            on_case_start(spec)
        if callable(replay_argv):
            argv: Sequence[str] | None = replay_argv(spec)
        else:
            argv = (replay_argv or {}).get(spec.name)
        result = run_case(
            spec, artifacts.case_dir(run_dir, spec.name), replay_argv=argv, on_progress=on_progress
        )
        results.append(result)
        if on_case_end is not None:
            on_case_end(result)
    return results
