"""A run folder read back from its files (`load_run`), and the views of it that report and compare use.

Any command's run folder is read the same way: ``cases/<name>/result.json`` (there for every case, also a
killed or interrupted one) and ``spec.json``, and where present ``summary.json`` (the command line, the
expectations of selftest and matrix cases, the `not_run` list), ``env.json``, ``matrix.json`` (the axes
of a matrix run), ``scale.json`` (a sweep's fits) and ``bisect.json``. A folder with neither a
summary.json nor a case folder is not a run folder: `UsageError`, unless it is an `nsa-diag attach`
folder (its result.json at the top: one case, its state for a verdict). A case folder without a result.json
(nsa-diag itself was killed) is read as `no result`, with the last location of its progress.jsonl; a
case of summary.json's `not_run` or of matrix.json that never started as `not run`.

The views: `verdict_grids` (a matrix's verdicts over its axes), `length_series` (memory and time against
S, from scale.json or from cases that differ only in S, fitted as `nsa-diag scale` fits) and
`failure_records` (where each failing case was stopped, with its stacks).
"""

from __future__ import annotations

import itertools
import json
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

from pydantic import JsonValue

from nsa_diag import artifacts, render
from nsa_diag.analysis.compare import ComparedCase, ComparedRun
from nsa_diag.analysis.sweep import ScalePoint, ScaleReport, ScaleSeries, fit_points, point_record
from nsa_diag.analysis.timeline import CaseEnd, Track
from nsa_diag.errors import UsageError
from nsa_diag.records import CaseEvidence, MainThread, PhaseSeconds
from nsa_diag.spec import CaseResult, CaseSpec, Where
from nsa_diag.summary import CaseEntry

MATRIX_JSON = "matrix.json"
SCALE_JSON = "scale.json"
BISECT_JSON = "bisect.json"
MIN_SERIES_POINTS = 3  # the growth fit with a fixed part needs three lengths
STACK_FRAMES = 8
NO_RESULT = "no result"  # a case folder without result.json: the case never finished (nsa-diag killed)
NOT_RUN = "not run"  # listed in summary.json's not_run or in matrix.json, never started
_RUN_NAME = re.compile(r"^\d{8}-\d{6}-(?P<command>gc-bisect|[a-z]+)")
_FAILED = {"hang", "slow", "crash", "error", "oom", "nonfinite", "grad-missing", "mismatch"}
_WATCHDOG_FIELDS = {"name", "seq_len", "stall", "timeout"}  # not part of what a scaling series computes


JsonObject = dict[str, JsonValue]  # a JSON file's object as read: any version's, or edited by hand


class CaseRow(TypedDict, total=False):
    """A case's row in a run folder read back (`load_run`): summary.json's `CaseEntry` of its result.json
    (the JSON of `CaseEntry.to_json`), summary.json's own row when it has no result, or a stand-in
    (name, ok, verdict None, reason, where, expected); with the last step's time, the timed steps and how
    the stall limit came about."""

    name: str
    ok: bool
    verdict: str | None
    hang_kind: str | None
    reason: str | None
    where: str | None
    elapsed_s: float
    device: str | None
    steps_done: int
    tokens_per_s: float | None
    loss: float | None
    peak_memory_bytes: int | None
    peak_memory_kind: str | None
    parity: JsonObject | None
    rate: JsonObject | None
    missing_grads: list[str]
    nonfinite: JsonObject | None
    dir: str
    replay: str
    stack: list[str]
    stack_file: str
    expected: JsonObject
    model: JsonObject | None
    step_s: float | None
    timed_steps: int | None
    stall_limit_reason: str | None


@dataclass
class CaseRecord:
    """One case of a run folder: its spec and result as found on disk, and its summary row."""

    name: str
    dir: Path
    spec: JsonObject | None
    result: CaseResult | None
    entry: CaseRow
    axes: dict[str, Any] = field(default_factory=dict)  # matrix runs: the values of the axes that made it
    tags: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return self.entry.get("verdict") or NO_RESULT


