"""The ``triton`` backends inside `NSAAttention`: the model with them equals the model with the torch ones.

Float32 Triton models against the float64 model with the default backends, logits and every parameter
gradient, for the three branches together (the fused op, and composed), each branch alone
(``force_branch``; ``sel`` ranks its blocks through the select-only entry), and the decode cache
(sequential prefill == batched). The model runs the fused op where it can, and its branch hooks say where.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from nsa_core import TinyLM
from nsa_core.ops.compression import compressed_attention
from nsa_core.ops.selection import selected_attention

from ..utils import MODEL_OVERRIDES, assert_close, logits_loss, random_tokens, tiny_config
from .conftest import SIZES

TRITON = dict(sel_backend="triton", cmp_backend="triton", win_backend="triton")
RATIO = 1e-4  # float32 kernels in a float32 model vs the float64 model
SEQ_LEN = 53  # no multiple of d=4, l=8, l'=8; longer than the window w=32
# sequences in a batch: two on CUDA; one under the interpreter, where a model run costs seconds a sequence
# (the kernels' own tests run batches of two there)
BATCH = 2 if SIZES.real else 1
# the hook tests' length: where each hook fires does not depend on it; still past the window, with more
# selection blocks (5) than slots (4), and the interpreter runs the model about a third faster than at 53
HOOK_LEN = 33


def run(model: TinyLM, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    logits_loss(logits.double().cpu()).backward()
    grads = {n: p.grad.double().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().double().cpu(), grads


def pair(**overrides: object) -> tuple[TinyLM, TinyLM]:
    """The float64 torch model and a float32 Triton model with the same weights."""
    torch.manual_seed(0)
    ref = TinyLM(tiny_config(**MODEL_OVERRIDES, **overrides)).double()
    tri = TinyLM(tiny_config(**MODEL_OVERRIDES, **TRITON, **overrides))
    tri.load_state_dict(ref.state_dict())
    return ref, tri.to(SIZES.device)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"fused": False}, {"force_branch": "cmp"}, {"force_branch": "sel"}, {"force_branch": "win"}],
    ids=["fused", "composed", "branch-cmp", "branch-sel", "branch-win"],
)
def test_model_matches_torch_backends(overrides: dict[str, object]) -> None:
    ref, tri = pair(**overrides)
    tokens = random_tokens(BATCH, SEQ_LEN)
    ref_logits, ref_grads = run(ref, tokens)
    tri_logits, tri_grads = run(tri, tokens.to(SIZES.device))
    assert_close("logits", ref_logits, tri_logits, RATIO)
    assert sorted(tri_grads) == sorted(ref_grads), "a parameter lost or gained a gradient"
    for name, grad in ref_grads.items():
        assert_close(f"{name}.grad", grad, tri_grads[name], RATIO)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
def test_sequential_prefill_matches_batched(fused: bool) -> None:
    """The decode cache: one token at a time (q_offset > 0, Tq = 1) gives the batched logits."""
    _, batched = pair(fused=fused)
    _, sequential = pair(prefill="sequential", fused=fused)
    tokens = random_tokens(1, 41).to(SIZES.device)
    with torch.no_grad():
        assert_close("logits", batched(tokens), sequential(tokens), RATIO)


def test_compressed_attention_points_to_the_kernel() -> None:
    q = torch.zeros(1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match="triton_compressed_attention"):
        compressed_attention(q, q[:, :1, :1], q[:, :1, :1], block_len=8, block_stride=4, backend="triton")


def test_missing_triton_names_the_workaround(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_triton(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", no_triton)
    q = torch.zeros(1, 4, 2, 16)
    block_idx = torch.zeros(1, 4, 1, 2, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="sel_backend='gather'"):
        selected_attention(q, q[:, :, :1], q[:, :, :1], block_idx, sel_block_len=4, backend="triton")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
def test_the_model_runs_the_fused_op_and_says_where_each_branch_starts(fused: bool) -> None:
    """With the three branches on Triton the layer runs `triton_nsa_attention`: its branch hooks see each
    branch start, forward and backward, in the op's order, and the composed path's taps see nothing;
    ``fused=False`` composes the branches, whose taps then see each branch's output."""
    _, model = pair(fused=fused)
    attn = model.blocks[1].attn
    assert attn.runs_fused is fused
    marks: list[tuple[str, str | None]] = []
    taps: list[str] = []
    handle = attn.register_branch_hook(lambda module, phase, branch: marks.append((phase, branch)))
    for name, tap in attn.branch_out.items():
        tap.register_forward_hook(lambda m, args, out, name=name: taps.append(name))
    run(model, random_tokens(1, HOOK_LEN).to(SIZES.device))
    if fused:
        forward = [("forward", b) for b in ("cmp", "sel", "win", None)]
        backward = [("backward", b) for b in ("sel", "win", "cmp", None)]
        assert (marks, taps) == (forward + backward, [])
    else:
        assert (marks, sorted(taps)) == ([], ["cmp", "sel", "win"])
    handle.remove()
    marks.clear()
    # without hooks the layer passes the op no callback, for the forward and the backward it records: a
    # forward says so (the backward would repeat the model's run at the interpreter's cost)
    with torch.no_grad():
        model(random_tokens(1, HOOK_LEN).to(SIZES.device))
    assert marks == []


