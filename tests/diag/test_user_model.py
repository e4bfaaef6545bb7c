"""A --model as users write them: the contract's shapes (outputs, vocabulary, layer layouts), the options a
model cannot take refused before anything runs (one per option family), plain models (no vocab_size) found
as they are and misbehaving in training, ddp's pre-flight on them, --gc and DDP's options on a model of the
seeds' kind, and a Hugging Face GPT-2 through run, selftest and ddp (with the ``hf`` extra)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from diag_cli import cli_env, preflight_in_process, run_cli, run_cli_json

from nsa_diag.app import run_cli as cli_main
from nsa_diag.errors import UsageError
from nsa_diag.spec import CaseSpec
from nsa_diag.worker.contract import load_factory
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
    # no vocab_size and no layers where nsa-diag looks first: the only nn.Embedding, a list one level down
    pytest.param("tensor,none,layers", None, "tensor", "embed (the only nn.Embedding)", id="only-embedding"),
    pytest.param("tensor,attr,decoder.stack", None, "tensor", "vocab_size", id="layers-one-level-down"),
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
        pytest.param(
            "diag_plain_model:tied",
            "",
            "no vocabulary size: it has no vocab_size (nor config.vocab_size, get_input_embeddings(), "
            "get_output_embeddings()), 2 nn.Embedding (tokens 256, positions 64), and its last module "
            "(norm: LayerNorm) has no out_features: pass --vocab N",
            id="no-vocab",
        ),
        pytest.param(
            "shaped", "tensor,attr,a.b.c.d", "up to 3 attributes down: name the list", id="too-deep"
        ),
        pytest.param(
            "diag_plain_model:two_stacks",
            "",
            "EncoderDecoderLM has 2 lists of layers of the same length, and nsa-diag cannot tell which are "
            "its layers: encoder (2 x Block), decoder (2 x Block): name one with --layers-attr NAME",
            id="ambiguous-layers",
        ),
        pytest.param("raising", "", "the factory raised RuntimeError: no checkpoint", id="factory-raises"),
    ],
)
def test_contract_broken(model: str, shape: str, problem: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHAPE", shape or "tensor,attr,layers")
    ref = model if ":" in model else f"diag_user_model:{model}"
    facts = model_facts(CaseSpec(model=ref, seq_len=16))
    assert facts.problem is not None
    assert problem in facts.problem
    assert "\n" not in facts.problem


# --- plain models as users write them (diag_plain_model): nn.Embedding, nn.ModuleList, nn.Linear head ---


def test_vocab_is_the_users_answer_where_the_model_does_not_say() -> None:
    from nsa_diag.cases import check_model_facts

    answered = CaseSpec(model="diag_plain_model:tied", seq_len=16, overrides={"vocab": 256})
    facts = model_facts(answered)
    assert (facts.problem, facts.vocab, facts.vocab_from) == (None, 256, "--vocab")
    check_model_facts(answered, facts)  # taken, though the factory never reads it
    agreeing = CaseSpec(model="diag_plain_model:plain", seq_len=16, overrides={"vocab": 256})
    check_model_facts(agreeing, model_facts(agreeing))
    other = CaseSpec(model="diag_plain_model:plain", seq_len=16, overrides={"vocab": 100})
    with pytest.raises(UsageError, match=r"built a model with vocab 256 \(embed \(the only nn.Embedding\)\)"):
        check_model_facts(other, model_facts(other))


def test_the_probe_finds_the_layers_the_worker_finds() -> None:
    from diag_plain_model import EncoderDecoderLM, PlainLM, Wrapper
    from torch import nn

    from nsa_diag.probe.hooks import find_blocks

    wrapped = Wrapper()
    assert find_blocks(wrapped) == ("net.layers", wrapped.net.layers)
    assert find_blocks(wrapped, "net.layers")[1] is wrapped.net.layers
    plain = PlainLM(layers=2)
    plain.extra = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))  # longer, but `layers` is a known layout
    assert find_blocks(plain)[0] == "layers"
    two = EncoderDecoderLM()
    assert find_blocks(two, "decoder") == ("decoder", two.decoder)  # --layers-attr settles a tie


def test_the_preflight_leaves_the_model_as_it_was() -> None:
    import random

    import torch
    from diag_plain_model import nan_after_update

    from nsa_diag.worker.ddp import untouched

    model = nan_after_update(CaseSpec())
    scale = model.layers[1].scale
    tokens = torch.randint(0, 256, (2, 8))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with untouched(model, torch.device("cpu")):
        model(tokens).sum().backward()
        assert model.layers[1].scale is not scale
        assert float(model.layers[1].scale) == 0.0
        torch.rand(3), random.random()
    assert model.layers[1].scale is scale, "a buffer reassigned in forward is put back"
    assert float(scale) == 1.0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    state, py = torch.get_rng_state(), random.getstate()
    with untouched(model, torch.device("cpu")):
        torch.rand(3), random.random()
    assert torch.equal(torch.get_rng_state(), state)
    assert random.getstate() == py
    assert torch.isfinite(model(tokens)).all(), "the first training forward after it is still the first"


def test_a_hang_in_the_preflight_is_timed_by_the_stall_and_says_pre_flight(tmp_path: Path) -> None:
    from nsa_diag.beacon import BeaconWriter, read_beacon
    from nsa_diag.spec import Where
    from nsa_diag.watchdog import Observation, decide
    from nsa_diag.worker.probes import Progress

    progress = Progress(BeaconWriter(tmp_path / "beacon.bin"), (tmp_path / "progress.jsonl").open("w"))
    progress.step, progress.pre_flight = 1, True
    progress.event(progress.backward_phase, "begin", layer=2, module="layers.2")
    state = read_beacon(tmp_path / "beacon.bin")
    assert state is not None
    assert state.phase == "pre-flight backward"
    assert Where(**state.where()).describe() == "pre-flight, layer 2 backward"
    progress.in_backward = True
    assert progress.forward_phase == "pre-flight recompute"
    history = [Observation(state.time - 1, None), Observation(state.time, state)]
    decision = decide(history, state.time + 5.5, CaseSpec(stall=5.0, timeout=100))
    assert (decision.status, decision.stall_limit_s) == ("stalled", 5.0), "not setup's 60 s"


PLAIN_RUNS = [  # model, verdict, hang kind, where the case says it went wrong
    pytest.param("deadlock", "hang", "python-deadlock", "layer 2 backward step 1", id="deadlock-backward",
                 marks=pytest.mark.slow),
    pytest.param("busy", "hang", "python-busy", "layer 1 backward step 1", id="busy-loop",
                 marks=pytest.mark.slow),
    pytest.param("nan_after_update", "nonfinite", None, "at step 2, first seen in the output of layers.1",
                 id="nan-after-update", marks=pytest.mark.slow),
    pytest.param("abort", "crash", None, "SIGABRT", id="abort", marks=pytest.mark.slow),
    pytest.param("raises", "error", None, "RuntimeError at layer 1 forward step 1", id="exception"),
]  # fmt: skip


@pytest.mark.parametrize("model,verdict,hang_kind,said", PLAIN_RUNS)
def test_plain_models_misbehaving_in_training(
    tmp_path: Path, model: str, verdict: str, hang_kind: str | None, said: str
) -> None:
    code, summary, stderr = run_cli_json(
        "run", "--model", f"diag_plain_model:{model}", "--seq-len", "16", "--steps", "2", "--stall", "3",
        "--device", "cpu", "--out", str(tmp_path),
    )  # fmt: skip
    (case,) = summary["cases"]
    assert (code, case["verdict"], case["hang_kind"]) == (1, verdict, hang_kind), (case["reason"], stderr)
    assert said in case["reason"]
    assert case["model"] == {
        "type": "PlainLM", "layers_attr": "layers", "layers": 3, "vocab": 256,
        "vocab_from": "embed (the only nn.Embedding)",
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,layers_attr,vocab_from",
    [
        pytest.param(["--model", "diag_plain_model:wrapped"], "net.layers",
                     "net.embed (the only nn.Embedding)", id="wrapped"),
        pytest.param(["--model", "diag_plain_model:tied", "--vocab", "256"], "layers", "--vocab", id="vocab"),
    ],
)  # fmt: skip
def test_plain_models_found_as_they_are(
    tmp_path: Path, args: list[str], layers_attr: str, vocab_from: str
) -> None:
    code, summary, stderr = run_cli_json(
        "run", *args, "--seq-len", "16", "--device", "cpu", "--out", str(tmp_path)
    )
    (case,) = summary["cases"]
    assert (code, case["verdict"]) == (0, "pass"), (case["reason"], stderr)
    assert (case["model"]["layers_attr"], case["model"]["vocab_from"]) == (layers_attr, vocab_from)
    assert _result(summary, case)["model"] == case["model"]
    assert f"layers {layers_attr} (" in (Path(summary["run_dir"]) / "summary.md").read_text()


def _result(summary: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    """The case's result.json."""
    return json.loads((Path(summary["run_dir"]) / case["dir"] / "result.json").read_text())


