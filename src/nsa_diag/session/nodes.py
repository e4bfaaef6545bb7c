"""Where the ranks of `nsa-diag ddp` run (`run_ddp`): one torchrun here (a `CaseList`), this node's part of
a multi-node case (`run_node`: a `NodePart`), or all the nodes as one Slurm job (``--executor slurm
--nnodes N``, `submit_nodes`), one torchrun per node.

On a cluster: one submitit job with one task per node (``nodes=N, tasks_per_node=1``; on submitit's local
executor, which has one node, ``tasks_per_node=N`` processes here instead). Each task runs `node_job` on
its node: its node rank is submitit's global rank of the task (one task per node: the node's index), node
0 picks a free port on its own host name (the first of the job's nodes) and publishes the endpoint in the
shared run folder (``slurm/rendezvous-<job id>.json``), the other nodes read it there, and then every node
runs what ``nsa-diag ddp --nnodes N --node-rank R --rdzv-endpoint HOST:PORT`` runs (`run_node`): the same
run folder, evidence and result (`nsa_diag.launchers.nodes`).

This process (on the login node) submits, shows the job's state until it ends, cancels it on Ctrl-C,
SIGTERM or SIGHUP (exit 130), and reports the case's result.json, which node 0 writes into the shared run
folder; a job that Slurm ended before a result was written gets one with the Slurm state and reason
(`nsa_diag.slurm.job_end`). The Slurm plumbing (settings, executor, states) is `nsa_diag.slurm`'s.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict

from nsa_diag import artifacts, interrupts, render
from nsa_diag.errors import UsageError
from nsa_diag.executor import InterruptGuard
from nsa_diag.interrupts import Interrupted
from nsa_diag.launchers.nodes import check_rendezvous
from nsa_diag.records import CaseEvidence
from nsa_diag.results import error_result
from nsa_diag.session.core import Session, read_result
from nsa_diag.session.followups import FollowUps
from nsa_diag.session.plans import CaseList, NodePart
from nsa_diag.slurm import LOG_FOLDER, Cluster, NodesJob, SlurmSettings, job_end, make_executor
from nsa_diag.spec import CaseResult, CaseSpec

POLL_S = 1.0
CANCEL_WAIT_S = {"slurm": 60.0, "local": 15.0}  # the cancelled job's nodes stop their cases (SIGTERM)
RESULT_GRACE_S = {"slurm": 15.0, "local": 2.0}  # a shared file system showing node 0's result.json late


@dataclass(frozen=True)
class NodeJob:
    """What every task of the job is given: the case (node rank and endpoint still to be filled in), the
    run folder's parent and tag, and where node 0 publishes the endpoint."""

    spec_json: str
    out: str
    tag: str | None
    endpoint_file: str
    loopback: bool  # submitit's local executor: every "node" is this host
    junit: str | None = None  # written by node 0


def _endpoint(job: NodeJob, node: int, first_host: str, wait_s: float) -> str:
    """Node 0: a free port on its host, published; node R > 0: the published endpoint (bounded wait)."""
    path = Path(job.endpoint_file)
    if node == 0:
        host = "127.0.0.1" if job.loopback else first_host
        with socket.socket() as s:
            s.bind((host, 0))
            endpoint = f"{host}:{s.getsockname()[1]}"
        artifacts.write_json(path, {"endpoint": endpoint, "host": socket.gethostname()})
        return endpoint
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            return str(artifacts.read_json(path)["endpoint"])
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
    raise UsageError(f"node 0 published no rendezvous endpoint in {path} within {wait_s:g} s")


def run_ddp(
    spec: CaseSpec,
    job: NodesJob | None,
    *,
    out: Path,
    tag: str | None,
    json_output: bool = False,
    follow: FollowUps | None = None,
) -> int:
    """`nsa-diag ddp`'s case (checked and built), wherever its ranks run: as one Slurm job of its nodes
    (``job``: submitted and followed from here), this node's part of a multi-node case, or one torchrun
    here; the exit code."""
    assert spec.ddp is not None
    follow = follow or FollowUps()
    if job is not None:
        return submit_nodes(
            spec,
            out=out,
            tag=tag,
            settings=job.settings,
            cluster=job.cluster,
            json_output=json_output,
            junit=follow.junit,
        )
    if spec.ddp.nnodes > 1:
        return run_node(spec, out, tag, follow, json_output=json_output)
    if spec.ddp.rdzv_endpoint is not None:
        check_rendezvous(spec.ddp)
    session = Session(CaseList("ddp", [spec]), out=out, tag=tag, json_output=json_output, follow=follow)
    return session.run()


