"""Stragglers: a rank of a DDP job that is consistently slower than the others, found before it hangs.

Pure: it takes each rank's per-step times (`Metrics`: ``step_s`` and ``phase_s``) and gives a
`Stragglers` record. DDP synchronises the ranks in backward (the gradient all-reduce), so every rank's
step takes about as long as the slowest one's: the others wait for it inside backward. A rank's *own* time
in a step is therefore its step time less that wait, taken as its backward time beyond the step's
shortest backward (the slowest rank arrives last and waits least). A rank is a straggler when its own time
is at least ``threshold`` times the other ranks' median in most of the steps compared: the steps after
step 1 (the warm-up), at least `MIN_STEPS` of them, or no rank is named (a slower step or two is
noise). Its extra time is placed in the phase where it exceeds the others' median most: forward, the
optimizer, or between steps (data loading, logging: the step's time outside the phases the worker
times). A rank slow inside backward's own computation is not seen this way:
its collectives keep the others waiting in the same phase, so every rank's backward ends together.

`watched_stragglers` asks the same of a user's job under ``nsa-diag watch``: each rank's steps as its
probe timed them (``steps.jsonl``, `nsa_diag.wire.StepTimes`: a step is an optimizer step, its
forward from the model's first block, its backward from ``Tensor.backward``), over the steps every rank
timed, the last `MAX_WATCHED_STEPS` of a long job.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping

from nsa_diag.records import Metrics, PhaseSeconds, StragglerRank, Stragglers
from nsa_diag.wire import StepTimes

# A rank slower in more than this share of the steps compared is consistently slower.
MOST_STEPS = 0.5
MIN_STEPS = 3  # steps compared, after the warm-up
PLACED_PHASES = ("forward", "optimizer", "between steps")
MAX_WATCHED_STEPS = 200  # a watched job's steps compared: the last ones every rank timed


def _phase(metrics: Metrics, phase: str, step: int) -> float:
    phases = metrics.phase_s
    if phases is None:
        return 0.0
    if phase == "between steps":
        timed = sum(_phase(metrics, p, step) for p in ("forward", "backward", "optimizer"))
        return max(0.0, metrics.step_s[step] - timed)
    values = phases.of(phase)
    return values[step] if step < len(values) else 0.0


def _excess(
    per_rank: Mapping[int, Metrics], rank: int, others: list[int], phase: str, steps: list[int]
) -> float:
    """Seconds `rank` spent in `phase` beyond the other ranks' median, summed over `steps`."""
    return sum(
        _phase(per_rank[rank], phase, s) - statistics.median(_phase(per_rank[o], phase, s) for o in others)
        for s in steps
    )


def _straggler(
    per_rank: Mapping[int, Metrics],
    own: Mapping[int, list[float]],
    rank: int,
    steps: list[int],
    threshold: float,
) -> StragglerRank | None:
    """`rank` as a straggler: its own time (`own`, per compared step) against the other ranks' median,
    at `threshold` or more in most steps; None otherwise."""
    others = [o for o in per_rank if o != rank]
    medians = [statistics.median(own[o][i] for o in others) for i in range(len(steps))]
    ratios = [mine / median if median > 0 else 1.0 for mine, median in zip(own[rank], medians, strict=True)]
    extras = [mine - median for mine, median in zip(own[rank], medians, strict=True)]
    slower = sum(ratio >= threshold for ratio in ratios)
    if slower / len(steps) <= MOST_STEPS:
        return None
    excess = {phase: _excess(per_rank, rank, others, phase, steps) for phase in PLACED_PHASES}
    phase, most = max(excess.items(), key=lambda item: item[1])
    total = sum(max(e, 0.0) for e in extras)
    return StragglerRank(
        rank=rank,
        ratio=round(statistics.median(ratios), 3),
        slower_steps=slower,
        steps=len(steps),
        phase=phase if most > 0 and most >= 0.5 * total else None,
        extra_s=round(statistics.median(extras), 6),
    )


