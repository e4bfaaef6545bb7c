"""PNG plots of analyses (matplotlib, Agg backend: no display needed). Imported only when a plot is made."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nsa_diag import artifacts

if TYPE_CHECKING:
    from nsa_diag.analysis.sweep import ScaleReport
    from nsa_diag.analysis.timeline import Row
    from nsa_diag.runfolder import Failure


def plot_scale(report: ScaleReport, path: Path) -> Path:
    """`nsa-diag scale`: peak memory and step time against the swept variable, log-log, one colour per
    series; measured points as dots, the fit as a line, the estimator as crosses (on the CPU, its growing
    part on top of the fitted fixed part)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 5))
    for index, series in enumerate(report.series):
        colour = f"C{index % 10}"
        label = f"{series.name} ({series.branch}/{series.backend or '-'})"
        run = [(p.x, p.peak_memory_bytes, p.step_s) for p in series.points if p.peak_memory_bytes]
        xs = [x for x, _, _ in run]
        if not xs:
            continue
        ax_mem.plot(xs, [peak / 2**20 for _, peak, _ in run], "o", color=colour, label=label)
        fit = series.memory_fit
        # on the CPU the estimate's growing part sits on the fitted fixed part (peak RSS holds the runtime)
        estimates = [
            (p.x, p.estimate_above_fixed_bytes + fit.fixed)
            if fit and p.estimate_above_fixed_bytes is not None
            else (p.x, p.estimate.total)
            for p in series.points
            if p.estimate
        ]
        if estimates:
            ax_mem.plot(
                [x for x, _ in estimates],
                [e / 2**20 for _, e in estimates],
                "x",
                color=colour,
                label="estimate",
            )
        grid = [min(xs) * (max(xs) / min(xs)) ** (i / 40) for i in range(41)]
        if fit:
            ax_mem.plot(
                grid,
                [fit.predict(x) / 2**20 for x in grid],
                "-",
                color=colour,
                label=f"fit: fixed + c·x^{fit.exponent:.2f}",
            )
        timed = [(x, step) for x, _, step in run if step]
        ax_time.plot([x for x, _ in timed], [step for _, step in timed], "o", color=colour, label=label)
        tfit = series.time_fit
        if tfit:
            ax_time.plot(
                grid,
                [tfit.coef * x**tfit.exponent for x in grid],
                "-",
                color=colour,
                label=f"fit: c·x^{tfit.exponent:.2f}",
            )
    x_name = report.series[0].x if report.series else "x"
    for ax, ylabel in ((ax_mem, "peak memory (MiB)"), (ax_time, "forward + backward (s)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(x_name)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("nsa-diag scale")
    fig.tight_layout()
    artifacts.write_with(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
    return path


# Verdict colours of the report's pictures: green passes, greys did not run, yellow was slow, and each
# failure has its own warm or dark colour.
VERDICT_COLOURS = {
    "pass": "#4caf50",
    "skipped": "#bdbdbd",
    "not run": "#eeeeee",
    "-": "#ffffff",
    "slow": "#ffc107",
    "hang": "#d32f2f",
    "crash": "#7b1fa2",
    "error": "#e64a19",
    "oom": "#1976d2",
    "nonfinite": "#f06292",
    "grad-missing": "#8d6e63",
    "mismatch": "#ff7043",
    "unchecked": "#ce93d8",  # ran, but its check did not: neither a pass nor a failure of the check
}
_FAILED_COLOUR = "#b71c1c"


def verdict_colour(label: str) -> str:
    """The colour of a grid cell or a marker from its label's first verdict ("hang (python-busy) / ...")."""
    verdict = label.split(" / ")[0].split(" (")[0].strip()
    return VERDICT_COLOURS.get(verdict, _FAILED_COLOUR)


def plot_verdict_grid(
    *,
    title: str,
    row_axis: str,
    col_axis: str | None,
    rows: list[str],
    cols: list[str],
    labels: list[list[str]],
    path: Path,
) -> Path:
    """`nsa-diag report` of a matrix: the verdict of each (row, column) cell as a coloured table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    width = min(2.0 + 1.8 * len(cols), 24.0)
    height = min(1.5 + 0.5 * len(rows), 24.0)
    fig, ax = plt.subplots(figsize=(width, height))
    image = [[to_rgb(verdict_colour(label)) for label in row] for row in labels]
    ax.imshow(image, aspect="auto")
    for i, row in enumerate(labels):
        for j, label in enumerate(row):
            ax.text(j, i, label.replace(" (", "\n("), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(cols)), cols, fontsize=8, rotation=30 if max(map(len, cols)) > 8 else 0)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_xlabel(col_axis or "")
    ax.set_ylabel(row_axis)
    ax.set_title(f"verdicts: {title}", fontsize=10)
    fig.tight_layout()
    artifacts.write_with(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
    return path


_PHASES = ("setup", "forward", "backward", "recompute", "optimizer", "check", "step")


def plot_failure_locations(records: Sequence[Failure], path: Path) -> Path:
    """`nsa-diag report`: where each failing case was stopped, layer against phase, coloured by verdict
    and labelled with the case (cases at the same place are stacked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in _PHASES if any(r.phase == p for r in records)]
    phases += sorted({r.phase or "unknown" for r in records} - set(phases))
    layers = sorted({r.layer for r in records if r.layer is not None})
    columns = [
        *(str(layer) for layer in layers),
        *(["-"] if any(r.layer is None for r in records) else []),
    ]
    fig, ax = plt.subplots(figsize=(min(3 + 1.6 * len(columns), 20), min(2 + 0.9 * len(phases), 14)))
    seen: dict[tuple[int, int], int] = {}
    for record in records:
        x = columns.index("-" if record.layer is None else str(record.layer))
        y = phases.index(record.phase or "unknown")
        offset = seen.get((x, y), 0)
        seen[(x, y)] = offset + 1
        label = record.verdict + (f" ({record.hang_kind})" if record.hang_kind else "")
        ax.plot(x, y + 0.18 * offset, "o", color=verdict_colour(label), markersize=10)
        ax.annotate(
            f"{record.case}: {label}",
            (x, y + 0.18 * offset),
            xytext=(8, -3),
            textcoords="offset points",
            fontsize=7,
        )
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(phases)), phases)
    ax.set_xlim(-0.5, len(columns) + 0.5)
    ax.set_ylim(len(phases) - 0.3, -0.5)
    ax.set_xlabel("layer (- : not in a layer)")
    ax.set_ylabel("phase")
    ax.set_title("where the failing cases were stopped")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    artifacts.write_with(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
    return path


_TIMELINE_DEPTH = 3  # the step, its phases (forward, backward, optimizer), their layers and collectives
_PHASE_COLOURS = {"forward": "C0", "backward": "C1", "optimizer": "C2", "setup": "C7", "pre-flight": "C4"}


def plot_timeline(rows: Sequence[Row], marks: Sequence[tuple[float, str]], end_s: float, path: Path) -> Path:
    """`nsa-diag report`: one row per case unit (a worker, a rank), its steps and their phases as bars
    against time; a slice still open at the end (where a unit stopped) hatched to the end; the stall and
    the verdict as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, min(1.5 + 0.6 * len(rows), 14)))
    for y, row in enumerate(rows):
        for span in row.spans:
            if span.depth >= _TIMELINE_DEPTH:
                continue
            colour = "0.85" if span.depth == 0 else _PHASE_COLOURS.get(span.phase or "", "C5")
            height = (0.8, 0.5, 0.2)[span.depth]
            ax.barh(
                y, span.end_s - span.start_s, left=span.start_s, height=height, color=colour,
                edgecolor="k" if span.open else colour, hatch="//" if span.open else None, linewidth=0.5,
            )  # fmt: skip
            if span.open:
                ax.annotate(f"open: {span.name}", (span.start_s, y - 0.05 - 0.25 * span.depth), fontsize=7)
    for index, (at, name) in enumerate(marks):
        ax.axvline(at, color="C3", linestyle="--", linewidth=1)
        ax.annotate(name, (at, -0.6 + 0.25 * index), fontsize=7, ha="right")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _PHASE_COLOURS.values()]
    ax.legend(handles, list(_PHASE_COLOURS), fontsize=7, loc="upper left", ncols=len(_PHASE_COLOURS))
    ax.set_yticks(range(len(rows)), [row.label for row in rows])
    ax.set_ylim(len(rows) - 0.4, -0.8)
    ax.set_xlim(0, max(end_s, 1e-3) * 1.02)
    ax.set_xlabel("seconds from the first event")
    ax.set_title("progress of each unit (hatched: still open when the case ended)")
    fig.tight_layout()
    artifacts.write_with(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
    return path
