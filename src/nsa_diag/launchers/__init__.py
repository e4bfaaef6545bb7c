"""Launchers: how a case's job starts, which processes and beacons it has, and how it stops (`base`).

`WorkerLauncher` runs our worker (one process), `TorchrunLauncher` the case on N ranks through torchrun.
"""

from __future__ import annotations

from nsa_diag.launchers.base import Launcher, Unit, pinned_env
from nsa_diag.launchers.torchrun import TorchrunLauncher
from nsa_diag.launchers.worker import WorkerLauncher
from nsa_diag.spec import CaseSpec


def default_launcher(spec: CaseSpec) -> Launcher:
    """torchrun for a spec with ``ddp`` (`nsa-diag ddp`), else our worker."""
    return TorchrunLauncher(spec) if spec.ddp is not None else WorkerLauncher(spec)


__all__ = ["Launcher", "TorchrunLauncher", "Unit", "WorkerLauncher", "default_launcher", "pinned_env"]
