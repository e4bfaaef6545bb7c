"""The job protocol: how the executor starts a case's job, watches it, takes its evidence, stops it and
judges it, whatever hosts it.

The executor (`nsa_diag.executor.run_case`) talks to a job only through these methods of its `Launcher`,
in this order, each with a typed result:

- ``home(case_dir) -> Path``: where the launcher's own files go (spec.json, replay.sh, the logs,
  result.json);
- ``plan(case_dir, extra_env) -> LaunchPlan``: the job's folders made; its command line, environment,
  working directory, where its output is echoed, replay.sh's command and variables;
- ``start(plan) -> ProcessHandle``: the job started in a new session, stdin closed, its output through
  the logs' cap (`nsa_diag.logcap`);
- ``units(case_dir) -> list[Unit]``: the processes the watchdog judges (`nsa_diag.watchdog.watch`), each
  with its folder and beacon;
- ``evidence(case_dir, stage, units) -> Evidence``: what only the launcher takes, at each `Stage`: the
  watch ended (the ranks' pids), a hang (before any kill: the NCCL flight recorder, and which processes
  the watchdog samples), before the stop (a multi-node case's barrier), after it, at an interrupt;
- ``stop() -> StopReport``: every process of the job stopped, and what it took;
- ``outcome(end: JobEnd) -> CaseResult``: the case's result from what the executor saw;
- ``interrupted(case_dir, by, elapsed, stop, sampled) -> CaseResult``: nsa-diag itself was interrupted;
- ``internal_files(case_dir) -> list[Path]``: the files only the running job uses, removed at the end.

A launcher object runs one case: it keeps what it learns of the job (the process, the ranks' pids).
`Launcher` holds the defaults, so a simple launcher is short (`nsa_diag.launchers.worker`): it implements
`plan`, `units`, `stop_processes` (what `stop` does once the job started) and `outcome`, which composes
`classified` (each unit's result, `nsa_diag.results.unit_result`) with its own way of combining them
(a worker: its one unit's result; torchrun: the cross-rank aggregation, `nsa_diag.analysis.ranks`).

Adding a launcher is one more module here and nothing else: subclass `Launcher`, implement those four,
and pass an instance to `run_case` (or teach `nsa_diag.launchers.default_launcher` when a spec field
should pick it). A user's own command (``nsa-diag watch -- python train.py``): `plan`'s argv is that
command, its environment adds the probe's ``sitecustomize`` to ``PYTHONPATH``; `units` gives each process
a folder and the probe's beacon, or ``beacon=None`` for one without the probe: the watchdog then never
calls it stalled, only the timeout applies, and its verdict comes from its exit status, /proc and py-spy.
A cluster launcher: `start` submits and returns a handle whose ``poll``/``pid`` follow the job
(`ProcessHandle`), `units` are the ranks' folders on shared storage, `stop_processes` cancels the job.
"""

from __future__ import annotations

import enum
import os
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nsa_diag import artifacts
from nsa_diag.logcap import LogPump
from nsa_diag.records import JobNotes, StopReport
from nsa_diag.results import Observed, interrupted_result, unit_result, worker_activity
from nsa_diag.spec import CaseResult, CaseSpec
from nsa_diag.watchdog import HangEvidence, ProcessHandle, Watched, WatchResult
from nsa_diag.worker import tether

# The package root above nsa_diag: children import the same nsa_diag as this process, installed or not.
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


# --- the records of the protocol ----------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchPlan:
    """How a case's job starts, decided before it does (`Launcher.plan`)."""

    home: Path  # the launcher's own files of the case (`Launcher.home`)
    argv: list[str]  # the command line that starts the job
    env: Mapping[str, str]  # the job's whole environment (this run's extra variables included)
    replay_argv: list[str]  # what replay.sh runs when the caller gives no replay command
    # the variables replay.sh exports: those the job depends on, not this machine's others (the executor
    # adds, of `env`, the `REPLAY_PINNED` ones)
    replay_env: Mapping[str, str]
    cwd: str | None = None  # the job's working directory (None: this process's)
    # where the job's stdout and stderr are shown while nsa-diag runs, besides the logs (None: not shown):
    # a user's command is followed on the terminal; our worker's output only goes to the logs
    echo: tuple[int | None, int | None] = (None, None)


