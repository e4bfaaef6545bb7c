"""Stopping a tree of processes: the one routine every stop of the toolkit runs.

`stop_tree` ends a `ProcessTree` in four steps, and says what it took in a `nsa_diag.records.StopReport`:

1. SIGTERM, when anything of the tree (or the ``proc`` it was started as) is alive: to each of the tree's
   process groups that still has a member (``killpg``: a process forked meanwhile gets it too) and to each
   of its live processes;
2. a grace period (``grace_s``) for all of them to end;
3. SIGKILL, round after round (`KILL_ROUNDS`), to whatever of the tree is still alive, looked up again at
   each round (a child started while its parent was dying is found);
4. ``proc`` reaped (`REAP_S`), and the survivors named (none should be).

A `ProcessTree` is what one stop ends, found afresh at each step from ``/proc``: the members of its process
groups and sessions (a job started with ``start_new_session``: its own), the processes given (a launcher's
handles, a psutil ``Process`` or anything with ``pid`` and ``is_running()``, or bare pids), with
``follow`` every descendant of those and the members of any group or session one of them leads (torchrun's
ranks and a user's DataLoader workers live in sessions of their own), and what ``find`` returns (the
guardian's sweep: the processes marked with a case's folder). A process once found stays in the tree while
it lives, however it is reparented; a pid is signalled only while it is the process that was found (same
start time), never a newcomer that took the number.

Its callers: our worker (`nsa_diag.launchers.worker`: its session), torchrun and its ranks
(`nsa_diag.launchers.torchrun`), a user's command under ``watch`` (`nsa_diag.launchers.command`), the
pre-flight of ``--model`` and the sweep by a case's marker (`nsa_diag.guard`, in nsa-diag and in the
guardian).

Standard library only when imported: the guardian process imports this module and starts in a fraction of
a second; `StopReport` (pydantic) is imported by `stop_tree` when it reports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from nsa_diag.records import StopReport

GRACE_S = 3.0  # SIGTERM to SIGKILL: our worker flushes its files and exits well within it
ROUND_S = 0.05  # how often the grace period looks, and the pause between SIGKILL rounds
KILL_ROUNDS = 50  # 2.5 s of SIGKILL rounds: a process in uninterruptible sleep dies when it wakes
REAP_S = 5.0  # how long the process started as the job is waited for after the SIGKILL
PROC = "/proc"


class Handle(Protocol):
    """A process seen earlier, that knows whether it is still the same one (psutil's ``Process``)."""

    @property
    def pid(self) -> int: ...

    def is_running(self) -> bool: ...


class _Stat(NamedTuple):
    state: str
    ppid: int
    pgrp: int
    session: int
    start: int  # clock ticks after boot: with the pid, which process this is


def _stat(pid: int) -> _Stat | None:
    """``/proc/<pid>/stat``'s fields that say where a process belongs; None when it is gone."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rpartition(b")")[2].split()  # the command name may hold spaces and parentheses
    try:
        return _Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def _table() -> dict[int, _Stat]:
    """Every process of the machine that is not a zombie, and where it belongs."""
    table = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir(PROC):
            if entry.isdigit():
                stat = _stat(int(entry))
                if stat is not None and stat.state != "Z":
                    table[int(entry)] = stat
    return table


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    stat = _stat(pid)
    return stat is not None and stat.state != "Z"


class ProcessTree:
    """The processes one stop ends, looked up afresh at each step (module docstring)."""

    def __init__(
        self,
        groups: Iterable[int] = (),
        pids: Iterable[int | Handle] = (),
        *,
        follow: bool = False,
        find: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        given = list(pids)
        self.groups = set(groups)
        self.handles = [p for p in given if not isinstance(p, int)]
        self.pids = {p for p in given if isinstance(p, int)}
        self.follow = follow
        self.find = find
        self.known: dict[int, int] = {}  # pid -> start time of every process found
        self.seen: set[int] = set()  # every pid found so far (the guardian's sweep names them)

    def live(self) -> list[int]:
        """The tree's live processes now (this process never among them)."""
        extra = list(self.find()) if self.find else []
        if self.groups or self.follow:
            table = _table()
        else:  # the processes given and found only (the sweep's): no need to read every process's
            pids = {*self.known, *self.pids, *(h.pid for h in self.handles), *extra}
            table = {p: s for p in pids if (s := _stat(p)) is not None and s.state != "Z"}
        found = {p for p, s in table.items() if s.pgrp in self.groups or s.session in self.groups}
        found |= {p for p, start in self.known.items() if p in table and table[p].start == start}
        found |= {p for p in self.pids if p in table and p not in self.known}
        found |= {
            h.pid for h in self.handles if h.pid in table and h.pid not in self.known and h.is_running()
        }
        found |= {p for p in extra if p in table}
        if self.follow:
            children: dict[int, list[int]] = {}
            for pid, stat in table.items():
                children.setdefault(stat.ppid, []).append(pid)
            while True:
                led = {s for p in found for s in (table[p].pgrp, table[p].session) if s == p}
                self.groups |= led
                more = {p for p, s in table.items() if s.pgrp in self.groups or s.session in self.groups}
                more |= {c for p in found for c in children.get(p, ())}
                if more <= found:
                    break
                found |= more
        found.discard(os.getpid())
        self.known.update({p: table[p].start for p in found if p not in self.known})
        self.seen |= found
        return sorted(found)

    def signal(self, sig: signal.Signals, pids: Iterable[int]) -> None:
        """``sig`` to each group with a member among ``pids``, and to each of ``pids`` still the process
        that was found."""
        pids = list(pids)
        stats = {p: _stat(p) for p in pids}
        for group in self.groups & {s.pgrp for s in stats.values() if s is not None}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        for pid, stat in stats.items():
            if stat is not None and stat.start == self.known.get(pid, stat.start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)


def stop_tree(
    tree: ProcessTree,
    proc: subprocess.Popen[bytes] | None = None,
    grace_s: float = GRACE_S,
    *,
    name_signalled: bool = False,
) -> StopReport:
    """SIGTERM, ``grace_s``, SIGKILL, reap (module docstring); what it took. ``proc``: the process the job
    was started as (waited for, reaped, its exit code reported; None: the tree has no such process, as a
    sweep's); ``name_signalled``: the report names the processes the SIGTERM went to."""
    from nsa_diag.records import StopReport  # here: the guardian starts without pydantic (module docstring)

    def running() -> bool:
        return proc is not None and proc.poll() is None

    if proc is not None:
        tree.pids.add(proc.pid)  # unreaped until the end: its pid is no one else's
    report = StopReport(sigterm=False, sigkill=False)
    targets = tree.live()
    if running() or targets:
        report.sigterm = True
        if name_signalled:
            report.signalled = targets
        tree.signal(signal.SIGTERM, targets)
        deadline = time.monotonic() + grace_s
        pause = ROUND_S / 8  # most processes end within milliseconds of the SIGTERM: look soon, then less
        while time.monotonic() < deadline and (running() or tree.live()):
            time.sleep(pause)
            pause = min(2 * pause, ROUND_S)
    left = False  # whether anything was still alive after the last SIGKILL round
    for _ in range(KILL_ROUNDS):
        targets = tree.live()
        if not running() and not targets:
            break
        report.sigkill = True
        tree.signal(signal.SIGKILL, targets)
        time.sleep(ROUND_S)
    else:
        left = True
    if proc is not None:
        try:
            proc.wait(timeout=REAP_S)
        except subprocess.TimeoutExpired:
            report.unreaped = proc.pid
        report.exit_code = proc.returncode
    survivors = tree.live() if left else []
    if survivors:
        report.survivors = survivors
    return report
