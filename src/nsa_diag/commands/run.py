"""`nsa-diag run`: one case, isolated in a worker process, under the hang/slow watchdog."""

from __future__ import annotations

import typer

from nsa_diag._cli_utils import CaseOptions, DebugOpt, JsonOpt, case_options
from nsa_diag.options import (
    CASE_NAME,
    EVIDENCE,
    FAULTS,
    FOLLOW_UPS,
    MODEL,
    NSA,
    OUTPUT,
    TRAINING,
    WATCHDOG,
)


@case_options(MODEL, NSA, TRAINING, WATCHDOG, FAULTS, EVIDENCE, FOLLOW_UPS, OUTPUT, CASE_NAME)
def run(options: CaseOptions, json_output: JsonOpt = False, debug: DebugOpt = False) -> None:
    """Run one case (a few real training steps) in a fresh worker process under the watchdog.

    The worker reports where it is (step, phase, layer, branch) from inside the model. No progress for
    the stall limit is a **hang** (`--stall auto`, the default: 120 s until step 1 ends, then 3x its
    duration, at least 10 s; or `--stall SECONDS`); progress that outlasts `--timeout` is **slow**, with
    its rate and the time it would need. Before it stops a hung worker, nsa-diag takes two stack samples
    of all threads a second apart, py-spy native frames when installed, GPU and /proc state. The verdict,
    where, why and the numbers (time per phase, tokens/s, loss, peak memory) go to the table and to
    `<out>/<time>-run/cases/<name>/`, with a `replay.sh` that reproduces the case.

    `--repeat N` runs it N times (hang probability, time to hang, transient failures); `--minimize`
    shrinks a failing case to the smallest command that still fails; `--triage` classifies an oom.

    `--model pkg.module:factory` trains your own model; its contract is in `--model`'s help below (and
    the README): it is built once before the case, and an option it would not take is refused.

    Exit code 0 when the case passes, 1 when not, 2 for a bad option.

    Examples:

        nsa-diag run
        nsa-diag run --inject deadlock:layer=1 --stall 5
        nsa-diag run --preset m7c-125m --seq-len 2048 --dtype bf16 --device cuda --steps 3
        nsa-diag run --inject slow:seconds=2 --steps 10 --timeout 8
        nsa-diag run --gc 0:1 --inject nan:layer=0,phase=recompute
        nsa-diag run --model mypkg.models:build --seq-len 512 --json
        nsa-diag run --inject deadlock:layer=1 --stall 5 --repeat 10 --junit run.xml
        nsa-diag run --layers 4 --seq-len 512 --inject nan:layer=2 --minimize
        nsa-diag run --preset m7c-125m --device cuda --seq-len 65536 --sel masked --triage
    """
    from nsa_diag.cases import build_spec, check_options
    from nsa_diag.launchers.preflight import check_user_model
    from nsa_diag.session import Session, check_follow_ups
    from nsa_diag.session.plans import CaseList

    check_options(options)
    spec = build_spec(options)  # named --name
    check_user_model([spec])  # a --model: built once, its contract and the options it takes checked
    plan = CaseList("run", [spec])
    session = Session(
        plan, out=options.out, tag=options.tag, json_output=json_output, follow=check_follow_ups(options)
    )
    raise typer.Exit(session.run())
