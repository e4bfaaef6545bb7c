"""A --model as users write them: the contract's shapes (outputs, vocabulary, layer layouts), the options a
model cannot take refused before anything runs (one per option family), --gc and DDP's options on a model
of the seeds' kind, and a Hugging Face GPT-2 through run, selftest and ddp (with the ``hf`` extra)."""

from __future__ import annotations

from pathlib import Path

import pytest
from diag_cli import run_cli, run_cli_json

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
    pytest.param(["run", "--sel", "masked"], "holds no NSAAttention", id="nsa-backend"),
    pytest.param(["branch"], "--branch cmp: set nsa_core's NSA attention", id="branch"),
    pytest.param(["backend"], "--reference-check (and nsa-diag backend)", id="backend"),
    pytest.param(["verify", "--only", "backends"], "needs an nsa_core.TinyLM", id="verify-backends"),
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
def test_options_a_model_cannot_take_are_refused(args: list[str], message: str, tmp_path: Path) -> None:
    model = [] if "--model" in args else ["--model", "diag_user_model:build"]
    done = run_cli(*args, *model, "--seq-len", "16", "--out", tmp_path, planted=True)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert message in lines[0]
    assert not list(tmp_path.iterdir()), "refused before any run folder"


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
