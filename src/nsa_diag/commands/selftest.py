"""`nsa-diag selftest`: inject every fault kind and check that each is detected and classified."""

from __future__ import annotations

from typing import Annotated

import typer

from nsa_diag._cli_utils import CaseOptions, DebugOpt, JsonOpt, case_command

SELFTEST_STALL_S = 3.0
SELFTEST_CUDA_STALL_S = 10.0  # CUDA start-up and first kernels can sit silent for seconds
SELFTEST_TIMEOUT_S = 60.0


@case_command(
    omit=("branch", "inject", "model", "reference_check", "tolerance"),
    defaults={"stall": None, "timeout": SELFTEST_TIMEOUT_S},
)
def selftest(
    options: CaseOptions,
    kinds: Annotated[
        str | None,
        typer.Option(
            "--kinds",
            metavar="KIND,...",
            help="Only these fault kinds (default: all).",
            rich_help_panel="Faults and checks",
        ),
    ] = None,
    json_output: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Inject every fault kind, one case each, and check the verdict and hang kind nsa-diag gives it.

    Faults fire in the backward of the last layer at step 1. Expected:

    | fault | verdict | hang kind |
    |---|---|---|
    | deadlock | hang | python-deadlock |
    | busy | hang | python-busy |
    | slow | slow | |
    | nan | nonfinite | |
    | oom | oom | |
    | segfault, abort, exit | crash | |
    | unused-param | grad-missing | |
    | gil-hog | hang | gil-held |
    | gpu-spin | hang (skipped without CUDA) | cuda-kernel |

    The stall defaults to 3 s (10 s on CUDA); `slow` sleeps 1 s per step with a timeout of twice the
    stall and steps enough for four times that, so the watchdog has to tell it from a hang. The table
    shows expected and observed side by side.

    Exit code 0 when every fault is classified as expected, 1 on any miss, 2 for a bad option.

    Examples:

        nsa-diag selftest
        nsa-diag selftest --kinds deadlock,slow,gil-hog
        nsa-diag selftest --preset m7c-125m --seq-len 2048 --dtype bf16 --device cuda --json
    """
    from nsa_diag.cases import check_options, parse_kinds, selftest_specs, uses_cuda
    from nsa_diag.session import run_session

    chosen = parse_kinds(kinds)
    cuda = options.device.value != "cpu" and uses_cuda(options)
    if options.stall is None:
        options = options.replace(stall=SELFTEST_CUDA_STALL_S if cuda else SELFTEST_STALL_S)
    check_options(options)
    cases = selftest_specs(options, chosen, cuda=cuda)
    code = run_session(
        "selftest",
        [spec for spec, _ in cases],
        out=options.out,
        tag=options.tag,
        json_output=json_output,
        expectations={spec.name: expected for spec, expected in cases},
    )
    raise typer.Exit(code)