def find_stragglers(per_rank: Mapping[int, Metrics], threshold: float) -> Stragglers | None:
    """The ranks whose own step time is at least `threshold` times the others' median in most steps;
    None with fewer than two ranks or no step every rank timed."""
    ranks = sorted(per_rank)
    if len(ranks) < 2:
        return None
    count = min(len(per_rank[r].step_s) for r in ranks)
    if count == 0:
        return None
    steps = list(range(1, count))  # 0-based: step 1, the warm-up, left out
    own: dict[int, list[float]] = {r: [] for r in ranks}
    for s in steps:
        shortest = min(_phase(per_rank[r], "backward", s) for r in ranks)
        for r in ranks:
            wait = _phase(per_rank[r], "backward", s) - shortest
            own[r].append(max(per_rank[r].step_s[s] - wait, 0.0))
    slow = []
    if len(steps) >= MIN_STEPS:
        slow = [found for r in ranks if (found := _straggler(per_rank, own, r, steps, threshold))]
    found = Stragglers(
        threshold=threshold,
        steps=[s + 1 for s in steps],
        own_step_s={str(r): round(statistics.median(own[r]), 6) for r in ranks if own[r]},
        slow=slow,
    )
    if len(steps) < MIN_STEPS:
        found.why = f"{len(steps)} step(s) after the warm-up; {MIN_STEPS} needed to call a rank slower"
    return found


def step_times(lines: Iterable[str]) -> dict[int, StepTimes]:
    """A probe's ``steps.jsonl`` lines by step; a line that is not a step's times is passed over (a line
    cut short when the job was killed)."""
    found: dict[int, StepTimes] = {}
    for line in lines:
        try:
            record = json.loads(line)
            step, seconds = (
                record["step"],
                [record[k] for k in ("step_s", "forward_s", "backward_s", "optimizer_s")],
            )
        except (ValueError, TypeError, KeyError):
            continue
        if isinstance(step, int) and all(isinstance(v, int | float) and v >= 0 for v in seconds):
            found[step] = record
    return found


SLOWDOWN_STEPS = 10  # steps averaged at each end of a run
SLOWDOWN_MIN = 1.5  # the last steps' mean over the first steps': "got slower"


def slowdown(lines: Iterable[str]) -> str | None:
    """Whether a job's steps kept getting slower (a probe's ``steps.jsonl`` lines, in order): the mean of
    its last `SLOWDOWN_STEPS` steps over that of its first (after the first, a warm-up), when at least
    `SLOWDOWN_MIN` and the two sets do not overlap, as "steps got 2.4x slower over the run (steps 2-11:
    0.36 s each, steps 71-80: 0.87 s)"; None otherwise."""
    times = step_times(lines)
    steps = sorted(times)[1:]
    if len(steps) < 2 * SLOWDOWN_STEPS:
        return None
    first, last = steps[:SLOWDOWN_STEPS], steps[-SLOWDOWN_STEPS:]
    mean_first = sum(times[s]["step_s"] for s in first) / len(first)
    mean_last = sum(times[s]["step_s"] for s in last) / len(last)
    if not (mean_first > 0 and mean_last / mean_first >= SLOWDOWN_MIN and math.isfinite(mean_last)):
        return None
    return (
        f"steps got {mean_last / mean_first:.1f}x slower over the run (steps {first[0]}-{first[-1]}: "
        f"{mean_first:.3g} s each, steps {last[0]}-{last[-1]}: {mean_last:.3g} s)"
    )


def watched_stragglers(per_rank: Mapping[int, Iterable[str]], threshold: float) -> Stragglers | None:
    """`find_stragglers` over the ranks of a watched job, from each rank's probe ``steps.jsonl`` lines: the
    steps every rank timed (the last `MAX_WATCHED_STEPS`, the first of them left out as the warm-up), with
    ``steps`` their numbers. None with fewer than two ranks."""
    times = {rank: step_times(lines) for rank, lines in per_rank.items()}
    if len(times) < 2:
        return None
    common = sorted(set.intersection(*(set(t) for t in times.values())))[-MAX_WATCHED_STEPS:]
    metrics = {
        rank: Metrics(
            step_s=[t[s]["step_s"] for s in common],
            phase_s=PhaseSeconds(
                forward=[t[s]["forward_s"] for s in common],
                backward=[t[s]["backward_s"] for s in common],
                optimizer=[t[s]["optimizer_s"] for s in common],
            ),
        )
        for rank, t in times.items()
    }
    found = find_stragglers(metrics, threshold)
    if found is not None:
        found.steps = common[1:]
    return found
