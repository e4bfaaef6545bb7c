"""Stragglers (`nsa_diag.analysis.stragglers`): a DDP rank whose own step time is consistently above the
other ranks', named with the phase its extra time is in; the ranks that wait for it in backward are not.

The per-step times here are what the ranks of a DDP job record (`Metrics`): the others' wait for the slow
rank shows in their backward (the gradient all-reduce). The real 2-rank job whose rank 1 is slower every
step is test_ddp.py's test_a_rank_slower_every_step_is_named_a_straggler_and_the_job_passes.

Under ``watch`` the same analysis reads each rank's probe ``steps.jsonl`` (`watched_stragglers`): the
recorded files here are those of tests/diag/jobs/ddp_straggler.py's two gloo ranks under watch (each
rank reading a batch in 0.1 s, rank 1 in 0.4 s; with --slow-rank -1, both in 0.1 s); the watched jobs
themselves run in test_watch.py's
test_a_watched_torchrun_rank_slow_in_its_data_loading_is_a_straggler_and_the_job_passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nsa_diag.analysis.stragglers import MIN_STEPS, find_stragglers, slowdown, step_times, watched_stragglers
from nsa_diag.probe.runtime import StepClock
from nsa_diag.records import Metrics, PhaseSeconds

STEPS = 6
RECORDED = Path(__file__).resolve().parent / "recorded" / "steps"


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


# --- a watched job: the probe's step lines ----------------------------------------------------------------


def _recorded(job: str) -> dict[int, list[str]]:
    return {r: (RECORDED / f"{job}.rank{r}.jsonl").read_text().splitlines() for r in (0, 1)}


def test_a_watched_rank_slow_in_its_data_loading_is_named_between_steps_from_its_step_lines() -> None:
    # rank 1's steps take as long as rank 0's (rank 0 waits ~0.3 s in backward's all-reduce), but its own
    # time is its DataLoader's, outside forward, backward and the optimizer
    lines = _recorded("straggler")
    assert [json.loads(line)["backward_s"] > 0.25 for line in lines[0]][2:] == [True] * 6  # the wait
    found = watched_stragglers(lines, threshold=1.25)
    assert found is not None
    assert found.steps == list(range(2, 9))  # the probe's step numbers; step 1, the warm-up, left out
    (slow,) = found.slow
    assert (slow.rank, slow.phase, slow.steps) == (1, "between steps", 7)
    assert slow.slower_steps >= 6
    assert slow.ratio > 2
    assert slow.extra_s == pytest.approx(0.3, abs=0.05)
    assert found.describe().startswith("rank 1: ")
    assert found.describe().endswith("x the other ranks' median step, in between steps (6 of 7 steps)")
    assert watched_stragglers(lines, threshold=100.0).slow == []  # type: ignore[union-attr]


def test_a_healthy_watched_job_names_no_rank() -> None:
    found = watched_stragglers(_recorded("healthy"), threshold=1.25)
    assert found is not None
    assert found.slow == []
    assert found.why is None
    assert set(found.own_step_s) == {"0", "1"}


def test_step_lines_compare_the_steps_every_rank_timed_and_pass_over_broken_lines() -> None:
    lines = _recorded("straggler")
    lines[0] = [*lines[0][:6], lines[0][6][:40], "not json", '{"step": 9}']  # killed mid-line
    assert sorted(step_times(lines[0])) == [1, 2, 3, 4, 5, 6]
    found = watched_stragglers(lines, threshold=1.25)
    assert found is not None
    assert found.steps == [2, 3, 4, 5, 6]
    assert [(s.rank, s.phase) for s in found.slow] == [(1, "between steps")]
    # a long job: its last steps every rank timed
    many = {r: [json.dumps({**json.loads(lines[1][1]), "step": s}) for s in range(1, 500)] for r in (0, 1)}
    # the last 200, the first of them left out as a warm-up
    assert watched_stragglers(many, threshold=1.25).steps == list(range(301, 500))  # type: ignore[union-attr]
    assert watched_stragglers({0: lines[0]}, threshold=1.25) is None  # one rank: no others
    assert watched_stragglers({0: lines[0], 1: []}, threshold=1.25) is None  # a rank that timed no step


def test_the_probes_step_clock_splits_a_step_into_its_phases() -> None:
    clock = StepClock()
    for phase, now in (("forward", 10.0), ("forward", 10.1), ("backward", 10.3), ("recompute", 10.4)):
        clock.saw(phase, now)
    clock.saw("optimizer", 10.7)
    clock.idle(10.8)  # the optimizer step ended
    first = clock.end(1, 10.8)
    assert first is not None
    assert (first["step"], first["step_s"]) == (1, pytest.approx(0.8))  # step 1: from its first event
    assert (first["forward_s"], first["backward_s"], first["optimizer_s"]) == pytest.approx((0.3, 0.4, 0.1))
    clock.saw(None, 11.0)  # a phase of the job's own (logging): not timed
    clock.saw("forward", 11.3)  # after 0.5 s of data loading
    clock.saw("backward", 11.4)
    clock.saw("optimizer", 11.6)
    second = clock.end(2, 11.7)
    assert second is not None
    assert second["step_s"] == pytest.approx(0.9)  # from step 1's end
    assert (second["forward_s"], second["backward_s"], second["optimizer_s"]) == pytest.approx(
        (0.1, 0.2, 0.1)
    )
    assert StepClock().end(1, 5.0) is None  # no event: no start known


def test_a_job_whose_steps_keep_getting_slower_is_said_so() -> None:
    """Issue 48: the slowdown of a passing job, from its probe's steps.jsonl (the first step a warm-up)."""

    def line(n: int, seconds: float) -> str:
        return json.dumps(
            {"step": n, "step_s": seconds, "forward_s": 0.1, "backward_s": 0.1, "optimizer_s": 0.0}
        )

    slowing = [line(n, 0.3 + 0.01 * n) for n in range(1, 81)]
    assert slowdown(["not json", *slowing]) == (
        "steps got 2.9x slower over the run (steps 2-11: 0.365 s each, steps 71-80: 1.06 s)"
    )
    assert slowdown([line(n, 0.3) for n in range(1, 81)]) is None
    assert slowdown(slowing[:15]) is None  # too few steps to say
