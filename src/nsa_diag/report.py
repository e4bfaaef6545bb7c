"""`nsa-diag report DIR` and the text of `nsa-diag compare`: a run folder as ``report.md`` with PNGs.

``report.md`` holds, in order: the run (command, result, counts), the cases table (verdict, where,
time, tokens/s, peak memory, parity), the repeats (--repeat), a verdict grid per family of a matrix's
axes, memory and time against sequence length with the fitted growth (from scale.json, or from cases
that differ only in S), where each failing case was stopped (hang kind, the first frames of its stack
samples and py-spy's native frames), and the environment. PNGs go beside it as ``report-*.png``: one
per verdict grid, the growth plot, the failure locations; without matplotlib the report says why and
keeps its tables. The run folder is read by `nsa_diag.runfolder.load_run`, from the files alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

from nsa_diag import artifacts, render
from nsa_diag.analysis.compare import env_facts
from nsa_diag.analysis.scaling import GrowthFit, describe_fit
from nsa_diag.analysis.sweep import ScaleReport, ScaleSeries, fit_points_note, host_bound_note
from nsa_diag.analysis.timeline import rows as timeline_rows
from nsa_diag.analysis.timeline import trace
from nsa_diag.errors import UsageError
from nsa_diag.runfolder import (
    NO_RESULT,
    NOT_RUN,
    Failure,
    Grid,
    RunFolder,
    axis_text,
    cell_text,
    failure_records,
    length_series,
    load_run,
    timeline_inputs,
    verdict_grids,
)
from nsa_diag.summary import status_text

REPORT_MD = "report.md"
TIMELINE = "timeline.json"  # every case's and rank's progress, for Perfetto (`nsa_diag.analysis.timeline`)
PNG_PREFIX = "report-"
MAX_GRIDS = 16  # beyond this many combinations of the other axes, the flat cases table says it all


# ---------------------------------------------------------------------------------------------- reading


# ------------------------------------------------------------------------------------------ verdict grid


def _grid_markdown(grid: Grid) -> list[str]:
    corner = f"{grid.row_axis} \\ {grid.col_axis}" if grid.col_axis else grid.row_axis
    head = [corner] + ([axis_text(c) for c in grid.cols] if grid.col_axis else ["verdict"])
    rows = [[axis_text(r), *(cell_text(cell) for cell in grid.cells[i])] for i, r in enumerate(grid.rows)]
    return _table(head, rows)


# ------------------------------------------------------------------------------- growth against length


def _fit_line(what: str, fit: GrowthFit | None, x_name: str) -> str:
    return describe_fit(what, fit).replace("x^", f"{x_name}^")


def _series_markdown(series: ScaleSeries) -> list[str]:
    x = series.x
    lines = [f"### {series.name} (branch {series.branch}, backend {series.backend or '-'})", ""]
    rows = []
    for p in series.points:
        tokens, step = p.tokens_per_s, p.step_s
        rows.append(
            [
                str(p.x),
                p.verdict or "-",
                render.format_bytes(p.peak_memory_bytes),
                "-" if step is None else f"{step:.3f} s",
                "-" if tokens is None else f"{tokens:,.0f}",
            ]
        )
    lines += _table([x, "verdict", "peak memory", "forward + backward", "tokens/s"], rows)
    memory_fit = series.memory_fit
    lines += ["", f"- {_fit_line('memory above the fixed part', memory_fit, x)}"]
    note = fit_points_note(series)
    if note:
        lines.append(f"- {note}")
    if memory_fit:
        lines.append(f"- fixed part {render.format_bytes(int(memory_fit.fixed))}")
    bound = host_bound_note(series)
    if bound:
        lines.append(f"- {bound}")
    lines.append(f"- {_fit_line('time', series.time_fit, x)}")
    limit = series.memory_limit
    if limit:
        at = limit.seq_len
        budget = f"{limit.budget_source}, {render.format_bytes(limit.budget_bytes)}"
        lines.append(
            f"- memory runs out at S ≈ {at:,} ({budget})"
            if at
            else f"- memory limit not predictable ({budget})"
        )
    if series.stopped_by:
        lines.append(f"- sweep stopped: {series.stopped_by}")
    return [*lines, ""]


# ------------------------------------------------------------------------------------------ failures


def _failure_markdown(record: Failure, case_dir: str) -> list[str]:
    kind = f" / {record.hang_kind}" if record.hang_kind else ""
    where = f" at {record.where}" if record.where else ""
    expected = " (expected)" if record.expected else ""
    lines = [
        f"### {record.case}: {record.verdict}{kind}{where}{expected}",
        "",
        f"{record.reason}",
        "",
    ]
    facts = []
    if record.stall_limit and record.verdict in ("hang", "slow"):
        facts.append(f"stall limit: {record.stall_limit}")
    if record.cpu_percent is not None:
        facts.append(f"worker CPU {record.cpu_percent:.0f}%")
    if record.main_thread_state:
        facts.append(f"main thread state {record.main_thread_state}")
    if facts:
        lines += ["- " + "; ".join(facts), ""]
    if record.stack:
        lines += [
            f"Main thread, last stack sample (`{case_dir}/{record.stack_file}`):",
            "",
            "```",
            *record.stack,
            "```",
        ]
    if record.native_stack:
        pyspy = Path(record.stack_file).parent / "pyspy.txt"
        lines += ["", f"Main thread with native frames (`{case_dir}/{pyspy.as_posix()}`):", "", "```"]
        lines += [*record.native_stack, "```"]
    return [*lines, ""]


# ---------------------------------------------------------------------------------------- environment


def _fact_text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _nodes_markdown(nodes: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A multi-node run: each node's host and the facts of its env.json that differ from node 0's."""
    if not nodes:
        return []
    first = env_facts(next(iter(nodes.values())))
    rows = []
    for node, env in nodes.items():
        facts = env_facts(env)
        differs = [f"{k}: {_fact_text(v)}" for k, v in facts.items() if v != first[k] and k != "host"]
        rows.append([node, _fact_text(facts["host"]), "; ".join(differs) or "-"])
    head = "Each node's env.json is in nodes/<r>/ (the table above is node 0's)."
    return [
        "### Nodes",
        "",
        head,
        "",
        *_table(["node", "host", f"differs from node {next(iter(nodes))}"], rows),
        "",
    ]


