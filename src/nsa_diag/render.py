"""Output for people and for scripts: Rich tables on stdout, JSON on stdout, diagnostics on stderr.

The environment snapshot (`render_env`); for case commands the live display on stderr (`LiveProgress`),
the result table on stdout (`render_summary`), the run folder's summary.json and summary.md
(`write_summary` of a `nsa_diag.summary.RunSummary`, through `artifacts`), the follow-ups' sections
(`render_follow_ups`) and a sweep's fits (`render_scale`).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from nsa_diag.evidence.env import ENV_VAR_NAMES, ENV_VAR_PREFIXES

if TYPE_CHECKING:
    from rich.console import Console

    from nsa_diag.analysis.sweep import ScalePoint, ScaleReport
    from nsa_diag.records import Parity
    from nsa_diag.spec import CaseResult, CaseSpec
    from nsa_diag.summary import CaseEntry, CaseRepeats, CaseShape, RunSummary

SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"

_SECTION_TITLES = {
    "python": "Python",
    "platform": "Platform",
    "system": "OS, libc, compiler, CPU",
    "cpu_memory": "CPU and memory",
    "torch": "torch",
    "triton": "Triton",
    "nvml": "NVIDIA driver (NVML)",
    "git": "git",
}


PIPE_WIDTH = 160  # stdout into a file or a pipe: wide enough that result rows do not wrap


def discard_closed_stream(stream: TextIO) -> None:
    """The reader of `stream` has gone (``nsa-diag run | head -c 10``): from now on what is written there
    goes to /dev/null, so that neither the next write nor the flush at exit fails. The exit code stays
    the verdict's (Python's recipe, https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


@functools.cache
def _console_class() -> type[Console]:
    from rich.console import Console

    class PipeSafeConsole(Console):
        """Rich's console, except on a closed pipe: Rich then exits 1 (`Console.on_broken_pipe`), which
        turned a passing run piped into ``head`` into a failure; this one stops writing and goes on."""

        def on_broken_pipe(self) -> None:
            self.quiet = True
            discard_closed_stream(self.file)

    return PipeSafeConsole


def stdout_console() -> Console:
    console = _console_class()()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = _console_class()(width=PIPE_WIDTH)
    return console


def stderr_console() -> Console:
    return _console_class()(stderr=True)


