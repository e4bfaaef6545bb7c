"""Stack evidence of a wedged worker: faulthandler samples (SIGUSR1) and py-spy dumps, taken and parsed.

The worker registers `faulthandler` for SIGUSR1 with ``all_threads=True`` into ``stacks.txt``. Its C signal
handler dumps every thread without taking the GIL, so a sample comes back also while the worker sits in C++
or holds the GIL. The handler cannot write a header, so the runner appends ``=== stack sample N at <time>``
before each signal; a fatal error (segfault, abort) dumps into the same file with no header of ours. Where
the handler writes nothing within `DUMP_START_TIMEOUT_S` (seen on a loaded GPU machine, the training thread
blocked on a lock, cause not found), `take_sample` asks the worker's heartbeat thread, when it is alive,
to dump the same way from Python (``stack.request``).

faulthandler shows Python frames only; ``py-spy dump --native`` adds the C/C++ frames (the lock, the CUDA
sync, the collective the thread is blocked in) when py-spy is on PATH (a dependency of nsa-diag; ``pip
install py-spy`` where it is missing) and ptrace of the process is permitted. `pyspy_sample` takes a dump
of the Python frames alone, for a process without a SIGUSR1 handler (`nsa-diag attach` samples it so).
Parsing is pure: `parse_faulthandler` / `parse_pyspy` turn texts into `nsa_diag.stackframes.ThreadStack`
records.
`read_stacks` is the one reader of ``stacks.txt``: its samples, its fatal-error dump and their threads
(`StackFile`), for the executor, the watchdog, the torchrun launcher and the reports alike.
"""

from __future__ import annotations

import ast
import datetime
import functools
import linecache
import os
import re
import shutil
import signal
import subprocess
import sysconfig
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from nsa_diag import artifacts
from nsa_diag.records import PyspyDump
from nsa_diag.redact import redact_argv, redact_line
from nsa_diag.stackframes import Frame, ThreadStack

SAMPLE_HEADER = "=== stack sample"
PYSPY_TIMEOUT_S = 20.0
DUMP_START_TIMEOUT_S = 3.0  # how long a sample waits for the worker's handler to start writing
PYSPY_HINT = "install it for native frames: pip install py-spy (a dependency of nsa-diag)"


PYSPY_ENV = "NSA_DIAG_PYSPY"  # the py-spy to run (a path or a name on PATH), or "none": never run one


def pyspy_exe() -> str | None:
    """The py-spy to run: `PYSPY_ENV`'s where set, else the one on PATH, else the one installed with
    nsa-diag beside this Python (a virtual environment run without activating it, pipx's, uv tool's: their
    programs are not on PATH, but py-spy is a dependency of nsa-diag and installed beside it); None where
    there is none."""
    chosen = os.environ.get(PYSPY_ENV, "").strip()
    if chosen:
        return None if chosen == "none" else shutil.which(chosen)
    return shutil.which("py-spy") or shutil.which("py-spy", path=sysconfig.get_path("scripts"))


def pyspy_missing() -> str:
    """Why no py-spy runs: switched off, or none on PATH nor beside nsa-diag's Python."""
    chosen = os.environ.get(PYSPY_ENV, "").strip()
    if chosen == "none":
        return f"py-spy is switched off ({PYSPY_ENV}=none)"
    if chosen:
        return f"{PYSPY_ENV}={chosen}: no such program; {PYSPY_HINT}"
    return f"py-spy is not on PATH, nor beside nsa-diag's Python; {PYSPY_HINT}"


_THREAD_RE = re.compile(
    r"^(?P<current>Current thread|Thread) (?P<id>0x[0-9a-fA-F]+)(?: \[(?P<name>[^\]]*)\])?"
    r" \(most recent call first\):"
)
_STACK_RE = re.compile(r"^Stack \(most recent call first\):")
_FRAME_RE = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<func>.*)$')
_FATAL_RE = re.compile(r"^Fatal Python error: (?P<what>.*)$")
_PYSPY_THREAD_RE = re.compile(r'^Thread (?P<id>\d+) \((?P<status>[^)]*)\)(?:: "(?P<name>.*)")?')
_PYSPY_FRAME_RE = re.compile(r"^\s+(?P<func>.+?) \((?P<where>[^()]*)\)$")


