"""Sliding-window attention in Triton: the query at ``t`` reads keys ``t - w + 1 .. t``, O(T * w) both ways.

The banded kernels of `nsa_core.ops.triton.flash` with ``key_stride = 1, key_offset = 0`` and a window:
each query tile loops over the ``w + BLOCK_M`` keys its rows can read; the backward's key tiles loop over
the ``w + BLOCK_N`` queries that read them, for each query head of their KV group.
"""

from __future__ import annotations

import torch

from nsa_core.ops.common import check_qkv, eager_under_compile
from nsa_core.ops.triton.flash import banded_backward, banded_forward


class SlidingWindowAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window, q_offset, scale):  # type: ignore[override]
        o, lse = banded_forward(
            q, k, v, key_stride=1, key_offset=0, window=window, q_offset=q_offset, scale=scale
        )
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.window, ctx.q_offset, ctx.scale = window, q_offset, scale
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = banded_backward(
            do, q, k, v, o, lse,
            key_stride=1, key_offset=0, window=ctx.window, q_offset=ctx.q_offset, scale=ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None


@eager_under_compile
def triton_sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Tq, HQ, D]`` over keys ``max(0, t - w + 1) .. t`` of ``k/v [B, Tk, HKV, D]``.

    Same contract as `nsa_core.ops.window.sliding_window_attention`: ``Tk = q_offset + Tq``, the query in
    row ``i`` sits at ``t = q_offset + i``; differentiable in ``q``, ``k`` and ``v``. Returns
    ``[B, Tq, HQ, D]`` in ``q``'s dtype (float32 accumulation for bf16/fp16).
    """
    check_qkv(q, k, v, q_offset)
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.numel() == 0:
        return torch.zeros_like(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return SlidingWindowAttentionFunction.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), window, q_offset, scale
    )
