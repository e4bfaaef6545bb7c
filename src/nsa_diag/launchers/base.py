"""The launcher interface: how a job starts, which processes and beacons it has, how it stops.

The executor (`nsa_diag.executor.run_case`) runs every case the same way, whatever hosts it:

1. ``prepare`` the case folder, write ``spec.json`` and ``replay.sh`` (`command`, `replay_argv`,
   `replay_env`, and of `child_env` the `REPLAY_PINNED` variables; it runs in this working directory);
2. `start` the job: `command` with `child_env`, stdin closed, stdout/stderr appended to the case's logs,
   in a session of its own (its own process group) so that it can be stopped as a whole;
3. watch its `units` (`nsa_diag.watchdog.watch`): each unit is a process the watchdog judges, with its
   folder and its beacon (one for our worker; one per local rank, ``ranks/<r>/``, under torchrun);
4. after a stall or a timeout, before any kill: `evidence_before_stop` (what only this launcher can take:
   torchrun's NCCL flight recorder), then the watchdog's evidence of every process in `sample_targets`
   (stacks, /proc, py-spy, GPU, memory);
5. `before_stop` (a multi-node case: every node has taken its evidence), then `stop` everything the job
   started, and report what it took;
6. each unit's result is classified (`nsa_diag.results.unit_result`) from `unit_ends` (each unit's watch
   record and stop report), and `combine` makes the case's result of them and the rest of the job's
   `Ending` (a worker: its one unit's result; torchrun: the cross-rank aggregation,
   `nsa_diag.analysis.ranks.aggregate`);
7. `internal_files` (beacons, dump requests, debug pipes) are removed before ``result.json`` lists the
   case's files.

A launcher object runs one case: it keeps what it learns of the job (the process, the ranks' pids).

Adding a launcher is one more module here and nothing else: subclass `Launcher`, implement the abstract
methods, and pass an instance to `run_case` (or teach `nsa_diag.launchers.default_launcher` when a spec
field should pick it). A user's own command (``nsa-diag watch -- python train.py``): `command` is that
argv, `child_env` adds the probe's ``sitecustomize`` to ``PYTHONPATH``; `units` gives each process a
folder and the probe's beacon, or ``beacon=None`` for one without the probe: the watchdog then never calls
it stalled, only the timeout applies, and its verdict comes from its exit status, /proc and py-spy;
`combine` keeps the unit's result. A cluster launcher: `start` submits and returns a handle whose
``poll``/``pid`` follow the job (`ProcessHandle`), `units` are the ranks' folders on shared storage, `stop`
cancels the job.
"""

from __future__ import annotations

import os
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nsa_diag import artifacts
from nsa_diag.logcap import LogPump
from nsa_diag.records import JobNotes, StopReport
from nsa_diag.results import interrupted_result
from nsa_diag.spec import CaseResult, CaseSpec
from nsa_diag.watchdog import HangEvidence, ProcessHandle, WatchResult
from nsa_diag.worker import tether

# The package root above nsa_diag: children import the same nsa_diag as this process, installed or not.
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


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
    # The key of the unit it was forked from (a DataLoader worker's training process), or None.
    parent: int | None = None


@dataclass(frozen=True)
class Ending:
    """How a case's job ended, for `Launcher.combine`: ``outcome`` is the watch's (``exited``,
    ``stalled``, ``timeout``), ``per_unit`` each unit's classified result by key, ``decider`` the key of
    the unit that stalled or timed out first (None when the job exited), ``stop`` what stopping the job
    took, ``elapsed`` seconds since the start, ``notes`` the launcher's evidence for ``result.json``."""

    case_dir: Path
    outcome: str
    per_unit: Mapping[int, CaseResult]
    decider: int | None
    stop: StopReport
    elapsed: float
    notes: JobNotes


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