def run_node(
    spec: CaseSpec, out: Path, tag: str | None, follow: FollowUps, *, json_output: bool = False
) -> int:
    """This node's part of a multi-node case, as ``nsa-diag ddp --nnodes N --node-rank R`` runs it: the
    rendezvous checked, then the session in the shared run folder; the exit code. Node 0 alone writes the
    case's JUnit (the nodes may share the path)."""
    assert spec.ddp is not None
    check_rendezvous(spec.ddp)
    if spec.ddp.node_rank > 0:
        follow = replace(follow, junit=None)
    plan = NodePart(spec, out, tag)
    return Session(plan, out=out, tag=tag, json_output=json_output, follow=follow).run()


class NodeOutcome(TypedDict, total=False):
    """What became of one task of the submitit job (`node_job`'s result, read by `_task_notes`)."""

    node_rank: int
    host: str
    job_id: str
    exit_code: int
    error: str  # a bad setting on the node, in one line
    endpoint: str


def node_job(job: NodeJob) -> NodeOutcome:
    """The function each task of the submitit job runs (pickled by reference): this node's rank from
    submitit's job environment, the endpoint, then `run_node`. Returns what became of it; a bad setting
    is its one line, not an exception (the login node reports it)."""
    import submitit

    env = submitit.JobEnvironment()
    spec = CaseSpec.model_validate_json(job.spec_json)
    assert spec.ddp is not None
    node = int(env.global_rank)
    facts = NodeOutcome(node_rank=node, host=socket.gethostname(), job_id=str(env.job_id))
    try:
        endpoint = _endpoint(job, node, str(env.hostnames[0]), spec.ddp.wait_s)
        ddp = spec.ddp.model_copy(update={"node_rank": node, "rdzv_endpoint": endpoint})
        follow = FollowUps(junit=Path(job.junit) if job.junit else None)  # written by node 0
        code = run_node(spec.model_copy(update={"ddp": ddp}), Path(job.out), job.tag, follow)
    except UsageError as exc:
        return {**facts, "exit_code": 2, "error": str(exc)}
    except KeyboardInterrupt:
        return {**facts, "exit_code": 130}
    return {**facts, "exit_code": code, "endpoint": endpoint}


def _state(job: Any) -> str:
    try:
        return str(job.state)
    except Exception:  # sacct failing must not end the wait: the run folder still tells
        return "UNKNOWN"


def submit_nodes(
    spec: CaseSpec,
    *,
    out: Path,
    tag: str | None,
    settings: SlurmSettings,
    cluster: Cluster,
    json_output: bool = False,
    junit: Path | None = None,
) -> int:
    """Submit the case's N nodes as one job, follow it, report the case's result (node 0 writes
    ``junit``); the exit code."""
    assert spec.ddp is not None
    ds = spec.ddp.model_copy(update={"run_id": spec.run_id()})  # every node's, whatever its endpoint
    spec = spec.model_copy(update={"ddp": ds})
    plan = NodePart(spec, out, tag)
    run_dir = artifacts.shared_run_dir(plan.shared_dir)  # type: ignore[arg-type]
    case_dir = run_dir / "cases" / spec.name
    if (case_dir / artifacts.RESULT).exists():
        raise UsageError(f"{run_dir}: this run has finished already; give a new --run-id to run it again")
    if settings.gpus_per_node is None and ds.backend == "nccl":  # one GPU per rank
        settings = settings.model_copy(update={"gpus_per_node": ds.nproc})
    if cluster == "local":  # submitit's local executor has one node: one task per simulated node
        settings, tasks = settings.model_copy(update={"nodes": 1}), ds.nnodes
    else:
        settings, tasks = settings.model_copy(update={"nodes": ds.nnodes}), 1
    minutes = settings.job_minutes(spec.timeout + 2 * ds.wait_s)
    folder = run_dir.resolve() / LOG_FOLDER
    executor = make_executor(settings, folder, cluster=cluster, minutes=minutes, name=f"nsa-diag-{spec.name}")
    executor.update_parameters(tasks_per_node=tasks)
    err = render.stderr_console()
    job: Any = None
    with InterruptGuard() as guard:
        try:
            with guard.deferred():  # an interrupt never leaves a job submitted but unknown
                job = executor.submit(node_job, _node_job(spec, out, tag, folder, cluster, junit))
            err.print(f"nsa-diag ddp: job {job.job_id}, {ds.nnodes} nodes, into {run_dir}", markup=False)
            state = _follow(job, err)
        except Interrupted:
            guard.close()
            if job is not None:
                job.cancel(check=False)
                _wait_done(job, CANCEL_WAIT_S[cluster])
            err.print("nsa-diag ddp: interrupted; the job was cancelled", markup=False)
            _result_or_end(spec, case_dir, job, "CANCELLED", cluster)
            return 130
    result = _result_or_end(spec, case_dir, job, state, cluster)
    return _report(result, job, run_dir, json_output)


