"""Reading the light probe's files from outside the probed process (`watch` and `attach` share this).

A process that runs with the probe (``NSA_DIAG_PROBE_DIR=<folder>`` in its environment and the probe's
``sitecustomize`` on its path) writes into ``<folder>/pid-<pid>/``:

- ``probe.json`` (written atomically): pid, ppid, argv, started (epoch s), rank, local_rank, world_size
  (from RANK/LOCAL_RANK/WORLD_SIZE, null when absent; the rank again after ``init_process_group``),
  ``role`` (``"launcher"`` for torchrun, ``"dataloader-worker"`` once torch's worker loop starts, else
  null), ``forked_from`` (the pid it was forked from: a DataLoader worker's training process),
  ``sigusr1`` (``"probe"``: the probe's faulthandler handles SIGUSR1 and dumps into ``stacks.txt``;
  ``"user"``: the process had its own handler, which the probe left alone) and ``torch`` (true once the
  torch hooks are in);
- ``at_hang.json``: the heartbeat thread's answer to a watchdog's request at a hang (memory, the
  collectives called per op and the one under way); only where ``nsa-diag watch`` asked for it;
- ``beacon.bin``: the progress beacon of `nsa_diag.beacon`, read here with no help from the process;
- ``stacks.txt``: faulthandler's all-threads dumps, appended on each SIGUSR1 (only with ``sigusr1 ==
  "probe"``).

Everything here only reads, and never raises for a folder that is missing, half-written or stale: a
reader gets None and, where it matters, why. A ``pid-<pid>`` folder left by an earlier process that had
the same pid is told apart by its start time (`is_stale`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from nsa_diag.beacon import BeaconState, read_beacon
from nsa_diag.wire import AT_HANG_JSON, BEACON, PROBE_DIR_ENV, PROBE_JSON, STACKS, AtHang

# A probe.json whose start time is this much earlier than the process's own start was written by an
# earlier process with the same pid (the probe writes it during interpreter start-up, after the exec).
STALE_SLACK_S = 2.0


class ProbeInfoJson(TypedDict):
    """`ProbeInfo` as attach's result.json writes it."""

    folder: str
    pid: int
    ppid: int | None
    argv: list[str]
    started: float | None
    rank: int | None
    local_rank: int | None
    world_size: int | None
    sigusr1: str | None
    torch: bool
    role: str | None
    forked_from: int | None


@dataclass(frozen=True)
class ProbeInfo:
    """One process's ``probe.json``, typed; `folder` is its ``pid-<pid>`` folder."""

    folder: Path
    pid: int
    ppid: int | None = None
    argv: tuple[str, ...] = ()
    started: float | None = None
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    sigusr1: str | None = None  # "probe" | "user" | None (not said)
    torch: bool = False
    role: str | None = None  # "launcher" | "dataloader-worker" | None
    forked_from: int | None = None

    @property
    def at_hang_path(self) -> Path:
        return self.folder / AT_HANG_JSON

    @property
    def beacon_path(self) -> Path:
        return self.folder / BEACON

    @property
    def stacks_path(self) -> Path:
        return self.folder / STACKS

    def to_json(self) -> ProbeInfoJson:
        return {
            "folder": str(self.folder), "pid": self.pid, "ppid": self.ppid, "argv": list(self.argv),
            "started": self.started, "rank": self.rank, "local_rank": self.local_rank,
            "world_size": self.world_size, "sigusr1": self.sigusr1, "torch": self.torch, "role": self.role,
            "forked_from": self.forked_from,
        }  # fmt: skip


def process_folder(probe_dir: Path, pid: int) -> Path:
    """``<probe_dir>/pid-<pid>``: where the probe of process ``pid`` writes."""
    return Path(probe_dir) / f"pid-{pid}"


