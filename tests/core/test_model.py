"""Whole-model properties in float64: every backend combination == the all-reference model, and causality.

Models of different backend configs share one ``state_dict``; each tested model is the reference model's
weights loaded strictly into the tested config.
"""

from __future__ import annotations

import pytest
import torch

from nsa_core import TinyLM, preset

from .utils import (
    BATCH,
    DTYPE,
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
    tiny_config,
)

COMBOS = [pytest.param(combo, id=combo_id(combo)) for combo in backend_combos()]
FORCED = [pytest.param(branch, id=f"force_{branch}") for branch in ("cmp", "sel", "win")]


@pytest.fixture(scope="module")
def reference_run() -> tuple[TinyLM, torch.Tensor, torch.Tensor]:
    """The all-reference model after one backward: (model with .grad set, tokens, logits)."""
    model = make_model(seed=0, **MODEL_OVERRIDES, **REFERENCE_BACKENDS)
    tokens = random_tokens(BATCH, SEQ_LEN)
    logits = model(tokens)
    logits_loss(logits).backward()
    return model, tokens, logits.detach()


@pytest.mark.parametrize("backends", COMBOS)
def test_model_matches_reference(reference_run: tuple, backends: dict[str, str]) -> None:
    ref, tokens, ref_logits = reference_run
    tri = clone_model(ref, **MODEL_OVERRIDES, **backends)
    tri_logits = tri(tokens)
    logits_loss(tri_logits).backward()
    assert tri_logits.shape == (BATCH, SEQ_LEN, tri.cfg.vocab)
    assert_close("logits", ref_logits, tri_logits)
    assert_grads_close(ref, tri)


@pytest.mark.parametrize("branch", FORCED)
def test_forced_branch_matches_reference(branch: str) -> None:
    """A forced branch computed by the default backends equals the same branch computed by the references."""
    tokens = random_tokens(BATCH, SEQ_LEN)
    ref = make_model(seed=0, force_branch=branch, **MODEL_OVERRIDES, **REFERENCE_BACKENDS)
    tri = clone_model(ref, force_branch=branch, **MODEL_OVERRIDES)
    ref_logits, tri_logits = ref(tokens), tri(tokens)
    logits_loss(ref_logits).backward()
    logits_loss(tri_logits).backward()
    assert_close("logits", ref_logits, tri_logits)
    assert_grads_close(ref, tri, allow_none=True)


def test_state_dict_is_shared_by_every_config() -> None:
    """Backends and forced branches change what is computed, never the parameters."""
    base = {k: v.shape for k, v in make_model(**MODEL_OVERRIDES).state_dict().items()}
    configs = [*backend_combos(), REFERENCE_BACKENDS, *(dict(force_branch=b) for b in ("cmp", "sel", "win"))]
    for overrides in configs:
        other = TinyLM(tiny_config(**MODEL_OVERRIDES, **overrides))
        assert {k: v.shape for k, v in other.state_dict().items()} == base, overrides


def test_model_is_deterministic() -> None:
    model = make_model(**MODEL_OVERRIDES)
    tokens = random_tokens(BATCH, SEQ_LEN)
    with torch.no_grad():
        assert torch.equal(model(tokens), model(tokens))


@pytest.mark.parametrize("seq_len", [1, 2, 7, 8, 9, 17])
def test_short_sequences(seq_len: int) -> None:
    """Any S >= 1 works, also before the first compressed block (S < l) is complete."""
    ref = make_model(**MODEL_OVERRIDES, **REFERENCE_BACKENDS)
    tri = clone_model(ref, **MODEL_OVERRIDES)
    tokens = random_tokens(BATCH, seq_len)
    ref_logits, tri_logits = ref(tokens), tri(tokens)
    logits_loss(ref_logits).backward()
    logits_loss(tri_logits).backward()
    assert_close("logits", ref_logits, tri_logits)
    assert_grads_close(ref, tri, allow_none=True)


# --- causality ---------------------------------------------------------------------------------------------

CUTS = (1, 9, 24, 41, SEQ_LEN - 1)  # positions from which on the tokens change


def changed_from(tokens: torch.Tensor, cut: int, vocab: int) -> torch.Tensor:
    """``tokens`` with every position >= ``cut`` replaced by a different token."""
    changed = tokens.clone()
    shift = torch.randint(1, vocab, changed[:, cut:].shape)
    changed[:, cut:] = (changed[:, cut:] + shift) % vocab
    return changed


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(REFERENCE_BACKENDS, id=combo_id(REFERENCE_BACKENDS)),
        *COMBOS,
        *(pytest.param(dict(force_branch=b), id=f"force_{b}") for b in ("cmp", "sel", "win")),
    ],
)
def test_causality(overrides: dict[str, str]) -> None:
    """Changing the tokens at positions >= t changes no logit before t (and does change the logit at t)."""
    model = make_model(**MODEL_OVERRIDES, **overrides)
    tokens = random_tokens(BATCH, SEQ_LEN)
    with torch.no_grad():
        base = model(tokens)
        for cut in CUTS:
            out = model(changed_from(tokens, cut, model.cfg.vocab))
            assert_close(f"logits before {cut}", base[:, :cut], out[:, :cut], ratio=1e-13, atol=1e-14)
            assert (out[:, cut] - base[:, cut]).abs().max() > 1e-6, (
                f"changing token {cut} left its logits as they were"
            )


@pytest.mark.parametrize("name, seq_len", [("tiny", 69), ("small", 70)])
def test_preset_matches_reference(name: str, seq_len: int) -> None:
    """The presets as shipped (default backends, no overrides) against their all-reference twins."""
    torch.manual_seed(0)
    ref = TinyLM(preset(name, **REFERENCE_BACKENDS)).to(DTYPE)
    tri = TinyLM(preset(name)).to(DTYPE)
    tri.load_state_dict(ref.state_dict())
    tokens = random_tokens(BATCH, seq_len, vocab=ref.cfg.vocab)
    ref_logits, tri_logits = ref(tokens), tri(tokens)
    logits_loss(ref_logits).backward()
    logits_loss(tri_logits).backward()
    assert_close("logits", ref_logits, tri_logits)
    assert_grads_close(ref, tri)
