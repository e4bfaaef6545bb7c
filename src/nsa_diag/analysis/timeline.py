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
    if record.get("module"):  # a collective, a check inside the phase
        return f"{phase}: {record['module']}"
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


def _level(record: Mapping[str, Any]) -> int:
    """0: a step, the setup, the pre-flight; 1: a phase of a step (forward, backward, ...); 2: a layer or
    a branch inside a phase."""
    if record.get("layer") is not None or record.get("branch") or record.get("module"):
        return 2
    return 0 if str(record.get("phase")) in ("step", "setup", "pre-flight", "done") else 1


def _key(record: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(record.get(k) for k in ("phase", "step", "layer", "branch", "module"))


def trace(tracks: Sequence[Track], ends: Sequence[CaseEnd] = ()) -> dict[str, Any]:
    """The Chrome trace of `tracks` (times in microseconds from the first event), with `ends` marked.

    A begin is paired with the next end of the same phase, step, layer, branch and module (slices as
    complete events, nested by time); a begin of a slice already open closes the earlier one there; a begin
    without its end stays a begin event, which Perfetto draws as not ended."""
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
        begun: dict[tuple[Any, ...], dict[str, Any]] = {}
        for record in records:
            ts = round((record["t"] - start) * 1e6, 1)
            last[track.case] = max(last.get(track.case, 0.0), ts)
            args = {k: record[k] for k in ("step", "layer", "branch", "module") if record.get(k) is not None}
            key, event = _key(record), record.get("event")
            if event in ("begin", "end") and key in begun:  # its end, or its begin again: it ends here
                closed = begun.pop(key)
                closed.update(ph="X", dur=round(ts - closed["ts"], 1))
                level = closed["args"]["level"]
                for inner in [
                    k for k, e in begun.items() if e["ts"] >= closed["ts"] and e["args"]["level"] > level
                ]:
                    opened = begun.pop(inner)  # its end went unsaid: it ends with the slice around it
                    opened.update(ph="X", dur=round(ts - opened["ts"], 1))
            if event == "begin":
                begun[key] = {
                    "ph": "B", "name": _label(record), "ts": ts, "pid": pid, "tid": tid,
                    "args": {**args, "phase": record.get("phase"), "level": _level(record)},
                }  # fmt: skip
                events.append(begun[key])
            elif event is None and record.get("detail"):
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


@dataclass(frozen=True)
class Span:
    """A slice of the trace: its name, start and end in seconds from the trace's start (an open slice ends
    at the trace's end), its depth (0 a step, 1 a phase, 2 a layer or branch), whether it was still open
    and the phase it is in (forward, backward, ...)."""

    name: str
    start_s: float
    end_s: float
    depth: int
    open: bool
    phase: str | None = None


@dataclass(frozen=True)
class Row:
    """One unit's slices for the picture: ``case / unit`` and its spans."""

    label: str
    spans: list[Span]


def rows(trace_data: Mapping[str, Any]) -> tuple[list[Row], list[tuple[float, str]], float]:
    """The trace as one row per unit (its slices, open ones running to the end), the marks (seconds, name)
    and the trace's end in seconds: what the per-rank picture of report.md draws."""
    events = trace_data.get("traceEvents") or []
    processes = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"
    }
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    end = max((e["ts"] + e.get("dur", 0.0) for e in events if "ts" in e), default=0.0) / 1e6
    spans: dict[tuple[int, int], list[Span]] = {key: [] for key in threads}
    marks = []
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") in ("X", "B") and key in spans:
            stop = (e["ts"] + e["dur"]) / 1e6 if e["ph"] == "X" else end
            args = e.get("args") or {}
            level, phase = int(args.get("level", 1)), args.get("phase")
            spans[key].append(Span(e["name"], e["ts"] / 1e6, stop, level, e["ph"] == "B", phase))
        elif e.get("ph") == "i" and e.get("s") == "p":
            marks.append((e["ts"] / 1e6, e["name"]))
    found = [
        Row(f"{processes.get(pid, '?')} / {threads[(pid, tid)]}", spans[(pid, tid)]) for pid, tid in threads
    ]
    return found, marks, end
