"""What a watched job is doing, said while it runs (issue 48): `watch` has no time box, so a person learns
"slow, not hung" from this line, not from the job being stopped.

`JobStatus` is fed the training processes' furthest beacon at every poll of the watchdog (the executor's
``on_progress``). On a terminal it keeps one live line on the terminal's last row (`LiveLine`), redrawn
every `LIVE_EVERY_S`; otherwise (a batch job's log) it writes one line to stderr now and then: every
`EVERY_S` seconds, and at once when the job goes quiet for `QUIET_S` seconds or comes back::

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
import os
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from nsa_diag.beacon import FLAG_DATALOADER, FLAG_DISTRIBUTED, FLAG_SAVING, BeaconState
from nsa_diag.render import describe_state
from nsa_diag.watchdog import steps_done

EVERY_S = 60.0  # a batch job's log: a line a minute
LIVE_EVERY_S = 1.0  # a terminal's live line
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


def progress_line(states: Sequence[BeaconState], now: float) -> str:
    """What one process's beacon reads over a short look (`nsa-diag attach`'s rounds) say, as watch's line
    says it: where it is, its rate over the look when steps ended in it, and how long it has been quiet
    and in what, when `QUIET_S` or more."""
    first, last = states[0], states[-1]
    parts = [describe_state(last)]
    steps = steps_done(last, sys.maxsize) - steps_done(first, sys.maxsize)
    if steps > 0 and last.time > first.time:
        spent = last.time - first.time
        parts.append(f"{steps / spent:.3g} steps/s ({steps} step(s) in {spent:.1f} s)")
    silent = now - last.time
    if last.seq > 1 and silent >= QUIET_S:
        why = _why_quiet(last)
        parts.append(f"no progress for {silent:.0f} s" + (f": {why}" if why else ""))
    return " · ".join(parts)


class LiveLine:
    """One line kept on a terminal's last row while everything else scrolls above it, as apt's progress
    line is: a scroll region over the other rows (DECSTBM), and each update one write that saves the
    cursor, rewrites the last row and restores the cursor. The job's output (echoed by another process,
    `nsa_diag.logcap`) and nsa-diag's own lines scroll in the region, whoever writes them: no write has to
    wait for another. `close` gives the terminal its whole height back and clears the row."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.rows: int | None = None  # the height the scroll region was set for; None: not set

    def _write(self, text: str) -> bool:
        try:
            os.write(self.fd, text.encode(errors="replace"))
        except OSError:
            return False
        return True

    def draw(self, text: str) -> None:
        try:
            size = os.get_terminal_size(self.fd)
        except OSError:
            return
        rows, cols = size.lines, size.columns
        if rows < 3 or cols < 10:  # no room for a line of its own
            return
        setup = ""
        if self.rows != rows:
            # the first time a new line for room (the cursor then goes back up into the region); after a
            # resize the region again for the new height
            setup = ("\n" if self.rows is None else "") + f"\x1b7\x1b[1;{rows - 1}r\x1b8"
            setup += "\x1b[1A" if self.rows is None else ""
        line = text if len(text) < cols else text[: cols - 4] + "..."
        if self._write(f"{setup}\x1b7\x1b[{rows};1H\x1b[2K{line}\x1b8"):
            self.rows = rows

    def close(self) -> None:
        if self.rows is None:
            return
        try:
            rows = os.get_terminal_size(self.fd).lines
        except OSError:
            rows = self.rows
        self._write(f"\x1b7\x1b[r\x1b[{rows};1H\x1b[2K\x1b8")
        self.rows = None


def _live_fd(err: TextIO) -> int | None:
    """The descriptor of ``err`` when it is a terminal that understands cursor movement, else None."""
    try:
        fd = err.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    if not os.isatty(fd) or os.environ.get("TERM", "") in ("", "dumb"):
        return None
    return fd


class JobStatus:
    """The ``on_progress`` of a watched job: a live line on a terminal, else one status line on ``err`` now
    and then (module docstring). `close` once the job has ended."""

    def __init__(
        self, err: TextIO | None = None, total_steps: int | None = None, every_s: float | None = None
    ):
        self.err = err if err is not None else sys.stderr
        self.total = total_steps
        fd = _live_fd(self.err)
        self.live = LiveLine(fd) if fd is not None else None
        self.every_s = every_s if every_s is not None else (LIVE_EVERY_S if self.live else EVERY_S)
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
        if self.live is not None:
            with_flush = getattr(self.err, "flush", None)
            if with_flush is not None:  # what nsa-diag wrote through the stream first
                with_flush()
            self.live.draw(text)
            return
        try:
            self.err.write(text + "\n")
            self.err.flush()
        except (OSError, ValueError):  # a closed stderr: the job goes on, the status is only said
            pass

    def close(self) -> None:
        """The job has ended: a live line goes (the terminal gets its last row back)."""
        if self.live is not None:
            self.live.close()

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
