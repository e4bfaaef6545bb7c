"""The only module that writes files: the run-folder layout and atomic writes (temporary file + rename).

    <out>/<YYYYmmdd-HHMMSS>-<command>[-<tag>]/
      summary.json  summary.md  env.json  .nsa-diag.lock .nsa-diag.reserve (while a process runs in it)
      cases/<case-id>/ spec.json result.json replay.sh stdout.log stderr.log progress.jsonl ...

A multi-node ddp run (`nsa_diag.launchers.nodes`) shares one folder, ``<out>/ddp-<run id>``, between its
nodes: each node holds its own lock (``.nsa-diag.node<r>.lock``) and adds ``nodes/<r>/`` (env.json, and
at node r > 0 its summary); its ranks write ``cases/<case-id>/ranks/<global rank>/``.

A reader never sees half a file: every JSON and text file is written to a temporary sibling and renamed.

No file records a secret (`nsa_diag.redact`): env.json and replay.sh name a secret-named variable as
withheld instead of its value; the values `withhold` is told of (such variables' values, the secret
arguments of the command lines nsa-diag runs or attaches to) are replaced by ``<withheld>`` in every text and
JSON file written here, and argument lists recorded under ``argv``/``cmdline``/``command`` keys have their
secret arguments withheld (`nsa_diag.redact.secret_words`); ``replay.sh`` asks for them instead. The
job's own stdout/stderr logs are its output, written as it prints them.

A run folder has one writer at a time: the process that holds its lock (`lock_run_dir`).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import shlex
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel

from nsa_diag.errors import DiskFullError, UsageError
from nsa_diag.redact import (
    MIN_SECRET_LEN,
    WITHHELD,
    embedded_secrets,
    env_secret_values,
    is_secret_name,
    redact_argv,
    redact_line,
    secret_words,
)

DEFAULT_OUT = Path("nsa-diag-runs")
# A run folder is refused on a file system with less free: a case writes logs, stacks and evidence, and a
# full disk midway would leave cases without result.json.
MIN_FREE_BYTES = 16 * 2**20
# Held on the run folder's disk while a process writes in it (`lock_run_dir`), given back when a write of
# ours finds the disk full (a job's checkpoints, another program): room for result.json and the summary.
RESERVE_BYTES = 2 * 2**20
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

ENV = "env.json"  # run folder: the environment snapshot (nsa_diag.evidence.env)
LOCK = ".nsa-diag.lock"  # run folder: flock-ed by the process that writes in it; says who that is
NODES = "nodes"  # a multi-node run folder, and its case folders: nodes/<node rank>/, each node's own files
RANK_RESULT = "rank_result.json"  # a multi-node case: ranks/<r>/, the rank's classified result
NODE = "node.json"  # a multi-node case: nodes/<r>/, how the node's part ended (read by node 0)
RANKS_DIR = "ranks"  # a DDP case (ours or a watched torchrun job): ranks/<r>/, one folder per rank


def rank_dir(case_dir: Path, rank: int) -> Path:
    return Path(case_dir) / RANKS_DIR / str(rank)


# File names of a case folder (DESIGN.md "Artifacts").
SPEC = "spec.json"
FR_AT_HANG = "flight_recorder.at_hang.pickle"  # a rank's flight recorder, dumped by its heartbeat at a hang
RESULT = "result.json"
REPLAY = "replay.sh"
STDOUT = "stdout.log"
STDERR = "stderr.log"
PROGRESS = "progress.jsonl"
BEACON = "beacon.bin"
WORKER_RESULT = "worker_result.json"  # the worker's own account; the runner folds it into result.json
MEMORY_STATS = "memory_stats.json"
MEMORY_SUMMARY = "memory_summary.txt"
GPU = "gpu.json"
NVIDIA_SMI = "nvidia-smi.txt"
STACKS = "stacks.txt"
PYSPY = "pyspy.txt"
PYSPY_MORE = "pyspy-more.txt"  # the last further py-spy dump of a unit that used the CPU at the hang
PROC = "proc.json"
TRACE = "trace.json"
MEMORY_TIMELINE = "memory_timeline.html"
MEMORY_SNAPSHOT = "memory_snapshot.pickle"
DUMP_REQUEST = "dump.request"  # the runner asks the worker's heartbeat thread for memory evidence at a hang
DUMP_DONE = "dump.done"  # ... and the worker says it has written it
STACK_REQUEST = "stack.request"  # ... and for a stack sample (its number) the SIGUSR1 handler left empty
# Files only a running case uses (in each unit's folder), removed when the case ends: the beacon is read
# only while the job runs, the requests and their answer are the runner talking to the heartbeat thread.
INTERNAL_FILES = (BEACON, DUMP_REQUEST, DUMP_DONE, STACK_REQUEST)


def write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (same-folder temporary file, fsync, rename). On a full disk
    the run folder's reserve (`lock_run_dir`) is given back and the write tried again; still full, a
    `DiskFullError` says which file could not be written. No temporary file stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return _write_bytes(path, data)
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        if _give_back_reserve(path.parent):
            with contextlib.suppress(OSError):
                return _write_bytes(path, data)
        raise DiskFullError(
            f"{path}: cannot be written, its file system is full ({exc.strerror}); free some space, or "
            "give --out on another disk"
        ) from None


def _write_bytes(path: Path, data: bytes) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; artifacts are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# The reserves this process holds (`lock_run_dir`), each on the disk of its run folder.
_reserves: list[Path] = []


def _make_reserve(path: Path) -> None:
    """`RESERVE_BYTES` of real blocks at ``path`` (best effort: a disk too full for it has none)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError:
        return
    try:
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError as exc:  # a file system without fallocate: written blocks hold the space too
            if exc.errno in DISK_FULL:
                raise
            os.write(fd, bytes(RESERVE_BYTES))
        _reserves.append(path)
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()
    finally:
        os.close(fd)


