"""Forced branches compute only their branch: what they read, which modules run, which parameters learn.

The seeds' "branch isolation" still ran every branch. Here a forced branch must not call the other
branches' modules, and their parameters must end backward with ``grad is None``.
"""

from __future__ import annotations

import re

import pytest
import torch

from nsa_core import SEL_BACKENDS, WIN_BACKENDS, TinyLM

from .utils import (
    BATCH,
    MODEL_OVERRIDES,
    REFERENCE_BACKENDS,
    SEQ_LEN,
    assert_close,
    assert_grads_close,
    clone_model,
    logits_loss,
    make_model,
    random_tokens,
)

# the attention parameters of each branch (names per the spec); everything else is shared by all branches
BRANCH_MODULES = {"cmp": ("kv_cmp", "phi_k", "phi_v"), "sel": ("kv_sel",), "win": ("kv_win",)}
SHARED_MODULES = ("q_proj", "gate", "o_proj")
# modules a forced branch runs: sel ranks its blocks with the compressed keys (kv_cmp, phi_k) under no_grad
RUNS = {"cmp": {"kv_cmp", "phi_k", "phi_v"}, "sel": {"kv_sel", "kv_cmp", "phi_k"}, "win": {"kv_win"}}
ATTN_PARAM = re.compile(r"^blocks\.\d+\.attn\.(\w+)\.")


def branch_of(name: str) -> str | None:
    """The branch an attention parameter belongs to, None for a shared one (also outside attention)."""
    match = ATTN_PARAM.match(name)
    if match is None:
        return None
    module = match.group(1)
    for branch, modules in BRANCH_MODULES.items():
        if module in modules:
            return branch
    assert module in SHARED_MODULES, f"unknown attention parameter {name}: assign it to a branch in this test"
    return None


def test_every_attention_parameter_is_classified() -> None:
    model = make_model(**MODEL_OVERRIDES)
    names = [name for name, _ in model.named_parameters()]
    branches = {branch_of(name) for name in names}  # fails on an attention parameter of no known module
    assert branches == {None, "cmp", "sel", "win"}


@pytest.mark.parametrize("branch", ["cmp", "sel", "win"])
def test_forced_branch_gradients(branch: str) -> None:
    model = make_model(force_branch=branch, **MODEL_OVERRIDES)
    logits = model(random_tokens(BATCH, SEQ_LEN))
    assert torch.isfinite(logits).all()
    logits_loss(logits).backward()
    for name, param in model.named_parameters():
        owner = branch_of(name)
        if owner is None or owner == branch:
            assert param.grad is not None, f"{name} of the computed graph got no gradient"
            assert torch.isfinite(param.grad).all(), f"{name}.grad is not finite"
            assert param.grad.abs().max() > 0, f"{name}.grad is all zeros"
        else:
            assert param.grad is None, (
                f"{name} belongs to {owner}, yet force_branch={branch} gave it a gradient"
            )


@pytest.mark.parametrize("branch", ["cmp", "sel", "win"])
def test_forced_branch_runs_only_its_modules(branch: str) -> None:
    model = make_model(force_branch=branch, **MODEL_OVERRIDES)
    ran: set[str] = set()
    for name, module in model.blocks[0].attn.named_children():
        if any(name in modules for modules in BRANCH_MODULES.values()):
            module.register_forward_pre_hook(lambda *_, name=name: ran.add(name))
    logits_loss(model(random_tokens(BATCH, SEQ_LEN))).backward()
    assert ran == RUNS[branch]


def test_unforced_model_trains_every_parameter() -> None:
    model = make_model(**MODEL_OVERRIDES)
    logits_loss(model(random_tokens(BATCH, SEQ_LEN))).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().max() > 0]
    assert not missing, f"parameters without gradient: {missing}"


def test_forced_sel_ranks_with_compressed_keys() -> None:
    """force_branch="sel" still selects by compressed scores: the sel backends agree with the reference."""
    tokens = random_tokens(BATCH, SEQ_LEN)
    ref = make_model(force_branch="sel", **MODEL_OVERRIDES, **REFERENCE_BACKENDS)
    ref_logits = ref(tokens)
    logits_loss(ref_logits).backward()
    for backend in (b for b in SEL_BACKENDS if b != "reference"):
        tri = clone_model(ref, force_branch="sel", sel_backend=backend, **MODEL_OVERRIDES)
        tri_logits = tri(tokens)
        logits_loss(tri_logits).backward()
        assert_close(f"{backend} logits", ref_logits, tri_logits)
        assert_grads_close(ref, tri, allow_none=True)


