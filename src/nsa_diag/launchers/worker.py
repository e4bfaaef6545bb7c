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
from nsa_diag.launchers.base import Ending, Launcher, Unit, python_env, worker_env
from nsa_diag.records import StopReport
from nsa_diag.spec import CaseResult
from nsa_diag.stopping import ProcessTree, stop_tree
from nsa_diag.watchdog import ProcessHandle, catches_sigusr1


def worker_argv(case_dir: Path) -> list[str]:
    # -P: the working directory is not put on sys.path (see `worker_env`'s PYTHONSAFEPATH)
    return [sys.executable, "-P", "-m", "nsa_diag.worker", str(case_dir)]


class WorkerLauncher(Launcher):
    """One worker process in the case folder (the default for a spec without ``ddp``)."""

    def command(self, case_dir: Path) -> list[str]:
        return worker_argv(case_dir)

    def replay_argv(self, case_dir: Path, argv: Sequence[str]) -> list[str]:
        # replay.sh runs from anywhere: the case folder as an absolute path
        return worker_argv(case_dir.resolve())

    def replay_env(self, case_dir: Path) -> dict[str, str]:
        return worker_env(self.spec)

    def child_env(self, case_dir: Path, extra_env: Mapping[str, str] | None) -> dict[str, str]:
        return python_env(self.spec, extra_env)

    def units(self, case_dir: Path) -> list[Unit]:
        return [Unit(0, case_dir, case_dir / artifacts.BEACON)]

    def sample_targets(self, units: Sequence[Unit]) -> dict[int, ProcessHandle]:
        assert self.proc is not None
        return {0: self.proc}

    def stop(self) -> StopReport:
        if self.proc is None:
            return StopReport(started=False)
        return stop_tree(ProcessTree([self.proc.pid]), self.proc)

    def combine(self, end: Ending) -> CaseResult:
        return end.per_unit[0]

    def sample_on_interrupt(self, case_dir: Path) -> bool:
        """A user's Ctrl-C on a hung run wants to see where it was: one sample, when the worker can answer."""
        proc = self.proc
        if proc is None or proc.poll() is not None or not catches_sigusr1(proc.pid):
            return False
        path = case_dir / artifacts.STACKS
        return stacks.take_sample(proc.pid, case_dir, path, 1, None, note="nsa-diag interrupted") is not None
