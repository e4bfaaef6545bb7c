"""`nsa-diag matrix NAME|FILE`: every case of a matrix (shipped or a file), resumable, several at a time;
`--list` the shipped ones."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from nsa_diag.matrix import Matrix
    from nsa_diag.options import SubmititCluster
    from nsa_diag.session.cluster import ClusterConfig

from nsa_diag._cli_utils import (
    AccountOpt,
    DebugOpt,
    ExecutorOpt,
    GpusPerNodeOpt,
    JobExecutor,
    JsonOpt,
    PartitionOpt,
    SlurmOptOpt,
    SubmititClusterOpt,
    TimeOpt,
)

_RUN = "Running"
_OUTPUT = "Output"


def _complete_name(incomplete: str) -> list[str]:
    """Shell completion of NAME: the shipped matrices whose name starts so."""
    from nsa_diag.matrices import shipped_paths

    return [name for name in shipped_paths() if name.startswith(incomplete)]


def matrix(
    file: Annotated[
        str | None,
        typer.Argument(
            metavar="NAME|FILE",
            help="A shipped matrix by name (`--list`), e.g. cpu-smoke, or a matrix file (YAML).",
            show_default=False,
            autocompletion=_complete_name,
        ),
    ] = None,
    list_shipped: Annotated[
        bool,
        typer.Option("--list", help="List the shipped matrices (name and description) and exit."),
    ] = False,
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            metavar="RUN_DIR",
            rich_help_panel=_RUN,
            help="Continue an interrupted run in its folder: cases finished there with the same spec are not "
            "run again.",
        ),
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            "-j",
            min=1,
            rich_help_panel=_RUN,
            help="Cases at a time, each in its own worker; with several GPUs each CUDA case gets one. "
            "With --executor slurm: jobs submitted and unfinished at a time.",
            show_default="1; with --executor slurm every case at once",
        ),
    ] = None,
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            metavar="TAG[,TAG]",
            rich_help_panel=_RUN,
            help="Only the cases with one of these tags (or names).",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", rich_help_panel=_RUN, help="List the cases and what would run; run nothing."
        ),
    ] = False,
    junit: Annotated[
        Path | None,
        typer.Option(
            "--junit", metavar="FILE", rich_help_panel=_OUTPUT, help="Also write JUnit XML here, for CI."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            file_okay=False,
            rich_help_panel=_OUTPUT,
            help="Folder that receives the run folder [default: nsa-diag-runs].",
        ),
    ] = None,
    tag: Annotated[
        str | None,
        typer.Option(
            "--tag",
            rich_help_panel=_OUTPUT,
            help="Suffix of the run folder's name [default: the matrix's name].",
        ),
    ] = None,
    executor: ExecutorOpt = JobExecutor.local,
    partition: PartitionOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    time_limit: TimeOpt = None,
    account: AccountOpt = None,
    slurm_opt: SlurmOptOpt = None,
    submitit_cluster: SubmititClusterOpt = None,
    json_output: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run every case of a matrix, each in its own worker under the watchdog, into one run folder.

    NAME is a matrix shipped with nsa-diag (`--list`: cpu-smoke, gpu-smoke, backward, scaling,
    production); FILE a matrix file of your own. A matrix file (YAML; schema: `nsa-diag schema matrix`)
    has `defaults`,
    `axes` (key -> values: every combination over the defaults is a case) and `cases` (entries on top of
    the defaults, each optionally with its own `axes`). Keys are case fields (preset, seq_len, batch,
    steps, dtype, device, stall, timeout, inject, alloc_conf, reference_check, check, ...) and model
    fields (layers, dim, sel_backend, gc, force_branch, ...); per case also `name`, `tags`,
    `requires: cuda` (skipped without a GPU) and `expect: {verdict, hang_kind}` (an injected fault that
    must be detected). A bad file is refused before anything runs, one line per problem with its line.

    The run folder holds the usual `cases/<name>/`, `summary.json`/`summary.md`, `env.json`, and
    `matrix.json` (axes and case names, for `nsa-diag report`). `--resume RUN_DIR` continues in that
    folder: a case whose `result.json` has the spec hash of the case as the file now defines it is not
    run again; interrupted cases, and cases whose spec changed, run again. Ctrl-C stops the running cases
    (each gets its result.json) and starts no new one.

    `--executor slurm` submits each case as a Slurm job through submitit (`pip install 'nsa-diag[slurm]'`)
    that runs it on its node under the same watchdog, into the run folder: it must be on a filesystem the
    nodes share. Slurm settings come from the file's `slurm:` section (partition, account, gpus_per_node,
    time, options) and the options below, which override it. A job that Slurm ends before its case has a
    verdict (time limit, preemption, node failure, cancellation) gets a result.json with the Slurm state
    and why, and `--resume` submits it again; Ctrl-C cancels every submitted job.

    Exit code 0 when every case is ok (passed, or ended as its `expect` says, or skipped for want of
    CUDA), 1 when not, 2 for a bad file or option, 130 when interrupted.

    Examples:

        nsa-diag matrix --list
        nsa-diag matrix cpu-smoke
        nsa-diag matrix backward --dry-run
        nsa-diag matrix backward --only branch,sel-backend --jobs 2 --junit backward.xml
        nsa-diag matrix backward --resume nsa-diag-runs/20250825-164210-matrix-backward
        nsa-diag matrix my-matrix.yaml
        nsa-diag matrix backward --executor slurm --partition gpu --gpus-per-node 1 --time 30
        nsa-diag matrix backward --executor slurm --account proj --slurm-opt qos=high --junit backward.xml
        nsa-diag matrix my-matrix.yaml --executor slurm --submitit-cluster local --jobs 2
        make matrix-gpu-smoke
    """
    import shutil
    import sys
    from dataclasses import replace

    from nsa_diag import artifacts
    from nsa_diag.cases import check_output, runs_on_cuda
    from nsa_diag.errors import UsageError
    from nsa_diag.matrices import resolve
    from nsa_diag.matrix import load_matrix
    from nsa_diag.session import FollowUps, Session
    from nsa_diag.session.matrix import MatrixPlan, environment_gpus, make_plan, render_plan

    if list_shipped:
        if file is not None:
            raise UsageError("--list lists the shipped matrices; give it no NAME or FILE")
        _print_shipped(json_output)
        raise typer.Exit(0)
    if file is None:
        raise UsageError("give a shipped matrix's NAME (nsa-diag matrix --list) or a matrix FILE")
    if resume is not None and (out is not None or tag is not None):
        raise UsageError("--resume continues in RUN_DIR; --out and --tag do not apply to it")
    if resume is not None and not (resume / "matrix.json").is_file():
        raise UsageError(f"--resume {resume}: not the folder of a matrix run (no matrix.json in it)")
    check_output(out, tag)
    if junit is not None and junit.is_dir():
        raise UsageError(f"--junit {junit}: is a folder; give a file name")
    loaded = load_matrix(resolve(file))  # a bad file: a MatrixFileError, one line per problem (exit 2)
    if resume is not None:
        try:
            before = artifacts.read_json(resume / "matrix.json").get("name")
        except (OSError, ValueError, AttributeError):
            raise UsageError(f"--resume {resume}: its matrix.json cannot be read") from None
        if before != loaded.name:
            print(
                f"nsa-diag: note: {resume} ran matrix {before!r}; continuing it with {loaded.name!r}",
                file=sys.stderr,
            )
    cluster = _cluster_config(
        executor,
        loaded,
        jobs=jobs,
        partition=partition,
        gpus_per_node=gpus_per_node,
        time_limit=time_limit,
        account=account,
        slurm_opt=slurm_opt or [],
        submitit_cluster=submitit_cluster,
    )
    selected = loaded.select([part.strip() for part in (only or "").split(",") if part.strip()])
    for case in selected:  # a matrix keeps such a case (its other evidence stands); the console says so
        if case.spec.memory_snapshot and not runs_on_cuda(case.spec.device):
            print(
                f"nsa-diag: note: case {case.name}: memory_snapshot needs CUDA; it runs on the CPU "
                "and writes no memory_snapshot.pickle",
                file=sys.stderr,
            )
    if cluster is None:
        cuda, gpus = environment_gpus(jobs or 1, selected)
    else:  # the cases run on the nodes: CUDA there when the jobs ask for GPUs (one by default if needed)
        if cluster.settings.gpus_per_node is None and any(case.needs_cuda() for case in selected):
            cluster = replace(cluster, settings=cluster.settings.model_copy(update={"gpus_per_node": 1}))
        cuda, gpus = bool(cluster.settings.gpus_per_node), []
    plan = make_plan(selected, resume_dir=resume, cuda=cuda)
    if dry_run:
        render_plan(loaded, plan, json_output=json_output)
        raise typer.Exit(0)
    if cluster is not None and cluster.cluster == "slurm" and shutil.which("sbatch") is None:
        raise UsageError("--executor slurm: no Slurm here (sbatch not found); run nsa-diag on a login node")

    parent = resume.parent if resume is not None else (out or artifacts.DEFAULT_OUT)
    matrix_plan = MatrixPlan(
        loaded,
        plan,
        jobs=jobs or 1,
        gpus=gpus,
        cuda=cuda,
        resume_dir=resume,
        junit=junit,
        cluster=cluster,
    )
    session = Session(
        matrix_plan,
        out=parent,
        tag=tag or loaded.name,
        json_output=json_output,
        follow=FollowUps(junit=junit),
    )
    raise typer.Exit(session.run())


