"""Rotary embedding in Triton: the layer's projections split into heads and rotated in one pass each way.

`NSAAttention` projects ``x`` once into ``[q | k_cmp v_cmp | k_sel v_sel | k_win v_win]`` (one GEMM over
the four weights side by side). In torch, splitting that row into seven ``[B, T, H, D]`` tensors costs a
``.contiguous()`` copy each, and rotating ``q``, ``k_sel`` and ``k_win`` costs about seven kernels each way
per tensor, plus the table of angles: some seventy launches a layer and step. `qkv_rope` writes the seven
tensors, contiguous and rotated where they are, in one kernel, and its backward writes the projection's
gradient in one more; `rope` rotates one tensor (the compressed keys, at their blocks' last positions).

Rotation as `nsa_core.layers.attention.apply_rope`: the two halves of each head, ``x1 cos - x2 sin`` and
``x1 sin + x2 cos``, at angle ``p * inv_freq[j]``. The angle is the float32 product that torch's table
holds, reduced to ``[-pi, pi]`` in float64 before its cosine and sine (float32 ``p * inv_freq`` reaches
~2e5 radians at 256k tokens); the rotation is float32 arithmetic with one rounding to the output dtype
(torch's ``apply_rope`` on bfloat16 rounds its products in bfloat16). The backward rotates by ``-angle``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nsa_core.ops.triton.flash import cdiv, next_power_of_2
from nsa_core.ops.triton.launch import Launcher

TWO_PI = tl.constexpr(2.0 * math.pi)  # a constexpr: kernels read no other globals


@triton.jit
def _move(
    src,
    src_row,
    src_col,
    dst,
    dst_row,
    dst_col,
    inv_freq,
    offs_r,
    mask_r,
    pos,
    HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROTATE: tl.constexpr,
    SIGN: tl.constexpr,
):
    # rows offs_r [BR]: HEADS heads of 2*HALF values at src + r*src_row + src_col to dst + r*dst_row +
    # dst_col, rotated by SIGN * pos[r] * inv_freq where ROTATE
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_HALF)
    mask = mask_r[:, None, None] & (offs_h < HEADS)[None, :, None] & (offs_j < HALF)[None, None, :]
    col = offs_h[None, :, None] * (2 * HALF) + offs_j[None, None, :]  # [1, BH, BJ]
    src_ptr = src + offs_r[:, None, None] * src_row + src_col + col
    dst_ptr = dst + offs_r[:, None, None] * dst_row + dst_col + col
    x1 = tl.load(src_ptr, mask=mask, other=0.0)
    x2 = tl.load(src_ptr + HALF, mask=mask, other=0.0)
    if ROTATE:
        freq = tl.load(inv_freq + offs_j, mask=offs_j < HALF, other=0.0)
        angle = (pos[:, None] * freq[None, :]).to(tl.float64)  # the float32 product, as torch's table
        angle = (angle - TWO_PI * tl.floor(angle / TWO_PI + 0.5)).to(tl.float32)
        cos = tl.cos(angle)[:, None, :]
        sin = tl.sin(angle)[:, None, :] * SIGN
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(dst_ptr, (a * cos - b * sin).to(dst.dtype.element_ty), mask=mask)
        tl.store(dst_ptr + HALF, (a * sin + b * cos).to(dst.dtype.element_ty), mask=mask)
    else:
        tl.store(dst_ptr, x1.to(dst.dtype.element_ty), mask=mask)
        tl.store(dst_ptr + HALF, x2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _section(
    y,
    y_row,
    y_col,
    packed,
    packed_row,
    inv_freq,
    offs_r,
    mask_r,
    pos,
    HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROTATE: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    # one of the seven tensors: y's columns y_col.. -> packed (forward), or back rotated by -angle
    if BACKWARD:
        _move(packed, packed_row, 0, y, y_row, y_col, inv_freq, offs_r, mask_r, pos,
              HEADS, BLOCK_H, HALF, BLOCK_HALF, ROTATE, -1.0)  # fmt: skip
    else:
        _move(y, y_row, y_col, packed, packed_row, 0, inv_freq, offs_r, mask_r, pos,
              HEADS, BLOCK_H, HALF, BLOCK_HALF, ROTATE, 1.0)  # fmt: skip


@triton.jit
def _rows(rows, T, pos_start, pos_step, BLOCK_R: tl.constexpr):
    # this program's rows (b, t) of a [B*T, ...] tensor, and their positions pos_start + t * pos_step
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    pos = (pos_start + (offs_r % T) * pos_step).to(tl.float32)
    return offs_r, offs_r < rows, pos


@Launcher
@triton.jit(do_not_specialize=["rows", "T", "pos_start"])
def _qkv_rope_kernel(
    y,
    q,
    k_cmp,
    v_cmp,
    k_sel,
    v_sel,
    k_win,
    v_win,
    inv_freq,
    rows,
    T,
    pos_start,
    y_row,
    H: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    # forward: y [rows, y_row] -> seven packed tensors; backward: their gradients -> y (rotated back)
    offs_r, mask_r, pos = _rows(rows, T, pos_start, 1, BLOCK_R)
    QD = H * 2 * HALF
    KV = HKV * 2 * HALF
    # (column in y, packed tensor, its row length, heads, rotated)
    _section(y, y_row, 0, q, QD, inv_freq, offs_r, mask_r, pos, H, BLOCK_H, HALF, BLOCK_HALF, True, BACKWARD)
    _section(y, y_row, QD, k_cmp, KV, inv_freq, offs_r, mask_r, pos, HKV, BLOCK_HKV, HALF, BLOCK_HALF,
             False, BACKWARD)  # fmt: skip
    _section(y, y_row, QD + KV, v_cmp, KV, inv_freq, offs_r, mask_r, pos, HKV, BLOCK_HKV, HALF, BLOCK_HALF,
             False, BACKWARD)  # fmt: skip
    _section(y, y_row, QD + 2 * KV, k_sel, KV, inv_freq, offs_r, mask_r, pos, HKV, BLOCK_HKV, HALF,
             BLOCK_HALF, True, BACKWARD)  # fmt: skip
    _section(y, y_row, QD + 3 * KV, v_sel, KV, inv_freq, offs_r, mask_r, pos, HKV, BLOCK_HKV, HALF,
             BLOCK_HALF, False, BACKWARD)  # fmt: skip
    _section(y, y_row, QD + 4 * KV, k_win, KV, inv_freq, offs_r, mask_r, pos, HKV, BLOCK_HKV, HALF,
             BLOCK_HALF, True, BACKWARD)  # fmt: skip
    _section(y, y_row, QD + 5 * KV, v_win, KV, inv_freq, offs_r, mask_r, pos, HKV, BLOCK_HKV, HALF,
             BLOCK_HALF, False, BACKWARD)  # fmt: skip


@Launcher
@triton.jit(do_not_specialize=["rows", "T", "pos_start", "pos_step"])
def _rope_kernel(
    x,
    out,
    inv_freq,
    rows,
    T,
    pos_start,
    pos_step,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    SIGN: tl.constexpr,
):
    offs_r, mask_r, pos = _rows(rows, T, pos_start, pos_step, BLOCK_R)
    row = HEADS * 2 * HALF
    _move(x, row, 0, out, row, 0, inv_freq, offs_r, mask_r, pos, HEADS, BLOCK_H, HALF, BLOCK_HALF, True, SIGN)


def _block_rows(heads: int, half: int) -> dict[str, int]:
    # about 4096 values of each half a program
    block_h, block_half = next_power_of_2(heads), next_power_of_2(half)
    return dict(BLOCK_R=max(1, 4096 // (block_h * block_half)), BLOCK_H=block_h, BLOCK_HALF=block_half)


def _check_freq(inv_freq: torch.Tensor, head_dim: int, device: torch.device) -> None:
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head dim, got {head_dim}")
    if inv_freq.shape != (head_dim // 2,) or inv_freq.dtype != torch.float32 or inv_freq.device != device:
        raise ValueError(f"inv_freq must be float32 [{head_dim // 2}] on {device}, got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)} on {inv_freq.device}")  # fmt: skip


class QKVRopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, inv_freq, heads, kv_heads, pos_start):  # type: ignore[override]
        B, T, C = y.shape
        D = 2 * inv_freq.shape[0]
        y = y if y.stride(-1) == 1 and y.stride(0) == T * y.stride(1) else y.contiguous()
        q = y.new_empty(B, T, heads, D)
        kv = [y.new_empty(B, T, kv_heads, D) for _ in range(6)]
        blocks = _block_rows(heads, D // 2)
        grid = (cdiv(B * T, blocks["BLOCK_R"]),)
        _qkv_rope_kernel[grid](
            y, q, *kv, inv_freq, B * T, max(T, 1), pos_start, y.stride(1),
            H=heads, HKV=kv_heads, HALF=D // 2, BLOCK_HKV=next_power_of_2(kv_heads), BACKWARD=False,
            **blocks,
        )  # fmt: skip
        ctx.save_for_backward(inv_freq)
        ctx.shape, ctx.heads, ctx.kv_heads, ctx.pos_start = (B, T, C), heads, kv_heads, pos_start
        return (q, *kv)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        (inv_freq,) = ctx.saved_tensors
        B, T, C = ctx.shape
        D = 2 * inv_freq.shape[0]
        grads = [g.contiguous() for g in grads]
        dy = grads[0].new_empty(B, T, C)
        blocks = _block_rows(ctx.heads, D // 2)
        grid = (cdiv(B * T, blocks["BLOCK_R"]),)
        _qkv_rope_kernel[grid](
            dy, *grads, inv_freq, B * T, max(T, 1), ctx.pos_start, C,
            H=ctx.heads, HKV=ctx.kv_heads, HALF=D // 2, BLOCK_HKV=next_power_of_2(ctx.kv_heads),
            BACKWARD=True, **blocks,
        )  # fmt: skip
        return dy, None, None, None, None


def qkv_rope(
    y: torch.Tensor, inv_freq: torch.Tensor, *, heads: int, kv_heads: int, pos_start: int = 0
) -> tuple[torch.Tensor, ...]:
    """Split ``y [B, T, (heads + 6 kv_heads) * D]``, the projection ``[q | k_cmp v_cmp | k_sel v_sel |
    k_win v_win]``, into ``q [B, T, heads, D]`` and six ``[B, T, kv_heads, D]`` tensors, contiguous, with
    ``q``, ``k_sel`` and ``k_win`` rotated at positions ``pos_start + t``. ``inv_freq [D/2]`` float32 (see
    `rope_frequencies`). Differentiable in ``y``; float16, bfloat16 or float32."""
    D = 2 * inv_freq.shape[0]
    _check_freq(inv_freq, D, y.device)
    if y.dim() != 3 or y.shape[-1] != (heads + 6 * kv_heads) * D:
        raise ValueError(f"y must be [B, T, {(heads + 6 * kv_heads) * D}], got {tuple(y.shape)}")
    return QKVRopeFunction.apply(y, inv_freq, heads, kv_heads, pos_start)


def _rotate(
    x: torch.Tensor, inv_freq: torch.Tensor, pos_start: int, pos_step: int, sign: float
) -> torch.Tensor:
    B, T, H, D = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    blocks = _block_rows(H, D // 2)
    grid = (cdiv(B * T, blocks["BLOCK_R"]),)
    _rope_kernel[grid](
        x, out, inv_freq, B * T, max(T, 1), pos_start, pos_step, HEADS=H, HALF=D // 2, SIGN=sign, **blocks
    )
    return out


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, inv_freq, pos_start, pos_step):  # type: ignore[override]
        ctx.save_for_backward(inv_freq)
        ctx.pos_start, ctx.pos_step = pos_start, pos_step
        return _rotate(x, inv_freq, pos_start, pos_step, 1.0)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        (inv_freq,) = ctx.saved_tensors
        return _rotate(dout, inv_freq, ctx.pos_start, ctx.pos_step, -1.0), None, None, None


def rope(x: torch.Tensor, inv_freq: torch.Tensor, *, pos_start: int = 0, pos_step: int = 1) -> torch.Tensor:
    """``x [B, T, H, D]`` rotated at positions ``pos_start + t * pos_step``; ``inv_freq [D/2]`` float32.
    Differentiable in ``x``; returns a new contiguous tensor."""
    if x.dim() != 4:
        raise ValueError(f"x must be [B, T, H, D], got {tuple(x.shape)}")
    _check_freq(inv_freq, x.shape[-1], x.device)
    return RopeFunction.apply(x, inv_freq, pos_start, pos_step)


def rope_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """``inv_freq [D/2]`` float32, ``theta ** (-j / (D/2))``: the frequencies of `apply_rope`'s table."""
    half = head_dim // 2
    return theta ** (-torch.arange(half, dtype=torch.float32, device=device) / half)
