"""Multi-node ddp: one node's part of a case whose ranks run on several hosts, all in one case folder.

``nsa-diag ddp --nnodes N --node-rank R --rdzv-endpoint HOST:PORT --out SHARED`` runs on every node; the
nodes meet at torchrun's rendezvous and in the run folder ``SHARED/ddp-<run id>`` (`CaseSpec.run_id`:
derived alike on every node, or ``--run-id``). What they say to each other goes through files in the
shared case folder, so any shared file system works and no service of ours listens on the network:

1. `check_rendezvous` (before any folder exists): HOST resolves; node 0 can listen on HOST:PORT (it hosts
   the rendezvous store); a node R > 0 finds something listening there within ``--rdzv-timeout``.
2. Each node clears its own stale files (node 0: the case's); node 0 writes the case's spec.json,
   replay.sh and torchrun logs in the case folder, a node R > 0 in ``nodes/<R>/`` (`home`).
3. torchrun's **static** rendezvous at HOST:PORT: the one that keeps ``--node-rank`` (the c10d backend
   ranks nodes by host name and process id), so global rank = node rank x nproc + local rank. Node 0's
   agent hosts the store, listening on HOST only (`nsa_diag.worker.agent`); it waits ``--rdzv-timeout``
   for the other nodes to join.
4. Each node watches its local ranks (``ranks/<global rank>/``). Before it stops them (`wait_for_nodes`) it
   says so in ``nodes/<R>/node.json`` and waits, bounded, until every node has: no node's kill breaks a
   rank of another node (gloo and NCCL fail at once when a peer dies) before its evidence is taken.
5. Each node classifies its ranks into ``ranks/<r>/rank_result.json`` and its end into ``node.json``.
6. Node 0 waits (``--rdzv-timeout``) for every rank's result; a rank whose node never wrote one is an
   error "node R never reported". The cross-rank aggregation over all ranks
   (`nsa_diag.analysis.ranks.aggregate`: minority ranks across nodes) is the case's result.json.
7. A node R > 0 waits as long for that result.json and ends with it (same verdict, same exit code), kept
   in ``nodes/<R>/result.json``; when node 0 writes none, its own ranks' aggregation, saying so.
"""

from __future__ import annotations

import contextlib
import errno
import re
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from pydantic import Field

from nsa_diag import artifacts
from nsa_diag.artifacts import RANKS_DIR, rank_dir
from nsa_diag.errors import UsageError
from nsa_diag.launchers.base import Ending, Evidence, JobEnd, LaunchPlan, Stage, Unit, classified
from nsa_diag.launchers.torchrun import TorchrunLauncher, aggregate_ranks, local_ranks, torchrun_argv
from nsa_diag.records import (
    Barrier,
    CaseEvidence,
    DdpResult,
    JobNotes,
    NodeEnd,
    RankVerdict,
    Record,
    StopReport,
)
from nsa_diag.results import error_result
from nsa_diag.spec import CaseResult, CaseSpec, DdpSpec

POLL_S = 0.2
CONNECT_TRY_S = 1.0  # one connection attempt to the rendezvous while a node R > 0 waits for node 0
# Before it stops its ranks a node waits for the others to have taken their evidence: a node stalls within
# its stall limit of the first one (the same job, the same limit), and its evidence takes seconds (two stack
# samples a second apart, py-spy, GPU state; 3-6 s measured on the CPU for one rank). With --stall auto the
# limit is measured per node; AUTO_BARRIER_S bounds the wait then.
EVIDENCE_MARGIN_S = 30.0
AUTO_BARRIER_S = 60.0


# torchrun's words for a rendezvous that did not complete (the static store's wait for the other nodes,
# a node's connection to node 0's store)
_RDZV_ERROR = re.compile(r"DistStoreError|RendezvousError|RendezvousConnectionError|waiting for clients")


