"""Banded flash attention in Triton: the kernels behind the sliding-window and compressed branches.

Key ``j`` ends at position ``e_j = j * key_stride + key_offset``; the query at ``t`` reads it iff
``e_j <= t`` and, with a window ``w``, ``e_j > t - w``. Raw keys under a sliding window are
``key_stride = 1, key_offset = 0``; compressed block ``j`` of length ``l`` and stride ``d`` is
``key_stride = d, key_offset = l - 1`` without a window. Both branches share these kernels; their modules
(`nsa_core.ops.triton.window`, `nsa_core.ops.triton.compression`) hold the autograd functions and checks.

Layout: ``q [B, Tq, HQ, D]``, ``k/v [B, Nk, HKV, D]`` (last dim contiguous), query head ``h`` reads KV head
``h // G``. The forward stores the row log-sum-exp in base 2 (``lse [B, HQ, Tq]``, 0 for a row that sees
no key, whose output is 0). The backward is FlashAttention-2's: ``delta = rowsum(o * do)``, one program per
(key tile, KV head) accumulating dK/dV over the ``G`` query heads of its group (no atomics, deterministic),
and one program per (query tile, query head) for dQ. Work and memory are O(T * keys a query reads).
Each kernel's tile loop runs the tiles that every query of its tile reads whole without the visibility
mask, and only the band's two edges with it (`_full_key_tiles`, `_full_query_tiles`); dK/dV works on
``s^T = k q^T`` so that ``p^T`` and ``ds^T`` feed its products without transposing a register tile.
Row offsets are cast to int64 before they meet a stride, so 256k tokens x 64 heads x 128 dims address.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from nsa_core.ops.triton.launch import Launcher


@triton.jit
def _key_range(
    t0,
    t1,
    Nk,
    WINDOW,
    KEY_STRIDE: tl.constexpr,
    KEY_OFFSET: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # keys some query in positions t0..t1 reads: [lo, hi), lo aligned down to a tile
    hi = tl.where(t1 >= KEY_OFFSET, (t1 - KEY_OFFSET) // KEY_STRIDE + 1, 0)
    hi = tl.minimum(hi, Nk)
    lo = hi * 0
    if HAS_WINDOW:
        first = tl.maximum(t0 - WINDOW - KEY_OFFSET + 1, 0)
        lo = (first + KEY_STRIDE - 1) // KEY_STRIDE
        lo = lo // BLOCK_N * BLOCK_N
    return lo, hi


@triton.jit
def _full_key_tiles(
    lo,
    hi,
    t0,
    t1,
    Nk,
    WINDOW,
    KEY_STRIDE: tl.constexpr,
    KEY_OFFSET: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # key tiles lo + i * BLOCK_N, i in [a, b), that every query of t0..t1 reads whole: no mask needed there
    n_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
    # keys every query reads (end <= t0), never past Nk
    below = tl.minimum(tl.where(t0 >= KEY_OFFSET, (t0 - KEY_OFFSET) // KEY_STRIDE + 1, 0), Nk)
    b = tl.maximum(below - lo, 0) // BLOCK_N
    a = b * 0
    if HAS_WINDOW:  # and the last query still reads the tile's first key: start * stride + offset > t1 - w
        x = t1 - WINDOW - KEY_OFFSET
        first = tl.where(x >= 0, x // KEY_STRIDE + 1, 0)
        a = (tl.maximum(first - lo, 0) + BLOCK_N - 1) // BLOCK_N
    b = tl.minimum(tl.maximum(a, b), n_tiles)
    a = tl.minimum(a, b)
    return a, b, n_tiles


@triton.jit
def _full_query_tiles(
    lo,
    hi,
    first_end,
    last_end,
    q_offset,
    WINDOW,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # query tiles lo + i * BLOCK_M, i in [a, b), whose every query reads every key of the tile whose keys
    # end at first_end..last_end (rows past Tq add nothing: their q and do load as 0)
    n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    a = (tl.maximum(last_end - q_offset - lo, 0) + BLOCK_M - 1) // BLOCK_M
    b = n_tiles
    if HAS_WINDOW:  # the tile's last query t1 still reads the first key: first_end > t1 - w
        y = first_end + WINDOW - q_offset - lo - BLOCK_M + 1
        b = (tl.maximum(y, 0) + BLOCK_M - 1) // BLOCK_M
    b = tl.minimum(tl.maximum(a, b), n_tiles)
    a = tl.minimum(a, b)
    return a, b, n_tiles


@triton.jit
def _visible(
    t, offs_n, Nk, WINDOW, KEY_STRIDE: tl.constexpr, KEY_OFFSET: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    # [BM, BN]: query t reads key j
    end = offs_n * KEY_STRIDE + KEY_OFFSET
    vis = (end[None, :] <= t[:, None]) & (offs_n[None, :] < Nk)
    if HAS_WINDOW:
        vis = vis & (end[None, :] > t[:, None] - WINDOW)
    return vis


@triton.jit
def _fwd_tile(
    q_tile,
    k_base,
    v_base,
    stride_kt,
    start,
    t,
    offs_d,
    mask_d,
    m_i,
    l_i,
    acc,
    Nk,
    WINDOW,
    scale_log2,
    KEY_STRIDE: tl.constexpr,
    KEY_OFFSET: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    COMPUTE_O: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # one key tile of the online softmax; MASKED=False where every query of the tile reads every key
    offs_n = start + tl.arange(0, BLOCK_N)
    row_k = offs_n.to(tl.int64) * stride_kt
    mask_n = offs_n < Nk
    k_t = tl.load(
        k_base + row_k[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0
    )  # [BD, BN]
    s = tl.dot(q_tile, k_t, input_precision=PRECISION, out_dtype=ACC) * scale_log2  # [BM, BN]
    if MASKED:
        vis = _visible(t, offs_n, Nk, WINDOW, KEY_STRIDE, KEY_OFFSET, HAS_WINDOW)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key here yet stays empty
    else:
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if COMPUTE_O:
        v_tile = tl.load(
            v_base + row_k[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0
        )  # [BN, BD]
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v_tile.dtype), v_tile, input_precision=PRECISION, out_dtype=ACC
        )
    return m_new, l_i, acc


@Launcher
@triton.jit(do_not_specialize=["HQ", "G", "Tq", "Nk", "q_offset", "WINDOW"])
def _fwd_kernel(
    q,
    k,
    v,
    o,
    lse,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_ob,
    stride_ot,
    stride_oh,
    HQ,
    G,
    Tq,
    Nk,
    D,
    q_offset,
    WINDOW,
    scale_log2,
    KEY_STRIDE: tl.constexpr,
    KEY_OFFSET: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    COMPUTE_O: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b, h = pid_bh // HQ, pid_bh % HQ
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m, mask_d = offs_m < Tq, offs_d < D
    row_q = offs_m.to(tl.int64)[:, None] * stride_qt
    q_tile = tl.load(
        q + b * stride_qb + h * stride_qh + row_q + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BM, BD]
    t = q_offset + offs_m
    t0 = q_offset + pid_m * BLOCK_M
    t1 = tl.minimum(t0 + BLOCK_M, q_offset + Tq) - 1
    lo, hi = _key_range(t0, t1, Nk, WINDOW, KEY_STRIDE, KEY_OFFSET, HAS_WINDOW, BLOCK_N)
    k_base = k + b * stride_kb + hk * stride_kh
    v_base = v + b * stride_kb + hk * stride_kh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    a, b_full, n_tiles = _full_key_tiles(
        lo, hi, t0, t1, Nk, WINDOW, KEY_STRIDE, KEY_OFFSET, HAS_WINDOW, BLOCK_N
    )
    for i in range(a, b_full):  # keys every query of the tile reads: no mask
        m_i, l_i, acc = _fwd_tile(
            q_tile, k_base, v_base, stride_kt, lo + i * BLOCK_N, t, offs_d, mask_d, m_i, l_i, acc,
            Nk, WINDOW, scale_log2, KEY_STRIDE, KEY_OFFSET, HAS_WINDOW, COMPUTE_O, False,
            BLOCK_N, ACC, PRECISION,
        )  # fmt: skip
    for j in range(0, a + n_tiles - b_full):  # the window and causal edges: masked
        i = tl.where(j < a, j, j - a + b_full)
        m_i, l_i, acc = _fwd_tile(
            q_tile, k_base, v_base, stride_kt, lo + i * BLOCK_N, t, offs_d, mask_d, m_i, l_i, acc,
            Nk, WINDOW, scale_log2, KEY_STRIDE, KEY_OFFSET, HAS_WINDOW, COMPUTE_O, True,
            BLOCK_N, ACC, PRECISION,
        )  # fmt: skip
    empty = l_i == 0.0
    if COMPUTE_O:
        acc = acc / tl.where(empty, 1.0, l_i)[:, None]
        row_o = offs_m.to(tl.int64)[:, None] * stride_ot
        tl.store(
            o + b * stride_ob + h * stride_oh + row_o + offs_d[None, :],
            acc.to(o.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )
    row_lse = tl.where(empty, 0.0, m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(lse + pid_bh * Tq + offs_m, row_lse.to(lse.dtype.element_ty), mask=mask_m)


@Launcher
@triton.jit(do_not_specialize=["HQ", "Tq"])
def _delta_kernel(
    o,
    do,
    delta,
    stride_ob,
    stride_ot,
    stride_oh,
    HQ,
    Tq,
    D,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
):
    # delta [B, HQ, Tq] = rowsum(o * do); o and do share strides
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b, h = pid_bh // HQ, pid_bh % HQ
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < Tq)[:, None] & (offs_d < D)[None, :]
    ptr = b * stride_ob + h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_ot + offs_d[None, :]
    o_tile = tl.load(o + ptr, mask=mask, other=0.0).to(ACC)
    do_tile = tl.load(do + ptr, mask=mask, other=0.0).to(ACC)
    tl.store(
        delta + pid_bh * Tq + offs_m, tl.sum(o_tile * do_tile, 1).to(delta.dtype.element_ty), mask=offs_m < Tq
    )


@triton.jit
def _dkdv_tile(
    q_base,
    do_base,
    lse_row,
    delta_row,
    stride_qt,
    start,
    k_tile,
    v_tile,
    dk_acc,
    dv_acc,
    offs_n,
    offs_d,
    mask_d,
    Tq,
    Nk,
    q_offset,
    WINDOW,
    scale_log2,
    KEY_STRIDE: tl.constexpr,
    KEY_OFFSET: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # one query tile's share of a key tile's dK/dV; MASKED=False where every query reads every key.
    # Computed transposed (keys as rows: s^T = k q^T) so that p^T and ds^T feed the next products as
    # they are: transposing a register tile would go through shared memory every step
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < Tq
    row_q = offs_m.to(tl.int64)[:, None] * stride_qt + offs_d[None, :]
    q_mask = mask_m[:, None] & mask_d[None, :]
    q_tile = tl.load(q_base + row_q, mask=q_mask, other=0.0)  # [BM, BD]
    do_tile = tl.load(do_base + row_q, mask=q_mask, other=0.0)
    row_lse = tl.load(lse_row + offs_m, mask=mask_m, other=0.0)
    row_delta = tl.load(delta_row + offs_m, mask=mask_m, other=0.0)
    s_t = tl.dot(k_tile, tl.trans(q_tile), input_precision=PRECISION, out_dtype=ACC) * scale_log2  # [BN, BM]
    p_t = tl.exp2(s_t - row_lse[None, :])  # rows past Tq: do = 0 adds nothing
    if MASKED:
        end = offs_n * KEY_STRIDE + KEY_OFFSET
        t = q_offset + offs_m
        vis = (end[:, None] <= t[None, :]) & (offs_n[:, None] < Nk) & mask_m[None, :]
        if HAS_WINDOW:
            vis = vis & (end[:, None] > t[None, :] - WINDOW)
        p_t = tl.where(vis, p_t, 0.0)
    dv_acc += tl.dot(p_t.to(do_tile.dtype), do_tile, input_precision=PRECISION, out_dtype=ACC)
    dp_t = tl.dot(v_tile, tl.trans(do_tile), input_precision=PRECISION, out_dtype=ACC)  # [BN, BM]
    ds_t = p_t * (dp_t - row_delta[None, :])
    dk_acc += tl.dot(ds_t.to(q_tile.dtype), q_tile, input_precision=PRECISION, out_dtype=ACC)
    return dk_acc, dv_acc


@Launcher
@triton.jit(
    do_not_specialize=["HQ", "HKV", "G", "G_PER", "H_SPLITS", "CHUNK", "Tq", "Nk", "q_offset", "WINDOW"]
)
def _bwd_dkdv_kernel(
    q,
    k,
    v,
    do,
    lse,
    delta,
    dk,
    dv,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_ds,
    stride_db,
    stride_dt,
    stride_dh,
    HQ,
    HKV,
    G,
    G_PER,
    H_SPLITS,
    CHUNK,
    Tq,
    Nk,
    D,
    q_offset,
    WINDOW,
    scale,
    scale_log2,
    KEY_STRIDE: tl.constexpr,
    KEY_OFFSET: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # one program per (key tile, KV head, split): dK/dV summed over G_PER query heads of the group and the
    # key tile's query tiles [c0, c0 + CHUNK) (split = chunk * H_SPLITS + head split); with several splits
    # each writes its partial sums to its own slice of dk/dv (summed by the launcher)
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    h_split = split % H_SPLITS
    b, hk = pid_bk // HKV, pid_bk % HKV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n, mask_d = offs_n < Nk, offs_d < D
    kv_ptr = b * stride_kb + hk * stride_kh + offs_n.to(tl.int64)[:, None] * stride_kt + offs_d[None, :]
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k_tile = tl.load(k + kv_ptr, mask=kv_mask, other=0.0)  # [BN, BD]
    v_tile = tl.load(v + kv_ptr, mask=kv_mask, other=0.0)
    # queries that read a key of this tile: rows [lo, hi)
    first_end = pid_n * BLOCK_N * KEY_STRIDE + KEY_OFFSET
    last_end = (tl.minimum(pid_n * BLOCK_N + BLOCK_N, Nk) - 1) * KEY_STRIDE + KEY_OFFSET
    lo = tl.maximum(first_end - q_offset, 0) // BLOCK_M * BLOCK_M
    hi = Tq
    if HAS_WINDOW:
        hi = tl.minimum(Tq, last_end + WINDOW - q_offset)
    a, b_full, n_tiles = _full_query_tiles(lo, hi, first_end, last_end, q_offset, WINDOW, HAS_WINDOW, BLOCK_M)
    # this program's query tiles [c0, c1): the unmasked ones [a, b_full) within them, and the edges before
    # and after, masked: c0 + j for j < before, then after_start + j - before (past n_tiles: none)
    c0 = split // H_SPLITS * CHUNK
    c1 = tl.minimum(c0 + CHUNK, n_tiles)
    a, b_full = tl.maximum(a, c0), tl.minimum(b_full, c1)
    before = tl.maximum(tl.minimum(a, c1) - c0, 0)
    after_start = tl.maximum(b_full, a)
    n_masked = before + tl.maximum(c1 - after_start, 0)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    for g in range(h_split * G_PER, h_split * G_PER + G_PER):
        h = hk * G + g
        q_base = q + b * stride_qb + h * stride_qh
        do_base = do + b * stride_qb + h * stride_qh
        lse_row, delta_row = lse + (b * HQ + h) * Tq, delta + (b * HQ + h) * Tq
        for i in range(a, b_full):  # queries that read every key of the tile: no mask
            dk_acc, dv_acc = _dkdv_tile(
                q_base, do_base, lse_row, delta_row, stride_qt, lo + i * BLOCK_M, k_tile, v_tile,
                dk_acc, dv_acc, offs_n, offs_d, mask_d, Tq, Nk, q_offset, WINDOW, scale_log2,
                KEY_STRIDE, KEY_OFFSET, HAS_WINDOW, False, BLOCK_M, ACC, PRECISION,
            )  # fmt: skip
        for j in range(0, n_masked):  # the causal and window edges: masked
            i = tl.where(j < before, c0 + j, after_start + j - before)
            dk_acc, dv_acc = _dkdv_tile(
                q_base, do_base, lse_row, delta_row, stride_qt, lo + i * BLOCK_M, k_tile, v_tile,
                dk_acc, dv_acc, offs_n, offs_d, mask_d, Tq, Nk, q_offset, WINDOW, scale_log2,
                KEY_STRIDE, KEY_OFFSET, HAS_WINDOW, True, BLOCK_M, ACC, PRECISION,
            )  # fmt: skip
    d_ptr = split.to(tl.int64) * stride_ds + b * stride_db + hk * stride_dh
    d_ptr += offs_n.to(tl.int64)[:, None] * stride_dt + offs_d[None, :]
    tl.store(dk + d_ptr, (dk_acc * scale).to(dk.dtype.element_ty), mask=kv_mask)
    tl.store(dv + d_ptr, dv_acc.to(dv.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_tile(
    q_tile,
    do_tile,
    row_lse,
    row_delta,
    k_base,
    v_base,
    stride_kt,
    start,
    t,
    mask_m,
    offs_d,
    mask_d,
    dq_acc,
    Nk,
    WINDOW,
    scale_log2,
    KEY_STRIDE: tl.constexpr,
    KEY_OFFSET: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # one key tile's share of a query tile's dQ; MASKED=False where every query reads every key
    offs_n = start + tl.arange(0, BLOCK_N)
    row_k = offs_n.to(tl.int64)[:, None] * stride_kt + offs_d[None, :]
    kv_mask = (offs_n < Nk)[:, None] & mask_d[None, :]
    k_tile = tl.load(k_base + row_k, mask=kv_mask, other=0.0)  # [BN, BD]
    v_tile = tl.load(v_base + row_k, mask=kv_mask, other=0.0)
    s = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION, out_dtype=ACC) * scale_log2
    p = tl.exp2(s - row_lse[:, None])
    if MASKED:
        vis = _visible(t, offs_n, Nk, WINDOW, KEY_STRIDE, KEY_OFFSET, HAS_WINDOW) & mask_m[:, None]
        p = tl.where(vis, p, 0.0)
    dp = tl.dot(do_tile, tl.trans(v_tile), input_precision=PRECISION, out_dtype=ACC)
    ds = p * (dp - row_delta[:, None])
    return dq_acc + tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=PRECISION, out_dtype=ACC)


@Launcher
@triton.jit(do_not_specialize=["HQ", "G", "Tq", "Nk", "q_offset", "WINDOW"])
def _bwd_dq_kernel(
    q,
    k,
    v,
    do,
    lse,
    delta,
    dq,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    HQ,
    G,
    Tq,
    Nk,
    D,
    q_offset,
    WINDOW,
    scale,
    scale_log2,
    KEY_STRIDE: tl.constexpr,
    KEY_OFFSET: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # one program per (query tile, query head); ACCUMULATE adds to the dq already there (the fused op's
    # three branches share one dq tensor)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b, h = pid_bh // HQ, pid_bh % HQ
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m, mask_d = offs_m < Tq, offs_d < D
    q_ptr = b * stride_qb + h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qt + offs_d[None, :]
    q_mask = mask_m[:, None] & mask_d[None, :]
    q_tile = tl.load(q + q_ptr, mask=q_mask, other=0.0)
    do_tile = tl.load(do + q_ptr, mask=q_mask, other=0.0)
    row_lse = tl.load(lse + pid_bh * Tq + offs_m, mask=mask_m, other=0.0)
    row_delta = tl.load(delta + pid_bh * Tq + offs_m, mask=mask_m, other=0.0)
    t = q_offset + offs_m
    t0 = q_offset + pid_m * BLOCK_M
    t1 = tl.minimum(t0 + BLOCK_M, q_offset + Tq) - 1
    lo, hi = _key_range(t0, t1, Nk, WINDOW, KEY_STRIDE, KEY_OFFSET, HAS_WINDOW, BLOCK_N)
    k_base = k + b * stride_kb + hk * stride_kh
    v_base = v + b * stride_kb + hk * stride_kh
    a, b_full, n_tiles = _full_key_tiles(
        lo, hi, t0, t1, Nk, WINDOW, KEY_STRIDE, KEY_OFFSET, HAS_WINDOW, BLOCK_N
    )
    dq_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    for i in range(a, b_full):  # keys every query of the tile reads: no mask
        dq_acc = _dq_tile(
            q_tile, do_tile, row_lse, row_delta, k_base, v_base, stride_kt, lo + i * BLOCK_N, t, mask_m,
            offs_d, mask_d, dq_acc, Nk, WINDOW, scale_log2, KEY_STRIDE, KEY_OFFSET, HAS_WINDOW, False,
            BLOCK_N, ACC, PRECISION,
        )  # fmt: skip
    for j in range(0, a + n_tiles - b_full):  # the window and causal edges: masked
        i = tl.where(j < a, j, j - a + b_full)
        dq_acc = _dq_tile(
            q_tile, do_tile, row_lse, row_delta, k_base, v_base, stride_kt, lo + i * BLOCK_N, t, mask_m,
            offs_d, mask_d, dq_acc, Nk, WINDOW, scale_log2, KEY_STRIDE, KEY_OFFSET, HAS_WINDOW, True,
            BLOCK_N, ACC, PRECISION,
        )  # fmt: skip
    dq_acc = dq_acc * scale
    if ACCUMULATE:
        dq_acc += tl.load(dq + q_ptr, mask=q_mask, other=0.0).to(ACC)
    tl.store(dq + q_ptr, dq_acc.to(dq.dtype.element_ty), mask=q_mask)


@Launcher
@triton.jit(do_not_specialize=["n", "splits"])
def _dkdv_sum_kernel(dk_part, dv_part, dk, dv, n, splits, ADD: tl.constexpr, BLOCK: tl.constexpr):
    # one program per BLOCK elements of dK and of dV: the splits' partial sums added in split order (the
    # same sum whatever the order the programs run in), plus what dk/dv hold where ADD, cast on the store
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc_k = tl.zeros([BLOCK], dtype=dk_part.dtype.element_ty)
    acc_v = tl.zeros([BLOCK], dtype=dv_part.dtype.element_ty)
    for s in range(splits):
        acc_k += tl.load(dk_part + s * n + offs, mask=mask, other=0.0)
        acc_v += tl.load(dv_part + s * n + offs, mask=mask, other=0.0)
    if ADD:
        acc_k += tl.load(dk + offs, mask=mask, other=0.0).to(acc_k.dtype)
        acc_v += tl.load(dv + offs, mask=mask, other=0.0).to(acc_v.dtype)
    tl.store(dk + offs, acc_k.to(dk.dtype.element_ty), mask=mask)
    tl.store(dv + offs, acc_v.to(dv.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------- launchers

LOG2_E = 1.0 / math.log(2.0)


# Host arithmetic of the launchers. Since Triton 3.6, `triton.cdiv` and `triton.next_power_of_2` are
# constexpr functions, a few microseconds a call on the host; a step launches ~250 kernels through these.
def cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    return 0 if n == 0 else 1 << (n - 1).bit_length()  # as triton.next_power_of_2 (0 for 0)


def kernel_dtypes(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """Accumulator type and dot precision: fp32 for half inputs, exact products for fp32/fp64 (tests)."""
    if dtype == torch.float64:
        return tl.float64, "ieee"
    if dtype == torch.float32:
        return tl.float32, "ieee"
    return tl.float32, "tf32"


def launch_options(dtype: torch.dtype, block_d: int) -> dict[str, int]:
    """Warps and pipeline stages: two stages for 4-byte inputs or wide heads keep shared memory in budget."""
    stages = 2 if torch.finfo(dtype).bits >= 32 or block_d > 128 else 3
    return dict(num_warps=4, num_stages=stages)


# Per-kernel overrides of `kernel_config` ("fwd", "dkdv", "dq" -> BLOCK_M, BLOCK_N, num_warps, num_stages);
# empty: the defaults below. benchmarks/tune_triton.py sets them to time other tile shapes.
LAUNCH: dict[str, dict[str, int]] = {}


def kernel_config(
    kind: str, dtype: torch.dtype, head_dim: int, windowed: bool = False, compressed: bool = False
) -> dict[str, int]:
    """Tiles and launch options of one banded kernel: ``BLOCK_M`` (query tile), ``BLOCK_N`` (key tile),
    ``num_warps``, ``num_stages``; `LAUNCH` overrides them per kernel.

    In bf16/fp16 (head dim up to 128): the sliding window's dK/dV walks 32-row query tiles: a key tile's
    band then wastes less at its two edges (0.82x the 64-row time at 8k and 64k, G=16, and at 16k, G=6;
    H100, benchmarks/tune_triton.py). Over the compressed keys (one key per ``d`` queries) dK/dV walks
    32-row query tiles too and dq reads 32-key tiles (H200, each alone, the compressed backward's time:
    dK/dV 0.85x at 8k and 0.87x at 64k, G=16, 0.70-0.92x at 8 x 2k and 1.07x at 16k, G=6; dq 0.87x,
    0.97x, 0.62-0.88x and 0.98x; BENCHMARKS.md)."""
    block_m, block_n, block_d = block_sizes(head_dim)
    config = dict(BLOCK_M=block_m, BLOCK_N=block_n, **launch_options(dtype, block_d))
    if torch.finfo(dtype).bits == 16 and block_d <= 128:
        if kind == "dkdv" and (windowed or compressed):
            config["BLOCK_M"] = 32
        if kind == "dq" and compressed:
            config["BLOCK_N"] = 32
    return {**config, **LAUNCH.get(kind, {})}


def block_sizes(head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_D)``: 64 x 64 tiles up to head dim 128, 32 x 32 beyond."""
    block_d = max(16, next_power_of_2(head_dim))
    tile = 64 if block_d <= 128 else 32
    return tile, tile, block_d


