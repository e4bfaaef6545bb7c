"""Process evidence from ``/proc`` (Linux): state, CPU time and kernel wait channel of a case's processes.

What the kernel says about a wedged process needs nothing from the process: ``State`` (R running,
S sleeping, D uninterruptible), user and system CPU time (their growth between two stack samples is the
CPU% that tells a busy loop from a blocked wait), and ``wchan``, the kernel function a sleeping thread
waits in (``futex_wait_queue``: a lock or condition; ``hrtimer_nanosleep``: a sleep; ``pipe_read``: I/O).
Every reader returns what it could read and never raises for a process that has gone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TypedDict

from nsa_diag.redact import redact_argv

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
STATUS_FIELDS = (
    "Name", "State", "Tgid", "PPid", "Threads", "VmPeak", "VmSize", "VmHWM", "VmRSS", "VmSwap",
    "SigBlk", "SigIgn", "SigCgt", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches",
)  # fmt: skip
STATE_NAMES = {
    "R": "running", "S": "sleeping", "D": "disk sleep", "Z": "zombie", "T": "stopped",
    "t": "tracing stop", "X": "dead", "I": "idle",
}  # fmt: skip


class Stat(TypedDict):
    """The fields of ``/proc/<pid>/stat`` the evidence uses (`parse_stat`)."""

    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    utime_s: float
    stime_s: float
    num_threads: int


class ThreadState(TypedDict):
    """One thread of a process: its name, state, wait channel and CPU seconds."""

    tid: int
    comm: str
    state: str
    wchan: str | None
    utime_s: float
    stime_s: float


class ProcessSnapshot(TypedDict, total=False):
    """`process_snapshot`: ``{"pid", "gone": True}`` for a process that has exited, else its command line,
    `Stat`, state name, wait channel, the `STATUS_FIELDS` of ``/proc/<pid>/status`` (the kernel's text)
    and its threads."""

    pid: int
    gone: bool
    cmdline: str
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    utime_s: float
    stime_s: float
    num_threads: int
    state_name: str
    wchan: str | None
    status: dict[str, str]
    threads: list[ThreadState]


class GroupSnapshot(TypedDict, total=False):
    """``proc.json``: every process of a case (its session), or why /proc says nothing."""

    available: bool
    why: str
    processes: list[ProcessSnapshot]


def available() -> bool:
    return (PROC / "self" / "stat").exists()


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except (OSError, ValueError):
        return None


def parse_stat(text: str) -> Stat:
    """Fields of a ``/proc/<pid>/stat`` line (the command name may hold spaces and parentheses)."""
    head, _, tail = text.rpartition(")")
    fields = tail.split()
    # fields[0] is field 3 of proc(5): state; ppid 4, pgrp 5, session 6, utime 14, stime 15, threads 20
    return Stat(
        comm=head.partition("(")[2],
        state=fields[0],
        ppid=int(fields[1]),
        pgrp=int(fields[2]),
        session=int(fields[3]),
        utime_s=int(fields[11]) / CLOCK_TICKS,
        stime_s=int(fields[12]) / CLOCK_TICKS,
        num_threads=int(fields[17]),
    )


def read_stat(pid: int, tid: int | None = None) -> Stat | None:
    """``/proc/<pid>/stat`` (or the thread's ``task/<tid>/stat``) parsed; None if the process is gone."""
    base = PROC / str(pid) if tid is None else PROC / str(pid) / "task" / str(tid)
    text = _read(base / "stat")
    if not text:
        return None
    try:
        return parse_stat(text)
    except (IndexError, ValueError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of all threads of ``pid`` so far; None if it is gone."""
    stat = read_stat(pid)
    return None if stat is None else stat["utime_s"] + stat["stime_s"]


def descendants_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each live descendant of ``pid`` (children, theirs, ...), by pid: its command name and CPU seconds so
    far (`cpu_seconds`), from every process's ``/proc/<pid>/stat``; empty without /proc."""
    stats = {p: stat for p, stat in _all_stats().items() if stat["state"] != "Z"}
    children: dict[int, list[int]] = {}
    for child, stat in stats.items():
        children.setdefault(stat["ppid"], []).append(child)
    found, todo = {}, list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        stat = stats[child]
        found[child] = (stat["comm"], stat["utime_s"] + stat["stime_s"])
        todo += children.get(child, ())
    return found


def busy_descendants(
    before: dict[int, tuple[str, float]], pid: int, wall_s: float, min_percent: float
) -> list[str]:
    """The descendants of ``pid`` but Python interpreters that used at least ``min_percent`` of a core
    since ``before`` (its `descendants_cpu` ``wall_s`` seconds ago), as "pid 4242 (cc1plus) at CPU 97%".
    A Python child is left to its own evidence (a probed process of a watched job: its frames must move;
    a busy loop on one line uses the CPU too)."""
    return descendants_work(before, pid, wall_s, min_percent)[0]


def descendants_work(
    before: dict[int, tuple[str, float]], pid: int, wall_s: float, min_percent: float, idle_limit: int = 4
) -> tuple[list[str], list[str]]:
    """`busy_descendants`, and from the same read of /proc the others: the programs (not Python: a
    DataLoader worker renames itself pt_data_worker, its command line still says python) that used less
    than ``min_percent``, as "pid 4243 `cat /mnt/backup/pipe` at CPU 0%", the innermost first, at most
    ``idle_limit``: what a process waiting for them waits on."""
    busy, idle = [], []
    for child, (comm, seconds) in sorted(descendants_cpu(pid).items()):
        if child not in before or before[child][0] != comm or is_python(comm):
            continue
        percent = cpu_percent(before[child][1], seconds, wall_s)
        if percent is None:
            continue
        if percent >= min_percent:
            busy.append(f"pid {child} ({comm}) at CPU {percent:.0f}%")
            continue
        argv = cmdline(child)
        if argv and is_python(argv[0]):
            continue
        text = " ".join(redact_argv(argv) or [comm])
        idle.append(f"pid {child} `{text if len(text) <= 80 else text[:77] + '...'}` at CPU {percent:.0f}%")
    return busy, idle[::-1][:idle_limit]


def io_bytes(pid: int) -> int | None:
    """Bytes ``pid`` has read and written so far through read/write system calls (``rchar`` + ``wchar`` of
    ``/proc/<pid>/io``: files, pipes and sockets, whether or not they reached a disk); None where /proc does
    not say (gone, or not ours to read)."""
    text = _read(PROC / str(pid) / "io")
    if not text:
        return None
    values = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(values["rchar"]) + int(values["wchar"])
    except (KeyError, ValueError):
        return None


def exe(pid: int) -> str | None:
    """The program ``pid`` runs (``/proc/<pid>/exe``, without the kernel's `` (deleted)`` mark): it changes
    when the process execs another program; None when it cannot be read (gone, another user's)."""
    try:
        return os.readlink(PROC / str(pid) / "exe").removesuffix(" (deleted)")
    except OSError:
        return None


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` as a list of words (empty when it cannot be read)."""
    text = _read(PROC / str(pid) / "cmdline") or ""
    return [word for word in text.split("\0") if word] if text else []


MAX_LOCKS = 3  # file locks named at a hang
# the kernel's wait channels of a thread blocked in flock (locks_lock_inode_wait; flock_lock_inode_wait
# before Linux 4.4) or in a POSIX lock (fcntl F_SETLKW, lockf: fcntl_setlk)
FILE_LOCK_WCHANS = ("lock_inode_wait", "fcntl_setlk", "lock_file_wait")


# a frame of the filelock package (`classify` says the wait when the frame is its acquire)
FILE_LOCK_FRAME = "/filelock/"


def waits_for_file_lock(wchan: str | None) -> bool:
    """Whether a thread's kernel wait channel is a file lock's (`FILE_LOCK_WCHANS`)."""
    return wchan is not None and any(needle in wchan for needle in FILE_LOCK_WCHANS)


def may_wait_for_file_lock(stack_texts: Iterable[str], main_wchan: str | None) -> bool:
    """Whether a process may wait for a file lock another holds, so that `held_file_locks` is worth
    reading: a frame of filelock in its stacks (which polls the lock with a sleep), or its main thread
    blocked in the kernel on one."""
    return waits_for_file_lock(main_wchan) or any(FILE_LOCK_FRAME in text for text in stack_texts)


def held_file_locks(waiter: int, locks_text: str | None = None) -> list[str]:
    """The file locks (``/proc/locks``: flock and POSIX locks) that processes other than ``waiter`` and
    this one (nsa-diag's own run-folder lock) hold, as "PATH (flock, pid N: CMD)": where ``waiter`` is
    blocked in the kernel on a lock, that lock's holders only; else all, the ``.lock`` files first; at most
    `MAX_LOCKS`. A lock's file is found among its holder's open files by device and inode
    (a holder another user runs cannot be read: its lock is left out). ``locks_text``: /proc/locks' text
    (tests)."""
    text = _read(PROC / "locks") if locks_text is None else locks_text
    lines = [line.split() for line in (text or "").splitlines()]
    # "1: FLOCK  ADVISORY  WRITE 19963 fe:00:2146672 0 EOF"; a process blocked on a lock has a line with
    # "->" after the id: only that lock's holders then
    waits = {f[6] for f in lines if len(f) >= 7 and f[1] == "->" and f[5] == str(waiter)}
    found = []
    for fields in lines:
        if len(fields) < 6 or fields[1] == "->" or not fields[4].isdigit():
            continue
        if waits and fields[5] not in waits:
            continue
        kind, pid, dev_inode = fields[1].lower(), int(fields[4]), fields[5].split(":")
        if pid in (waiter, os.getpid()) or len(dev_inode) != 3:
            continue
        try:
            major, minor, inode = int(dev_inode[0], 16), int(dev_inode[1], 16), int(dev_inode[2])
        except ValueError:
            continue
        path = _open_file(pid, major, minor, inode)
        if path is not None:
            command = " ".join(" ".join(redact_argv(cmdline(pid))).split())[:120]  # secrets withheld
            found.append(f"{path} ({kind}, pid {pid}: {command})")
    found.sort(key=lambda held: not held.split(" (", 1)[0].endswith(".lock"))
    return found[:MAX_LOCKS]


def _open_file(pid: int, major: int, minor: int, inode: int) -> str | None:
    """The path of the file ``pid`` has open on device ``major:minor`` at ``inode``, if it can be read."""
    try:
        fds = os.listdir(PROC / str(pid) / "fd")
    except OSError:
        return None
    for fd in fds:
        try:
            st = os.stat(PROC / str(pid) / "fd" / fd)
        except OSError:
            continue
        if st.st_ino == inode and (os.major(st.st_dev), os.minor(st.st_dev)) == (major, minor):
            return os.readlink(PROC / str(pid) / "fd" / fd)
    return None


def is_python(program: str) -> bool:
    """Whether an executable (a path or a name) is a Python interpreter (``python3.12``, ``pypy3``)."""
    return os.path.basename(program).startswith(("python", "pypy"))


def cpu_percent(cpu_before: float | None, cpu_after: float | None, wall_s: float) -> float | None:
    """CPU% over a wall-clock interval (100 = one core busy; threads add up)."""
    if cpu_before is None or cpu_after is None or wall_s <= 0:
        return None
    return round(100.0 * (cpu_after - cpu_before) / wall_s, 1)


def wchan(pid: int, tid: int | None = None) -> str | None:
    """The kernel function the process (thread) sleeps in; None when running or unreadable."""
    base = PROC / str(pid) if tid is None else PROC / str(pid) / "task" / str(tid)
    text = (_read(base / "wchan") or "").strip()
    return None if text in ("", "0") else text


def _all_stats() -> dict[int, Stat]:
    """Every process's ``/proc/<pid>/stat``, by pid; empty without /proc."""
    stats: dict[int, Stat] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir(PROC):
            if entry.isdigit() and (stat := read_stat(int(entry))) is not None:
                stats[int(entry)] = stat
    return stats


def session_pids(session: int) -> list[int]:
    """Every live process whose session id is ``session`` (the worker's descendants that did not setsid)."""
    return sorted(p for p, stat in _all_stats().items() if session in (stat["session"], stat["pgrp"]))


def _status(pid: int) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in (_read(PROC / str(pid) / "status") or "").splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            fields[key] = " ".join(value.split())
    return fields


def _threads(pid: int) -> list[ThreadState]:
    threads: list[ThreadState] = []
    try:
        tids = sorted(int(t.name) for t in (PROC / str(pid) / "task").iterdir() if t.name.isdigit())
    except OSError:
        return threads
    for tid in tids:
        stat = read_stat(pid, tid)
        if stat is None:
            continue
        threads.append(
            ThreadState(
                tid=tid,
                comm=stat["comm"],
                state=stat["state"],
                wchan=wchan(pid, tid),
                utime_s=stat["utime_s"],
                stime_s=stat["stime_s"],
            )
        )
    return threads


def process_snapshot(pid: int) -> ProcessSnapshot:
    """State, CPU time, wait channel and threads of ``pid`` (``{"pid", "gone": True}`` if it has exited)."""
    stat = read_stat(pid)
    if stat is None:
        return ProcessSnapshot(pid=pid, gone=True)
    cmdline = (_read(PROC / str(pid) / "cmdline") or "").replace("\0", " ").strip()
    return ProcessSnapshot(
        pid=pid,
        cmdline=cmdline,
        **stat,
        state_name=STATE_NAMES.get(stat["state"], stat["state"]),
        wchan=wchan(pid),
        status=_status(pid),
        threads=_threads(pid),
    )


def group_snapshot(session: int) -> GroupSnapshot:
    """`process_snapshot` of every process of the case (its session), for ``proc.json``."""
    if not available():
        return GroupSnapshot(available=False, why="/proc is not available on this system")
    return GroupSnapshot(available=True, processes=[process_snapshot(pid) for pid in session_pids(session)])


def main_thread(snapshot: ProcessSnapshot) -> ThreadState | None:
    """The main thread's record (tid == pid) of a `process_snapshot`."""
    for thread in snapshot.get("threads", ()):
        if thread["tid"] == snapshot.get("pid"):
            return thread
    return None