def _env_markdown(env: Mapping[str, Any] | None) -> list[str]:
    if not env:
        return ["No env.json in this run folder.", ""]
    rows = [[k, _fact_text(v)] for k, v in env_facts(env).items()]
    lines = [f"Collected {env.get('collected_at', '?')}.", "", *_table(["fact", "value"], rows), ""]
    # an env.json of an older nsa-diag may hold a secret's value: report.md never repeats it
    recorded = env.get("env_vars") or {}
    variables = {k: v for k, v in recorded.items() if not artifacts.is_secret_name(k)}
    withheld = sorted({*(env.get("env_vars_withheld") or ()), *(set(recorded) - set(variables))})
    if variables:
        lines += [
            "Environment variables (only NSA_*, TORCH_*, NCCL_*, CUDA_*, PYTORCH_*, TRITON_* are kept):",
            "",
        ]
        lines += _table(["variable", "value"], [[k, str(v)] for k, v in variables.items()])
    else:
        lines.append("No NSA_*, TORCH_*, NCCL_*, CUDA_*, PYTORCH_* or TRITON_* variable was set.")
    if withheld:
        lines += ["", f"Withheld (their names say they hold a secret): {', '.join(withheld)}."]
    return [*lines, ""]


# ------------------------------------------------------------------------------------------- markdown


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return [line(head), "|" + "|".join("---" for _ in head) + "|", *(line(row) for row in rows)]