# What replay.sh keeps of the environment the job ran with, beyond the launcher's `replay_env`: the import
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

    # --- starting ------------------------------------------------------------------------------------

    def prepare(self, case_dir: Path) -> None:  # noqa: B027 (a hook: most launchers need nothing here)
        """Folders the job expects before it starts."""

    def home(self, case_dir: Path) -> Path:
        """Where this launcher's own files of the case go: spec.json, replay.sh, the job's stdout.log and
        stderr.log, result.json. The case folder, except for a node r > 0 of a multi-node case, which
        shares the case folder with node 0 and writes its own in ``nodes/<r>/``."""
        return Path(case_dir)

    @abstractmethod
    def command(self, case_dir: Path) -> list[str]:
        """The command line that starts the job (asked once per case)."""

    def replay_argv(self, case_dir: Path, argv: Sequence[str]) -> list[str]:
        """What ``replay.sh`` runs when the caller gives no replay command: by default the job's own."""
        return list(argv)

    @abstractmethod
    def replay_env(self, case_dir: Path) -> dict[str, str]:
        """The variables ``replay.sh`` exports (those the job depends on; not this machine's others)."""

    @abstractmethod
    def child_env(self, case_dir: Path, extra_env: Mapping[str, str] | None) -> dict[str, str]:
        """The job's whole environment (``extra_env``: for this run only, not in ``replay.sh``)."""

    def cwd(self) -> str | None:
        """The job's working directory (None: this process's)."""
        return None

    def echo_fds(self) -> tuple[int | None, int | None]:
        """Where the job's stdout and stderr are shown while nsa-diag runs, besides the logs (None: not
        shown). A user's command is followed on the terminal; our worker's output only goes to the logs."""
        return None, None

    def start(self, case_dir: Path, argv: Sequence[str], env: Mapping[str, str]) -> ProcessHandle:
        """Start ``argv`` in a new session with stdin closed, its output going to the case's logs through
        their cap (`nsa_diag.logcap`: head and tail kept, room left for the case's own files); straight
        into the log files when that process cannot start."""
        home = self.home(case_dir)
        try:
            out, err = self.echo_fds()
            self.logs = LogPump([(home / artifacts.STDOUT, out), (home / artifacts.STDERR, err)])
        except OSError:
            self.logs = None
        if self.logs is not None:
            try:
                self.proc = self._popen(argv, env, *self.logs.job_fds)
            finally:
                self.logs.started()
            return self.proc
        with (
            artifacts.open_append(home / artifacts.STDOUT, binary=True) as out,
            artifacts.open_append(home / artifacts.STDERR, binary=True) as err,
        ):
            self.proc = self._popen(argv, env, out.fileno(), err.fileno())
        return self.proc

    def _popen(
        self, argv: Sequence[str], env: Mapping[str, str], out: int, err: int
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=dict(env),
            cwd=self.cwd(),
            start_new_session=True,
        )

    def close_logs(self) -> None:
        """The job was stopped: wait (briefly) for its logs' last bytes. A job left running on purpose
        (``watch --keep-alive``) keeps its logs; only their copy to the terminal ends."""
        if self.logs is None:
            return
        if self.kept_alive():
            self.logs.detach()
        else:
            self.logs.finish()

    # --- watching ------------------------------------------------------------------------------------

    @abstractmethod
    def units(self, case_dir: Path) -> list[Unit]:
        """The processes the watchdog judges, each with its folder and beacon."""

    def after_watch(self, case_dir: Path) -> None:  # noqa: B027 (a hook: most launchers need nothing here)
        """The polling loop has ended: learn what `stop` and the evidence need (e.g. the ranks' pids)."""

    def notes(self) -> JobNotes:
        """Launcher facts for the case's result (torchrun: its command line)."""
        return JobNotes()

    def evidence_before_stop(self, case_dir: Path) -> JobNotes:
        """Evidence only this launcher can take, before any process is stopped (notes for the result)."""
        return JobNotes()

    @abstractmethod
    def sample_targets(self, units: Sequence[Unit]) -> dict[int, ProcessHandle]:
        """The processes (by unit key) whose stacks, /proc, py-spy and memory to take at a hang."""

    # --- stopping and the result ---------------------------------------------------------------------

    def before_stop(self, case_dir: Path) -> None:  # noqa: B027 (a hook: most launchers need nothing here)
        """The evidence is taken, the job is about to be stopped (interrupts are not held back here): a
        node of a multi-node case waits for the other nodes to have taken theirs."""

    @abstractmethod
    def stop(self) -> StopReport:
        """Stop every process of the job (also those it started in sessions of their own); what it took,
        with ``exit_code`` and any ``survivors``. ``StopReport(started=False)`` when nothing was started."""

    def internal_files(self, case_dir: Path) -> list[Path]:
        """The files only the running job uses, removed when the case ends (after its result is built):
        by default `artifacts.INTERNAL_FILES` in each unit's folder."""
        return [unit.folder / name for unit in self.units(case_dir) for name in artifacts.INTERNAL_FILES]

    def evidence_after_stop(self, case_dir: Path, notes: JobNotes) -> None:  # noqa: B027 (a hook)
        """Evidence the job left as it stopped, added to ``notes``."""

    def unit_ends(
        self,
        case_dir: Path,
        units: Sequence[Unit],
        watched: Sequence[WatchResult],
        hangs: Mapping[int, HangEvidence],
        stop: StopReport,
    ) -> dict[int, tuple[WatchResult, StopReport]]:
        """Each unit's watch record and stop report, for its classification. By default each unit ends as
        the job did (one process: its own)."""
        return {u.key: (w, stop) for u, w in zip(units, watched, strict=True)}

    @abstractmethod
    def combine(self, end: Ending) -> CaseResult:
        """The case's result from its units' results (`Ending`)."""

    # --- nsa-diag interrupted ------------------------------------------------------------------------

    def kept_alive(self) -> bool:
        """Whether the job was left running on purpose (`watch --keep-alive`): nothing of it is swept."""
        return False

    def sample_on_interrupt(self, case_dir: Path) -> bool:
        """One quick stack sample when nsa-diag is interrupted, before the stop; whether one was taken."""
        return False

    def interrupted(
        self, case_dir: Path, by: str, elapsed: float, stop: StopReport, sampled: bool
    ) -> CaseResult:
        """The result of a case nsa-diag's SIGINT/SIGTERM (``by``) ended, after `stop`."""
        return interrupted_result(self.spec, case_dir, by, elapsed, stop, sampled)
