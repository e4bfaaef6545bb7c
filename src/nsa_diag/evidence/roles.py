"""Which process of a job is which: the training process (or each rank), torch's launcher, DataLoader workers,
helpers, a shell (pure functions over what the probe and /proc say).

A verdict is about the training process: the main process of a plain script, or each rank of a distributed
job. The processes around it are reported as what they are, never as the culprit: torchrun's agent waits
on its ranks by design, an idle DataLoader worker waits for indices by design, a shell waits for its child.

`assign_roles` decides, first match wins, for each process of the tree:

- ``dataloader-worker``: its probe saw torch's DataLoader worker loop start (``role`` in probe.json), or a
  stack of it is in ``torch/utils/data/_utils/worker.py``;
- ``launcher``: torchrun / ``python -m torch.distributed.run|launch`` (the probe's ``role``, or its command
  line), or a process without a rank whose children are ranks;
- ``rank``: a process with a rank (RANK, or the probe saw it join a process group) that was not forked from
  a process of the same rank;
- ``shell``: not Python (a shell script, ``bash -c``): judged by its exit status alone;
- ``training``: a Python process with no training process or rank above it (the job's main process), nor
  a launcher of ranks;
- ``helper``: any other Python process (a subprocess of the training process, a compile worker, the
  resource tracker beside the ranks of torch.multiprocessing.spawn).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from nsa_diag.wire import launcher_argv

Role = Literal["training", "rank", "launcher", "dataloader-worker", "helper", "shell"]
TRAINING_ROLES: tuple[Role, ...] = ("training", "rank")


@dataclass(frozen=True)
class ProcessFacts:
    """What is known of one process: its tree position, command line, whether it runs Python, and what its
    probe noted (rank, role, the pid it was forked from); ``stacks``: any stack text taken of it."""

    pid: int
    ppid: int | None = None
    argv: tuple[str, ...] = ()
    python: bool = True
    rank: int | None = None
    role: str | None = None  # the probe's "launcher" / "dataloader-worker", or None
    forked_from: int | None = None
    stacks: str = ""


def _dataloader_worker(p: ProcessFacts) -> bool:
    return p.role == "dataloader-worker" or "torch/utils/data/_utils/worker.py" in p.stacks.replace("\\", "/")


def assign_roles(processes: Sequence[ProcessFacts]) -> dict[int, Role]:
    """The role of every process (module docstring), by pid."""
    by_pid = {p.pid: p for p in processes}
    roles: dict[int, Role] = {}

    def parent_of(p: ProcessFacts) -> ProcessFacts | None:
        ppid = p.forked_from if p.forked_from is not None else p.ppid
        return by_pid.get(ppid) if ppid is not None else None

    def ancestors(p: ProcessFacts) -> list[ProcessFacts]:
        found, seen = [], {p.pid}
        current = parent_of(p)
        while current is not None and current.pid not in seen:
            found.append(current)
            seen.add(current.pid)
            current = parent_of(current)
        return found

    parents = {  # of ranks, without a rank themselves: launchers
        parent.pid
        for p in processes
        if p.rank is not None and (parent := parent_of(p)) is not None and parent.rank is None
    }
    for p in processes:
        parent = parent_of(p)
        if _dataloader_worker(p):
            roles[p.pid] = "dataloader-worker"
        elif p.role == "launcher" or launcher_argv(list(p.argv)) or (p.rank is None and p.pid in parents):
            roles[p.pid] = "launcher"
        elif p.rank is not None and not (parent is not None and parent.rank == p.rank):
            roles[p.pid] = "rank"
        elif not p.python:
            roles[p.pid] = "shell"
    for p in processes:  # the rest, knowing the ranks and launchers
        if p.pid in roles:
            continue
        above = ancestors(p)
        trained = any(a.python and roles.get(a.pid) not in ("launcher", "shell") for a in above)
        # beside ranks under their launcher, a process without a rank is one of its helpers
        # (torch.multiprocessing.spawn's resource tracker)
        beside_ranks = any(a.pid in parents for a in above)
        roles[p.pid] = "helper" if trained or beside_ranks else "training"
    return roles


def describe(role: Role, rank: int | None = None) -> str:
    """``"rank 1"``, ``"the training process"``, ``"a DataLoader worker"``: for reasons and tables."""
    if role == "rank":
        return f"rank {rank}" if rank is not None else "a rank"
    return {
        "training": "the training process",
        "launcher": "torch's launcher (torchrun's agent)",
        "dataloader-worker": "a DataLoader worker",
        "helper": "a helper process",
        "shell": "the shell command",
    }[role]


def training_pids(roles: Mapping[int, Role]) -> list[int]:
    """The pids whose state a verdict is about (training processes and ranks), in pid order."""
    return sorted(pid for pid, role in roles.items() if role in TRAINING_ROLES)