@dataclass
class RunFolder:
    """A run folder as read back: whatever is missing is None, and `notes` says what could not be read."""

    path: Path
    command: str
    summary: JsonObject | None
    env: dict[str, Any] | None  # env.json: the machine's environment
    cases: list[CaseRecord]
    not_run: list[str]
    matrix: JsonObject | None = None
    scale: ScaleReport | None = None
    bisect: JsonObject | None = None
    notes: list[str] = field(default_factory=list)
    # a multi-node ddp run: each node's env.json (nodes/<r>/env.json) by node rank, "0", "1", ...
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def case(self, name: str) -> CaseRecord | None:
        return next((case for case in self.cases if case.name == name), None)

    def compared(self) -> ComparedRun:
        """What `nsa_diag.analysis.compare.compare_runs` compares of this run."""
        cases = [ComparedCase(case.name, case.entry, case.spec) for case in self.cases]
        return ComparedRun(str(self.path), self.command, cases, self.env, self.nodes, self.notes)


def _read_json(path: Path, notes: list[str]) -> Any:
    """The JSON in `path`, or None when there is none; an unreadable file is noted, not raised (one that
    is not a regular file, too large or nested too deep is skipped unread: `artifacts.read_json`)."""
    if not path.is_symlink() and not path.exists():
        return None
    try:
        return artifacts.read_json(path)
    except artifacts.UnreadableFile as exc:
        notes.append(f"{exc}: skipped")
    except (OSError, ValueError) as exc:
        notes.append(f"{path.name} in {path.parent} cannot be read: {type(exc).__name__}: {exc}")
    return None


def _vet(path: Path, limit: int, notes: list[str]) -> None:
    """Note a file the report would read that is no regular file or too large: its readers skip it."""
    try:
        st = path.stat()
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode):
        notes.append(f"{path}: not a regular file: skipped")
    elif st.st_size > limit:
        notes.append(f"{path}: larger than {limit // 2**20} MiB: skipped")


# The fields of summary.json and matrix.json that readers iterate or index, and the JSON type each must have.
SUMMARY_SHAPE: dict[str, type] = {"command": str, "cases": list, "not_run": list, "argv": list}
MATRIX_SHAPE: dict[str, type] = {"name": str, "file": str, "cases": list, "axes": dict}


def _shaped(data: Any, file: str, shape: Mapping[str, type], notes: list[str]) -> JsonObject | None:
    """`data` if it is a JSON object, less each field of `shape` of another type (noted): a file edited by
    hand, or of another tool, is read as far as it makes sense, never raised on."""
    if data is None:
        return None
    if not isinstance(data, dict):
        notes.append(f"{file} is not a JSON object: ignored")
        return None
    wrong = [key for key, kind in shape.items() if key in data and not isinstance(data[key], kind)]
    for key in wrong:
        notes.append(f"{file}: {key} is not a JSON {_JSON_TYPES[shape[key]]}: ignored")
    return {key: value for key, value in data.items() if key not in wrong}


_JSON_TYPES = {str: "string", list: "array", dict: "object"}


def _memory_at_hang(case_dir: Path) -> tuple[int | None, str | None]:
    """The largest peak in memory_stats.json (written after forward and at a hang) when the result has
    none: a hung case never reaches the end-of-step measurement."""
    try:
        stats = artifacts.read_json(case_dir / artifacts.MEMORY_STATS)
    except (OSError, ValueError):
        return None, None
    for key, kind in (
        ("allocated_bytes.all.peak", "CUDA peak allocated (memory_stats.json)"),
        ("cpu_peak_rss_bytes", "peak RSS of the worker (memory_stats.json)"),
    ):
        values = [m[key] for m in stats.values() if isinstance(m, dict) and isinstance(m.get(key), int)]
        if values:
            return max(values), kind
    return None, None


def _last(values: Sequence[float | None]) -> float | None:
    return values[-1] if values else None


def _timed_steps(step_s: Sequence[float]) -> int | None:
    """The steps a case's step time and tokens/s are over, warm: steps 2.. (step 1 warms up: Triton
    compiles, the allocator settles); 0 for a case of one step, whose timings are its warm-up's; None
    without step times (a job under `watch`)."""
    if not step_s:
        return None
    return len(step_s) - 1


MAX_TIMELINE_RANKS = 1024  # a ddp case's ranks read for the timeline (a folder of more is not ours)


