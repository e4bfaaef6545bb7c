"""A job's stdout.log and stderr.log, capped: a small process between the job's output and its logs.

A job may print without end (a loop that logs every batch) on a disk with little room. Its output goes to
a pipe each; ``python -m nsa_diag.logcap`` reads them and writes each log as its **head** (the first
`LOG_HEAD` bytes, as they come) and its **tail** (the last `LOG_TAIL` bytes, kept in memory and written
after a marker line that says how many bytes were dropped between them: when the stream ends, and whenever
it has been quiet for `IDLE_FLUSH_S`). A log also stops growing while its file system has less than
`LOG_RESERVE` free, so that the case's own files (result.json, the evidence, the summary) still have room;
its marker then says so. While nsa-diag runs, what the job prints is also copied to nsa-diag's terminal.

It is a process of its own, in a session of its own, so that the logs outlive nsa-diag: a job left running
by ``watch --keep-alive`` keeps printing into them (no pipe breaks), and a job whose nsa-diag was killed
still gets its tail written. It reads a third pipe whose only write end is nsa-diag's: when that closes
(`LogPump.detach`, or nsa-diag ended) it stops copying to the terminal. It exits when every process that
holds the job's output has closed it (the job ended, and everything it started).

Standard library only (it starts in a fraction of a second); it writes nothing but the logs, which are the
job's own output, as it printed them (`nsa_diag.artifacts` writes every other file).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

LOG_HEAD = 8 * 2**20  # bytes kept from a log's start
LOG_TAIL = 8 * 2**20  # bytes kept from its end
# Left free on the log's file system for the case's own files: the largest seen are a few MiB of stacks and
# py-spy dumps of a many-process job, and a run folder is refused below 16 MiB free (`artifacts`).
LOG_RESERVE = 4 * 2**20
IDLE_FLUSH_S = 0.3  # a quiet stream has its tail written out (a reader after the job ends sees it) ...
FLUSH_EVERY_S = 2.0  # ... at most this often: each time rewrites the whole tail (up to `LOG_TAIL`)
CHUNK = 65536
LOG_DRAIN_S = 3.0  # how long the case waits for the logs' last bytes once its processes are stopped


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


class CappedLog:
    """One log file: its head written as it comes, then its tail kept in memory (module docstring)."""

    def __init__(self, path: Path, head: int = LOG_HEAD, tail: int = LOG_TAIL, reserve: int = LOG_RESERVE):
        self.path = Path(path)
        self.head, self.tail_cap, self.reserve = head, tail, reserve
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.start = os.fstat(self.fd).st_size  # what an earlier run of the case left stays
        self.written = 0  # bytes of the head on disk
        self.seen = 0  # bytes the job wrote
        self.head_full = False
        self.why: str | None = None  # why the head ended before `head` bytes: disk space, a failed write
        self.tail = bytearray()
        self.tail_dirty = False
        self.last_byte = b"\n"

    def _room(self) -> int:
        """Bytes this log may still add before its file system has less than `reserve` free."""
        try:
            st = os.fstatvfs(self.fd)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize - self.reserve

    def write(self, data: bytes) -> None:
        self.seen += len(data)
        if not self.head_full:
            n = min(len(data), self.head - self.written)
            room = self._room()
            if room < n:
                n, self.head_full = max(room, 0), True
                self.why = f"its file system had less than {_mib(self.reserve)} free"
            try:
                done = os.write(self.fd, data[:n]) if n else 0
            except OSError as exc:
                done, self.head_full = 0, True
                self.why = f"writing it failed: {exc.strerror or exc}"
            self.written += done
            if done:
                self.last_byte = data[done - 1 : done]
            data = data[done:]
            if not data:
                return
            self.head_full = True
        self.tail += data
        if len(self.tail) > 2 * self.tail_cap:  # trimmed now and then: each trim moves the whole tail
            del self.tail[: -self.tail_cap]
        self.tail_dirty = True

    def flush(self) -> None:
        """Write the marker line and the tail after the head (again: what was there is replaced)."""
        if not self.tail_dirty:
            return
        self.tail_dirty = False
        tail = bytes(self.tail[-self.tail_cap :]) if self.tail_cap else b""
        try:
            os.ftruncate(self.fd, self.start + self.written)
        except OSError:
            return
        room = max(self._room() - 200, 0)
        if len(tail) > room:
            tail = tail[len(tail) - room :] if room else b""
            self.why = self.why or f"its file system had less than {_mib(self.reserve)} free"
        dropped = self.seen - self.written - len(tail)
        why = f"; {self.why}" if self.why else ""
        marker = (
            f"[nsa-diag: {dropped} bytes of output dropped here; this log keeps the first "
            f"{_mib(self.written)} and the last {_mib(len(tail))}{why}]\n"
        ).encode()
        if self.last_byte != b"\n":
            marker = b"\n" + marker
        with contextlib.suppress(OSError):
            os.write(self.fd, marker + tail)

    def close(self) -> None:
        self.flush()
        os.close(self.fd)


def _echo(fd: int | None, data: bytes) -> int | None:
    """Copy ``data`` to nsa-diag's terminal; None once that fails (the terminal closed)."""
    if fd is None:
        return None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        return None
    return fd


