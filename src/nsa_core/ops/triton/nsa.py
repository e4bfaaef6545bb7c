"""The whole NSA op in one autograd function: compression with the fused selection, selected attention,
sliding window and the sigmoid gates, forward and backward.

Composed from the branch functions, autograd keeps each branch's output for its backward and the gates',
writes ``do * sigmoid(g_b)`` once per branch (three ``[B, T, HQ, D]`` tensors), lets every branch's
backward recompute ``delta = rowsum(o * do)``, and sums three ``dq`` tensors. Here the backward starts
with one pass over ``do`` and the three outputs (`gates.gated_sum_bwd_stats`) that writes the gates'
gradient and, per branch and row, ``delta_b = <do, o_b>`` and ``lse_b - log2(s_b)``: the branch kernels
then run on the raw ``do`` and give the gradients of ``s_b * o_b`` (their ``p`` becomes ``s_b p``,
``ds = s_b p (dp - delta_b)`` and ``dv = (s_b p)^T do``), and each adds its ``dq`` into one tensor
(selection first, then window, then compression: a fixed order, so the gradients stay deterministic).
The workspace of the backward drops by four ``[B, T, HQ, D]`` tensors (the three gated output
gradients and two of the three ``dq``) and by the torch sum over ``dq``. Where the selection and the window
read the same ``k`` and ``v`` (the same tensors passed twice), the window's dK/dV are added into the
selection's as its partial sums are summed: one gradient each, not two for autograd to add.

``on_branch(phase, branch)``, if given, is called on the host as each branch's kernels are about to be
launched (``"forward"`` or ``"backward"``, then ``"cmp"``, ``"sel"`` or ``"win"``), and with ``branch=None``
once the op's kernels of that direction are launched: what a tool needs to say which branch a step is in,
or to open a profiler range per branch, without composing the branches. It runs no kernel, reads no tensor.

The kernels are those of `flash`, `compression`, `selection` and `gates`; each is tested alone against the
float64 references, and this composition against the references of the three branches together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nsa_core.ops.common import check_qkv, eager_under_compile
from nsa_core.ops.triton.compression import (
    SELECT_KEYS,
    check_compressed,
    check_select,
    select_from_lse,
    triton_compressed_attention,
)
from nsa_core.ops.triton.flash import banded_backward, banded_forward
from nsa_core.ops.triton.gates import gated_sum_bwd_stats, gated_sum_fwd, triton_gated_sum
from nsa_core.ops.triton.selection import (
    SUPPORTED_DTYPES,
    BlockQueries,
    TokenTiles,
    selected_bwd,
    selected_fwd,
    triton_selected_attention,
)
from nsa_core.ops.triton.window import triton_sliding_window_attention


@dataclass(frozen=True)
class NSAGeometry:
    """The op's block geometry: compression ``l, d``, selection ``l', n`` with forced blocks, window ``w``."""

    block_len: int
    block_stride: int
    sel_block_len: int
    n_sel: int
    n_init: int
    n_local: int
    window: int

    def compressed(self, q_offset: int) -> dict[str, int | None]:
        # compressed block j ends at j * d + l - 1 (the banded kernels' key geometry)
        stride, offset = self.block_stride, self.block_len - 1
        return dict(key_stride=stride, key_offset=offset, window=None, q_offset=q_offset)

    def sliding(self, q_offset: int) -> dict[str, int | None]:
        return dict(key_stride=1, key_offset=0, window=self.window, q_offset=q_offset)

    def select(self) -> dict[str, int]:
        return dict(
            sel_block_len=self.sel_block_len, n_sel=self.n_sel, n_init=self.n_init, n_local=self.n_local
        )


class NSAAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gate_logits, geometry, q_offset, scale, on_branch
    ):
        mark = on_branch or _unmarked
        mark("forward", "cmp")
        o_cmp, lse_cmp = banded_forward(q, k_cmp, v_cmp, scale=scale, **geometry.compressed(q_offset))
        block_idx = select_from_lse(
            q, k_cmp, lse_cmp, block_len=geometry.block_len, block_stride=geometry.block_stride,
            q_offset=q_offset, scale=scale, **geometry.select(),
        )  # fmt: skip
        mark("forward", "sel")
        # what the forward built for the backward: its tiles, which dq reads again, or its inverted index
        token_tiles: list[TokenTiles | BlockQueries] = []
        o_sel, lse_sel = selected_fwd(
            q, k_sel, v_sel, block_idx, geometry.sel_block_len, q_offset, scale, tiles_out=token_tiles
        )
        mark("forward", "win")
        o_win, lse_win = banded_forward(q, k_win, v_win, scale=scale, **geometry.sliding(q_offset))
        out = gated_sum_fwd(gate_logits, o_cmp, o_sel, o_win)
        mark("forward", None)
        ctx.save_for_backward(
            q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gate_logits,
            o_cmp, o_sel, o_win, lse_cmp, lse_sel, lse_win, block_idx,
        )  # fmt: skip
        ctx.geometry, ctx.q_offset, ctx.scale, ctx.mark = geometry, q_offset, scale, mark
        # the window reads the selection's keys and values (the op's common use): its backward adds its
        # dK/dV into the selection's, one gradient each where autograd would add two
        ctx.shared_kv = k_win is k_sel and v_win is v_sel
        # tiles of one token, and the scan's, are block_idx itself (an output: not kept on ctx, which would
        # hold it in a cycle); dq builds nothing for them
        kept = token_tiles[0] if token_tiles else None
        if isinstance(kept, TokenTiles) and (kept.tokens == 1 or kept.scan):
            kept = None
        ctx.token_tiles = kept
        ctx.mark_non_differentiable(block_idx)
        return out, block_idx

    @staticmethod
    def backward(ctx, do, _d_block_idx):  # type: ignore[override]
        (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gate_logits,
         o_cmp, o_sel, o_win, lse_cmp, lse_sel, lse_win, block_idx) = ctx.saved_tensors  # fmt: skip
        geometry, q_offset, scale, mark = ctx.geometry, ctx.q_offset, ctx.scale, ctx.mark
        B, Tq, HQ, _ = q.shape
        do = do.contiguous()
        d_gate, stats = gated_sum_bwd_stats(
            do, gate_logits, (o_cmp, o_sel, o_win), (lse_cmp, lse_sel, lse_win)
        )
        banded_rows, sel_rows = (B, HQ, Tq), (B, Tq, HQ)
        lse2_cmp, delta_cmp = stats[0].view(banded_rows), stats[1].view(banded_rows)
        lse2_sel, delta_sel = stats[2].view(sel_rows), stats[3].view(sel_rows)
        lse2_win, delta_win = stats[4].view(banded_rows), stats[5].view(banded_rows)
        mark("backward", "sel")
        dq, dk_sel, dv_sel = selected_bwd(
            do, q, k_sel, v_sel, o_sel, lse2_sel, block_idx, geometry.sel_block_len, q_offset, scale,
            delta=delta_sel, token_tiles=ctx.token_tiles,
        )  # fmt: skip
        mark("backward", "win")
        shared = ctx.shared_kv
        _, dk_win, dv_win = banded_backward(
            do, q, k_win, v_win, o_win, lse2_win, scale=scale, delta=delta_win, dq=dq,
            dkdv=(dk_sel, dv_sel) if shared else None, **geometry.sliding(q_offset),
        )  # fmt: skip
        if shared:  # dk_win, dv_win hold both branches' gradients; k_win is k_sel
            dk_sel, dv_sel, dk_win, dv_win = dk_win, dv_win, None, None
        mark("backward", "cmp")
        _, dk_cmp, dv_cmp = banded_backward(
            do, q, k_cmp, v_cmp, o_cmp, lse2_cmp, scale=scale, delta=delta_cmp, dq=dq,
            **geometry.compressed(q_offset),
        )  # fmt: skip
        mark("backward", None)
        return dq, dk_cmp, dv_cmp, dk_sel, dv_sel, dk_win, dv_win, d_gate, None, None, None, None


def _unmarked(phase: str, branch: str | None) -> None:
    pass


def _composed(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, ...],
    gate_logits: torch.Tensor,
    geometry: NSAGeometry,
    q_offset: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # the branch functions one after the other: the edge cases (no query, no complete compressed block)
    k_cmp, v_cmp, k_sel, v_sel, k_win, v_win = kv
    select = dict(kv_heads=k_cmp.shape[2], **geometry.select())
    o_cmp, block_idx = triton_compressed_attention(
        q, k_cmp, v_cmp, block_len=geometry.block_len, block_stride=geometry.block_stride,
        q_offset=q_offset, scale=scale, select=select,
    )  # fmt: skip
    assert block_idx is not None
    o_sel = triton_selected_attention(
        q, k_sel, v_sel, block_idx, sel_block_len=geometry.sel_block_len, q_offset=q_offset, scale=scale
    )
    o_win = triton_sliding_window_attention(
        q, k_win, v_win, window=geometry.window, q_offset=q_offset, scale=scale
    )
    return triton_gated_sum(gate_logits, o_cmp, o_sel, o_win), block_idx


@eager_under_compile
def triton_nsa_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gate_logits: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    sel_block_len: int,
    n_sel: int,
    n_init: int,
    n_local: int,
    window: int,
    q_offset: int = 0,
    scale: float | None = None,
    on_branch: Callable[[str, str | None], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated sum of the three NSA branches of ``q [B, Tq, HQ, D]``, as one autograd function.

    Equals ``triton_gated_sum(gate_logits, o_cmp, o_sel, o_win)`` of the branch functions:
    ``triton_compressed_attention(q, k_cmp, v_cmp, select=...)`` over ``k_cmp/v_cmp [B, Nc, HKV, D]`` (its
    ``block_idx`` chooses the selection's blocks), ``triton_selected_attention(q, k_sel, v_sel, block_idx)``
    and ``triton_sliding_window_attention(q, k_win, v_win)`` over ``[B, Tk, HKV, D]`` with
    ``Tk = q_offset + Tq``; ``gate_logits [B, Tq, HQ, 3]`` (cmp, sel, win). The same key/value tensors may
    serve several branches. Differentiable in ``q``, the six key/value tensors and ``gate_logits``;
    float16, bfloat16 or float32. Returns ``(out [B, Tq, HQ, D], block_idx [B, Tq, HKV, n_sel])``.
    ``on_branch(phase, branch)``: see the module's docstring (not called on the composed edge cases: no
    query, or no complete compressed block).
    """
    check_qkv(q, k_sel, v_sel, q_offset)
    check_qkv(q, k_win, v_win, q_offset)
    check_compressed(q, k_cmp, v_cmp, block_len, block_stride, q_offset)
    geometry = NSAGeometry(block_len, block_stride, sel_block_len, n_sel, n_init, n_local, window)
    check_select(dict(kv_heads=k_cmp.shape[2], **geometry.select()), k_cmp.shape[2], block_stride)
    assert set(geometry.select()) | {"kv_heads"} == set(SELECT_KEYS)
    if k_sel.shape[2] != k_cmp.shape[2] or k_win.shape[2] != k_cmp.shape[2]:
        raise ValueError("k_cmp, k_sel and k_win must have the same number of KV heads")
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    if gate_logits.shape != (*q.shape[:-1], 3):
        raise ValueError(f"gate_logits {tuple(gate_logits.shape)} must be {(*q.shape[:-1], 3)}")
    kv = (k_cmp, v_cmp, k_sel, v_sel, k_win, v_win)
    if q.dtype not in SUPPORTED_DTYPES or any(x.dtype != q.dtype for x in kv):
        raise NotImplementedError(
            f"triton_nsa_attention runs float16, bfloat16 or float32 with one dtype for q and the keys and "
            f"values; got {q.dtype}, {[x.dtype for x in kv]}: cast them, or compose the branch functions"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.shape[1] == 0 or k_cmp.shape[1] == 0:
        return _composed(q, kv, gate_logits, geometry, q_offset, scale)
    return NSAAttentionFunction.apply(
        q.contiguous(), *(x.contiguous() for x in kv), gate_logits.contiguous(), geometry, q_offset, scale,
        on_branch,
    )  # fmt: skip
