"""The comparison helpers themselves: a NaN, an Inf, a missing gradient or a wrong shape always fails."""

from __future__ import annotations

import pytest
import torch

from .utils import DTYPE, assert_close, assert_grads_close


def test_close_tensors_pass() -> None:
    x = torch.randn(4, 5, dtype=DTYPE)
    assert_close("same", x, x.clone())
    assert_close("rounding", x, x * (1 + 1e-13))
    assert_close("zeros", torch.zeros(3), torch.zeros(3))
    assert_close("empty", torch.zeros(0, 3), torch.zeros(0, 3))


def test_different_tensors_fail() -> None:
    x = torch.randn(4, 5, dtype=DTYPE)
    with pytest.raises(AssertionError, match="rel RMS err"):
        assert_close("off", x, x * 1.001)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("side", ["ref", "tri", "both"])
def test_non_finite_fails(bad: float, side: str) -> None:
    x = torch.randn(4, 5, dtype=DTYPE)
    poisoned = x.clone()
    poisoned[2, 3] = bad
    ref = poisoned if side in ("ref", "both") else x
    tri = poisoned if side in ("tri", "both") else x
    with pytest.raises(AssertionError, match="NaN/Inf"):
        assert_close("poisoned", ref, tri)


def test_shape_and_none_fail() -> None:
    x = torch.randn(4, 5, dtype=DTYPE)
    with pytest.raises(AssertionError, match="shape"):
        assert_close("shape", x, x[:, :4])
    with pytest.raises(AssertionError, match="None"):
        assert_close("none", x, None)


def test_grads_helper_fails_on_nan_or_missing_gradient() -> None:
    ref, tri = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()
    tri.load_state_dict(ref.state_dict())
    x = torch.randn(5, 3, dtype=DTYPE)
    ref(x).sum().backward()
    tri(x).sum().backward()
    assert_grads_close(ref, tri)
    tri.bias.grad[0] = float("nan")
    with pytest.raises(AssertionError, match="NaN/Inf"):
        assert_grads_close(ref, tri)
    tri.bias.grad = None
    with pytest.raises(AssertionError, match="None"):
        assert_grads_close(ref, tri)
    with pytest.raises(AssertionError, match="nonzero"):  # None on one side is fine only against zeros
        assert_grads_close(ref, tri, allow_none=True)
