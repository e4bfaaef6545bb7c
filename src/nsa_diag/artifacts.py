"""The only module that writes files: the run-folder layout and atomic writes (temporary file + rename).

    <out>/<YYYYmmdd-HHMMSS>-<command>[-<tag>]/
      summary.json  summary.md  env.json  .nsa-diag.lock (while a process runs in it)
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
import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from nsa_diag.errors import UsageError
from nsa_diag.redact import (
    MIN_SECRET_LEN,
    WITHHELD,
    env_secret_values,
    is_secret_name,
    redact_argv,
    secret_words,
)

DEFAULT_OUT = Path("nsa-diag-runs")
# A run folder is refused on a file system with less free: a case writes logs, stacks and evidence, and a
# full disk midway would leave cases without result.json.
MIN_FREE_BYTES = 16 * 2**20

ENV = "env.json"  # run folder: the environment snapshot (nsa_diag.evidence.env)
LOCK = ".nsa-diag.lock"  # run folder: flock-ed by the process that writes in it; says who that is
NODES = "nodes"  # a multi-node run folder, and its case folders: nodes/<node rank>/, each node's own files
RANK_RESULT = "rank_result.json"  # a multi-node case: ranks/<r>/, the rank's classified result
NODE = "node.json"  # a multi-node case: nodes/<r>/, how the node's part ended (read by node 0)

# File names of a case folder (DESIGN.md "Artifacts").
SPEC = "spec.json"
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
    """Write ``data`` to ``path`` atomically (same-folder temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
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


# --- secrets --------------------------------------------------------------------------------------------

# The secret values this process knows of (`withhold`), never written into a file.
_withheld: set[str] = set()
# Keys whose value is a command line (a list of words, or one string): its secret arguments are withheld.
ARGV_KEYS = frozenset({"argv", "cmdline", "command"})


def withhold(values: Iterable[str]) -> None:
    """Never write these values (secrets) into a file: each is replaced by ``<withheld>``. A value shorter
    than `nsa_diag.redact.MIN_SECRET_LEN` or all digits is not searched for (it would withhold ordinary
    text); an argument list still has it withheld by position (`ARGV_KEYS`)."""
    _withheld.update(v for v in values if len(v) >= MIN_SECRET_LEN and not v.isdigit())


def scrub(text: str) -> str:
    """`text` with every withheld value replaced (the longest first: one may contain another)."""
    for value in sorted((v for v in _withheld if v in text), key=len, reverse=True):
        text = text.replace(value, WITHHELD)
    return text


def scrub_data(data: Any, key: str | None = None) -> Any:
    """JSON-like `data` with its strings scrubbed and its command lines' secret arguments withheld."""
    if isinstance(data, str):
        if key in ARGV_KEYS:
            data = " ".join(redact_argv(data.split(" ")))
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


def write_json(path: Path, data: Any) -> Path:
    """Atomic JSON (pydantic models are dumped in JSON mode), secrets withheld (`scrub_data`)."""
    if hasattr(data, "model_dump"):
        data = data.model_dump(mode="json")
    data = scrub_data(json.loads(json.dumps(data, default=str)))
    return write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_json_new(path: Path, data: Any) -> bool:
    """`write_json` where ``path`` does not exist yet, whether it wrote: another writer's file is never
    replaced, also one that appears meanwhile (the complete temporary file is linked into place, which
    fails where a file is)."""
    if hasattr(data, "model_dump"):
        data = data.model_dump(mode="json")
    data = scrub_data(json.loads(json.dumps(data, default=str)))
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


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


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

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in this order: whoever locks next locks a file that
        is still on disk, see `lock_run_dir`)."""
        if self._fd is None:
            return
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
    lock of the folder (`node_lock`: one per node of a shared multi-node folder)."""
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
    return RunFolderLock(path, fd)


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
    (a secret argument, `secret_words`, or a withheld value within it) becomes ``"${VAR:?...}"``, where VAR
    is the secret-named variable of this environment holding that value, else ``NSA_DIAG_SECRET_<n>``."""
    secret_values = env_secret_values(environ)  # the same values `withhold` takes from an environment
    by_value = {v: k for k, v in sorted(environ.items()) if is_secret_name(k) and v in secret_values}
    known = {*_withheld, *by_value}
    positional = {i: value for i, (_, value) in secret_words(argv).items()}
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
            hit = min(((rest.find(v), -len(v), v) for v in known if v in rest), default=None)
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
