"""torchrun's restarts of a job's ranks (``--max-restarts N``), read from the job's stderr (pure: text in,
facts out).

torchrun logs at ERROR level, each time a worker group fails, "failed (exitcode: 1) local_rank: 1 (pid:
4242) of binary: ..." (the first failure of that attempt), then starts the ranks again while restarts are
left. Each rank process of attempt ``k`` has ``TORCHELASTIC_RESTART_COUNT=k`` (the probe records it), so
a job whose probed ranks reached count ``n`` was restarted ``n`` times, and its first ``n`` failure lines
are where attempts 1..n ended; the text after the n-th is the last attempt's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ATTEMPT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


@dataclass(frozen=True)
class AttemptEnd:
    """One failure line of torchrun: the attempt's first failed process and its exit code (negative: the
    signal that ended it), and the text of that attempt (the stderr from the previous end to this one)."""

    exit_code: int
    local_rank: int
    pid: int
    text: str


def split_attempts(text: str, restarts: int) -> tuple[list[AttemptEnd], str]:
    """The ends of the first ``restarts`` attempts in the job's stderr ``text`` (fewer where torchrun's
    lines were not kept) and the text of the attempt after them."""
    ends: list[AttemptEnd] = []
    start = 0
    for found in ATTEMPT_FAILED.finditer(text):
        if len(ends) == restarts:
            break
        line_end = text.find("\n", found.end())
        line_end = len(text) if line_end < 0 else line_end + 1
        code, local_rank, pid = (int(g) for g in found.groups())
        ends.append(AttemptEnd(code, local_rank, pid, text[start : found.start()]))
        start = line_end
    return ends, text[start:]
