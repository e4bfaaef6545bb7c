"""`nsa-diag compare A B`: environment, verdict changes and memory/time ratios between two run folders."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_diag._cli_utils import DebugOpt


def compare(
    run_a: Annotated[Path, typer.Argument(metavar="A", help="The run folder to compare against (before).")],
    run_b: Annotated[Path, typer.Argument(metavar="B", help="The run folder to compare (after).")],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", metavar="FILE", help="Also write the comparison as markdown to FILE.", dir_okay=False
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the comparison as JSON to stdout instead of tables.")
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Compare two run folders: what differs in the environment, which verdicts changed, and how memory
    and time moved per case.

    Environment: from each env.json, the versions (torch, CUDA, cuDNN, NCCL, Triton, NVIDIA driver),
    the GPUs, the machine, the git revision, and every recorded `NSA_*`, `TORCH_*`, `NCCL_*`, `CUDA_*`,
    `PYTORCH_*`, `TRITON_*` variable that is set on one side only or differs. Cases are matched by name:
    per common case the verdict in A and in B and the change (worse: ok in A, not ok in B; better;
    changed: failed differently; not comparable: skipped or no result on a side), the spec fields that
    differ (e.g. alloc_conf), and B/A of peak memory, step time and tokens/s. A ratio of numbers that
    measure different things is shown as "not comparable", with why: cases of different shapes (model,
    seq_len, batch, dtype, device, backends or any other model option, faults, checks) do different work;
    the step time and tokens/s of a one-step case are its warm-up's (`--steps 2` or more times steps
    2..). Cases found on one side only are listed.

    Exit code 0 when no case got worse, 1 when one did, 2 when A or B is not a run folder.

    Examples:

        nsa-diag branch --tag torch-2.13 && .venv-other/bin/nsa-diag branch --tag torch-2.14
        nsa-diag compare nsa-diag-runs/*-branch-torch-2.13 nsa-diag-runs/*-branch-torch-2.14
        nsa-diag compare RUN_A RUN_B --out compare.md
        nsa-diag compare RUN_A RUN_B --json
    """
    from nsa_diag import artifacts
    from nsa_diag.analysis.compare import compare_runs
    from nsa_diag.errors import UsageError
    from nsa_diag.render import print_json, print_line
    from nsa_diag.report import compare_markdown, render_compare
    from nsa_diag.runfolder import load_run

    if out is not None and out.is_dir():
        raise UsageError(f"--out {out}: is a folder; give a file name, e.g. {out / 'compare.md'}")
    comparison = compare_runs(load_run(run_a).compared(), load_run(run_b).compared())
    if out is not None:
        try:
            artifacts.write_text(out, compare_markdown(comparison))
        except OSError as exc:
            raise UsageError(f"--out {out}: cannot be written: {exc.strerror or exc}") from None
    if json_output:
        print_json(comparison)
    else:
        render_compare(comparison)
        if out is not None:
            print_line(f"markdown: {out}")
    raise typer.Exit(int(comparison["exit_code"]))