def _case_rows(run: RunFolder) -> tuple[list[str], list[list[str]]]:
    axis_keys = list((run.matrix or {}).get("axes") or {})
    expected = any("expected" in c.entry for c in run.cases)
    tagged = any(c.tags for c in run.cases)
    parity = any(c.entry.get("parity") for c in run.cases)
    head = ["case", *axis_keys] + (["tags"] if tagged else []) + (["expected", "ok"] if expected else [])
    head += ["verdict", "hang kind", "where", "time", "tokens/s", "peak memory"] + (
        ["parity"] if parity else []
    )
    rows = []
    for case in run.cases:
        row = [case.name, *(axis_text(case.axes[k]) if k in case.axes else "-" for k in axis_keys)]
        row += [",".join(case.tags) or "-"] if tagged else []
        if expected:
            exp = case.entry.get("expected") or {}
            text = (exp.get("verdict") or "-") + (f" / {exp['hang_kind']}" if exp.get("hang_kind") else "")
            row += [text, render.ok_text(bool(case.entry.get("ok")), case.verdict)]
        if case.verdict in (NO_RESULT, NOT_RUN):
            row += [case.verdict, "-", case.entry.get("where") or "-", "-", "-", "-"] + (
                ["-"] if parity else []
            )
        else:
            cells = render._cells({**_CELL_DEFAULTS, **case.entry})
            peak = cells["peak memory"]
            if case.entry.get("peak_memory_kind", "") and "memory_stats" in case.entry["peak_memory_kind"]:
                peak += {"hang": " (at hang)", "slow": " (at timeout)"}.get(case.verdict, "")
            row += [case.verdict, case.entry.get("hang_kind") or "-", cells["where"], cells["time"]]
            row += [cells["tokens/s"], peak] + ([cells["parity"]] if parity else [])
        rows.append(row)
    return head, rows


_CELL_DEFAULTS = {
    "where": None,
    "elapsed_s": None,
    "tokens_per_s": None,
    "loss": None,
    "peak_memory_bytes": None,
    "parity": None,
    "verdict": NO_RESULT,
}


def _spread_text(spread: Mapping[str, Any] | None) -> str:
    if not spread:
        return "-"
    return f"{spread['min']:.1f} / {spread['median']:.1f} / {spread['max']:.1f} s"


def _repeats_markdown(repeats: Mapping[str, Any] | None) -> list[str]:
    """summary.json's `repeats` (--repeat N): per case the outcomes over its runs."""
    if not isinstance(repeats, Mapping) or not repeats.get("cases"):
        return []
    rows = []
    for r in repeats["cases"]:
        hang = r.get("hang") or {}
        ci = hang.get("ci95") or [None, None]
        probability = (
            f"{hang['probability']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"
            if isinstance(hang.get("probability"), int | float) and None not in ci
            else "-"
        )
        counts = ", ".join(f"{n} {v}" for v, n in (r.get("counts") or {}).items())
        rows.append(
            [
                r["case"],
                f"{r.get('ok_runs', '?')}/{r.get('runs', '?')}",
                r.get("status", "?"),
                counts or "-",
                probability,
                _spread_text(r.get("time_to_hang_s")),
            ]
        )
    head = ["case", "ok runs", "status", "verdicts", "hang probability [95%]", "time to hang min/median/max"]
    lines = [f"## Repeats ({repeats.get('repeat', '?')} runs per case)", "", *_table(head, rows), ""]
    if repeats.get("transient"):
        lines += [f"Transient (fails in some runs only): {', '.join(repeats['transient'])}.", ""]
    return lines


def _run_lines(run: RunFolder) -> list[str]:
    summary = run.summary or {}
    lines = [f"# nsa-diag {run.command}: `{run.path.name}`", ""]
    lines.append(f"- run folder: `{run.path}`")
    if summary:
        lines.append(f"- command: `{' '.join(summary.get('argv') or [])}`")
        lines.append(
            f"- started {summary.get('started_at', '?')}, "
            f"took {render.format_seconds(summary.get('elapsed_s'))}"
            f"; nsa-diag {summary.get('nsa_diag_version', '?')}"
        )
        counts, left_out = summary.get("counts"), summary.get("left_out")
        result = status_text(
            ok=bool(summary.get("ok")),
            interrupted=bool(summary.get("interrupted")),
            counts=counts if isinstance(counts, Mapping) else {},
            left_out=left_out if isinstance(left_out, Mapping) else {},
        )
        lines.append(f"- result: {result}, exit code {summary.get('exit_code', '?')}")
    elif run.command == "attach":  # its result.json is the tree's, read as one case
        for case in run.cases:
            lines.append(f"- {case.name}: {case.verdict}: {case.entry.get('reason') or '-'}")
        lines.append(
            "- attach reports a state, not a verdict; the processes' evidence is in `processes/<pid>/`"
        )
    elif (run.path / render.SUMMARY_JSON).exists():  # there, but not what nsa-diag writes
        lines.append(f"- {render.SUMMARY_JSON} could not be used (see Notes); read from cases/")
    else:
        lines.append(
            f"- no {render.SUMMARY_JSON}: the run did not finish (was nsa-diag killed?); read from cases/"
        )
    counts: dict[str, int] = {}
    for case in run.cases:
        counts[case.verdict] = counts.get(case.verdict, 0) + 1
    if run.not_run:
        counts["not run"] = len(run.not_run)
    lines.append("- cases: " + (", ".join(f"{n} {verdict}" for verdict, n in counts.items()) or "none"))
    if run.matrix:
        lines.append(f"- matrix: {run.matrix.get('name', '?')} (`{run.matrix.get('file', '?')}`)")
    return [*lines, ""]


