"""`nsa-diag watch`: the spec of a user's command, and the plan that runs it as one case.

`build_watch_spec` checks the command line (a command after ``--`` that exists, a sane ``--timeout``)
and records the command, its directory and its environment (env.json's names, secrets withheld) in a
`CaseSpec` whose ``command`` is set. `WatchPlan` runs it through the session (`Session.run_case`, the one
executor) with `nsa_diag.launchers.command.CommandLauncher`; its ``replay.sh`` runs the same
``nsa-diag watch`` again, from any directory. The job's own output streams to the terminal (its stdout
to stderr under ``--json``, which keeps stdout for the summary); between its lines, now and then, a status
line of nsa-diag's on stderr (`nsa_diag.session.status.JobStatus`: step, rate, trend, ETA, a pause).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nsa_diag.cases import CaseOptions, check_output, parse_stall, validate_spec
from nsa_diag.errors import EXIT_HANG, UsageError
from nsa_diag.launchers.command import CommandLauncher, recorded_env
from nsa_diag.redact import redact_argv
from nsa_diag.session.core import Session, read_result
from nsa_diag.session.plans import CaseList
from nsa_diag.session.status import JobStatus
from nsa_diag.spec import CaseSpec

if TYPE_CHECKING:
    from nsa_diag.summary import RunSummary

USAGE = "nsa-diag watch [OPTIONS] -- CMD [ARGS...]"


# Linux runs a script through its #! line, nested this deep at most (the kernel's BINPRM_MAX_RECURSION)
MAX_INTERPRETERS = 4
ELF_MAGIC = b"\x7fELF"
BINFMT_MISC = Path("/proc/sys/fs/binfmt_misc")


def _check_command(argv: Sequence[str]) -> None:
    """The command can start as the kernel will start it: a `UsageError` (one line) before any run folder
    exists, rather than a run folder whose job "failed" (issue 27: a missing #! interpreter, a file of no
    executable format, an argument the run folder cannot record)."""
    if not argv:
        raise UsageError(f"watch: no command after --; usage: {USAGE}")
    for i, word in enumerate(argv):
        try:
            word.encode("utf-8")
        except UnicodeEncodeError:
            what = "the command" if i == 0 else f"argument {i} of the command"
            raise UsageError(
                f"watch: {what}, {os.fsencode(word)!r}, is not valid UTF-8: nsa-diag records the command as "
                "text; pass it in UTF-8, or from a script"
            ) from None
    exe = argv[0]
    if os.sep in exe:
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise UsageError(f"watch: {exe}: no such executable file")
        path = exe
    else:
        found = shutil.which(exe)
        if found is None:
            raise UsageError(f"watch: {exe}: command not found (not on PATH)")
        path = found
    _check_exec_format(exe, path, depth=0)


def _check_exec_format(named: str, path: str, depth: int) -> None:
    """`path` (the command `named`) is a binary or a script whose #! interpreter can start. An unreadable
    file (execute-only) is left to the kernel, as is any format binfmt_misc may run."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)  # the kernel reads at most this much of a #! line (BINPRM_BUF_SIZE)
    except OSError:
        return
    if head.startswith(ELF_MAGIC) or sys.platform != "linux":
        return
    if not head.startswith(b"#!"):
        if _binfmt_misc_handlers():
            return
        raise UsageError(
            f"watch: {named}: not a program the system can run (no #! line, not a binary); "
            f"add a #! line, or name its interpreter: -- sh {named}"
        )
    line = head[2:].split(b"\n", 1)[0].strip(b" \t")
    interpreter, _, arg = (part.decode(errors="surrogateescape") for part in line.partition(b" "))
    arg = arg.strip(" \t")
    if not interpreter:
        raise UsageError(f"watch: {named}: its #! line names no interpreter")
    if not os.path.exists(interpreter):
        raise UsageError(f"watch: {named}: its #! interpreter {interpreter} does not exist")
    if not (os.path.isfile(interpreter) and os.access(interpreter, os.X_OK)):
        raise UsageError(f"watch: {named}: its #! interpreter {interpreter} is not executable")
    if os.path.basename(interpreter) == "env":
        program = arg.removeprefix("-S").split()[0] if arg.startswith("-S") and arg[2:].strip() else arg
        if program and not program.startswith("-") and "=" not in program and shutil.which(program) is None:
            raise UsageError(
                f"watch: {named}: its #! line runs {interpreter} {arg}: {program!r} is not on PATH"
            )
    if depth + 1 < MAX_INTERPRETERS:
        _check_exec_format(named, interpreter, depth + 1)


def _binfmt_misc_handlers() -> bool:
    """Whether binfmt_misc has formats registered here (Java, Wine, QEMU): the kernel may run more than
    binaries and #! scripts."""
    try:
        return any(p.name not in ("register", "status") for p in BINFMT_MISC.iterdir())
    except OSError:
        return False


def build_watch_spec(
    options: CaseOptions, argv: Sequence[str], *, keep_alive: bool, total_steps: int | None
) -> CaseSpec:
    """The case of ``nsa-diag watch ... -- argv``; a `UsageError` (exit 2, one line) for bad input."""
    _check_command(argv)
    if options.timeout is not None and not 0 < options.timeout < math.inf:
        raise UsageError(f"--timeout {options.timeout:g}: give a positive, finite number of seconds")
    check_output(options.out, options.tag)  # as `run` and `attach`: a tag names a folder, no `../`
    command = {
        "argv": tuple(argv),
        "cwd": os.getcwd(),
        "env": recorded_env(os.environ),
        "keep_alive": keep_alive,
        "total_steps": total_steps,
        "straggler_ratio": options.straggler_ratio,
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


class WatchPlan(CaseList):
    """The one case of ``nsa-diag watch``, run through the session with the user's command as its launcher:
    the job's stdout streams to the terminal (to stderr under the session's ``--json``); its replay.sh
    runs the same ``nsa-diag watch`` again (`nsa_diag.cases.replay_argv`)."""

    stopped = "the watched job was stopped"

    def __init__(self, spec: CaseSpec) -> None:
        assert spec.command is not None
        super().__init__("watch", [spec])
        self.spec = spec

    def begin(self, session: Session) -> None:
        assert self.spec.command is not None
        argv = redact_argv(self.spec.command.argv)
        session.note(f"nsa-diag watch: {' '.join(argv)} -> {session.case_dir(self.spec.name)}")

    def exit_code(self, summary: RunSummary) -> int:
        """`EXIT_HANG` when the job hung, else the usual code (0 pass, 1 any other verdict, 130)."""
        hung = any(r.verdict == "hang" for r in self._results)
        return EXIT_HANG if hung and summary.exit_code == 1 else summary.exit_code

    def execute(self, session: Session) -> None:
        echo = sys.stderr.buffer if session.json_output else None
        launcher = CommandLauncher(self.spec, echo_stdout=echo)
        assert self.spec.command is not None
        status = JobStatus(sys.stderr, total_steps=self.spec.command.total_steps)
        try:
            self._results.append(session.run_case(self.spec, launcher=launcher, on_progress=status))
        except KeyboardInterrupt:  # the runner wrote the stopped job's result.json
            found = read_result(session.case_dir(self.spec.name))
            self._results = [found] if found is not None else []
            raise
        finally:
            status.close()
