"""`nsa-diag ddp`: the case on N ranks through torchrun (gloo on the CPU, NCCL on GPUs), each rank watched."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from nsa_diag.options import SubmititCluster
    from nsa_diag.slurm import Cluster, SlurmSettings

from nsa_diag._cli_utils import (
    AccountOpt,
    CaseOptions,
    DebugOpt,
    GpusPerNodeOpt,
    JsonOpt,
    PartitionOpt,
    SlurmOptOpt,
    SubmititClusterOpt,
    TimeOpt,
    case_options,
)
from nsa_diag.options import (
    CASE_NAME,
    EVIDENCE,
    FAULTS,
    FOLLOW_UPS,
    MODEL,
    NSA,
    OUTPUT,
    TRAINING,
    WATCHDOG,
    JobExecutor,
)

_DDP = "DDP"
_CLUSTER = "Cluster (--executor slurm)"

NprocOpt = Annotated[int, typer.Option("--nproc", help="Ranks per node.", rich_help_panel=_DDP)]
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        metavar="auto|gloo|nccl",
        help="Process-group backend; auto: nccl when the ranks run on CUDA, else gloo.",
        rich_help_panel=_DDP,
    ),
]


@case_options(
    MODEL,
    NSA,
    TRAINING,
    WATCHDOG,
    FAULTS,
    EVIDENCE,
    FOLLOW_UPS,
    OUTPUT,
    CASE_NAME,
    defaults={"stall": "auto", "name": "ddp"},
)
def ddp(
    options: CaseOptions,
    nproc: NprocOpt = 2,
    backend: BackendOpt = "auto",
    static_graph: Annotated[
        bool, typer.Option("--static-graph", help="DDP static_graph=True.", rich_help_panel=_DDP)
    ] = False,
    find_unused: Annotated[
        bool,
        typer.Option("--find-unused", help="DDP find_unused_parameters=True.", rich_help_panel=_DDP),
    ] = False,
    bucket_mb: Annotated[
        float | None,
        typer.Option("--bucket-mb", help="DDP bucket_cap_mb (default 25).", rich_help_panel=_DDP, min=0.001),
    ] = None,
    trace_buckets: Annotated[
        bool,
        typer.Option(
            "--trace-buckets",
            help="Record bucket sizes and dtypes per rank for step 1.",
            rich_help_panel=_DDP,
        ),
    ] = False,
    nnodes: Annotated[
        int, typer.Option("--nnodes", help="Nodes (run the command on each).", rich_help_panel=_DDP)
    ] = 1,
    node_rank: Annotated[
        int, typer.Option("--node-rank", help="This node's index, 0..nnodes-1.", rich_help_panel=_DDP)
    ] = 0,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            "--rdzv-endpoint",
            metavar="HOST:PORT",
            help="Rendezvous endpoint (several nodes); default 127.0.0.1 and a free port.",
            rich_help_panel=_DDP,
        ),
    ] = None,
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id",
            metavar="ID",
            help="Several nodes: the rendezvous id and run folder `<out>/ddp-<ID>`, the same on every node "
            "(default: the case name and a hash of its options, alike on every node).",
            rich_help_panel=_DDP,
        ),
    ] = None,
    rdzv_timeout: Annotated[
        float | None,
        typer.Option(
            "--rdzv-timeout",
            metavar="SECONDS",
            help="Several nodes: how long the nodes wait for each other (node 0 for the others to join, "
            "the others for node 0 to listen, node 0 for their results); default 120.",
            rich_help_panel=_DDP,
        ),
    ] = None,
    executor: Annotated[
        JobExecutor,
        typer.Option(
            "--executor",
            rich_help_panel=_CLUSTER,
            help="local: this node's part, here. slurm: one Slurm job of --nnodes nodes through submitit "
            "(pip install 'nsa-diag[slurm]'), one torchrun per node; node ranks and the endpoint are chosen "
            "on the nodes; --out must be on a file system they share.",
        ),
    ] = JobExecutor.local,
    partition: PartitionOpt = None,
    account: AccountOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    time_limit: TimeOpt = None,
    slurm_opt: SlurmOptOpt = None,
    submitit_cluster: SubmititClusterOpt = None,
    json_output: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run the case on N ranks through torchrun under DistributedDataParallel, every rank watched.

    Each rank is a worker with its own progress, logs, stacks and memory under `cases/<name>/ranks/<r>/`.
    Before DDP wraps the model, a **pre-flight** forward and backward per rank finds the parameters that
    get a gradient: static_graph safe, find_unused needed, or ranks disagree. A hook per parameter records
    which gradients arrived on each rank (`grad-missing` names the parameter and the rank); DDP's own
    errors (unused parameters, "marked ready twice", a graph changed under static_graph) are explained in
    one line with the fix. After each step the parameters are hashed on every rank: a silent desync is a
    `mismatch`. On a stall the watchdog dumps every rank (NCCL flight recorder, two stack samples, py-spy,
    memory) before it stops any, then names the **minority ranks** and their first divergent frame;
    `hang_kind` is `collective` when ranks wait in collectives. No process of the job outlives it.

    Exit code 0 when the case passes, 1 when not, 2 for a bad option.

    Examples:

        nsa-diag ddp --nproc 2 --backend gloo --device cpu
        nsa-diag ddp --inject unused-param:layer=1 --stall 10
        nsa-diag ddp --inject skip-collective:rank=1 --stall 5
        nsa-diag ddp --backend nccl --static-graph --trace-buckets
        nsa-diag ddp --gc all --gc-reentrant --find-unused
        nsa-diag ddp --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 --backend nccl --out /shared/runs
        nsa-diag ddp --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400 --backend nccl --out /shared/runs
        nsa-diag ddp --executor slurm --nnodes 2 --nproc 8 --backend nccl --gpus-per-node 8 --out /shared/runs

    Several nodes: run the command on every node, with the same options but --node-rank, and an --out on
    a file system every node sees. The nodes share one run folder, `<out>/ddp-<run id>`: each node's ranks
    write `ranks/<global rank>/` of the case, node 0 writes the case's result.json (the cross-rank diff and
    minority ranks across nodes) and summary, every node ends with its exit code. Node 0 hosts the
    rendezvous on the endpoint's address only. With --executor slurm this command submits one job of
    --nnodes nodes, follows it, and reports the case's result (Ctrl-C cancels the job).
    """
    import dataclasses

    from nsa_diag.cases import build_ddp_spec, check_ddp_options, check_nodes_options, check_options
    from nsa_diag.launchers.nodes import check_rendezvous
    from nsa_diag.launchers.preflight import check_user_model
    from nsa_diag.session import Plan, Session, check_follow_ups
    from nsa_diag.session.nodes import PENDING_ENDPOINT, submit_nodes
    from nsa_diag.session.plans import CaseList, NodePart

    check_options(options)
    follow = check_follow_ups(options)
    check_nodes_options(options, nnodes=nnodes, run_id=run_id, rdzv_timeout=rdzv_timeout)
    slurm = executor == JobExecutor.slurm
    cluster = _slurm_settings(
        slurm,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        partition=partition,
        account=account,
        gpus_per_node=gpus_per_node,
        time_limit=time_limit,
        slurm_opt=slurm_opt or [],
        submitit_cluster=submitit_cluster,
    )
    if slurm and backend == "auto":  # the ranks run on the job's nodes, not on this one
        backend = "nccl" if gpus_per_node or options.device.value == "cuda" else "gloo"
    resolved = check_ddp_options(
        nproc=nproc,
        backend=backend,
        device=options.device.value,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        here=not slurm,
    )
    if slurm:
        rdzv_endpoint = PENDING_ENDPOINT
    settings = {
        "nproc": nproc, "backend": resolved, "static_graph": static_graph, "find_unused": find_unused,
        "bucket_mb": bucket_mb, "trace_buckets": trace_buckets, "nnodes": nnodes, "node_rank": node_rank,
        "rdzv_endpoint": rdzv_endpoint, "rdzv_timeout": rdzv_timeout, "run_id": run_id,
    }  # fmt: skip
    spec = build_ddp_spec(options, settings, name=options.name)
    check_user_model([spec])
    assert spec.ddp is not None
    if cluster is not None:
        slurm_settings, where = cluster
        code = submit_nodes(
            spec,
            out=options.out,
            tag=options.tag,
            settings=slurm_settings,
            cluster=where,
            json_output=json_output,
            junit=follow.junit,
        )
        raise typer.Exit(code)
    if spec.ddp.rdzv_endpoint is not None:
        check_rendezvous(spec.ddp)
    if nnodes > 1:
        plan: Plan = NodePart(spec, options.out, options.tag)
        if node_rank > 0:  # node 0 writes the case's JUnit (the nodes may share the path)
            follow = dataclasses.replace(follow, junit=None)
    else:
        plan = CaseList("ddp", [spec])
    session = Session(plan, out=options.out, tag=options.tag, json_output=json_output, follow=follow)
    raise typer.Exit(session.run())