def build_report(
    run: RunFolder, plots: Mapping[str, str], plot_error: str | None = None, timeline: str | None = None
) -> str:
    """report.md's text; `plots` maps a section key ("grid-<i>", "scaling", "failures") to a PNG name;
    `timeline`: the trace file written beside it."""
    lines = _run_lines(run)
    head, rows = _case_rows(run)
    lines += ["## Cases", "", *_table(head, rows), ""]
    if timeline:
        lines += [
            f"Timeline: `{timeline}`, every case's and rank's steps, phases and layers, the stall and the "
            "verdict; open it in https://ui.perfetto.dev (or chrome://tracing).",
            "",
        ]
        if "timeline" in plots:
            lines += [f"![progress of each unit]({plots['timeline']})", ""]
    if run.not_run:
        lines += [f"Not run: {', '.join(run.not_run)}.", ""]
    if run.command != "attach":
        lines += ["Every case's files are in `cases/<case>/`; `cases/<case>/replay.sh` runs it again.", ""]
    if run.bisect:
        lines += ["## gc-bisect", "", f"{run.bisect.get('conclusion') or 'not concluded'}", ""]
        trials = run.bisect.get("trials") or []
        lines += _table(
            ["gc", "case", "verdict", "reason"],
            [[t["gc"], t["case"], t["verdict"], t["reason"]] for t in trials],
        )
        lines.append("")
    lines += _repeats_markdown((run.summary or {}).get("repeats"))
    grids = verdict_grids(run)
    if grids:
        lines += ["## Verdict grid", ""]
        if len(grids) > MAX_GRIDS:
            lines += [f"{len(grids)} combinations of the other axes: see the cases table.", ""]
        for index, grid in enumerate(grids[:MAX_GRIDS]):
            if len(grids) > 1:
                lines += [f"### {grid.title}", ""]
            lines += [*_grid_markdown(grid), ""]
            if f"grid-{index}" in plots:
                lines += [f"![verdict grid {grid.title}]({plots[f'grid-{index}']})", ""]
    series = length_series(run)
    if series:
        x_name = series[0].x
        what = "sequence length" if x_name == "seq_len" else x_name
        source = "scale.json" if run.scale else "the cases that differ only in S"
        lines += [f"## Memory and time against {what}", "", f"From {source}.", ""]
        if "scaling" in plots:
            lines += [f"![memory and time against {what}]({plots['scaling']})", ""]
        for s in series:
            lines += _series_markdown(s)
    failures = failure_records(run)
    if failures:
        lines += ["## Failures and hang locations", ""]
        if "failures" in plots:
            lines += [f"![where the cases failed]({plots['failures']})", ""]
        for record in failures:
            lines += _failure_markdown(record, f"cases/{record.case}")
    if plot_error:
        lines += [f"Plots could not be drawn: {plot_error}", ""]
    lines += ["## Environment", "", *_env_markdown(run.env), *_nodes_markdown(run.nodes)]
    if run.notes:
        lines += ["## Notes", "", *(f"- {note}" for note in run.notes), ""]
    return "\n".join(lines).rstrip() + "\n"


def _grid_labels(grid: Grid) -> list[list[str]]:
    return [[cell_text(cell) for cell in row] for row in grid.cells]


def _timeline_png(run: RunFolder, trace_data: Mapping[str, Any]) -> str:
    from nsa_diag import plots

    found, marks, end = timeline_rows(trace_data)
    name = f"{PNG_PREFIX}timeline.png"
    plots.plot_timeline(found, marks, end, run.path / name)
    return name


