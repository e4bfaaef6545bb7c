"""`nsa-diag scale`: sweep S (and/or layers), fit memory and time growth, compare with the estimator."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from nsa_diag._cli_utils import CaseOptions, DebugOpt, JsonOpt, case_options
from nsa_diag.options import EVIDENCE, FAULTS, FOLLOW_UPS, MODEL, NSA, OUTPUT, TRAINING, WATCHDOG

_PANEL = "Sweep"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_int_list(flag: str, text: str | None) -> tuple[int, ...]:
    """``"64,128,256"`` -> (64, 128, 256), sorted and unique; `UsageError` naming the flag."""
    from nsa_diag.errors import UsageError

    if text is None:
        return ()
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected whole numbers separated by commas") from None
    if not values or values[0] < 1:
        raise UsageError(f"{flag} {text!r}: expected numbers >= 1")
    return tuple(values)


def parse_budget(text: str | None) -> tuple[int, str] | None:
    """``"8GiB"`` -> (bytes, "--memory-budget 8GiB")."""
    from nsa_diag.errors import UsageError

    if text is None:
        return None
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    size = int(float(match.group(1)) * _UNITS[unit]) if match is not None and unit in _UNITS else 0
    if size < 1:
        raise UsageError(f"--memory-budget {text!r}: expected a size such as 8GiB, 500MB or 1000000")
    return size, f"--memory-budget {text.strip()}"


# --repeat is left out: a sweep point is one measurement that its series' fit uses as it is; --layers and
# --seq-len are the sweep's own lists below.
@case_options(
    MODEL,
    NSA,
    TRAINING,
    WATCHDOG,
    FAULTS,
    EVIDENCE,
    FOLLOW_UPS,
    OUTPUT,
    omit=("layers", "seq_len", "repeat"),
    defaults={"batch": 1, "steps": 4},
)
def scale(
    options: CaseOptions,
    seq_lens: Annotated[
        str | None,
        typer.Option("--seq-lens", metavar="S1,S2,...", rich_help_panel=_PANEL, help="Sequence lengths."),
    ] = None,
    layers: Annotated[
        str | None,
        typer.Option("--layers", metavar="L1,L2,...", rich_help_panel=_PANEL, help="Layer counts."),
    ] = None,
    per_branch: Annotated[
        bool,
        typer.Option(
            "--per-branch", rich_help_panel=_PANEL, help="Sweep each branch alone (cmp, sel, win) too."
        ),
    ] = False,
    memory_budget: Annotated[
        str | None,
        typer.Option(
            "--memory-budget",
            metavar="SIZE",
            rich_help_panel=_PANEL,
            help="Predict where memory runs out against this (e.g. 8GiB); default: the device's total.",
        ),
    ] = None,
    json_output: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Sweep the sequence length (`--seq-lens`) and/or the layer count (`--layers`), one worker per point,
    and fit how peak memory and step time grow.

    Per point: peak memory (CUDA max allocated, or the worker's peak RSS on the CPU), forward and
    backward time (the median of the steps after the first, a warm-up; `--steps` defaults to 4 here),
    tokens/s, verdict, and the analytical memory estimate with its relative error. On CUDA a point whose
    host took 90% or more of forward + backward to issue the work is host-bound (marked `*`: the GPU
    waited for Python and kernel launches) and left out of the time fit.

    Per series: the exponent k of memory above the fixed part (memory ≈ F + c·x^k) and of time, with a
    95% interval; k > 1.3 is flagged quadratic. With `--per-branch` each branch runs alone
    too and the branch and backend behind a quadratic exponent are named. From the memory fit, the S at
    which the device (or `--memory-budget`) runs out. A point that does not pass (oom, hang, ...) ends
    its series: larger points are not run. Writes scale.json and scale.png next to the usual summary.
    With both lists, one S series per layer count. `--triage` classifies a point that ran out of memory
    (fragmentation, capacity, memory outside PyTorch); `--minimize` shrinks a failing point.

    Exit code 0 when every point run passes, 1 when not, 2 for a bad option.

    Examples:

        nsa-diag scale --seq-lens 512,1024,1536,2048,3072,4096 --sel masked --branch sel
        nsa-diag scale --seq-lens 512,1024,1536,2048,3072,4096 --sel gather --branch sel
        nsa-diag scale --seq-lens 512,1024,2048 --per-branch --sel masked
        nsa-diag scale --layers 1,2,4,8
        nsa-diag scale --preset m7c-125m --device cuda --dtype bf16 --seq-lens 512,1024,2048,4096,8192
        nsa-diag scale --preset m7c-125m --device cuda --seq-lens 16384,32768,65536 --triage --junit s.xml
    """
    from nsa_diag.cases import check_options
    from nsa_diag.errors import UsageError
    from nsa_diag.launchers.preflight import check_user_model
    from nsa_diag.session import Session, check_follow_ups
    from nsa_diag.session.plans import Sweep, build_series

    lens, layer_counts = parse_int_list("--seq-lens", seq_lens), parse_int_list("--layers", layers)
    if not lens and not layer_counts:
        raise UsageError("give --seq-lens S1,S2,... and/or --layers L1,L2,... to sweep")
    budget = parse_budget(memory_budget)
    check_options(options)
    follow = check_follow_ups(options)
    series = build_series(options, lens, layer_counts, per_branch=per_branch)
    specs = [spec for one in series for _, spec in one.points]
    check_user_model(specs, "scale --per-branch" if per_branch else None)
    plan = Sweep(series, budget)
    session = Session(plan, out=options.out, tag=options.tag, json_output=json_output, follow=follow)
    raise typer.Exit(session.run())
