"""`nsa-diag backend`: the case once per backend of a branch, each checked against the reference."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from nsa_diag._cli_utils import CaseOptions, DebugOpt, JsonOpt, case_options
from nsa_diag.options import (
    EVIDENCE,
    FAULTS,
    FOLLOW_UPS,
    MODEL,
    NSA,
    OUTPUT,
    TRAINING,
    WATCHDOG,
    CmpBackend,
    SelBackend,
    WinBackend,
    values_of,
)

_PANEL = "Backends to compare (default: every backend but the reference, of every branch)"


def _backends(flag: str, what: str, choices: type[Enum]) -> object:
    help = f"{what} ({', '.join(values_of(choices))}): backends to run."
    return typer.Option(flag, metavar="A,B,...", rich_help_panel=_PANEL, help=help)


# Every case runs one branch, one backend of it, with --reference-check: the lists below choose them.
@case_options(
    MODEL,
    NSA,
    TRAINING,
    WATCHDOG,
    FAULTS,
    EVIDENCE,
    FOLLOW_UPS,
    OUTPUT,
    omit=("branch", "sel", "cmp", "win", "reference_check"),
)
def backend(
    options: CaseOptions,
    sel: Annotated[str | None, _backends("--sel", "Selection", SelBackend)] = None,
    cmp: Annotated[str | None, _backends("--cmp", "Compression", CmpBackend)] = None,
    win: Annotated[str | None, _backends("--win", "Sliding-window", WinBackend)] = None,
    json_output: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run the case once per backend, computing only that backend's branch, and compare its loss and
    every gradient at step 1 with the reference backends on the same weights and batch.

    Each case reports the relative error of the loss and the largest relative error of a gradient
    (||g - g_ref|| / ||g_ref||) and the worst parameter; beyond `--tolerance` (by dtype: fp32 1e-4,
    fp16 1e-2, bf16 5e-2) the verdict is **mismatch**. With no list, every backend but the reference
    runs for every branch; with some lists, only those. Cases are named `<branch>-<backend>`. A
    `--model` is compared with a copy of itself whose nsa_core NSAAttention modules run the reference
    backends (a model holding none is refused).

    Exit code 0 when every case passes, 1 when not, 2 for a bad option.

    Examples:

        nsa-diag backend
        nsa-diag backend --sel masked,gather,packed
        nsa-diag backend --win masked,chunked --seq-len 256 --window 64
        nsa-diag backend --preset m7c-125m --seq-len 2048 --dtype bf16 --device cuda --json
        nsa-diag backend --sel masked,gather --minimize --junit backend.xml
        nsa-diag backend --model mypkg.models:build --sel masked --seq-len 256
    """
    from nsa_diag.cases import backend_specs, check_options, parse_backend_list
    from nsa_diag.launchers.preflight import check_user_model
    from nsa_diag.session import Session, check_follow_ups
    from nsa_diag.session.plans import CaseList

    lists = {
        "sel": parse_backend_list("sel", sel),
        "cmp": parse_backend_list("cmp", cmp),
        "win": parse_backend_list("win", win),
    }
    check_options(options)
    specs = backend_specs(options, {branch: names for branch, names in lists.items() if names})
    check_user_model(specs, "backend")
    plan = CaseList("backend", specs)
    session = Session(
        plan, out=options.out, tag=options.tag, json_output=json_output, follow=check_follow_ups(options)
    )
    raise typer.Exit(session.run())