def draw_plots(run: RunFolder) -> dict[str, str]:
    """The PNGs beside report.md: one per verdict grid, the growth plot, the failure locations."""
    from nsa_diag import plots

    made: dict[str, str] = {}
    for index, grid in enumerate(verdict_grids(run)[:MAX_GRIDS]):
        name = f"{PNG_PREFIX}grid-{index + 1}.png"
        plots.plot_verdict_grid(
            title=grid.title,
            row_axis=grid.row_axis,
            col_axis=grid.col_axis,
            rows=[axis_text(r) for r in grid.rows],
            cols=[axis_text(c) for c in grid.cols] if grid.col_axis else ["verdict"],
            labels=_grid_labels(grid),
            path=run.path / name,
        )
        made[f"grid-{index}"] = name
    series = length_series(run)
    if series:
        name = f"{PNG_PREFIX}scaling.png"
        plots.plot_scale(ScaleReport(series=series), run.path / name)
        made["scaling"] = name
    located = [r for r in failure_records(run) if r.phase or r.layer is not None]
    if located:
        name = f"{PNG_PREFIX}failures.png"
        plots.plot_failure_locations(located, run.path / name)
        made["failures"] = name
    return made


class ReportWritten(TypedDict):
    """What `write_report` wrote (``nsa-diag report --json``): the files, the cases' verdicts, the notes."""

    run_dir: str
    command: str
    report: str
    plots: list[str]
    timeline: str | None
    plot_error: str | None
    cases: int
    counts: dict[str, int]
    not_run: list[str]
    notes: list[str]


def write_report(path: Path) -> ReportWritten:
    """Read the run folder at `path`, write report.md and its PNGs there; what was written."""
    run = load_run(path)
    plot_error = None
    try:
        made = draw_plots(run)
    except Exception as exc:  # the tables stand without the pictures
        made, plot_error = {}, f"{type(exc).__name__}: {exc}"
    tracks, ends = timeline_inputs(run)
    trace_data = trace(tracks, ends) if tracks else None
    timeline = TIMELINE if trace_data else None
    if trace_data and plot_error is None:
        try:
            made["timeline"] = _timeline_png(run, trace_data)
        except Exception as exc:  # the trace file stands without the picture
            plot_error = f"{type(exc).__name__}: {exc}"
    path = run.path / TIMELINE
    try:
        if trace_data:
            artifacts.write_json(path, trace_data)  # JSON: secrets withheld value by value
        path = run.path / REPORT_MD
        artifacts.write_text(path, build_report(run, made, plot_error, timeline))
    except OSError as exc:
        raise UsageError(f"{path}: cannot be written: {exc.strerror or exc}") from None
    counts: dict[str, int] = {}
    for case in run.cases:
        counts[case.verdict] = counts.get(case.verdict, 0) + 1
    return {
        "run_dir": str(run.path),
        "command": run.command,
        "report": str(run.path / REPORT_MD),
        "plots": [str(run.path / name) for name in made.values()],
        "timeline": str(run.path / timeline) if timeline else None,
        "plot_error": plot_error,
        "cases": len(run.cases),
        "counts": counts,
        "not_run": run.not_run,
        "notes": run.notes,
    }


# ------------------------------------------------------------------------------------ compare A B


def _ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _side_text(side: Mapping[str, Any]) -> str:
    verdict = side.get("verdict") or NO_RESULT
    return verdict + (f" ({side['hang_kind']})" if side.get("hang_kind") else "")


def _spec_text(differences: Sequence[Mapping[str, Any]]) -> str:
    return "; ".join(f"{d['field']}: {_fact_text(d['a'])} -> {_fact_text(d['b'])}" for d in differences)


RATIO_HEAD = ("case", "peak memory A", "peak memory B", "memory B/A", "step time B/A", "tokens/s B/A")


def _ratio_cell(case: Mapping[str, Any], key: str) -> str:
    """A B/A cell: the ratio, or "not comparable" (why is in the row's last cell), never a ratio of two
    numbers that measure different things."""
    if key in (case.get("not_comparable") or {}):
        return "not comparable"
    return _ratio_text(case["ratios"][key])


