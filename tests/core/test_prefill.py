"""Prefill modes and decode compute one function: batched == sequential == prefill(k) + decode, S > window.

S = 53 with the tiny window 32: the decode steps run past the window, and S is no multiple of the block
stride 4, the block length 8 or the selection block length 8 (`utils.MODEL_OVERRIDES`).
"""

from __future__ import annotations

import pytest
import torch

from nsa_core import KVCache, TinyLM

from .utils import (
    BATCH,
    MODEL_OVERRIDES,
    REFERENCE_BACKENDS,
    SEQ_LEN,
    assert_close,
    assert_grads_close,
    backend_combos,
    clone_model,
    combo_id,
    logits_loss,
    make_model,
    random_tokens,
)

FAMILIES = [
    pytest.param(REFERENCE_BACKENDS, id=combo_id(REFERENCE_BACKENDS)),
    *(pytest.param(combo, id=combo_id(combo)) for combo in backend_combos()),
]
PREFIX_LENS = (1, 21, 37)  # tokens prefilled before decoding: one, less than the window, more than the window


def prefill_then_decode(model: TinyLM, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, KVCache]:
    """Logits of every position: ``model.prefill`` over the first ``k`` tokens, then one decode per token."""
    logits, cache = model.prefill(tokens[:, :k])
    assert logits.shape == (tokens.shape[0], k, model.cfg.vocab)
    steps = [logits]
    for t in range(k, tokens.shape[1]):
        step, cache = model.decode(tokens[:, t : t + 1], cache)
        assert step.shape == (tokens.shape[0], 1, model.cfg.vocab)
        steps.append(step)
    return torch.cat(steps, dim=1), cache


@pytest.mark.parametrize("backends", FAMILIES)
def test_batched_equals_sequential_equals_decode(backends: dict[str, str]) -> None:
    batched = make_model(**MODEL_OVERRIDES, **backends)
    sequential = clone_model(batched, prefill="sequential", **MODEL_OVERRIDES, **backends)
    tokens = random_tokens(BATCH, SEQ_LEN)
    with torch.no_grad():
        ref_logits = batched(tokens)
        assert_close("sequential", ref_logits, sequential(tokens))
        for k in PREFIX_LENS:
            tri_logits, cache = prefill_then_decode(batched, tokens, k)
            assert_close(f"prefill {k} + decode", ref_logits, tri_logits)
            assert cache.length == SEQ_LEN
        # a sequential model's prefill hands over a cache that decodes the same way
        tri_logits, cache = prefill_then_decode(sequential, tokens, PREFIX_LENS[1])
        assert_close("sequential prefill + decode", ref_logits, tri_logits)
        assert cache.length == SEQ_LEN


@pytest.mark.parametrize("backends", FAMILIES)
def test_sequential_gradients_equal_batched(backends: dict[str, str]) -> None:
    """Autograd flows through the decode cache: sequential prefill trains to the same gradients."""
    batched = make_model(**MODEL_OVERRIDES, **backends)
    sequential = clone_model(batched, prefill="sequential", **MODEL_OVERRIDES, **backends)
    tokens = random_tokens(BATCH, SEQ_LEN)
    ref_logits, tri_logits = batched(tokens), sequential(tokens)
    logits_loss(ref_logits).backward()
    logits_loss(tri_logits).backward()
    assert_close("logits", ref_logits, tri_logits)
    assert_grads_close(batched, sequential)


@pytest.mark.parametrize("branch", ["cmp", "sel", "win"])
def test_decode_with_forced_branch(branch: str) -> None:
    batched = make_model(force_branch=branch, **MODEL_OVERRIDES)
    tokens = random_tokens(BATCH, SEQ_LEN)
    with torch.no_grad():
        ref_logits = batched(tokens)
        tri_logits, _ = prefill_then_decode(batched, tokens, PREFIX_LENS[1])
    assert_close("prefill + decode", ref_logits, tri_logits)


def test_decode_rows_are_independent_of_the_batch() -> None:
    """Each sequence of a batch decodes as it would alone."""
    model = make_model(**MODEL_OVERRIDES)
    tokens = random_tokens(BATCH, SEQ_LEN)
    with torch.no_grad():
        together, _ = prefill_then_decode(model, tokens, PREFIX_LENS[1])
        alone, _ = prefill_then_decode(model, tokens[1:], PREFIX_LENS[1])
    assert_close("row 1", together[1:], alone)


def test_decode_refuses_several_tokens() -> None:
    model = make_model(**MODEL_OVERRIDES)
    tokens = random_tokens(BATCH, 10)
    with torch.no_grad():
        _, cache = model.prefill(tokens[:, :5])
        with pytest.raises(ValueError, match="one token"):
            model.decode(tokens[:, 5:7], cache)


def test_tiny_preset_as_shipped() -> None:
    """The tiny preset without overrides (l' = 16): S = 69 has 5 selection blocks for n = 4 slots."""
    seq_len = 69
    batched = make_model()
    sequential = clone_model(batched, prefill="sequential")
    tokens = random_tokens(BATCH, seq_len)
    with torch.no_grad():
        ref_logits = batched(tokens)
        assert_close("sequential", ref_logits, sequential(tokens))
        tri_logits, cache = prefill_then_decode(batched, tokens, 33)
    assert_close("prefill 33 + decode", ref_logits, tri_logits)
    assert cache.length == seq_len