def process_folders(probe_dir: Path) -> list[Path]:
    """Every ``pid-<pid>`` folder under ``probe_dir``, by pid (none when it does not exist)."""
    try:
        found = [p for p in Path(probe_dir).iterdir() if p.is_dir() and p.name.startswith("pid-")]
    except OSError:
        return []
    return sorted((p for p in found if p.name[4:].isdigit()), key=lambda p: int(p.name[4:]))


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_probe(folder: Path, data: Any) -> ProbeInfo | None:
    """`ProbeInfo` from the decoded ``probe.json`` of ``folder``; None when it is not one (no int pid)."""
    if not isinstance(data, dict) or _int_or_none(data.get("pid")) is None:
        return None
    argv = data.get("argv")
    started = data.get("started")
    sigusr1 = data.get("sigusr1")
    role = data.get("role")
    return ProbeInfo(
        folder=Path(folder),
        pid=data["pid"],
        ppid=_int_or_none(data.get("ppid")),
        argv=tuple(str(a) for a in argv) if isinstance(argv, list) else (),
        started=float(started)
        if isinstance(started, int | float) and not isinstance(started, bool)
        else None,
        rank=_int_or_none(data.get("rank")),
        local_rank=_int_or_none(data.get("local_rank")),
        world_size=_int_or_none(data.get("world_size")),
        sigusr1=sigusr1 if isinstance(sigusr1, str) else None,
        torch=data.get("torch") is True,
        role=role if isinstance(role, str) else None,
        forked_from=_int_or_none(data.get("forked_from")),
    )


def read_probe(folder: Path) -> ProbeInfo | None:
    """The ``probe.json`` of a ``pid-<pid>`` folder; None when there is none or it cannot be read."""
    try:
        data = json.loads((Path(folder) / PROBE_JSON).read_text())
    except (OSError, ValueError):
        return None
    return parse_probe(folder, data)


def is_stale(probe: ProbeInfo, process_started: float | None) -> bool:
    """Whether ``probe`` was written by an earlier process with the same pid (it started before this one)."""
    if probe.started is None or process_started is None:
        return False
    return probe.started < process_started - STALE_SLACK_S


def find_probe(
    pid: int, environ: dict[str, str], process_started: float | None = None
) -> tuple[ProbeInfo | None, str]:
    """The probe of process ``pid`` whose environment is ``environ``: (its `ProbeInfo`, what was found).

    The second item says why there is none: no ``NSA_DIAG_PROBE_DIR`` in its environment, no folder for
    it (the probe did not start in this process), an unreadable or stale ``probe.json``.
    """
    probe_dir = environ.get(PROBE_DIR_ENV)
    if not probe_dir:
        return None, f"no probe: {PROBE_DIR_ENV} is not in its environment"
    folder = process_folder(Path(probe_dir), pid)
    if not (folder / PROBE_JSON).exists():
        return None, f"no probe: {folder / PROBE_JSON} does not exist (the probe did not start in it)"
    probe = read_probe(folder)
    if probe is None or probe.pid != pid:
        return None, f"no probe: {folder / PROBE_JSON} cannot be read as this process's probe record"
    if is_stale(probe, process_started):
        return None, f"no probe: {folder / PROBE_JSON} was written by an earlier process with pid {pid}"
    return probe, f"probe in {folder}"


def read_probe_beacon(probe: ProbeInfo) -> BeaconState | None:
    """A consistent read of the probe's beacon, or None when it has none (yet)."""
    return read_beacon(probe.beacon_path)


def read_at_hang(probe: ProbeInfo) -> AtHang | None:
    """The probe's ``at_hang.json`` (collective counts per op, the one under way), or None where there is
    none: it exists only after a watchdog asked for it."""
    try:
        data = json.loads(probe.at_hang_path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def location(probe: ProbeInfo | None, state: BeaconState | None) -> str | None:
    """Where the process is, in words: ``"rank 1, step 5, backward, layers.7"`` (None without a beacon).

    The module is the beacon's; without one the layer number is given (``layer 7``).
    """
    if state is None:
        return None
    parts = []
    if probe is not None and probe.rank is not None:
        parts.append(f"rank {probe.rank}")
    if state.step is not None:
        parts.append(f"step {state.step}")
    if state.phase:
        parts.append(state.phase)
    if state.branch:
        parts.append(f"branch {state.branch}")
    if state.module:
        parts.append(state.module)
    elif state.layer is not None:
        parts.append(f"layer {state.layer}")
    return ", ".join(parts) or None
