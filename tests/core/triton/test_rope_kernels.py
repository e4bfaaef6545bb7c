"""The RoPE kernels against `apply_rope` in float64: the layer's split-and-rotate of its one projection
(`qkv_rope`, seven tensors out, the projection's gradient back) and the rotation of one tensor at strided
positions (`rope`, the compressed keys at their blocks' last tokens)."""

from __future__ import annotations

import pytest
import torch

from nsa_core.layers.attention import apply_rope
from nsa_core.ops.triton.rope import qkv_rope, rope, rope_frequencies

from ..utils import assert_close
from .conftest import SIZES

THETA = 10000.0
# float32 rotation against float64: the float32 angle p * inv_freq is off by up to ~p * 2**-24 radians
RATIO = 1e-5
ROTATED = (0, 3, 5)  # q, k_sel, k_win among q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win


def _split_reference(y: torch.Tensor, heads: int, kv_heads: int, pos0: int) -> list[torch.Tensor]:
    # torch: q and six key/value tensors as views of y, then apply_rope on q, k_sel and k_win
    B, T, _ = y.shape
    D = y.shape[-1] // (heads + 6 * kv_heads)
    positions = torch.arange(pos0, pos0 + T)
    parts = [y[..., : heads * D].view(B, T, heads, D)]
    parts += list(y[..., heads * D :].view(B, T, 6, kv_heads, D).unbind(2))
    return [apply_rope(p, positions, THETA) if i in ROTATED else p for i, p in enumerate(parts)]


@pytest.mark.parametrize("D", [*SIZES.head_dims, 24])  # and a half head dim no power of 2
@pytest.mark.parametrize("T", SIZES.seq_lens)
@pytest.mark.parametrize(("heads", "kv_heads", "pos0"), [(4, 2, 0), (6, 1, 77)])
def test_qkv_rope_matches_apply_rope(
    device: str, D: int, T: int, heads: int, kv_heads: int, pos0: int
) -> None:
    """Against torch's float32 RoPE (the same float32 angles), forward and backward; against float64 where
    the positions are small enough for float32 angles to hold (below ~1000)."""
    gen = torch.Generator().manual_seed(T + D + heads + pos0)
    y = torch.randn(2, T, (heads + 6 * kv_heads) * D, generator=gen, dtype=torch.float64)
    grads = [torch.randn(2, T, h, D, generator=gen, dtype=torch.float64) for h in [heads] + [kv_heads] * 6]
    references = []
    for dtype in (torch.float64, torch.float32):
        ref_y = y.to(dtype).clone().requires_grad_(True)
        refs = _split_reference(ref_y, heads, kv_heads, pos0)
        torch.autograd.backward(refs, [g.to(dtype) for g in grads])
        references.append((dtype, [r.detach().double() for r in refs], ref_y.grad.double()))
    tri_y = y.to(device=device, dtype=torch.float32).requires_grad_(True)
    inv_freq = rope_frequencies(D, THETA, tri_y.device)
    outs = qkv_rope(tri_y, inv_freq, heads=heads, kv_heads=kv_heads, pos_start=pos0)
    torch.autograd.backward(outs, [g.to(device=device, dtype=torch.float32) for g in grads])
    assert all(out.is_contiguous() for out in outs)
    for dtype, refs, ref_grad in references:
        if dtype == torch.float64 and pos0 + T > 1000:
            continue
        ratio = RATIO if dtype == torch.float64 else 1e-6
        for i, (ref, out) in enumerate(zip(refs, outs, strict=True)):
            assert_close(f"{dtype} part {i}", ref, out.detach().double().cpu(), ratio, atol=1e-6)
        assert_close(f"{dtype} dy", ref_grad, tri_y.grad.double().cpu(), ratio, atol=1e-6)


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
    ref_x = x.clone().requires_grad_(True)
    ref = apply_rope(ref_x, positions, THETA)
    ref.backward(dout)
    tri_x = x.to(device=device, dtype=torch.float32).requires_grad_(True)
    out = rope(tri_x, rope_frequencies(D, THETA, tri_x.device), pos_start=start, pos_step=step)
    out.backward(dout.to(device=device, dtype=torch.float32))
    # float32 angles p * inv_freq lose ~p * 2**-24 radians: compare with torch's own float32 rotation there
    torch32 = apply_rope(x.float(), positions, THETA).double()
    assert_close("out", torch32, out.detach().double().cpu(), 1e-6, atol=1e-6)
    if start + 9 * step < 1000:
        assert_close("out vs float64", ref.detach(), out.detach().double().cpu(), RATIO)
        assert_close("dx", ref_x.grad, tri_x.grad.double().cpu(), RATIO)


def test_rope_rejects_bad_arguments(device: str) -> None:
    freq = rope_frequencies(16, THETA, torch.device(device))
    with pytest.raises(ValueError, match="y must be"):
        qkv_rope(torch.zeros(1, 4, 100, device=device), freq, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="inv_freq must be"):
        rope(torch.zeros(1, 4, 2, 32, device=device), freq)
    with pytest.raises(ValueError, match="x must be"):
        rope(torch.zeros(4, 2, 16, device=device), freq)