_SLURM_ONLY = ("--partition", "--account", "--gpus-per-node", "--time", "--slurm-opt", "--submitit-cluster")


def _slurm_settings(
    slurm: bool,
    *,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str | None,
    partition: str | None,
    account: str | None,
    gpus_per_node: int | None,
    time_limit: str | None,
    slurm_opt: list[str],
    submitit_cluster: SubmititCluster | None,
) -> tuple[SlurmSettings, Cluster] | None:
    """None for --executor local (refusing the Slurm options there); else the job's Slurm settings and the
    submitit cluster. `UsageError` (exit 2) for what cannot work: no submitit, no Slurm, one node, a node
    rank or endpoint given (the job chooses them)."""
    import shutil

    from nsa_diag.errors import UsageError
    from nsa_diag.slurm import require_submitit, settings_from_options

    given = (partition, account, gpus_per_node, time_limit, slurm_opt or None, submitit_cluster)
    if not slurm:
        named = [flag for flag, value in zip(_SLURM_ONLY, given, strict=True) if value is not None]
        if named:
            raise UsageError(f"{named[0]} applies to --executor slurm; this run is --executor local")
        return None
    if nnodes < 2:
        raise UsageError(
            "--executor slurm: give --nnodes 2 or more (one node: nsa-diag matrix --executor slurm)"
        )
    if node_rank != 0 or rdzv_endpoint is not None:
        flag = "--node-rank" if node_rank != 0 else "--rdzv-endpoint"
        raise UsageError(
            f"{flag}: not with --executor slurm; each node's rank and the endpoint come from the job"
        )
    require_submitit()
    cluster = submitit_cluster.value if submitit_cluster is not None else "slurm"
    if cluster == "slurm" and shutil.which("sbatch") is None:
        raise UsageError("--executor slurm: no Slurm here (sbatch not found); run nsa-diag on a login node")
    settings = settings_from_options(
        partition=partition,
        account=account,
        gpus_per_node=gpus_per_node,
        time=time_limit,
        slurm_opts=slurm_opt,
    )
    return settings, cluster  # type: ignore[return-value]