def _progress_lines(path: Path) -> list[str] | None:
    try:
        return artifacts.read_text(path).splitlines()
    except (OSError, ValueError):  # missing, not a regular file, too large
        return None


def timeline_inputs(run: RunFolder) -> tuple[list[Track], list[CaseEnd]]:
    """Each case's progress (its worker's or watched job's ``progress.jsonl``, each rank's under
    ``ranks/<r>/``) and how each case ended, for `nsa_diag.analysis.timeline.trace`."""
    tracks: list[Track] = []
    ends: list[CaseEnd] = []
    for case in run.cases:
        own = _progress_lines(case.dir / artifacts.PROGRESS)
        if own:
            tracks.append(Track(case.name, "worker" if run.command != "watch" else "job", own))
        ranks = case.dir / artifacts.RANKS_DIR
        folders = sorted(
            (p for p in itertools.islice(ranks.iterdir(), MAX_TIMELINE_RANKS) if p.name.isdigit())
            if ranks.is_dir() and not ranks.is_symlink()
            else (),
            key=lambda p: int(p.name),
        )
        for folder in folders:
            lines = _progress_lines(folder / artifacts.PROGRESS)
            if lines:
                tracks.append(Track(case.name, f"rank {folder.name}", lines))
        if case.result is not None:
            result = case.result
            ends.append(CaseEnd(case.name, result.verdict, result.reason, result.stall_limit_s))
    return tracks, ends


def _last_progress(case_dir: Path) -> Where | None:
    """The last location in progress.jsonl: where a case that has no result.json had got to."""
    try:
        lines = artifacts.read_text(case_dir / artifacts.PROGRESS).splitlines()
    except (OSError, ValueError):
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a killed writer leaves at most a partial last line
        if isinstance(record, dict) and record.get("phase") and record.get("event") in ("begin", "end"):
            fields = ("phase", "step", "layer", "branch", "module", "event")
            return Where(**{k: record.get(k) for k in fields})
    return None


def _entry(
    name: str,
    case_dir: Path,
    result: CaseResult | None,
    summary_entry: Mapping[str, Any] | None,
    expected: Mapping[str, Any] | None,
    why: str,
) -> CaseRow:
    """The case's summary row from its result.json (summary.json's own row only when there is none):
    `CaseEntry.of`, plus the peak at a hang from memory_stats.json, the last step's time and how
    the stall limit came about."""
    from nsa_diag.cases import Expectation

    if result is None:
        if summary_entry:
            return cast(CaseRow, dict(summary_entry))
        where = _last_progress(case_dir)
        row = CaseRow(
            name=name,
            ok=False,
            verdict=None,
            hang_kind=None,
            reason=why,
            where=f"last progress: {where.describe()}" if where else None,
        )
        if isinstance(expected, Mapping):
            row["expected"] = dict(expected)
        return row
    expectation = (
        Expectation(name, expected["verdict"], expected.get("hang_kind"))
        if isinstance(expected, Mapping) and expected.get("verdict")
        else None
    )
    entry = cast(
        CaseRow,
        CaseEntry.of(
            result, expectation, stack=lambda stacks_file: render.main_thread_stack(case_dir, stacks_file)
        ).to_json(),
    )
    if entry["peak_memory_bytes"] is None:
        entry["peak_memory_bytes"], entry["peak_memory_kind"] = _memory_at_hang(case_dir)
    entry["step_s"] = _last(result.metrics.step_s)
    entry["timed_steps"] = _timed_steps(result.metrics.step_s)
    entry["stall_limit_reason"] = result.stall_limit_reason
    return entry


def _command(path: Path, summary: Mapping[str, Any] | None) -> str:
    if summary and isinstance(summary.get("command"), str):
        return summary["command"]
    match = _RUN_NAME.match(path.name)
    return match["command"] if match else "unknown"


def _of_type(value: Any, kind: type) -> Any:
    """`value` if it is a `kind` (dict, list), else an empty one."""
    return value if isinstance(value, kind) else kind()


def _named(entry: Mapping[str, Any]) -> bool:
    return isinstance(entry.get("name"), str)