# --- ddp's pre-flight runs the user's model before step 1: it leaves no trace, and is watched as a step ---


@pytest.mark.slow
def test_ddp_preflight_hang_is_placed_and_timed_by_the_stall(tmp_path: Path) -> None:
    code, summary, stderr = run_cli_json(
        "ddp", "--model", "diag_plain_model:deadlock", "--nproc", "2", "--backend", "gloo", "--stall", "5",
        "--seq-len", "16", "--device", "cpu", "--out", str(tmp_path),
    )  # fmt: skip
    (case,) = summary["cases"]
    assert (code, case["verdict"], case["hang_kind"]) == (1, "hang", "python-deadlock"), (
        case["reason"],
        stderr,
    )
    assert case["where"] == "pre-flight, layer 2 backward"
    assert "at pre-flight, layer 2 backward" in case["reason"]
    result = _result(summary, case)
    assert result["stall_limit_s"] == 5.0, "the stall's 5 s, not setup's 60 s"
    assert result["where"]["phase"] == "pre-flight backward"


@pytest.mark.slow
def test_ddp_preflight_changes_nothing_the_steps_compute(tmp_path: Path) -> None:
    code, summary, stderr = run_cli_json(
        "ddp", "--model", "diag_plain_model:nan_after_update", "--nproc", "2", "--backend", "gloo",
        "--steps", "2", "--stall", "60", "--seq-len", "16", "--device", "cpu", "--out", str(tmp_path),
    )  # fmt: skip
    (case,) = summary["cases"]
    assert (code, case["verdict"]) == (1, "nonfinite"), (case["reason"], stderr)
    assert "non-finite loss at step 2" in case["reason"], (
        "as `run` says: the pre-flight's forward left no trace"
    )
    assert _result(summary, case)["ddp"]["preflight"]["verdict"] == "static-graph-safe"


