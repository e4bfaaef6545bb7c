"""`nsa-diag selftest`: inject every fault kind and check that each is detected and classified."""

from __future__ import annotations

from typing import Annotated

import typer

from nsa_diag._cli_utils import CaseOptions, DebugOpt, JsonOpt, case_options
from nsa_diag.options import EVIDENCE, FAULTS, FOLLOW_UPS, MODEL, NSA, OUTPUT, TRAINING, WATCHDOG

SELFTEST_STALL_S = 3.0
SELFTEST_CUDA_STALL_S = 10.0  # CUDA start-up and first kernels can sit silent for seconds
SELFTEST_TIMEOUT_S = 60.0


# The faults are the selftest's own, on the built-in model or a --model: --inject and the checks are left out.
@case_options(
    MODEL,
    NSA,
    TRAINING,
    WATCHDOG,
    FAULTS,
    EVIDENCE,
    FOLLOW_UPS,
    OUTPUT,
    omit=("branch", "inject", "reference_check", "tolerance"),
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
    ddp: Annotated[
        bool,
        typer.Option(
            "--ddp",
            help="The ddp fault kinds instead (skip-collective, unused-param), 2 ranks through torchrun: "
            "gloo on the CPU, nccl with GPUs.",
            rich_help_panel="Faults and checks",
        ),
    ] = False,
    json_output: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Inject every fault kind, one case each, and check the verdict and hang kind nsa-diag gives it.

    Faults fire in the backward of the last layer at step 1, in the built-in model or in your `--model`
    (`unused-param` then detaches its last layer's first module with parameters). Expected:

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
    | gpu-spin | hang (CUDA only: left out without it, and said so) | cuda-kernel |

    `--ddp` (issue 6) runs the ddp kinds on 2 ranks instead: `skip-collective` on rank 1 (hang,
    collective, rank 1 named as the minority) and `unused-param` on every rank (grad-missing naming the
    parameter and the ranks).

    The stall defaults to 3 s (10 s on CUDA); `slow` sleeps 1 s per step with a timeout of twice the
    stall and steps enough for four times that, so the watchdog has to tell it from a hang. The table
    shows expected and observed side by side.

    Exit code 0 when every fault run is classified as expected, 1 on any miss, 2 for a bad option
    (`--kinds gpu-spin` without CUDA among them: it would check nothing).

    Examples:

        nsa-diag selftest
        nsa-diag selftest --kinds deadlock,slow,gil-hog
        nsa-diag selftest --ddp
        nsa-diag selftest --preset m7c-125m --seq-len 2048 --dtype bf16 --device cuda --json
        nsa-diag selftest --kinds deadlock,gil-hog --repeat 5 --junit selftest.xml
    """
    from nsa_diag.cases import (
        build_spec,
        check_model_facts,
        check_options,
        ddp_selftest_specs,
        parse_kinds,
        selftest_specs,
        uses_cuda,
    )
    from nsa_diag.errors import UsageError
    from nsa_diag.launchers.preflight import check_user_model
    from nsa_diag.session import Session, check_follow_ups
    from nsa_diag.session.plans import CaseList

    chosen = parse_kinds(kinds)
    cuda = options.device.value != "cpu" and uses_cuda(options)
    left_out: dict[str, str] = {}
    if not cuda and not ddp and "gpu-spin" in chosen:  # a check that cannot run here is not run, nor passed
        here = "--device cpu" if options.device.value == "cpu" else "torch sees no CUDA device here"
        if kinds is not None:
            raise UsageError(
                f"--kinds gpu-spin: the fault spins a CUDA kernel, and {here}: it would check nothing; "
                "run it on a GPU"
            )
        why = f"it spins a CUDA kernel; {here}"
        chosen = tuple(kind for kind in chosen if kind != "gpu-spin")
        left_out["gpu-spin"] = why
    if options.stall is None:
        options = options.replace(stall=SELFTEST_CUDA_STALL_S if cuda else SELFTEST_STALL_S)
    check_options(options)
    # a --model: built once, its last layer gets the faults
    facts = check_user_model([build_spec(options, name="preflight")]) if options.model else None
    layers = facts.layers if facts is not None else None
    if ddp:  # issue 6: the ddp fault kinds on 2 ranks
        cases = ddp_selftest_specs(options, layers=layers)
    else:
        cases = selftest_specs(options, chosen, cuda=cuda, layers=layers)
    for spec, _ in cases:
        if facts is not None:
            check_model_facts(spec, facts)
    plan = CaseList(
        "selftest",
        [spec for spec, _ in cases],
        {spec.name: expected for spec, expected in cases},
        left_out=left_out,
    )
    session = Session(
        plan, out=options.out, tag=options.tag, json_output=json_output, follow=check_follow_ups(options)
    )
    raise typer.Exit(session.run())