def _attach_run(path: Path, notes: list[str]) -> RunFolder | None:
    """An `nsa-diag attach` run folder (its result.json at the top, no cases/), as a run of one case named
    after the PID attached to: the tree's state stands for a verdict (attach gives none), ok when it was
    progressing; the place, from the process attach focused on. None when `path` is not one."""
    record = _read_json(path / artifacts.RESULT, notes)
    if not isinstance(record, dict) or record.get("command") != "attach":
        return None
    processes = [p for p in _of_type(record.get("processes"), list) if isinstance(p, dict)]
    focus = next((p for p in processes if p.get("pid") == record.get("focus_pid")), None)
    state = record.get("state") if isinstance(record.get("state"), str) else None
    entry = {
        "name": f"pid {record.get('pid', '?')}",
        "ok": state == "progressing",
        "verdict": state,
        "hang_kind": record.get("hang_kind") if isinstance(record.get("hang_kind"), str) else None,
        "reason": record.get("reason") if isinstance(record.get("reason"), str) else None,
        "where": focus.get("location") if focus and isinstance(focus.get("location"), str) else None,
        "elapsed_s": record.get("observed_s") if isinstance(record.get("observed_s"), int | float) else None,
    }
    env = _read_json(path / artifacts.ENV, notes)
    case = CaseRecord(name=entry["name"], dir=path, spec=None, result=None, entry=entry)
    return RunFolder(
        path=path,
        command="attach",
        summary=None,
        env=env if isinstance(env, dict) else None,
        cases=[case],
        not_run=[],
        notes=notes,
    )


def load_run(path: Path) -> RunFolder:
    """Read the run folder at `path`; `UsageError` when it is not one."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"{path}: no such folder (expected an nsa-diag run folder)")
    notes: list[str] = []
    summary = _shaped(
        _read_json(path / render.SUMMARY_JSON, notes), render.SUMMARY_JSON, SUMMARY_SHAPE, notes
    )
    cases_dir = path / "cases"
    folders = {
        p.name: p
        for p in (sorted(cases_dir.iterdir()) if cases_dir.is_dir() else [])
        if p.is_dir() and ((p / artifacts.RESULT).is_file() or (p / artifacts.SPEC).is_file())
    }
    if summary is None and not folders:
        attached = _attach_run(path, notes)
        if attached is not None:
            return attached
        raise UsageError(
            f"{path} is not an nsa-diag run folder "
            f"(no {render.SUMMARY_JSON} and no cases/*/{artifacts.RESULT})"
        )
    matrix = _shaped(_read_json(path / MATRIX_JSON, notes), MATRIX_JSON, MATRIX_SHAPE, notes)
    summary_entries = {
        c["name"]: c for c in (summary or {}).get("cases", []) if isinstance(c, dict) and _named(c)
    }
    matrix_cases = {
        c["name"]: c for c in (matrix or {}).get("cases", []) if isinstance(c, dict) and _named(c)
    }

    summary_not_run = [n for n in (summary or {}).get("not_run") or [] if isinstance(n, str)]
    order = [*summary_entries, *matrix_cases, *sorted(folders), *summary_not_run]
    records: list[CaseRecord] = []
    for name in dict.fromkeys(order):
        case_dir = folders.get(name, cases_dir / name)
        in_matrix = matrix_cases.get(name, {})
        spec = _read_json(case_dir / artifacts.SPEC, notes) if name in folders else None
        raw = _read_json(case_dir / artifacts.RESULT, notes) if name in folders else None
        result, why = None, f"no {artifacts.RESULT}: the case did not finish (was nsa-diag killed?)"
        if name not in folders and name not in summary_entries:
            why = "not run: the run ended before this case" + (" (or --only left it out)" if matrix else "")
        if raw is not None:
            try:
                result = CaseResult.model_validate(raw)
            except ValueError as exc:
                why = f"{artifacts.RESULT} is not a valid result: {' '.join(str(exc).split())[:200]}"
                notes.append(f"case {name}: {why}")
        if name in folders:
            stacks = result.stacks_file() if result is not None else artifacts.STACKS
            for file in {
                artifacts.PROGRESS,
                artifacts.PYSPY,
                stacks,
                str(Path(stacks).parent / artifacts.PYSPY),
            }:
                _vet(case_dir / file, artifacts.TEXT_MAX_BYTES, notes)
            _vet(case_dir / artifacts.MEMORY_STATS, artifacts.JSON_MAX_BYTES, notes)
        expected = (summary_entries.get(name) or {}).get("expected") or in_matrix.get("expect")
        entry = _entry(name, case_dir, result, summary_entries.get(name), expected, why)
        if name not in folders and name not in summary_entries:
            entry["verdict"] = NOT_RUN
        records.append(
            CaseRecord(
                name=name,
                dir=case_dir,
                spec=spec if isinstance(spec, dict) else None,
                result=result,
                entry=entry,
                axes=_of_type(in_matrix.get("axes"), dict),
                tags=[t for t in _of_type(in_matrix.get("tags"), list) if isinstance(t, str)],
            )
        )
    not_run = [r.name for r in records if r.verdict == NOT_RUN]
    env = _read_json(path / artifacts.ENV, notes)
    nodes = {}
    for node_env in sorted((path / artifacts.NODES).glob(f"*/{artifacts.ENV}"), key=lambda p: p.parent.name):
        found = _read_json(node_env, notes)
        if isinstance(found, dict):
            nodes[node_env.parent.name] = found
    scale = _scale(_read_json(path / SCALE_JSON, notes), notes)
    bisect = _read_json(path / BISECT_JSON, notes)
    return RunFolder(
        path=path,
        command=_command(path, summary),
        summary=summary,
        env=env if isinstance(env, dict) else None,
        cases=records,
        not_run=not_run,
        matrix=matrix,
        scale=scale,
        bisect=bisect if isinstance(bisect, dict) else None,
        notes=notes,
        nodes=nodes,
    )


def _scale(data: object, notes: list[str]) -> ScaleReport | None:
    """scale.json as read (None where there is none); one that does not read as a scale report is noted,
    and the series are then fitted from the cases (`length_series`)."""
    if data is None:
        return None
    try:
        return ScaleReport.model_validate(data)
    except ValueError as exc:
        notes.append(f"{SCALE_JSON} is not a scale report: {' '.join(str(exc).split())[:200]}: ignored")
        return None


def axis_text(value: Any) -> str:
    """An axis value as a grid label: lists joined by commas, None as `none`."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ",".join(axis_text(v) for v in value) or "none"
    return str(value)


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def verdict_text(case: CaseRecord) -> str:
    kind = case.entry.get("hang_kind")
    return case.verdict + (f" ({kind})" if kind else "")


