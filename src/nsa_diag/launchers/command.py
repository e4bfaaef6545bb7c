"""A user's own command (`nsa-diag watch -- CMD`): its processes, found as they appear, are the units.

The command runs in a session of its own in the directory ``watch`` was started from, with the user's
whole environment plus the probe (`nsa_diag.probe`: ``NSA_DIAG_PROBE_DIR=<case>/procs`` and the probe's
``sitecustomize`` first on ``PYTHONPATH``) and the NCCL flight recorder switched on (unless the user set
its variables). Its stdout and stderr go to the case's ``stdout.log``/``stderr.log`` and, while nsa-diag
runs, to the terminal, through the logs' cap (`nsa_diag.logcap`: a process of its own, so that a job left
running by ``--keep-alive`` keeps writing there, no pipe breaks).

Units, re-read at every poll (``units_appear``): the command's own process first (``procs/pid-<pid>/``,
probed or not), then every probed process in the order it appeared. A torchrun rank (``RANK`` set, not
forked from a process of the same rank) is keyed by its rank and gets ``ranks/<r>/rank.json`` pointing at
its folder; any other process by its pid. A unit counts as reporting progress once its beacon records an
event beyond its start (`nsa_diag.watchdog.reports_progress`); until then, and for a process without the
probe (not Python), only ``--timeout`` applies. SIGUSR1 goes only to processes whose ``probe.json`` says
``sigusr1: probe``.

Each rank's probe times its steps (``steps.jsonl``): at the end the ranks are compared, and a rank
consistently slower than the others is named (`nsa_diag.analysis.stragglers.watched_stragglers`).

At a stall or timeout, before anything stops: the flight recorder's dump of every rank (NCCL), then the
watchdog's evidence of every live unit, and ``tree.json``: /proc of every process of the job (probed or
not, DataLoader workers and torchrun's ranks in sessions of their own included: psutil's descendants,
followed while the job ran). Then every one of them is stopped (`nsa_diag.stopping`: SIGTERM, grace,
SIGKILL), unless ``--keep-alive``. The verdict (`nsa_diag.launchers.job`): from the command's exit status
and its last traceback when it exited; at a stall the unit that stalled, the ranks' minority, the process
waited on.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from nsa_diag import artifacts
from nsa_diag.analysis.stragglers import slowdown, watched_stragglers
from nsa_diag.artifacts import RANKS_DIR
from nsa_diag.beacon import BeaconState, read_beacon
from nsa_diag.classify import never_progressed
from nsa_diag.evidence import procfs
from nsa_diag.evidence.env import select_env_vars
from nsa_diag.evidence.roles import TRAINING_ROLES, ProcessFacts, Role, assign_roles, describe
from nsa_diag.evidence.stacks import read_stacks, take_sample
from nsa_diag.launchers import job
from nsa_diag.launchers.base import (
    SOURCE_ROOT,
    Evidence,
    JobEnd,
    Launcher,
    LaunchPlan,
    Stage,
    Unit,
    classified,
)
from nsa_diag.launchers.torchrun import (
    FR_BUFFER,
    FR_FILE,
    FR_PREFIX,
    FR_WAIT_S,
    LEGACY_FR_BUFFER_ENV,
    PIPE_PREFIX,
    RankProcess,
    flight_recorder_says,
    with_files,
)
from nsa_diag.probe import BRANCHES_ENV, PROBE_DIR_ENV, SITE_DIR
from nsa_diag.records import FlightRecorder, JobNotes, StopReport, Stragglers
from nsa_diag.results import interrupted_result
from nsa_diag.spec import CaseResult, CaseSpec, CommandSpec, Where
from nsa_diag.stopping import ProcessTree, stop_tree
from nsa_diag.watchdog import ProcessHandle, steps_done
from nsa_diag.wire import FR_PREFIX_ENV, STEPS_JSONL, ProbeJson

PROCS_DIR = "procs"
RANK_JSON = "rank.json"
TREE_JSON = "tree.json"


def probe_env(case_dir: Path, environ: Mapping[str, str], branch_marks: bool = False) -> dict[str, str]:
    """What nsa-diag adds to the job's environment: the probe (with ``branch_marks``, marks per NSA branch
    too), and the NCCL flight recorder (each variable only where the user has not set it)."""
    procs = Path(case_dir).resolve() / PROCS_DIR
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
    env = {PROBE_DIR_ENV: str(procs), "PYTHONPATH": os.pathsep.join([SITE_DIR, *paths, SOURCE_ROOT])}
    env[BRANCHES_ENV] = "1" if branch_marks else "0"
    env[FR_PREFIX_ENV] = str(procs / FR_PREFIX)  # a gloo rank's probe dumps its recorder there at a hang
    recorder = {
        "TORCH_FR_BUFFER_SIZE": str(FR_BUFFER),  # the recorder of every backend that keeps one (gloo's too)
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(procs / FR_PREFIX),
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(procs / PIPE_PREFIX),
    }
    # the buffer's older name (torch < 2.9) is only an alias now, and torch warns in every rank's output where
    # it is set; the new name outranks it, so a size the user gave under the old one stands untouched
    if LEGACY_FR_BUFFER_ENV in environ:
        del recorder["TORCH_FR_BUFFER_SIZE"]
    env.update({k: v for k, v in recorder.items() if k not in environ})
    return env


def recorded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The job's environment as spec.json records it: env.json's names, secret values withheld."""
    return select_env_vars(environ)