def parse_faulthandler(text: str) -> list[ThreadStack]:
    """The threads of one faulthandler dump (``Thread 0x...`` / ``Current thread 0x...`` blocks)."""
    threads: list[ThreadStack] = []
    header: dict[str, object] | None = None
    frames: list[Frame] = []

    def flush() -> None:
        if header is not None:
            threads.append(ThreadStack(frames=tuple(frames), **header))  # type: ignore[arg-type]

    for raw in text.splitlines():
        line = raw.rstrip()
        match = _THREAD_RE.match(line)
        if match or _STACK_RE.match(line):
            flush()
            frames = []
            header = (
                {"thread_id": match["id"], "current": match["current"] != "Thread", "name": match["name"]}
                if match
                else {"thread_id": "current", "current": True}
            )
            continue
        frame = _FRAME_RE.match(line)
        if frame and header is not None:
            number = frame["line"]
            frames.append(Frame(frame["file"], int(number) if number.isdigit() else 0, frame["func"]))
        elif header is not None and line and not line.startswith("  "):
            flush()  # any other unindented line ends the block ("Extension modules: ...", C stacks)
            header, frames = None, []
    flush()
    return threads


def split_samples(text: str) -> tuple[list[str], str | None]:
    """``stacks.txt`` -> (the texts of the runner's samples in order, a fatal-error dump or None).

    A fatal error dump (``Fatal Python error: Segmentation fault`` ...) is text outside any sample whose
    threads parse; the last such text is returned.
    """
    samples: list[str] = []
    fatal: str | None = None
    chunks = re.split(rf"^{re.escape(SAMPLE_HEADER)}[^\n]*\n", text, flags=re.MULTILINE)
    outside = [chunks[0]]
    for chunk in chunks[1:]:
        # A fatal dump written after a sample header lands in that chunk: split it off.
        head, sep, tail = chunk.partition("Fatal Python error:")
        samples.append(head)
        if sep:
            outside.append(sep + tail)
    for chunk in outside:
        start = chunk.rfind("Fatal Python error:")
        if start >= 0 and parse_faulthandler(chunk[start:]):
            fatal = chunk[start:]
    return samples, fatal


@dataclass(frozen=True)
class StackFile:
    """``stacks.txt`` read once: the watchdog's samples in order and a fatal dump (see `split_samples`)."""

    samples: tuple[str, ...] = ()
    fatal: str | None = None

    def sample_threads(self) -> list[list[ThreadStack]]:
        """The threads of each sample, in order (an empty list for a sample nothing answered)."""
        return [parse_faulthandler(sample) for sample in self.samples]

    def threads(self) -> list[ThreadStack]:
        """Every thread of every sample, then of the fatal dump."""
        return [t for text in [*self.samples, self.fatal or ""] for t in parse_faulthandler(text)]

    def last_dump(self) -> str | None:
        """The dump that shows where the process ended up: the fatal one, else the last sample."""
        return self.fatal or (self.samples[-1] if self.samples else None)


def read_stacks(path: Path) -> StackFile:
    """``stacks.txt`` at ``path``; empty when there is none (a case that ended normally, or never started)."""
    try:
        text = artifacts.read_text(Path(path))
    except (OSError, ValueError):  # none, or not a regular file of a sane size (a run folder read back)
        return StackFile()
    samples, fatal = split_samples(text)
    return StackFile(tuple(samples), fatal)


def fatal_error(text: str | None) -> str | None:
    """``"Segmentation fault"`` from a fatal dump, or None."""
    for line in (text or "").splitlines():
        match = _FATAL_RE.match(line.strip())
        if match:
            return match["what"].strip()
    return None