@dataclass
class Grid:
    """Verdicts of matrix cases over two of their axes (rows x columns) at fixed values of the others."""

    title: str
    row_axis: str
    col_axis: str | None
    rows: list[Any]
    cols: list[Any]
    cells: list[list[list[CaseRecord]]]  # [row][col] -> the cases there (usually one)


def _values(key: str, cases: Sequence[CaseRecord], declared: Mapping[str, Any]) -> list[Any]:
    """The values `key` takes among `cases`, in the order matrix.json declares them."""
    found: list[Any] = []
    for value in [*(declared.get(key) or []), *(c.axes[key] for c in cases)]:
        if any(_same(c.axes[key], value) for c in cases) and not any(_same(value, f) for f in found):
            found.append(value)
    return found


def verdict_grids(run: RunFolder) -> list[Grid]:
    """The verdict grids of a matrix run. Cases made by the same axes (the top level's, or one entry's)
    form a family: its first axis gives the rows, the second the columns, and each combination of the
    others a grid of its own; a one-axis family is a single column. Listed cases (no axes) are in the
    cases table only."""
    declared = (run.matrix or {}).get("axes") or {}
    families: dict[tuple[str, ...], list[CaseRecord]] = {}
    for case in run.cases:
        if case.axes:
            families.setdefault(tuple(case.axes), []).append(case)
    grids = []
    for keys, cases in families.items():
        row_axis, col_axis, rest = keys[0], (keys[1] if len(keys) > 1 else None), keys[2:]
        rows = _values(row_axis, cases, declared)
        cols = _values(col_axis, cases, declared) if col_axis else [None]
        family = " x ".join(keys) if len(families) > 1 else ""
        for fixed_values in itertools.product(*(_values(k, cases, declared) for k in rest)):
            fixed = dict(zip(rest, fixed_values, strict=True))
            at_fixed = [c for c in cases if all(_same(c.axes[k], v) for k, v in fixed.items())]
            if not at_fixed:
                continue
            cells = [
                [
                    [
                        c
                        for c in at_fixed
                        if _same(c.axes[row_axis], r) and (col_axis is None or _same(c.axes[col_axis], col))
                    ]
                    for col in cols
                ]
                for r in rows
            ]
            where = ", ".join(f"{k}={axis_text(v)}" for k, v in fixed.items())
            title = " at ".join(part for part in (family, where) if part) or "all cases"
            grids.append(Grid(title, row_axis, col_axis, rows, cols, cells))
    return grids