# query tiles a dK/dV chunk holds at least (`dkdv_splits`): fewer is more partial sums for little work
DKDV_MIN_CHUNK = 8
SUM_BLOCK = 1024  # elements of dK and of dV a program of `_dkdv_sum_kernel` adds
SPLIT_WORKSPACE_BYTES = 256 << 20  # float32 partial dK + dV of the splits (heads, query chunks), at most


def program_target(device: torch.device) -> int:
    """Programs that fill the device: 4 per SM on CUDA (a small number in the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return _program_target(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _program_target(index: int) -> int:
    return 4 * torch.cuda.get_device_properties(index).multi_processor_count


def head_splits(programs: int, G: int, kv_elements: int, target: int, workspace: int | None = None) -> int:
    """Into how many parts the dK/dV programs split the G query heads of a group: the smallest divisor of G
    that gives ``target`` programs, as far as the float32 partial sums fit ``workspace`` bytes (default
    `SPLIT_WORKSPACE_BYTES`).

    Few key tiles (the compressed keys are T/d; short windows of short sequences) would otherwise leave
    most of the GPU idle while each program walks every query of every head of its group.
    """
    workspace = SPLIT_WORKSPACE_BYTES if workspace is None else workspace
    best = 1
    for splits in range(2, G + 1):
        if G % splits or splits * kv_elements * 8 > workspace:
            continue
        if programs * best >= target:
            break
        best = splits
    return best


def dkdv_splits(*args: int) -> tuple[int, int, int]:
    """`_dkdv_splits` (its arguments from ``Tq`` on) under the current `SPLIT_WORKSPACE_BYTES`: the splits
    are cached per shape and per cap, so a cap set after a shape's first call applies."""
    return _dkdv_splits(SPLIT_WORKSPACE_BYTES, *args)


