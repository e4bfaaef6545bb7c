"""Slurm through submitit: the settings of a submission, the executor made from them, and a job's end.

Everything nsa-diag submits to a cluster goes through this module (`nsa-diag matrix --executor slurm`; the
multi-node `ddp --executor slurm` reuses it). It does not schedule anything itself: submitit writes the
sbatch script, submits, pickles the function a job runs and its return value, and asks ``sacct`` for
states. This module only

- holds the settings (`SlurmSettings`: partition, account, GPUs per node, time limit, nodes, any other
  sbatch option), from command-line options and from a matrix file's ``slurm:`` section (`merged`);
- makes a submitit executor from them (`make_executor`): ``cluster="slurm"`` on a cluster,
  ``cluster="local"`` (submitit's `LocalExecutor`: one local process per job, the same pickling and the
  same submission path) in the tests and on a machine without Slurm;
- says what a job's final state means for a case that has no result of its own (`job_end`): Slurm's
  states (COMPLETED, FAILED, TIMEOUT, PREEMPTED, NODE_FAIL, CANCELLED, OUT_OF_MEMORY, ...) and those of
  the local executor, each with the reason a person reads, never a silent gap;
- refuses what cannot work in one line (`UsageError`, exit 2): no submitit (`require_submitit`), a bad
  ``--slurm-opt`` or ``--time``, no Slurm on this machine, a Slurm option without ``--executor slurm``
  (`nodes_job`: how `nsa-diag ddp` submits a case's nodes as one job).

submitit is an optional dependency (``pip install 'nsa-diag[slurm]'``) imported only here, and only when
a command asks for ``--executor slurm``. The module sits with the vocabulary (pydantic and the errors only)
because a matrix file's ``slurm:`` section is a `SlurmSettings` (`nsa_diag.matrix`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nsa_diag.errors import UsageError
from nsa_diag.options import JobExecutor, SubmititCluster

Cluster = Literal["slurm", "local"]
INSTALL_HINT = "--executor slurm needs submitit: pip install 'nsa-diag[slurm]'"
LOG_FOLDER = "slurm"  # submitit's own files (sbatch script, pickles, job logs), inside the run folder
# In LOG_FOLDER: what the local executor's job controllers print (their KeyboardInterrupt on Ctrl-C).
LOCAL_CONTROLLERS_LOG = "local-controllers.log"

# A Slurm time limit: "MINUTES", "MINUTES:SECONDS", "HOURS:MINUTES:SECONDS", "DAYS-HOURS",
# "DAYS-HOURS:MINUTES", "DAYS-HOURS:MINUTES:SECONDS" (sbatch --time).
_TIME = re.compile(
    r"^(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
    r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$"
)
_OPTION_KEY = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
# sbatch options that submitit writes itself (a second value would break the job's logs or its signal),
# and those with an option of their own here.
_OWNED_KEYS = {"output", "error", "array", "open-mode", "signal", "job-name", "wckey"}
_FIELD_KEYS = {"partition": "partition", "account": "account", "time": "time",
               "gpus-per-node": "gpus_per_node", "nodes": "nodes"}  # fmt: skip


def time_limit_minutes(text: str) -> int:
    """A Slurm time limit (``--time``) in whole minutes, rounded up; `ValueError` for another format."""
    match = _TIME.match(text.strip())
    if match is None:
        raise ValueError(
            f"{text!r} is not a Slurm time limit: MINUTES, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
        )
    g = {k: int(v) if v is not None else 0 for k, v in match.groupdict().items()}
    if match["days"] is not None:
        seconds = ((g["days"] * 24 + g["dh"]) * 60 + g["dm"]) * 60 + g["ds"]
    elif match["c"] is not None:  # H:M:S
        seconds = (g["a"] * 60 + g["b"]) * 60 + g["c"]
    else:  # M or M:S
        seconds = g["a"] * 60 + g["b"]
    if seconds <= 0:
        raise ValueError(f"{text!r}: a time limit must be longer than 0")
    return math.ceil(seconds / 60)


def option_key(key: str) -> str:
    """An sbatch option's name as sbatch spells it (``mail_user``, ``--mail-user`` -> ``mail-user``)."""
    return key.strip().removeprefix("--").replace("_", "-")


