"""A run's progress as a trace that opens in Perfetto (https://ui.perfetto.dev) or chrome://tracing.

Pure: it takes each unit's progress lines (a case's worker, a watched job, each rank of a ddp case) and the
cases' verdicts, and gives a trace in the Chrome trace event format: one process per case, one thread per
unit, a slice per begun and ended phase (step, forward, backward, a layer, a branch), an instant event per
note (``torch imported``, ``model built``), and, on each case, the stall and the verdict. A unit stopped
inside a phase leaves its slices open: Perfetto draws them to the end of the trace, which shows at a
glance that rank 1 stopped at step 4 in backward while rank 0 waits in all_reduce.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Track:
    """One unit's progress: its case, its name in the case (``worker``, ``rank 1``) and progress.jsonl's
    lines."""

    case: str
    unit: str
    lines: Sequence[str]


@dataclass(frozen=True)
class CaseEnd:
    """How a case ended, for the marks at its end: its verdict, reason, and a hang's stall limit."""

    case: str
    verdict: str
    reason: str
    stall_limit_s: float | None = None


def _label(record: Mapping[str, Any]) -> str:
    phase = str(record.get("phase") or "?")
    if phase == "step" and record.get("step") is not None:
        return f"step {record['step']}"
    if record.get("branch"):
        return f"{record['branch']} ({phase})"
    if record.get("layer") is not None:
        return f"layer {record['layer']} {phase}"
    return phase


def _records(lines: Sequence[str]) -> list[dict[str, Any]]:
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a killed writer leaves at most a partial last line
        if isinstance(record, dict) and isinstance(record.get("t"), int | float):
            records.append(record)
    return records


def trace(tracks: Sequence[Track], ends: Sequence[CaseEnd] = ()) -> dict[str, Any]:
    """The Chrome trace of `tracks` (times in microseconds from the first event), with `ends` marked."""
    per_track = [(track, _records(track.lines)) for track in tracks]
    times = [r["t"] for _, records in per_track for r in records]
    if not times:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    start = min(times)
    cases = list(dict.fromkeys(track.case for track in tracks))
    events: list[dict[str, Any]] = []
    last: dict[str, float] = {}
    for pid, case in enumerate(cases, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": case}})
    for tid, (track, records) in enumerate(per_track, start=1):
        pid = cases.index(track.case) + 1
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track.unit}}
        )
        for record in records:
            ts = round((record["t"] - start) * 1e6, 1)
            last[track.case] = max(last.get(track.case, 0.0), ts)
            args = {k: record[k] for k in ("step", "layer", "branch", "module") if record.get(k) is not None}
            event = record.get("event")
            if event == "begin":
                events.append(
                    {"ph": "B", "name": _label(record), "ts": ts, "pid": pid, "tid": tid, "args": args}
                )
            elif event == "end":
                events.append({"ph": "E", "ts": ts, "pid": pid, "tid": tid})
            elif record.get("detail"):
                name = str(record["detail"])
                events.append(
                    {"ph": "i", "s": "t", "name": name, "ts": ts, "pid": pid, "tid": tid, "args": args}
                )
    for end in ends:
        if end.case not in last:
            continue
        pid = cases.index(end.case) + 1
        ts = last[end.case]
        if end.stall_limit_s is not None and end.verdict == "hang":
            ts = round(ts + end.stall_limit_s * 1e6, 1)
            name = f"stall: no progress for {end.stall_limit_s:g} s"
            events.append({"ph": "i", "s": "p", "name": name, "ts": ts, "pid": pid, "tid": 0})
        name = f"verdict: {end.verdict}"
        events.append(
            {
                "ph": "i",
                "s": "p",
                "name": name,
                "ts": ts,
                "pid": pid,
                "tid": 0,
                "args": {"reason": end.reason},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
