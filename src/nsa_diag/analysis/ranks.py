"""Cross-rank analysis of a `nsa-diag ddp` case (pure: no processes, no signals, no files).

The torchrun launcher (`nsa_diag.launchers.torchrun`) reads each rank's files and passes them in; here:

- `rank_exit_codes`: torchrun's failure summary (or mp.spawn's exception) on the job's stderr -> each failed
  rank's exit code;
- `collective_state`: from a rank's progress records, the explicit collectives it entered per process group
  and the one it waits in;
- `cross_rank_diff`: each rank's training-thread stack normalised and clustered; the ranks outside the
  largest cluster are the minority (on a tie: the ranks that never entered the training-group collective
  the others wait in, the flight recorder's rule); their first divergent frame;
- `aggregate`: the case's result from the ranks' results (each classified as a single worker's would be):
  the verdict and the rank it comes from (`SEVERITY`; at a hang the minority rank, ``hang_kind``
  collective when ranks wait in collectives), missing gradients per rank and their difference, the
  pre-flight verdict, parameter hashes, buckets, and at a hang the cross-rank stack diff.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nsa_diag.analysis.stragglers import find_stragglers
from nsa_diag.records import (
    CaseEvidence,
    CollectiveState,
    CollectiveWait,
    DdpResult,
    DivergentFrame,
    JobNotes,
    RankDdp,
    RankVerdict,
    StackCluster,
    StackDiff,
    StopReport,
)
from nsa_diag.spec import TRAIN_GROUP, CaseResult, CaseSpec
from nsa_diag.stackframes import ThreadStack, gpu_wait
from nsa_diag.wire import AtHang

# A verdict from several ranks: the case takes the first in this order (a crash explains the rest).
SEVERITY = (
    "crash",
    "error",
    "oom",
    "nonfinite",
    "grad-missing",
    "mismatch",
    "slow",
    "hang",
    "unchecked",
    "skipped",
    "pass",
)


_EXITCODE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


# torch.multiprocessing.spawn's exception when a process it started ended without a Python exception; the
# process index it names is the rank by convention (the first argument spawn gives the function)
_SPAWN_EXIT = re.compile(
    r"ProcessExitedException: process (\d+) terminated with (?:signal (SIG[A-Z0-9]+)|exit code (-?\d+))"
)

_SPAWN_RAISED = re.compile(r"^-- Process (\d+) terminated with the following error:", re.MULTILINE)


def rank_exit_codes(stderr: str) -> dict[int, int]:
    """The ranks' exit codes a launcher wrote on the job's stderr: torchrun's failure summary (``rank : 1
    (local_rank: 1)`` / ``exitcode : -11``), torch.multiprocessing.spawn's ``process 0 terminated with
    signal SIGABRT`` (a signal as its negative number, as torchrun gives it) or ``Process 1 terminated
    with the following error`` (1) -> {rank: code}."""
    codes = {int(r): int(c) for r, c in _EXITCODE.findall(stderr)}
    for index in _SPAWN_RAISED.findall(stderr):
        codes.setdefault(int(index), 1)  # spawn's wrapper exits 1 after the exception
    for index, name, code in _SPAWN_EXIT.findall(stderr):
        if name in signal.Signals.__members__:
            codes.setdefault(int(index), -signal.Signals[name].value)
        elif code:
            codes.setdefault(int(index), int(code))
    return codes


# torch.multiprocessing.spawn's warning as it stops the other processes after one failed
_SPAWN_STOPPED = re.compile(r"Terminating process (\d+) via signal (SIG[A-Z0-9]+)")
# torch's DataLoader, when a worker died by a signal ("Killed": often the kernel's OOM killer)
_WORKER_KILLED_BY = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: ([^.\n]+)")
_BY_DESCRIPTION = {signal.strsignal(s): s for s in signal.Signals if signal.strsignal(s)}


def ends_said(stderr: str) -> dict[int, int]:
    """The processes whose end the job's stderr states: those a launcher said it stopped after a rank
    failed (torch.multiprocessing.spawn's ``Terminating process 4242 via signal SIGTERM``), DataLoader
    workers torch said were killed (``DataLoader worker (pid 4243) is killed by signal: Killed.``) ->
    {pid: the signal as a negative exit code}."""
    ends = {
        int(pid): -signal.Signals[name].value
        for pid, name in _SPAWN_STOPPED.findall(stderr)
        if name in signal.Signals.__members__
    }
    for pid, description in _WORKER_KILLED_BY.findall(stderr):
        if description.strip() in _BY_DESCRIPTION:
            ends.setdefault(int(pid), -_BY_DESCRIPTION[description.strip()].value)
    return ends


# --- the cross-rank diff ------------------------------------------------------------------------------


def collective_state(progress_lines: Sequence[str]) -> CollectiveState:
    """From a rank's progress.jsonl: explicit collectives entered per group, and the one it waits in."""
    entered: dict[str, int] = {}
    waiting: CollectiveWait | None = None
    skipped: list[int | None] = []
    for line in progress_lines:
        if '"collective"' not in line and '"skip-collective"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "skip-collective":
            skipped.append(rec.get("step"))
            continue
        group = rec.get("group")
        if rec.get("event") == "begin":
            if rec.get("n") is not None:
                entered[group] = max(entered.get(group, 0), int(rec["n"]))
            waiting = CollectiveWait(
                group=group, op=rec.get("collective"), n=rec.get("n"), module=rec.get("module")
            )
        elif rec.get("event") == "end":
            waiting = None
    return CollectiveState(entered=entered, waiting=waiting, skipped_at_steps=skipped)


def _signature(thread: ThreadStack) -> tuple[tuple[str, str], ...]:
    """A stack without line numbers or paths, outermost frame first: equal for ranks at the same place."""
    return tuple((os.path.basename(f.file), f.func) for f in reversed(thread.python_frames))


def cross_rank_diff(
    threads: Mapping[int, ThreadStack | None], collectives: Mapping[int, CollectiveState]
) -> StackDiff:
    """Cluster the ranks' training-thread stacks; name the minority ranks and their first divergent frame.

    Largest cluster = majority. On a tie (two ranks, two places) the minority is the ranks that never
    entered the training-group collective another rank waits in (they are the ones waited for); failing
    that, the ranks that wait in no collective at all; failing that, the ranks that do not wait for the GPU
    while the others do (NCCL: a rank whose collective has no partner waits in a device sync).
    """
    sigs = {r: _signature(t) for r, t in threads.items() if t is not None}
    clusters: dict[tuple[tuple[str, str], ...], list[int]] = {}
    for rank, sig in sorted(sigs.items()):
        clusters.setdefault(sig, []).append(rank)
    groups = sorted(clusters.values(), key=lambda ranks: (-len(ranks), ranks))
    out = StackDiff(
        clusters=[
            StackCluster(
                ranks=ranks,
                top=threads[ranks[0]].python_frames[0].short() if threads[ranks[0]].python_frames else None,
            )
            for ranks in groups
        ],
        minority_ranks=[],
        basis="",
    )
    if len(groups) <= 1:
        out.basis = "every rank is at the same frame" if groups else "no stack sample of any rank"
        return out
    majority: list[int] = []
    if len(groups[0]) > len(groups[1]):
        majority = groups[0]
        out.basis = f"stack clusters: {_who(majority)} share one stack"
    else:
        waits = [
            (r, c.waiting) for r, c in collectives.items()
            if c.waiting is not None and c.waiting.group == TRAIN_GROUP and c.waiting.n
        ]  # fmt: skip
        if waits:
            n = max(w.n or 0 for _, w in waits)
            nothing = CollectiveState()
            behind = [r for r in sigs if collectives.get(r, nothing).entered.get(TRAIN_GROUP, 0) < n]
            if behind and len(behind) < len(sigs):
                majority = [r for r in sigs if r not in behind]
                op = next(w.op for _, w in waits if w.n == n)
                out.basis = (
                    f"collective sequence: {_who(majority)} wait(s) in {op} #{n} of the training group, "
                    f"which {_who(behind)} never entered"
                )
        if not majority:
            in_collective = [
                r
                for r, t in threads.items()
                if t is not None and (_in_torch_distributed(t) or _waits(collectives.get(r)))
            ]
            if in_collective and len(in_collective) < len(sigs):
                majority = in_collective
                out.basis = f"{_who(majority)} wait(s) in a collective, the others do not"
        if not majority:
            on_device = [r for r, t in threads.items() if t is not None and gpu_wait(t) is not None]
            if on_device and len(on_device) < len(sigs):
                majority = on_device
                out.basis = (
                    f"{_who(majority)} wait(s) for the GPU, the others do not (an NCCL collective whose "
                    "partner never comes waits on the device)"
                )
    if not majority:
        out.basis = "the ranks split evenly with nothing to tell the odd ones out"
        return out
    minority = sorted(r for r in sigs if r not in majority)
    out.minority_ranks = minority
    out.majority_ranks = sorted(majority)
    ref = threads[majority[0]]
    out.first_divergent_frame = {str(r): _first_divergence(threads[r], ref) for r in minority}
    return out


def _waits(state: CollectiveState | None) -> bool:
    return state is not None and state.waiting is not None


def minority_by_counts(diff: StackDiff, at_hang: Mapping[int, AtHang]) -> None:
    """On a tie of stacks: the ranks that entered fewer calls of the collective the others wait in are the
    minority: the others wait for them. ``at_hang``: each rank's probe counts at the hang (``at_hang.json``:
    ``collectives`` per op, the call under way as ``waiting``). Sets ``minority_ranks``, ``majority_ranks``
    and ``basis`` of ``diff`` (a `cross_rank_diff`) when the counts tell."""
    counts = {r: a.get("collectives") or {} for r, a in at_hang.items()}
    waiting = {w["op"]: w["n"] for a in at_hang.values() if (w := a.get("waiting"))}
    ops = {op for c in counts.values() for op in c}
    if not ops:
        return
    top = {op: max(c.get(op, 0) for c in counts.values()) for op in ops}
    gap = {op: top[op] - min(c.get(op, 0) for c in counts.values()) for op in ops}
    # The op most unevenly called; on a tie, the one a rank waits in (gloo blocks inside the call; NCCL
    # returns at once and waits at a device sync), then the most called.
    op = max(ops, key=lambda o: (gap[o], waiting.get(o, 0), top[o]))
    if gap[op] == 0:
        return
    n, how = top[op], "wait in" if op in waiting else "called"
    behind = sorted(r for r, c in counts.items() if c.get(op, 0) < n)
    callers = sorted(r for r, c in counts.items() if c.get(op, 0))
    if all(gap[o] == 0 for o in ops - {op}) and len(callers) * 2 <= len(counts):
        # An op only some ranks ever called, all else even: they left the common path (a rank that took
        # a barrier for a skipped all_reduce). Under NCCL the others' calls return at once and pair with
        # whatever comes, so the others are not behind; these ranks are the odd ones.
        majority = sorted(r for r in counts if r not in callers)
        diff.minority_ranks, diff.majority_ranks = callers, majority
        diff.basis = (
            f"collective counts: rank(s) {', '.join(map(str, callers))} {how} {op} #{n}, which rank(s) "
            f"{', '.join(map(str, majority))} never called; every other collective even"
        )
        return
    if behind and len(behind) < len(counts):
        majority = sorted(r for r in counts if r not in behind)
        diff.minority_ranks, diff.majority_ranks = behind, majority
        diff.basis = (
            f"collective counts: rank(s) {', '.join(map(str, majority))} {how} {op} #{n}, which rank(s) "
            f"{', '.join(map(str, behind))} never reached"
        )


def minority_hang_kind(
    kinds: Mapping[int, str | None], minority: Sequence[int], counted: bool, current: str | None
) -> str | None:
    """The hang kind of a stuck multi-rank job, from each rank's own kind (by rank) and the minority ranks:
    what the minority is stuck in, unless that is only a wait for the others. ``counted``: the minority came
    from the probe's collective counts (`minority_by_counts`); ``current``: the kind so far."""
    own = {kinds.get(r) for r in minority} - {None, "collective", "unknown"}
    if (
        counted
        and own <= {"cuda-kernel"}
        and set(kinds.values()) <= {"cuda-kernel", "collective", "unknown", None}
    ):
        # The ranks' collectives disagree and they wait on the GPU: an NCCL collective that has no partner
        # spins in its kernel (a device sync shows "waiting for the GPU"), so this is a collective hang.
        return "collective"
    if own:
        return sorted(own)[0]  # type: ignore[type-var]
    if "collective" in kinds.values():
        return "collective"
    return current


def _in_torch_distributed(thread: ThreadStack) -> bool:
    return any("torch/distributed/" in f.file.replace("\\", "/") for f in thread.python_frames)


def _first_divergence(thread: ThreadStack, ref: ThreadStack) -> DivergentFrame:
    mine, theirs = list(reversed(thread.python_frames)), list(reversed(ref.python_frames))
    for i, frame in enumerate(mine):
        other = theirs[i] if i < len(theirs) else None
        if other is None or (os.path.basename(frame.file), frame.func) != (
            os.path.basename(other.file),
            other.func,
        ):
            return DivergentFrame(frame=frame.short(), majority_frame=other.short() if other else None)
    return DivergentFrame(frame=mine[-1].short() if mine else None, majority_frame=None)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _who(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0, 2``."""
    return f"rank {_ranks(ranks)}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"


@dataclass(frozen=True)
class RankInputs:
    """What the launcher read of one rank for `aggregate`."""

    ddp_report: RankDdp | None  # the rank's WorkerReport.ddp (None when it wrote none)
    last_thread: ThreadStack | None  # its training thread in its last stack sample
    progress_lines: Sequence[str]  # its progress.jsonl


def aggregate(
    spec: CaseSpec,
    outcome: str,
    per_rank: Mapping[int, CaseResult],
    inputs: Mapping[int, RankInputs],
    decider: int | None,
    stop: StopReport,
    elapsed: float,
    notes: JobNotes,
) -> CaseResult:
    """The case's result from the ranks' results and what was read of each rank (module docstring)."""
    ds = spec.ddp
    assert ds is not None
    ranks = sorted(per_rank)
    reports = {r: inputs[r].ddp_report or RankDdp(rank=r, world_size=ds.world_size) for r in ranks}
    missing = {str(r): per_rank[r].missing_grads for r in ranks if per_rank[r].missing_grads}
    arrival = {
        str(r): {step: info.missing for step, info in reports[r].grad_arrival.items() if info.missing}
        for r in ranks
    }
    arrival = {r: v for r, v in arrival.items() if v}
    ddp = DdpResult(
        nproc=ds.nproc, nnodes=ds.nnodes, node_rank=ds.node_rank, world_size=ds.world_size,
        backend=ds.backend, static_graph=ds.static_graph, find_unused=ds.find_unused,
        bucket_mb=ds.bucket_mb,
        ranks={
            str(r): RankVerdict(verdict=per_rank[r].verdict, reason=per_rank[r].reason,
                                hang_kind=per_rank[r].hang_kind,
                                where=per_rank[r].where.describe() if per_rank[r].where else None,
                                steps_done=per_rank[r].steps_done, exit_code=per_rank[r].exit_code,
                                missing_grads=per_rank[r].missing_grads)
            for r in ranks
        },
        missing_grads=missing,
        grad_arrival_missing=arrival,
    )  # fmt: skip
    if missing:
        every = set.intersection(*(set(v) for v in missing.values())) if len(missing) == len(ranks) else set()
        ddp.missing_grads_diff = {r: sorted(set(v) - every) for r, v in missing.items() if set(v) - every}
        ddp.missing_grads_on_every_rank = sorted(every)
    preflight = next((reports[r].preflight for r in ranks if reports[r].preflight), None)
    if preflight:
        ddp.preflight = preflight
    hashes = next((reports[r].param_hash for r in ranks if reports[r].param_hash), None)
    if hashes:
        ddp.param_hash = hashes
        ddp.params_in_sync = all(len(set(h)) == 1 for h in hashes.values())
    buckets = {str(r): b for r in ranks if (b := reports[r].buckets)}
    if buckets:
        ddp.buckets = buckets
    errors = {str(r): e for r in ranks if (e := reports[r].ddp_error)}
    if errors:
        ddp.ddp_error = errors
    ddp.add(notes)
    ddp.stragglers = find_stragglers({r: per_rank[r].metrics for r in ranks}, ds.straggler_ratio)

    hang_kind = None
    collectives = {r: collective_state(inputs[r].progress_lines) for r in ranks}
    if outcome == "stalled":
        threads = {r: inputs[r].last_thread for r in ranks}
        diff = cross_rank_diff(threads, collectives)
        diff.collectives = {str(r): c for r, c in collectives.items()}
        ddp.stack_diff = diff
        ddp.minority_ranks = diff.minority_ranks
        ddp.first_divergent_frame = diff.first_divergent_frame if "first_divergent_frame" in diff else None
        waiting = {r for r, c in collectives.items() if c.waiting is not None}
        for r in waiting:  # NCCL waits show as a device sync in the stack; the progress record says which
            if per_rank[r].hang_kind not in (None, "collective"):
                ddp.ranks[str(r)].hang_kind_from_stacks = per_rank[r].hang_kind
                ddp.ranks[str(r)].hang_kind = "collective"
        kinds = {r: ddp.ranks[str(r)].hang_kind for r in ranks}
        verdict, hang_kind, reason, source = _hang(per_rank, kinds, diff, decider)
    else:
        verdict, reason, source = _worst(per_rank, outcome)
        lost = left_a_collective(per_rank, collectives)
        if lost is not None and verdict in ("error", "crash"):  # the error is the wait's end, not its cause
            ddp.minority_ranks = lost.culprits
            reason = f"{lost.describe(per_rank)}; {reason}"
            source = lost.culprits[0]
        if ddp.stragglers is not None and ddp.stragglers.slow:  # said even when the job passes
            reason += f"; straggler {ddp.stragglers.describe()}"
    src = per_rank[source]
    return CaseResult(
        name=spec.name,
        spec_hash=spec.spec_hash(),
        verdict=verdict,  # type: ignore[arg-type]
        reason=reason,
        hang_kind=hang_kind,  # type: ignore[arg-type]
        where=src.where,
        elapsed_s=round(elapsed, 3),
        stall_limit_s=src.stall_limit_s,
        stall_reason=reason.partition("; ")[2] or None if verdict == "hang" else None,
        stall_limit_reason=src.stall_limit_reason,
        timeout_s=spec.timeout,
        device=per_rank[ranks[0]].device,
        exit_code=stop.exit_code,
        signal=src.signal,
        steps_done=min(per_rank[r].steps_done for r in ranks),
        metrics=per_rank[ranks[0]].metrics,
        rate=src.rate,
        missing_grads=sorted({n for v in missing.values() for n in v}),
        nonfinite=src.nonfinite,
        parity=src.parity,
        model=next((per_rank[r].model for r in ranks if per_rank[r].model is not None), None),
        evidence=CaseEvidence(
            outcome=outcome,
            stop=stop,
            rank_of_verdict=source,
            ranks={str(r): per_rank[r].evidence for r in ranks},
        ),
        ddp=ddp,
    )


# A collective whose peer went away (gloo's socket closed, NCCL's remote process gone): the rank that
# reports it was waiting for a rank that left, the error is that wait's end
PEER_LOST = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|remote process exited|peer (?:closed|exited)", re.I
)


@dataclass(frozen=True)
class LeftCollective:
    """Ranks that never entered the collective another rank's failed wait was in (`left_a_collective`)."""

    culprits: list[int]
    victims: list[int]
    wait: CollectiveWait
    skipped: dict[int, list[int | None]]

    def describe(self, per_rank: Mapping[int, CaseResult]) -> str:
        w = self.wait
        what = f"{w.op or 'a collective'} #{w.n} of the {w.group} group"
        parts = []
        for r in self.culprits:
            res = per_rank[r]
            how = f"skipped it at step {self.skipped[r][0]} and " if self.skipped.get(r) else ""
            end = f"exited {res.exit_code}" if res.exit_code is not None else f"ended {res.verdict}"
            parts.append(f"rank {r} {how}{end} after {res.steps_done} step(s)")
        return (
            f"{_who(self.culprits)} never entered {what}, which {_who(self.victims)} waited in: "
            f"{'; '.join(parts)}, and the wait ended with the peer gone"
        )


def left_a_collective(
    per_rank: Mapping[int, CaseResult], collectives: Mapping[int, CollectiveState]
) -> LeftCollective | None:
    """A rank failed inside an explicit collective because its peer went away (`PEER_LOST`) while other
    ranks never entered that collective (they entered fewer of its group's): those ranks are the cause,
    the failed wait the consequence. Under gloo a rank that skips a collective and exits ends the others'
    wait with "Connection closed by peer"; under NCCL they would hang instead."""
    victims = [
        r for r in sorted(per_rank)
        if per_rank[r].verdict in ("error", "crash") and PEER_LOST.search(per_rank[r].reason or "")
        and (c := collectives.get(r)) is not None and c.waiting is not None and c.waiting.n is not None
    ]  # fmt: skip
    if not victims:
        return None
    wait = collectives[victims[0]].waiting
    assert wait is not None
    n = wait.n or 0
    entered = {r: c.entered.get(wait.group or "", 0) for r, c in collectives.items()}
    culprits = [r for r in sorted(per_rank) if r not in victims and r in entered and entered[r] < n]
    if not culprits:
        return None
    skipped = {r: list(collectives[r].skipped_at_steps) for r in culprits if collectives[r].skipped_at_steps}
    return LeftCollective(culprits=culprits, victims=victims, wait=wait, skipped=skipped)


def _worst(per_rank: Mapping[int, CaseResult], outcome: str) -> tuple[str, str, int]:
    """The most severe verdict over the ranks, the ranks that share it, and its reason."""

    # A rank stopped by torchrun (SIGTERM) because another failed is a consequence, not the cause.
    def key(r: int) -> tuple[int, int]:
        res = per_rank[r]
        consequence = int(res.verdict == "crash" and res.signal == "SIGTERM")
        return consequence, SEVERITY.index(res.verdict) if res.verdict in SEVERITY else 0

    source = min(per_rank, key=key)
    verdict = per_rank[source].verdict
    same = [r for r in sorted(per_rank) if per_rank[r].verdict == verdict]
    if verdict == "pass":
        reason = f"{len(per_rank)} rank(s) passed: {per_rank[source].reason}"
    else:
        reason = f"{_who(same)}: {per_rank[source].reason}"
        if verdict == "grad-missing" and len(same) > 1:
            differ = {r: per_rank[r].missing_grads for r in same}
            if len({tuple(v) for v in differ.values()}) > 1:
                reason += "; per rank: " + "; ".join(
                    f"rank {r}: {', '.join(v[:3])}" for r, v in differ.items()
                )
    return verdict, reason, source


def _hang(
    per_rank: Mapping[int, CaseResult],
    kinds: Mapping[int, str | None],
    diff: StackDiff,
    decider: int | None,
) -> tuple[str, str | None, str, int]:
    minority = list(diff.minority_ranks)
    minority_kinds = {kinds.get(r) for r in minority} - {None, "collective", "unknown"}
    if minority_kinds:
        kind = sorted(minority_kinds)[0]  # the odd rank's own hang (a deadlock) explains the others' wait
    elif any(k == "collective" for k in kinds.values()):
        kind = "collective"
    else:
        kind = next((k for k in kinds.values() if k), "unknown")
    source = minority[0] if minority else (decider if decider is not None else min(per_rank))
    stalled = per_rank[decider if decider is not None else source]
    idle = stalled.reason.partition(" at ")[0] if stalled.reason.startswith("no progress") else "no progress"
    parts = [f"{idle} on rank {decider if decider is not None else source}"]
    majority = diff.majority_ranks
    if not majority and not minority and stalled.where is not None:  # all alike: say where they are
        parts[0] += f" at {stalled.where.describe()}"
    if majority:
        ref = per_rank[majority[0]]
        parts.append(f"{_who(majority)} at {ref.where.describe() if ref.where else 'an unknown place'}")
    if minority:
        div = diff.first_divergent_frame.get(str(minority[0])) or DivergentFrame()
        src = per_rank[minority[0]]
        text = f"minority {_who(minority)} at {src.where.describe() if src.where else 'an unknown place'}"
        if div.frame:
            text += f", first divergent frame {div.frame}"
            if div.majority_frame:
                text += f" (the others: {div.majority_frame})"
        parts.append(text)
    parts.append(diff.basis)
    why = per_rank[source].reason.partition("; ")[2]
    if why:
        parts.append(f"rank {source}: {why}")
    return "hang", kind, "; ".join(p for p in parts if p), source
