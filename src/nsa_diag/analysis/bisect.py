"""Bisection of a checkpointed layer range (`nsa-diag gc-bisect`): pure logic, no processes.

`smallest_range` finds the smallest contiguous range ``[A, B)`` of layers that, checkpointed alone, still
reproduces a failure: halve, keeping the half that reproduces; when neither half does alone (the failure
needs layers of both), shrink from each end instead. About ``2·log2(L)`` tries while halving works.

`BisectState` is what ``bisect.json`` holds: the starting case, every range tried and its verdict. A
resumed bisection replays the algorithm over the recorded answers, so only the tries not yet made run.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from nsa_diag.records import Parity
from nsa_diag.spec import CaseSpec

STATE_FILE = "bisect.json"


def range_text(start: int, stop: int) -> str:
    return f"{start}:{stop}"


def smallest_range(start: int, stop: int, reproduces: Callable[[int, int], bool]) -> tuple[int, int]:
    """The smallest ``[A, B)`` inside ``[start, stop)`` for which ``reproduces(A, B)`` holds, assuming it
    holds for ``[start, stop)``."""
    lo, hi = start, stop
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if reproduces(lo, mid):
            hi = mid
        elif reproduces(mid, hi):
            lo = mid
        else:
            break
    while hi - lo > 1 and reproduces(lo + 1, hi):
        lo += 1
    while hi - lo > 1 and reproduces(lo, hi - 1):
        hi -= 1
    return lo, hi


class Trial(BaseModel):
    """One case of the bisection: the checkpointed range, the case name and its verdict."""

    model_config = ConfigDict(extra="forbid")

    gc: str  # "none", "all" or "A:B"
    case: str
    verdict: str
    reason: str = ""
    parity: Parity | None = None


class BisectState(BaseModel):
    """``bisect.json``: enough to resume (`--resume RUN_DIR`) and to read the outcome."""

    model_config = ConfigDict(extra="forbid")

    mode: str = "range"  # "range": bisect the verdict; "grads": per-layer gradient comparison
    spec: CaseSpec  # the starting case
    out: str
    layers: int
    start: tuple[int, int]
    target: str | None = None  # the verdict to reproduce
    trials: list[Trial] = Field(default_factory=list)
    conclusion: str | None = None
    found: tuple[int, int] | None = None
    layers_differ: list[int] = Field(default_factory=list)
    done: bool = False

    def trial(self, gc: str) -> Trial | None:
        return next((t for t in self.trials if t.gc == gc), None)
