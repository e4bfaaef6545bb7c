"""torchrun: one case on N ranks (`nsa-diag ddp`), each rank a unit with its own folder and beacon.

``python -m nsa_diag.worker.agent ... -m nsa_diag.worker.ddp <case_dir>`` (torchrun, tied to nsa-diag's
life, its store listening on the rendezvous address only) starts in a new session (rendezvous on
127.0.0.1 and a free port unless ``rdzv_endpoint`` is given: then torchrun's static rendezvous there,
which keeps the node rank; one node's part of a multi-node case is `nsa_diag.launchers.nodes`'s
`NodeLauncher`); each rank works in
``ranks/<r>/`` (see `nsa_diag.worker.ddp`) and torchrun starts each in a session of its own. The
executor watches every local rank's beacon with the single worker's rules; at a stall this launcher first
asks every rank's NCCL flight recorder for a dump through its debug pipe, the executor then takes every
live rank's evidence (by pid: torchrun, not us, is their parent), and `stop` signals torchrun's session
and every rank's at once (`nsa_diag.stopping`) and checks that none is left. Each rank's result is
classified as a single worker's would be; the case's result is their cross-rank aggregation
(`nsa_diag.analysis.ranks.aggregate`), from what this launcher reads of each rank.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import psutil

from nsa_diag import artifacts
from nsa_diag.analysis.flight import analyse, rank_names
from nsa_diag.analysis.ranks import RankInputs, aggregate, rank_exit_codes
from nsa_diag.artifacts import RANKS_DIR, rank_dir
from nsa_diag.beacon import read_beacon
from nsa_diag.classify import focus_thread
from nsa_diag.errors import UsageError
from nsa_diag.evidence.flight import load_dump
from nsa_diag.evidence.stacks import read_stacks
from nsa_diag.launchers.base import (
    Ending,
    Evidence,
    JobEnd,
    Launcher,
    LaunchPlan,
    Stage,
    Unit,
    UnitEnds,
    classified,
    python_env,
    worker_env,
)
from nsa_diag.records import CaseEvidence, FlightRecorder, JobNotes, StopReport
from nsa_diag.results import error_result, read_worker_report
from nsa_diag.spec import CaseResult, CaseSpec, pg_timeout_s
from nsa_diag.stackframes import ThreadStack
from nsa_diag.stopping import ProcessTree, alive, stop_tree

LOOPBACK = "127.0.0.1"
FR_PREFIX = "nccl_trace_rank_"  # TORCH_NCCL_DEBUG_INFO_TEMP_FILE: torch appends the rank
PIPE_PREFIX = "nccl_pipe_rank_"  # TORCH_NCCL_DEBUG_INFO_PIPE_FILE: torch reads <prefix><rank>.pipe
FR_FILE = "nccl_flight_recorder.pickle"  # where each rank's dump ends up, in ranks/<r>/
FR_WAIT_S = 5.0
FR_BUFFER = 2000  # TORCH_FR_BUFFER_SIZE; not its alias LEGACY_FR_BUFFER_ENV: torch warns of it in each rank
LEGACY_FR_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def local_ranks(spec: CaseSpec) -> list[int]:
    assert spec.ddp is not None
    first = spec.ddp.node_rank * spec.ddp.nproc
    return list(range(first, first + spec.ddp.nproc))


def ddp_env(spec: CaseSpec, case_dir: Path) -> dict[str, str]:
    """Variables for torchrun and the ranks: the flight recorder on (NCCL's dumped into the case folder on
    timeout and on demand through its pipe; every rank's by its heartbeat at a hang); NCCL's own timeouts
    longer than the watchdog's stall."""
    assert spec.ddp is not None
    ranks = Path(case_dir).resolve() / RANKS_DIR
    timeout = str(int(pg_timeout_s(spec)))
    env = {
        "TORCH_FR_BUFFER_SIZE": str(FR_BUFFER),  # the recorder of every backend that keeps one (gloo's too)
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(ranks / FR_PREFIX),
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(ranks / PIPE_PREFIX),
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": timeout,
        "TORCH_NCCL_TRACE_CPP_STACK": "1",
    }
    if spec.ddp.rdzv_endpoint is None:  # one node: keep gloo's and NCCL's sockets on loopback too
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    return env


def torchrun_argv(
    spec: CaseSpec, case_dir: Path, port: int | None = None, worker_args: Sequence[str] = ()
) -> list[str]:
    """torchrun (through `nsa_diag.worker.agent`: it dies with us, its store listens on the rendezvous
    address only) starting ``nsa_diag.worker.ddp`` on every local rank (``worker_args`` after the case
    folder)."""
    ds = spec.ddp
    assert ds is not None
    argv = [sys.executable, "-m", "nsa_diag.worker.agent", "--nnodes", str(ds.nnodes),
            "--nproc-per-node", str(ds.nproc), "--max-restarts", "0"]  # fmt: skip
    if ds.rdzv_endpoint is None:
        argv += ["--master-addr", LOOPBACK, "--master-port", str(port or free_port())]
    else:  # torchrun's static rendezvous: the one that keeps --node-rank (c10d ranks nodes by host name)
        argv += ["--node-rank", str(ds.node_rank), "--rdzv-backend", "static",
                 "--rdzv-endpoint", ds.rdzv_endpoint, "--rdzv-id", spec.run_id(),
                 "--rdzv-conf", f"timeout={max(1, round(ds.wait_s))}"]  # fmt: skip
    return [*argv, "-m", "nsa_diag.worker.ddp", str(Path(case_dir).resolve()), *worker_args]


# --- processes ----------------------------------------------------------------------------------------


class RankProcess:
    """A rank seen by pid (torchrun is its parent, not us): a `ProcessHandle` for the hang evidence."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return None if alive(self.pid) else 0


def _descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


# --- the NCCL flight recorder ------------------------------------------------------------------------


def flight_recorder_dump(case_dir: Path, spec: CaseSpec, pids: Mapping[int, int]) -> FlightRecorder:
    """NCCL: ask every rank's flight recorder for a dump through its debug pipe, wait for the files (other
    backends have no pipe: each rank's heartbeat dumps its recorder at the hang). They are analysed after
    the stop, with the dumps written then (`with_files`)."""
    assert spec.ddp is not None
    if spec.ddp.backend != "nccl":
        return FlightRecorder(
            taken=False, why=f"{spec.ddp.backend} has no debug pipe: each rank's own dump at the hang is read"
        )
    ranks_dir = Path(case_dir) / RANKS_DIR
    asked: dict[str, str] = {}
    for rank in pids:
        pipe = ranks_dir / f"{PIPE_PREFIX}{rank}.pipe"
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"1\n")
            os.close(fd)
            asked[str(rank)] = "asked through the debug pipe"
        except OSError as exc:
            asked[str(rank)] = f"no debug pipe ({exc.strerror}); the dump comes only on NCCL's own timeout"
    deadline = time.monotonic() + FR_WAIT_S
    while time.monotonic() < deadline and not all((ranks_dir / f"{FR_PREFIX}{r}").exists() for r in pids):
        time.sleep(0.1)
    time.sleep(0.3)  # a dump being written
    return FlightRecorder(asked=asked, files=collect_flight_recorder(case_dir, pids))


def with_files(
    recorder: FlightRecorder | None, found: Mapping[str, str], case_dir: Path, world_size: int | None
) -> FlightRecorder:
    """``recorder`` with the dumps ``found`` after the stop (NCCL's own timeout, or the ranks' heartbeats at
    the hang, wrote them) among its files, and what they all say."""
    recorder = recorder if recorder is not None else FlightRecorder()
    return analysed(case_dir, recorder.model_copy(update={"files": {**recorder.files, **found}}), world_size)


def analysed(case_dir: Path, recorder: FlightRecorder, world_size: int | None) -> FlightRecorder:
    """``recorder`` with what its files say (`nsa_diag.analysis.flight`, as `nsa-diag fr` reads them)."""
    dumps, unread = {}, {}
    for rank, path in recorder.files.items():
        try:
            dumps[int(rank)] = load_dump(Path(case_dir) / path)
        except UsageError as exc:
            unread[rank] = str(exc)
    analysis = analyse(dumps, world_size) if dumps else None
    return recorder.model_copy(update={"analysis": analysis, "unread": unread})


def flight_recorder_says(recorder: FlightRecorder | None) -> str | None:
    """One clause for a hang's reason: the rank the dumps blame, or that the ranks wait for each other."""
    analysis = recorder.analysis if recorder is not None else None
    if analysis is None or not (analysis.culprits or analysis.suspects):
        return None
    ranks = analysis.culprits or analysis.suspects
    names = rank_names(ranks)
    if analysis.culprits:
        blamed = [g.finding for g in analysis.groups if set(g.culprits) & set(ranks)]
        return f"{names} ({blamed[0] if blamed else analysis.findings[-1]})"
    return f"{names} each wait in a collective another never entered (in different process groups)"


def heartbeat_dumps(case_dir: Path, ranks: Sequence[int], have: Mapping[str, str]) -> dict[str, str]:
    """The recorders the ranks' heartbeats dumped at the hang, for the ranks ``have`` holds no dump of."""
    return {
        str(r): f"{RANKS_DIR}/{r}/{artifacts.FR_AT_HANG}"
        for r in ranks
        if str(r) not in have and (rank_dir(case_dir, r) / artifacts.FR_AT_HANG).is_file()
    }


def collect_flight_recorder(case_dir: Path, ranks: Sequence[int] | Mapping[int, int]) -> dict[str, str]:
    """Move ``ranks/nccl_trace_rank_<r>`` (torch's dump, on demand or on timeout) into ``ranks/<r>/``."""
    found = {}
    for rank in ranks:
        src = Path(case_dir) / RANKS_DIR / f"{FR_PREFIX}{rank}"
        if src.exists():
            dest = rank_dir(case_dir, rank) / FR_FILE
            artifacts.write_bytes(dest, src.read_bytes())
            src.unlink(missing_ok=True)
            found[str(rank)] = f"{RANKS_DIR}/{rank}/{FR_FILE}"
    return found


# --- the launcher -------------------------------------------------------------------------------------


def rank_inputs(unit_dir: Path) -> RankInputs:
    """What the cross-rank aggregation needs of one rank, read from its folder."""
    report = read_worker_report(unit_dir)
    last: ThreadStack | None = None
    for threads in reversed(read_stacks(unit_dir / artifacts.STACKS).sample_threads()):
        last = focus_thread(threads)
        if last is not None:
            break
    try:
        lines = (unit_dir / artifacts.PROGRESS).read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    return RankInputs(report.ddp if report else None, last, lines)


def aggregate_ranks(spec: CaseSpec, end: Ending) -> CaseResult:
    """The case's result from its ranks' results (``end.per_unit``, by rank) and what their folders hold
    (`aggregate`)."""
    inputs = {r: rank_inputs(rank_dir(end.case_dir, r)) for r in end.per_unit}
    return aggregate(spec, end.outcome, end.per_unit, inputs, end.decider, end.stop, end.elapsed, end.notes)


class TorchrunLauncher(Launcher):
    """The case on ``spec.ddp``'s local ranks through torchrun (the default for a spec with ``ddp``)."""

    label = "ddp case"

    def __init__(self, spec: CaseSpec) -> None:
        super().__init__(spec)
        assert spec.ddp is not None
        self.argv: list[str] = []
        self.pids: dict[int, int] = {}  # rank -> pid, from the ranks' beacons
        self.recorder: FlightRecorder | None = None  # asked at the last hang of the watch

    def plan(self, case_dir: Path, extra_env: Mapping[str, str] | None) -> LaunchPlan:
        (case_dir / RANKS_DIR).mkdir(parents=True, exist_ok=True)
        self.argv = torchrun_argv(self.spec, case_dir)  # picks a free port: asked once per case
        return LaunchPlan(
            home=self.home(case_dir),
            argv=self.argv,
            env={**python_env(self.spec), **ddp_env(self.spec, case_dir), **(extra_env or {})},
            replay_argv=self.argv,
            replay_env={**worker_env(self.spec), **ddp_env(self.spec, case_dir)},
        )

    def units(self, case_dir: Path) -> list[Unit]:
        return [
            Unit(r, rank_dir(case_dir, r), rank_dir(case_dir, r) / artifacts.BEACON)
            for r in local_ranks(self.spec)
        ]

    def evidence(self, case_dir: Path, stage: Stage, units: Sequence[Unit] = ()) -> Evidence:
        """The watch ended: the ranks' pids (for the evidence and the stop) and torchrun's command line. At
        a hang: every rank's NCCL flight recorder, and every live rank for the watchdog. After the stop:
        the dumps NCCL's own timeout wrote."""
        if stage is Stage.WATCHED:
            self.pids = self._rank_pids(case_dir)
            self.recorder = None
            return Evidence(JobNotes(torchrun=self.argv))
        if stage is Stage.HANG:
            self.recorder = flight_recorder_dump(case_dir, self.spec, self.pids)
            targets = {r: RankProcess(pid) for r, pid in self.pids.items() if alive(pid)}
            return Evidence(JobNotes(flight_recorder=self.recorder), targets)
        if stage is Stage.STOPPED:
            ranks = local_ranks(self.spec)
            found = collect_flight_recorder(case_dir, ranks)
            asked = self.recorder.files if self.recorder else {}
            found |= heartbeat_dumps(case_dir, ranks, {**found, **asked})
            if found or asked:  # what every dump says, once all are in
                recorder = with_files(self.recorder, found, case_dir, self.spec.ddp.world_size)
                return Evidence(JobNotes(flight_recorder=recorder))
        return Evidence()

    def _rank_pids(self, case_dir: Path) -> dict[int, int]:
        """rank -> pid of the ranks still of this job, from their beacons."""
        assert self.proc is not None
        beacons = {r: read_beacon(rank_dir(case_dir, r) / artifacts.BEACON) for r in local_ranks(self.spec)}
        pids = {r: s.pid for r, s in beacons.items() if s is not None and s.pid > 0}
        children = set(_descendants(self.proc.pid))
        return {r: p for r, p in pids.items() if p in children or alive(p)}

    def stop_processes(self) -> StopReport:
        assert self.proc is not None
        # torchrun's session, every rank and every session a rank leads, at once
        report = stop_tree(ProcessTree([self.proc.pid], self.pids.values(), follow=True), self.proc)
        report.rank_pids = list(self.pids.values())
        return report

    def internal_files(self, case_dir: Path) -> list[Path]:
        # and the NCCL debug pipes (FIFOs) each rank's process group made for flight-recorder requests
        pipes = [Path(case_dir) / RANKS_DIR / f"{PIPE_PREFIX}{r}.pipe" for r in local_ranks(self.spec)]
        return super().internal_files(case_dir) + pipes

    def rank_ends(self, end: JobEnd) -> UnitEnds:
        """Each rank's end: a rank that had exited before the others were stopped ended by itself, with
        the code torchrun's failure summary gives it (0 when it wrote its result and is not in the
        summary)."""
        stderr = (self.home(end.case_dir) / artifacts.STDERR).read_text(errors="replace")
        codes = rank_exit_codes(stderr)
        ends = {}
        for unit, w in zip(end.units, end.watched.units, strict=True):
            rank = unit.key
            if w.outcome != "exited" and rank not in end.hangs:  # this rank had already exited
                w = replace(w, outcome="exited", decision=None, exit_code=codes.get(rank, 0))
            code = codes.get(rank, 0 if (unit.folder / artifacts.WORKER_RESULT).exists() else None)
            ends[rank] = (
                w,
                StopReport(exit_code=code if w.outcome == "exited" else None, pid=self.pids.get(rank)),
            )
        return ends

    def outcome(self, end: JobEnd) -> CaseResult:
        """The ranks' cross-rank aggregation (`aggregate_ranks`), naming any process left."""
        result = aggregate_ranks(self.spec, classified(self.spec, end, self.rank_ends(end)))
        said = flight_recorder_says(end.notes.flight_recorder) if result.verdict == "hang" else None
        if said:
            result = result.model_copy(update={"reason": result.reason + f"; flight recorder: {said}"})
        if end.stop.survivors:
            result = result.model_copy(
                update={"reason": result.reason + f"; processes left: {end.stop.survivors}"}
            )
        return result

    def interrupted(
        self, case_dir: Path, by: str, elapsed: float, stop: StopReport, sampled: bool
    ) -> CaseResult:
        """One line: the ranks' own states are not gathered when nsa-diag itself is interrupted."""
        reason = f"interrupted by {by} after {elapsed:.1f} s"
        return error_result(self.spec, reason, elapsed, CaseEvidence(outcome="interrupted", stop=stop))