def cell_text(cases: Sequence[CaseRecord]) -> str:
    return " / ".join(verdict_text(c) for c in cases) or "-"


def _flat_spec(spec: Mapping[str, JsonValue]) -> JsonObject:
    flat = {k: v for k, v in spec.items() if k != "overrides"}
    flat.update(spec.get("overrides") or {})
    return flat


def _step_time(result: CaseResult) -> float | None:
    """Forward plus backward of the last step, as `nsa-diag scale` measures it."""
    phases = result.metrics.phase_s or PhaseSeconds()
    fwd, bwd = _last(phases.forward), _last(phases.backward)
    return fwd + bwd if fwd is not None and bwd is not None else None


def _device_total(env: Mapping[str, Any] | None, device: str | None) -> tuple[int, str] | None:
    env = env or {}
    if device and device.startswith("cuda"):
        devices = (env.get("torch") or {}).get("devices") or []
        if devices and isinstance(devices[0].get("total_memory_bytes"), int):
            return devices[0]["total_memory_bytes"], f"{devices[0].get('name', 'GPU')} total (env.json)"
        return None
    total = (env.get("cpu_memory") or {}).get("memory_total_bytes")
    return (total, "total memory of the machine (env.json)") if isinstance(total, int) else None


def _series_point(case: CaseRecord) -> ScalePoint:
    """A passed case as a point of a length series: `sweep.point_record`, the memory estimator's estimate
    (with the phase of its peak) next to the measurement, from spec.json validated as a `CaseSpec`; a
    spec.json that no longer validates (another version's fields) gives the point without an estimate.
    The peak is the case's summary row's where the result has none (memory_stats.json)."""
    assert case.spec is not None
    assert case.result is not None
    result = case.result
    try:
        spec: CaseSpec | None = CaseSpec.model_validate(case.spec)
    except ValueError:
        spec = None
    if spec is not None:
        point = point_record(spec.seq_len, spec, result)
    else:
        point = ScalePoint(
            x=case.spec["seq_len"],
            estimate=None,
            verdict=result.verdict,
            device=result.device,
            step_s=_step_time(result),
            tokens_per_s=result.metrics.tokens_per_s,
        )
    point.case = case.name  # spec.json's name can be another's (a copied case folder)
    if point.peak_memory_bytes is None:
        point.peak_memory_bytes = case.entry.get("peak_memory_bytes")
        point.peak_memory_kind = case.entry.get("peak_memory_kind")
    return point


