"""A --model as users write them: the contract's shapes (outputs, vocabulary, layer layouts), the options a
model cannot take refused before anything runs (one per option family), --gc and DDP's options on a model
of the seeds' kind, and a Hugging Face GPT-2 through run, selftest and ddp (with the ``hf`` extra)."""

from __future__ import annotations

from pathlib import Path

import pytest
from diag_cli import cli_env, run_cli, run_cli_json

from nsa_diag.app import run_cli as cli_main
from nsa_diag.spec import CaseSpec
from nsa_diag.worker.preflight import model_facts

SHAPES = [
    pytest.param("tensor,attr,layers", None, "tensor", "vocab_size", id="tensor-vocab_size-layers"),
    pytest.param("tuple,config,model.layers", None, "tuple", "config.vocab_size", id="tuple-config-llama"),
    pytest.param(
        "list,embedding,transformer.h", None, "list", "get_output_embeddings()", id="list-embedding-h"
    ),
    pytest.param("logits,attr,encoder.layer", None, ".logits", "vocab_size", id="logits-encoder.layer"),
    pytest.param("tensor,attr,blocks", None, "tensor", "vocab_size", id="blocks"),
    pytest.param("tensor,attr,decoder.stack", "decoder.stack", "tensor", "vocab_size", id="layers-attr"),
]