def _give_back_reserve(folder: Path) -> bool:
    """Remove a reserve on ``folder``'s disk; whether there was one."""
    try:
        device = os.stat(folder).st_dev
    except OSError:
        return False
    for reserve in list(_reserves):
        try:
            if os.stat(reserve).st_dev != device:
                continue
            reserve.unlink()
        except OSError:
            pass
        _reserves.remove(reserve)
        return True
    return False


def _drop_reserve(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
    if path in _reserves:
        _reserves.remove(path)


# --- secrets --------------------------------------------------------------------------------------------

# The secret values this process knows of (`withhold`), never written into a file.
_withheld: set[str] = set()
# Keys whose value is a command line (a list of words, or one string): its secret arguments are withheld.
ARGV_KEYS = frozenset({"argv", "cmdline", "command"})


def withhold(values: Iterable[str]) -> None:
    """Never write these values (secrets) into a file: each is replaced by ``<withheld>``. A value shorter
    than `nsa_diag.redact.MIN_SECRET_LEN` is not searched for (it would withhold ordinary text); an
    argument list still has it withheld by position (`ARGV_KEYS`). An all-digit value is a secret like
    any other (``--api-key 98765432109``), searched for as a whole number: not inside a longer one."""
    _withheld.update(v for v in values if len(v) >= MIN_SECRET_LEN)


def scrub(text: str) -> str:
    """`text` with every withheld value replaced (the longest first: one may contain another)."""
    for value in sorted((v for v in _withheld if v in text), key=len, reverse=True):
        if value.isdigit():
            text = re.sub(rf"(?<![0-9]){value}(?![0-9])", WITHHELD, text)
        else:
            text = text.replace(value, WITHHELD)
    return text


def scrub_data(data: Any, key: str | None = None) -> Any:
    """JSON-like `data` with its strings scrubbed and its command lines' secret arguments withheld; a
    pydantic model in it (a record of `nsa_diag.records`) is scrubbed as its JSON and read back."""
    if isinstance(data, BaseModel):
        return type(data).model_validate(scrub_data(data.model_dump(mode="json")))
    if isinstance(data, str):
        if key in ARGV_KEYS:
            data = " ".join(redact_argv(redact_line(data).split(" ")))
        return scrub(data)
    if isinstance(data, dict):
        return {scrub(k) if isinstance(k, str) else k: scrub_data(v, k if isinstance(k, str) else None)
                for k, v in data.items()}  # fmt: skip
    if isinstance(data, (list, tuple)):
        if key in ARGV_KEYS and all(isinstance(w, str) for w in data):
            data = redact_argv(data)
        return [scrub_data(item) for item in data]
    return data


def write_text(path: Path, text: str) -> Path:
    return write_bytes(path, scrub(text).encode())


def as_json(value: object) -> object:
    """``json.dumps``'s ``default``: a pydantic model (a record, also inside a dict) as its JSON; TypeError
    for another value JSON has no type for."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _jsonable(value: object) -> object:
    """`as_json`, else the value's text (what a file gets for anything else)."""
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else str(value)


def write_json(path: Path, data: Any) -> Path:
    """Atomic JSON (pydantic models are dumped in JSON mode), secrets withheld (`scrub_data`)."""
    if hasattr(data, "model_dump"):
        data = data.model_dump(mode="json")
    data = scrub_data(json.loads(json.dumps(data, default=_jsonable)))
    # every string and key is scrubbed: the text is not again, lest a number equal to a secret's digits
    # become ``<withheld>`` and the file no JSON
    return write_bytes(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())


def write_json_new(path: Path, data: Any) -> bool:
    """`write_json` where ``path`` does not exist yet, whether it wrote: another writer's file is never
    replaced, also one that appears meanwhile (the complete temporary file is linked into place, which
    fails where a file is)."""
    if hasattr(data, "model_dump"):
        data = data.model_dump(mode="json")
    data = scrub_data(json.loads(json.dumps(data, default=_jsonable)))
    text = scrub(json.dumps(data, indent=2, sort_keys=False) + "\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def write_with(path: Path, writer: Callable[[Path], object]) -> Path:
    """Let ``writer`` (a library exporter, e.g. torch's ``export_chrome_trace``) write a temporary sibling of
    ``path`` with the same suffix, then rename it into place: readers never see a half-written export."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        writer(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def open_append(path: Path, *, binary: bool = False) -> IO[Any]:
    """Open a streaming file (progress.jsonl, stacks.txt, a log) for appending; the caller closes it.

    Text mode is line-buffered, so each complete line reaches the file at once; binary mode is unbuffered
    (faulthandler writes to the descriptor directly). Appends are not atomic writes: these files are
    read line by line, and a killed writer leaves at most one partial last line.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if binary:
        return open(path, "ab", buffering=0)
    return open(path, "a", buffering=1, encoding="utf-8")


def append_text(path: Path, text: str) -> Path:
    """Append ``text`` to ``path`` (memory_summary.txt: one section per moment measured)."""
    with open_append(path) as f:
        f.write(scrub(text))
    return path


# --- reading back ---------------------------------------------------------------------------------------

# What a run folder's file may be when read back (`read_file`): a folder copied from elsewhere, edited by
# hand or made to harm may hold anything. Logs, stacks and progress.jsonl are capped at their writers'
# (`nsa_diag.logcap`: 16 MiB a log); the largest JSON nsa-diag writes is a result.json of a few hundred
# KiB, nested under 10 deep.
TEXT_MAX_BYTES = 64 * 2**20
JSON_MAX_BYTES = 16 * 2**20
JSON_MAX_DEPTH = 64
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class UnreadableFile(ValueError):
    """A file read back is not one nsa-diag wrote: not a regular file (a FIFO, a device, a link to one),
    larger than its kind's limit, or JSON nested too deep. Its text: ``<path>: <why>``."""


def read_file(path: Path, limit: int = TEXT_MAX_BYTES) -> bytes:
    """The bytes of the regular file at ``path`` (a link to one is followed), at most ``limit`` of them:
    anything else is an `UnreadableFile` before it is opened (a FIFO never blocks, a device is never read),
    and a file that grows past ``limit`` while read is one too. OSError when there is none."""
    path = Path(path)
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise UnreadableFile(f"{path}: not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped for something else since the stat above
            raise UnreadableFile(f"{path}: not a regular file")
        if st.st_size > limit:
            raise UnreadableFile(f"{path}: larger than {limit // 2**20} MiB ({st.st_size // 2**20} MiB)")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise UnreadableFile(f"{path}: larger than {limit // 2**20} MiB")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: Path, limit: int = TEXT_MAX_BYTES) -> str:
    """`read_file` as text (undecodable bytes replaced)."""
    return read_file(path, limit).decode(errors="replace")


def json_depth_exceeds(data: bytes, depth: int = JSON_MAX_DEPTH) -> bool:
    """Whether the JSON text ``data`` nests arrays and objects more than ``depth`` deep (strings aside):
    the innermost pairs of brackets are removed, a level per pass."""
    brackets = _JSON_STRING.sub(b"", data).translate(_BRACKETS, _NOT_BRACKETS)
    for _ in range(depth):
        fewer = brackets.replace(b"[]", b"")
        if fewer == brackets:  # unbalanced: json.loads says what is wrong
            return len(brackets) > depth
        brackets = fewer
    return bool(brackets)


def read_json(path: Path, limit: int = JSON_MAX_BYTES) -> Any:
    """The JSON in the regular file at ``path`` (`read_file`); `UnreadableFile` when it nests deeper than
    `JSON_MAX_DEPTH`, ValueError when it is not JSON, OSError when there is none."""
    data = read_file(path, limit)
    if json_depth_exceeds(data):
        raise UnreadableFile(f"{path}: nested deeper than {JSON_MAX_DEPTH}")
    try:
        return json.loads(data)
    except RecursionError:
        raise UnreadableFile(f"{path}: nested deeper than {JSON_MAX_DEPTH}") from None


def new_run_dir(command: str, out: Path | None = None, tag: str | None = None) -> Path:
    """Create ``<out>/<YYYYmmdd-HHMMSS>-<command>[-<tag>]``, with a numeric suffix if it already exists.

    An ``--out`` where no run folder can be made (read-only, immutable, under /proc, its file system full,
    a name too long) is a `UsageError` saying so, and leaves nothing behind: not even the folders of
    ``--out`` this call made.
    """
    base = Path(out or DEFAULT_OUT)
    stem = time.strftime("%Y%m%d-%H%M%S") + f"-{command}" + (f"-{tag}" if tag else "")
    made = [p for p in (base, *base.parents) if not p.exists()]  # deepest first
    try:
        for n in range(1000):
            path = base / (stem if n == 0 else f"{stem}.{n}")
            try:
                path.mkdir(parents=True)
                break
            except FileExistsError:
                continue
        else:
            raise UsageError(f"--out {base}: {stem} and 999 numbered copies of it exist already")
        free = shutil.disk_usage(path).free
        if free < MIN_FREE_BYTES:
            path.rmdir()
            raise UsageError(
                f"--out {base}: its file system is full ({free // 1024} KiB free; a run needs "
                f"{MIN_FREE_BYTES // 2**20} MiB)"
            )
        return path
    except OSError as exc:
        _remove_empty(made)
        raise UsageError(f"--out {base}: cannot create a run folder there: {exc.strerror or exc}") from None
    except UsageError:
        _remove_empty(made)
        raise


def remove_run_dir(path: Path) -> None:
    """Undo `new_run_dir` when the run's first files cannot be written: no half run folder stays."""
    shutil.rmtree(path, ignore_errors=True)


def _remove_empty(folders: list[Path]) -> None:
    """Remove each folder (deepest first) while it is empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


class FolderInUse(Exception):
    """`lock_run_dir`: another process holds the folder (`holder` says which, in words)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


class RunFolderLock:
    """The lock of one run folder, held by this process until `release` (or until it dies: the kernel
    drops a flock with its last descriptor, so a killed holder never blocks a later ``--resume``)."""

    def __init__(self, path: Path, fd: int, reserve: Path | None = None) -> None:
        self.path = path
        self._fd: int | None = fd
        self.reserve = reserve

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in this order: whoever locks next locks a file that
        is still on disk, see `lock_run_dir`)."""
        if self._fd is None:
            return
        if self.reserve is not None:
            _drop_reserve(self.reserve)
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


def node_lock(node_rank: int) -> str:
    """The lock file name of one node of a multi-node run folder: the nodes share the folder, a node rank
    is held by one process at a time."""
    return f".nsa-diag.node{node_rank}.lock"


def node_dir(folder: Path, node_rank: int) -> Path:
    """``<folder>/nodes/<node rank>``: a node's own files in a shared run folder or case folder."""
    return Path(folder) / NODES / str(node_rank)


def shared_run_dir(path: Path) -> Path:
    """Create (or join) the run folder the nodes of a multi-node run share. An ``--out`` where it cannot
    be made is a `UsageError`, leaving behind none of the folders this call made."""
    path = Path(path)
    made = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path).free
    except OSError as exc:
        _remove_empty(made)
        raise UsageError(
            f"--out {path.parent}: cannot create a run folder there: {exc.strerror or exc}"
        ) from None
    if free < MIN_FREE_BYTES:
        _remove_empty(made)
        raise UsageError(f"--out {path.parent}: its file system is full ({free // 1024} KiB free)")
    return path