class SlurmSettings(BaseModel):
    """How jobs are submitted: a matrix file's ``slurm:`` section, or the command's Slurm options.

    Unset fields leave the choice to the cluster (its default partition, account, ...) or, for ``time``,
    to nsa-diag (`job_minutes`: the cases' own timeout plus a margin).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, title="slurm")

    partition: str | None = Field(None, description="sbatch --partition")
    account: str | None = Field(None, description="sbatch --account")
    gpus_per_node: int | None = Field(None, ge=0, description="sbatch --gpus-per-node (one case uses one)")
    time: str | None = Field(
        None,
        description="sbatch --time of each job (MINUTES, HH:MM:SS, D-HH:MM:SS); default: the case's "
        "timeout plus 5 minutes",
    )
    nodes: int = Field(1, ge=1, description="sbatch --nodes (a matrix case runs on one)")
    options: dict[str, str] = Field(
        default_factory=dict,
        description="other sbatch options, name -> value (qos, constraint, mem, cpus-per-task, ...)",
    )

    @field_validator("time")
    @classmethod
    def _valid_time(cls, value: str | None) -> str | None:
        if value is not None:
            time_limit_minutes(value)
        return value

    @field_validator("options")
    @classmethod
    def _valid_options(cls, value: dict[str, str]) -> dict[str, str]:
        out = {}
        for raw, text in value.items():
            key = option_key(str(raw))
            if not _OPTION_KEY.match(key):
                raise ValueError(f"{raw!r} is not an sbatch option name")
            if key in _FIELD_KEYS:
                raise ValueError(f"{key}: give it as `{_FIELD_KEYS[key]}` (--{key}), not as an extra option")
            if key in _OWNED_KEYS:
                raise ValueError(f"{key}: set by nsa-diag through submitit; it cannot be given")
            out[key] = str(text)
        return out

    def merged(self, override: SlurmSettings) -> SlurmSettings:
        """These settings with those set in ``override`` (the command line over the file); options merge
        key by key."""
        fields = {name: getattr(override, name) for name in override.model_fields_set if name != "options"}
        options = {**self.options, **override.options}
        return self.model_copy(update={**fields, "options": options})

    def is_empty(self) -> bool:
        """Whether nothing was set (the defaults everywhere)."""
        return not self.model_fields_set and not self.options

    def job_minutes(self, case_timeout_s: float) -> int:
        """A job's time limit in minutes: ``time`` when set, else the case's timeout plus 5 minutes (start-up,
        the evidence of a hang, the stop)."""
        if self.time is not None:
            return time_limit_minutes(self.time)
        return math.ceil((case_timeout_s + 300) / 60)


def parse_slurm_opt(text: str) -> tuple[str, str]:
    """``--slurm-opt KEY=VALUE`` -> (sbatch option name, value); `UsageError` for anything else."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise UsageError(f"--slurm-opt {text!r}: give KEY=VALUE, e.g. --slurm-opt qos=high")
    try:
        settings = SlurmSettings(options={key: value.strip()})
    except ValueError as exc:
        message = exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc)
        raise UsageError(f"--slurm-opt {text!r}: {str(message).removeprefix('Value error, ')}") from None
    return next(iter(settings.options.items()))


def settings_from_options(
    *,
    partition: str | None = None,
    account: str | None = None,
    gpus_per_node: int | None = None,
    time: str | None = None,
    nodes: int | None = None,
    slurm_opts: Sequence[str] = (),
) -> SlurmSettings:
    """The settings the command-line options give (only those given count as set); `UsageError`."""
    given: dict[str, str | int | dict[str, str]] = {
        k: v
        for k, v in dict(
            partition=partition, account=account, gpus_per_node=gpus_per_node, time=time, nodes=nodes
        ).items()
        if v is not None
    }
    if time is not None:
        try:
            time_limit_minutes(time)
        except ValueError as exc:
            raise UsageError(f"--time {exc}") from None
    options = dict(parse_slurm_opt(text) for text in slurm_opts)
    if options:
        given["options"] = options
    return SlurmSettings.model_validate(given)


# --- submitit ----------------------------------------------------------------------------------------------


def require_submitit() -> ModuleType:
    """The submitit module, or a one-line `UsageError` saying how to install it."""
    try:
        import submitit
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    return submitit


# --- nsa-diag ddp --executor slurm: a case's nodes as one job ----------------------------------------------

# The options that only `--executor slurm` takes, in the order a refusal names the first given.
SLURM_ONLY = ("--partition", "--account", "--gpus-per-node", "--time", "--slurm-opt", "--submitit-cluster")