@pytest.mark.parametrize("shape,layers_attr,output,vocab_from", SHAPES)
def test_contract_shapes(
    shape: str, layers_attr: str | None, output: str, vocab_from: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHAPE", shape)
    facts = model_facts(CaseSpec(model="diag_user_model:shaped", layers_attr=layers_attr, seq_len=16))
    assert facts.problem is None
    assert (facts.output, facts.vocab, facts.vocab_from, facts.layers) == (output, 300, vocab_from, 2)
    assert facts.layers_attr == shape.split(",")[2]


@pytest.mark.parametrize(
    "model,shape,problem",
    [
        pytest.param("shaped", "flat,attr,layers", "logits are [16, 300]", id="bad-output-shape"),
        pytest.param("shaped", "tensor,none,layers", "no vocabulary size", id="no-vocab"),
        pytest.param("shaped", "tensor,attr,decoder.stack", "--layers-attr NAME", id="no-known-layers"),
        pytest.param("raising", "", "the factory raised RuntimeError: no checkpoint", id="factory-raises"),
    ],
)
def test_contract_broken(model: str, shape: str, problem: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHAPE", shape or "tensor,attr,layers")
    facts = model_facts(CaseSpec(model=f"diag_user_model:{model}", seq_len=16))
    assert facts.problem is not None
    assert problem in facts.problem


# One per option family: every option applies to the model that runs, or the command says why not (exit 2).
REFUSED = [
    pytest.param(["run", "--window", "64"], "holds no NSAAttention", id="nsa-geometry"),
    pytest.param(  # the same refusal as nsa-geometry, for the backends: make test-slow
        ["run", "--sel", "masked"], "holds no NSAAttention", id="nsa-backend", marks=pytest.mark.slow
    ),
    pytest.param(["branch"], "branch with --model diag_user_model:build: it runs each NSA", id="branch"),
    pytest.param(["backend"], "backend with --model diag_user_model:build: the check", id="backend"),
    pytest.param(  # the same refusal as `backend` above, through the run option: make test-slow
        ["run", "--reference-check"],
        "--reference-check with --model diag_user_model:build",
        id="reference",
        marks=pytest.mark.slow,
    ),
    pytest.param(["verify", "--only", "backends"], "no property applies to UserLM", id="verify-backends"),
    pytest.param(["verify", "--only", "causality"], "needs an nsa_core.TinyLM", id="verify-causality"),
    pytest.param(["run", "--dim", "48"], "never reads it", id="model-option-unread"),
    pytest.param(["run", "--vocab", "100"], "built a model with vocab 64", id="model-option-differs"),
    pytest.param(["run", "--inject", "nan:layer=3"], "layers are 0..2 (layers)", id="inject-layer"),
    pytest.param(
        ["run", "--gc", "0:1", "--inject", "nan:layer=1,phase=recompute"],
        "fires only when layer 1",
        id="recompute",
    ),
    pytest.param(["run", "--gc", "0:9"], "has 3 layers", id="gc-range"),
    pytest.param(
        ["run", "--model", "diag_user_model:raising"], "the factory raised RuntimeError", id="factory"
    ),
]


@pytest.mark.parametrize("args,message", REFUSED)
def test_options_a_model_cannot_take_are_refused(
    args: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # nsa-diag in process (the CLI's own `run_cli`): the refusal comes before any case, so a subprocess
    # would add only its start-up (`test_a_model_refusal_from_the_command_line`); the model's pre-flight
    # is a subprocess still, and finds the planted models on PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", cli_env(planted=True)["PYTHONPATH"])
    model = [] if "--model" in args else ["--model", "diag_user_model:build"]
    code = cli_main([*args, *model, "--seq-len", "16", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message in lines[0]
    assert not list(tmp_path.iterdir()), "refused before any run folder"


def test_a_model_refusal_from_the_command_line(tmp_path: Path) -> None:
    done = run_cli(
        "run", "--window", "64", "--model", "diag_user_model:build", "--out", tmp_path, planted=True
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "holds no NSAAttention" in line
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_recompute_fault_fires_in_a_checkpointed_user_layer(tmp_path: Path) -> None:
    code, summary, stderr = run_cli_json(
        "run", "--model", "diag_user_model:build", "--gc", "0:1", "--inject", "nan:layer=0,phase=recompute",
        "--seq-len", "16", "--device", "cpu", "--out", str(tmp_path),
    )  # fmt: skip
    (case,) = summary["cases"]
    assert (code, case["verdict"]) == (1, "nonfinite"), stderr
    assert "(recompute) of layers.0" in case["reason"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags,verdict,said",
    [
        pytest.param([], "grad-missing", "cmp_proj.weight", id="plain"),
        pytest.param(["--find-unused"], "pass", "tolerated by find_unused_parameters=True", id="find-unused"),
        pytest.param(["--gc-reentrant", "--find-unused"], "error", "marked ready twice", id="reentrant"),
    ],
)
def test_seed_model_under_ddp_with_gc(tmp_path: Path, flags: list[str], verdict: str, said: str) -> None:
    code, summary, stderr = run_cli_json(
        "ddp", "--model", "diag_user_model:seed_lm", "--gc", "all", *flags, "--seq-len", "16", "--steps", "2",
        "--device", "cpu", "--backend", "gloo", "--stall", "60", "--out", str(tmp_path),
    )  # fmt: skip
    (case,) = summary["cases"]
    assert case["verdict"] == verdict, (case["reason"], stderr)
    assert said in case["reason"]
    assert (verdict == "pass") == (case["steps_done"] == 2)


# --- a user model holding nsa_core NSAAttention modules: branch, backend parity and verify apply to them ---

NSA_LM = ["--model", "diag_user_model:nsa_lm", "--seq-len", "32", "--device", "cpu"]
OFF_SEL = ["--model", "diag_user_model:nsa_lm_off_selection", "--seq-len", "32", "--device", "cpu"]


def test_nsa_variant_copies_the_model_with_other_backends() -> None:
    import torch
    from diag_user_model import nsa_lm

    from nsa_diag.worker.nsa_variant import nsa_config, nsa_idle_parameters, with_nsa
    from nsa_diag.worker.probes import attach_progress

    class Events:  # a progress sink that keeps the events (nsa_diag.probe.hooks.ProgressSink)
        forward_phase, backward_phase = "forward", "backward"

        def __init__(self) -> None:
            self.seen: list[str] = []

        def event(self, phase: str, event: str | None = None, **where: object) -> int:
            self.seen.append(f"{phase} {event}")
            return len(self.seen)

    events = Events()
    model = nsa_lm(CaseSpec(overrides={"force_branch": "win"}))
    attach_progress(model, events)
    model(torch.randint(0, 256, (1, 8)))[0].sum().backward()
    seen = len(events.seen)
    ref = with_nsa(model, sel_backend="reference", win_backend="reference")
    assert {m.nsa.win_backend for m in ref.modules() if hasattr(m, "nsa")} == {"reference"}
    assert {m.cfg.nsa.sel_backend for m in ref.modules() if hasattr(m, "nsa")} == {"reference"}
    assert model.layers[0].attn.nsa.win_backend != "reference", "the model itself is left as it is"
    assert all(p.grad is None for p in ref.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in ref.modules()), "our hooks stay behind"
    assert any(m._forward_hooks for m in model.modules())
    for (name, p), (ref_name, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert name == ref_name
        assert torch.equal(p, r)
        assert p.data_ptr() != r.data_ptr()
    ref(torch.randint(0, 256, (1, 8)))[0].sum().backward()
    assert len(events.seen) == seen, "the copy reports nothing through the model's hooks"
    assert all(p.grad is not None for n, p in ref.named_parameters() if n not in nsa_idle_parameters(ref))
    assert nsa_config(model).layers == len(model.layers)
    assert "layers.1.attn.kv_sel.weight" in nsa_idle_parameters(model)  # force_branch win: sel untrained


def test_backend_parity_through_the_nsa_modules_of_a_user_model(tmp_path: Path) -> None:
    # the planted bug is in selection only: sel-masked must mismatch, win-chunked (sel not computed) pass
    code, summary, stderr = run_cli_json(
        "backend", *OFF_SEL, "--sel", "masked", "--win", "chunked", "--out", str(tmp_path)
    )
    cases = {case["name"]: case for case in summary["cases"]}
    assert code == 1, stderr
    sel, win = cases["sel-masked"], cases["win-chunked"]
    assert sel["verdict"] == "mismatch", sel["reason"]
    assert "differs from the reference backends" in sel["reason"]
    assert sel["parity"]["grad_rel_err_max"] > sel["parity"]["grad_bound"] == 1e-4
    assert ".attn." in sel["parity"]["worst_param"]
    assert win["verdict"] == "pass", win["reason"]
    assert win["parity"]["reference_backends"] == {"sel": "reference", "cmp": "reference", "win": "reference"}
    assert 0 <= win["parity"]["grad_rel_err_max"] <= win["parity"]["grad_bound"]


@pytest.mark.slow
def test_backend_every_backend_of_a_user_model_passes(tmp_path: Path) -> None:
    code, summary, stderr = run_cli_json("backend", *NSA_LM, "--out", str(tmp_path), timeout=400)
    assert code == 0, (stderr, [c["reason"] for c in summary.get("cases", [])])
    assert len(summary["cases"]) >= 5
    assert all(case["parity"]["grad_rel_err_max"] <= 1e-4 for case in summary["cases"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,code,verdict", [(NSA_LM, 0, "pass"), (OFF_SEL, 1, "mismatch")], ids=["nsa_lm", "off-selection"]
)
def test_verify_backends_on_a_user_model(tmp_path: Path, model: list[str], code: int, verdict: str) -> None:
    got, summary, stderr = run_cli_json("verify", "--only", "backends", *model, "--out", str(tmp_path))
    (case,) = summary["cases"]
    assert (got, case["verdict"]) == (code, verdict), (case["reason"], stderr)
    assert "sel=masked" in case["parity"]["errors"]
    if verdict == "mismatch":
        assert "at sel=" in case["reason"]


@pytest.mark.slow
def test_branch_on_a_user_model_computes_each_branch(tmp_path: Path) -> None:
    code, summary, stderr = run_cli_json("branch", *NSA_LM, "--out", str(tmp_path))
    assert code == 0, (stderr, [c["reason"] for c in summary.get("cases", [])])
    losses = {case["name"]: case["reason"] for case in summary["cases"]}
    assert list(losses) == ["cmp", "sel", "win", "all"]
    assert len(set(losses.values())) == 4, "each branch alone computes another loss"


# --- a Hugging Face causal LM (the hf extra) -------------------------------------------------------------

HF = ["--model", "diag_hf_model:gpt2", "--seq-len", "16", "--device", "cpu"]


@pytest.fixture
def transformers_on_path() -> None:
    pytest.importorskip("transformers")  # the children run this interpreter, with its packages


@pytest.mark.slow
@pytest.mark.usefixtures("transformers_on_path")
@pytest.mark.parametrize(
    "command", [["run", "--gc", "all", "--steps", "2"], ["selftest"], ["ddp", "--backend", "gloo"]], ids=str
)
def test_hugging_face_gpt2(tmp_path: Path, command: list[str]) -> None:
    code, summary, stderr = run_cli_json(*command, *HF, "--out", str(tmp_path), timeout=400)
    assert code == 0, (stderr, [c["reason"] for c in summary.get("cases", [])])
