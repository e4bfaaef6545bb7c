"""RoPE: per head, rotate-half, dot products depend only on the position difference, norms preserved."""

from __future__ import annotations

import math

import pytest
import torch

from nsa_core import apply_rope

from .utils import DTYPE, assert_close

B, T, H, D = 2, 9, 3, 16


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DTYPE)


def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # per-head dot products of every query with every key: [B, H, Tq, Tk]
    return torch.einsum("bthd,bshd->bhts", q, k)


@pytest.mark.parametrize("theta", [10000.0, 500.0], ids=["theta1e4", "theta500"])
@pytest.mark.parametrize("shift", [1, 37, 1000], ids=lambda s: f"shift{s}")
def test_dot_products_depend_on_position_difference_only(shift: int, theta: float) -> None:
    q, k = rand(B, T, H, D), rand(B, T, H, D)
    q_pos = torch.arange(T) * 3 + 5  # queries and keys at different, unordered positions
    k_pos = torch.randperm(T) * 2
    ref = scores(apply_rope(q, q_pos, theta), apply_rope(k, k_pos, theta))
    tri = scores(apply_rope(q, q_pos + shift, theta), apply_rope(k, k_pos + shift, theta))
    assert_close("shifted scores", ref, tri, ratio=1e-11)
    # and the rotation is not trivial: other differences give other scores
    moved = scores(apply_rope(q, q_pos + shift, theta), apply_rope(k, k_pos, theta))
    assert (moved - ref).abs().max() > 1e-3


def test_position_zero_is_identity() -> None:
    x = rand(B, T, H, D)
    assert_close("rope(x, 0)", x, apply_rope(x, torch.zeros(T, dtype=torch.long)))


def test_norm_preserved() -> None:
    x = rand(B, T, H, D)
    y = apply_rope(x, torch.arange(T) * 11)
    assert_close("norms", x.norm(dim=-1), y.norm(dim=-1))


def test_heads_are_independent() -> None:
    """Head h's output depends on head h's input only, and every head gets the same rotation."""
    x, pos = rand(B, T, H, D), torch.arange(T) + 3
    y = apply_rope(x, pos)
    x2 = x.clone()
    x2[:, :, 1] = rand(B, T, D)
    y2 = apply_rope(x2, pos)
    assert torch.equal(y[:, :, 0], y2[:, :, 0])
    assert torch.equal(y[:, :, 2], y2[:, :, 2])
    for h in range(H):
        assert_close(f"head {h} alone", y[:, :, h], apply_rope(x[:, :, h : h + 1], pos)[:, :, 0])
    same = x[:, :, :1].expand(B, T, H, D)
    y_same = apply_rope(same, pos)
    for h in range(1, H):
        assert_close(f"head {h} rotation", y_same[:, :, 0], y_same[:, :, h])


def test_rotate_half_convention() -> None:
    """Pairs (i, i + D/2) rotate by pos * theta^(-2i/D): the rotate-half (GPT-NeoX / LLaMA) layout."""
    d, theta, pos = 4, 100.0, 3
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=DTYPE).view(1, 1, 1, d)
    y = apply_rope(x, torch.tensor([pos]), theta).view(d)
    expected = []
    for i, (a, b) in enumerate([(1.0, 3.0), (2.0, 4.0)]):
        angle = pos * theta ** (-2 * i / d)
        expected.append(
            (a * math.cos(angle) - b * math.sin(angle), a * math.sin(angle) + b * math.cos(angle))
        )
    ref = torch.tensor([expected[0][0], expected[1][0], expected[0][1], expected[1][1]], dtype=DTYPE)
    assert_close("rope", ref, y)


def test_rope_gradient_is_the_inverse_rotation() -> None:
    """RoPE is a rotation R: the gradient of <R x, g> is R^T g, which R maps back onto g."""
    x = rand(B, T, H, D).requires_grad_()
    g, pos = rand(B, T, H, D), torch.arange(T) * 7
    (apply_rope(x, pos) * g).sum().backward()
    assert_close("R dx", g, apply_rope(x.grad, pos))