def print_line(text: str) -> None:
    """One line on stdout, for a person or a script (no Rich); nothing once the reader has gone."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        discard_closed_stream(sys.stdout)


def print_json(data: Any) -> None:
    """`data` as indented JSON on stdout (no Rich: machines read this)."""
    from nsa_diag import artifacts

    print_line(json.dumps(data, indent=2, default=artifacts.as_json))


def _format_value(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and key.endswith("_bytes"):
        return f"{value / 2**30:.1f} GiB"
    return str(value)


def _rows(section: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, value in section.items():
        if isinstance(value, list):  # devices: one row each
            if not value:
                rows.append((key, "none"))
            for item in value:
                fields = ", ".join(f"{k}={_format_value(k, v)}" for k, v in item.items() if k != "index")
                rows.append((f"{key}[{item.get('index', '?')}]", fields))
        else:
            rows.append((key, _format_value(key, value)))
    return rows


def render_env(snapshot: Mapping[str, Any], console: Console | None = None) -> None:
    """The environment snapshot as two tables: the facts, then the recorded environment variables."""
    from rich.table import Table

    console = console or stdout_console()
    facts = Table(title=f"nsa-diag {snapshot['nsa_diag_version']} environment", title_justify="left")
    facts.add_column("section", style="bold")
    facts.add_column("fact")
    facts.add_column("value", overflow="fold")
    for section, title in _SECTION_TITLES.items():
        for index, (key, value) in enumerate(_rows(snapshot[section])):
            facts.add_row(title if index == 0 else "", key, value)
        facts.add_section()
    facts.add_row("collected at", "", snapshot["collected_at"])
    console.print(facts)

    env_vars = snapshot["env_vars"]
    prefixes = ", ".join([f"{prefix}*" for prefix in ENV_VAR_PREFIXES] + list(ENV_VAR_NAMES))
    variables = Table(
        title="environment variables",
        title_justify="left",
        caption=f"only {prefixes} are recorded, never a secret's value",
        caption_justify="left",
    )
    variables.add_column("name", style="bold")
    variables.add_column("value", overflow="fold")
    for name, value in env_vars.items():
        variables.add_row(name, value)
    for name in snapshot.get("env_vars_withheld") or ():
        variables.add_row(name, "(withheld: the name says it is a secret)")
    if not env_vars and not snapshot.get("env_vars_withheld"):
        variables.add_row("(none set)", "")
    console.print(variables)


# ---------------------------------------------------------------------------------------------------------
# Case results: the live display while cases run, the table at the end, summary.json and summary.md.

_VERDICT_STYLES = {
    "pass": "green",
    "skipped": "yellow",
    "unchecked": "magenta",  # the case ran, a check it was asked for did not: not a pass
    "slow": "yellow",
    "hang": "bold red",
}
_SHOWS_WHERE = {"hang", "slow", "crash", "error", "oom", "nonfinite"}


def format_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / 2**20:.1f} MiB"


def format_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f} s" if value < 600 else f"{value / 60:.1f} min"


STACK_DEPTH = 8


def main_thread_stack(case_dir: Path, stacks_file: str = "stacks.txt", depth: int = STACK_DEPTH) -> list[str]:
    """The innermost frames of the main thread in the last stack sample (or fatal-error dump) of
    ``stacks_file`` in the case folder: the process the verdict is about (`CaseResult.stacks_file`).

    Empty when it holds no sample, e.g. for a case that ended normally.
    """
    from nsa_diag.evidence.stacks import parse_faulthandler, read_stacks

    dump = read_stacks(Path(case_dir) / stacks_file).last_dump()
    if not dump:
        return []
    threads = parse_faulthandler(dump)
    main = next((t for t in threads if t.is_main), None) or next((t for t in threads if t.current), None)
    return [frame.short() for frame in main.frames[:depth]] if main else []


def _parity_text(parity: Parity | Mapping[str, Any] | None) -> str:
    """A case's parity in a cell: a `Parity`, or its JSON (a run folder read back by `report`)."""
    if not parity:
        return "-"
    if parity.get("checked") is False:  # the check could not run (its why is in the reason)
        return "not run"
    if isinstance(parity.get("max_err"), int | float):  # a verify property
        return f"max err {parity['max_err']:.1e} (bound {parity.get('bound', float('nan')):.0e})"
    loss, grad = parity.get("loss_rel_err"), parity.get("grad_rel_err_max")
    if not isinstance(loss, int | float) or not isinstance(grad, int | float):
        return "-"
    return f"loss {loss:.1e} · grad {grad:.1e}"


def _cells(case: Mapping[str, Any] | CaseEntry) -> dict[str, str]:
    """The table cells of a case: a `CaseEntry`, or its JSON (a run folder read back by `report`)."""
    tokens = case["tokens_per_s"]
    loss = case["loss"]
    return {
        "where": case["where"] if case["where"] and case["verdict"] in _SHOWS_WHERE else "-",
        "time": format_seconds(case["elapsed_s"]),
        "tokens/s": f"{tokens:,.0f}" if isinstance(tokens, int | float) else "-",
        "loss": f"{loss:.4f}" if isinstance(loss, int | float) else "-",
        "peak memory": format_bytes(case["peak_memory_bytes"]),
        "parity": _parity_text(case["parity"]),
    }


def ok_text(ok: bool, verdict: str) -> str:
    """A judged case's ok cell in markdown (summary.md, report.md): as `_ok_cell`."""
    if ok and verdict == "skipped":
        return "skipped"
    return "yes" if ok else "**NO**"


def _ok_cell(ok: bool, verdict: str) -> str:
    """A judged case's ok cell: a case skipped here met its expectation without being checked: said so."""
    if ok and verdict == "skipped":
        return "[yellow]skipped[/yellow]"
    return "[green]yes[/green]" if ok else "[bold red]NO[/bold red]"


