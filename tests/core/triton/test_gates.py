"""The fused gated sum against torch's sigmoid-multiply-add: output and the gradients of all four inputs."""

from __future__ import annotations

import pytest
import torch

from nsa_core.ops.triton.gates import triton_gated_sum

from ..utils import assert_close
from .conftest import SIZES


def _torch_gated_sum(g: torch.Tensor, *outputs: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(g)[..., None]
    return sum(s[..., b, :] * o for b, o in enumerate(outputs))


@pytest.mark.parametrize("D", [*SIZES.head_dims, 24])  # and a head dim no power of 2
@pytest.mark.parametrize("T", SIZES.seq_lens)
def test_gated_sum_matches_torch(device: str, T: int, D: int) -> None:
    gen = torch.Generator().manual_seed(T + D)
    shape = (2, T, 3, D)
    xs = [torch.randn(2, T, 3, 3, generator=gen, dtype=torch.float64)]
    xs += [torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    do = torch.randn(*shape, generator=gen, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_(True) for x in xs]
    ref = _torch_gated_sum(*ref_in)
    ref.backward(do)
    tri_in = [x.to(device=device, dtype=torch.float32).requires_grad_(True) for x in xs]
    tri = triton_gated_sum(*tri_in)
    tri.backward(do.to(device=device, dtype=torch.float32))
    assert_close("out", ref.detach(), tri.detach().double().cpu(), 1e-6, atol=1e-6)
    for name, r, t in zip(("d_gate", "d_cmp", "d_sel", "d_win"), ref_in, tri_in, strict=True):
        assert_close(name, r.grad, t.grad.double().cpu(), 1e-6, atol=1e-6)


def test_gated_sum_rejects_mismatched_shapes(device: str) -> None:
    o = torch.zeros(1, 4, 2, 16, device=device)
    with pytest.raises(ValueError, match="gate_logits"):
        triton_gated_sum(torch.zeros(1, 4, 2, 2, device=device), o, o, o)
    with pytest.raises(ValueError, match="share one shape"):
        triton_gated_sum(torch.zeros(1, 4, 2, 3, device=device), o, o, o[..., :8])
