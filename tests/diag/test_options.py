"""Case options are declared once: every declaration is complete, the choices match `nsa_core`, and a replay
line read back through the command line builds the spec it came from.

In-process and without workers: `Session.run` is replaced by one that keeps the specs of its plan.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
from diag_cli import preflight_in_process

from nsa_diag import cases
from nsa_diag.app import run_cli
from nsa_diag.cases import CASE_OPTIONS, DDP_OPTIONS, SPEC_OPTIONS, CaseOptions, build_spec, replay_argv
from nsa_diag.options import GROUPS, SESSION_OPTIONS, NotAnOption, Opt
from nsa_diag.session import Session
from nsa_diag.spec import MODEL_OPTIONS, CaseSpec, DdpSpec


def test_every_case_spec_field_has_exactly_one_declaration() -> None:
    for field, info in CaseSpec.model_fields.items():
        declarations = [item for item in info.metadata if isinstance(item, Opt | NotAnOption)]
        assert len(declarations) == 1, f"CaseSpec.{field}: {declarations}"
        if isinstance(declarations[0], Opt):
            assert declarations[0].name == field
            assert SPEC_OPTIONS[field].flag == declarations[0].flag
    assert set(SPEC_OPTIONS) <= set(CaseSpec.model_fields)


def test_every_ddp_field_declares_its_option() -> None:
    """`nsa-diag ddp`'s options are declared on `DdpSpec` (CaseSpec.ddp), each named after its field."""
    for field, info in DdpSpec.model_fields.items():
        (opt,) = [item for item in info.metadata if isinstance(item, Opt)]
        assert opt.name == field
        assert DDP_OPTIONS[field].flag == opt.flag
    assert list(DDP_OPTIONS) == list(DdpSpec.model_fields)


def test_every_override_has_exactly_one_option() -> None:
    from nsa_core.config import _MODEL_FIELDS, _NSA_FIELDS

    keys = [opt.override for opt in MODEL_OPTIONS]
    assert len(keys) == len(set(keys))
    assert set(keys) <= _MODEL_FIELDS | _NSA_FIELDS
    assert not set(keys) & set(CaseSpec.model_fields)  # an override is never also a spec field


def test_every_option_is_in_exactly_one_group_and_named_once() -> None:
    in_groups = [name for group in GROUPS for name in group.names]
    assert sorted(in_groups) == sorted(CASE_OPTIONS)
    assert len(CASE_OPTIONS) == len(SPEC_OPTIONS) + len(MODEL_OPTIONS) + len(SESSION_OPTIONS) + len(
        DDP_OPTIONS
    )
    flags = [opt.flag for opt in CASE_OPTIONS.values()]
    assert len(flags) == len(set(flags))


def test_spec_choices_come_from_the_enums_and_match_nsa_core() -> None:
    import nsa_core
    from nsa_diag.options import FaultKind, values_of
    from nsa_diag.spec import Injection

    fields = CaseSpec.model_fields
    assert typing.get_args(fields["preset"].annotation) == tuple(nsa_core.PRESETS)
    assert typing.get_args(Injection.model_fields["kind"].annotation) == values_of(FaultKind)
    help_text = SPEC_OPTIONS["inject"].help
    assert all(kind in help_text for kind in values_of(FaultKind))  # skip-collective included
    backends = {
        opt.override: values_of(opt.type) for opt in MODEL_OPTIONS if opt.override.endswith("_backend")
    }
    triton = nsa_core.TRITON_BACKENDS
    assert backends == {
        "sel_backend": nsa_core.SEL_BACKENDS + triton,
        "cmp_backend": nsa_core.CMP_BACKENDS + triton,
        "win_backend": nsa_core.WIN_BACKENDS + triton,
    }


def test_metadata_leaves_spec_json_alone() -> None:
    spec = CaseSpec()
    assert list(spec.model_dump()) == list(CaseSpec.model_fields)
    assert "Opt" not in str(CaseSpec.model_json_schema())


# --- replay lines read back through the command line -------------------------------------------------------