def test_a_hook_on_a_projection_sees_it() -> None:
    """The fused layer computes its four projections as one GEMM, unless a module hook is on one of them:
    then each is called as itself, so the hook sees (and may change) its output; a detached output leaves
    that weight without a gradient, as `nsa-diag`'s unused-param fault expects."""
    _, model = pair()
    attn = model.blocks[0].attn
    assert attn.runs_fused
    seen: list[tuple[int, ...]] = []

    def detach(module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(out.shape))
        return out.detach()

    handle = attn.kv_win.register_forward_hook(detach)
    _, grads = run(model, random_tokens(1, HOOK_LEN).to(SIZES.device))
    handle.remove()
    assert len(seen) == 1
    assert "blocks.0.attn.kv_win.weight" not in grads
    assert {"blocks.0.attn.q_proj.weight", "blocks.0.attn.kv_sel.weight"} <= set(grads)
    _, grads = run(model, random_tokens(1, HOOK_LEN).to(SIZES.device))
    assert "blocks.0.attn.kv_win.weight" in grads


def test_the_fused_layer_runs_phi_as_kernels_unless_a_hook_is_on_it() -> None:
    """The fused layer runs its block compressors through `triton_block_compress_pair` (no block copy; the
    keys' and values' phi in one launch, the member a program axis); a hook on a compressor or on its MLP's
    layers makes the layer call that module instead, so the hook sees it run, and the other one alone."""
    from nsa_core.ops.triton import compressor

    _, model = pair()
    attn = model.blocks[0].attn
    members: list[int] = []  # per forward launch: how many compressors it ran
    kernel = compressor._compress_fwd_kernel
    original = kernel.launch
    kernel.launch = lambda grid, *args, **kwargs: (members.append(grid[2]), original(grid, *args, **kwargs))
    try:
        with torch.no_grad():
            model(random_tokens(1, HOOK_LEN).to(SIZES.device))
        assert members == [2] * len(model.blocks)  # phi_k and phi_v of every layer, together
        seen: list[tuple[int, ...]] = []
        handle = attn.phi_v.mlp[0].register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
        members.clear()
        with torch.no_grad():
            model(random_tokens(1, HOOK_LEN).to(SIZES.device))
        handle.remove()
    finally:
        kernel.launch = original
    assert len(seen) == 1
    assert members == [1] + [2] * (len(model.blocks) - 1)  # the hooked layer's phi_k alone


@pytest.mark.slow  # Dynamo and the interpreter: ~7-10 s each on the CPU (make test-slow runs it there)
@pytest.mark.parametrize("overrides", [{}, {"fused": False}], ids=["fused", "composed"])
def test_a_compiled_model_runs_its_triton_layers_between_graphs(overrides: dict[str, object]) -> None:
    """torch.compile (inductor on CUDA, aot_eager under the interpreter) of a model on the Triton backends:
    each layer's attention runs as it does eagerly, between graphs (traced, inductor recompiled the kernels
    with fp64 float arguments and refused them: the first GPU run of `run --compile inductor`); the only
    graph breaks are those calls (Dynamo counts a break inside an inlined call at each frame it resumes),
    and the logits and every gradient are the eager model's."""
    from torch._dynamo.utils import counters

    _, model = pair(**overrides)
    tokens = random_tokens(BATCH, SEQ_LEN).to(SIZES.device)
    eager_logits, eager_grads = run(model, tokens)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="inductor" if SIZES.real else "aot_eager")
    model.zero_grad(set_to_none=True)
    logits = compiled(tokens)
    logits_loss(logits.double().cpu()).backward()
    grads = {n: p.grad.double().cpu() for n, p in model.named_parameters() if p.grad is not None}
    breaks = dict(counters["graph_break"])
    assert breaks
    assert all("untraced" in reason for reason in breaks), breaks
    assert_close("logits", eager_logits, logits.detach().double().cpu(), 1e-5)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        assert_close(name, eager_grads[name], grad, 1e-5)