def _expected_text(case: CaseEntry) -> str:
    expected = case.expected
    assert expected is not None
    return expected.verdict + (f" / {expected.hang_kind}" if expected.hang_kind else "")


# what a passing case's reason may say beyond "it passed" that its person must see (issue 48): a straggler
# rank and its phase, steps that kept getting slower
PASS_FINDINGS = ("; straggler ", " slower over the run")


def render_summary(summary: RunSummary, console: Console | None = None) -> None:
    """The result table, then one line per case that did not pass, the run folder and the replay hint."""
    from rich.markup import escape
    from rich.table import Table

    console = console or stdout_console()
    cases = summary.cases
    selftest = any(case.expected is not None for case in cases)
    with_parity = any(case.parity for case in cases)
    table = Table(title=f"nsa-diag {summary.command}", title_justify="left")
    table.add_column("case", style="bold")
    if selftest:
        table.add_column("expected")
    table.add_column("verdict")
    table.add_column("hang kind")
    if selftest:
        table.add_column("ok")
    columns = ["where", "time", "tokens/s", "loss", "peak memory"] + (["parity"] if with_parity else [])
    for column in columns:
        table.add_column(column, justify="right" if column in ("time", "tokens/s", "loss") else "left")
    for case in cases:
        style = _VERDICT_STYLES.get(case.verdict, "red")
        row = [escape(case.name)]
        if selftest:
            row.append(_expected_text(case))
        row += [f"[{style}]{case.verdict}[/{style}]", case.hang_kind or "-"]
        if selftest:
            row.append(_ok_cell(case.ok, case.verdict))
        cells = _cells(case)
        row += [escape(cells[column]) for column in columns]
        table.add_row(*row)
    console.print(table)

    for case in cases:
        if case.verdict != "pass" or not case.ok or any(f in case.reason for f in PASS_FINDINGS):
            reason = f"[bold]{escape(case.name)}[/bold]: {escape(case.reason)}"
            console.print(reason, soft_wrap=True, highlight=False)
        if case.stack:
            console.print(f"  main thread, last stack sample ({case.stack_file}):", highlight=False)
            for frame in case.stack:
                console.print(f"    {escape(frame)}", highlight=False, soft_wrap=True)
    if summary.not_run:
        console.print(f"not run: {', '.join(summary.not_run)}")
    for name, why in (summary.left_out or {}).items():
        console.print(f"not checked here: {escape(name)} ({escape(why)})", soft_wrap=True, highlight=False)
    counts = ", ".join(f"{n} {verdict}" for verdict, n in summary.counts.items()) or "no case ran"
    status = "interrupted" if summary.interrupted else summary.status()
    console.print(f"{counts} ({status}) in {format_seconds(summary.elapsed_s)}", soft_wrap=True)
    console.print(f"run folder: {escape(summary.run_dir)}", soft_wrap=True)
    failed = [case for case in cases if not case.ok]
    if failed:
        replay = Path(summary.run_dir) / failed[0].replay
        console.print(f"reproduce {escape(failed[0].name)}: {escape(str(replay))}", soft_wrap=True)


