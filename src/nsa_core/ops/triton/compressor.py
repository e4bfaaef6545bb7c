"""The block compressor phi in Triton: one kernel forward, three or four backward (torch: ~16 in all).

phi turns each complete block of ``l`` tokens of ``raw [B, T, H, D]`` (blocks ``first ..``, stride ``d``)
into one vector: ``y = W2 silu(W1 flat(block + pos) + b1) + b2`` with ``pos [l, D]``, ``W1 [D, l D]`` and
``W2 [D, D]`` (`nsa_core.layers.attention.BlockCompressor`). In torch that is an overlapping-block copy
(every token twice at ``l = 2d``), two GEMMs, the activation, their backward and the unfold's: at m7c-125m's
geometry the op's forward+backward went from 80 kernels to 56 with the kernels below (eight of the 56), so
its key and value compressors had taken some 32 (BENCHMARKS.md). Here:

- forward: a program takes ``BLOCK_N`` blocks of one (batch, head) and sums ``x_j W1_j^T`` over the
  ``l`` token positions ``j`` of a block, reading the tokens where they lie (no block copy); the hidden
  pre-activation ``h`` is kept for the backward (``[rows, D]``, rows = blocks x heads: small);
- backward: ``dh = (dy W2) * silu'(h)`` by block tiles; the tokens' gradient by tiles of stride chunks
  (token ``u = c d + r`` of chunk ``c`` lies in block ``c - m`` at position ``r + m d``, ``m = 0 ..``):
  each token's sum over its blocks in one program, no atomics; the weights' gradients by one program per
  token position ``j`` (``dW1_j = dh^T x_j``, and ``dpos_j = (sum_rows dh) W1_j``, which is the sum over
  blocks of the input's gradient) and one for ``W2``, ``b2`` and ``b1``, each summing its rows in order
  (over `SPLIT_ROWS` rows, split into row ranges whose partial sums a fourth kernel adds in order).

The keys' and the values' phi (two raw tensors of one layout, each with its own weights) run in the same
launches (`triton_block_compress_pair`): every kernel takes both members' pointers and a program axis picks
one, so a layer issues one autograd function and four or five kernels for both, not two and eight or ten
(at m7c-125m's 2k op the host's issue time was the op's time, BENCHMARKS.md).

Everything is deterministic. Rounding follows torch's: ``block + pos`` and ``h`` are rounded to the
inputs' dtype before the products that read them; products accumulate in float32 (float16/bfloat16) or
exactly (float32, ``ieee``); ``dh`` stays float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_core.ops.compression import num_compressed_blocks, unfold_blocks
from nsa_core.ops.triton.flash import cdiv, kernel_dtypes
from nsa_core.ops.triton.launch import Launcher

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_ROWS = 64  # blocks (or stride chunks, or rows of a weight sum) a program takes at a time
# the weights' gradients sum over every (batch, block, head) row: one program per token position sums up to
# SPLIT_ROWS of them (a short sequence's step: no second launch); more are split into at most MAX_SPLITS
# row ranges, whose float32 partial sums a second kernel adds in order (at 64k tokens and 4 heads the
# unsplit sum took 1.37 ms of the compressor's 1.59, H200)
SPLIT_ROWS = 2048
MAX_SPLITS = 16


@triton.jit
def _pick(which, first, second):
    # the pointer of the pair's member ``which`` (0: keys, 1: values); one member: first and second alike
    chosen = first
    if which == 1:
        chosen = second
    return chosen


@triton.jit
def _block_input(raw, pos, base, first_token, mask, j, s_t, offs_c, D):
    # x_j of blocks whose first token is first_token (per row; base: the row's batch and head offset):
    # raw[b, first_token + j, h, :] + pos[j], rounded to raw's dtype
    ptrs = raw + (base + (first_token + j).to(tl.int64) * s_t)[:, None] + offs_c[None, :]
    x = tl.load(ptrs, mask=mask[:, None], other=0.0).to(tl.float32)
    x = x + tl.load(pos + j * D + offs_c).to(tl.float32)[None, :]
    return x.to(raw.dtype.element_ty)


@Launcher
@triton.jit(do_not_specialize=["N", "start", "rows"])
def _compress_fwd_kernel(
    raw, raw2, pos, pos2, w1, w1_2, b1, b1_2, w2, w2_2, b2, b2_2, hidden, out, out2,
    N, H, start, stride_d, block_len, rows, s_b, s_t, s_h,
    D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # program (block tile, b * H + h, member): out rows (b, n, h) of the tile, hidden the same rows (the
    # member's ``rows`` after the first's)
    bh, which = tl.program_id(1), tl.program_id(2)
    raw, pos, w1 = _pick(which, raw, raw2), _pick(which, pos, pos2), _pick(which, w1, w1_2)
    b1, w2, b2 = _pick(which, b1, b1_2), _pick(which, w2, w2_2), _pick(which, b2, b2_2)
    out = _pick(which, out, out2)
    hidden += which.to(tl.int64) * rows * D
    b, h = bh // H, bh % H
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_c = tl.arange(0, D)
    base = tl.zeros([BLOCK_N], dtype=tl.int64) + (b.to(tl.int64) * s_b + h * s_h)
    first_token = start + offs_n * stride_d
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for j in range(block_len):
        x = _block_input(raw, pos, base, first_token, mask_n, j, s_t, offs_c, D)
        w = tl.load(w1 + offs_c[None, :] * (block_len * D) + j * D + offs_c[:, None])  # W1_j^T [c, o]
        acc += tl.dot(x, w, input_precision=PRECISION)
    pre = (acc + tl.load(b1 + offs_c).to(tl.float32)[None, :]).to(hidden.dtype.element_ty)
    r = ((b * N + offs_n) * H + h).to(tl.int64)
    tl.store(hidden + r[:, None] * D + offs_c[None, :], pre, mask=mask_n[:, None])
    pre = pre.to(tl.float32)
    act = (pre * tl.sigmoid(pre)).to(w2.dtype.element_ty)
    w = tl.load(w2 + offs_c[None, :] * D + offs_c[:, None])  # W2^T [i, o]
    y = tl.dot(act, w, input_precision=PRECISION) + tl.load(b2 + offs_c).to(tl.float32)[None, :]
    tl.store(out + r[:, None] * D + offs_c[None, :], y.to(out.dtype.element_ty), mask=mask_n[:, None])


@Launcher
@triton.jit(do_not_specialize=["rows"])
def _compress_bwd_hidden_kernel(
    dy, dy2, hidden, w2, w2_2, dh, rows, D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr
):
    # program (row tile, member): dh = (dy W2) * silu'(h), float32, rows of the tile
    which = tl.program_id(1)
    dy, w2 = _pick(which, dy, dy2), _pick(which, w2, w2_2)
    hidden += which.to(tl.int64) * rows * D
    dh += which.to(tl.int64) * rows * D
    offs_r = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_r = offs_r < rows
    offs_c = tl.arange(0, D)
    ptrs = offs_r[:, None] * D + offs_c[None, :]
    dy_tile = tl.load(dy + ptrs, mask=mask_r[:, None], other=0.0)
    w = tl.load(w2 + offs_c[:, None] * D + offs_c[None, :])  # W2 [o, i]
    da = tl.dot(dy_tile, w, input_precision=PRECISION)
    pre = tl.load(hidden + ptrs, mask=mask_r[:, None], other=0.0).to(tl.float32)
    sig = tl.sigmoid(pre)
    tl.store(dh + ptrs, da * sig * (1.0 + pre * (1.0 - sig)), mask=mask_r[:, None])


@Launcher
@triton.jit(do_not_specialize=["N", "T", "start", "rows"])
def _compress_bwd_input_kernel(
    dh, w1, w1_2, d_raw,
    N, H, T, start, stride_d, block_len, rows, s_p, s_b, s_t, s_h,
    D: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # program (chunk tile, b * H + h, member): d_raw of tokens start + c d + r, r < d, for the tile's chunks
    # c; a token's blocks are c - m for m = 0 .. while r + m d < l (none: zeros). d_raw [members, B, T, H, D]
    which = tl.program_id(2)
    w1 = _pick(which, w1, w1_2)
    dh += which.to(tl.int64) * rows * D
    d_raw += which.to(tl.int64) * s_p
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_k = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_c = tl.arange(0, D)
    blocks_per_token = tl.cdiv(block_len, stride_d)
    for r in range(stride_d):
        acc = tl.zeros([BLOCK_C, D], dtype=tl.float32)
        for m in range(blocks_per_token):
            j = r + m * stride_d
            if j < block_len:
                n = offs_k - m
                valid = (n >= 0) & (n < N)
                rows_n = ((b * N + n) * H + h).to(tl.int64)
                g = tl.load(dh + rows_n[:, None] * D + offs_c[None, :], mask=valid[:, None], other=0.0)
                w = tl.load(w1 + offs_c[:, None] * (block_len * D) + j * D + offs_c[None, :])  # W1_j [o, c]
                acc += tl.dot(g.to(w1.dtype.element_ty), w, input_precision=PRECISION)
        token = start + offs_k * stride_d + r
        ptrs = d_raw + b.to(tl.int64) * s_b + token.to(tl.int64)[:, None] * s_t + h * s_h + offs_c[None, :]
        tl.store(ptrs, acc.to(d_raw.dtype.element_ty), mask=(token < T)[:, None])


@triton.jit
def _weight_grads(j, which, acc, col, col_dh, w1, d_pos, d_w1, d_b1, d_w2, d_b2, block_len, D: tl.constexpr):
    # the sums of program j written as gradients of the member ``which`` (its weights' gradients after the
    # first member's in each pair tensor): dW1_j and d_pos_j = col W1_j (j < l), or dW2, db2, db1
    offs_c = tl.arange(0, D)
    at = which.to(tl.int64)
    if j < block_len:
        w1_j = offs_c[:, None] * (block_len * D) + j * D + offs_c[None, :]  # [o, c]
        tl.store(d_w1 + at * (block_len * D * D) + w1_j, acc.to(d_w1.dtype.element_ty))
        dpos = tl.sum(col[:, None] * tl.load(w1 + w1_j).to(tl.float32), 0)
        tl.store(d_pos + at * (block_len * D) + j * D + offs_c, dpos.to(d_pos.dtype.element_ty))
    else:
        w2_at = d_w2 + at * (D * D) + offs_c[:, None] * D + offs_c[None, :]
        tl.store(w2_at, acc.to(d_w2.dtype.element_ty))
        tl.store(d_b2 + at * D + offs_c, col.to(d_b2.dtype.element_ty))
        tl.store(d_b1 + at * D + offs_c, col_dh.to(d_b1.dtype.element_ty))


@Launcher
@triton.jit(do_not_specialize=["N", "start", "rows", "rows_per_split", "splits"])
def _compress_bwd_weight_kernel(
    raw, raw2, pos, pos2, w1, w1_2, dy, dy2, hidden, dh, d_pos, d_w1, d_b1, d_w2, d_b2, part,
    N, H, start, stride_d, block_len, rows, rows_per_split, splits, s_b, s_t, s_h,
    D: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    # program (j, split, member): over the split's rows, j < l: dW1_j = sum dh^T x_j and sum dh (for
    # d_pos_j); j = l: dW2 = sum dy^T silu(h), db2 = sum dy, db1 = sum dh. SPLIT: partial sums into part
    # [members, splits, l + 1, D * D + 2 D] (float32, summed in order by `_compress_bwd_weight_reduce_kernel`)
    j, split, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    raw, pos, w1, dy = (
        _pick(which, raw, raw2),
        _pick(which, pos, pos2),
        _pick(which, w1, w1_2),
        _pick(which, dy, dy2),
    )
    hidden += which.to(tl.int64) * rows * D
    dh += which.to(tl.int64) * rows * D
    offs_c = tl.arange(0, D)
    acc = tl.zeros([D, D], dtype=tl.float32)
    col = tl.zeros([D], dtype=tl.float32)  # sum over rows of dh (j < l) or dy (j = l)
    col_dh = tl.zeros([D], dtype=tl.float32)
    r_begin = split * rows_per_split
    r_end = tl.minimum(rows, r_begin + rows_per_split)
    for r0 in range(r_begin, r_end, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < r_end
        ptrs = offs_r.to(tl.int64)[:, None] * D + offs_c[None, :]
        g = tl.load(dh + ptrs, mask=mask_r[:, None], other=0.0)  # [R, o]
        if j < block_len:
            b, n, h = offs_r // (N * H), (offs_r // H) % N, offs_r % H
            base = b.to(tl.int64) * s_b + h.to(tl.int64) * s_h
            x = _block_input(raw, pos, base, start + n * stride_d, mask_r, j, s_t, offs_c, D)
            acc += tl.dot(tl.trans(g.to(raw.dtype.element_ty)), x, input_precision=PRECISION)
            col += tl.sum(g, 0)
        else:
            g_y = tl.load(dy + ptrs, mask=mask_r[:, None], other=0.0)
            pre = tl.load(hidden + ptrs, mask=mask_r[:, None], other=0.0).to(tl.float32)
            act = (pre * tl.sigmoid(pre)).to(dy.dtype.element_ty)
            acc += tl.dot(tl.trans(g_y), act, input_precision=PRECISION)
            col += tl.sum(g_y.to(tl.float32), 0)
            col_dh += tl.sum(g, 0)
    if SPLIT:
        at = part + ((which * splits + split) * (block_len + 1) + j).to(tl.int64) * (D * D + 2 * D)
        tl.store(at + offs_c[:, None] * D + offs_c[None, :], acc)
        tl.store(at + D * D + offs_c, col)
        tl.store(at + D * D + D + offs_c, col_dh)
    else:
        _weight_grads(j, which, acc, col, col_dh, w1, d_pos, d_w1, d_b1, d_w2, d_b2, block_len, D)


@Launcher
@triton.jit
def _compress_bwd_weight_reduce_kernel(
    part, w1, w1_2, d_pos, d_w1, d_b1, d_w2, d_b2, splits, block_len, D: tl.constexpr
):
    # program (j, member): the splits' partial sums of j added in split order, then written as gradients
    j, which = tl.program_id(0), tl.program_id(1)
    w1 = _pick(which, w1, w1_2)
    offs_c = tl.arange(0, D)
    acc = tl.zeros([D, D], dtype=tl.float32)
    col = tl.zeros([D], dtype=tl.float32)
    col_dh = tl.zeros([D], dtype=tl.float32)
    for split in range(splits):
        at = part + ((which * splits + split) * (block_len + 1) + j).to(tl.int64) * (D * D + 2 * D)
        acc += tl.load(at + offs_c[:, None] * D + offs_c[None, :])
        col += tl.load(at + D * D + offs_c)
        col_dh += tl.load(at + D * D + D + offs_c)
    _weight_grads(j, which, acc, col, col_dh, w1, d_pos, d_w1, d_b1, d_w2, d_b2, block_len, D)


def _strides(raw: torch.Tensor) -> tuple[int, int, int]:
    return raw.stride(0), raw.stride(1), raw.stride(2)


def _warps(D: int) -> int:
    return 4 if D <= 64 else 8  # the weight sums hold a [D, D] float32 accumulator


def _second(members: tuple[torch.Tensor, ...]) -> torch.Tensor:
    # the second member's pointer, or the first's where there is one member (never read then)
    return members[-1]


class BlockCompressFunction(torch.autograd.Function):
    """phi over one raw tensor, or over two of one shape and layout (the keys and the values, each with
    its own weights) in the same launches: ``apply(block_len, block_stride, first, *raws, *weights)`` with
    five weights a member, in the members' order; returns one output a member."""

    @staticmethod
    def forward(ctx, block_len, block_stride, first, *tensors):  # type: ignore[override]
        P = len(tensors) // 6
        raws = tensors[:P]
        pos, w1, b1, w2, b2 = (tensors[P + i :: 5] for i in range(5))
        raw = raws[0]
        B, T, H, D = raw.shape
        start = first * block_stride
        N = num_compressed_blocks(T - start, block_len, block_stride)
        rows = B * N * H
        outs = tuple(raw.new_empty(B, N, H, D) for _ in raws)
        hidden = raw.new_empty(P, B, N, H, D)
        precision = kernel_dtypes(raw.dtype)[1]
        _compress_fwd_kernel[(cdiv(N, BLOCK_ROWS), B * H, P)](
            raw, _second(raws), pos[0], _second(pos), w1[0], _second(w1), b1[0], _second(b1), w2[0],
            _second(w2), b2[0], _second(b2), hidden, outs[0], _second(outs),
            N, H, start, block_stride, block_len, rows, *_strides(raw),
            D=D, BLOCK_N=BLOCK_ROWS, PRECISION=precision, num_warps=_warps(D),
        )  # fmt: skip
        ctx.save_for_backward(*raws, *pos, *w1, *w2, hidden)
        ctx.geometry = (block_len, block_stride, start, P)
        return outs if P > 1 else outs[0]

    @staticmethod
    def backward(ctx, *dys):  # type: ignore[override]
        block_len, block_stride, start, P = ctx.geometry
        saved = ctx.saved_tensors
        raws, pos, w1, w2, hidden = (
            saved[:P],
            saved[P : 2 * P],
            saved[2 * P : 3 * P],
            saved[3 * P : 4 * P],
            saved[-1],
        )
        raw = raws[0]
        B, T, H, D = raw.shape
        N = hidden.shape[2]
        rows = B * N * H
        dys = tuple(dy.contiguous() for dy in dys)
        precision = kernel_dtypes(raw.dtype)[1]
        dh = torch.empty(P, rows, D, dtype=torch.float32, device=raw.device)
        _compress_bwd_hidden_kernel[(cdiv(rows, BLOCK_ROWS), P)](
            dys[0], _second(dys), hidden, w2[0], _second(w2), dh, rows,
            D=D, BLOCK_N=BLOCK_ROWS, PRECISION=precision, num_warps=_warps(D),
        )  # fmt: skip
        d_raws: tuple[torch.Tensor | None, ...] = (None,) * P
        if any(ctx.needs_input_grad[3 : 3 + P]):
            # every token from start on is written (zeros where no block holds it); those before: zeros
            d_raw = (torch.zeros if start else torch.empty)(
                (P, *raw.shape), dtype=raw.dtype, device=raw.device
            )
            chunks = cdiv(T - start, block_stride)
            _compress_bwd_input_kernel[(cdiv(chunks, BLOCK_ROWS), B * H, P)](
                dh, w1[0], _second(w1), d_raw, N, H, T, start, block_stride, block_len, rows,
                d_raw.stride(0), *_strides(d_raw[0]),
                D=D, BLOCK_C=BLOCK_ROWS, PRECISION=precision, num_warps=_warps(D),
            )  # fmt: skip
            d_raws = tuple(d_raw[i] if ctx.needs_input_grad[3 + i] else None for i in range(P))
        p0 = pos[0]
        d_pos, d_w1, d_w2 = p0.new_empty(P, *p0.shape), p0.new_empty(P, *w1[0].shape), p0.new_empty(P, D, D)
        d_b1, d_b2 = p0.new_empty(P, D), p0.new_empty(P, D)
        # the weights' sums over the rows: one program per token position (and W2's) while the rows are
        # few; split over row ranges beyond, each split's partial sums then added in order
        splits = min(MAX_SPLITS, cdiv(rows, SPLIT_ROWS))
        rows_per_split = cdiv(cdiv(rows, splits), BLOCK_ROWS) * BLOCK_ROWS
        part = dh  # written only where split
        if splits > 1:
            part = torch.empty(
                P, splits, block_len + 1, D * D + 2 * D, dtype=torch.float32, device=raw.device
            )
        _compress_bwd_weight_kernel[(block_len + 1, splits, P)](
            raw, _second(raws), pos[0], _second(pos), w1[0], _second(w1), dys[0], _second(dys), hidden, dh,
            d_pos, d_w1, d_b1, d_w2, d_b2, part,
            N, H, start, block_stride, block_len, rows, rows_per_split, splits, *_strides(raw),
            D=D, BLOCK_R=BLOCK_ROWS, PRECISION=precision, SPLIT=splits > 1, num_warps=_warps(D),
        )  # fmt: skip
        if splits > 1:
            _compress_bwd_weight_reduce_kernel[(block_len + 1, P)](
                part, w1[0], _second(w1), d_pos, d_w1, d_b1, d_w2, d_b2, splits, block_len, D=D,
                num_warps=_warps(D),
            )  # fmt: skip
        weights = tuple(g for i in range(P) for g in (d_pos[i], d_w1[i], d_b1[i], d_w2[i], d_b2[i]))
        return None, None, None, *d_raws, *weights