@functools.lru_cache(maxsize=256)  # a shape's splits, once: its loop runs over the key tiles
def _dkdv_splits(
    workspace: int,
    Tq: int,
    Nk: int,
    groups: int,
    G: int,
    D: int,
    q_offset: int,
    key_stride: int,
    key_offset: int,
    window: int,
    block_m: int,
    block_n: int,
    target: int,
    min_chunk: int = 1,
) -> tuple[int, int, int]:
    """``(head splits, query tiles per chunk, splits)`` of the dK/dV programs (``splits`` = head splits x
    chunks; one program per key tile, (batch, KV head) and split; ``groups`` = B x HKV).

    First the G query heads of a group are split (`head_splits`); then, where a key tile's query tiles are
    many more than the work each program would get with ``target`` programs, they are dealt out in chunks:
    over the compressed keys the first key tile reads every query (m7c-125m at 16k: 512 query tiles a head,
    the last tile 32), so one program walked a whole head's queries while most of the GPU had finished.
    A chunk holds at least ``min_chunk`` query tiles; the float32 partial sums of all splits stay within
    ``workspace`` bytes.
    """
    key_tiles = cdiv(Nk, block_n)
    kv_elements = groups * Nk * D
    if kv_elements == 0:  # no keys (no compressed block yet): nothing to split
        return 1, 1, 1
    h_splits = head_splits(key_tiles * groups, G, kv_elements, target, workspace)

    tiles = []  # each key tile's query tiles, as the kernel's lo and hi give them
    for tile in range(key_tiles):
        first_end = tile * block_n * key_stride + key_offset
        last_end = (min(tile * block_n + block_n, Nk) - 1) * key_stride + key_offset
        lo = max(first_end - q_offset, 0) // block_m * block_m
        hi = min(Tq, last_end + window - q_offset) if window else Tq
        tiles.append(max(cdiv(hi - lo, block_m), 0))
    longest = max(tiles, default=0)
    chunk = max(cdiv(sum(tiles) * groups * h_splits, target), min_chunk)  # a program's tiles, dealt evenly
    most = max(workspace // (kv_elements * 8) // h_splits, 1)
    chunks = min(cdiv(longest, chunk), most)
    if chunks <= 1:
        return h_splits, max(longest, 1), h_splits
    return h_splits, cdiv(longest, chunks), h_splits * chunks


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same strides where they matter: a dimension of size 1 is only ever indexed
    at 0, so its stride is free (``.contiguous()`` leaves such strides as they were, e.g. in decode)."""
    return a.shape == b.shape and all(
        n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True)
    )


def banded_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_stride: int,
    key_offset: int,
    window: int | None,
    q_offset: int,
    scale: float,
    compute_o: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``o [B, Tq, HQ, D]`` (empty unless ``compute_o``) and ``lse [B, HQ, Tq]`` (base 2).

    ``lse`` is float32 (float64 for float64 inputs).
    """
    B, Tq, HQ, D = q.shape
    Nk, HKV = k.shape[1], k.shape[2]
    assert q.stride(-1) == 1
    assert k.stride(-1) == 1
    assert same_layout(k, v)  # the kernels index v with k's strides
    block_d = block_sizes(D)[2]
    config = kernel_config("fwd", q.dtype, D)
    acc, precision = kernel_dtypes(q.dtype)
    o = torch.empty_like(q) if compute_o else q.new_empty(0)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.empty(B, HQ, Tq, dtype=lse_dtype, device=q.device)
    o_strides = o.stride()[:3] if compute_o else (0, 0, 0)
    grid = (cdiv(Tq, config["BLOCK_M"]), B * HQ)
    _fwd_kernel[grid](
        q, k, v, o, lse,
        *q.stride()[:3], *k.stride()[:3], *o_strides,
        HQ, HQ // HKV, Tq, Nk, D, q_offset, window or 0, scale * LOG2_E,
        KEY_STRIDE=key_stride, KEY_OFFSET=key_offset, HAS_WINDOW=window is not None, COMPUTE_O=compute_o,
        BLOCK_D=block_d, ACC=acc, PRECISION=precision, **config,
    )  # fmt: skip
    return o, lse


def banded_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    key_stride: int,
    key_offset: int,
    window: int | None,
    q_offset: int,
    scale: float,
    delta: torch.Tensor | None = None,
    dq: torch.Tensor | None = None,
    dkdv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of `banded_forward`'s output for the output gradient ``do``.

    The fused op (`nsa_core.ops.triton.nsa`) passes ``delta [B, HQ, Tq]`` (then ``o`` is not read), a ``dq``
    to add this branch's gradient into (returned as ``dq``), and, where another branch read the same keys
    and values, their gradients ``dkdv`` (contiguous, ``k``'s shape) to add this branch's into (returned
    as ``dk, dv``: one tensor each where autograd would have added two).
    """
    B, Tq, HQ, D = q.shape
    Nk, HKV = k.shape[1], k.shape[2]
    do = do.contiguous()
    assert same_layout(do, q)  # one set of strides indexes do, o, q and dq
    assert delta is not None or same_layout(o, q)
    assert dq is None or same_layout(dq, q)
    block_d = block_sizes(D)[2]
    compressed = key_stride > 1
    dkdv_config = kernel_config("dkdv", q.dtype, D, windowed=window is not None, compressed=compressed)
    dq_config = kernel_config("dq", q.dtype, D, compressed=compressed)
    acc, precision = kernel_dtypes(q.dtype)
    if delta is None:
        delta = torch.empty_like(lse)
        _delta_kernel[(cdiv(Tq, 64), B * HQ)](
            o, do, delta, *o.stride()[:3], HQ, Tq, D, BLOCK_M=64, BLOCK_D=block_d, ACC=acc
        )
    accumulate = dq is not None
    if dq is None:
        dq = torch.empty_like(q)
    G = HQ // HKV
    key_tiles = cdiv(Nk, dkdv_config["BLOCK_N"])
    h_splits, chunk, splits = dkdv_splits(
        Tq, Nk, B * HKV, G, D, q_offset, key_stride, key_offset, window or 0,
        dkdv_config["BLOCK_M"], dkdv_config["BLOCK_N"], program_target(q.device), DKDV_MIN_CHUNK,
    )  # fmt: skip
    if dkdv is not None:
        assert all(x.shape == k.shape and x.is_contiguous() for x in dkdv)
    if splits == 1:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dk_out, dv_out = dk, dv
        d_strides = (0, *dk.stride()[:3])
    else:  # partial sums per split, in float32, then one sum (into dkdv where given)
        part_dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
        dk_out = torch.empty(splits, B, Nk, HKV, D, dtype=part_dtype, device=k.device)
        dv_out = torch.empty_like(dk_out)
        d_strides = dk_out.stride()[:4]
    common = dict(
        KEY_STRIDE=key_stride, KEY_OFFSET=key_offset, HAS_WINDOW=window is not None,
        BLOCK_D=block_d, ACC=acc, PRECISION=precision,
    )  # fmt: skip
    _bwd_dkdv_kernel[(key_tiles, B * HKV, splits)](
        q, k, v, do, lse, delta, dk_out, dv_out, *q.stride()[:3], *k.stride()[:3], *d_strides,
        HQ, HKV, G, G // h_splits, h_splits, chunk, Tq, Nk, D, q_offset, window or 0, scale, scale * LOG2_E,
        **common, **dkdv_config,
    )  # fmt: skip
    if splits > 1:
        if dkdv is None:
            dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)
        else:
            dk, dv = dkdv
        n = dk.numel()
        _dkdv_sum_kernel[(cdiv(n, SUM_BLOCK),)](
            dk_out, dv_out, dk, dv, n, splits, ADD=dkdv is not None, BLOCK=SUM_BLOCK
        )
    elif dkdv is not None:
        dk, dv = dkdv[0].add_(dk), dkdv[1].add_(dv)
    _bwd_dq_kernel[(cdiv(Tq, dq_config["BLOCK_M"]), B * HQ)](
        q, k, v, do, lse, delta, dq, *q.stride()[:3], *k.stride()[:3],
        HQ, HQ // HKV, Tq, Nk, D, q_offset, window or 0, scale, scale * LOG2_E, ACCUMULATE=accumulate,
        **common, **dq_config,
    )  # fmt: skip
    return dq, dk, dv
