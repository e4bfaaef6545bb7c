"""PNG plots of analyses (matplotlib, Agg backend: no display needed). Imported only when a plot is made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nsa_diag import artifacts


def plot_scale(report: dict[str, Any], path: Path) -> Path:
    """`nsa-diag scale`: peak memory and step time against the swept variable, log-log, one colour per
    series; measured points as dots, the fit as a line, the estimator as crosses (on the CPU, its growing
    part on top of the fitted fixed part)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 5))
    for index, series in enumerate(report["series"]):
        colour = f"C{index % 10}"
        label = f"{series['name']} ({series['branch']}/{series['backend'] or '-'})"
        run = [p for p in series["points"] if p.get("peak_memory_bytes")]
        xs = [p["x"] for p in run]
        if not xs:
            continue
        ax_mem.plot(xs, [p["peak_memory_bytes"] / 2**20 for p in run], "o", color=colour, label=label)
        fit = series.get("memory_fit")
        # on the CPU the estimate's growing part sits on the fitted fixed part (peak RSS holds the runtime)
        estimates = [
            (p["x"], p["estimate_above_fixed_bytes"] + fit["fixed"])
            if fit and "estimate_above_fixed_bytes" in p
            else (p["x"], p["estimate"]["total"])
            for p in series["points"]
            if p.get("estimate")
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
                [(fit["fixed"] + fit["coef"] * x ** fit["exponent"]) / 2**20 for x in grid],
                "-",
                color=colour,
                label=f"fit: fixed + c·x^{fit['exponent']:.2f}",
            )
        timed = [p for p in run if p.get("step_s")]
        ax_time.plot([p["x"] for p in timed], [p["step_s"] for p in timed], "o", color=colour, label=label)
        tfit = series.get("time_fit")
        if tfit:
            ax_time.plot(
                grid,
                [tfit["coef"] * x ** tfit["exponent"] for x in grid],
                "-",
                color=colour,
                label=f"fit: c·x^{tfit['exponent']:.2f}",
            )
    x_name = report["series"][0]["x"] if report["series"] else "x"
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
