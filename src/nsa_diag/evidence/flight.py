"""Reading the flight recorder dumps a job wrote: one file per rank, as PyTorch writes them.

NCCL writes them on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``: files named
``<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>``, by default ``nccl_trace_rank_<rank>``) or on demand through its
debug pipe; a process dumps its own recorder, of any backend that keeps one (gloo's too, e.g. in torch 2.13,
with ``TORCH_FR_BUFFER_SIZE`` set), through ``torch._C._distributed_c10d._dump_fr_trace``. A dump is a
pickle of plain data (PyTorch's own reader, ``torch.distributed.flight_recorder``, unpickles it as it is) or
its JSON form.
Here it is unpickled with every global refused: a dump holds dicts, lists, tuples, strings and numbers, so a
file that names a class or function is not a dump and is never run.

The rank is the number that ends the file's name (PyTorch's rule); ``prefix`` keeps the files whose names
start with it.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from pathlib import Path
from typing import Any

from nsa_diag.errors import UsageError

MAX_DUMP_BYTES = 256 << 20  # 2000 entries with stacks are a few MB; a larger file is not a dump
_RANK = re.compile(r"(\d+)$")


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"names {module}.{name}: a flight recorder dump holds plain data only")


def load_dump(path: Path) -> dict[str, Any]:
    """One dump, pickled or JSON; `UsageError` naming the file for anything else."""
    try:
        size = path.stat().st_size
        if size > MAX_DUMP_BYTES:
            raise UsageError(f"{path}: {size >> 20} MiB is not a flight recorder dump")
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if not data:
        raise UsageError(f"{path}: not a flight recorder dump (the file is empty)")
    if data[:1] not in (b"{", b"[", b"\x80"):  # JSON, or a pickle of protocol 2 or later (every dump's)
        raise UsageError(
            f"{path}: not a flight recorder dump (neither a pickle nor JSON: it begins {data[:20]!r})"
        )
    try:
        dump = json.loads(data) if data[:1] in (b"{", b"[") else _PlainUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, json.JSONDecodeError, EOFError, ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not a flight recorder dump ({str(exc)[:120]})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise UsageError(f"{path}: not a flight recorder dump (no 'entries' list)")
    return dump


def find_dumps(directory: Path, prefix: str | None = None) -> dict[int, Path]:
    """The dump files of ``directory`` by rank: regular files whose name ends in a number (and starts with
    ``prefix``). Two files of one rank (two prefixes) are refused: say ``--prefix``."""
    if not directory.is_dir():
        raise UsageError(f"{directory}: not a folder (give the folder the ranks' dump files are in)")
    found: dict[int, Path] = {}
    for path in sorted(directory.iterdir()):
        match = _RANK.search(path.name)
        if match is None or (prefix is not None and not path.name.startswith(prefix)):
            continue
        if path.is_symlink() or not path.is_file():
            continue
        rank = int(match.group(1))
        if rank in found:
            raise UsageError(
                f"{directory}: two files for rank {rank} ({found[rank].name}, {path.name}); pick one set "
                "with --prefix"
            )
        found[rank] = path
    if not found:
        which = f" starting with {prefix!r}" if prefix else ""
        example = "names ending in the rank, e.g. nccl_trace_rank_0"
        raise UsageError(f"{directory}: no dump files{which} ({example})")
    return found


def read_dumps(directory: Path, prefix: str | None = None) -> dict[int, dict[str, Any]]:
    """Every rank's dump in ``directory`` (`find_dumps`, `load_dump`)."""
    return {rank: load_dump(path) for rank, path in find_dumps(directory, prefix).items()}
