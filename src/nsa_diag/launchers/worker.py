"""Our own worker: ``python -m nsa_diag.worker <case_dir>``, one process and one beacon in the case folder.

The worker (`nsa_diag.worker.main`) registers faulthandler for SIGUSR1 into ``stacks.txt``, reports
progress into ``beacon.bin`` and ``progress.jsonl``, and writes ``worker_result.json``. It is the only
process of its session, so stopping it is `nsa_diag.stopping.stop_tree` on that session, and the case's
result is its one unit's result.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from nsa_diag import artifacts
from nsa_diag.evidence import stacks
from nsa_diag.launchers.base import (
    Evidence,
    JobEnd,
    Launcher,
    LaunchPlan,
    Stage,
    Unit,
    classified,
    python_env,
    worker_env,
)
from nsa_diag.records import StopReport
from nsa_diag.spec import CaseResult
from nsa_diag.stopping import ProcessTree, stop_tree
from nsa_diag.watchdog import catches_sigusr1


def worker_argv(case_dir: Path) -> list[str]:
    # -P: the working directory is not put on sys.path (see `worker_env`'s PYTHONSAFEPATH)
    return [sys.executable, "-P", "-m", "nsa_diag.worker", str(case_dir)]


class WorkerLauncher(Launcher):
    """One worker process in the case folder (the default for a spec without ``ddp``)."""

    def plan(self, case_dir: Path, extra_env: Mapping[str, str] | None) -> LaunchPlan:
        return LaunchPlan(
            home=self.home(case_dir),
            argv=worker_argv(case_dir),
            env=python_env(self.spec, extra_env),
            replay_argv=worker_argv(case_dir.resolve()),  # replay.sh runs from anywhere
            replay_env=worker_env(self.spec),
        )

    def units(self, case_dir: Path) -> list[Unit]:
        return [Unit(0, case_dir, case_dir / artifacts.BEACON)]

    def evidence(self, case_dir: Path, stage: Stage, units: Sequence[Unit] = ()) -> Evidence:
        """At an interrupt, a user's Ctrl-C on a hung run wants to see where it was: one sample, when the
        worker can answer."""
        if stage is not Stage.INTERRUPTED:
            return super().evidence(case_dir, stage, units)
        proc = self.proc
        if proc is None or proc.poll() is not None or not catches_sigusr1(proc.pid):
            return Evidence()
        path = case_dir / artifacts.STACKS
        taken = stacks.take_sample(proc.pid, case_dir, path, 1, None, note="nsa-diag interrupted")
        return Evidence(sampled=taken is not None)

    def stop_processes(self) -> StopReport:
        assert self.proc is not None
        return stop_tree(ProcessTree([self.proc.pid]), self.proc)

    def outcome(self, end: JobEnd) -> CaseResult:
        return classified(self.spec, end).per_unit[0]
