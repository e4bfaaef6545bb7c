"""On a CUDA device: every backend in bf16 and fp32 against the float64 reference, outputs and gradients.

The bound is relative to a same-dtype torch run (the masked backends), as in flash-attention's tests: a
backend may be at most twice as far from the float64 reference as that run, plus a small floor. All
low-precision runs share the compression path, so they rank the same selection blocks.
Skipped where no CUDA device is present (CI); run on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from nsa_core import TinyLM, preset

from .utils import get_err_ratio

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GEOMETRY = dict(sel_block_len=8, layers=2)  # S=101 gives 13 selection blocks: the ranking matters
BASELINE = dict(sel_backend="masked", cmp_backend="masked", win_backend="masked")
COMBOS = [
    dict(sel_backend="gather"),
    dict(sel_backend="packed"),
    dict(win_backend="chunked"),
    dict(sel_backend="gather", win_backend="chunked"),
]


def _run(model: TinyLM, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    logits.float().square().mean().backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().double().cpu(), grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(f"{k[:3]}={v}" for k, v in c.items()))
def test_backend_matches_reference_on_cuda(combo: dict[str, str], dtype: torch.dtype) -> None:
    tokens = torch.randint(0, 256, (2, 101))
    ref_model = TinyLM(preset("tiny", **GEOMETRY)).double()
    ref_logits, ref_grads = _run(ref_model, tokens)
    state = ref_model.state_dict()

    def low_precision(overrides: dict[str, str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = TinyLM(preset("tiny", **GEOMETRY, **{**BASELINE, **overrides}))
        model.load_state_dict(state)
        return _run(model.to(device="cuda", dtype=dtype), tokens.cuda())

    base_logits, base_grads = low_precision({})
    tri_logits, tri_grads = low_precision(combo)
    assert torch.isfinite(tri_logits).all(), "non-finite logits"
    floor = 1e-2 if dtype == torch.bfloat16 else 1e-5
    base_err, tri_err = get_err_ratio(ref_logits, base_logits), get_err_ratio(ref_logits, tri_logits)
    assert tri_err <= 2 * base_err + floor, f"logits: {tri_err:.3e} vs same-dtype torch {base_err:.3e}"
    assert sorted(tri_grads) == sorted(ref_grads), "a parameter lost its gradient"
    for name, ref in ref_grads.items():
        assert torch.isfinite(tri_grads[name]).all(), f"{name}.grad is not finite"
        base_err, tri_err = get_err_ratio(ref, base_grads[name]), get_err_ratio(ref, tri_grads[name])
        assert tri_err <= 2 * base_err + floor, (
            f"{name}.grad: {tri_err:.3e} vs same-dtype torch {base_err:.3e}"
        )