def _node_job(
    spec: CaseSpec, out: Path, tag: str | None, folder: Path, cluster: Cluster, junit: Path | None
) -> NodeJob:
    stamp = f"{time.time():.0f}"  # the endpoint file of this submission (a job id is not known yet)
    return NodeJob(
        spec_json=spec.model_dump_json(),
        out=str(Path(out).resolve()),
        tag=tag,
        endpoint_file=str(folder / f"rendezvous-{stamp}.json"),
        loopback=cluster == "local",
        junit=str(Path(junit).resolve()) if junit is not None else None,
    )


def _follow(job: Any, err: Any) -> str:
    """Until the job ends: its state on stderr as it changes; the final state."""
    last = None
    while True:
        interrupts.check()
        state = _state(job)
        if state != last:
            err.print(f"nsa-diag ddp: job {job.job_id} {state}", markup=False)
            last = state
        if job.done():
            return _state(job)
        time.sleep(POLL_S)


def _wait_done(job: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not job.done():
        time.sleep(0.2)


def _result_or_end(spec: CaseSpec, case_dir: Path, job: Any, state: str, cluster: Cluster) -> CaseResult:
    """Node 0's result.json of the case, or (none written) one from the job's final state."""
    deadline = time.monotonic() + RESULT_GRACE_S[cluster]
    while True:
        result = read_result(case_dir)
        if result is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    job_id = str(job.job_id) if job is not None else "(not submitted)"
    end = job_end(state, job_id=job_id)
    ended_normally = end.state in ("COMPLETED", "FINISHED")
    if result is not None and result.evidence.outcome == "nsa-diag-ended" and not ended_normally:
        # the job's nsa-diag was stopped before it wrote the case's result, and its guardian wrote that
        # much: the job's end says why (a cancel after an interrupt, a time limit, a node lost)
        reason = f"{end.reason}; {result.reason}"
        result = result.model_copy(update={"reason": reason})
        artifacts.write_json(case_dir / artifacts.RESULT, result)
    if result is not None:
        return result
    notes = _task_notes(job)
    result = error_result(spec, end.reason + notes, 0.0, CaseEvidence(outcome="scheduler-ended", state=state))
    result = result.model_copy(update={"verdict": end.verdict})
    artifacts.write_json(case_dir / artifacts.RESULT, result)
    return result


def _task_notes(job: Any) -> str:
    """What the job's tasks said when they ended without a case result (a bad setting on a node)."""
    try:
        outcomes = job.results()
    except Exception:
        return ""
    said = [
        f"node {o.get('node_rank')}: {o['error']}" for o in outcomes if isinstance(o, dict) and o.get("error")
    ]
    return ("; " + "; ".join(said)) if said else ""


def _report(result: CaseResult, job: Any, run_dir: Path, json_output: bool) -> int:
    """The case's verdict on stdout (or the node 0 summary as JSON) and the exit code."""
    summary = run_dir / "summary.json"
    if json_output and summary.exists():
        render.print_json(artifacts.read_json(summary))
    else:
        kind = f" ({result.hang_kind})" if result.hang_kind else ""
        render.stdout_console().print(f"{result.name}: {result.verdict}{kind}: {result.reason}", markup=False)
        render.stdout_console().print(f"run folder: {run_dir}", markup=False)
    return 0 if result.verdict == "pass" else 1