@pytest.mark.parametrize("chunk_elements", [1, 64, 1000], ids=lambda n: f"chunk{n}")
def test_forced_sel_scoring_in_query_chunks(monkeypatch: pytest.MonkeyPatch, chunk_elements: int) -> None:
    """Scoring alone runs in query chunks to stay linear in memory; any chunking selects the same blocks."""
    import nsa_core.layers.attention as attention

    tokens = random_tokens(BATCH, SEQ_LEN)
    for backend in ("reference", "gather"):
        ref = make_model(force_branch="sel", sel_backend=backend, **MODEL_OVERRIDES)
        ref_logits = ref(tokens)
        logits_loss(ref_logits).backward()
        tri = clone_model(ref, force_branch="sel", sel_backend=backend, **MODEL_OVERRIDES)
        with monkeypatch.context() as patch:
            patch.setattr(attention, "SCORE_CHUNK_ELEMENTS", chunk_elements)
            tri_logits = tri(tokens)
        logits_loss(tri_logits).backward()
        assert_close(f"{backend} chunked-scoring logits", ref_logits, tri_logits)
        assert_grads_close(ref, tri, allow_none=True)


def test_forced_sel_selection_depends_on_compressed_weights() -> None:
    """The compressed keys decide which blocks the sel branch reads: other kv_cmp weights, other logits."""
    tokens = random_tokens(BATCH, SEQ_LEN)
    model = make_model(force_branch="sel", **MODEL_OVERRIDES)
    with torch.no_grad():
        base = model(tokens)
        for block in model.blocks:
            block.attn.kv_cmp.weight.mul_(-3.0)
        assert (model(tokens) - base).abs().max() > 1e-6


def changed_before(tokens: torch.Tensor, stop: int, vocab: int) -> torch.Tensor:
    changed = tokens.clone()
    changed[:, :stop] = (changed[:, :stop] + torch.randint(1, vocab, changed[:, :stop].shape)) % vocab
    return changed


@pytest.mark.parametrize("backend", WIN_BACKENDS)
def test_forced_window_reads_only_the_window(backend: str) -> None:
    """One layer with force_branch="win": the logit at t reads tokens t-w+1 .. t only."""
    seq_len, stop = 60, 10  # change tokens 0..9: queries t >= 9 + w no longer see any of them
    model = make_model(layers=1, force_branch="win", win_backend=backend, **MODEL_OVERRIDES)
    window = model.cfg.nsa.window
    tokens = random_tokens(BATCH, seq_len)
    with torch.no_grad():
        base = model(tokens)
        out = model(changed_before(tokens, stop, model.cfg.vocab))
    first_blind = stop - 1 + window
    assert_close(
        "logits beyond the window", base[:, first_blind:], out[:, first_blind:], ratio=1e-13, atol=1e-14
    )
    assert (out[:, first_blind - 1] - base[:, first_blind - 1]).abs().max() > 1e-6, (
        "the window's first token counts"
    )


def test_unforced_model_reads_beyond_the_window() -> None:
    """The contrast: with every branch on, compression and selection carry tokens from beyond the window."""
    seq_len, stop = 60, 10
    model: TinyLM = make_model(layers=1, **MODEL_OVERRIDES)
    tokens = random_tokens(BATCH, seq_len)
    with torch.no_grad():
        base = model(tokens)
        out = model(changed_before(tokens, stop, model.cfg.vocab))
    assert (out[:, -1] - base[:, -1]).abs().max() > 1e-6


@pytest.mark.parametrize("branch", [None, "cmp", "sel", "win"], ids=lambda b: f"force-{b}")
def test_idle_parameter_names_are_exactly_the_ungraded(branch: str | None) -> None:
    """`idle_parameter_names` lists what a forced branch leaves without gradient: tools tell it from a bug."""
    model = make_model(force_branch=branch, **MODEL_OVERRIDES)
    logits_loss(model(random_tokens(BATCH, SEQ_LEN))).backward()
    ungraded = sorted(name for name, p in model.named_parameters() if p.grad is None)
    assert ungraded == sorted(model.idle_parameter_names())
