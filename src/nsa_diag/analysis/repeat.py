"""`--repeat N`: every case N times, and what the repeats say together.

Repeat i of the case `c` runs as the case ``c-r<i>`` (i = 1..N): its own folder ``cases/c-r<i>/`` with
spec.json, result.json and replay.sh like any case, the same spec otherwise (so the same spec hash). Tools
that read a run folder (report, compare, matrix --resume) see ordinary cases. summary.json gets a
``repeats`` section, one entry per case:

- ``runs``, ``ok_runs`` and ``counts`` (runs per verdict), ``hang_kinds`` (hangs per kind);
- ``status``: ``pass`` (every run ok), ``fail`` (no run ok) or ``transient`` (some runs ok, some not: the
  failure does not repeat; the case is still not ok);
- ``hang``: how many runs hung, the probability k/n and its 95% Wilson score interval;
- ``time_to_hang_s``: min/median/max over the hung runs of the time until the watchdog called the hang
  (the worker's last progress, measured from its first record, plus the stall limit), and the steps
  (``hang_steps``) at which they hung.

Pure: the time to hang of each hung run comes from the caller (`nsa_diag.session.followups.hang_timing`
reads it from the run's ``progress.jsonl``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from nsa_diag.spec import CaseSpec
from nsa_diag.summary import CaseRepeats, HangOdds, RepeatsSection, Spread

Z_95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


class HangTiming(TypedDict):
    """When a hung run stopped progressing and when the watchdog called it, in seconds from its first
    progress record, and the step it hung in (`nsa_diag.session.followups.hang_timing`)."""

    onset_s: float
    detected_s: float
    step: int | None


def repeat_name(name: str, index: int) -> str:
    """The case name of repeat `index` (1-based) of the case `name`."""
    return f"{name}-r{index}"


def expand(specs: Sequence[CaseSpec], repeat: int) -> tuple[list[CaseSpec], dict[str, str]]:
    """The runs of `specs` repeated `repeat` times (case by case, repeats together) and, per run name, the
    name of its case. With `repeat` 1 the specs are the runs, under their own names."""
    if repeat < 1:
        raise ValueError(f"repeat={repeat} must be at least 1")
    if repeat == 1:
        return list(specs), {spec.name: spec.name for spec in specs}
    runs, base = [], {}
    for spec in specs:
        for index in range(1, repeat + 1):
            name = repeat_name(spec.name, index)
            runs.append(CaseSpec.model_validate({**spec.model_dump(), "name": name}))
            base[name] = spec.name
    return runs, base


def wilson_interval(k: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion k/n (95% by default); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must be between 0 and n={n}")
    p = k / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def spread(values: Sequence[float]) -> Spread | None:
    """min, median and max of `values` (rounded to ms); None when there are none."""
    if not values:
        return None
    return Spread(
        min=round(min(values), 3),
        median=round(statistics.median(values), 3),
        max=round(max(values), 3),
        n=len(values),
    )


def _status(ok_runs: int, runs: int) -> str:
    if runs and ok_runs == runs:
        return "pass"
    return "transient" if ok_runs else "fail"


def case_repeats(
    case: str,
    entries: Sequence[Mapping[str, Any]],
    repeat: int,
    timings: Mapping[str, HangTiming | None] | None = None,
) -> CaseRepeats:
    """The repeats entry of one case from its runs' summary entries (`nsa_diag.summary.CaseEntry` as
    JSON: name, ok, verdict, hang_kind, reason, elapsed_s) and the timing of its hung runs by run name
    (`nsa_diag.session.followups.hang_timing`)."""
    timings = timings or {}
    counts: dict[str, int] = {}
    kinds: dict[str, int] = {}
    reasons: list[str] = []
    for entry in entries:
        counts[entry["verdict"]] = counts.get(entry["verdict"], 0) + 1
        if entry.get("hang_kind"):
            kinds[entry["hang_kind"]] = kinds.get(entry["hang_kind"], 0) + 1
        if not entry["ok"] and entry["reason"] not in reasons:
            reasons.append(entry["reason"])
    runs = len(entries)
    ok_runs = sum(1 for entry in entries if entry["ok"])
    hung = [entry for entry in entries if entry["verdict"] == "hang"]
    low, high = wilson_interval(len(hung), runs)
    hung_timings = [t for e in hung if (t := timings.get(e["name"])) is not None]
    detected = [t["detected_s"] for t in hung_timings]
    status = _status(ok_runs, runs)
    failing = [e for e in entries if not e["ok"]]
    return CaseRepeats(
        case=case,
        repeat=repeat,
        runs=runs,
        ok_runs=ok_runs,
        failed_runs=runs - ok_runs,
        status=status,
        ok=status == "pass" and runs == repeat,
        counts=counts,
        hang_kinds=kinds,
        hang=HangOdds(
            count=len(hung),
            probability=round(len(hung) / runs, 4) if runs else None,
            ci95=[round(low, 4), round(high, 4)],
        ),
        time_to_hang_s=spread(detected),
        hang_steps=[t["step"] for e in hung if (t := timings.get(e["name"])) and t.get("step") is not None],
        elapsed_s=spread([float(e["elapsed_s"]) for e in entries]),
        failing_runs=[e["name"] for e in failing],
        reasons=reasons[:3],
    )


def repeats_section(
    cases: Sequence[Mapping[str, Any]],
    base_of: Mapping[str, str],
    order: Sequence[str],
    repeat: int,
    timings: Mapping[str, HangTiming | None] | None = None,
) -> RepeatsSection:
    """summary.json's ``repeats``: per case (in `order`), `case_repeats` over its runs' entries."""
    grouped: dict[str, list[Mapping[str, Any]]] = {name: [] for name in order}
    for entry in cases:
        base = base_of.get(entry["name"])
        if base in grouped:
            grouped[base].append(entry)
    per_case = [case_repeats(name, grouped[name], repeat, timings) for name in order]
    return RepeatsSection(
        repeat=repeat,
        folders="cases/<case>-r<i>, i = 1..repeat",
        transient=[c.case for c in per_case if c.status == "transient"],
        cases=per_case,
    )
