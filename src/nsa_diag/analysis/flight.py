"""What a job's flight recorder dumps say about a hang: which rank stopped where (pure: parsed dumps in).

PyTorch's flight recorder keeps, per rank, the last collectives each process group entered (its sequence
number in the group, the op, the input sizes and dtypes, a state and the Python stack of the call). Across
the ranks of one group the sequence numbers line up: the n-th collective of a group is the same call on
every rank, unless the ranks took different paths. So, per group:

- the **frontier**: the furthest collective any rank entered; the ranks whose last one is older **never
  entered** it (the ranks the others wait for: the culprits, PyTorch's own ``fr_trace`` rule);
- a **desync**: the first sequence number at which the ranks' calls differ (op, sizes or dtypes). The ranks
  outside the largest group of equal calls are the culprits; where the groups tie, the ranks whose call
  site there (the innermost frame outside torch) is new to them in that group, e.g. a rank-dependent branch
  that took another collective;
- ranks of the job **without a dump** (``world_size``, or the group's member list where the dump has it):
  their state is unknown; where the ranks that did dump agree and wait at the same collective, the ranks
  without a dump are the likely culprits (a rank that crashed, or hung outside any collective, often writes
  none).

Whether a collective completed is reported as the dump records it; the analysis uses only what each rank
entered (gloo's recorder marks a collective that timed out as completed, and keeps no start).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from nsa_diag.records import FrAnalysis, FrCall, FrGroup


def analyse(dumps: Mapping[int, Mapping[str, Any]], world_size: int | None = None) -> FrAnalysis:
    """The findings of the dumps ``{rank: dump}`` (as `nsa_diag.evidence.flight.read_dumps` returns them)."""
    calls: dict[str, dict[int, dict[int, FrCall]]] = {}  # group -> rank -> seq -> call
    descs: dict[str, str] = {}
    completed: dict[str, dict[int, int | None]] = {}
    members: dict[str, list[int]] = {}
    for rank, dump in sorted(dumps.items()):
        for entry in dump.get("entries") or []:
            found = _call(entry)
            if found is not None:
                group, desc, call = found
                descs.setdefault(group, desc)
                calls.setdefault(group, {}).setdefault(rank, {})[call.seq] = call
        for group, status in (dump.get("pg_status") or {}).items():
            if isinstance(status, Mapping) and isinstance(status.get("last_completed_collective"), int):
                last = status["last_completed_collective"]
                completed.setdefault(str(group), {})[rank] = last if last >= 0 else None
        for group, config in (dump.get("pg_config") or {}).items():
            ranks = _ranks(config.get("ranks") if isinstance(config, Mapping) else None)
            if ranks:
                members.setdefault(str(group), ranks)
    if world_size is None and "0" in members:  # the default group's members: every rank of the job
        world_size = max(members["0"]) + 1
    groups = [
        _group(name, descs.get(name, ""), by_rank, completed.get(name, {}), members.get(name))
        for name, by_rank in sorted(calls.items(), key=lambda kv: _order(kv[0]))
    ]
    missing = [r for r in range(world_size) if r not in dumps] if world_size else []
    culprits = sorted({r for g in groups for r in g.culprits})
    findings = [g.finding for g in groups if g.finding]
    suspects: list[int] = []
    if len(culprits) > 1 and culprits == sorted(dumps):  # every rank waits for another in some group
        waits = "; ".join(
            f"{rank_names(g.never_entered)} never entered {_label(g)} {g.frontier.describe()}"
            for g in groups if g.culprits and g.frontier is not None
        )  # fmt: skip
        findings.append(
            f"every rank waits in a collective another rank never entered ({waits}): the ranks took "
            "different paths, and the dumps alone cannot tell which path is the wrong one (the stacks or "
            "the code at those places can)"
        )
        suspects, culprits = culprits, []
    if missing:
        names = rank_names(missing)
        if culprits or suspects:
            findings.append(f"{names} wrote no dump: what {_them(missing)} did is unknown")
        else:
            waiting = [g for g in groups if g.frontier is not None]
            where = "; ".join(f"{_label(g)} {g.frontier.describe()}" for g in waiting if g.frontier)
            findings.append(
                f"{names} wrote no dump while the ranks that did agree"
                + (f" (furthest: {where})" if where else "")
                + f": {_them(missing)} likely crashed, was killed, or hung outside any collective before the"
                " dump: the likely culprit"
            )
            culprits = list(missing)
    elif world_size is None:
        findings.append(
            "the dumps do not say how many ranks the job had: give --world-size to find ranks without a dump"
        )
    return FrAnalysis(
        ranks=sorted(dumps), world_size=world_size, missing=missing, groups=groups, culprits=culprits,
        suspects=suspects, findings=findings,
    )  # fmt: skip


def _group(
    name: str,
    desc: str,
    by_rank: Mapping[int, Mapping[int, FrCall]],
    completed: Mapping[int, int | None],
    member_ranks: list[int] | None,
) -> FrGroup:
    ranks = sorted(set(by_rank) | ({r for r in member_ranks if r in completed} if member_ranks else set()))
    last = {r: by_rank[r][max(by_rank[r])] for r in ranks if by_rank.get(r)}
    frontier = max(last.values(), key=lambda c: c.seq) if last else None
    group = FrGroup(
        name=name, desc=desc, ranks=ranks, last_entered={str(r): c for r, c in last.items()},
        last_completed={str(r): completed.get(r) for r in ranks}, frontier=frontier,
    )  # fmt: skip
    if frontier is None:
        return group
    behind = [r for r in ranks if r not in last or last[r].seq < frontier.seq]
    group.never_entered = behind
    desync = _first_desync(by_rank, ranks, frontier.seq)
    label = _label(group)
    if desync is not None:
        seq, at = desync
        culprits, why = _desync_culprits(by_rank, at, seq)
        group.desync = {str(r): c for r, c in at.items()}
        group.culprits = culprits
        calls = "; ".join(f"rank {r} {c.op} {c.sizes} at {_site(c)}" for r, c in sorted(at.items()))
        group.finding = f"{label}: the ranks called #{seq} differently ({calls}): {why}"
    elif behind and len(behind) < len(ranks):
        ahead = [r for r in ranks if r not in behind]
        group.culprits = behind
        before = "; ".join(
            f"rank {r}'s last: {last[r].describe()} at {_site(last[r])}" if r in last else f"rank {r}: none"
            for r in behind
        )
        group.finding = (
            f"{label}: {rank_names(behind)} never entered {frontier.describe()} that"
            f" {rank_names(ahead)} entered (at {_site(frontier)}); {before}"
        )
    else:
        every = "" if len(ranks) == 1 else " all"
        group.finding = f"{label}: {rank_names(ranks)}{every} at {frontier.describe()} (at {_site(frontier)})"
    return group


def _first_desync(
    by_rank: Mapping[int, Mapping[int, FrCall]], ranks: list[int], upto: int
) -> tuple[int, dict[int, FrCall]] | None:
    seqs = sorted({s for r in ranks for s in by_rank.get(r, {}) if s <= upto})
    for seq in seqs:
        at = {r: by_rank[r][seq] for r in ranks if seq in by_rank.get(r, {})}
        if len({_signature(c) for c in at.values()}) > 1:
            return seq, at
    return None


def _desync_culprits(
    by_rank: Mapping[int, Mapping[int, FrCall]], at: Mapping[int, FrCall], seq: int
) -> tuple[list[int], str]:
    kinds: dict[tuple[str, str, str], list[int]] = {}
    for rank, call in sorted(at.items()):
        kinds.setdefault(_signature(call), []).append(rank)
    sizes = sorted((len(v) for v in kinds.values()), reverse=True)
    if sizes[0] > sizes[1]:
        majority = max(kinds.values(), key=len)
        minority = sorted(r for r in at if r not in majority)
        return minority, f"{rank_names(minority)} left the call the other ranks made (the minority)"
    # a tie: the ranks whose call site at `seq` is new to them in this group took another path
    new = sorted(
        r for r, call in at.items()
        if _site(call) not in {_site(c) for s, c in by_rank[r].items() if s < seq}
    )  # fmt: skip
    if new and len(new) < len(at):
        return new, (
            f"{rank_names(new)} called it from a place {_them(new)} had not called this group's collectives"
            " from before (a rank-dependent path)"
        )
    return sorted(at), "as many ranks on each side: the dumps cannot tell which path is the wrong one"


def _call(entry: Any) -> tuple[str, str, FrCall] | None:
    if not isinstance(entry, Mapping) or entry.get("is_p2p"):
        return None
    seq = entry.get("collective_seq_id")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq <= 0:
        return None
    group = entry.get("process_group")
    name, desc = ((str(group[0]), str(group[1]) if len(group) > 1 else "")
                  if isinstance(group, (list, tuple)) and group else ("?", ""))  # fmt: skip
    op = str(entry.get("profiling_name") or "?").rpartition(":")[2]  # "nccl:all_reduce" -> all_reduce
    dtypes = entry.get("input_dtypes")
    state = entry.get("state")
    call = FrCall(
        seq=seq, op=op, sizes=_plain(entry.get("input_sizes")),
        dtypes=[str(d) for d in dtypes] if isinstance(dtypes, list) else [],
        state=str(state) if state is not None else None, frames=_frames(entry.get("frames")),
        site=_user_frame(entry.get("frames")),
    )  # fmt: skip
    return name, desc, call


MAX_FRAMES = 12


def _python_frames(frames: Any) -> list[Mapping[str, Any]]:
    # with TORCH_NCCL_TRACE_CPP_STACK the recorder keeps C++ frames too: the Python ones say where
    plain = [f for f in frames if isinstance(f, Mapping)] if isinstance(frames, list) else []
    return [f for f in plain if str(f.get("filename", "")).endswith(".py")]


def _frames(frames: Any) -> list[str]:
    return [_frame(f) for f in _python_frames(frames)[:MAX_FRAMES]]


def _frame(f: Mapping[str, Any]) -> str:
    return f"{f.get('name', '?')} ({PurePath(str(f.get('filename', '?'))).name}:{f.get('line', '?')})"


def _user_frame(frames: Any) -> str | None:
    """The innermost frame outside installed packages (torch's wrappers, typing_extensions') and outside
    nsa-diag's probe (which counts a watched job's collectives from a wrapper): the user's."""
    plain = _python_frames(frames)
    for f in plain:
        parts = PurePath(str(f.get("filename", ""))).parts
        probe = any(parts[i : i + 2] == ("nsa_diag", "probe") for i in range(len(parts) - 1))
        if not {"site-packages", "dist-packages"} & set(parts) and not probe:
            return _frame(f)
    return _frame(plain[0]) if plain else None


def _site(call: FrCall) -> str:
    return call.site or "an unknown place"


def _signature(call: FrCall) -> tuple[str, str, str]:
    return call.op, json.dumps(call.sizes), ",".join(call.dtypes)


def _plain(value: Any) -> list[Any]:
    return json.loads(json.dumps(value, default=str)) if isinstance(value, (list, tuple)) else []


def _ranks(value: Any) -> list[int]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return []
    return [int(r) for r in value if isinstance(r, int)] if isinstance(value, list) else []


def _order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def _label(group: FrGroup) -> str:
    return f"group {group.name}" + (f" ({group.desc})" if group.desc else "")


def rank_names(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 0, 1``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _them(ranks: list[int]) -> str:
    return "it" if len(ranks) == 1 else "they"
