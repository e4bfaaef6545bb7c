"""`nsa-diag ddp`: the case on N ranks through torchrun (gloo on the CPU, NCCL on GPUs), each rank watched."""

from __future__ import annotations

import typer

from nsa_diag._cli_utils import (
    AccountOpt,
    CaseOptions,
    DebugOpt,
    GpusPerNodeOpt,
    JobExecutor,
    JsonOpt,
    NodesExecutorOpt,
    PartitionOpt,
    SlurmOptOpt,
    SubmititClusterOpt,
    TimeOpt,
    case_options,
)
from nsa_diag.options import (
    CASE_NAME,
    DDP,
    EVIDENCE,
    FAULTS,
    FOLLOW_UPS,
    MODEL,
    NSA,
    OUTPUT,
    TRAINING,
    WATCHDOG,
)


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
    DDP,
    defaults={"stall": "auto", "name": "ddp"},
)
def ddp(
    options: CaseOptions,
    executor: NodesExecutorOpt = JobExecutor.local,
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
    from nsa_diag.cases import build_ddp_spec, check_nodes_options, check_options
    from nsa_diag.launchers.preflight import check_user_model
    from nsa_diag.session import check_follow_ups
    from nsa_diag.session.nodes import run_ddp
    from nsa_diag.slurm import nodes_job

    check_options(options)
    follow = check_follow_ups(options)
    check_nodes_options(options)
    job = nodes_job(  # None: --executor local
        executor,
        nnodes=options.nnodes,
        node_rank=options.node_rank,
        rdzv_endpoint=options.rdzv_endpoint,
        partition=partition,
        account=account,
        gpus_per_node=gpus_per_node,
        time=time_limit,
        slurm_opts=slurm_opt or (),
        submitit_cluster=submitit_cluster,
    )
    spec = build_ddp_spec(options, job)  # named --name
    check_user_model([spec])
    code = run_ddp(spec, job, out=options.out, tag=options.tag, json_output=json_output, follow=follow)
    raise typer.Exit(code)