@dataclass(frozen=True)
class Unit:
    """One process the watchdog judges: its key (0 for a worker, the rank under torchrun), the folder its
    files go to, and its beacon (None: a process that reports no progress)."""

    key: int
    folder: Path
    beacon: Path | None
    # Why no SIGUSR1 may be sent to this process for stack samples (its own handler, no probe); None: may.
    no_signal: str | None = None
    # What the process is (`nsa_diag.evidence.roles`): None for our own worker and ranks (training).
    role: str | None = None
    # The key of the unit it was forked from (a DataLoader worker's training process), else of its parent
    # process where that is one of the job's (a child started by exec), or None.
    parent: int | None = None


class Stage(enum.Enum):
    """When the executor asks a launcher for its evidence (`Launcher.evidence`)."""

    WATCHED = "watched"  # the polling loop ended (also when the job exited): learn what the rest needs
    HANG = "hang"  # a stall or a timeout, before any process is stopped
    STOPPING = "stopping"  # the evidence is taken, the job is about to be stopped (interrupts not held)
    STOPPED = "stopped"  # the job was stopped: what it left as it stopped
    INTERRUPTED = "interrupted"  # nsa-diag itself was interrupted, before the stop


@dataclass(frozen=True)
class Evidence:
    """What a launcher took of its job at one `Stage`: ``notes`` for the case's result; at `Stage.HANG`
    the processes (by unit key) whose stacks, /proc, py-spy and memory the watchdog takes; at
    `Stage.INTERRUPTED` whether it took a quick stack sample itself."""

    notes: JobNotes = field(default_factory=JobNotes)
    targets: Mapping[int, ProcessHandle] = field(default_factory=dict)
    sampled: bool = False


@dataclass(frozen=True)
class JobEnd:
    """What the executor saw of a job, for `Launcher.outcome`: the units watched, how the watch ended
    (``watched``: the outcome, each unit's record in the order of ``units``, the unit that decided), the
    watchdog's evidence of each unit at a hang (by key), what stopping it took, the launcher's notes, and
    when the case started (``t0``, `time.monotonic`)."""

    case_dir: Path
    units: Sequence[Unit]
    watched: Watched
    hangs: Mapping[int, HangEvidence]
    stop: StopReport
    notes: JobNotes
    t0: float

    @property
    def decider(self) -> int | None:
        """The key of the unit that stalled or timed out first (None when the job exited)."""
        return self.units[self.watched.decider].key if self.watched.decider is not None else None


@dataclass(frozen=True)
class Ending:
    """How a case's job ended, each unit classified (`classified`): ``outcome`` is the watch's
    (``exited``, ``stalled``, ``timeout``), ``per_unit`` each unit's classified result by key, ``decider``
    the key of the unit that stalled or timed out first (None when the job exited), ``stop`` what
    stopping the job took, ``elapsed`` seconds since the start, ``notes`` the launcher's evidence for
    ``result.json``."""

    case_dir: Path
    outcome: str
    per_unit: Mapping[int, CaseResult]
    decider: int | None
    stop: StopReport
    elapsed: float
    notes: JobNotes


# --- each unit's result -------------------------------------------------------------------------------

# Each unit's watch record and stop report, by key: how it ended, for its classification.
UnitEnds = Mapping[int, tuple[WatchResult, StopReport]]


def observed_units(
    units: Sequence[Unit], watched: Sequence[WatchResult], hangs: Mapping[int, HangEvidence]
) -> dict[int, Observed]:
    """Each unit as the executor saw it, by key."""
    return {
        u.key: Observed(f"pid {u.key}" if u.role else f"unit {u.key}", u.folder, w, hangs.get(u.key))
        for u, w in zip(units, watched, strict=True)
    }


