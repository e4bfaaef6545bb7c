"""A Hugging Face causal LM for ``--model diag_hf_model:gpt2`` (random init from a small config; needs the
``hf`` extra, ``pip install -e '.[hf]'``). Not a test module: the worker imports it by name."""

from __future__ import annotations

from typing import Any


def gpt2(spec: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=500, n_positions=256, n_embd=32, n_layer=int(spec.overrides.get("layers", 2)), n_head=2,
        bos_token_id=0, eos_token_id=0, use_cache=False,  # training: no decode cache (and so --gc works)
    )  # fmt: skip
    return GPT2LMHeadModel(config)