def _cluster_config(
    executor: JobExecutor,
    loaded: Matrix,
    *,
    jobs: int | None,
    partition: str | None,
    gpus_per_node: int | None,
    time_limit: str | None,
    account: str | None,
    slurm_opt: list[str],
    submitit_cluster: SubmititCluster | None,
) -> ClusterConfig | None:
    """None for --executor local (refusing Slurm options there); else how the cases are submitted: the
    file's `slurm:` section under the command's Slurm options. `UsageError` (exit 2) for a bad option or
    no submitit."""
    from nsa_diag.session.cluster import ClusterConfig
    from nsa_diag.slurm import SlurmSettings, refuse_slurm_options, require_submitit, settings_from_options

    if refuse_slurm_options(
        executor, partition=partition, account=account, gpus_per_node=gpus_per_node, time=time_limit,
        slurm_opts=slurm_opt, submitit_cluster=submitit_cluster,
    ):  # fmt: skip
        return None
    require_submitit()
    options = settings_from_options(
        partition=partition,
        account=account,
        gpus_per_node=gpus_per_node,
        time=time_limit,
        slurm_opts=slurm_opt,
    )
    settings = (loaded.slurm or SlurmSettings()).merged(options)
    cluster = submitit_cluster.value if submitit_cluster is not None else "slurm"
    return ClusterConfig(settings, cluster, jobs)  # type: ignore[arg-type]


def _print_shipped(json_output: bool) -> None:
    """The shipped matrices to stdout: one line each (name, description), or a JSON list."""
    from nsa_diag.matrices import shipped
    from nsa_diag.render import print_json, print_line

    found = shipped()
    if json_output:
        print_json([{"name": m.name, "description": m.description} for m in found])
        return
    width = max(len(m.name) for m in found)
    for m in found:
        print_line(f"{m.name:<{width}}  {m.description}")