def runs_in_triton(raw: torch.Tensor, weights: tuple[torch.Tensor, ...], block_len: int) -> bool:
    """Whether `triton_block_compress` runs its kernels on these inputs rather than torch: one supported
    dtype for all, a power-of-two head dim of 16 to 128, parameters of phi's shapes, plain tensors."""
    D = raw.shape[-1]
    pos, w1, b1, w2, b2 = weights
    shapes = (pos.shape, w1.shape, b1.shape, w2.shape, b2.shape)
    return (
        raw.dtype in SUPPORTED_DTYPES
        and all(w.dtype == raw.dtype and w.device == raw.device for w in weights)
        and 16 <= D <= 128
        and D & (D - 1) == 0
        and shapes == ((block_len, D), (D, block_len * D), (D,), (D, D), (D,))
        and all(type(x) in (torch.Tensor, torch.nn.Parameter) for x in (raw, *weights))
    )


def torch_block_compress(
    raw: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    *,
    block_len: int,
    block_stride: int,
    first: int = 0,
) -> torch.Tensor:
    """phi in torch, as `BlockCompressor.forward` over `nsa_core.ops.compression.unfold_blocks`."""
    pos, w1, b1, w2, b2 = weights
    blocks = unfold_blocks(raw, block_len, block_stride, first)
    hidden = torch.nn.functional.silu(torch.nn.functional.linear((blocks + pos).flatten(-2), w1, b1))
    return torch.nn.functional.linear(hidden, w2, b2)


