"""The pre-flight of a ``--model``: ``python -P -m nsa_diag.worker.preflight <facts.json> <spec.json>...``.

Run by the command (`nsa_diag.launchers.preflight`) after every other check and before any case: for each
spec it builds the model as the worker will, with a spec that records which overrides the factory reads,
runs one forward of batch 1 on a few tokens without gradients, on the case's device, and writes a
`ModelFacts` per spec (a list, in order). A broken contract is a fact (``problem``), not a crash: the
command refuses it in one line.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nsa_diag import artifacts
from nsa_diag.spec import CaseSpec, ModelFacts, OverrideValue
from nsa_diag.worker.contract import (
    ContractError,
    check_logits,
    is_self_checkpointing,
    load_factory,
    logits_of,
    nsa_settings,
    vocab_of,
)
from nsa_diag.worker.probes import find_blocks

USAGE = "usage: python -m nsa_diag.worker.preflight <facts.json> <spec.json>..."
PROBE_TOKENS = 16  # the forward's length: enough for the output's shape, short for any model on the CPU


class ReadRecorder(dict):  # type: ignore[type-arg]
    """``spec.overrides`` that notes every key the factory looks at (a full read marks them all)."""

    def __init__(self, values: Mapping[str, OverrideValue]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)

    def keys(self) -> Any:
        self.read.update(super().keys())
        return super().keys()

    def items(self) -> Any:
        self.read.update(super().keys())
        return super().items()

    def __iter__(self) -> Any:
        self.read.update(super().keys())
        return super().__iter__()


def model_facts(spec: CaseSpec) -> ModelFacts:
    """Build ``spec``'s model and run one forward; what was found (``problem`` when the contract broke)."""
    import torch

    assert spec.model is not None
    facts = ModelFacts(model=spec.model)
    recording = spec.model_copy()
    overrides = ReadRecorder(dict(spec.overrides))
    object.__setattr__(recording, "overrides", overrides)  # frozen model: the recorder in place of the dict
    try:
        factory = load_factory(spec.model)
        torch.manual_seed(spec.seed)
        try:
            model = factory(recording)
        except Exception as exc:
            raise ContractError(f"the factory raised {type(exc).__name__}: {exc}") from exc
        facts.read_overrides = sorted(overrides.read)
        if not isinstance(model, torch.nn.Module):
            raise ContractError(f"the factory returned {type(model).__name__}, not an nn.Module")
        facts.type = type(model).__name__
        facts.self_checkpointing = is_self_checkpointing(model)
        try:
            facts.layers_attr, blocks = find_blocks(model, spec.layers_attr)
        except ValueError as exc:
            raise ContractError(str(exc)) from None
        facts.layers = len(blocks)
        facts.vocab, facts.vocab_from = vocab_of(model, spec.overrides.get("vocab"))  # not the factory's read
        facts.nsa_layers, facts.nsa_values = nsa_settings(model, blocks)
        cfg = getattr(model, "cfg", None)
        if facts.self_checkpointing and cfg is not None:  # a TinyLM: its config says what it runs
            for key in ("vocab", "dim", "layers", "heads", "kv_heads", "head_dim", "mlp_hidden", "prefill",
                        "gc", "gc_reentrant"):  # fmt: skip
                facts.nsa_values[key] = [getattr(cfg, key)]
        seq = min(spec.seq_len, PROBE_TOKENS)
        # on the device the case runs on: a model whose layers run Triton kernels cannot run on the CPU
        cuda = spec.device in ("cuda", "auto") and torch.cuda.is_available()
        device = torch.device("cuda") if cuda else torch.device("cpu")
        model = model.to(device)
        tokens = torch.randint(0, facts.vocab, (1, seq), device=device)
        with torch.no_grad():
            try:
                output = model(tokens)
            except Exception as exc:
                raise ContractError(
                    f"one forward of ids [1, {seq}] raised {type(exc).__name__}: {exc}"
                ) from exc
        facts.output = (
            "tensor" if isinstance(output, torch.Tensor)
            else type(output).__name__ if isinstance(output, tuple | list) else ".logits"
        )  # fmt: skip
        check_logits(logits_of(output), 1, seq, facts.vocab)
    except ContractError as exc:
        facts.problem = " ".join(exc.reason.split())
    return facts


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    found: list[ModelFacts] = []
    for path in args[1:]:
        spec = CaseSpec.model_validate_json(Path(path).read_text())
        try:
            found.append(model_facts(spec))
        except Exception as exc:  # not the model's contract: nsa-diag's own failure, with its traceback
            traceback.print_exc()
            found.append(ModelFacts(model=str(spec.model), problem=f"{type(exc).__name__}: {exc}"))
    artifacts.write_text(Path(args[0]), json.dumps([facts.model_dump(mode="json") for facts in found]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