# One per option family: every option applies to the model that runs, or the command says why not (exit 2).
SLOW = pytest.mark.slow
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
    # the three slowest (20-36 s under make test's load) to make test-slow; the others stay
    pytest.param(
        ["verify", "--only", "causality"], "needs an nsa_core.TinyLM", id="verify-causality", marks=SLOW
    ),
    pytest.param(["run", "--dim", "48"], "never reads it", id="model-option-unread", marks=SLOW),
    pytest.param(
        ["run", "--vocab", "100"], "built a model with vocab 64", id="model-option-differs", marks=SLOW
    ),
    # the layer count the pre-flight found, checked against --inject, --gc and a recompute fault: make test
    # keeps the recompute one (both --gc and --inject), the two plain ranges go to make test-slow
    pytest.param(
        ["run", "--inject", "nan:layer=3"], "layers are 0..2 (layers)", id="inject-layer", marks=SLOW
    ),
    pytest.param(
        ["run", "--gc", "0:1", "--inject", "nan:layer=1,phase=recompute"],
        "fires only when layer 1",
        id="recompute",
    ),
    pytest.param(["run", "--gc", "0:9"], "has 3 layers", id="gc-range", marks=SLOW),
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
    # would add only its start-up (`test_a_model_refusal_from_the_command_line`). The model's pre-flight
    # runs in this process too (`diag_cli.preflight_in_process`: its child would import torch again for
    # the same facts). Anything a refusal let through would start its cases in subprocesses, which find
    # the planted models on PYTHONPATH.
    preflight_in_process(monkeypatch)
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


@pytest.mark.slow  # 27 s; the backend refusals and test_backend_every_backend_of_a_user_model stay
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
    # each case's verdict first (the table of a selftest says which one missed), then nsa-diag's stderr
    got = [
        f"{c['name']}: {c['verdict']} {c.get('hang_kind') or ''}: {c['reason'][:300]}"
        for c in summary.get("cases", [])
    ]
    assert code == 0, "\n".join([*got, stderr[-4000:]])


def test_a_factory_without_parameters_is_called_as_it_is(tmp_path: Path) -> None:
    """`def make_model():` or a model class: called with no argument (it reads no option); a factory with
    a parameter gets the spec, as the contract says."""
    module = tmp_path / "zero_arg_models.py"
    module.write_text(
        "import torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = nn.Embedding(64, 8)\n"
        "        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))\n"
        "        self.head = nn.Linear(8, 64)\n"
        "    def forward(self, ids):\n"
        "        x = self.emb(ids)\n"
        "        for layer in self.layers:\n"
        "            x = layer(x)\n"
        "        return self.head(x)\n"
        "def make_model():\n"
        "    return Net()\n"
        "def with_spec(spec):\n"
        "    return Net() if spec.model.endswith('with_spec') else None\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        spec = CaseSpec(name="c", model="zero_arg_models:with_spec")
        for ref in ("zero_arg_models:make_model", "zero_arg_models:Net", "zero_arg_models:with_spec"):
            model = load_factory(ref)(spec)
            assert type(model).__name__ == "Net", ref
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("zero_arg_models", None)