def summary_markdown(summary: RunSummary) -> str:
    """summary.md: the same as the table, for people reading the run folder."""
    cases = summary.cases
    selftest = any(case.expected is not None for case in cases)
    with_parity = any(case.parity for case in cases)
    head = ["case"] + (["expected"] if selftest else []) + ["verdict", "hang kind"]
    head += (["ok"] if selftest else []) + ["where", "time", "tokens/s", "loss", "peak memory"]
    head += ["parity"] if with_parity else []
    lines = [
        f"# nsa-diag {summary.command}",
        "",
        f"- started {summary.started_at}, {format_seconds(summary.elapsed_s)}; "
        f"nsa-diag {summary.nsa_diag_version}",
        f"- command: `{' '.join(summary.argv)}`",
        f"- result: {summary.status()}, exit code {summary.exit_code}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    for case in cases:
        cells = _cells(case)
        row = [case.name]
        if selftest:
            row.append(_expected_text(case))
        row += [case.verdict, case.hang_kind or "-"]
        row += ([ok_text(case.ok, case.verdict)] if selftest else []) + [
            cells[c] for c in ("where", "time", "tokens/s", "loss", "peak memory")
        ]
        row += [cells["parity"]] if with_parity else []
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    lines += ["", "## Cases", ""]
    for case in cases:
        lines.append(f"- **{case.name}** ({case.verdict}): {case.reason}")
        if case.model is not None:
            lines.append(f"  model: {case.model.describe()}")
        lines.append(f"  files: `{case.dir}/`; reproduce: `{case.replay}`")
        if case.stack:
            lines.append(f"  main thread, last stack sample (`{case.stack_file}`):")
            lines += ["", "  ```", *(f"  {frame}" for frame in case.stack), "  ```", ""]
    if summary.not_run:
        lines += ["", f"Not run: {', '.join(summary.not_run)}."]
    for name, why in (summary.left_out or {}).items():
        lines += ["", f"Not checked here: {name} ({why})."]
    return "\n".join(lines) + "\n"


def write_summary(run_dir: Path, summary: RunSummary) -> None:
    """summary.json and summary.md in the run folder (atomic writes, through `artifacts`)."""
    from nsa_diag import artifacts

    artifacts.write_json(Path(run_dir) / SUMMARY_JSON, summary.to_json())
    artifacts.write_text(Path(run_dir) / SUMMARY_MD, summary_markdown(summary) + follow_ups_markdown(summary))


def stall_text(stall: float | str) -> str:
    return "auto" if stall == "auto" else f"{stall:g} s"


def timeout_text(timeout: float | None) -> str:
    """``"300 s"``, or ``"none"`` (no time box: `watch`'s default)."""
    return "none" if timeout is None else f"{timeout:g} s"


def verdict_line(head: str, result: CaseResult) -> str:
    """``<head>: <verdict> (<hang kind>) in <time>`` in rich markup; ``head`` is escaped here."""
    from rich.markup import escape

    style = _VERDICT_STYLES.get(result.verdict, "red")
    kind = f" ({result.hang_kind})" if result.hang_kind else ""
    return f"{escape(head)}: [{style}]{result.verdict}[/{style}]{kind} in {format_seconds(result.elapsed_s)}"


_Display = TypeVar("_Display", bound="LiveDisplay")


class LiveDisplay:
    """Base of the live displays on stderr: on a terminal a transient `rich.live.Live` showing
    `_renderable()`, redrawn by `_refresh()`; elsewhere (CI logs, pipes) nothing, and the subclass prints
    one line per case start and end instead."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._live: Any = None

    def _renderable(self) -> Any:
        raise NotImplementedError

    @property
    def live(self) -> bool:
        return self._live is not None

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._renderable())

    def __enter__(self: _Display) -> _Display:
        if self.console.is_terminal:
            from rich.live import Live

            self._live = Live(self._renderable(), console=self.console, transient=True, refresh_per_second=8)
            self._live.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


class LiveProgress(LiveDisplay):
    """The live display on stderr while cases run: the case, where the worker is, the time elapsed.

    On a terminal a transient status line follows the beacon; elsewhere (CI logs, pipes) one line per
    case start and end, so logs stay readable. Feed it from the runner's callbacks.
    """

    def __init__(self, console: Console, specs: Sequence[CaseSpec]) -> None:
        super().__init__(console)
        self.total = len(specs)
        self.index = 0
        self.spec: CaseSpec | None = None
        self.state: Any = None
        self.elapsed = 0.0

    def _prefix(self) -> str:
        name = self.spec.name if self.spec else "?"
        return f"[{self.index}/{self.total}] {name}"

    def _renderable(self) -> Any:
        from rich.markup import escape
        from rich.spinner import Spinner

        if self.spec is None:
            return Spinner("dots", "starting")
        where = describe_state(self.state, self.spec.steps)
        text = f"{escape(self._prefix())}: {escape(where)} · {self.elapsed:.1f} s"
        state = self.state
        idle = time.time() - state.time if state is not None and state.phase != "setup" else 0.0
        if idle >= 1.0:  # a hang in the making: count towards --stall (setup has a longer limit)
            text += f" · no progress for {idle:.1f} s (stall {stall_text(self.spec.stall)})"
        return Spinner("dots", text)

    def case_start(self, spec: CaseSpec) -> None:
        self.index += 1
        self.spec, self.state, self.elapsed = spec, None, 0.0
        if self.live:
            self._refresh()
        else:
            self.console.print(
                f"{self._prefix()}: running (stall {stall_text(spec.stall)}, "
                f"timeout {timeout_text(spec.timeout)})",
                markup=False,
                highlight=False,
            )

    def progress(self, state: Any, elapsed: float) -> None:
        self.state, self.elapsed = state, elapsed
        self._refresh()

    def case_end(self, result: CaseResult) -> None:
        self.console.print(verdict_line(self._prefix(), result), highlight=False)


def describe_state(state: Any, steps: int | None = None) -> str:
    """A beacon read (`BeaconState` or None) as `step 1/2 · layer 1 backward (sel)`."""
    if state is None:
        return "starting the worker"
    parts = []
    if state.step is not None:
        parts.append(f"step {state.step}" + (f"/{steps}" if steps else ""))
    location = " ".join(
        part
        for part in (
            f"layer {state.layer}" if state.layer is not None else None,
            state.phase,
            f"({state.branch})" if state.branch else None,
        )
        if part
    )
    if location:
        parts.append(location)
    return " · ".join(parts) or "running"


# ---------------------------------------------------------------------------------------------------------
# Follow-ups (nsa_diag.session.followups): --repeat, --minimize, --triage sections of summary.json.


def _repeat_cells(entry: CaseRepeats) -> dict[str, str]:
    hang = entry.hang
    low, high = hang.ci95
    probability = hang.probability
    tth = entry.time_to_hang_s
    steps = sorted(set(entry.hang_steps))
    return {
        "case": entry.case,
        "runs": f"{entry.runs}/{entry.repeat}",
        "ok": f"{entry.ok_runs}/{entry.runs}",
        "status": entry.status,
        "verdicts": ", ".join(f"{n} {verdict}" for verdict, n in entry.counts.items()) or "-",
        "P(hang) [95%]": "-" if probability is None else f"{probability:.2f} [{low:.2f}, {high:.2f}]",
        "time to hang": "-" if not tth else f"{tth.min:.1f} / {tth.median:.1f} / {tth.max:.1f} s",
        "hang steps": ", ".join(map(str, steps)) or "-",
    }


_REPEAT_COLUMNS = ("case", "runs", "ok", "status", "verdicts", "P(hang) [95%]", "time to hang", "hang steps")
_STATUS_STYLES = {"pass": "green", "transient": "bold yellow", "fail": "bold red"}


def _shape_text(shape: CaseShape) -> str:
    parts = [f"layers {shape.layers}"] if shape.layers is not None else []
    parts += [f"S {shape.seq_len}", f"batch {shape.batch}", f"steps {shape.steps}"]
    return ", ".join([*parts, f"branch {shape.branch}"])


def _figure(value: int | None) -> str:
    """Bytes in GiB (`format_bytes`), or in TiB/PiB/EiB for the absurd requests of a broken shape."""
    if not isinstance(value, int):
        return "-"
    for unit, size in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return format_bytes(value)


def render_follow_ups(summary: RunSummary, console: Console | None = None) -> None:
    """The repeats table, the minimized commands and the OOM triage, for the sections `summary` has."""
    from rich.markup import escape
    from rich.table import Table

    console = console or stdout_console()
    repeats = summary.repeats
    if repeats:
        table = Table(title=f"repeats ({repeats.repeat} runs per case)", title_justify="left")
        for column in _REPEAT_COLUMNS:
            table.add_column(column, style="bold" if column == "case" else None)
        for entry in repeats.cases:
            cells = _repeat_cells(entry)
            style = _STATUS_STYLES.get(entry.status, "red")
            cells["status"] = f"[{style}]{cells['status']}[/{style}]"
            table.add_row(*(cells[c] if c == "status" else escape(cells[c]) for c in _REPEAT_COLUMNS))
        console.print(table)
        for entry in repeats.cases:
            if entry.status == "transient":
                console.print(
                    f"[bold]{escape(entry.case)}[/bold]: transient: {entry.failed_runs} of "
                    f"{entry.runs} runs failed ({escape(', '.join(entry.failing_runs))})",
                    soft_wrap=True,
                    highlight=False,
                )
        if any(entry.time_to_hang_s for entry in repeats.cases):
            console.print("time to hang: min / median / max until the watchdog called it", highlight=False)
    for record in summary.minimize or []:
        head = f"minimize {record.case} ({record.target}): {record.runs} run(s)"
        console.print(escape(head), highlight=False)
        console.print(f"  from  {escape(_shape_text(record.start))}", highlight=False)
        if record.reduced:
            console.print(f"  to    {escape(_shape_text(record.smallest))}", highlight=False)
        else:
            console.print("  no smaller configuration reproduced it", highlight=False)
        if record.stopped:
            console.print(f"  {escape(record.stopped)}", highlight=False)
        console.print(f"  reproduce: {escape(record.command)}", soft_wrap=True, highlight=False)
    for triaged in summary.triage or []:
        console.print(
            f"triage {escape(triaged.case)}: [bold]{triaged.kind}[/bold]: {escape(triaged.why)}",
            soft_wrap=True,
            highlight=False,
        )
        figures = triaged.figures
        line = ", ".join(
            f"{label} {_figure(value)}"
            for value, label in (
                (figures.requested_bytes, "requested"),
                (figures.total_bytes, "total"),
                (figures.allocated_bytes, "allocated"),
                (figures.reserved_unallocated_bytes, "reserved unallocated"),
                (figures.outside_pytorch_bytes, "outside PyTorch"),
            )
            if value is not None
        )
        if line:
            console.print(f"  at the failure: {line}", soft_wrap=True, highlight=False)
        for rerun in triaged.reruns:
            console.print(
                f"  PYTORCH_CUDA_ALLOC_CONF={escape(rerun.alloc_conf)}: {rerun.verdict or 'not run'}"
                + (f" ({escape(rerun.reason)})" if rerun.verdict is None else ""),
                soft_wrap=True,
                highlight=False,
            )
        if triaged.note:
            console.print(f"  {escape(triaged.note)}", soft_wrap=True, highlight=False)


def follow_ups_markdown(summary: RunSummary) -> str:
    """The sections of summary.md for --repeat, --minimize and --triage ("" when there are none)."""
    lines: list[str] = []
    repeats = summary.repeats
    if repeats:
        lines += ["", f"## Repeats ({repeats.repeat} runs per case)", ""]
        lines += [
            "| " + " | ".join(_REPEAT_COLUMNS) + " |",
            "|" + "|".join("---" for _ in _REPEAT_COLUMNS) + "|",
        ]
        for entry in repeats.cases:
            cells = _repeat_cells(entry)
            lines.append("| " + " | ".join(cells[c].replace("|", "\\|") for c in _REPEAT_COLUMNS) + " |")
        lines += [
            "",
            "P(hang): hung runs / runs with the 95% Wilson interval; time to hang: min / median / max.",
        ]
        if repeats.transient:
            lines.append(f"Transient (failed in some runs only): {', '.join(repeats.transient)}.")
    if summary.minimize:
        lines += ["", "## Minimized", ""]
        for record in summary.minimize:
            lines.append(f"- **{record.case}** ({record.target}), {record.runs} run(s) under "
                         f"`{record.dir or 'minimize'}/`: {_shape_text(record.start)} -> "
                         f"{_shape_text(record.smallest)}"
                         + (f" ({record.stopped})" if record.stopped else ""))  # fmt: skip
            lines += ["", "  ```sh", f"  {record.command}", "  ```"]
    if summary.triage:
        lines += ["", "## OOM triage", ""]
        for triaged in summary.triage:
            lines.append(f"- **{triaged.case}**: **{triaged.kind}**: {triaged.why}")
            for rerun in triaged.reruns:
                lines.append(
                    f"  - `PYTORCH_CUDA_ALLOC_CONF={rerun.alloc_conf}`: {rerun.verdict or 'not run'}"
                )
            if triaged.note:
                lines.append(f"  - {triaged.note}")
    return "\n".join(lines) + ("\n" if lines else "")


# ---------------------------------------------------------------------------------------------------------
# nsa-diag scale: the sweep's series (nsa_diag.analysis.sweep.analyse_series) as tables and fit lines.


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def _above_errors(points: Sequence[ScalePoint]) -> str:
    return ", ".join(
        f"{p.x}: {p.estimate_above_fixed_rel_err:+.0%}"
        for p in points
        if p.estimate_above_fixed_rel_err is not None
    )


def _estimate_cell(point: ScalePoint) -> str:
    if point.estimate_exceeds_budget is not None:  # an oom point: the estimate foresaw it, or not
        return "foresaw oom" if point.estimate_exceeds_budget else "missed oom"
    return _pct(point.estimate_rel_err)


def _seconds_cell(point: ScalePoint, value: float | None) -> str:
    """A phase's median time; `*` marks a host-bound point (the note under the table says what it is)."""
    if value is None:
        return "-"
    return f"{value:.3f} s" + ("*" if point.host_bound else "")


def render_scale(report: ScaleReport) -> None:
    """The sweep as a table on stdout, then one line per fit, the culprits and the predicted limits."""
    from rich.table import Table

    from nsa_diag.analysis.scaling import describe_fit
    from nsa_diag.analysis.sweep import fit_points_note, host_bound_note

    console = stdout_console()
    for a in report.series:
        table = Table(title=f"{a.name} (branch {a.branch}, backend {a.backend or '-'})")
        for column in (a.x, "verdict", "peak memory", "estimate", "est. error", "fwd", "bwd", "tokens/s"):
            table.add_column(column)
        for p in a.points:
            tokens = p.tokens_per_s
            table.add_row(
                str(p.x),
                p.verdict or "-",
                format_bytes(p.peak_memory_bytes),
                format_bytes(p.estimate.total if p.estimate is not None else None),
                _estimate_cell(p),
                _seconds_cell(p, p.forward_s),
                _seconds_cell(p, p.backward_s),
                "-" if tokens is None else f"{tokens:,.0f}",
            )
        console.print(table)
        for note in (fit_points_note(a), host_bound_note(a)):
            if note:
                console.print(f"  {note}", markup=False, highlight=False)
        for what, fit in (("memory", a.memory_fit), ("time", a.time_fit)):
            text = describe_fit(what + (" above the fixed part" if what == "memory" else ""), fit)
            console.print("  " + text.replace("x^", f"{a.x}^"), markup=False, highlight=False)
        if a.memory_fit:
            console.print(
                f"  fixed part {format_bytes(int(a.memory_fit.fixed))}",
                markup=False,
                highlight=False,
            )
        if a.estimate_max_abs_rel_err is not None:
            compared = next((p.estimate_compared for p in a.points if p.estimate_compared is not None), "")
            above = a.estimate_above_fixed_max_abs_rel_err
            console.print(
                f"  estimator: largest error {a.estimate_max_abs_rel_err:.0%} ({compared})"
                + (f"; of the growing part alone, per point: {_above_errors(a.points)}" if above else ""),
                markup=False,
                highlight=False,
            )
        elif a.estimate_not_compared:
            console.print(
                f"  estimator: not compared: {a.estimate_not_compared}", markup=False, highlight=False
            )
        limit = a.memory_limit
        if limit:
            at = limit.seq_len
            console.print(
                f"  memory runs out at S ≈ {at:,} ({limit.budget_source}, {format_bytes(limit.budget_bytes)})"
                if at
                else f"  memory limit: not predictable from the fit ({limit.budget_source})",
                markup=False,
                highlight=False,
            )
        if a.stopped_by:
            console.print(f"  sweep stopped: {a.stopped_by}", markup=False, highlight=False)
    for line in report["culprits"]:
        console.print(line, markup=False, highlight=False)
