"""The timeline (`nsa_diag.analysis.timeline`): progress lines of a case's units as a Chrome trace that
Perfetto opens. Through `nsa-diag report` on a real hung run: test_report_compare.py's
test_report_of_a_hang_shows_where_and_the_stacks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nsa_diag.analysis.timeline import CaseEnd, Track, rows, trace

T0 = 1_700_000_000.0


def line(t: float, phase: str, event: str | None, **fields: Any) -> str:
    return json.dumps({"seq": 0, "t": T0 + t, "phase": phase, "event": event, **fields})


def open_slices(events: list[dict[str, Any]], tid: int) -> list[str]:
    """The slices of unit `tid` still open at the end (begin events; ended ones are complete events)."""
    return [e["name"] for e in events if e.get("tid") == tid and e["ph"] == "B"]


def test_rank_1_stopped_in_backward_while_rank_0_waits_in_all_reduce() -> None:
    rank0 = [
        line(0.0, "setup", None, detail="torch imported"),
        line(1.0, "step", "begin", step=4),
        line(1.1, "forward", "begin", step=4),
        line(1.5, "forward", "end", step=4),
        line(1.5, "backward", "begin", step=4),
        line(1.6, "backward", "begin", step=4, module="all_reduce"),
    ]
    rank1 = [
        line(1.0, "step", "begin", step=4),
        line(1.2, "backward", "begin", step=4),
        line(1.3, "backward", "begin", step=4, layer=1),
        '{"seq": 9, "t": 17000',  # a killed writer's partial last line
    ]
    ends = [CaseEnd("ddp", "hang", "rank 1: python-deadlock", stall_limit_s=5.0)]
    events = trace([Track("ddp", "rank 0", rank0), Track("ddp", "rank 1", rank1)], ends)["traceEvents"]
    names = {(e["name"], e["args"]["name"]) for e in events if e["ph"] == "M"}
    assert names == {("process_name", "ddp"), ("thread_name", "rank 0"), ("thread_name", "rank 1")}
    assert open_slices(events, 1) == ["step 4", "backward", "backward: all_reduce"]
    assert open_slices(events, 2) == ["step 4", "backward", "layer 1 backward"]
    (note,) = [e for e in events if e["ph"] == "i" and e["s"] == "t"]
    assert (note["name"], note["ts"]) == ("torch imported", 0.0)  # microseconds from the first event
    stall, verdict = [e for e in events if e["ph"] == "i" and e["s"] == "p"]
    assert stall["name"] == "stall: no progress for 5 s"
    assert stall["ts"] == verdict["ts"] == pytest.approx(1.6e6 + 5e6, abs=1)
    assert verdict["args"]["reason"] == "rank 1: python-deadlock"


def test_cases_are_processes_and_a_passing_case_is_marked_at_its_last_event() -> None:
    a = [
        line(0.0, "step", "begin", step=1),
        line(0.1, "forward", "begin", step=1),
        line(0.2, "forward", "begin", step=1, module="all_gather"),  # its end never logged
        line(0.3, "forward", "end", step=1),
        line(0.5, "step", "end", step=1),
    ]
    b = [line(0.2, "forward", "begin", layer=0), line(0.3, "forward", "end", layer=0)]
    ends = [CaseEnd("a", "pass", "1 step"), CaseEnd("b", "pass", "1 step"), CaseEnd("c", "crash", "no lines")]
    events = trace([Track("a", "worker", a), Track("b", "worker", b)], ends)["traceEvents"]
    slices = [(e["pid"], e["name"], round(e["dur"] / 1e6, 3)) for e in events if e["ph"] == "X"]
    assert slices == [
        (1, "step 1", 0.5),
        (1, "forward", 0.2),
        (1, "forward: all_gather", 0.1),  # ends with the slice around it
        (2, "layer 0 forward", 0.1),
    ]
    assert not [e for e in events if e["ph"] == "B"]
    marks = [(e["pid"], e["ts"], e["name"]) for e in events if e["ph"] == "i"]
    assert marks == [
        (1, pytest.approx(0.5e6, abs=1), "verdict: pass"),
        (2, pytest.approx(0.3e6, abs=1), "verdict: pass"),
    ]  # c has no track: no mark
    assert trace([Track("a", "worker", ["not json", ""])])["traceEvents"] == []


def test_the_picture_has_a_row_per_unit_and_draws(tmp_path: Path) -> None:
    from nsa_diag.plots import plot_timeline

    rank0 = [line(0.0, "step", "begin", step=1), line(0.1, "forward", "begin", step=1)]
    rank1 = [line(0.0, "step", "begin", step=1), line(0.2, "step", "end", step=1)]
    data = trace(
        [Track("ddp", "rank 0", rank0), Track("ddp", "rank 1", rank1)], [CaseEnd("ddp", "hang", "r", 2.0)]
    )
    found, marks, end = rows(data)
    assert [r.label for r in found] == ["ddp / rank 0", "ddp / rank 1"]
    assert [(s.name, s.depth, s.open) for s in found[0].spans] == [("step 1", 0, True), ("forward", 1, True)]
    assert found[0].spans[0].end_s == end == pytest.approx(2.2)  # open: to the end (the stall's mark)
    assert [name for _, name in marks] == ["stall: no progress for 2 s", "verdict: hang"]
    path = plot_timeline(found, marks, end, tmp_path / "timeline.png")
    assert path.read_bytes().startswith(b"\x89PNG")
