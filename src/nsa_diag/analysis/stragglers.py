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
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from nsa_diag.records import Metrics, StragglerRank, Stragglers

# A rank slower in more than this share of the steps compared is consistently slower.
MOST_STEPS = 0.5
MIN_STEPS = 3  # steps compared, after the warm-up
PLACED_PHASES = ("forward", "optimizer", "between steps")


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
