"""`nsa-diag branch`: the case once per NSA branch, each computing only that branch, then all of them."""

from __future__ import annotations

import typer

from nsa_diag._cli_utils import CaseOptions, DebugOpt, JsonOpt, case_options
from nsa_diag.options import EVIDENCE, FAULTS, FOLLOW_UPS, MODEL, NSA, OUTPUT, TRAINING, WATCHDOG


@case_options(MODEL, NSA, TRAINING, WATCHDOG, FAULTS, EVIDENCE, FOLLOW_UPS, OUTPUT, omit=("branch",))
def branch(options: CaseOptions, json_output: JsonOpt = False, debug: DebugOpt = False) -> None:
    """Run the case four times: compression only (`cmp`), selection only (`sel`), sliding window only
    (`win`), then every branch (`all`).

    A forced branch truly computes only that branch (`force_branch`): the other branches' projections
    and kernels do not run, so a hang, a crash or NaN that follows one branch shows which. Each case is
    an isolated worker under the watchdog, as with `nsa-diag run`; backends and geometry come from the
    same options.

    Exit code 0 when all four pass, 1 when not, 2 for a bad option.

    Examples:

        nsa-diag branch
        nsa-diag branch --preset m7c-125m --seq-len 2048 --dtype bf16 --device cuda
        nsa-diag branch --sel masked --win masked --seq-len 1024
        nsa-diag branch --inject deadlock:layer=1 --stall 5 --json
        nsa-diag branch --repeat 5 --junit branch.xml
    """
    from nsa_diag.cases import branch_specs, check_options
    from nsa_diag.launchers.preflight import check_user_model
    from nsa_diag.session import Session, check_follow_ups
    from nsa_diag.session.plans import CaseList

    check_options(options)
    specs = branch_specs(options)
    check_user_model(specs, "branch")  # a --model: a branch runs alone only in its NSAAttention modules
    plan = CaseList("branch", specs)
    session = Session(
        plan, out=options.out, tag=options.tag, json_output=json_output, follow=check_follow_ups(options)
    )
    raise typer.Exit(session.run())
