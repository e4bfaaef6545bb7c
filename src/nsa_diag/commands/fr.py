"""`nsa-diag fr DIR`: which rank stopped where, from the flight recorder dumps a job wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_diag._cli_utils import DebugOpt, typer_annotation
from nsa_diag.cases import CASE_OPTIONS

_OUTPUT = "Output"


def fr(
    directory: Annotated[
        Path, typer.Argument(metavar="DIR", help="The folder of the ranks' dump files (one per rank).")
    ],
    prefix: Annotated[
        str | None,
        typer.Option(
            "--prefix",
            help="Read only the files whose names start with this (e.g. nccl_trace_rank_); the rank is "
            "the number that ends each name.",
        ),
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            min=1,
            help="How many ranks the job had, to name the ranks that wrote no dump (by default the "
            "default group's members where the dumps list them).",
        ),
    ] = None,
    out: typer_annotation(CASE_OPTIONS["out"], _OUTPUT) = CASE_OPTIONS["out"].default,  # type: ignore[valid-type]
    tag: typer_annotation(CASE_OPTIONS["tag"], _OUTPUT) = None,  # type: ignore[valid-type]
    json_output: Annotated[
        bool, typer.Option("--json", help="Print result.json to stdout instead of the findings.")
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Read the flight recorder dumps a distributed job wrote and say which rank stopped where.

    PyTorch's flight recorder keeps each rank's last collectives per process group; NCCL writes it on a
    timeout (TORCH_NCCL_DUMP_ON_TIMEOUT=1, files `TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`, by default
    `~/.cache/fr_trace/nccl_trace_rank_<rank>` or `/tmp/nccl_trace_rank_<rank>`), any backend's on
    `torch._C._distributed_c10d._dump_fr_trace()` (gloo's too, with TORCH_FR_BUFFER_SIZE set). Per
    process group: the collective each rank last entered (sequence number, op, sizes, dtypes, the code that
    called it); the ranks that never entered the furthest one the others did; the first collective the
    ranks called differently (a desync), blaming the minority, or on a tie the rank that called from a new
    place; and the ranks without a dump (with --world-size), the likely culprits where the others agree.
    Dumps are pickles of plain data or JSON: a file naming any class or function is refused, never run.
    Everything goes to `<out>/<time>-fr/` (result.json, summary.md).

    Exit code 1 when a culprit is found, 0 when the dumps agree, 2 for a folder without dumps or a file
    that is not one.

    Examples:

        nsa-diag fr ~/.cache/fr_trace
        nsa-diag fr dumps/ --prefix nccl_trace_rank_ --world-size 8
        nsa-diag fr dumps/ --json
    """
    from nsa_diag.session.flight import FrRequest, run_fr

    request = FrRequest(directory=directory, prefix=prefix, world_size=world_size, out=Path(out), tag=tag)
    raise typer.Exit(run_fr(request, json_output=json_output))