def dataloader_workers(key: int, units: Sequence[Unit], observed: Mapping[int, Observed]) -> list[Observed]:
    """The DataLoader workers of unit ``key`` (forked from it), as observed."""
    return [observed[u.key] for u in units if u.parent == key and u.role == "dataloader-worker"]


def classified(spec: CaseSpec, end: JobEnd, ends: UnitEnds | None = None) -> Ending:
    """The job's end with each unit classified (`nsa_diag.results.unit_result`) from its end in ``ends``;
    by default each unit ends as the job did (one process: its own)."""
    if ends is None:
        ends = {u.key: (w, end.stop) for u, w in zip(end.units, end.watched.units, strict=True)}
    observed = observed_units(end.units, end.watched.units, end.hangs)
    per_unit = {}
    for unit in end.units:
        unit_watched, unit_stop = ends[unit.key]
        workers = {
            w.label: worker_activity(spec, w) for w in dataloader_workers(unit.key, end.units, observed)
        }
        per_unit[unit.key] = unit_result(
            spec, unit.folder, unit_watched, end.hangs.get(unit.key), unit_stop, time.monotonic() - end.t0,
            workers,
        )  # fmt: skip
    elapsed = time.monotonic() - end.t0
    return Ending(end.case_dir, end.watched.outcome, per_unit, end.decider, end.stop, elapsed, end.notes)


# --- the job's environment ----------------------------------------------------------------------------


def worker_env(spec: CaseSpec) -> dict[str, str]:
    """The environment variables the spec sets for its worker (also exported by ``replay.sh``).

    ``PYTHONSAFEPATH=1`` (Python 3.11+, as ``-P``): ``python -m`` would put the working directory first on
    ``sys.path``, and any ``pydantic.py`` or ``torch.py`` lying there would run inside the worker, torchrun
    and every rank. Only a ``--model`` module is imported from the working directory
    (`nsa_diag.worker.train.load_factory`)."""
    env = {"PYTHONSAFEPATH": "1"}
    if spec.alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = spec.alloc_conf
    if spec.launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    return env


# What replay.sh keeps of the environment the job ran with, beyond the plan's `replay_env`: the import
# path (a --model module's package, nsa_diag from a checkout) and the GPUs it saw (a matrix job's own).
REPLAY_PINNED = ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")


def pinned_env(child_env: Mapping[str, str]) -> dict[str, str]:
    """The `REPLAY_PINNED` variables of a job's environment, as the job had them."""
    return {name: child_env[name] for name in REPLAY_PINNED if name in child_env}