def pump(streams: Sequence[tuple[int, Path, int | None]], control: int) -> int:
    """The process's body: copy each (input fd, log, echo fd or None) until every input has ended."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # nsa-diag's to handle; the job's output still ends here
    logs = {fd: CappedLog(path) for fd, path, _ in streams}
    echo: dict[int, int | None] = {fd: to for fd, _, to in streams}
    open_control: int | None = control
    flushed = time.monotonic()
    while logs:
        watched = [*logs, *([open_control] if open_control is not None else [])]
        try:
            ready, _, _ = select.select(watched, [], [], IDLE_FLUSH_S)
        except InterruptedError:
            continue
        if not ready:
            if time.monotonic() - flushed >= FLUSH_EVERY_S:
                flushed = time.monotonic()
                for log in logs.values():
                    log.flush()
            continue
        for fd in ready:
            try:
                data = os.read(fd, CHUNK)
            except OSError:
                data = b""
            if fd == open_control:  # nsa-diag let go (or ended): the terminal is no longer ours
                if not data:
                    open_control = None
                    echo = dict.fromkeys(echo)
                continue
            if not data:
                logs.pop(fd).close()
                continue
            logs[fd].write(data)
            echo[fd] = _echo(echo[fd], data)
    return 0


class LogPump:
    """nsa-diag's handle on the log process of one job: the pipes the job writes to (`job_fds`)."""

    def __init__(self, logs: Sequence[tuple[Path, int | None]]) -> None:
        """``logs``: each log's path and the descriptor its copy goes to while nsa-diag runs (None: none).
        Raises OSError when the process cannot start (the caller then writes the logs directly)."""
        self.job_fds: list[int] = []
        passed: list[int] = []
        args: list[str] = []
        control_read, self.control = os.pipe()
        passed.append(control_read)
        try:
            for path, echo in logs:
                read_end, write_end = os.pipe()
                self.job_fds.append(write_end)
                passed.append(read_end)
                echo_fd = -1
                if echo is not None:
                    echo_fd = os.dup(echo)
                    passed.append(echo_fd)
                args += [str(read_end), os.path.abspath(path), str(echo_fd)]
            env = dict(os.environ)
            env.pop("NSA_DIAG_CASE", None)  # not the case's: a sweep must not stop it before it drains
            root = str(Path(__file__).resolve().parents[1])
            paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            env["PYTHONPATH"] = os.pathsep.join([root, *paths])
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nsa_diag.logcap", str(control_read), *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=passed,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            for fd in self.job_fds:
                os.close(fd)
            os.close(self.control)
            raise
        finally:
            for fd in passed:
                os.close(fd)

    def started(self) -> None:
        """The job has its copies of the pipes: ours are closed, so the logs end when the job's do."""
        for fd in self.job_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.job_fds = []

    def detach(self) -> None:
        """Stop copying to the terminal; the logs go on as long as the job prints (``--keep-alive``)."""
        self.started()
        if self.control >= 0:
            with contextlib.suppress(OSError):
                os.close(self.control)
            self.control = -1

    def finish(self, timeout: float = LOG_DRAIN_S) -> bool:
        """The job's processes are stopped: wait for the logs' last bytes; whether the process ended (one
        of the job that is still alive holds its output: its tail is written whenever it goes quiet)."""
        self.detach()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


def _main(argv: Sequence[str]) -> int:
    control, rest = int(argv[0]), list(argv[1:])
    streams = []
    for i in range(0, len(rest), 3):
        echo = int(rest[i + 2])
        streams.append((int(rest[i]), Path(rest[i + 1]), echo if echo >= 0 else None))
    return pump(streams, control)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
