"""The RoPE kernels against float64 rotations: the layer's split-and-rotate of its one projection
(`qkv_rope`, seven tensors out, the projection's gradient back) and the rotation of one tensor at strided
positions (`rope`, the compressed keys at their blocks' last tokens).

Two references. `apply_rope` in float64 where positions are small (under 1000), where float32 angles hold.
At any position, the float64 rotation by the kernel's own float32 angle ``fl32(p * inv_freq)`` (the angle
torch's float32 table holds too): that angle is off by up to ~p * 2**-24 radians from the true one, so at
4096 tokens any float32 RoPE differs from float64 by ~1e-5, and by ~1e-2 at 250k; what the kernel adds to it
(the reduction to [-pi, pi] and the float32 cosine) must stay at float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from nsa_core.layers.attention import apply_rope
from nsa_core.ops.triton.rope import qkv_rope, rope, rope_frequencies

from ..utils import assert_close
from .conftest import SIZES

THETA = 10000.0
SMALL = 1000  # positions below which float32 angles are compared with float64 ones (RATIO)
RATIO = 1e-5
SAME_ANGLE_RATIO = 2e-6  # against the float64 rotation by the same float32 angle
ROTATED = (0, 3, 5)  # q, k_sel, k_win among q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win


def _rotate64(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """``x`` (float64) rotated at ``positions``: by float64 angles (`apply_rope`) where ``inv_freq`` is None,
    else by the float32 angles ``positions * inv_freq`` (a float32 product), in float64 from there."""
    if inv_freq is None:
        return apply_rope(x, positions, THETA)
    angle = (positions.float()[:, None] * inv_freq.cpu()[None, :]).double()  # [T, D/2]
    cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _split_reference(
    y: torch.Tensor, heads: int, kv_heads: int, pos0: int, inv_freq: torch.Tensor | None = None
) -> list[torch.Tensor]:
    # q and six key/value tensors as views of y, then q, k_sel and k_win rotated
    B, T, _ = y.shape
    D = y.shape[-1] // (heads + 6 * kv_heads)
    positions = torch.arange(pos0, pos0 + T)
    parts = [y[..., : heads * D].view(B, T, heads, D)]
    parts += list(y[..., heads * D :].view(B, T, 6, kv_heads, D).unbind(2))
    return [_rotate64(p, positions, inv_freq) if i in ROTATED else p for i, p in enumerate(parts)]


@pytest.mark.parametrize("D", [*SIZES.head_dims, 24])  # and a half head dim no power of 2
@pytest.mark.parametrize("T", SIZES.seq_lens)
@pytest.mark.parametrize(("heads", "kv_heads", "pos0"), [(4, 2, 0), (6, 1, 77)])
def test_qkv_rope_matches_float64(device: str, D: int, T: int, heads: int, kv_heads: int, pos0: int) -> None:
    gen = torch.Generator().manual_seed(T + D + heads + pos0)
    y = torch.randn(2, T, (heads + 6 * kv_heads) * D, generator=gen, dtype=torch.float64)
    grads = [torch.randn(2, T, h, D, generator=gen, dtype=torch.float64) for h in [heads] + [kv_heads] * 6]
    tri_y = y.to(device=device, dtype=torch.float32).requires_grad_(True)
    inv_freq = rope_frequencies(D, THETA, tri_y.device)
    outs = qkv_rope(tri_y, inv_freq, heads=heads, kv_heads=kv_heads, pos_start=pos0)
    torch.autograd.backward(outs, [g.to(device=device, dtype=torch.float32) for g in grads])
    assert all(out.is_contiguous() for out in outs)
    references = [(inv_freq, SAME_ANGLE_RATIO)] + ([(None, RATIO)] if pos0 + T <= SMALL else [])
    for freq, ratio in references:
        ref_y = y.clone().requires_grad_(True)
        refs = _split_reference(ref_y, heads, kv_heads, pos0, freq)
        torch.autograd.backward(refs, grads)
        label = "float64" if freq is None else "same angle"
        for i, (ref, out) in enumerate(zip(refs, outs, strict=True)):
            assert_close(f"{label} part {i}", ref.detach(), out.detach().double().cpu(), ratio, atol=1e-6)
        assert_close(f"{label} dy", ref_y.grad, tri_y.grad.double().cpu(), ratio, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qkv_rope_low_precision_rounds_once(device: str, dtype: torch.dtype) -> None:
    """In half precision the rotation is float32 arithmetic rounded once: within one unit of the dtype of
    the float64 result (torch's bfloat16 `apply_rope` rounds each product)."""
    heads, kv_heads, D, T = 4, 2, 32, 64
    y = torch.randn(1, T, (heads + 6 * kv_heads) * D, generator=torch.Generator().manual_seed(1))
    y = y.to(dtype).double()
    refs = _split_reference(y, heads, kv_heads, 5)
    inv_freq = rope_frequencies(D, THETA, torch.device(device))
    outs = qkv_rope(y.to(device=device, dtype=dtype), inv_freq, heads=heads, kv_heads=kv_heads, pos_start=5)
    eps = torch.finfo(dtype).eps
    for ref, out in zip(refs, outs, strict=True):
        assert out.dtype == dtype
        err = (out.double().cpu() - ref).abs()
        assert (err <= eps * ref.abs().clamp_min(1e-3) + 1e-6).all(), float(err.max())


@pytest.mark.parametrize("D", [SIZES.head_dims[-1], 24])
@pytest.mark.parametrize(("start", "step"), [(31, 16), (250_000, 1)])
def test_rope_at_strided_positions(device: str, D: int, start: int, step: int) -> None:
    gen = torch.Generator().manual_seed(D + start)
    x = torch.randn(2, 9, 3, D, generator=gen, dtype=torch.float64)
    dout = torch.randn(2, 9, 3, D, generator=gen, dtype=torch.float64)
    positions = start + torch.arange(9) * step
    tri_x = x.to(device=device, dtype=torch.float32).requires_grad_(True)
    inv_freq = rope_frequencies(D, THETA, tri_x.device)
    out = rope(tri_x, inv_freq, pos_start=start, pos_step=step)
    out.backward(dout.to(device=device, dtype=torch.float32))
    references = [(inv_freq, SAME_ANGLE_RATIO)] + ([(None, RATIO)] if positions.max() < SMALL else [])
    for freq, ratio in references:
        ref_x = x.clone().requires_grad_(True)
        ref = _rotate64(ref_x, positions, freq)
        ref.backward(dout)
        label = "float64" if freq is None else "same angle"
        assert_close(f"{label} out", ref.detach(), out.detach().double().cpu(), ratio, atol=1e-6)
        assert_close(f"{label} dx", ref_x.grad, tri_x.grad.double().cpu(), ratio, atol=1e-6)


def test_rope_rejects_bad_arguments(device: str) -> None:
    freq = rope_frequencies(16, THETA, torch.device(device))
    with pytest.raises(ValueError, match="y must be"):
        qkv_rope(torch.zeros(1, 4, 100, device=device), freq, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="inv_freq must be"):
        rope(torch.zeros(1, 4, 2, 32, device=device), freq)
    with pytest.raises(ValueError, match="x must be"):
        rope(torch.zeros(4, 2, 16, device=device), freq)