def parse_pyspy(text: str) -> list[ThreadStack]:
    """The threads of a ``py-spy dump [--native]`` text. Python frames read ``func (file.py:line)``."""
    threads: list[ThreadStack] = []
    header: dict[str, object] | None = None
    frames: list[Frame] = []
    for raw in text.splitlines():
        match = _PYSPY_THREAD_RE.match(raw)
        if match:
            if header is not None:
                threads.append(ThreadStack(frames=tuple(frames), **header))  # type: ignore[arg-type]
            status = match["status"]
            header = {
                "thread_id": match["id"],
                "name": match["name"],
                "status": status,
                "current": "gil" in status,
            }
            frames = []
            continue
        frame = _PYSPY_FRAME_RE.match(raw)
        if frame and header is not None:
            where = frame["where"]
            file, _, number = where.rpartition(":")
            if number.isdigit() and (file.endswith(".py") or file.startswith("<")):
                frames.append(Frame(file, int(number), frame["func"]))
            else:
                frames.append(Frame(where, 0, frame["func"], native=True))
    if header is not None:
        threads.append(ThreadStack(frames=tuple(frames), **header))  # type: ignore[arg-type]
    return threads


def source_lines(threads: Iterable[ThreadStack], depth: int = 3) -> dict[str, str]:
    """``{"file:line": source text}`` of the innermost ``depth`` Python frames of each thread.

    faulthandler shows the Python line, not the C call made from it (``lock.acquire()``, ``x.item()``);
    the source says which. Read on this machine, where the worker's files are.
    """
    found: dict[str, str] = {}
    for thread in threads:
        for frame in thread.python_frames[:depth]:
            if frame.line and frame.key not in found:
                linecache.checkcache(frame.file)  # the file may have changed since it was cached
                text = linecache.getline(frame.file, frame.line).strip().split("  #")[0].rstrip()
                if text and not text.startswith("#"):
                    found[frame.key] = text
    return found


# a source file larger than this is not parsed for its loops (a generated file; reading it is the cost)
LOOP_SOURCE_MAX_BYTES = 2 << 20


def enclosing_loops(threads: Iterable[ThreadStack], depth: int = 3) -> dict[str, str]:
    """``{"file:line": "`while not os.path.exists(path):` at file.py:20"}``: the innermost ``while`` loop
    around each of the innermost ``depth`` Python frames of each thread, from its source file (a ``for``
    over the steps is no check that waits).

    A wait in a loop that sleeps and checks (``while not os.path.exists(p): time.sleep(1)``) shows the
    sleep in the stack; the loop's head says what it waits for. Read on this machine, bounded in size; a
    file that cannot be read or parsed gives nothing."""
    found: dict[str, str] = {}
    for frame in _source_frames(threads, depth):
        around = [b for b in _blocks_of(frame.file) if b.loop and b.start < frame.line <= b.end]
        around = [b for b in around if b.text.startswith("while")]  # a loop that checks, not `for step in`
        if around:
            inner = max(around, key=lambda b: b.start)
            found[frame.key] = f"`{inner.text}` at {os.path.basename(frame.file)}:{inner.start}"
    return found


def enclosing_withs(threads: Iterable[ThreadStack], depth: int = 16) -> dict[str, tuple[str, ...]]:
    """``{"file:line": ("metrics_lock at train.py:44", ...)}``: the context managers of the ``with``
    statements whose body holds each of the innermost ``depth`` Python frames of each thread (what the
    thread holds there, where its stack shows it: a lock taken with ``with``), innermost last."""
    found: dict[str, tuple[str, ...]] = {}
    for frame in _source_frames(threads, depth):
        name = os.path.basename(frame.file)
        withs = sorted(
            (b for b in _blocks_of(frame.file) if not b.loop and b.start < frame.line <= b.end),
            key=lambda b: b.start,
        )
        held = tuple(f"{item} at {name}:{b.start}" for b in withs for item in b.items)
        if held:
            found[frame.key] = held
    return found