def python_env(spec: CaseSpec, extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the spec's variables and ``extra_env``, unbuffered output, this
    process's pid (the children die with it: `nsa_diag.worker.tether`), and ``PYTHONPATH`` leading to
    this nsa_diag: the environment our Python children start with."""
    env = {**os.environ, **worker_env(spec), **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
    env[tether.PARENT_ENV] = str(os.getpid())
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if SOURCE_ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([SOURCE_ROOT, *paths])
    return env


# --- the protocol, with its defaults -------------------------------------------------------------------


class Launcher(ABC):
    """How one case's job starts, what the watchdog watches of it, and how it ends (module docstring).

    ``label`` names the job in an internal-error reason ("... while running the case: ...").
    """

    label = "case"
    # True: the job's processes appear while it runs (a user's command); `units` is asked at every poll,
    # its list only grows, and a unit's beacon counts once it records progress
    # (`nsa_diag.watchdog.reports_progress`).
    units_appear = False

    def __init__(self, spec: CaseSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.logs: LogPump | None = None

    def home(self, case_dir: Path) -> Path:
        """Where this launcher's own files of the case go: spec.json, replay.sh, the job's stdout.log and
        stderr.log, result.json. The case folder, except for a node r > 0 of a multi-node case, which
        shares the case folder with node 0 and writes its own in ``nodes/<r>/``."""
        return Path(case_dir)

    @abstractmethod
    def plan(self, case_dir: Path, extra_env: Mapping[str, str] | None) -> LaunchPlan:
        """Make the folders the job expects; how it starts (asked once per case). ``extra_env``: for this
        run only, in the job's environment, not in ``replay.sh``."""

    def start(self, plan: LaunchPlan) -> ProcessHandle:
        """Start ``plan.argv`` in a new session with stdin closed, its output going to the case's logs
        through their cap (`nsa_diag.logcap`: head and tail kept, room left for the case's own files);
        straight into the log files when that process cannot start."""
        try:
            out, err = plan.echo
            self.logs = LogPump([(plan.home / artifacts.STDOUT, out), (plan.home / artifacts.STDERR, err)])
        except OSError:
            self.logs = None
        if self.logs is not None:
            try:
                self.proc = _popen(plan, *self.logs.job_fds)
            finally:
                self.logs.started()
            return self.proc
        with (
            artifacts.open_append(plan.home / artifacts.STDOUT, binary=True) as out,
            artifacts.open_append(plan.home / artifacts.STDERR, binary=True) as err,
        ):
            self.proc = _popen(plan, out.fileno(), err.fileno())
        return self.proc

    @abstractmethod
    def units(self, case_dir: Path) -> list[Unit]:
        """The processes the watchdog judges, each with its folder and beacon."""

    def evidence(self, case_dir: Path, stage: Stage, units: Sequence[Unit] = ()) -> Evidence:
        """What only this launcher takes of its job at ``stage`` (`Stage`; ``units``: those watched). By
        default nothing but, at a hang, the job's own process for its first unit (one process: our
        worker)."""
        if stage is Stage.HANG and self.proc is not None and units:
            return Evidence(targets={units[0].key: self.proc})
        return Evidence()

    def stop(self) -> StopReport:
        """Stop every process of the job (`stop_processes`), then wait (briefly) for its logs' last bytes:
        its result reads them. ``StopReport(started=False)`` when nothing was started. A job left running
        on purpose (``watch --keep-alive``) keeps its logs; only their copy to the terminal ends."""
        report = self.stop_processes() if self.proc is not None else StopReport(started=False)
        if self.logs is not None:
            if report.kept_alive:
                self.logs.detach()
            else:
                self.logs.finish()
        return report

    def can_restart(self) -> bool:
        """Whether the job's own launcher would restart its ranks if they failed now (`restart_hung`)."""
        return False

    def restart_hung(self) -> tuple[int, list[int]] | None:
        """At a hang, before the job is stopped: where the job's own launcher restarts failed ranks and has
        a restart left (torchrun ``--max-restarts``), kill the hung attempt's ranks so that it does, and
        say (that attempt, the pids killed); None where it cannot (the job is then stopped)."""
        return None

    @abstractmethod
    def stop_processes(self) -> StopReport:
        """Stop every process of the started job (also those it started in sessions of their own); what it
        took, with ``exit_code`` and any ``survivors`` (`nsa_diag.stopping.stop_tree`)."""

    @abstractmethod
    def outcome(self, end: JobEnd) -> CaseResult:
        """The case's result from what the executor saw of the job (`JobEnd`): its units classified
        (`classified`), combined as this launcher's job needs."""

    def interrupted(
        self, case_dir: Path, by: str, elapsed: float, stop: StopReport, sampled: bool
    ) -> CaseResult:
        """The result of a case nsa-diag's SIGINT/SIGTERM (``by``) ended, after `stop` (``sampled``: the
        launcher took a stack sample first, `Stage.INTERRUPTED`)."""
        return interrupted_result(self.spec, case_dir, by, elapsed, stop, sampled)

    def internal_files(self, case_dir: Path) -> list[Path]:
        """The files only the running job uses, removed when the case ends (after its result is built):
        by default `artifacts.INTERNAL_FILES` in each unit's folder."""
        return [unit.folder / name for unit in self.units(case_dir) for name in artifacts.INTERNAL_FILES]


def _popen(plan: LaunchPlan, out: int, err: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        plan.argv,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        env=dict(plan.env),
        cwd=plan.cwd,
        start_new_session=True,
    )