def length_series(run: RunFolder) -> list[ScaleSeries]:
    """Series of memory and time against S, in scale.json's shape (`plots.plot_scale` draws them).

    From scale.json when the run has one; otherwise from the cases that passed and differ only in S
    (and the watchdog limits), when three lengths or more are there, each fitted as `scale` fits
    (`sweep.fit_points`: CUDA points whose estimated peak is the optimizer step are left out of the
    memory fit), with the memory budget for the limit from env.json, not from this machine.
    """
    if run.scale is not None:
        return run.scale.series
    groups: dict[str, list[CaseRecord]] = {}
    for case in run.cases:
        if case.spec is None or case.result is None or not case.result.passed:
            continue
        key = json.dumps({k: v for k, v in case.spec.items() if k not in _WATCHDOG_FIELDS}, sort_keys=True)
        groups.setdefault(key, []).append(case)
    groups = {k: g for k, g in groups.items() if len({c.spec["seq_len"] for c in g}) >= MIN_SERIES_POINTS}
    flats = [_flat_spec(json.loads(key)) for key in groups]
    varying = sorted({k for f in flats for k in f if any(not _same(f.get(k), g.get(k)) for g in flats)})
    series = []
    for (_key, cases), flat in zip(groups.items(), flats, strict=True):
        points = [_series_point(case) for case in sorted(cases, key=lambda c: c.spec["seq_len"])]
        backends = ",".join(
            f"{b}={flat[f'{b}_backend']}" for b in ("sel", "cmp", "win") if f"{b}_backend" in flat
        )
        found = ScaleSeries(
            name=", ".join(f"{k}={axis_text(flat.get(k))}" for k in varying) or run.command,
            branch=flat.get("force_branch") or "all",
            backend=backends or None,
            x="seq_len",
            points=points,
            stopped_by=None,
        )
        found.add(fit_points(points, "seq_len", lambda device: _device_total(run.env, device)))
        series.append(found)
    return series


def pyspy_main_frames(case_dir: Path, depth: int = STACK_FRAMES) -> list[str]:
    """The innermost frames (native ones included) of the main thread in ``pyspy.txt``."""
    from nsa_diag.evidence.stacks import parse_pyspy

    try:
        text = artifacts.read_text(case_dir / artifacts.PYSPY)
    except (OSError, ValueError):
        return []
    threads = parse_pyspy(text)
    main = next((t for t in threads if t.name == "MainThread"), None) or next(iter(threads), None)
    return [frame.short() for frame in main.frames[:depth]] if main else []


def _location(result: CaseResult) -> Where | None:
    """Where the case stopped; for non-finite values, the module where they first appeared (the beacon
    has moved on to the end of the step by then)."""
    nonfinite = result.nonfinite
    if nonfinite is not None and nonfinite.module is not None:
        layer = re.search(r"blocks\.(\d+)", nonfinite.module)
        phase = "backward" if nonfinite.where == "grad" else "forward"
        return Where(
            phase=phase, step=nonfinite.step, layer=int(layer[1]) if layer else None, module=nonfinite.module
        )
    if result.where is None or result.where.phase == "done":
        return None
    return result.where


@dataclass(frozen=True)
class Failure:
    """Where a failing case went wrong (`failure_records`): its verdict and hang kind, where and why, the
    stall limit, CPU and main thread state at the stall, and its stacks (Python, then native frames)."""

    case: str
    verdict: str
    hang_kind: str | None
    expected: bool  # the case was expected to fail so (selftest, a matrix's expect)
    where: str | None
    phase: str | None
    layer: int | None
    step: int | None
    branch: str | None
    reason: str | None
    stall_limit: str | None
    cpu_percent: float | None
    main_thread_state: str | None
    stack: list[str]
    stack_file: str
    native_stack: list[str]


def failure_records(run: RunFolder) -> list[Failure]:
    """Where each case that failed went wrong: verdict, hang kind, location, why, and its stacks."""
    records = []
    for case in run.cases:
        if case.verdict not in _FAILED and case.verdict != NO_RESULT:
            continue
        result = case.result
        where = _location(result) if result is not None else _last_progress(case.dir)
        evidence = result.evidence if result is not None else CaseEvidence()
        main_thread = evidence.main_thread or MainThread()
        stacks_file = result.stacks_file() if result is not None else artifacts.STACKS
        records.append(
            Failure(
                case=case.name,
                verdict=case.verdict,
                hang_kind=case.entry.get("hang_kind"),
                expected=bool(case.entry.get("expected")) and bool(case.entry.get("ok")),
                where=case.entry.get("where"),
                phase=where.phase if where else None,
                layer=where.layer if where else None,
                step=where.step if where else None,
                branch=where.branch if where else None,
                reason=case.entry.get("reason"),
                stall_limit=result.stall_limit_reason if result is not None else None,
                cpu_percent=evidence.cpu_percent,
                main_thread_state=main_thread.state,
                stack=render.main_thread_stack(case.dir, stacks_file, STACK_FRAMES),
                stack_file=stacks_file,
                native_stack=pyspy_main_frames(case.dir / Path(stacks_file).parent),
            )
        )
    return records
