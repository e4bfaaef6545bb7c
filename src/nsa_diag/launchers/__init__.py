"""Launchers: how a case's job starts, which processes and beacons it has, and how it stops; the job
protocol the executor talks to (`base`: `Launcher` and its records).

`WorkerLauncher` runs our worker (one process), `TorchrunLauncher` the case on N ranks through torchrun,
`NodeLauncher` one node's part of a multi-node case (`nsa_diag.launchers.nodes`).
"""

from __future__ import annotations

from nsa_diag.launchers.base import (
    Ending,
    Evidence,
    JobEnd,
    Launcher,
    LaunchPlan,
    Stage,
    Unit,
    dataloader_workers,
    observed_units,
    pinned_env,
)
from nsa_diag.launchers.nodes import NodeLauncher
from nsa_diag.launchers.torchrun import TorchrunLauncher
from nsa_diag.launchers.worker import WorkerLauncher
from nsa_diag.spec import CaseSpec


def default_launcher(spec: CaseSpec) -> Launcher:
    """torchrun for a spec with ``ddp`` (`nsa-diag ddp`; this node's part when it has several nodes), else
    our worker."""
    if spec.ddp is not None and spec.ddp.nnodes > 1:
        return NodeLauncher(spec)
    return TorchrunLauncher(spec) if spec.ddp is not None else WorkerLauncher(spec)


__all__ = [
    "Ending",
    "Evidence",
    "JobEnd",
    "LaunchPlan",
    "Launcher",
    "NodeLauncher",
    "Stage",
    "TorchrunLauncher",
    "Unit",
    "WorkerLauncher",
    "dataloader_workers",
    "default_launcher",
    "observed_units",
    "pinned_env",
]