def remove_tree(path: Path) -> None:
    """Remove a folder and what it holds (a node's stale rank folders before its ranks start again)."""
    shutil.rmtree(path, ignore_errors=True)


def lock_run_dir(run_dir: Path, name: str = LOCK) -> RunFolderLock:
    """Take ``run_dir``'s lock (``.nsa-diag.lock``: an exclusive flock, and who holds it: pid, command,
    since when, host). Raises `FolderInUse`, naming the holder, when another process has it; nothing in
    the folder is changed then. The descriptor is not inherited by children (``os.open`` makes it
    close-on-exec), so a worker that outlived us could not keep the folder locked. ``name``: another
    lock of the folder (`node_lock`: one per node of a shared multi-node folder). While it is held, a
    reserve of `RESERVE_BYTES` sits beside it (``.nsa-diag.reserve``), given back to the first write that
    finds the disk full (`write_bytes`) and removed with the lock."""
    path = Path(run_dir) / name
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise FolderInUse(holder) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the last holder may have removed the file between our open and our flock: lock the new one
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    holder = {
        "pid": os.getpid(),
        "command": scrub(shlex.join(redact_argv(["nsa-diag", *sys.argv[1:]]))),
        "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    reserve = path.with_name(name.removesuffix(".lock") + ".reserve")
    _make_reserve(reserve)
    return RunFolderLock(path, fd, reserve)


def _lock_holder(fd: int) -> str:
    """Who holds the lock whose file is open as ``fd``, in words."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0))
        return f"pid {holder['pid']} ({holder['command']}) on {holder['host']} since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not said which yet)"


def remove_files(paths: Iterable[Path]) -> None:
    """Remove each file that exists (a case's internal files once it has ended); a failure is ignored:
    a file left behind costs less than a case without its result."""
    for path in paths:
        try:
            Path(path).unlink(missing_ok=True)
        except OSError:
            continue


def case_dir(run_dir: Path, name: str) -> Path:
    path = Path(run_dir) / "cases" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _replay_words(argv: Sequence[str], environ: dict[str, str]) -> tuple[str, list[str]]:
    """The shell words of `argv` for replay.sh, and the variables the user must set: each secret in a word
    (a secret argument, `secret_words`; one inside a command line in one word, `embedded_secrets`; or a
    withheld value within it) becomes ``"${VAR:?...}"``, where VAR is the secret-named variable of this
    environment holding that value, else ``NSA_DIAG_SECRET_<n>``."""
    secret_values = env_secret_values(environ)  # the same values `withhold` takes from an environment
    by_value = {v: k for k, v in sorted(environ.items()) if is_secret_name(k) and v in secret_values}
    known = {*_withheld, *by_value}
    positional = {i: value for i, (_, value) in secret_words(argv).items()}
    # a command line in one word (``bash -c "... --password X"``): its secrets by their place in it
    embedded = {i: {argv[i][a:b] for a, b, _ in spans} for i, spans in embedded_secrets(argv).items()}
    words: list[str] = []
    asked: list[str] = []

    def ask(value: str) -> str:
        if value not in by_value:  # one variable per value, numbered in order
            by_value[value] = f"NSA_DIAG_SECRET_{sum(a.startswith('NSA_DIAG_') for a in asked) + 1}"
        var = by_value[value]
        if var not in asked:
            asked.append(var)
        what = "the value nsa-diag withheld" if var.startswith("NSA_DIAG_") else "its secret"
        return f'"${{{var}:?set {var} to {what}}}"'

    for i, word in enumerate(argv):
        pieces: list[str] = []
        rest = word
        tail = ""
        if i in positional:  # the value ends the word (``--key=X``, ``X``, ``NAME=X``)
            rest, tail = word[: len(word) - len(positional[i])], ask(positional[i])
        while rest:
            found_here = known | embedded.get(i, set())
            hit = min(((rest.find(v), -len(v), v) for v in found_here if v in rest), default=None)
            if hit is None:
                pieces.append(shlex.quote(rest))
                break
            at, _, value = hit
            if at:
                pieces.append(shlex.quote(rest[:at]))
            pieces.append(ask(value))
            rest = rest[at + len(value) :]
        words.append("".join(pieces) + tail or "''")
    return " ".join(words), asked


def write_replay(
    path: Path, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> Path:
    """An executable ``replay.sh`` that runs ``argv`` again in ``cwd`` with ``env`` set, from any directory;
    every word is shell-quoted; a secret's value is left out: a secret-named variable of ``env`` is listed
    for the user to set, a secret argument of ``argv`` read from a variable (`_replay_words`)."""
    env = env or {}
    withheld = sorted(name for name in env if is_secret_name(name))
    command, asked = _replay_words(argv, {**os.environ, **env})
    lines = ["#!/usr/bin/env bash", "# Reproduces this case.", "set -euo pipefail"]
    if cwd is not None:  # a --model module is imported from the directory the case ran in
        lines.append(f"cd {shlex.quote(str(Path(cwd).resolve()))}")
    if withheld:
        lines.append(f"# Withheld (secret values are never written; set them yourself): {' '.join(withheld)}")
    if asked:
        lines.append(f"# Secret arguments, read from these variables (set them yourself): {' '.join(asked)}")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k not in withheld]
    lines.append(command + ' "$@"')
    write_text(path, "\n".join(lines) + "\n")
    os.chmod(path, 0o755)
    return path