def _fileno(stream: Any) -> int | None:
    """The descriptor of one of our streams, flushed first (None: it has none, e.g. captured in a test)."""
    try:
        stream.flush()
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None


def max_restarts(argv: Sequence[str]) -> int:
    """torchrun's ``--max-restarts N`` (``--max_restarts``, ``=N``) in a command line; 0 without one."""
    for i, word in enumerate(argv):
        name, eq, value = word.partition("=")
        if name in ("--max-restarts", "--max_restarts"):
            text = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            return int(text) if text.isdigit() else 0
    return 0


class Proc:
    """One process of the job that nsa-diag saw: its pid, psutil handle (for a safe kill: same start time)
    and, when probed, its folder and ``probe.json``."""

    def __init__(self, pid: int, handle: psutil.Process | None, folder: Path | None) -> None:
        self.pid, self.handle, self.folder = pid, handle, folder
        self.info = ProbeJson()

    def read_info(self) -> ProbeJson:
        if self.folder is not None:
            with contextlib.suppress(OSError, ValueError):
                self.info = artifacts.read_json(self.folder / job.PROBE_JSON)
        return self.info

    def alive(self) -> bool:
        if self.handle is None:
            return False
        try:
            return self.handle.is_running() and self.handle.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


class CommandLauncher(Launcher):
    """``spec.command`` in its directory, every process of it watched (module docstring)."""

    label = "watched command"
    units_appear = True

    def __init__(self, spec: CaseSpec, echo_stdout: Any = None) -> None:
        super().__init__(spec)
        assert spec.command is not None
        self.cmd: CommandSpec = spec.command
        self.echo_stdout = echo_stdout  # where the job's stdout is shown (stderr under --json)
        self.procs: dict[int, Proc] = {}  # by pid, in the order seen; probed ones have a folder
        self.order: list[int] = []  # probed pids in the order they appeared (the units after the root)
        self.keys: dict[int, int] = {}  # pid -> unit key (rank, or pid)
        self.evidence_taken = False
        self.force_stop = False
        self.stop_report: StopReport | None = None
        self.recorder: FlightRecorder | None = None  # asked at the last hang of the watch
        self.exited_by_itself = False  # the command had exited when the case came to stop it
        self.alive_at_evidence: list[int] = []  # pids alive when the evidence was taken (the last time)

    # --- starting ------------------------------------------------------------------------------------

    def plan(self, case_dir: Path, extra_env: Mapping[str, str] | None) -> LaunchPlan:
        """The command in its directory with the user's environment and the probe; its stdout shown on
        ours (on our stderr under ``--json``), its stderr on our stderr. replay.sh exports nothing more:
        the user's environment is theirs."""
        (case_dir / PROCS_DIR).mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(extra_env or {})}
        out_stream = self.echo_stdout if self.echo_stdout is not None else sys.stdout
        return LaunchPlan(
            home=self.home(case_dir),
            argv=list(self.cmd.argv),
            env={**env, **probe_env(case_dir, env, self.spec.branch_marks)},
            replay_argv=list(self.cmd.argv),
            replay_env={},
            cwd=self.cmd.cwd,
            echo=(_fileno(out_stream), _fileno(sys.stderr)),
        )

    def start(self, plan: LaunchPlan) -> ProcessHandle:
        proc = super().start(plan)
        self._see(proc.pid, None)
        return proc

    # --- the processes -------------------------------------------------------------------------------

    def _see(self, pid: int, folder: Path | None) -> Proc:
        proc = self.procs.get(pid)
        if proc is None:
            try:
                handle: psutil.Process | None = psutil.Process(pid)
            except psutil.Error:
                handle = None
            proc = self.procs[pid] = Proc(pid, handle, folder)
        elif folder is not None and proc.folder is None:
            proc.folder = folder
        return proc

    def _scan(self, case_dir: Path) -> None:
        """New probed processes (their probe.json written) and every live descendant of the command."""
        assert self.proc is not None
        for folder in sorted((case_dir / PROCS_DIR).glob("pid-*"), key=lambda p: p.stat().st_mtime):
            pid = int(folder.name.removeprefix("pid-"))
            if pid in self.keys or not (folder / job.PROBE_JSON).exists():
                continue
            proc = self._see(pid, folder)
            self._key(case_dir, proc, proc.read_info())
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                if child.pid not in self.procs:
                    self.procs[child.pid] = Proc(child.pid, child, None)

    def _key(self, case_dir: Path, proc: Proc, info: ProbeJson) -> None:
        """A new probed process's unit key: its rank (a rank process not forked from one of the same rank)
        where no process holds that rank, or where the holder is of an earlier torchrun attempt (restarted
        ranks: the holder is then keyed by its pid); else its pid."""
        assert self.proc is not None
        rank, parent = info.get("rank"), self.procs.get(info.get("ppid", -1))
        same_rank_parent = parent is not None and parent.info.get("rank") == rank
        if proc.pid == self.proc.pid:
            return  # the root unit is always first, keyed by its pid
        is_rank = isinstance(rank, int) and not same_rank_parent
        holder = next((pid for pid, key in self.keys.items() if key == rank and pid != key), None)
        if is_rank and holder is not None and job.attempt_of(info) > job.attempt_of(self.procs[holder].info):
            self.keys[holder] = holder  # its rank's earlier attempt: a process of the job like any other
            holder = None
        if is_rank and holder is None:
            self.keys[proc.pid] = rank
            rank_folder = case_dir / RANKS_DIR / str(rank)
            artifacts.write_json(
                rank_folder / RANK_JSON,
                {"rank": rank, "pid": proc.pid, "folder": f"{PROCS_DIR}/{proc.folder.name}"},  # type: ignore[union-attr]
            )
        else:
            self.keys[proc.pid] = proc.pid
        if proc.pid not in self.order:
            self.order.append(proc.pid)

    def _root_folder(self, case_dir: Path) -> Path:
        assert self.proc is not None
        return case_dir / PROCS_DIR / f"pid-{self.proc.pid}"

    def units(self, case_dir: Path) -> list[Unit]:
        assert self.proc is not None
        self._scan(case_dir)
        root = self._root_folder(case_dir)
        self._see(self.proc.pid, root).read_info()
        for pid in self.order:
            info = self.procs[pid].read_info()
            if self.keys[pid] == pid and isinstance(info.get("rank"), int):
                # a rank its probe learned after it started (torch.multiprocessing.spawn's processes get
                # theirs from init_process_group, torchrun's from the environment)
                self._key(case_dir, self.procs[pid], info)
        roles = self.roles()
        found = [
            Unit(
                self.proc.pid, root, root / artifacts.BEACON, job.no_signal(self.procs[self.proc.pid].info),
                role=roles.get(self.proc.pid),
            )
        ]  # fmt: skip
        for pid in self.order:
            proc = self.procs[pid]
            assert proc.folder is not None
            found.append(
                Unit(
                    self.keys[pid],
                    proc.folder,
                    proc.folder / artifacts.BEACON,
                    job.no_signal(proc.info),
                    role=roles.get(pid),
                    parent=self._parent(pid),
                )
            )
        return found

    def _parent(self, pid: int) -> int | None:
        """The key of the process ``pid`` was forked from, else of its parent process where that is one of
        the job's (a child started by exec: subprocess.run)."""
        info = self.procs[pid].info
        forked, ppid = info.get("forked_from"), info.get("ppid")
        parent = forked if isinstance(forked, int) else ppid if ppid in self.procs else None
        return self.keys.get(parent, parent) if parent is not None else None

    def facts(self) -> list[ProcessFacts]:
        """What is known of each process seen: its probe's record, else /proc (`evidence.roles`)."""
        found = []
        for pid, proc in self.procs.items():
            info = proc.info
            if info:
                rank, forked = info.get("rank"), info.get("forked_from")
                found.append(
                    ProcessFacts(
                        pid, info.get("ppid"), tuple(info.get("argv") or ()), True,
                        rank if isinstance(rank, int) else None, info.get("role"),
                        forked if isinstance(forked, int) else None,
                    )
                )  # fmt: skip
                continue
            try:
                assert proc.handle is not None
                ppid, argv = proc.handle.ppid(), tuple(proc.handle.cmdline())
            except (AssertionError, psutil.Error):
                ppid, argv = None, ()
            exe = os.path.basename(argv[0]) if argv else ""
            found.append(ProcessFacts(pid, ppid, argv, exe.startswith(("python", "pypy"))))
        return found

    def roles(self) -> dict[int, Role]:
        """Each seen process's role, by pid (`nsa_diag.evidence.roles.assign_roles`)."""
        return assign_roles(self.facts())

    def pid_of(self, key: int) -> int:
        assert self.proc is not None
        if key == self.proc.pid:
            return key
        return next(pid for pid, k in self.keys.items() if k == key)

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the job's rank processes."""
        return {k: pid for pid, k in self.keys.items() if k != pid}

    def _attempt(self) -> tuple[int, list[Proc]] | None:
        """torchrun with ``--max-restarts N`` (its agent's command line, from its probe) whose attempt under
        way is not its N-th restart: that attempt and its ranks; None otherwise."""
        launchers = [p.info for p in self.procs.values() if p.info.get("role") == "launcher"]
        allowed = max((max_restarts(list(i.get("argv") or [])) for i in launchers), default=0)
        ranks = [self.procs[pid] for pid in self.ranks().values() if pid in self.procs]
        attempt = max((job.attempt_of(p.info) for p in ranks), default=0)
        return (attempt, ranks) if ranks and attempt < allowed else None

    def can_restart(self) -> bool:
        return self._attempt() is not None

    def restart_hung(self) -> tuple[int, list[int]] | None:
        """Kill the ranks of the attempt under way (`_attempt`) and their descendants (SIGKILL: a rank
        stuck in a collective or a C call may never act on SIGTERM); torchrun's agent then stops what is
        left of the attempt and starts the next. (attempt, pids killed), or None."""
        found = self._attempt()
        if found is None:
            return None
        attempt, ranks = found
        killed: list[int] = []
        for proc in ranks:
            if proc.handle is None or job.attempt_of(proc.info) != attempt:
                continue
            with contextlib.suppress(psutil.Error):  # psutil checks it is the same process (start time)
                tree = [proc.handle, *proc.handle.children(recursive=True)]
                for each in tree:
                    with contextlib.suppress(psutil.Error):
                        each.kill()
                        killed.append(each.pid)
        return (attempt, killed) if killed else None

    # --- evidence ------------------------------------------------------------------------------------

    def evidence(self, case_dir: Path, stage: Stage, units: Sequence[Unit] = ()) -> Evidence:
        """The watch ended: the command's facts. At a hang, before anything stops: ``tree.json`` (/proc of
        every live process of the job), every rank's NCCL flight recorder, and every live unit for the
        watchdog. After the stop: the dumps NCCL's own timeout wrote, and the job's own account when it
        ended by itself. At an interrupt: a stack sample of each training process (`_sample_on_interrupt`)."""
        if stage is Stage.WATCHED:
            assert self.proc is not None
            self.recorder = None
            return Evidence(JobNotes(command=list(self.cmd.argv), cwd=self.cmd.cwd, root_pid=self.proc.pid))
        if stage is Stage.HANG:
            return Evidence(self._at_hang(case_dir), self._targets(units))
        if stage is Stage.STOPPED:
            return Evidence(self._after_stop(case_dir))
        if stage is Stage.INTERRUPTED:
            return Evidence(sampled=self._sample_on_interrupt(case_dir))
        return Evidence()

    def _at_hang(self, case_dir: Path) -> JobNotes:
        self.evidence_taken = True
        self._scan(case_dir)
        tree = {
            str(pid): {**procfs.process_snapshot(pid), "probe": proc.read_info() or None}
            for pid, proc in self.procs.items()
            if proc.alive()
        }
        artifacts.write_json(case_dir / TREE_JSON, tree)
        self.alive_at_evidence = sorted(int(p) for p in tree)
        notes = JobNotes(processes_alive=self.alive_at_evidence)
        if self.ranks():
            self.recorder = notes.flight_recorder = self._flight_recorder(case_dir)
        return notes

    def _flight_recorder(self, case_dir: Path) -> FlightRecorder:
        """Ask every rank's NCCL flight recorder for a dump through its debug pipe (NCCL jobs only)."""
        procs = case_dir / PROCS_DIR
        asked = {}
        for rank in self.ranks():
            try:
                fd = os.open(procs / f"{PIPE_PREFIX}{rank}.pipe", os.O_WRONLY | os.O_NONBLOCK)
                os.write(fd, b"1\n")
                os.close(fd)
                asked[str(rank)] = "asked through the debug pipe"
            except OSError as exc:  # the rank's probe dumps its group's recorder at the dump request
                asked[str(rank)] = f"no debug pipe ({exc.strerror}): not NCCL; its probe dumps the recorder"
        if any(v.startswith("asked") for v in asked.values()):
            deadline = time.monotonic() + FR_WAIT_S
            while time.monotonic() < deadline and not all(
                (procs / f"{FR_PREFIX}{r}").exists() for r in self.ranks()
            ):
                time.sleep(0.1)
            time.sleep(0.3)  # a dump being written
        return FlightRecorder(asked=asked, files=self._collect_flight_recorder(case_dir))

    def _collect_flight_recorder(self, case_dir: Path) -> dict[str, str]:
        found = {}
        for rank in self.ranks():
            src = case_dir / PROCS_DIR / f"{FR_PREFIX}{rank}"
            if src.exists():
                dest = case_dir / RANKS_DIR / str(rank) / FR_FILE
                artifacts.write_bytes(dest, src.read_bytes())
                src.unlink(missing_ok=True)
                found[str(rank)] = f"{RANKS_DIR}/{rank}/{FR_FILE}"
        return found

    def _targets(self, units: Sequence[Unit]) -> dict[int, ProcessHandle]:
        targets: dict[int, ProcessHandle] = {}
        for unit in units:
            pid = self.pid_of(unit.key)
            if self.procs[pid].alive():
                targets[unit.key] = RankProcess(pid)
        return targets

    # --- stopping ------------------------------------------------------------------------------------

    def stop_processes(self) -> StopReport:
        assert self.proc is not None
        self.exited_by_itself = self.proc.poll() is not None
        if self.cmd.keep_alive and self.evidence_taken and not self.force_stop:
            alive = sorted(pid for pid, p in self.procs.items() if p.alive())
            report = StopReport(kept_alive=alive, exit_code=self.proc.poll())
        else:
            # the command's session, every process seen, their descendants and the sessions they lead
            handles = [p.handle for p in self.procs.values() if p.handle]
            tree = ProcessTree([self.proc.pid], handles, follow=True)
            report = stop_tree(tree, self.proc, name_signalled=True)
        self.stop_report = report
        return report

    def _sample_on_interrupt(self, case_dir: Path) -> bool:
        """Ctrl-C: nothing of the job outlives nsa-diag, --keep-alive or not; but first one stack sample of
        each training process whose probe takes SIGUSR1, so that the case says where the job was."""
        self.force_stop = True
        if self.proc is None:
            return False
        taken = False
        for unit in self.units(case_dir):
            pid = self.pid_of(unit.key)
            if unit.role not in TRAINING_ROLES or unit.no_signal is not None or not self.procs[pid].alive():
                continue
            path = unit.folder / artifacts.STACKS
            number = len(read_stacks(path).samples) + 1
            taken |= (
                take_sample(pid, unit.folder, path, number, None, note="nsa-diag interrupted") is not None
            )
        return taken

    def interrupted(
        self, case_dir: Path, by: str, elapsed: float, stop: StopReport, sampled: bool
    ) -> CaseResult:
        """The job's result when nsa-diag was interrupted: where each training process was (its beacon),
        and which stacks were taken. Where no training process reported progress but another process of
        the job did (a script that runs its training in a subprocess), where that one was too: the job's
        progress is never read from a folder that has no beacon."""
        found = self.units(case_dir) if self.proc else []
        states = {u.key: read_beacon(u.beacon) if u.beacon is not None else None for u in found}
        moved = [u for u in found if not never_progressed(_where(states[u.key]))]
        training = [u for u in found if u.role in TRAINING_ROLES]
        units = training if any(u in moved for u in training) else training + moved
        if not units:
            return super().interrupted(case_dir, by, elapsed, stop, sampled)
        ranks = self.ranks()
        places = []
        for unit in units:
            where = _where(states[unit.key])
            text = job.place(where, unit.key if unit.key in ranks else None)
            if unit.role not in TRAINING_ROLES:
                text = f"pid {unit.key} ({describe(unit.role)}): {text}" if unit.role else text
            places.append((unit, where, text))
        first = places[0]
        result = interrupted_result(self.spec, first[0].folder, by, elapsed, stop, sampled)
        at = "; ".join(text if len(places) > 1 else text.removeprefix("rank 0, ") for _, _, text in places)
        stacks_taken = [
            f"{u.folder.relative_to(case_dir)}/{artifacts.STACKS}"
            for u, _, _ in places
            if (u.folder / artifacts.STACKS).exists()
        ]
        reason = f"interrupted by {by} after {elapsed:.1f} s at {at}"
        assert self.proc is not None
        evidence = result.evidence.model_copy(
            update={"location": at, "stacks": stacks_taken, "root_pid": self.proc.pid}
        )
        steps = max((steps_done(state, sys.maxsize) for state in states.values()), default=0)
        update = {"reason": reason, "where": first[1], "evidence": evidence, "steps_done": steps}
        return result.model_copy(update=update)

    def internal_files(self, case_dir: Path) -> list[Path]:
        if self.stop_report is not None and self.stop_report.kept_alive:
            return []  # the job still runs: its beacons and requests are in use
        pipes = list((case_dir / PROCS_DIR).glob(f"{PIPE_PREFIX}*"))
        folders = [p.folder for p in self.procs.values() if p.folder is not None]
        return [f / name for f in folders for name in artifacts.INTERNAL_FILES] + pipes

    def _after_stop(self, case_dir: Path) -> JobNotes:
        notes = JobNotes()
        found = self._collect_flight_recorder(case_dir)  # written on NCCL's own timeout
        if found or (self.recorder is not None and self.recorder.files):  # analysed once all are in
            notes.flight_recorder = with_files(self.recorder, found, case_dir, None)
        assert self.proc is not None
        root = self._root_folder(case_dir)
        root.mkdir(parents=True, exist_ok=True)
        code = self.proc.poll()
        if code is not None and self.exited_by_itself:  # the job ended by itself: its own account
            infos = {pid: p.read_info() for pid, p in self.procs.items() if p.folder is not None}
            report = job.job_report(code, case_dir, infos)
            if report is not None:
                artifacts.write_json(root / artifacts.WORKER_RESULT, report)
        return notes

    def outcome(self, end: JobEnd) -> CaseResult:
        """Each unit's end (`job.unit_ends`) and, past the timeout, its rate; the job's verdict
        (`job.combine`)."""
        assert self.proc is not None
        ends = job.unit_ends(end.case_dir, end.units, end.watched.units, end.hangs, end.stop, self.ranks())
        rates = {}
        for unit, w in zip(end.units, end.watched.units, strict=True):
            if w.outcome == "timeout":
                total = self.cmd.total_steps or _info_total(self.procs[self.pid_of(unit.key)].read_info())
                rates[unit.key] = job.job_rate(w, self.spec, total)
        ending = classified(self.spec, end, ends)
        infos = {
            self.keys.get(pid, pid): p.read_info() for pid, p in self.procs.items() if p.folder is not None
        }
        roles = {self.keys.get(pid, pid): role for pid, role in self.roles().items()}
        parents = {self.keys.get(pid, pid): self._parent(pid) for pid in self.procs}
        alive = [self.keys.get(pid, pid) for pid in self.alive_at_evidence]
        folders = {unit.key: unit.folder for unit in end.units}
        recorded = end.notes.flight_recorder.analysis if end.notes.flight_recorder is not None else None
        result = job.combine(
            self.spec, ending,
            root=self.proc.pid, infos=infos, ranks=self.ranks(), rates=rates, folders=folders,
            roles=roles, parents=parents, alive=alive, stragglers=self._stragglers(),
            blamed=recorded.culprits if recorded is not None else (),
        )  # fmt: skip
        said = flight_recorder_says(end.notes.flight_recorder) if result.verdict == "hang" else None
        if said:  # the ranks' recorders, read as `nsa-diag fr` reads them
            result = result.model_copy(update={"reason": result.reason + f"; flight recorder: {said}"})
        slower = self._slowdown() if result.verdict in ("pass", "slow") else None
        if slower:  # a job that kept getting slower (issue 48): said at its end, as a straggler is
            result = result.model_copy(update={"reason": result.reason + f"; {slower}"})
        return result

    def _slowdown(self) -> str | None:
        """Whether the training process's steps kept getting slower (`analysis.stragglers.slowdown`, from its
        ``steps.jsonl``: rank 0's under torchrun)."""
        ranks = self.ranks()
        pid = ranks.get(0) if ranks else self.proc.pid if self.proc is not None else None
        folder = self.procs[pid].folder if pid in self.procs else None
        if folder is None:
            return None
        try:
            return slowdown(artifacts.read_text(folder / STEPS_JSONL).splitlines())
        except (OSError, ValueError):
            return None

    def _stragglers(self) -> Stragglers | None:
        """The ranks' step times compared (`nsa_diag.analysis.stragglers.watched_stragglers`), from each
        rank's ``steps.jsonl``; None for a job of one rank or none."""
        lines: dict[int, list[str]] = {}
        for rank, pid in self.ranks().items():
            folder = self.procs[pid].folder
            lines[rank] = []
            if folder is not None:
                with contextlib.suppress(OSError, ValueError):
                    lines[rank] = artifacts.read_text(folder / STEPS_JSONL).splitlines()
        return watched_stragglers(lines, self.cmd.straggler_ratio)


def _where(state: BeaconState | None) -> Where | None:
    return Where(**state.where()) if state is not None else None


def _info_total(info: ProbeJson) -> int | None:
    total = info.get("total_steps")
    return total if isinstance(total, int) and total > 0 else None
