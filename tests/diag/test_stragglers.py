"""Stragglers (`nsa_diag.analysis.stragglers`): a DDP rank whose own step time is consistently above the
other ranks', named with the phase its extra time is in; the ranks that wait for it in backward are not.

The per-step times here are what the ranks of a DDP job record (`Metrics`): the others' wait for the slow
rank shows in their backward (the gradient all-reduce). The real 2-rank job whose rank 1 is slower every
step is test_ddp.py's test_a_rank_slower_every_step_is_named_a_straggler_and_the_job_passes.
"""

from __future__ import annotations

import pytest

from nsa_diag.analysis.stragglers import MIN_STEPS, find_stragglers
from nsa_diag.records import Metrics, PhaseSeconds

STEPS = 6


def rank(forward: float, backward: float, optimizer: float = 0.02, between: float = 0.01) -> Metrics:
    """A rank's metrics, the same times every step; `between`: the step's time outside the timed phases."""
    step = forward + backward + optimizer + between
    return Metrics(
        phase_s=PhaseSeconds(
            forward=[forward] * STEPS, backward=[backward] * STEPS, optimizer=[optimizer] * STEPS
        ),
        step_s=[step] * STEPS,
    )


def test_a_rank_slow_in_forward_is_named_and_the_ranks_waiting_for_it_are_not() -> None:
    # rank 2 spends 0.2 s more in forward; ranks 0 and 1 wait those 0.2 s in backward's all-reduce
    found = find_stragglers({0: rank(0.1, 0.3), 1: rank(0.1, 0.3), 2: rank(0.3, 0.1)}, threshold=1.25)
    assert found is not None
    (slow,) = found.slow
    assert (slow.rank, slow.phase, slow.slower_steps, slow.steps) == (2, "forward", STEPS - 1, STEPS - 1)
    assert slow.ratio == pytest.approx(0.43 / 0.23, rel=1e-3)
    assert slow.extra_s == pytest.approx(0.2)
    assert found.steps == list(range(2, STEPS + 1))  # step 1, the warm-up, left out
    assert found.own_step_s == pytest.approx({"0": 0.23, "1": 0.23, "2": 0.43})
    assert (
        found.describe()
        == f"rank 2: {slow.ratio:.2f}x the other ranks' median step, in forward (5 of 5 steps)"
    )


@pytest.mark.parametrize(
    ("slow_rank", "phase"),
    [
        (rank(0.1, 0.1, optimizer=0.22), "optimizer"),
        (rank(0.1, 0.1, between=0.21), "between steps"),  # data loading, logging
    ],
    ids=["optimizer", "between-steps"],
)
def test_the_extra_time_is_placed_in_its_phase(slow_rank: Metrics, phase: str) -> None:
    found = find_stragglers({0: rank(0.1, 0.3), 1: slow_rank}, threshold=1.25)
    assert found is not None
    assert [(s.rank, s.phase) for s in found.slow] == [(1, phase)]


def test_below_the_threshold_no_rank_is_named() -> None:
    ranks = {0: rank(0.1, 0.3), 1: rank(0.12, 0.28)}  # own steps 0.43 s and 0.41 s: 1.05x
    found = find_stragglers(ranks, threshold=1.25)
    assert found is not None
    assert found.slow == []
    assert found.why is None
    assert find_stragglers(ranks, threshold=1.04).slow[0].rank == 1  # type: ignore[union-attr]


def test_slower_in_a_minority_of_steps_is_noise() -> None:
    slow = rank(0.1, 0.1)
    slow.phase_s.forward[2] = slow.phase_s.forward[3] = 0.4  # type: ignore[union-attr]
    slow.step_s[2] = slow.step_s[3] = 0.53
    found = find_stragglers({0: rank(0.1, 0.1), 1: slow}, threshold=1.25)
    assert found is not None
    assert found.slow == []  # 2 of 5 steps


def test_too_few_steps_say_why_and_one_rank_has_no_others() -> None:
    short = Metrics(phase_s=PhaseSeconds(forward=[0.1, 0.5], backward=[0.1, 0.1]), step_s=[0.2, 0.6])
    other = Metrics(phase_s=PhaseSeconds(forward=[0.1, 0.1], backward=[0.1, 0.5]), step_s=[0.2, 0.6])
    found = find_stragglers({0: other, 1: short}, threshold=1.25)
    assert found is not None
    assert found.slow == []
    assert found.why == f"1 step(s) after the warm-up; {MIN_STEPS} needed to call a rank slower"
    assert find_stragglers({0: rank(0.1, 0.1)}, threshold=1.25) is None
    assert find_stragglers({0: Metrics(), 1: Metrics()}, threshold=1.25) is None