def _source_frames(threads: Iterable[ThreadStack], depth: int) -> Iterator[Frame]:
    """The innermost ``depth`` Python frames of each thread that have a line in a .py file, each once."""
    seen = set()
    for thread in threads:
        for frame in thread.python_frames[:depth]:
            if frame.line and frame.file.endswith(".py") and frame.key not in seen:
                seen.add(frame.key)
                yield frame


@dataclass(frozen=True)
class _Block:
    """A loop or a ``with`` statement of a source file: its lines, its head, its context managers."""

    loop: bool
    start: int
    end: int
    text: str  # the head's first line, stripped
    items: tuple[str, ...] = ()  # a with's context managers, as written (``self._lock``)


def _blocks_of(path: str) -> tuple[_Block, ...]:
    try:
        st = os.stat(path)
    except OSError:
        return ()
    if st.st_size > LOOP_SOURCE_MAX_BYTES:
        return ()
    return _blocks(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _blocks(path: str, mtime_ns: int, size: int) -> tuple[_Block, ...]:
    """The loops and with statements of a source file; () when it cannot be read or parsed."""
    del mtime_ns, size  # the cache's key: a changed file is read again
    try:
        with open(path, "rb") as f:
            source = f.read(LOOP_SOURCE_MAX_BYTES + 1)
        if len(source) > LOOP_SOURCE_MAX_BYTES:
            return ()
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return ()
    lines = source.decode("utf-8", errors="replace").splitlines()
    out = []
    for node in ast.walk(tree):
        loop = isinstance(node, (ast.While, ast.For, ast.AsyncFor))
        if not (loop or isinstance(node, (ast.With, ast.AsyncWith))) or node.end_lineno is None:
            continue
        head = lines[node.lineno - 1].strip() if node.lineno <= len(lines) else ""
        items: tuple[str, ...] = ()
        if not loop:
            try:
                items = tuple(ast.unparse(i.context_expr)[:80] for i in node.items)  # type: ignore[attr-defined]
            except (ValueError, RecursionError):
                items = ()
        out.append(_Block(loop, node.lineno, node.end_lineno, head.split("  #")[0].rstrip()[:120], items))
    return tuple(out)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")


def request_sample(pid: int, stacks_path: Path, number: int, note: str = "", send: bool = True) -> int | None:
    """Write the header of sample ``number`` into ``stacks.txt`` and SIGUSR1 ``pid`` (unless not ``send``).

    Returns the file's size once the header is written (for `wait_for_dump`), None if ``pid`` is gone.
    """
    suffix = f" ({note})" if note else ""
    artifacts.append_text(stacks_path, f"{SAMPLE_HEADER} {number} at {_now()}{suffix}\n")
    header_end = stacks_path.stat().st_size
    try:
        os.kill(pid, signal.SIGUSR1 if send else 0)
    except ProcessLookupError:
        return None
    return header_end


def take_sample(
    pid: int,
    case_dir: Path,
    stacks_path: Path,
    number: int,
    heartbeat: bool | None,
    note: str = "",
    signal_ok: bool = True,
) -> str | None:
    """Stack sample ``number``: SIGUSR1 to faulthandler, and where its handler writes nothing in time while
    the heartbeat thread is alive, the heartbeat thread's dump (``stack.request``). Returns who wrote it
    ("signal", "heartbeat thread"), or None when nothing was written or ``pid`` is gone. Not
    ``signal_ok`` (a process with a SIGUSR1 handler of its own): the heartbeat thread's dump only."""
    header_end = request_sample(pid, stacks_path, number, note, send=signal_ok)
    if header_end is None:
        return None
    if signal_ok:
        wait_for_dump(stacks_path, header_end)
        if _size(stacks_path) > header_end:
            return "signal"
    if heartbeat is False:  # a held GIL: the heartbeat thread cannot run either
        return None
    artifacts.write_text(Path(case_dir) / artifacts.STACK_REQUEST, f"{number}\n")
    wait_for_dump(stacks_path, header_end)
    return "heartbeat thread" if _size(stacks_path) > header_end else None


def wait_for_dump(
    stacks_path: Path, size_before: int, start_timeout_s: float = DUMP_START_TIMEOUT_S, timeout_s: float = 0.5
) -> None:
    """Wait for faulthandler's dump to begin (at most ``start_timeout_s``), then until it stops growing (it
    writes in a burst; at most ``timeout_s`` more).

    ``size_before`` is `request_sample`'s answer, header included: counted without it, the header alone
    looked like a finished dump and the wait ended before the worker had written anything. The start gets
    seconds, not a fraction of one: on a loaded machine the worker's handler may run late, and a wait that
    ended first let the next header land before the dump, leaving the samples empty.
    """
    deadline = time.monotonic() + start_timeout_s
    while _size(stacks_path) <= size_before:
        if time.monotonic() >= deadline:
            return
        time.sleep(0.02)
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        size = _size(stacks_path)
        if size == last:
            return
        last = size
        time.sleep(0.05)


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def pyspy_dump(pid: int, out_path: Path, timeout_s: float = PYSPY_TIMEOUT_S) -> PyspyDump:
    """``py-spy dump --native --pid`` into ``out_path``; returns what happened (and why not, if not).

    Falls back to a dump without ``--native`` when the native unwinder fails (some kernels and builds).
    """
    exe = pyspy_exe()
    if exe is None:
        return PyspyDump(taken=False, why=pyspy_missing())
    attempts = []
    for args in (["dump", "--native", "--pid", str(pid)], ["dump", "--pid", str(pid)]):
        try:
            done = subprocess.run(
                [exe, *args], capture_output=True, text=True, timeout=timeout_s,
                stdin=subprocess.DEVNULL, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            attempts.append(f"py-spy {' '.join(args)} did not finish within {timeout_s:g} s")
            continue
        text = _redact_header(done.stdout)
        text += f"\n--- stderr ---\n{done.stderr}" if done.stderr.strip() else ""
        if done.returncode == 0 and parse_pyspy(done.stdout):
            artifacts.write_text(out_path, text)
            return PyspyDump(taken=True, native="--native" in args, file=out_path.name)
        said = _last_line(done.stderr or done.stdout)
        if "ermission" in said or "not permitted" in said:
            said += " (py-spy needs ptrace rights: run as root or set kernel.yama.ptrace_scope=0)"
        attempts.append(f"py-spy {' '.join(args)} exited {done.returncode}: {said}")
    artifacts.write_text(out_path, "\n".join(attempts) + "\n")
    return PyspyDump(taken=False, why="; ".join(attempts), file=out_path.name)


def pyspy_sample(pid: int, timeout_s: float = PYSPY_TIMEOUT_S) -> tuple[str | None, str]:
    """One ``py-spy dump --pid`` (Python frames only: quicker than ``--native``): (its text with its
    command line's secrets withheld, or None; what happened)."""
    exe = pyspy_exe()
    if exe is None:
        return None, pyspy_missing()
    try:
        done = subprocess.run(
            [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s,
            stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, f"py-spy dump did not finish within {timeout_s:g} s"
    if done.returncode == 0 and parse_pyspy(done.stdout):
        return _redact_header(done.stdout), "taken"
    said = _last_line(done.stderr or done.stdout)
    if "ermission" in said or "not permitted" in said:
        said += " (py-spy needs ptrace rights: run as root or set kernel.yama.ptrace_scope=0)"
    return None, f"py-spy dump exited {done.returncode}: {said}"


def _redact_header(text: str) -> str:
    """py-spy's dump heads with the command line (``Process 42: python train.py --api-key X``): its secret
    arguments withheld (`nsa_diag.redact.redact_argv`; known secret values go when the file is written)."""
    lines = text.split("\n")
    for i, line in enumerate(lines[:3]):
        head, sep, cmdline = line.partition(": ")
        if head.startswith("Process ") and sep:
            lines[i] = head + sep + " ".join(redact_argv(redact_line(cmdline).split(" ")))
    return "\n".join(lines)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"