def compare_tables(comparison: Mapping[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The comparison as (title, head, rows) tables: environment, verdicts, ratios."""
    env = comparison["environment"]
    env_rows = [[f["fact"], _fact_text(f["a"]), _fact_text(f["b"])] for f in env["facts"] if f["differs"]]
    env_rows += [[f"${v['name']}", _fact_text(v["a"]), _fact_text(v["b"])] for v in env["env_vars"]]
    for node, node_env in (comparison.get("nodes") or {}).items():  # multi-node runs: node by node
        env_rows += [
            [f"node {node}: {f['fact']}", _fact_text(f["a"]), _fact_text(f["b"])]
            for f in node_env["facts"]
            if f["differs"]
        ]
    case_rows = [
        [
            c["name"],
            _side_text(c["a"]),
            _side_text(c["b"]),
            c["change"],
            _spec_text(c["spec_differences"]) or "-",
        ]
        for c in comparison["cases"]
    ]
    ratio_rows = [
        [
            c["name"],
            render.format_bytes(c["a"]["peak_memory_bytes"]),
            render.format_bytes(c["b"]["peak_memory_bytes"]),
            *(_ratio_cell(c, key) for key in ("peak_memory", "step_time", "tokens_per_s")),
            "; ".join(dict.fromkeys((c.get("not_comparable") or {}).values())) or "-",
        ]
        for c in comparison["cases"]
        if any(v is not None for v in c["ratios"].values()) or c.get("not_comparable")
    ]
    return [
        ("environment differences", ["fact", "A", "B"], env_rows),
        ("verdicts", ["case", "A", "B", "change", "spec differs"], case_rows),
        (
            "B/A",
            [*RATIO_HEAD, "not comparable"],
            ratio_rows,
        ),
    ]


def compare_lines(comparison: Mapping[str, Any]) -> list[str]:
    """The lines under the tables: cases on one side only, the counts and the outcome."""
    lines = []
    env = comparison["environment"]
    for side in ("a", "b"):
        if not env[f"{side}_recorded"]:
            lines.append(f"{side.upper()} has no env.json: its environment is unknown")
    if env["a_recorded"] and env["b_recorded"] and not any(f["differs"] for f in env["facts"]):
        lines.append(
            "environment: no recorded fact differs" + ("" if not env["env_vars"] else " but variables")
        )
    if comparison["only_in_a"]:
        lines.append(f"only in A: {', '.join(comparison['only_in_a'])}")
    if comparison["only_in_b"]:
        lines.append(f"only in B: {', '.join(comparison['only_in_b'])}")
    for side in ("a", "b"):
        lines += [f"{side.upper()}: {note}" for note in comparison[side]["notes"]]
    counts = ", ".join(f"{n} {change}" for change, n in comparison["counts"].items() if n) or "no common case"
    lines.append(f"{len(comparison['cases'])} common case(s): {counts}")
    apart = [c["name"] for c in comparison["cases"] if c.get("not_comparable")]
    if apart:
        lines.append(f"B/A not comparable (why: the table's last column): {', '.join(apart)}")
    if comparison["worse"]:
        lines.append(f"worse in B: {', '.join(comparison['worse'])} (exit code 1)")
    return lines


def render_compare(comparison: Mapping[str, Any], console: Any = None) -> None:
    """The comparison on stdout: three tables, then the one-sided cases and the outcome."""
    from rich.markup import escape
    from rich.table import Table

    console = console or render.stdout_console()
    console.print(
        f"A: {comparison['a']['run_dir']} ({comparison['a']['command']})", markup=False, highlight=False
    )
    console.print(
        f"B: {comparison['b']['run_dir']} ({comparison['b']['command']})", markup=False, highlight=False
    )
    for title, head, rows in compare_tables(comparison):
        if not rows:
            continue
        table = Table(title=title, title_justify="left")
        for column in head:
            table.add_column(column, overflow="fold")
        for row in rows:
            style = {"worse": "bold red", "better": "green"}.get(row[3]) if title == "verdicts" else None
            table.add_row(*(escape(cell) for cell in row), style=style)
        console.print(table)
    for line in compare_lines(comparison):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def compare_markdown(comparison: Mapping[str, Any]) -> str:
    """The comparison as markdown (`compare --out FILE`)."""
    lines = [
        "# nsa-diag compare",
        "",
        f"- A: `{comparison['a']['run_dir']}` ({comparison['a']['command']})",
        f"- B: `{comparison['b']['run_dir']}` ({comparison['b']['command']})",
        "",
    ]
    for title, head, rows in compare_tables(comparison):
        lines += [f"## {title[0].upper()}{title[1:]}", ""]
        lines += [*_table(head, rows), ""] if rows else ["None.", ""]
    lines += ["## Outcome", "", *(f"- {line}" for line in compare_lines(comparison))]
    return "\n".join(lines) + "\n"
