"""The gated sum of the three branch outputs in one Triton pass each way.

``out = sigmoid(g_cmp) * o_cmp + sigmoid(g_sel) * o_sel + sigmoid(g_win) * o_win`` per (token, head), with
``gate_logits [B, T, HQ, 3]`` and the outputs ``[B, T, HQ, D]``. In torch that is a sigmoid, three
products and two sums forward and about twice as many passes backward over head-dim-wide tensors; here
the forward reads each output once and writes ``out``, the backward reads ``do`` and the outputs once and
writes their gradients and the gates' (``dg_b = s_b (1 - s_b) <do, o_b>``). Arithmetic in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_core.ops.common import eager_under_compile
from nsa_core.ops.triton.flash import cdiv, next_power_of_2
from nsa_core.ops.triton.launch import Launcher


@triton.jit
def _row_tile(rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # this program's BLOCK_R rows (token, head); every tensor contiguous: row r at r * D, gate r at r * 3
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = offs_r < rows
    mask = mask_r[:, None] & (offs_d < D)[None, :]
    return offs_r, mask_r, offs_r[:, None] * D + offs_d[None, :], mask


@triton.jit
def _gated(acc, gate, o, b, offs_r, mask_r, ptr, mask):
    # acc + sigmoid(gate[:, b]) * o, in float32
    s = tl.sigmoid(tl.load(gate + offs_r * 3 + b, mask=mask_r, other=0.0).to(tl.float32))
    return acc + s[:, None] * tl.load(o + ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _gated_grads(do_tile, gate, o, d_o, d_gate, b, offs_r, mask_r, ptr, mask):
    # d_o = sigmoid(g_b) * do; d_gate[:, b] = s (1 - s) <do, o_b>
    s = tl.sigmoid(tl.load(gate + offs_r * 3 + b, mask=mask_r, other=0.0).to(tl.float32))
    o_tile = tl.load(o + ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(d_o + ptr, (s[:, None] * do_tile).to(d_o.dtype.element_ty), mask=mask)
    dg = s * (1.0 - s) * tl.sum(do_tile * o_tile, 1)
    tl.store(d_gate + offs_r * 3 + b, dg.to(d_gate.dtype.element_ty), mask=mask_r)


@Launcher
@triton.jit(do_not_specialize=["rows"])
def _gated_sum_fwd_kernel(
    gate,
    o_cmp,
    o_sel,
    o_win,
    out,
    rows,
    D,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_r, mask_r, ptr, mask = _row_tile(rows, D, BLOCK_R, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    acc = _gated(acc, gate, o_cmp, 0, offs_r, mask_r, ptr, mask)
    acc = _gated(acc, gate, o_sel, 1, offs_r, mask_r, ptr, mask)
    acc = _gated(acc, gate, o_win, 2, offs_r, mask_r, ptr, mask)
    tl.store(out + ptr, acc.to(out.dtype.element_ty), mask=mask)


@Launcher
@triton.jit(do_not_specialize=["rows"])
def _gated_sum_bwd_kernel(
    gate,
    o_cmp,
    o_sel,
    o_win,
    do,
    d_gate,
    d_cmp,
    d_sel,
    d_win,
    rows,
    D,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_r, mask_r, ptr, mask = _row_tile(rows, D, BLOCK_R, BLOCK_D)
    do_tile = tl.load(do + ptr, mask=mask, other=0.0).to(tl.float32)
    _gated_grads(do_tile, gate, o_cmp, d_cmp, d_gate, 0, offs_r, mask_r, ptr, mask)
    _gated_grads(do_tile, gate, o_sel, d_sel, d_gate, 1, offs_r, mask_r, ptr, mask)
    _gated_grads(do_tile, gate, o_win, d_win, d_gate, 2, offs_r, mask_r, ptr, mask)


@triton.jit
def _gate_row_stats(do_tile, gate, o, lse, lse_out, delta, d_gate, b, offs_r, mask_r, ptr, mask, row):
    # for the fused op: d_gate[:, b] = s (1 - s) <do, o_b>; the branch's backward runs on the raw do with
    # delta = <do, o_b> and lse - log2(s): its p is then s * p, i.e. the gradient of s * o_b (s = 0: p = 0)
    s = tl.sigmoid(tl.load(gate + offs_r * 3 + b, mask=mask_r, other=0.0).to(tl.float32))
    o_tile = tl.load(o + ptr, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(do_tile * o_tile, 1)
    tl.store(d_gate + offs_r * 3 + b, (s * (1.0 - s) * dot).to(d_gate.dtype.element_ty), mask=mask_r)
    row_lse = tl.load(lse + row, mask=mask_r, other=0.0)
    shifted = tl.where(s > 0.0, row_lse - tl.log2(tl.where(s > 0.0, s, 1.0)), float("inf"))
    tl.store(lse_out + row, shifted.to(lse_out.dtype.element_ty), mask=mask_r)
    tl.store(delta + row, dot.to(delta.dtype.element_ty), mask=mask_r)


@Launcher
@triton.jit(do_not_specialize=["rows", "T", "HQ"])
def _gated_sum_bwd_stats_kernel(
    gate,
    o_cmp,
    o_sel,
    o_win,
    do,
    lse_cmp,
    lse_sel,
    lse_win,
    d_gate,
    stats,
    rows,
    T,
    HQ,
    D,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # stats [6, rows] float32: lse and delta of cmp and win in their [B, HQ, T] layout, of sel in [B, T, HQ]
    offs_r, mask_r, ptr, mask = _row_tile(rows, D, BLOCK_R, BLOCK_D)
    h, bt = offs_r % HQ, offs_r // HQ
    banded = (bt // T * HQ + h) * T + bt % T  # row (b, t, h) of the banded kernels' [B, HQ, T]
    do_tile = tl.load(do + ptr, mask=mask, other=0.0).to(tl.float32)
    _gate_row_stats(do_tile, gate, o_cmp, lse_cmp, stats, stats + rows, d_gate, 0, offs_r, mask_r, ptr, mask,
                    banded)  # fmt: skip
    _gate_row_stats(do_tile, gate, o_sel, lse_sel, stats + 2 * rows, stats + 3 * rows, d_gate, 1, offs_r,
                    mask_r, ptr, mask, offs_r)  # fmt: skip
    _gate_row_stats(do_tile, gate, o_win, lse_win, stats + 4 * rows, stats + 5 * rows, d_gate, 2, offs_r,
                    mask_r, ptr, mask, banded)  # fmt: skip


def _launch_shape(D: int) -> tuple[int, int]:
    block_d = max(16, next_power_of_2(D))
    return max(1, 4096 // block_d), block_d  # BLOCK_R x BLOCK_D = 4096 elements a program


def gated_sum_fwd(
    gate_logits: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor
) -> torch.Tensor:
    """Launch the forward on contiguous inputs: ``out [B, T, HQ, D]``."""
    rows, D = o_cmp.numel() // o_cmp.shape[-1], o_cmp.shape[-1]
    out = torch.empty_like(o_cmp)
    block_r, block_d = _launch_shape(D)
    if rows:
        _gated_sum_fwd_kernel[(cdiv(rows, block_r),)](
            gate_logits, o_cmp, o_sel, o_win, out, rows, D, BLOCK_R=block_r, BLOCK_D=block_d
        )
    return out


def gated_sum_bwd_stats(
    do: torch.Tensor,
    gate_logits: torch.Tensor,
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    lses: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op's gate backward: ``(d_gate [B, T, HQ, 3], stats [6, B * T * HQ])``, one pass over ``do``.

    ``outputs`` and ``lses`` are the branches' (cmp, sel, win); the lse of cmp and win is the banded kernels'
    ``[B, HQ, T]``, the lse of sel ``[B, T, HQ]`` (float32, base 2). ``stats`` holds, per branch and in its
    lse's layout, ``lse - log2(sigmoid(g))`` and ``delta = <do, o>``: the branch's backward on the raw ``do``
    with those gives the gradients of the gated output ``sigmoid(g) * o``, so no ``do * sigmoid(g)`` tensor
    is written.
    """
    o_cmp, o_sel, o_win = outputs
    B, T, HQ, D = o_cmp.shape
    rows = B * T * HQ
    assert all(x.is_contiguous() for x in (do, gate_logits, *outputs, *lses))
    assert all(x.numel() == rows and x.dtype == torch.float32 for x in lses)
    d_gate = torch.empty_like(gate_logits)
    stats = torch.empty(6, rows, dtype=torch.float32, device=do.device)
    block_r, block_d = _launch_shape(D)
    if rows:
        _gated_sum_bwd_stats_kernel[(cdiv(rows, block_r),)](
            gate_logits, o_cmp, o_sel, o_win, do, *lses, d_gate, stats, rows, T, HQ, D,
            BLOCK_R=block_r, BLOCK_D=block_d,
        )  # fmt: skip
    return d_gate, stats


class GatedSumFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_logits, o_cmp, o_sel, o_win):  # type: ignore[override]
        out = gated_sum_fwd(gate_logits, o_cmp, o_sel, o_win)
        ctx.save_for_backward(gate_logits, o_cmp, o_sel, o_win)
        return out

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        gate_logits, o_cmp, o_sel, o_win = ctx.saved_tensors
        do = do.contiguous()
        rows, D = o_cmp.numel() // o_cmp.shape[-1], o_cmp.shape[-1]
        d_gate = torch.empty_like(gate_logits)
        d_cmp, d_sel, d_win = torch.empty_like(o_cmp), torch.empty_like(o_sel), torch.empty_like(o_win)
        block_r, block_d = _launch_shape(D)
        if rows:
            _gated_sum_bwd_kernel[(cdiv(rows, block_r),)](
                gate_logits, o_cmp, o_sel, o_win, do, d_gate, d_cmp, d_sel, d_win, rows, D,
                BLOCK_R=block_r, BLOCK_D=block_d,
            )  # fmt: skip
        return d_gate, d_cmp, d_sel, d_win


@eager_under_compile
def triton_gated_sum(
    gate_logits: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor
) -> torch.Tensor:
    """``sum_b sigmoid(gate_logits[..., b, None]) * o_b`` over b = cmp, sel, win.

    ``gate_logits [B, T, HQ, 3]``, outputs ``[B, T, HQ, D]`` of one dtype; returns ``[B, T, HQ, D]`` in the
    outputs' dtype, differentiable in all four inputs.
    """
    if gate_logits.shape != (*o_cmp.shape[:-1], 3):
        raise ValueError(f"gate_logits {tuple(gate_logits.shape)} must be {(*o_cmp.shape[:-1], 3)}")
    if not (o_cmp.shape == o_sel.shape == o_win.shape) or not (o_cmp.dtype == o_sel.dtype == o_win.dtype):
        raise ValueError("the three branch outputs must share one shape and dtype")
    return GatedSumFunction.apply(
        gate_logits.contiguous(), o_cmp.contiguous(), o_sel.contiguous(), o_win.contiguous()
    )