# --- up front: what can be checked before any folder exists ------------------------------------------


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[v6]:PORT``) -> (host, port); the endpoint is validated by `DdpSpec`."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def check_rendezvous(ds: DdpSpec) -> None:
    """A multi-node case's rendezvous, as far as it can be checked before anything runs; a `UsageError`
    (one line, exit 2) when it cannot work: HOST does not resolve; node 0 cannot listen on HOST:PORT (not
    an address of this machine, the port taken); at a node R > 0 nothing listens there within
    ``ds.wait_s`` (node 0 not started, a wrong host or port, a firewall)."""
    assert ds.rdzv_endpoint is not None
    host, port = split_endpoint(ds.rdzv_endpoint)
    where = f"--rdzv-endpoint {ds.rdzv_endpoint}"
    try:
        address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(f"{where}: host {host!r} does not resolve ({exc})") from None
    family, kind, proto, _, sockaddr = address
    if ds.node_rank == 0:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise UsageError(
                        f"{where}: {host} is not an address of this machine; node 0 hosts the rendezvous, "
                        "so run --node-rank 0 on the host the endpoint names"
                    ) from None
                raise UsageError(f"{where}: node 0 cannot listen there: {exc.strerror or exc}") from None
        return
    deadline = time.monotonic() + ds.wait_s
    while True:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(CONNECT_TRY_S)
            with contextlib.suppress(OSError):
                sock.connect(sockaddr)
                return
        if time.monotonic() >= deadline:
            raise UsageError(
                f"{where}: nothing listens there after {ds.wait_s:g} s; node 0 hosts the rendezvous: start "
                "it (or check the host, the port and the firewall), or wait longer with --rdzv-timeout"
            )
        time.sleep(POLL_S)


# --- the node's launcher ------------------------------------------------------------------------------


def node_of(spec: CaseSpec, rank: int) -> int:
    assert spec.ddp is not None
    return rank // spec.ddp.nproc


def barrier_s(spec: CaseSpec) -> float:
    """How long a node waits for the others before it stops its ranks (`EVIDENCE_MARGIN_S`)."""
    stall = AUTO_BARRIER_S if spec.stall == "auto" else float(spec.stall)
    return min(stall, spec.timeout or stall) + EVIDENCE_MARGIN_S


def _read(path: Path) -> object:
    """The JSON in ``path``; None where there is none yet (or half of one: another node writes it)."""
    try:
        return artifacts.read_json(path)
    except (OSError, ValueError):
        return None


class NodeFile(Record):
    """What a node says of itself in ``nodes/<R>/node.json`` (step 4 and 5 of the module docstring): its
    state (stopping, ended, interrupted) and, ended, how its watch ended and what stopping took."""

    state: str
    node_rank: int
    host: str
    time: float
    outcome: str | None = None
    decider: int | None = None
    stop: StopReport | None = None
    ranks: list[int] = Field(default_factory=list)
    by: str | None = None  # interrupted: the signal


def _node_file(path: Path) -> NodeFile | None:
    try:
        return NodeFile.model_validate(_read(path))
    except ValueError:
        return None


