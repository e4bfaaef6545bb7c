"""`nsa-diag verify`: the correctness properties of an NSA configuration, one case per property."""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

import typer

from nsa_diag._cli_utils import CaseOptions, DebugOpt, JsonOpt, case_options
from nsa_diag.options import (
    CHECK_OMITS,
    EVIDENCE,
    FAULTS,
    FOLLOW_UPS,
    MODEL,
    NSA,
    OUTPUT,
    TRAINING,
    WATCHDOG,
)
from nsa_diag.spec import OverrideValue

PROPERTIES = ("backends", "causality", "prefill", "gc")
CHECK_TIMEOUT_S = 1800.0  # float64 on the CPU: m7c-125m takes minutes per property
CHECK_STALL_S = 120.0  # seconds without progress (a check reports every block) under --stall auto


def verify_seq_len(cfg: Any) -> int:
    """The smallest S that makes selection sparse (S > n_sel·l' by one block), longer than the window,
    and a multiple of no block length (+3): tiny 83, small 291, m7c-125m 1091."""
    nsa = cfg.nsa
    return max(nsa.n_sel * nsa.sel_block_len + nsa.sel_block_len, nsa.window + nsa.block_len) + 3


def parse_properties(text: str | None) -> tuple[str, ...]:
    """`--only causality,gc` -> the properties, checked; None: all of them."""
    from nsa_diag.cases import parse_choice_list

    return parse_choice_list("--only", text, PROPERTIES, "property")


class _CheckFields(TypedDict, total=False):
    """The `CaseSpec` fields every property's case shares."""

    seq_len: int
    stall: float
    dtype: str


def verify_specs(options: CaseOptions, on_cuda: bool, properties: tuple[str, ...] = PROPERTIES) -> list[Any]:
    """One `check` case per property; on CUDA in bf16 unless another low precision is asked for."""
    from nsa_diag.cases import build_spec, model_config, parse_stall, preset_overrides

    cfg = model_config(options.preset.value, preset_overrides(options))
    fields = _CheckFields(seq_len=options.seq_len or verify_seq_len(cfg))
    if parse_stall(options.stall) == "auto":  # no training step to measure: a fixed, generous limit
        fields["stall"] = CHECK_STALL_S
    if on_cuda and options.dtype.value == "fp32":
        fields["dtype"] = "bf16"
    specs = []
    for prop in properties:
        overrides: dict[str, OverrideValue] = {}
        if prop == "prefill":
            overrides = {"gc": "none", "gc_reentrant": False, "prefill": "batched"}
        if prop == "gc":
            overrides = {"gc": "none", "gc_reentrant": False}
        specs.append(build_spec(options, name=prop, overrides=overrides, check=prop, **fields))
    return specs


@case_options(
    MODEL,
    NSA,
    TRAINING,
    WATCHDOG,
    FAULTS,
    EVIDENCE,
    FOLLOW_UPS,
    OUTPUT,
    omit=CHECK_OMITS,
    defaults={"batch": 1, "timeout": CHECK_TIMEOUT_S},
)
def verify(
    options: CaseOptions,
    only: Annotated[
        str | None,
        typer.Option("--only", metavar="P,Q,...", help=f"Only these properties: {', '.join(PROPERTIES)}."),
    ] = None,
    json_output: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check the correctness properties of the model, one case (an isolated worker) per property:

    - **backends**: every selection, compression and window backend against the reference backends:
      the logits and every parameter's gradient, same weights and batch (a `--model`: copies of it whose
      nsa_core NSAAttention modules run each backend; the other properties need an nsa_core.TinyLM);
    - **causality**: changing the tokens from position t on changes no logit before t (several t);
    - **prefill**: batched prefill, sequential prefill, and prefill + one decode step per token agree;
    - **gc**: gradient checkpointing of all layers and of a middle range, reentrant and not, gives the
      gradients of no checkpointing.

    On the CPU in float64 (bound: `--tolerance`, default 1e-9 relative); on CUDA in bf16 (or the
    `--dtype` given), with a bound of twice the error of the same computation with the masked backends
    in that dtype against fp32, plus 1e-2. The default S is the smallest that keeps selection sparse
    (n_sel·l' plus a block, plus 3 so it is a multiple of no block length), batch 1.

    Verdict per property: pass, or **mismatch** with the largest relative error and where it is.
    Exit code 0 when every property holds, 1 when one does not (its case names the property), 2 for a
    bad option, or for a `--model` a property cannot apply to: `backends` needs a model that holds
    nsa_core NSAAttention modules, the others a model that is an nsa_core.TinyLM (or subclass).

    Examples:

        nsa-diag verify
        nsa-diag verify --preset m7c-125m
        nsa-diag verify --only backends --model mypkg.models:build_with_nsa_attention
        nsa-diag verify --only causality,prefill --model mypkg.models:build_tinylm_subclass
        nsa-diag verify --preset m7c-125m --device cuda --json
        nsa-diag verify --junit verify.xml
    """
    from nsa_diag.cases import check_options, uses_cuda
    from nsa_diag.launchers.preflight import check_user_model
    from nsa_diag.session import Session, check_follow_ups
    from nsa_diag.session.plans import CaseList

    properties = parse_properties(only)
    check_options(options)
    specs = verify_specs(options, uses_cuda(options), properties)
    check_user_model(specs)
    plan = CaseList("verify", specs)
    session = Session(
        plan, out=options.out, tag=options.tag, json_output=json_output, follow=check_follow_ups(options)
    )
    raise typer.Exit(session.run())