def refuse_slurm_options(
    executor: JobExecutor,
    *,
    partition: str | None,
    account: str | None,
    gpus_per_node: int | None,
    time: str | None,
    slurm_opts: Sequence[str],
    submitit_cluster: SubmititCluster | None,
) -> bool:
    """For `ddp` and `matrix`: False under ``--executor slurm``; True under ``--executor local``, where
    any of `SLURM_ONLY` given is refused (`UsageError`, the first in that order named)."""
    if executor == JobExecutor.slurm:
        return False
    given = (partition, account, gpus_per_node, time, list(slurm_opts) or None, submitit_cluster)
    named = [flag for flag, value in zip(SLURM_ONLY, given, strict=True) if value is not None]
    if named:
        raise UsageError(f"{named[0]} applies to --executor slurm; this run is --executor local")
    return True


@dataclass(frozen=True)
class NodesJob:
    """How `nsa-diag ddp --executor slurm` submits a case's nodes: one job of these settings, through
    this submitit cluster (``local``: submitit's local executor, every node a process here)."""

    settings: SlurmSettings
    cluster: Cluster = "slurm"


def nodes_job(
    executor: JobExecutor,
    *,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str | None,
    partition: str | None = None,
    account: str | None = None,
    gpus_per_node: int | None = None,
    time: str | None = None,
    slurm_opts: Sequence[str] = (),
    submitit_cluster: SubmititCluster | None = None,
) -> NodesJob | None:
    """None for ``--executor local`` (refusing the Slurm options there); else the job that runs the case's
    ``nnodes`` nodes. `UsageError` (exit 2) for what cannot work: no submitit, no Slurm, one node, a node
    rank or endpoint given (the job chooses them), a bad ``--time`` or ``--slurm-opt``."""
    if refuse_slurm_options(
        executor, partition=partition, account=account, gpus_per_node=gpus_per_node, time=time,
        slurm_opts=slurm_opts, submitit_cluster=submitit_cluster,
    ):  # fmt: skip
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
    cluster: Cluster = "local" if submitit_cluster == SubmititCluster.local else "slurm"
    if cluster == "slurm" and shutil.which("sbatch") is None:
        raise UsageError("--executor slurm: no Slurm here (sbatch not found); run nsa-diag on a login node")
    settings = settings_from_options(
        partition=partition, account=account, gpus_per_node=gpus_per_node, time=time, slurm_opts=slurm_opts
    )
    return NodesJob(settings, cluster)


def make_executor(
    settings: SlurmSettings,
    folder: Path,
    *,
    cluster: Cluster = "slurm",
    minutes: int,
    name: str = "nsa-diag",
) -> Any:
    """A `submitit.AutoExecutor` for jobs of at most ``minutes``, its files in ``folder``.

    ``cluster="local"`` runs each job as a local process (submitit's `LocalExecutor`) through the same
    calls; the Slurm-only settings are then ignored. Several jobs submitted in ``executor.batch()`` become
    one Slurm array. `UsageError` when there is no Slurm here or sbatch refuses a setting.
    """
    submitit = require_submitit()
    try:
        executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
    except RuntimeError as exc:  # SlurmExecutor: no srun on this machine
        raise UsageError(f"--executor slurm: no Slurm here ({exc}); run nsa-diag on a login node") from None
    params: dict[str, Any] = {"name": name, "timeout_min": minutes, "nodes": settings.nodes}
    if settings.gpus_per_node is not None:
        params["gpus_per_node"] = settings.gpus_per_node
    slurm: dict[str, Any] = {"partition": settings.partition, "account": settings.account}
    if settings.options:
        slurm["additional_parameters"] = dict(settings.options)
    params.update({f"slurm_{k}": v for k, v in slurm.items() if v is not None})
    try:
        executor.update_parameters(**params)
    except (ValueError, NameError, AssertionError) as exc:
        raise UsageError(f"Slurm settings refused: {' '.join(str(exc).split())}") from None
    return executor


# --- how a job ended ---------------------------------------------------------------------------------------

# Slurm job states in which a job has not ended (squeue/sacct), and the local executor's.
ACTIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
     "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "READY", "RESV_DEL_HOLD"}
)  # fmt: skip


def base_state(state: str) -> str:
    """``"CANCELLED by 1234"`` -> ``"CANCELLED"``; upper case."""
    return (state.split() or ["UNKNOWN"])[0].upper()


