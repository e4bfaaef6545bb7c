"""Gradient checkpointing: same gradients as without it, and the checkpointed blocks are the ones recomputed.

The seeds' checkpointing recomputed the wrong layer (a loop closure re-ran the last block): a forward
pre-hook on every block counts its calls and records its input, so a recompute of the wrong block, or of
the right block on the wrong input, fails here even where the gradients happen to agree.
"""

from __future__ import annotations

import pytest
import torch

from nsa_core import TinyLM, parse_gc

from .utils import (
    BATCH,
    MODEL_OVERRIDES,
    SEQ_LEN,
    assert_close,
    assert_grads_close,
    clone_model,
    logits_loss,
    make_model,
    random_tokens,
)

LAYERS = 4
GC_CASES = [
    pytest.param(gc, reentrant, id=f"gc_{gc}-{'reentrant' if reentrant else 'nonreentrant'}")
    for gc in ("all", "1:3", "2:4", "0:1", "3:4")
    for reentrant in (False, True)
]


@pytest.fixture(scope="module")
def no_gc_run() -> tuple[TinyLM, torch.Tensor, torch.Tensor]:
    model = make_model(layers=LAYERS, **MODEL_OVERRIDES)
    tokens = random_tokens(BATCH, SEQ_LEN)
    logits = model(tokens)
    logits_loss(logits).backward()
    return model, tokens, logits.detach()


def record_block_calls(model: TinyLM) -> dict[int, list[torch.Tensor]]:
    """Inputs of every call of every block, by block position.

    Pre-hooks, not forward hooks: non-reentrant checkpointing may stop a recompute early, once it has
    rebuilt every saved tensor, and a hook after forward would then never see the recompute.
    """
    calls: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(model.blocks))}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda module, args, i=i: calls[i].append(args[0].detach().clone()))
    return calls


@pytest.mark.parametrize("gc, reentrant", GC_CASES)
def test_checkpointing_keeps_gradients(no_gc_run: tuple, gc: str, reentrant: bool) -> None:
    ref, tokens, ref_logits = no_gc_run
    tri = clone_model(ref, layers=LAYERS, gc=gc, gc_reentrant=reentrant, **MODEL_OVERRIDES)
    calls = record_block_calls(tri)
    tri_logits = tri(tokens)
    forward_calls = {i: len(c) for i, c in calls.items()}
    logits_loss(tri_logits).backward()

    assert_close("logits", ref_logits, tri_logits)
    assert_grads_close(ref, tri)
    assert forward_calls == dict.fromkeys(range(LAYERS), 1), "each block runs once in forward"
    expected = {i: 2 if i in parse_gc(gc, LAYERS) else 1 for i in range(LAYERS)}
    assert {i: len(c) for i, c in calls.items()} == expected, "blocks run in forward + backward"
    for i in parse_gc(gc, LAYERS):
        assert_close(f"block {i} recompute input", calls[i][0], calls[i][1], ratio=1e-15, atol=0.0)


def test_no_checkpointing_runs_each_block_once(no_gc_run: tuple) -> None:
    ref, tokens, _ = no_gc_run
    model = clone_model(ref, layers=LAYERS, **MODEL_OVERRIDES)
    calls = record_block_calls(model)
    logits_loss(model(tokens)).backward()
    assert {i: len(c) for i, c in calls.items()} == dict.fromkeys(range(LAYERS), 1)


def test_checkpointing_is_off_without_grad(no_gc_run: tuple) -> None:
    """Under no_grad (evaluation) there is nothing to recompute; logits are the same."""
    ref, tokens, ref_logits = no_gc_run
    model = clone_model(ref, layers=LAYERS, gc="all", **MODEL_OVERRIDES)
    calls = record_block_calls(model)
    with torch.no_grad():
        assert_close("logits", ref_logits, model(tokens))
    assert {i: len(c) for i, c in calls.items()} == dict.fromkeys(range(LAYERS), 1)


@pytest.mark.parametrize("branch", ["cmp", "sel", "win"])
def test_checkpointing_with_forced_branch(branch: str) -> None:
    """Checkpointing a layer whose other branches are skipped keeps their parameters gradient-free."""
    tokens = random_tokens(BATCH, SEQ_LEN)
    ref = make_model(layers=2, force_branch=branch, **MODEL_OVERRIDES)
    tri = clone_model(ref, layers=2, force_branch=branch, gc="all", **MODEL_OVERRIDES)
    logits_loss(ref(tokens)).backward()
    logits_loss(tri(tokens)).backward()
    assert_grads_close(ref, tri, allow_none=True)
