"""What a watched job is doing, said while it runs (issue 48): `watch` has no time box, so a person learns
"slow, not hung" from this line, not from the job being stopped.

`JobStatus` is fed the training processes' furthest beacon at every poll of the watchdog (the executor's
``on_progress``) and writes one line to stderr now and then: every `EVERY_S` seconds (`EVERY_TTY_S` on a
terminal), and at once when the job goes quiet for `QUIET_S` seconds or comes back::

    nsa-diag watch 5m00s: step 1234 · backward · 3.2 steps/s (last 100 steps) · steps 1.8x slower than
    the first 100 · ETA 4m10s (from the trend, step 2000 of 2000)
    nsa-diag watch 5m40s: step 1301 · no progress for 12 s: writing or reading a checkpoint

Its memory is bounded: the first `FIRST_STEPS` step times and the last `LAST_STEPS`. The trend is the
mean step of the last steps against the first; the ETA, where the total steps are known (``--total-steps``),
extrapolates the last steps' durations along their straight-line fit, so a job slowing down gets the time
it will really need, not its mean rate's.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import TextIO

from nsa_diag.beacon import FLAG_DATALOADER, FLAG_DISTRIBUTED, FLAG_SAVING, BeaconState
from nsa_diag.render import describe_state
from nsa_diag.watchdog import steps_done

EVERY_S = 60.0  # a batch job's log: a line a minute
EVERY_TTY_S = 20.0
QUIET_S = 10.0  # no progress event for this long: said at once, with what the beacon knows of why
FIRST_STEPS = 100
LAST_STEPS = 100
TREND_MIN_STEPS = 20  # fewer steps on either side: no trend
SLOWER = 1.3  # the last steps' mean this much over the first steps': "slower"


def _duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _why_quiet(state: BeaconState) -> str | None:
    """What the training process's main thread was in when it last moved (the probe's flags)."""
    if state.flags & FLAG_SAVING:
        return "writing or reading a checkpoint"
    if state.flags & FLAG_DATALOADER:
        return "waiting for its next batch from the DataLoader"
    if state.flags & FLAG_DISTRIBUTED:
        return "in torch.distributed (a collective or the rendezvous)"
    return None


class JobStatus:
    """The ``on_progress`` of a watched job: one status line on ``err`` now and then (module docstring)."""

    def __init__(
        self, err: TextIO | None = None, total_steps: int | None = None, every_s: float | None = None
    ):
        self.err = err if err is not None else sys.stderr
        self.total = total_steps
        tty = hasattr(self.err, "isatty") and self.err.isatty()
        self.every_s = every_s if every_s is not None else (EVERY_TTY_S if tty else EVERY_S)
        self.first: list[float] = []  # the first steps' durations
        self.last: collections.deque[tuple[int, float]] = collections.deque(maxlen=LAST_STEPS)
        self.done = 0
        self.step_end: float | None = None  # when the last step was first seen done
        self.said_at = time.monotonic()
        self.quiet = False
        self.lines = 0

    def __call__(self, state: BeaconState | None, elapsed: float) -> None:
        now = time.time()
        done = steps_done(state, sys.maxsize) if state is not None else 0
        if done > self.done:
            if self.step_end is not None and done == self.done + 1:
                self._step(done, now - self.step_end)
            self.done, self.step_end = done, now
        silent = now - state.time if state is not None and state.seq > 1 else None
        quiet = silent is not None and silent >= QUIET_S
        due = time.monotonic() - self.said_at >= self.every_s or quiet != self.quiet
        self.quiet = quiet
        if due:
            self.say(self.line(state, elapsed, silent))

    def _step(self, number: int, seconds: float) -> None:
        if len(self.first) < FIRST_STEPS:
            self.first.append(seconds)
        self.last.append((number, seconds))

    def say(self, text: str) -> None:
        self.said_at = time.monotonic()
        self.lines += 1
        try:
            self.err.write(text + "\n")
            self.err.flush()
        except (OSError, ValueError):  # a closed stderr: the job goes on, the status is only said
            pass

    def rate(self) -> float | None:
        """Steps per second over the last steps."""
        spent = sum(s for _, s in self.last)
        return len(self.last) / spent if self.last and spent > 0 else None

    def slowdown(self) -> float | None:
        """The last steps' mean over the first steps' (None: too few steps, or the two sets overlap)."""
        if len(self.first) < TREND_MIN_STEPS or len(self.last) < TREND_MIN_STEPS:
            return None
        if self.last[0][0] <= len(self.first):
            return None
        first = sum(self.first) / len(self.first)
        last = sum(s for _, s in self.last) / len(self.last)
        return last / first if first > 0 else None

    def eta_s(self) -> float | None:
        """Seconds to the total steps, from the last steps' straight-line trend (never below their mean)."""
        if self.total is None or len(self.last) < 2 or self.done >= self.total:
            return None
        xs = [float(n) for n, _ in self.last]
        ys = [s for _, s in self.last]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else 0.0
        remaining = range(self.done + 1, self.total + 1)
        # the sum of (my + slope (n - mx)) over the remaining steps, at least the mean's
        trend = len(remaining) * my + slope * (sum(remaining) - len(remaining) * mx)
        return max(trend, len(remaining) * min(ys)) if slope >= 0 else len(remaining) * my

    def line(self, state: BeaconState | None, elapsed: float, silent: float | None) -> str:
        parts = [describe_state(state) if state is not None else "starting (no progress reported yet)"]
        rate = self.rate()
        if rate is not None:
            parts.append(f"{rate:.3g} steps/s (last {len(self.last)} steps)")
        slower = self.slowdown()
        if slower is not None and slower >= SLOWER:
            parts.append(f"steps {slower:.1f}x slower than the first {len(self.first)}")
        eta = self.eta_s()
        if eta is not None:
            parts.append(f"ETA {_duration(eta)} (from the trend, {self.total} steps)")
        if silent is not None and silent >= QUIET_S:
            why = _why_quiet(state) if state is not None else None
            parts.append(f"no progress for {silent:.0f} s" + (f": {why}" if why else ""))
        return f"nsa-diag watch {_duration(elapsed)}: " + " · ".join(parts)