@dataclass(frozen=True)
class JobEnd:
    """What a job's final state says about a case that it did not let reach a verdict: the verdict it gets
    (``error``, or ``oom`` for Slurm's memory limit), ``head`` (which job, its state, where) and ``why``
    (what the state means); `reason` is both, in one line."""

    state: str  # as Slurm (or the local executor) gave it, e.g. "CANCELLED by 1234"
    verdict: Literal["error", "oom"]
    head: str
    why: str

    @property
    def reason(self) -> str:
        return f"{self.head}: {self.why}"


# One line per state: what happened to the job, for a person (sacct(1) JOB STATE CODES).
_STATE_REASONS: dict[str, str] = {
    "COMPLETED": "the job ended normally, but the case's result.json never appeared on the shared filesystem",
    "FAILED": "the job exited with a non-zero code before its case wrote a result",
    "TIMEOUT": "the job reached its Slurm time limit",
    "PREEMPTED": "Slurm preempted the job (a job of higher priority took the node)",
    "NODE_FAIL": "the node running the job failed",
    "BOOT_FAIL": "the job's node failed to boot",
    "CANCELLED": "the job was cancelled (scancel)",
    "OUT_OF_MEMORY": "the job exceeded its Slurm memory allocation (the kernel's OOM killer)",
    "DEADLINE": "the job reached its deadline",
    "REVOKED": "the job was revoked (federation)",
    "SPECIAL_EXIT": "the job ended in Slurm's special exit state",
    # submitit's local executor (a process per job on this machine)
    "FINISHED": "the job's process exited before its case wrote a result",
    "INTERRUPTED": "the job's process was killed by a signal",
    "NO PROCESS AND NO RESULT": "the job's process is gone and left no result",
    "UNKNOWN": "the scheduler knows nothing of the job (no sacct record)",
}


def job_end(
    state: str,
    *,
    job_id: str,
    cluster: Cluster = "slurm",
    minutes: int | None = None,
    nodes: str | None = None,
    exit_signal: str | None = None,
    result_saved: bool | None = None,
) -> JobEnd:
    """The verdict and the reason of a case whose job ended in ``state`` before the case had a verdict.
    ``result_saved``: whether submitit saved the job's return value (or its exception); a local job
    whose controller exited normally (FINISHED) without one had its task killed."""
    base = base_state(state)
    why = _STATE_REASONS.get(base, f"the job ended in state {base}")
    label = "Slurm job" if cluster == "slurm" else "local submitit job"
    ended = f"ended {state}"
    if cluster == "local" and base == "FINISHED" and result_saved is False:
        ended = f"was killed (submitit's state: {state})"
        why = (
            "its task process ended without a result, by a signal (SIGKILL, the kernel's OOM killer) "
            "before its case wrote one"
        )
    if base == "TIMEOUT" and minutes is not None:
        why += f" ({minutes} min; raise it with --time)"
    if base == "INTERRUPTED" and exit_signal:
        why = f"the job's process was killed by {exit_signal}"
    if base == "OUT_OF_MEMORY":
        why += "; ask for more with --slurm-opt mem=..."
    where = f" on {nodes}" if nodes and nodes not in ("None assigned", "") else ""
    verdict: Literal["error", "oom"] = "oom" if base == "OUT_OF_MEMORY" else "error"
    return JobEnd(state, verdict, f"{label} {job_id} {ended}{where}", why)


@contextlib.contextmanager
def controllers_stderr(folder: Path, cluster: Cluster) -> Iterator[None]:
    """While jobs are submitted: the local executor starts each job's controller with our stderr, and a
    terminal's Ctrl-C (or our cancel, a SIGINT) makes it print its KeyboardInterrupt tracebacks there,
    burying nsa-diag's one line. The controllers started in here get `LOCAL_CONTROLLERS_LOG` in
    ``folder`` instead (the submission runs in one thread, between two lines of ours)."""
    if cluster != "local":
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    log = os.open(folder / LOCAL_CONTROLLERS_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(log, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(log)


def is_active(state: str) -> bool:
    """Whether a job in ``state`` may still run (or start)."""
    return base_state(state) in ACTIVE_STATES


def job_paths(job: Any) -> Mapping[str, Path]:
    """The job's own log files (stdout, stderr) in the submitit folder."""
    return {"stdout": Path(job.paths.stdout), "stderr": Path(job.paths.stderr)}


def log_tail(path: Path, lines: int = 20, max_bytes: int = 16384) -> list[str]:
    """The last lines of a job's log (empty when it has none yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]