class NodeLauncher(TorchrunLauncher):
    """This node's part of a multi-node ddp case (module docstring): its local ranks through torchrun,
    the other nodes met through the shared case folder."""

    label = "ddp case (this node's part)"

    def __init__(self, spec: CaseSpec) -> None:
        super().__init__(spec)
        assert spec.ddp is not None
        assert spec.ddp.nnodes > 1
        self.ds: DdpSpec = spec.ddp
        self.node = spec.ddp.node_rank
        self.host = socket.gethostname()

    def home(self, case_dir: Path) -> Path:
        return Path(case_dir) if self.node == 0 else artifacts.node_dir(case_dir, self.node)

    def _node_file(self, case_dir: Path, node: int) -> Path:
        return artifacts.node_dir(case_dir, node) / artifacts.NODE

    def _say(self, case_dir: Path, state: str, **facts: object) -> None:
        record = NodeFile.model_validate(
            {"state": state, "node_rank": self.node, "host": self.host, "time": time.time(), **facts}
        )
        artifacts.write_json(self._node_file(case_dir, self.node), record)

    def plan(self, case_dir: Path, extra_env: Mapping[str, str] | None) -> LaunchPlan:
        """First clear what an earlier attempt in this folder left: this node's ranks and node files; at
        node 0 also every node's and rank's results (the other nodes write theirs only after the
        rendezvous, which needs node 0). A node R > 0's ranks read the spec in its folder."""
        for rank in local_ranks(self.spec):
            artifacts.remove_tree(rank_dir(case_dir, rank))
        stale = [self._node_file(case_dir, self.node), self.home(case_dir) / artifacts.RESULT]
        if self.node == 0:
            stale += [self._node_file(case_dir, n) for n in range(self.ds.nnodes)]
            stale += list((Path(case_dir) / RANKS_DIR).glob(f"*/{artifacts.RANK_RESULT}"))
        artifacts.remove_files(stale)
        plan = super().plan(case_dir, extra_env)
        self.home(case_dir).mkdir(parents=True, exist_ok=True)
        own_spec = [] if self.node == 0 else [str((self.home(case_dir) / artifacts.SPEC).resolve())]
        self.argv = torchrun_argv(self.spec, case_dir, worker_args=own_spec)
        return replace(plan, argv=self.argv, replay_argv=self.argv)

    def evidence(self, case_dir: Path, stage: Stage, units: Sequence[Unit] = ()) -> Evidence:
        """torchrun's, with this node's rank and host; before the stop, the barrier (`wait_for_nodes`)."""
        if stage is Stage.STOPPING:
            return Evidence(JobNotes(barrier=self.wait_for_nodes(case_dir)))
        taken = super().evidence(case_dir, stage, units)
        if stage is Stage.WATCHED:
            taken.notes.node_rank, taken.notes.host = self.node, self.host
        return taken

    def _never_started(self, case_dir: Path) -> bool:
        """No local rank ever started (`plan` removed their folders): the rendezvous did not complete."""
        return not any(rank_dir(case_dir, r).exists() for r in local_ranks(self.spec))

    def _rendezvous_failure(self, case_dir: Path) -> str:
        """The case's reason when the rendezvous did not complete, with torchrun's own last word on it."""
        try:
            lines = (self.home(case_dir) / artifacts.STDERR).read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        said = next((ln.strip() for ln in reversed(lines) if _RDZV_ERROR.search(ln)), None)
        text = (
            f"the rendezvous at {self.ds.rdzv_endpoint} did not complete within {self.ds.wait_s:g} s "
            f"(--rdzv-timeout): no rank started on node {self.node}"
        )
        return text + (f"; torchrun: {said}" if said else "")

    def _not_met(self, case_dir: Path, elapsed: float, stop: StopReport) -> CaseResult:
        """The case's result when the rendezvous did not complete: an error saying so, each rank's part."""
        ranks = {
            str(r): RankVerdict(
                verdict="error",
                reason="never started: the rendezvous did not complete"
                if node_of(self.spec, r) == self.node
                else f"node {node_of(self.spec, r)} never reported",
            )
            for r in range(self.ds.world_size)
        }
        ddp = DdpResult(nnodes=self.ds.nnodes, node_rank=self.node, world_size=self.ds.world_size,
                        backend=self.ds.backend, ranks=ranks, torchrun=self.argv)  # fmt: skip
        result = error_result(
            self.spec,
            self._rendezvous_failure(case_dir),
            elapsed,
            CaseEvidence(outcome="rendezvous-failed", stop=stop),
        )
        return result.model_copy(update={"ddp": ddp})

    def wait_for_nodes(self, case_dir: Path) -> Barrier:
        """Say this node has its evidence, and wait (`barrier_s`, at most ``--rdzv-timeout``) until every
        node has said so; not when no local rank started (there is nothing to break). How long it waited."""
        self._say(case_dir, "stopping")
        if self._never_started(case_dir):
            return Barrier(waited_s=0.0, skipped="no rank started on this node")
        others = [n for n in range(self.ds.nnodes) if n != self.node]
        started = time.monotonic()
        deadline = started + min(barrier_s(self.spec), self.ds.wait_s)
        while True:
            missing = [n for n in others if _node_file(self._node_file(case_dir, n)) is None]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        return Barrier(waited_s=round(time.monotonic() - started, 2), nodes_not_ready=missing)

    def outcome(self, end: JobEnd) -> CaseResult:
        """Publish this node's ranks' results and its end; node 0 then aggregates every rank, a node R > 0
        takes node 0's result (module docstring)."""
        case_dir = end.case_dir
        ending = classified(self.spec, end, self.rank_ends(end))
        if self._never_started(case_dir):
            self._say(case_dir, "ended", outcome="rendezvous-failed", stop=end.stop)
            return self._not_met(case_dir, ending.elapsed, end.stop)
        for rank, result in ending.per_unit.items():
            artifacts.write_json(rank_dir(case_dir, rank) / artifacts.RANK_RESULT, result)
        self._say(
            case_dir,
            "ended",
            outcome=ending.outcome,
            decider=ending.decider,
            stop=ending.stop,
            ranks=sorted(ending.per_unit),
        )
        return self._aggregate_all(ending) if self.node == 0 else self._await_case(ending)

    def _aggregate_all(self, end: Ending) -> CaseResult:
        """Node 0: every rank's result (waiting for the other nodes), aggregated across nodes."""
        case_dir, outcome, per_unit, decider = end.case_dir, end.outcome, end.per_unit, end.decider
        others = [r for r in range(self.ds.world_size) if r not in per_unit]
        wait = self.ds.wait_s
        deadline = time.monotonic() + wait
        paths = {r: rank_dir(case_dir, r) / artifacts.RANK_RESULT for r in others}
        while time.monotonic() < deadline and not all(p.exists() for p in paths.values()):
            time.sleep(POLL_S)
        per_rank = dict(per_unit)
        for rank, path in paths.items():
            found = _read(path)
            try:
                per_rank[rank] = CaseResult.model_validate(found)
            except ValueError:
                node = node_of(self.spec, rank)
                reason = f"node {node} never reported: no result for rank {rank} within {wait:g} s"
                per_rank[rank] = error_result(
                    self.spec, reason, end.elapsed, CaseEvidence(outcome="node-missing")
                )
        nodes: dict[str, NodeEnd] = {}
        for n in range(self.ds.nnodes):
            record = _node_file(self._node_file(case_dir, n)) if n != self.node else None
            if n == self.node:
                nodes[str(n)] = NodeEnd(host=self.host, outcome=outcome, decider=decider)
            elif record is None or record.state != "ended":
                nodes[str(n)] = NodeEnd(never_reported=True, state=record.state if record else None)
            else:
                nodes[str(n)] = NodeEnd(
                    host=record.host, outcome=record.outcome, decider=record.decider, stop=record.stop
                )
        outcomes = [outcome, *(v.outcome for v in nodes.values())]
        combined = "stalled" if "stalled" in outcomes else "timeout" if "timeout" in outcomes else outcome
        if decider is None:
            decider = next((v.decider for v in nodes.values() if v.decider is not None), None)
        notes = end.notes.model_copy(update={"nodes": nodes})
        result = aggregate_ranks(
            self.spec, replace(end, outcome=combined, per_unit=per_rank, decider=decider, notes=notes)
        )
        survivors = {n: v.stop.survivors for n, v in nodes.items() if v.stop is not None and v.stop.survivors}
        if survivors:
            result = result.model_copy(update={"reason": result.reason + f"; processes left: {survivors}"})
        return result

    def _await_case(self, end: Ending) -> CaseResult:
        """Node R > 0: node 0's result of the case, or this node's ranks' own aggregation when none comes."""
        wait = self.ds.wait_s
        deadline = time.monotonic() + wait
        path = Path(end.case_dir) / artifacts.RESULT
        while time.monotonic() < deadline:
            found = _read(path)
            if found is not None:
                with contextlib.suppress(ValueError):
                    return self._node_0s(CaseResult.model_validate(found), end)
            time.sleep(POLL_S)
        result = aggregate_ranks(self.spec, end)
        reason = f"node 0 wrote no result for the case within {wait:g} s; node {self.node}'s ranks only: "
        return result.model_copy(update={"reason": reason + result.reason})

    def _node_0s(self, case: CaseResult, end: Ending) -> CaseResult:
        """Node 0's result of the case, as this node R > 0 ends with it: where node 0's nsa-diag was
        interrupted, that is said of node 0 (this node was not), with what became of this node's ranks."""
        if case.evidence.outcome != "interrupted":
            return case
        own = aggregate_ranks(self.spec, end)
        reason = f"node 0 was {case.reason} (not this node); node {self.node}'s ranks: {own.reason}"
        return case.model_copy(update={"reason": reason})

    def interrupted(
        self, case_dir: Path, by: str, elapsed: float, stop: StopReport, sampled: bool
    ) -> CaseResult:
        self._say(case_dir, "interrupted", by=by)
        return super().interrupted(case_dir, by, elapsed, stop, sampled)