def _spec_of_command_line(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> CaseSpec:
    kept: list[CaseSpec] = []

    def keep(self: Session) -> int:
        kept.extend(self.plan.specs())
        return 0

    monkeypatch.setattr(Session, "run", keep)
    assert run_cli(argv) == 0
    (spec,) = kept
    return spec


def _options(**values: Any) -> Any:
    return CaseOptions(**{"device": CASE_OPTIONS["device"].type("cpu"), **values})


_GEOMETRY = {
    "layers": 3, "window": 16, "sel": "packed", "branch": "win", "gc": "1:3", "gc_reentrant": True,
    "seq_len": 96, "dtype": "bf16", "inject": ("deadlock:layer=2,phase=recompute",), "stall": 4,
}  # fmt: skip
_EVERY_OPTION = {
    "preset": "small", "dim": 128, "heads": 8, "kv_heads": 4, "head_dim": 16, "vocab": 512,
    "mlp_hidden": 256, "block_len": 16, "block_stride": 8, "sel_block_len": 32, "n_sel": 4,
    "n_init": 0, "n_local": 1, "prefill": "sequential", "cmp": "reference", "win": "masked",
    "batch": 3, "seed": 7, "lr": 0.01, "timeout": 50.0, "tolerance": 1e-3, "reference_check": True,
    "anomaly": True, "launch_blocking": True, "profile": True,
    "alloc_conf": "expandable_segments:True", "steps": 2,
    "inject": ("nan:layer=1", "slow:seconds=0.5,step=2"),
}  # fmt: skip
ROUND_TRIPS = [
    pytest.param({}, id="defaults"),
    pytest.param(_GEOMETRY, id="geometry-branch-gc-inject"),
    pytest.param(_EVERY_OPTION, id="every-option"),
    pytest.param({"model": "diag_user_model:build", "layers_attr": "layers", "seq_len": 64}, id="user-model"),
    # refused on the CPU: the test pretends a GPU is there
    pytest.param({"device": "cuda", "memory_snapshot": True}, id="cuda-memory-snapshot"),
]


def _typed(values: dict[str, Any]) -> dict[str, Any]:
    """Choices as their Enum members, as the command line gives them."""
    typed = {}
    for name, value in values.items():
        kind = CASE_OPTIONS[name].type
        typed[name] = (
            kind(value) if isinstance(kind, type) and issubclass(kind, str) and kind is not str else value
        )
    return typed


@pytest.mark.parametrize("values", ROUND_TRIPS)
def test_replay_line_builds_the_same_spec(
    values: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preflight_in_process(monkeypatch)  # the --model's pre-flight, without a child importing torch again
    monkeypatch.setattr(cases, "cuda_available", lambda: True)
    spec = build_spec(_options(**_typed(values)), name="round-trip")
    argv = replay_argv(spec, tmp_path)
    again = _spec_of_command_line(argv[3:], monkeypatch)
    assert again.spec_hash() == spec.spec_hash()
    assert again == spec
    assert replay_argv(again, tmp_path) == argv


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DDP_ROUND_TRIPS = [
    pytest.param(
        {
            "nproc": 3,
            "backend": "gloo",
            "static_graph": True,
            "bucket_mb": 5.0,
            "trace_buckets": True,
            "straggler_ratio": 1.5,
        },
        id="one-node",
    ),
    pytest.param(  # node 0 of two: its rendezvous is checked (it can listen there), then its session
        {
            "nproc": 1,
            "find_unused": True,
            "nnodes": 2,
            "rdzv_endpoint": "127.0.0.1:{port}",
            "run_id": "r1",
            "rdzv_timeout": 30.0,
        },
        id="node-0-of-2",
    ),
]


@pytest.mark.parametrize("ddp", DDP_ROUND_TRIPS)
def test_ddp_replay_line_builds_the_same_spec(
    ddp: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nsa_diag.cases import build_ddp_spec

    if "rdzv_endpoint" in ddp:
        ddp = {**ddp, "rdzv_endpoint": ddp["rdzv_endpoint"].format(port=_free_port())}
    options = _options(**_typed({"inject": ("skip-collective:rank=1",), "layers": 3}), **ddp)
    spec = build_ddp_spec(options, name="d")
    assert spec.ddp == DdpSpec(**ddp)
    argv = replay_argv(spec, tmp_path)
    assert argv[3] == "ddp"
    again = _spec_of_command_line(argv[3:], monkeypatch)
    assert again.spec_hash() == spec.spec_hash()
    assert again == spec
    assert replay_argv(again, tmp_path) == argv