def triton_block_compress(
    raw: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    *,
    block_len: int,
    block_stride: int,
    first: int = 0,
) -> torch.Tensor:
    """phi over the complete blocks ``first ..`` of ``raw [B, T, H, D]``: ``[B, N, H, D]``.

    ``weights = (pos [l, D], W1 [D, l D], b1 [D], W2 [D, D], b2 [D])``: `BlockCompressor`'s ``pos``,
    ``mlp[0]`` and ``mlp[2]``. Differentiable in ``raw`` and the five weights. Runs the module's torch
    operations where the kernels do not apply (`runs_in_triton`) or where there is no complete block."""
    _check_geometry(block_len, block_stride, first)
    N = num_compressed_blocks(raw.shape[1] - first * block_stride, block_len, block_stride)
    if N < 1 or not runs_in_triton(raw, weights, block_len):
        return torch_block_compress(raw, weights, block_len=block_len, block_stride=block_stride, first=first)
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    return BlockCompressFunction.apply(
        block_len, block_stride, first, raw, *(w.contiguous() for w in weights)
    )


def triton_block_compress_pair(
    raws: tuple[torch.Tensor, torch.Tensor],
    weights: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
    *,
    block_len: int,
    block_stride: int,
    first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`triton_block_compress` of two raw tensors, each with its own weights (the keys' phi and the
    values'), in the launches of one: one autograd function, four or five kernels forward and backward
    for both where two calls issue twice as many. The same results as the two calls; where the two do not
    share a shape, dtype and layout, or the kernels do not apply to one of them, it makes the two calls."""
    _check_geometry(block_len, block_stride, first)
    (raw, raw2), (w, w2) = raws, weights
    N = num_compressed_blocks(raw.shape[1] - first * block_stride, block_len, block_stride)
    if (
        N < 1
        or (raw.shape, raw.dtype, raw.device) != (raw2.shape, raw2.dtype, raw2.device)
        or raw.stride() != raw2.stride()
        or raw.stride(-1) != 1
        or not runs_in_triton(raw, w, block_len)
        or not runs_in_triton(raw2, w2, block_len)
    ):
        geometry = dict(block_len=block_len, block_stride=block_stride, first=first)
        return triton_block_compress(raw, w, **geometry), triton_block_compress(raw2, w2, **geometry)
    return BlockCompressFunction.apply(
        block_len, block_stride, first, raw, raw2, *(x.contiguous() for x in (*w, *w2))
    )


def _check_geometry(block_len: int, block_stride: int, first: int) -> None:
    if block_len < 1 or block_stride < 1 or first < 0:
        raise ValueError(f"block_len={block_len}, block_stride={block_stride} and first={first} are invalid")
