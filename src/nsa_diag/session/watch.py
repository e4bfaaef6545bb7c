"""`nsa-diag watch`: the spec of a user's command, and the plan that runs it as one case.

`build_watch_spec` checks the command line (a command after ``--`` that exists, a sane ``--timeout``)
and records the command, its directory and its environment (env.json's names, secrets withheld) in a
`CaseSpec` whose ``command`` is set. `WatchPlan` runs it through the one executor
(`nsa_diag.executor.run_case`) with `nsa_diag.launchers.command.CommandLauncher`; its ``replay.sh`` runs
the same ``nsa-diag watch`` again, from any directory. No live display: the job's own output streams to
the terminal (its stdout to stderr under ``--json``, which keeps stdout for the summary).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from nsa_diag.cases import CaseOptions, check_output, parse_stall, validate_spec
from nsa_diag.errors import UsageError
from nsa_diag.executor import run_case
from nsa_diag.launchers.command import CommandLauncher, recorded_env
from nsa_diag.redact import redact_argv
from nsa_diag.session.core import Session
from nsa_diag.session.plans import CaseList
from nsa_diag.spec import CaseSpec

USAGE = "nsa-diag watch [OPTIONS] -- CMD [ARGS...]"


def _check_command(argv: Sequence[str]) -> None:
    if not argv:
        raise UsageError(f"watch: no command after --; usage: {USAGE}")
    exe = argv[0]
    if os.sep in exe:
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise UsageError(f"watch: {exe}: no such executable file")
    elif shutil.which(exe) is None:
        raise UsageError(f"watch: {exe}: command not found (not on PATH)")


def build_watch_spec(
    options: CaseOptions, argv: Sequence[str], *, keep_alive: bool, total_steps: int | None
) -> CaseSpec:
    """The case of ``nsa-diag watch ... -- argv``; a `UsageError` (exit 2, one line) for bad input."""
    _check_command(argv)
    if not 0 < options.timeout < math.inf:
        raise UsageError(f"--timeout {options.timeout:g}: give a positive, finite number of seconds")
    check_output(options.out, options.tag)  # as `run` and `attach`: a tag names a folder, no `../`
    command = {
        "argv": tuple(argv),
        "cwd": os.getcwd(),
        "env": recorded_env(os.environ),
        "keep_alive": keep_alive,
        "total_steps": total_steps,
    }
    return validate_spec(
        {
            "name": options.name,
            "stall": parse_stall(options.stall),
            "timeout": options.timeout,
            "command": command,
            "branch_marks": options.branch_marks,
        }
    )


def watch_replay_argv(spec: CaseSpec, out: Path) -> list[str]:
    """``nsa-diag watch`` with this spec's options and command, for replay.sh."""
    cmd = spec.command
    assert cmd is not None
    argv = [sys.executable, "-m", "nsa_diag", "watch", "--name", spec.name, "--out", str(out.resolve())]
    argv += ["--stall", str(spec.stall), "--timeout", f"{spec.timeout:g}"]
    if cmd.keep_alive:
        argv.append("--keep-alive")
    if cmd.total_steps:
        argv += ["--total-steps", str(cmd.total_steps)]
    if spec.branch_marks:
        argv.append("--branch-marks")
    return [*argv, "--", *cmd.argv]


class WatchPlan(CaseList):
    """The one case of ``nsa-diag watch``, run with the user's command as its launcher."""

    stopped = "the watched job was stopped"

    def __init__(self, spec: CaseSpec, *, out: Path, tag: str | None, json_output: bool) -> None:
        super().__init__("watch", [spec])
        self.spec = spec
        self.out = Path(out)
        self.json_output = json_output

    def begin(self, session: Session) -> None:
        assert self.spec.command is not None
        argv = redact_argv(self.spec.command.argv)
        session.note(f"nsa-diag watch: {' '.join(argv)} -> {session.case_dir(self.spec.name)}")

    def execute(self, session: Session) -> None:
        echo = sys.stderr.buffer if self.json_output else None
        launcher = CommandLauncher(self.spec, watch_replay_argv(self.spec, self.out), echo_stdout=echo)
        case_dir = session.case_dir(self.spec.name)
        try:
            self._results.append(run_case(self.spec, case_dir, launcher))
        except KeyboardInterrupt:
            from nsa_diag.session.core import read_result

            found = read_result(case_dir)
            self._results = [found] if found is not None else []
            raise
