"""Triton selected attention: each query reads the ``n`` blocks of ``l'`` keys its KV group chose.

Forward: one program per (tile of ``M`` consecutive query tokens, batch x KV group) loads the tokens' ``G``
query heads of the group as one tile of ``M x G`` rows (``M = 16 // G``, at least 1: the 16 rows of the
smallest MMA, which a group of 6 heads alone fills to 6) and streams blocks with an online softmax (causal
per row). Neighbouring queries share most of their blocks where the model has learnt locality, and at
short lengths, where the blocks are few: a tile whose union of blocks (`tile_union`, one small kernel) is
below ``SHARE_PCT`` of its ``M x n`` slots streams each block of the union once for the rows that chose
it; otherwise each token's own blocks for its rows (the forward loads slot i of the tile's tokens side by
side as one key tile, ``PAIR_KEYS``). Where the keys are few against the ``n x l'`` a query
reads (``SCAN_SPAN``), tiles of ``SCAN_ROWS`` rows instead stream every key up to their last position,
each (row, key) pair masked by the row's blocks: nearly every block is some token's choice there, and each
key is loaded once for the whole tile; the longest tiles run first, and the key tiles before every row's
position are masked by the blocks alone (no causal mask). Past the scan's lengths, where its workspace
fits (``BLOCKS_BYTES``) and a KV group has at most ``BLOCKS_GROUP`` heads, the forward runs by selection
block instead: one program per (block, chunk of the queries that chose it, through the inverted index
below) loads the block's keys once and writes, per (query, slot), the softmax over that block alone and its
log-sum-exp; a second kernel merges each query's slots in slot order. It keeps the log-sum-exp per query head.

Backward, in two kernels and no atomics:
- ``dq`` (and ``delta = rowsum(o * dO)``) per tile as in the forward (union, own blocks or scan), streaming
  the same keys again; by selection block, dK/dV below writes each (query, slot)'s part of ``dq`` beside
  its own sums and one more kernel adds a query's parts in slot order;
- ``dK/dV`` per (selection block, batch x KV group): an inverted (CSR) index built on the device lists, for
  every block, the query tokens whose group chose it; the block's program walks that list in token order
  and writes its keys' gradients once. Blocks nobody chose get zeros. A block chosen by very many queries
  (block 0, which every query is forced to read) is split into chunks of queries whose fp32 partial sums go
  to a small workspace and are added in chunk order by a third kernel, so one hot block does not serialise
  the whole backward. Every sum runs in a fixed order: the gradients are deterministic.

Memory: the CSR index holds one entry per used slot (``B * Tq * HKV * n``), the same size as ``block_idx``;
nothing of size ``T x T/l'`` is built. Program ids and row indices are cast to int64 before they multiply
strides, so 256k-token sequences address correctly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nsa_core.ops.common import check_qkv, eager_under_compile
from nsa_core.ops.triton.flash import cdiv, next_power_of_2
from nsa_core.ops.triton.launch import Launcher

LOG2E = 1.4426950408889634

# dK/dV: a selection block's query list is split into chunks of at most this many entries once it is longer;
# the launcher raises it so that the fp32 workspace of the partial sums stays below WORKSPACE_BYTES. At 512
# the forced and popular blocks of short sequences (block 0: every query) no longer hold up the kernel's
# last wave: the m7c backward at 8 x 2048 0.77x the time at 2048, at 16384 0.91x (H200, BENCHMARKS.md).
MIN_CHUNK = 512
WORKSPACE_BYTES = 64 << 20


@triton.jit
def _tile_rows(i_m, Tq, q_offset, i_h, M: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr):
    # rows of a tile: M consecutive query tokens x the G heads of one KV group, token-major
    o_r = tl.arange(0, BLOCK_R)
    e_r = o_r // G
    tok = i_m * M + e_r  # query row 0 .. Tq-1
    m_r = (e_r < M) & (tok < Tq)
    return e_r, tok, m_r, i_h * G + o_r % G, q_offset + tok


@triton.jit
def _tile_blocks(IDX_bh, si_t, tok, m_r, N_SEL: tl.constexpr, BLOCK_N: tl.constexpr):
    # [R, N]: each row's own blocks (-1: an unused slot, or a padding row)
    o_n = tl.arange(0, BLOCK_N)
    return tl.load(
        IDX_bh + tok[:, None] * si_t + o_n[None, :], mask=m_r[:, None] & (o_n < N_SEL)[None, :], other=-1
    )


@triton.jit
def _key_tile(
    K_bh, V_bh, sk_t, sv_t, blk, s0, t_last, chose, t_r,
    D: tl.constexpr, L_SEL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PER_ROW: tl.constexpr,
):  # fmt: skip
    # keys s0.. of block `blk` (-1: nothing) and which (row, key) pairs are visible: the rows `chose`, keys up
    # to t_last (unused slots and keys after every row load nothing; pos <= t_last < Tk keeps loads in
    # bounds); PER_ROW: rows of several tokens, each up to its own position t_r
    o_s, o_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    pos = blk * L_SEL + s0 + o_s  # [S]
    m_s = (s0 + o_s < L_SEL) & (pos >= 0) & (pos <= t_last)
    m_sd = m_s[:, None] & (o_d < D)[None, :]
    b_k = tl.load(K_bh + pos[:, None] * sk_t + o_d[None, :], mask=m_sd, other=0.0)
    b_v = tl.load(V_bh + pos[:, None] * sv_t + o_d[None, :], mask=m_sd, other=0.0)
    visible = chose[:, None] & m_s[None, :]
    if PER_ROW:
        visible = visible & (pos[None, :] <= t_r[:, None])
    return b_k, b_v, visible


@triton.jit
def _paired_key_tile(
    K_bh, V_bh, IDX_bh, sk_t, sv_t, si_t, i_m, i_n, s0, Tq, q_offset, e_r,
    D: tl.constexpr, L_SEL: tl.constexpr, M: tl.constexpr, PAIR: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    # keys s0.. of slot i_n's block of each of the tile's M tokens side by side, PAIR x BLOCK_S keys (PAIR:
    # M up to a power of two): key lane k belongs to token k // BLOCK_S and is visible to that token's rows
    # alone, up to its position
    o_k, o_d = tl.arange(0, PAIR * BLOCK_S), tl.arange(0, BLOCK_D)
    e_k = o_k // BLOCK_S
    tok_k = i_m * M + e_k
    m_t = (e_k < M) & (tok_k < Tq)
    blk = tl.load(IDX_bh + tok_k * si_t + i_n, mask=m_t, other=-1).to(tl.int64)  # [K]
    pos = blk * L_SEL + s0 + o_k % BLOCK_S
    m_k = m_t & (s0 + o_k % BLOCK_S < L_SEL) & (pos >= 0) & (pos <= q_offset + tok_k)
    m_kd = m_k[:, None] & (o_d < D)[None, :]
    b_k = tl.load(K_bh + pos[:, None] * sk_t + o_d[None, :], mask=m_kd, other=0.0)
    b_v = tl.load(V_bh + pos[:, None] * sv_t + o_d[None, :], mask=m_kd, other=0.0)
    return b_k, b_v, (e_r[:, None] == e_k[None, :]) & m_k[None, :]


@triton.jit
def _scan_key_tile(
    K_bh, V_bh, sk_t, sv_t, b_idx, s0, t_last, t_r,
    D: tl.constexpr, L_SEL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    # the scan's keys s0.. (BLOCK_S divides l': a key tile lies in one block) and the (row, key) pairs kept:
    # the rows whose blocks `b_idx [R, N]` hold that block, each up to its own position (CAUSAL); without
    # CAUSAL every row's position is past the tile: whole keys, kept for the rows that chose the block
    blk = s0 // L_SEL
    chose = tl.max((b_idx == blk).to(tl.int32), 1) > 0  # [R]
    if CAUSAL:
        b_k, b_v, visible = _key_tile(
            K_bh,
            V_bh,
            sk_t,
            sv_t,
            blk,
            s0 - blk * L_SEL,
            t_last,
            chose,
            t_r,
            D,
            L_SEL,
            BLOCK_S,
            BLOCK_D,
            True,
        )
    else:
        o_s, o_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
        m_d = (o_d < D)[None, :]
        b_k = tl.load(K_bh + (s0 + o_s)[:, None] * sk_t + o_d[None, :], mask=m_d, other=0.0)
        b_v = tl.load(V_bh + (s0 + o_s)[:, None] * sv_t + o_d[None, :], mask=m_d, other=0.0)
        visible = chose[:, None]
    return b_k, b_v, visible


@triton.jit
def _scan_tile(i_m, Tt, q_offset, M: tl.constexpr, BLOCK_S: tl.constexpr):
    # the scan's tile for program i_m, the longest first (the causal tiles' work grows along the sequence:
    # the short ones fill the last wave), and the end of the key tiles every row of it reads whole
    i_m = Tt - 1 - i_m
    return i_m, (q_offset + i_m * M + 1) // BLOCK_S * BLOCK_S


@triton.jit
def _fwd_block(
    b_q, K_bh, V_bh, sk_t, sv_t, blk, chose, t_r, t_last, m_i, l_i, acc, qk_scale,
    D: tl.constexpr, L_SEL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, PER_ROW: tl.constexpr,
):  # fmt: skip
    # the online softmax of the rows `chose` over block `blk` (`_key_tile`)
    for s0 in range(0, L_SEL, BLOCK_S):
        b_k, b_v, visible = _key_tile(
            K_bh, V_bh, sk_t, sv_t, blk, s0, t_last, chose, t_r, D, L_SEL, BLOCK_S, BLOCK_D, PER_ROW
        )
        m_i, l_i, acc = _fwd_step(b_q, b_k, b_v, visible, m_i, l_i, acc, qk_scale, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _fwd_step(b_q, b_k, b_v, visible, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    # the online softmax over one key tile, (row, key) pairs outside `visible` left out
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale  # [R, S]
    b_s = tl.where(visible, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, 1))
    # a row that sees no key of this tile keeps its max at -inf: shift by 0 instead (no NaN)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    b_p = tl.exp2(b_s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
    return m_new, l_i, acc


@Launcher
@triton.jit(do_not_specialize=["Tq", "Tt", "q_offset"])
def _selected_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    IDX,
    UNION,
    COUNT,
    sq_b,
    sq_t,
    sq_h,
    sk_b,
    sk_t,
    sk_h,
    sv_b,
    sv_t,
    sv_h,
    so_b,
    so_t,
    so_h,
    si_b,
    si_t,
    si_h,
    Tq,
    Tt,
    q_offset,
    qk_scale,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    N_SEL: tl.constexpr,
    L_SEL: tl.constexpr,
    M: tl.constexpr,
    SHARE_PCT: tl.constexpr,
    SCAN: tl.constexpr,
    PAIR: tl.constexpr,  # 0, or M up to a power of two: own blocks side by side
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # One program per tile of M query tokens and (batch, KV group). A tile whose tokens share enough of
    # their blocks (the union of its M x n slots has fewer than SHARE_PCT % of them) streams each block of
    # the union once for the rows that chose it; otherwise each token's own blocks for its rows alone.
    i_m = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    whole = 0
    if SCAN:
        i_m, whole = _scan_tile(i_m, Tt, q_offset, M, BLOCK_S)
    e_r, tok, m_r, heads, t_r = _tile_rows(i_m, Tq, q_offset, i_h, M, G, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    m_rd = m_r[:, None] & (o_d < D)[None, :]
    t_last = tl.max(tl.where(m_r, t_r, -1), 0)  # the last position any row of the tile reads
    b_q = tl.load(
        Q + i_b * sq_b + tok[:, None] * sq_t + heads[:, None] * sq_h + o_d[None, :], mask=m_rd, other=0.0
    )
    K_bh = K + i_b * sk_b + i_h * sk_h
    V_bh = V + i_b * sv_b + i_h * sv_h
    IDX_bh = IDX + i_b * si_b + i_h * si_h

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    if SCAN:  # every key up to the tile's last position, in order, for the rows whose blocks hold it
        b_idx = _tile_blocks(IDX_bh, si_t, tok, m_r, N_SEL, BLOCK_N)
        for s0 in range(0, whole, BLOCK_S):  # before every row's position: masked by the blocks alone
            b_k, b_v, visible = _scan_key_tile(
                K_bh, V_bh, sk_t, sv_t, b_idx, s0, t_last, t_r, D, L_SEL, BLOCK_S, BLOCK_D, False
            )
            m_i, l_i, acc = _fwd_step(b_q, b_k, b_v, visible, m_i, l_i, acc, qk_scale, PRECISION)
        for s0 in range(whole, t_last + 1, BLOCK_S):  # the causal edge
            b_k, b_v, visible = _scan_key_tile(
                K_bh, V_bh, sk_t, sv_t, b_idx, s0, t_last, t_r, D, L_SEL, BLOCK_S, BLOCK_D, True
            )
            m_i, l_i, acc = _fwd_step(b_q, b_k, b_v, visible, m_i, l_i, acc, qk_scale, PRECISION)
    else:
        count = M * N_SEL
        if M > 1:
            count = tl.load(COUNT + i_bh * Tt + i_m)
        if count * 100 < M * N_SEL * SHARE_PCT:  # shared: the union, each block once
            b_idx = _tile_blocks(IDX_bh, si_t, tok, m_r, N_SEL, BLOCK_N)
            UNION_row = UNION + (i_bh * Tt + i_m) * (M * N_SEL)
            for i_u in range(0, count):
                blk = tl.load(UNION_row + i_u).to(tl.int64)
                chose = tl.max((b_idx == blk).to(tl.int32), 1) > 0  # [R]: the rows that selected this block
                m_i, l_i, acc = _fwd_block(
                    b_q, K_bh, V_bh, sk_t, sv_t, blk, chose, t_r, t_last, m_i, l_i, acc, qk_scale,
                    D, L_SEL, BLOCK_S, BLOCK_D, PRECISION, True,
                )  # fmt: skip
        elif PAIR > 0:  # each token's own blocks, slot by slot: the M tokens' blocks side by side
            for i_n in range(N_SEL):
                for s0 in range(0, L_SEL, BLOCK_S):
                    b_k, b_v, visible = _paired_key_tile(
                        K_bh, V_bh, IDX_bh, sk_t, sv_t, si_t, i_m, i_n, s0, Tq, q_offset, e_r,
                        D, L_SEL, M, PAIR, BLOCK_S, BLOCK_D,
                    )  # fmt: skip
                    m_i, l_i, acc = _fwd_step(b_q, b_k, b_v, visible, m_i, l_i, acc, qk_scale, PRECISION)
        else:  # each token's own blocks, up to its own position
            for j in tl.static_range(M):
                t_j = tl.minimum(i_m * M + j, Tq - 1)
                chose = tl.full([BLOCK_R], True, tl.int1)  # one token a tile: every row (padding: not stored)
                if M > 1:
                    chose = e_r == j
                for i_n in range(N_SEL):
                    blk = tl.load(IDX_bh + t_j * si_t + i_n).to(tl.int64)
                    m_i, l_i, acc = _fwd_block(
                        b_q, K_bh, V_bh, sk_t, sv_t, blk, chose, t_r, q_offset + t_j, m_i, l_i, acc, qk_scale,
                        D, L_SEL, BLOCK_S, BLOCK_D, PRECISION, False,
                    )  # fmt: skip

    # a query with no readable key outputs zeros; its lse is +inf so that the backward's p is 0
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    tl.store(
        O + i_b * so_b + tok[:, None] * so_t + heads[:, None] * so_h + o_d[None, :],
        b_o.to(O.dtype.element_ty),
        mask=m_rd,
    )
    b_lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.log2(l_safe))
    tl.store(LSE + (i_b * Tq + tok) * (HKV * G) + heads, b_lse, mask=m_r)


@triton.jit
def _dq_block(
    b_q, b_do, b_lse, b_delta, K_bh, V_bh, sk_t, sv_t, blk, chose, t_r, t_last, b_dq, qk_scale,
    D: tl.constexpr, L_SEL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, PER_ROW: tl.constexpr,
):  # fmt: skip
    for s0 in range(0, L_SEL, BLOCK_S):
        b_k, b_v, visible = _key_tile(
            K_bh, V_bh, sk_t, sv_t, blk, s0, t_last, chose, t_r, D, L_SEL, BLOCK_S, BLOCK_D, PER_ROW
        )
        b_dq = _dq_step(b_q, b_do, b_lse, b_delta, b_k, b_v, visible, b_dq, qk_scale, PRECISION)
    return b_dq


@triton.jit
def _dq_step(b_q, b_do, b_lse, b_delta, b_k, b_v, visible, b_dq, qk_scale, PRECISION: tl.constexpr):
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale
    b_p = tl.where(visible, tl.exp2(b_s - b_lse[:, None]), 0.0)  # [R, S]
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)
    b_ds = b_p * (b_dp - b_delta[:, None])
    return b_dq + tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PRECISION)


@Launcher
@triton.jit(do_not_specialize=["Tq", "Tt", "q_offset"])
def _selected_bwd_dq_kernel(
    Q,
    K,
    V,
    O,
    DO,
    DQ,
    LSE,
    DELTA,
    IDX,
    UNION,
    COUNT,
    sq_b,
    sq_t,
    sq_h,
    sk_b,
    sk_t,
    sk_h,
    sv_b,
    sv_t,
    sv_h,
    so_b,
    so_t,
    so_h,
    sdo_b,
    sdo_t,
    sdo_h,
    sdq_b,
    sdq_t,
    sdq_h,
    si_b,
    si_t,
    si_h,
    Tq,
    Tt,
    q_offset,
    qk_scale,
    scale,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    N_SEL: tl.constexpr,
    L_SEL: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    M: tl.constexpr,
    SHARE_PCT: tl.constexpr,
    SCAN: tl.constexpr,
    PAIR: tl.constexpr,  # 0, or M up to a power of two: own blocks side by side
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # the forward's tiles and choice (shared union or each token's blocks); HAS_DELTA: DELTA holds
    # rowsum(o * dO) already (the fused op's gate pass); else computed and stored
    i_m = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    whole = 0
    if SCAN:
        i_m, whole = _scan_tile(i_m, Tt, q_offset, M, BLOCK_S)
    e_r, tok, m_r, heads, t_r = _tile_rows(i_m, Tq, q_offset, i_h, M, G, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    m_rd = m_r[:, None] & (o_d < D)[None, :]
    t_last = tl.max(tl.where(m_r, t_r, -1), 0)
    b_q = tl.load(
        Q + i_b * sq_b + tok[:, None] * sq_t + heads[:, None] * sq_h + o_d[None, :], mask=m_rd, other=0.0
    )
    b_do = tl.load(
        DO + i_b * sdo_b + tok[:, None] * sdo_t + heads[:, None] * sdo_h + o_d[None, :], mask=m_rd, other=0.0
    )
    row = (i_b * Tq + tok) * (HKV * G) + heads
    if HAS_DELTA:
        b_delta = tl.load(DELTA + row, mask=m_r, other=0.0)
    else:
        o_ptr = O + i_b * so_b + tok[:, None] * so_t + heads[:, None] * so_h + o_d[None, :]
        b_o = tl.load(o_ptr, mask=m_rd, other=0.0)
        b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # [R]
        tl.store(DELTA + row, b_delta, mask=m_r)
    b_lse = tl.load(LSE + row, mask=m_r, other=float("inf"))
    K_bh = K + i_b * sk_b + i_h * sk_h
    V_bh = V + i_b * sv_b + i_h * sv_h
    IDX_bh = IDX + i_b * si_b + i_h * si_h

    b_dq = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    if SCAN:  # the forward's scan: every key up to t_last, for the rows whose blocks hold it
        b_idx = _tile_blocks(IDX_bh, si_t, tok, m_r, N_SEL, BLOCK_N)
        for s0 in range(0, whole, BLOCK_S):
            b_k, b_v, visible = _scan_key_tile(
                K_bh, V_bh, sk_t, sv_t, b_idx, s0, t_last, t_r, D, L_SEL, BLOCK_S, BLOCK_D, False
            )
            b_dq = _dq_step(b_q, b_do, b_lse, b_delta, b_k, b_v, visible, b_dq, qk_scale, PRECISION)
        for s0 in range(whole, t_last + 1, BLOCK_S):
            b_k, b_v, visible = _scan_key_tile(
                K_bh, V_bh, sk_t, sv_t, b_idx, s0, t_last, t_r, D, L_SEL, BLOCK_S, BLOCK_D, True
            )
            b_dq = _dq_step(b_q, b_do, b_lse, b_delta, b_k, b_v, visible, b_dq, qk_scale, PRECISION)
    else:
        count = M * N_SEL
        if M > 1:
            count = tl.load(COUNT + i_bh * Tt + i_m)
        if count * 100 < M * N_SEL * SHARE_PCT:
            b_idx = _tile_blocks(IDX_bh, si_t, tok, m_r, N_SEL, BLOCK_N)
            UNION_row = UNION + (i_bh * Tt + i_m) * (M * N_SEL)
            for i_u in range(0, count):
                blk = tl.load(UNION_row + i_u).to(tl.int64)
                chose = tl.max((b_idx == blk).to(tl.int32), 1) > 0
                b_dq = _dq_block(
                    b_q, b_do, b_lse, b_delta, K_bh, V_bh, sk_t, sv_t, blk, chose, t_r, t_last, b_dq,
                    qk_scale, D, L_SEL, BLOCK_S, BLOCK_D, PRECISION, True,
                )  # fmt: skip
        elif PAIR > 0:
            for i_n in range(N_SEL):
                for s0 in range(0, L_SEL, BLOCK_S):
                    b_k, b_v, visible = _paired_key_tile(
                        K_bh, V_bh, IDX_bh, sk_t, sv_t, si_t, i_m, i_n, s0, Tq, q_offset, e_r,
                        D, L_SEL, M, PAIR, BLOCK_S, BLOCK_D,
                    )  # fmt: skip
                    b_dq = _dq_step(b_q, b_do, b_lse, b_delta, b_k, b_v, visible, b_dq, qk_scale, PRECISION)
        else:
            for j in tl.static_range(M):
                t_j = tl.minimum(i_m * M + j, Tq - 1)
                chose = tl.full([BLOCK_R], True, tl.int1)
                if M > 1:
                    chose = e_r == j
                for i_n in range(N_SEL):
                    blk = tl.load(IDX_bh + t_j * si_t + i_n).to(tl.int64)
                    b_dq = _dq_block(
                        b_q, b_do, b_lse, b_delta, K_bh, V_bh, sk_t, sv_t, blk, chose, t_r, q_offset + t_j,
                        b_dq, qk_scale, D, L_SEL, BLOCK_S, BLOCK_D, PRECISION, False,
                    )  # fmt: skip
    tl.store(
        DQ + i_b * sdq_b + tok[:, None] * sdq_t + heads[:, None] * sdq_h + o_d[None, :],
        (b_dq * scale).to(DQ.dtype.element_ty),
        mask=m_rd,
    )


@Launcher
@triton.jit(do_not_specialize=["Tq", "Tk", "Ns", "q_offset"])
def _selected_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    WK,
    WV,
    WDQ,
    OFFSETS,
    SLOTS,
    ENTRIES,
    sq_b,
    sq_t,
    sq_h,
    sk_b,
    sk_t,
    sk_h,
    sv_b,
    sv_t,
    sv_h,
    sdo_b,
    sdo_t,
    sdo_h,
    sdk_b,
    sdk_t,
    sdk_h,
    sdv_b,
    sdv_t,
    sdv_h,
    Tq,
    Tk,
    Ns,
    q_offset,
    qk_scale,
    scale,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    N_SEL: tl.constexpr,
    L_SEL: tl.constexpr,
    N_SUB: tl.constexpr,
    CHUNK: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    DQ_PARTS: tl.constexpr,  # also each entry's dq over this key tile, fp32 into WDQ (`_dq_parts_kernel`)
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_js = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_c = tl.program_id(2)
    i_j, i_sub = i_js // N_SUB, i_js % N_SUB
    i_b, i_h = i_bh // HKV, i_bh % HKV
    bucket = i_bh * Ns + i_j
    start = tl.load(OFFSETS + bucket)
    end = tl.load(OFFSETS + bucket + 1)
    count = end - start
    # chunk 0 always runs (a block nobody chose still writes its zeros); the last chunk takes any remainder
    if (i_c == 0) | (i_c * CHUNK < count):
        lo = start + i_c * CHUNK
        hi = end
        if i_c < N_CHUNKS - 1:
            hi = tl.minimum(end, lo + CHUNK)
        o_s, o_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
        m_d = o_d < D
        pos = i_j * L_SEL + i_sub * BLOCK_S + o_s  # [S]
        m_s = (i_sub * BLOCK_S + o_s < L_SEL) & (pos < Tk)
        m_sd = m_s[:, None] & m_d[None, :]
        b_k = tl.load(K + i_b * sk_b + i_h * sk_h + pos[:, None] * sk_t + o_d[None, :], mask=m_sd, other=0.0)
        b_v = tl.load(V + i_b * sv_b + i_h * sv_h + pos[:, None] * sv_t + o_d[None, :], mask=m_sd, other=0.0)
        b_dk = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
        b_dv = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)

        # a tile of BLOCK_R rows holds E entries (query tokens) x G heads, entry-major
        E: tl.constexpr = BLOCK_R // G
        o_r = tl.arange(0, BLOCK_R)
        e_r, g_r = o_r // G, o_r % G
        heads = i_h * G + g_r
        for e0 in range(lo, hi, E):
            ent = e0 + e_r
            m_r = (e_r < E) & (ent < hi)
            entry = tl.load(ENTRIES + ent, mask=m_r, other=0).to(tl.int64)
            tok = entry // N_SEL  # query row 0 .. Tq-1
            m_rd = m_r[:, None] & m_d[None, :]
            b_q = tl.load(
                Q + i_b * sq_b + tok[:, None] * sq_t + heads[:, None] * sq_h + o_d[None, :],
                mask=m_rd,
                other=0.0,
            )
            b_do = tl.load(
                DO + i_b * sdo_b + tok[:, None] * sdo_t + heads[:, None] * sdo_h + o_d[None, :],
                mask=m_rd,
                other=0.0,
            )
            row = (i_b * Tq + tok) * (HKV * G) + heads
            b_lse = tl.load(LSE + row, mask=m_r, other=float("inf"))
            b_delta = tl.load(DELTA + row, mask=m_r, other=0.0)
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale  # [R, S]
            visible = m_r[:, None] & m_s[None, :] & (pos[None, :] <= q_offset + tok[:, None])
            b_p = tl.where(visible, tl.exp2(b_s - b_lse[:, None]), 0.0)
            b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=PRECISION)
            b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)
            b_ds = b_p * (b_dp - b_delta[:, None])
            b_dk += tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q, input_precision=PRECISION)
            if DQ_PARTS:  # row (b, tok, h, slot, sub, g) of the workspace: summed by _dq_parts_kernel
                b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PRECISION)
                part = (((i_b * Tq + tok) * HKV + i_h) * N_SEL + entry % N_SEL) * N_SUB + i_sub
                b_dq = b_dq.to(WDQ.dtype.element_ty)
                tl.store(WDQ + (part * G + g_r)[:, None] * D + o_d[None, :], b_dq, mask=m_rd)
        b_dk = b_dk * scale

        if (count <= CHUNK) | (N_CHUNKS == 1):
            tl.store(
                DK + i_b * sdk_b + i_h * sdk_h + pos[:, None] * sdk_t + o_d[None, :],
                b_dk.to(DK.dtype.element_ty),
                mask=m_sd,
            )
            tl.store(
                DV + i_b * sdv_b + i_h * sdv_h + pos[:, None] * sdv_t + o_d[None, :],
                b_dv.to(DV.dtype.element_ty),
                mask=m_sd,
            )
        else:  # a hot block: an fp32 partial per chunk, summed by _selected_bwd_reduce_kernel
            slot = tl.load(SLOTS + bucket).to(tl.int64) + i_c
            o_w = (
                slot * (N_SUB * BLOCK_S * BLOCK_D) + (i_sub * BLOCK_S + o_s)[:, None] * BLOCK_D + o_d[None, :]
            )
            tl.store(WK + o_w, b_dk)
            tl.store(WV + o_w, b_dv)


@Launcher
@triton.jit(do_not_specialize=["Tk", "Ns"])
def _selected_bwd_reduce_kernel(
    DK,
    DV,
    WK,
    WV,
    OFFSETS,
    SLOTS,
    sdk_b,
    sdk_t,
    sdk_h,
    sdv_b,
    sdv_t,
    sdv_h,
    Tk,
    Ns,
    HKV: tl.constexpr,
    D: tl.constexpr,
    L_SEL: tl.constexpr,
    N_SUB: tl.constexpr,
    CHUNK: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_js = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_j, i_sub = i_js // N_SUB, i_js % N_SUB
    i_b, i_h = i_bh // HKV, i_bh % HKV
    bucket = i_bh * Ns + i_j
    count = tl.load(OFFSETS + bucket + 1) - tl.load(OFFSETS + bucket)
    if count > CHUNK:
        n_chunks = tl.minimum((count + CHUNK - 1) // CHUNK, N_CHUNKS)
        slot0 = tl.load(SLOTS + bucket).to(tl.int64)
        o_s, o_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
        o_w = (i_sub * BLOCK_S + o_s)[:, None] * BLOCK_D + o_d[None, :]
        b_dk = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
        b_dv = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
        for c in range(n_chunks):
            base = (slot0 + c) * (N_SUB * BLOCK_S * BLOCK_D)
            b_dk += tl.load(WK + base + o_w)
            b_dv += tl.load(WV + base + o_w)
        pos = i_j * L_SEL + i_sub * BLOCK_S + o_s
        m_sd = ((i_sub * BLOCK_S + o_s < L_SEL) & (pos < Tk))[:, None] & (o_d < D)[None, :]
        tl.store(
            DK + i_b * sdk_b + i_h * sdk_h + pos[:, None] * sdk_t + o_d[None, :],
            b_dk.to(DK.dtype.element_ty),
            mask=m_sd,
        )
        tl.store(
            DV + i_b * sdv_b + i_h * sdv_h + pos[:, None] * sdv_t + o_d[None, :],
            b_dv.to(DV.dtype.element_ty),
            mask=m_sd,
        )


@triton.jit
def _block_keys(
    K_bh, V_bh, sk_t, sv_t, blk, s0, Tk,
    D: tl.constexpr, L_SEL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # keys s0.. of block `blk`, their positions and which are keys of the block
    o_s, o_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    pos = blk * L_SEL + s0 + o_s
    m_s = (s0 + o_s < L_SEL) & (pos < Tk)
    m_sd = m_s[:, None] & (o_d < D)[None, :]
    b_k = tl.load(K_bh + pos[:, None] * sk_t + o_d[None, :], mask=m_sd, other=0.0)
    b_v = tl.load(V_bh + pos[:, None] * sv_t + o_d[None, :], mask=m_sd, other=0.0)
    return b_k, b_v, pos, m_s


@triton.jit
def _entry_rows(ENTRIES, e0, hi, e_r, Q_bh, sq_t, q_offset, m_d, E: tl.constexpr, N_SEL: tl.constexpr):
    # the rows of entries e0 .. e0 + E - 1 (below hi) of a block's list: entry, token, position, mask, queries
    m_r = (e_r < E) & (e0 + e_r < hi)
    entry = tl.load(ENTRIES + e0 + e_r, mask=m_r, other=0).to(tl.int64)
    tok = entry // N_SEL
    b_q = tl.load(Q_bh + tok[:, None] * sq_t, mask=m_r[:, None] & m_d[None, :], other=0.0)
    return entry, tok, q_offset + tok, m_r, b_q


@triton.jit
def _store_part(WO, WL, entry, tok, m_r, g_r, o_d, m_d, i_b, i_h, Tq, m_i, l_i, acc,
                HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N_SEL: tl.constexpr):  # fmt: skip
    # an entry's softmax over its block, normalised, and its log-sum-exp at row (b, token, h, slot, g); a
    # listed block starts at or before its token, so every listed row saw a key (l_i > 0)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    part = (((i_b * Tq + tok) * HKV + i_h) * N_SEL + entry % N_SEL) * G + g_r
    b_o = (acc / l_safe[:, None]).to(WO.dtype.element_ty)
    tl.store(WO + part[:, None] * D + o_d[None, :], b_o, mask=m_r[:, None] & m_d[None, :])
    tl.store(WL + part, m_i + tl.log2(l_safe), mask=m_r)


@Launcher
@triton.jit(do_not_specialize=["Tq", "Tk", "Ns", "q_offset"])
def _selected_fwd_blocks_kernel(
    Q, K, V, WO, WL, OFFSETS, ENTRIES,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    Tq, Tk, Ns, q_offset, qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N_SEL: tl.constexpr, L_SEL: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # The forward by selection block: one program per (block, batch x KV group, chunk of CHUNK entries of
    # the block's query list) walks its entries, E = BLOCK_R // G query tokens (x the group's G heads) a
    # step, against the block's keys (loaded once where the block is one key tile). Each entry's softmax
    # over this block alone, normalised, and its log-sum-exp go to row (b, token, h, slot, g) of WO and WL;
    # `_fwd_combine_kernel` merges a token's slots in slot order.
    i_j = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_c = tl.program_id(2)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    bucket = i_bh * Ns + i_j
    lo = tl.load(OFFSETS + bucket) + i_c * CHUNK
    end = tl.load(OFFSETS + bucket + 1)
    if lo < end:
        hi = tl.minimum(end, lo + CHUNK)
        E: tl.constexpr = BLOCK_R // G
        o_r, o_d = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
        e_r, g_r = o_r // G, o_r % G
        m_d = o_d < D
        K_bh = K + i_b * sk_b + i_h * sk_h
        V_bh = V + i_b * sv_b + i_h * sv_h
        Q_bh = Q + i_b * sq_b + (i_h * G + g_r)[:, None] * sq_h + o_d[None, :]
        if L_SEL <= BLOCK_S:  # the block is one key tile: loaded once for all the entries
            b_k, b_v, pos, m_s = _block_keys(K_bh, V_bh, sk_t, sv_t, i_j, 0, Tk, D, L_SEL, BLOCK_S, BLOCK_D)
            for e0 in range(lo, hi, E):
                entry, tok, t_r, m_r, b_q = _entry_rows(
                    ENTRIES, e0, hi, e_r, Q_bh, sq_t, q_offset, m_d, E, N_SEL
                )
                visible = m_r[:, None] & m_s[None, :] & (pos[None, :] <= t_r[:, None])
                m_i, l_i, acc = _fwd_step(
                    b_q, b_k, b_v, visible, tl.full([BLOCK_R], float("-inf"), tl.float32),
                    tl.zeros([BLOCK_R], tl.float32), tl.zeros([BLOCK_R, BLOCK_D], tl.float32), qk_scale,
                    PRECISION,
                )  # fmt: skip
                _store_part(
                    WO, WL, entry, tok, m_r, g_r, o_d, m_d, i_b, i_h, Tq, m_i, l_i, acc, HKV, G, D, N_SEL
                )
        else:
            for e0 in range(lo, hi, E):
                entry, tok, t_r, m_r, b_q = _entry_rows(
                    ENTRIES, e0, hi, e_r, Q_bh, sq_t, q_offset, m_d, E, N_SEL
                )
                m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_R], tl.float32)
                acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
                for s0 in range(0, L_SEL, BLOCK_S):
                    b_k, b_v, pos, m_s = _block_keys(
                        K_bh, V_bh, sk_t, sv_t, i_j, s0, Tk, D, L_SEL, BLOCK_S, BLOCK_D
                    )
                    visible = m_r[:, None] & m_s[None, :] & (pos[None, :] <= t_r[:, None])
                    m_i, l_i, acc = _fwd_step(b_q, b_k, b_v, visible, m_i, l_i, acc, qk_scale, PRECISION)
                _store_part(
                    WO, WL, entry, tok, m_r, g_r, o_d, m_d, i_b, i_h, Tq, m_i, l_i, acc, HKV, G, D, N_SEL
                )


@triton.jit
def _slot_rows(IDX_bh, si_t, tok, t_r, m_r, i_n, L_SEL: tl.constexpr):
    # the rows whose token's slot i_n holds a block that starts at or before the token (the index's entries)
    blk = tl.load(IDX_bh + tok * si_t + i_n, mask=m_r, other=-1)
    return m_r & (blk >= 0) & (blk * L_SEL <= t_r)


@triton.jit
def _merge_rows(
    IDX, si_b, si_h, Tq, q_offset,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N_SEL: tl.constexpr, M: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # a merging program's rows, (tile of M query tokens, batch x KV group) from its ids: the batch, tokens,
    # row mask, heads and positions (`_tile_rows`), the head-dim lanes, the group's block choices, and each
    # row's first part (its token's slot 0)
    i_m = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    _, tok, m_r, heads, t_r = _tile_rows(i_m, Tq, q_offset, i_h, M, G, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    first = ((i_b * Tq + tok) * HKV + i_h) * N_SEL
    return i_b, tok, m_r, heads, t_r, o_d, (o_d < D)[None, :], IDX + i_b * si_b + i_h * si_h, first


@Launcher
@triton.jit(do_not_specialize=["Tq", "q_offset"])
def _fwd_combine_kernel(
    O, LSE, WO, WL, IDX, so_b, so_t, so_h, si_b, si_t, si_h, Tq, q_offset,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N_SEL: tl.constexpr, L_SEL: tl.constexpr,
    M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # one program per (tile of M query tokens, batch x KV group): each row's slots merged in slot order
    # (log-sum-exp weights), the output and log-sum-exp of `_selected_fwd_kernel`
    i_b, tok, m_r, heads, t_r, o_d, m_d, IDX_bh, first = _merge_rows(
        IDX, si_b, si_h, Tq, q_offset, HKV, G, D, N_SEL, M, BLOCK_R, BLOCK_D
    )
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for i_n in range(N_SEL):
        valid = _slot_rows(IDX_bh, si_t, tok, t_r, m_r, i_n, L_SEL)
        part = (first + i_n) * G + heads % G
        b_l = tl.load(WL + part, mask=valid, other=float("-inf"))
        b_o = tl.load(WO + part[:, None] * D + o_d[None, :], mask=valid[:, None] & m_d, other=0.0)
        m_new = tl.maximum(m_i, b_l)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(b_l - m_safe)
        l_i = l_i * alpha + beta
        acc = acc * alpha[:, None] + beta[:, None] * b_o.to(tl.float32)
        m_i = m_new
    # a query with no readable key outputs zeros; its lse is +inf so that the backward's p is 0
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(
        O + i_b * so_b + tok[:, None] * so_t + heads[:, None] * so_h + o_d[None, :],
        (acc / l_safe[:, None]).to(O.dtype.element_ty),
        mask=m_r[:, None] & m_d,
    )
    b_lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.log2(l_safe))
    tl.store(LSE + (i_b * Tq + tok) * (HKV * G) + heads, b_lse, mask=m_r)


@Launcher
@triton.jit(do_not_specialize=["Tq", "q_offset"])
def _dq_parts_kernel(
    DQ, WDQ, IDX, sdq_b, sdq_t, sdq_h, si_b, si_t, si_h, Tq, q_offset, scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N_SEL: tl.constexpr, L_SEL: tl.constexpr,
    N_SUB: tl.constexpr, M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # one program per (tile of M query tokens, batch x KV group): dq = scale x the sum of each row's parts
    # (dK/dV's DQ_PARTS: one per slot and key tile of its block), in slot order
    i_b, tok, m_r, heads, t_r, o_d, m_d, IDX_bh, first = _merge_rows(
        IDX, si_b, si_h, Tq, q_offset, HKV, G, D, N_SEL, M, BLOCK_R, BLOCK_D
    )
    b_dq = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for i_n in range(N_SEL):
        valid = _slot_rows(IDX_bh, si_t, tok, t_r, m_r, i_n, L_SEL)
        for i_sub in tl.static_range(N_SUB):
            part = ((first + i_n) * N_SUB + i_sub) * G + heads % G
            b_part = tl.load(WDQ + part[:, None] * D + o_d[None, :], mask=valid[:, None] & m_d, other=0.0)
            b_dq += b_part.to(tl.float32)
    tl.store(
        DQ + i_b * sdq_b + tok[:, None] * sdq_t + heads[:, None] * sdq_h + o_d[None, :],
        (b_dq * scale).to(DQ.dtype.element_ty),
        mask=m_r[:, None] & m_d,
    )


# --- launchers ---------------------------------------------------------------------------------------------


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    assert x.stride(-1) == 1, "the head dimension must be contiguous"
    return x.stride(0), x.stride(1), x.stride(2)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs get IEEE products (tests compare them with float64); half inputs ignore the setting
    return "ieee" if dtype == torch.float32 else "tf32"


def _tile_bytes(dtype: torch.dtype, tiles: dict[str, int]) -> int:
    return tiles["BLOCK_S"] * tiles["BLOCK_D"] * (4 if dtype == torch.float32 else 2)


def _num_stages(dtype: torch.dtype, tiles: dict[str, int]) -> int:
    # software-pipelined copies of a [BLOCK_S, BLOCK_D] key/value tile must fit in shared memory (227 KB on
    # H100): three stages for bf16 at D <= 128, two for float32 or wide heads (one stage takes more: the
    # unpipelined loop keeps other layout conversions in shared memory; sm_90 compiles checked)
    return 3 if _tile_bytes(dtype, tiles) <= 16 << 10 else 2


# Per-kernel overrides ("fwd", "dq", "dkdv", "fwd-scan", "dq-scan", "fwd-blocks" -> num_warps, num_stages,
# and BLOCK_R for dkdv and fwd-blocks); empty: the defaults. benchmarks/tune_triton.py and
# selection_tiles.py set them to time other launch options.
LAUNCH: dict[str, dict[str, int]] = {}
_WARPS = {"fwd": 4, "dq": 4, "dkdv": 8}
# bf16/fp16 on an H100 (benchmarks/tune_triton.py, BENCHMARKS.md): fewer warps and two stages for the
# 16-row tiles of fwd and dq (0.91x, 0.96x the time), 4 warps over 64 rows a step for dK/dV (0.73x)
_HALF = {"fwd": dict(num_warps=2, num_stages=2), "dq": dict(num_warps=2, num_stages=2),
         "dkdv": dict(num_warps=4, num_stages=2, BLOCK_R=64)}  # fmt: skip


# fwd and dq: rows of a tile (query tokens x the G heads of a group) they aim at; a tile of M = ROWS // G
# consecutive tokens (at least one) reads the union of their blocks once
_TILE_ROWS = {"fwd": 16, "dq": 16}
MAX_TILE_TOKENS = 16  # the per-token path unrolls its tokens
# a tile streams its union when it holds fewer than this share (%) of its tokens' slots: the union path's
# membership test costs about a fifth more per block than a token's own blocks (H200, m7c geometry)
SHARE_PCT = 80
# a tile that reads each token's own blocks loads slot i of its M tokens as one key tile of M x BLOCK_S
# keys (at most PAIR_MAX_KEYS, and 16 KB: the tile's loops share shared memory), each token's rows masked
# to its own keys: half the loop's steps at M = 2. The forward only: it took the forward at m7c 16k from
# 1.36 to 1.19 ms and dq from 1.86 to 2.01 (bwd, H200, BENCHMARKS.md)
PAIR_KEYS = {"fwd": True, "dq": False}
PAIR_MAX_KEYS = 128


def _token_rows(
    target: int, G: int, n_sel: int, tile_bytes: int, block_s: int, pair_keys: bool
) -> dict[str, int]:
    # tiles of several tokens hold two pipelined loops (the union's, each token's): with key/value tiles
    # over 32 KB (float32 at D > 128, half at D > 256) their buffers exceed shared memory (282 KB for
    # float32 at D = 192 on an H200, of 227 KB; 32 KB tiles ran): one token a program there, as before
    M = max(1, min(MAX_TILE_TOKENS, target // G)) if tile_bytes <= 32 << 10 else 1
    pair = next_power_of_2(M)  # key tiles of pair x BLOCK_S keys, at most PAIR_MAX_KEYS and 16 KB
    if not pair_keys or M == 1 or pair * block_s > PAIR_MAX_KEYS or pair * tile_bytes > 16 << 10:
        pair = 0
    return dict(
        M=M,
        SHARE_PCT=SHARE_PCT if M > 1 else 0,  # one token a tile: its own blocks are the union
        PAIR=pair,  # the own-blocks path with the tokens' blocks side by side (0: in turn)
        BLOCK_R=max(16, next_power_of_2(M * G)),
        BLOCK_N=next_power_of_2(n_sel),
    )


# fwd and dq over short sequences: a tile of SCAN_ROWS rows (M = SCAN_ROWS // G tokens) streams every key
# up to its last position, in order, each (row, key) pair kept where the row's blocks hold the key (a
# block-masked flash attention, no union built). Where the keys are few against the n x l' a query reads,
# a tile's tokens together choose nearly every block: each key tile is loaded once for all M tokens
# instead of once per token that chose it. Chosen when the keys are at most SCAN_SPAN x n x l'.
SCAN_ROWS = 128  # for 8 KB key tiles (half precision at D <= 64); wider tiles scale it down
SCAN_SPAN = 4
# warps: with the whole key tiles unmasked, 8 for the forward took m7c's 8 x 2048 from 0.309 to 0.267 ms and
# 4 x 4096 from 0.531 to 0.465; dq at 4 was 1.16-1.19x its time at 8 (H200, BENCHMARKS.md)
_SCAN_WARPS = {"fwd": 8, "dq": 8}


def _scan_block(sel_block_len: int) -> int:
    # the scan's key tile: a power of two dividing l' (a tile lies in one block), 16 to 64 keys (0: none);
    # tiles of two whole blocks (128 keys at l' = 64) were slower (H200, BENCHMARKS.md)
    low = min(64, sel_block_len & -sel_block_len)
    return low if low >= 16 else 0


# fwd and dq by selection block, past the scan's lengths: the forward walks each block's query list (the
# inverted index, built once for the forward and the backward) with the block's keys loaded once, one
# output and log-sum-exp per (query head, slot) merged by a second kernel; dK/dV writes each entry's dq part
# beside its own sums, summed per query by another. Where the queries choose blocks independently of their
# neighbours (a model at initialisation, random-like choices at 16k), a tile of query tokens shares few
# blocks and each token's own blocks were read for it alone. Taken where each of the two workspaces (the
# forward's parts, dq's parts: a value per query head, slot and head-dim element, dq's per key tile of a
# block too) is at most BLOCKS_BYTES (m7c-125m, bf16: up to 64k tokens); 0: never. At m7c 64k (1.5 GiB a
# workspace) the op took 17.8 ms against 23.3 per token, its peak 2189 MiB against 678 (H200).
BLOCKS_BYTES = 2 << 30
# ... and where a KV group has at most BLOCKS_GROUP query heads: the parts' traffic grows with the group (a
# value per head, against the block's keys loaded once for all of them). With 16 heads a group at 8k (paper
# geometry, 2 GiB) the op took 12.1 ms by block against 10.9 per token (H200).
BLOCKS_GROUP = 8
# bf16/fp16 inputs: the parts in their dtype, merged in fp32 (as the composed branches' outputs and dq are
# summed in it); half the workspace's traffic: m7c 16k fwd 1.07 -> 0.74 ms, bwd 1.50 -> 1.12 (H200)
HALF_PARTS = True
BLOCKS_CHUNK = 256  # entries of a block's list a forward program walks: block 0 holds every query
# ... doubled, up to 4x, while the programs stay at least BLOCKS_PROGRAMS (the lists' entries / chunk): at
# m7c-125m 64k the forward took 2.04 ms with 1024 against 2.26 with 256, at 16k 0.64 against 0.51 (H200)
BLOCKS_PROGRAMS = 2048
# elements (rows of tokens x the G heads, x BLOCK_D) of a tile that merges parts: the forward's merge keeps
# an fp32 output and rescales it, dq's sums; at m7c-125m 16k (D = 64) 128 rows for the forward and 32 for
# dq took 0.124 + 0.108 ms against 0.175 + 0.132 with 64 for both (H200, benchmarks/nsa_profile.py)
PARTS_ELEMENTS = {"fwd": 128 * 64, "dq": 32 * 64}


def _blocks(q: torch.Tensor, G: int, n_sel: int, sel_block_len: int, keys: int) -> bool:
    """Whether fwd and dq run by selection block (`BLOCKS_BYTES`, `BLOCKS_GROUP`); the scan comes first where
    it runs."""
    B, Tq, HQ, D = q.shape
    if _scan_block(sel_block_len) and keys <= SCAN_SPAN * n_sel * sel_block_len:
        return False
    if G > BLOCKS_GROUP:
        return False
    n_sub = cdiv(sel_block_len, _tiles(1, D, sel_block_len)["BLOCK_S"])
    size = _parts_dtype(q.dtype).itemsize
    return 0 < B * Tq * HQ * n_sel * D * size * n_sub <= BLOCKS_BYTES


def _blocks_chunk(slots: int) -> int:
    """Entries of a block's list a forward program walks, for ``slots`` (B x HKV x Tq x n) list entries at
    most: BLOCKS_CHUNK, doubled up to 4x while the programs stay at least BLOCKS_PROGRAMS."""
    chunk = BLOCKS_CHUNK
    while chunk < 4 * BLOCKS_CHUNK and slots // (2 * chunk) >= BLOCKS_PROGRAMS:
        chunk *= 2
    return chunk


def _parts_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if HALF_PARTS and dtype != torch.float32 else torch.float32


def _parts_rows(kind: str, G: int, block_d: int) -> dict[str, int]:
    M = max(1, PARTS_ELEMENTS[kind] // block_d // G)
    return dict(M=M, BLOCK_R=max(16, next_power_of_2(M * G)))


def _plan(
    kind: str, dtype: torch.dtype, tiles: dict[str, int], G: int, n_sel: int, sel_block_len: int, keys: int
) -> dict[str, int]:
    """fwd and dq (kind): launch options and tile rows, the scan (short sequences, SCAN_SPAN) or tiles of
    tokens (`_token_rows`). The forward and dq plan alike for one call: dq reads the forward's tiles."""
    block_s = _scan_block(sel_block_len)
    if block_s and keys <= SCAN_SPAN * n_sel * sel_block_len:
        scan_tiles = {**tiles, "BLOCK_S": block_s}
        rows = max(16, SCAN_ROWS * (8 << 10) // max(_tile_bytes(dtype, scan_tiles), 8 << 10))
        M = max(1, rows // G)
        config = dict(num_warps=_SCAN_WARPS[kind], num_stages=_num_stages(dtype, scan_tiles))
        config.update(LAUNCH.get(f"{kind}-scan", {}))
        return dict(
            **config, M=M, SHARE_PCT=0, SCAN=True, PAIR=0, BLOCK_R=max(16, next_power_of_2(M * G)),
            BLOCK_N=next_power_of_2(n_sel), BLOCK_S=block_s, BLOCK_D=tiles["BLOCK_D"],
        )  # fmt: skip
    config = _launch(kind, dtype, tiles)
    rows = _token_rows(
        config.pop("ROWS"), G, n_sel, _tile_bytes(dtype, tiles), tiles["BLOCK_S"], PAIR_KEYS[kind]
    )
    return dict(**config, **rows, SCAN=False, BLOCK_S=tiles["BLOCK_S"], BLOCK_D=tiles["BLOCK_D"])


def _launch(kind: str, dtype: torch.dtype, tiles: dict[str, int]) -> dict[str, int]:
    config = dict(num_warps=_WARPS[kind], num_stages=_num_stages(dtype, tiles))
    if kind in _TILE_ROWS:
        config["ROWS"] = _TILE_ROWS[kind]
    if kind == "dkdv":
        config["BLOCK_R"] = _rows(tiles)
    if torch.finfo(dtype).bits == 16 and tiles["BLOCK_D"] <= 128:
        config.update(_HALF[kind])
        if kind == "dkdv":
            config["BLOCK_R"] = max(config["BLOCK_R"], tiles["BLOCK_G"])
    return {**config, **LAUNCH.get(kind, {})}


def _rows(tiles: dict[str, int]) -> int:
    # dK/dV rows per step (query tokens x heads of one group): with two [l', D] fp32 accumulators live, 64
    # rows spill registers at D = 128 (sm_90 compiles: ~900 B of stack), 32 rows at 8 warps do not
    return max(32, tiles["BLOCK_G"])


def _tiles(G: int, D: int, sel_block_len: int) -> dict[str, int]:
    return dict(
        BLOCK_G=max(16, next_power_of_2(G)),
        BLOCK_S=min(64, max(16, next_power_of_2(sel_block_len))),
        BLOCK_D=max(16, next_power_of_2(D)),
    )


@Launcher
@triton.jit(do_not_specialize=["Tq", "Tt"])
def _tile_union_kernel(
    IDX, UNION, COUNT, si_b, si_t, si_h, Tq, Tt,
    HKV: tl.constexpr, N_SEL: tl.constexpr, M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # one program per (tile, batch x KV group): the tile's M x n slots, each block kept at its first slot
    i_m = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    o_c = tl.arange(0, BLOCK_C)  # slot c = token j * n + i_n of the tile
    tok = i_m * M + o_c // N_SEL
    m_c = (o_c < M * N_SEL) & (tok < Tq)
    cand = tl.load(IDX + i_b * si_b + tok * si_t + i_h * si_h + o_c % N_SEL, mask=m_c, other=-1).to(tl.int32)
    earlier = (cand[:, None] == cand[None, :]) & (o_c[None, :] < o_c[:, None])  # [C, C]
    keep = (m_c & (cand >= 0) & (tl.max(earlier.to(tl.int32), 1) == 0)).to(tl.int32)
    slot = tl.cumsum(keep, 0) - 1
    tl.store(UNION + (i_bh * Tt + i_m) * (M * N_SEL) + slot, cand, mask=keep != 0)
    tl.store(COUNT + i_bh * Tt + i_m, tl.sum(keep, 0))


def tile_union(block_idx: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks a tile of ``tokens`` consecutive query rows reads, per (batch, KV group, tile).

    Returns ``union [B, HKV, Tt, tokens * n]`` (int32: each block the tile's rows selected, once, in the
    order of their first slot; the entries past ``count`` are undefined) and ``count [B, HKV, Tt]``
    (int32), ``Tt = ceil(Tq / tokens)``. Neighbouring queries of a trained model select mostly the same
    blocks (the forced initial and local ones, and top-n blocks of similar scores): a tile whose union is
    small enough loads each block once for all its rows (the kernels decide per tile). One kernel.
    """
    B, Tq, HKV, n = block_idx.shape
    tiles = cdiv(Tq, tokens)
    union = torch.empty(B, HKV, tiles, tokens * n, dtype=torch.int32, device=block_idx.device)
    count = torch.empty(B, HKV, tiles, dtype=torch.int32, device=block_idx.device)
    if tiles:
        _tile_union_kernel[(tiles, B * HKV)](
            block_idx, union, count, *_strides(block_idx), Tq, tiles,
            HKV=HKV, N_SEL=n, M=tokens, BLOCK_C=next_power_of_2(tokens * n),
        )  # fmt: skip
    return union, count


@dataclass(frozen=True)
class TokenTiles:
    """The forward's and dq's tiles of ``tokens`` query rows: the kernels' ``UNION``, ``COUNT`` and number
    of tiles. The forward builds them and the fused op keeps them for dq, which reads the same tiles."""

    tokens: int
    union: torch.Tensor
    count: torch.Tensor
    n_tiles: int
    scan: bool = False


@dataclass(frozen=True)
class BlockQueries:
    """The inverted index (`build_block_queries`) the forward built by selection block, for the backward."""

    offsets: torch.Tensor
    entries: torch.Tensor


def _union(block_idx: torch.Tensor, plan: dict[str, int], built: TokenTiles | None = None) -> TokenTiles:
    # one token a tile reads its own blocks, and the scan every block: nothing to build
    tokens, scan = plan["M"], plan["SCAN"]
    if built is not None and (built.tokens, built.scan) == (tokens, scan):
        return built
    if tokens == 1 or scan:
        return TokenTiles(tokens, block_idx, block_idx, cdiv(block_idx.shape[1], tokens), scan)
    union, count = tile_union(block_idx, tokens)
    return TokenTiles(tokens, union, count, count.shape[-1])


def selected_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    sel_block_len: int,
    q_offset: int,
    scale: float,
    tiles_out: list[TokenTiles | BlockQueries] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward: returns ``o [B, Tq, HQ, D]`` and ``lse [B, Tq, HQ]`` (float32, log2 units).

    ``tiles_out``: a list that receives what the forward built for `selected_bwd`: the token tiles dq reads
    again, or the inverted index (`BlockQueries`) where it ran by selection block."""
    B, Tq, HQ, D = q.shape
    HKV = k.shape[2]
    G = HQ // HKV
    o = torch.empty_like(q)
    lse = torch.empty(B, Tq, HQ, dtype=torch.float32, device=q.device)
    if Tq == 0:
        return o, lse
    n_sel = block_idx.shape[-1]
    if _blocks(q, G, n_sel, sel_block_len, k.shape[1]):
        index = BlockQueries(*build_block_queries(block_idx, k.shape[1], sel_block_len, q_offset))
        if tiles_out is not None:
            tiles_out.append(index)
        _forward_by_block(q, k, v, o, lse, block_idx, index, sel_block_len, q_offset, scale)
        return o, lse
    plan = _plan("fwd", q.dtype, _tiles(G, D, sel_block_len), G, n_sel, sel_block_len, k.shape[1])
    built = _union(block_idx, plan)
    if tiles_out is not None:
        tiles_out.append(built)
    n_tiles = built.n_tiles
    _selected_fwd_kernel[(n_tiles, B * HKV)](
        q, k, v, o, lse, block_idx, built.union, built.count,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), *_strides(block_idx),
        Tq, n_tiles, q_offset, scale * LOG2E,
        HKV=HKV, G=G, D=D, N_SEL=n_sel, L_SEL=sel_block_len, PRECISION=_precision(q.dtype), **plan,
    )  # fmt: skip
    return o, lse


def _forward_by_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    block_idx: torch.Tensor,
    index: BlockQueries,
    sel_block_len: int,
    q_offset: int,
    scale: float,
) -> None:
    # each block's entries against its keys (one part per query head and slot), then the parts merged
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, n_sel = HQ // HKV, block_idx.shape[-1]
    tiles = _tiles(G, D, sel_block_len)
    parts = torch.empty(B * Tq * HQ * n_sel, D, dtype=_parts_dtype(q.dtype), device=q.device)
    parts_lse = torch.empty(B * Tq * HQ * n_sel, dtype=torch.float32, device=q.device)
    num_sel_blocks = cdiv(Tk, sel_block_len)
    # dK/dV's rows a step over the same lists, unless LAUNCH["fwd-blocks"] says otherwise
    config = {**_launch("dkdv", q.dtype, tiles), **LAUNCH.get("fwd-blocks", {})}
    chunk = _blocks_chunk(B * HKV * Tq * n_sel)
    _selected_fwd_blocks_kernel[(num_sel_blocks, B * HKV, cdiv(Tq, chunk))](
        q, k, v, parts, parts_lse, index.offsets, index.entries,
        *_strides(q), *_strides(k), *_strides(v), Tq, Tk, num_sel_blocks, q_offset, scale * LOG2E,
        HKV=HKV, G=G, D=D, N_SEL=n_sel, L_SEL=sel_block_len, CHUNK=chunk, BLOCK_S=tiles["BLOCK_S"],
        BLOCK_D=tiles["BLOCK_D"], PRECISION=_precision(q.dtype), **config,
    )  # fmt: skip
    rows = _parts_rows("fwd", G, tiles["BLOCK_D"])
    _fwd_combine_kernel[(cdiv(Tq, rows["M"]), B * HKV)](
        o, lse, parts, parts_lse, block_idx, *_strides(o), *_strides(block_idx), Tq, q_offset,
        HKV=HKV, G=G, D=D, N_SEL=n_sel, L_SEL=sel_block_len, BLOCK_D=tiles["BLOCK_D"], **rows,
    )  # fmt: skip


@Launcher
@triton.jit(do_not_specialize=["Tq", "Ns", "n_chunks", "q_offset"])
def _index_count_kernel(
    IDX, COUNTS, si_b, si_t, si_h, Tq, Ns, n_chunks, q_offset,
    HKV: tl.constexpr, N_SEL: tl.constexpr, L_SEL: tl.constexpr, CHUNK_T: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # one program per (chunk of CHUNK_T query rows, batch x KV group): COUNTS[bucket, chunk] += the rows of
    # the chunk that chose the bucket's block (integer atomics: the counts are exact whatever their order)
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    o_t, o_n = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_N)
    for t0 in range(0, CHUNK_T, BLOCK_T):
        tok = i_c * CHUNK_T + t0 + o_t
        m = ((t0 + o_t < CHUNK_T) & (tok < Tq))[:, None] & (o_n < N_SEL)[None, :]
        blk = tl.load(IDX + i_b * si_b + tok[:, None] * si_t + i_h * si_h + o_n[None, :], mask=m, other=-1)
        valid = m & (blk >= 0) & (blk * L_SEL <= q_offset + tok[:, None])
        tl.atomic_add(COUNTS + (i_bh * Ns + blk) * n_chunks + i_c, 1, mask=valid)


@Launcher
@triton.jit(do_not_specialize=["Tq", "Ns", "n_chunks", "q_offset", "last"])
def _index_fill_kernel(
    IDX, COUNTS, ENDS, OFFSETS, ENTRIES, si_b, si_t, si_h, Tq, Ns, n_chunks, q_offset, last,
    HKV: tl.constexpr, N_SEL: tl.constexpr, L_SEL: tl.constexpr, CHUNK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    # one program per (chunk, batch x KV group): its rows in ascending order, each row's entry (row * n +
    # slot) at ENDS[i] - COUNTS[i] (i = bucket * n_chunks + chunk, ENDS the inclusive prefix sum of COUNTS),
    # counting COUNTS[i] down by one per entry: buckets in order, chunks in order within a bucket, rows in
    # order within a chunk. No two programs touch one entry i, and a row's n blocks are distinct.
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    if i_c == 0:  # the bucket's start: its chunk 0's, before any count moves
        o_j = tl.arange(0, BLOCK_J)
        for j0 in range(0, Ns, BLOCK_J):
            m_j = j0 + o_j < Ns
            i = (i_bh * Ns + j0 + o_j) * n_chunks
            start = tl.load(ENDS + i, mask=m_j, other=0) - tl.load(COUNTS + i, mask=m_j, other=0)
            tl.store(OFFSETS + i_bh * Ns + j0 + o_j, start, mask=m_j)
        if i_bh == 0:
            tl.store(OFFSETS + last, tl.load(ENDS + last * n_chunks - 1))  # the total
    o_n = tl.arange(0, BLOCK_N)
    for t0 in range(0, CHUNK_T):
        tok = i_c * CHUNK_T + t0 + 0 * o_n  # [N]: this row, for each of its slots
        m = (o_n < N_SEL) & (tok < Tq)
        blk = tl.load(IDX + i_b * si_b + tok * si_t + i_h * si_h + o_n, mask=m, other=-1)
        valid = m & (blk >= 0) & (blk * L_SEL <= q_offset + tok)
        i = (i_bh * Ns + blk) * n_chunks + i_c
        left = tl.atomic_add(COUNTS + i, -1, mask=valid)
        slot = tl.load(ENDS + i, mask=valid, other=0) - left
        tl.store(ENTRIES + slot, (tok * N_SEL + o_n).to(tl.int32), mask=valid)


INDEX_ENTRIES = 1 << 22  # (bucket, chunk) counters of the inverted index: the chunks grow to stay below


def build_block_queries(
    block_idx: torch.Tensor, num_keys: int, sel_block_len: int, q_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverted index: for each (batch, KV group, selection block), the query rows that chose it.

    Returns ``offsets [B*HKV*Ns + 1]`` (int64) and ``entries [E]`` (int32, ``E`` = the slots of
    ``block_idx``): bucket ``(b*HKV + h)*Ns + j`` lists ``entries[offsets[i]:offsets[i+1]]``, each
    ``row * n + slot`` (the query row and the slot of ``block_idx[b, row, h]`` that holds ``j``), rows in
    ascending order; entries past ``offsets[-1]`` are undefined. Unused slots and blocks that start after
    the query are left out. A counting sort over chunks of query rows: a count kernel, one prefix sum and
    a fill kernel; no host synchronisation, the same index whatever the order the GPU runs them in.
    """
    B, Tq, HKV, n = block_idx.shape
    device = block_idx.device
    num_sel_blocks = cdiv(num_keys, sel_block_len)
    num_buckets = B * HKV * num_sel_blocks
    chunk_t = 16
    while num_buckets * cdiv(Tq, chunk_t) > INDEX_ENTRIES:
        chunk_t *= 2
    n_chunks = cdiv(Tq, chunk_t)
    counts = torch.zeros(num_buckets * n_chunks, dtype=torch.int32, device=device)
    offsets = torch.empty(num_buckets + 1, dtype=torch.int64, device=device)
    entries = torch.empty(block_idx.numel(), dtype=torch.int32, device=device)
    common = dict(HKV=HKV, N_SEL=n, L_SEL=sel_block_len, CHUNK_T=chunk_t, BLOCK_N=next_power_of_2(n))
    args = (*_strides(block_idx), Tq, num_sel_blocks, n_chunks, q_offset)
    grid = (n_chunks, B * HKV)
    _index_count_kernel[grid](block_idx, counts, *args, BLOCK_T=min(16, chunk_t), **common)
    ends = torch.cumsum(counts, 0)  # int64
    _index_fill_kernel[grid](
        block_idx, counts, ends, offsets, entries, *args, num_buckets, BLOCK_J=1024, **common
    )  # fmt: skip
    return offsets, entries


@Launcher
@triton.jit(do_not_specialize=["num_buckets", "chunk", "n_chunks"])
def _hot_slots_kernel(OFFSETS, SLOTS, num_buckets, chunk, n_chunks, BLOCK: tl.constexpr):
    # one program: each bucket's first workspace slot, the exclusive prefix sum of its slot counts
    o = tl.arange(0, BLOCK)
    carry = tl.zeros([], dtype=tl.int64)
    for start in range(0, num_buckets, BLOCK):
        m = start + o < num_buckets
        first = tl.load(OFFSETS + start + o, mask=m, other=0)
        count = tl.load(OFFSETS + start + o + 1, mask=m, other=0) - first
        used = tl.where(count > chunk, tl.minimum((count + chunk - 1) // chunk, n_chunks), 0)
        tl.store(SLOTS + start + o, carry + tl.cumsum(used, 0) - used, mask=m)
        carry += tl.sum(used, 0)


def hot_slots(offsets: torch.Tensor, chunk: int, n_chunks: int) -> torch.Tensor:
    """``slots [num_buckets]`` (int64): where each bucket's fp32 partial sums start in the dK/dV workspace.

    A bucket of more than ``chunk`` entries (``offsets`` from `build_block_queries`) takes
    ``min(ceil(count / chunk), n_chunks)`` consecutive slots, the others none; the slots are the exclusive
    prefix sum of those counts, in bucket order. One kernel (it was eight torch operations)."""
    num_buckets = offsets.numel() - 1
    slots = torch.empty(num_buckets, dtype=torch.int64, device=offsets.device)
    _hot_slots_kernel[(1,)](offsets, slots, num_buckets, chunk, n_chunks, BLOCK=1024)
    return slots


def _chunk_size(entries: int, slot_elements: int) -> int:
    # A bucket longer than CHUNK entries takes at most ceil(count / CHUNK) < 2 count / CHUNK workspace slots,
    # so the slots stay below 2 entries / CHUNK; pick CHUNK so that they fit WORKSPACE_BYTES (dK and dV fp32).
    slot_bytes = 2 * 4 * slot_elements
    chunk = MIN_CHUNK
    while 2 * entries // chunk * slot_bytes > WORKSPACE_BYTES:
        chunk *= 2
    return chunk


def selected_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    block_idx: torch.Tensor,
    sel_block_len: int,
    q_offset: int,
    scale: float,
    chunk: int | None = None,
    delta: torch.Tensor | None = None,
    token_tiles: TokenTiles | BlockQueries | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward: ``dq``, then ``dk/dv`` through the inverted index (by selection block: dq's
    parts with dK/dV's, then their sum). ``chunk`` is for tests.

    The fused op (`nsa_core.ops.triton.nsa`) passes ``delta = rowsum(o * do) [B, Tq, HQ]`` (float32); then
    ``o`` is not read; and what the forward built (`selected_fwd`'s ``tiles_out``): the token tiles, which
    dq reads again where its tiles are the forward's, or the inverted index.
    """
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G = HQ // HKV
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if Tq == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    tiles = _tiles(G, D, sel_block_len)
    precision = _precision(q.dtype)
    n_sel = block_idx.shape[-1]
    BLOCK_S, BLOCK_D = tiles["BLOCK_S"], tiles["BLOCK_D"]
    n_sub = cdiv(sel_block_len, BLOCK_S)
    by_block = _blocks(q, G, n_sel, sel_block_len, Tk)
    if by_block:
        if delta is None:
            delta = (o.float() * do.float()).sum(-1)
        wdq = torch.empty(B * Tq * HQ * n_sel * n_sub, D, dtype=_parts_dtype(q.dtype), device=q.device)
    else:
        wdq = dq.new_empty(0)
        has_delta = delta is not None
        if delta is None:
            delta = torch.empty(B, Tq, HQ, dtype=torch.float32, device=q.device)
        plan = _plan("dq", q.dtype, tiles, G, n_sel, sel_block_len, Tk)
        built = _union(block_idx, plan, token_tiles if isinstance(token_tiles, TokenTiles) else None)
        n_tiles = built.n_tiles
        _selected_bwd_dq_kernel[(n_tiles, B * HKV)](
            q, k, v, o, do, dq, lse, delta, block_idx, built.union, built.count,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o), *_strides(do), *_strides(dq),
            *_strides(block_idx),
            Tq, n_tiles, q_offset, scale * LOG2E, scale,
            HKV=HKV, G=G, D=D, N_SEL=n_sel, L_SEL=sel_block_len, HAS_DELTA=has_delta, PRECISION=precision,
            **plan,
        )  # fmt: skip
    assert delta.shape == (B, Tq, HQ)
    assert delta.is_contiguous()

    if isinstance(token_tiles, BlockQueries):
        offsets, entries = token_tiles.offsets, token_tiles.entries
    else:
        offsets, entries = build_block_queries(block_idx, Tk, sel_block_len, q_offset)
    num_sel_blocks = cdiv(Tk, sel_block_len)
    chunk = chunk or _chunk_size(entries.numel(), n_sub * BLOCK_S * BLOCK_D)
    n_chunks = cdiv(Tq, chunk)  # a bucket lists each query row at most once per used slot
    slots, wk, wv = offsets, dq.new_empty(0), dq.new_empty(0)  # one chunk: no bucket is hot
    if n_chunks > 1:  # a hot bucket's chunks write fp32 partials at its slots, then one sum
        slots = hot_slots(offsets, chunk, n_chunks)
        num_slots = max(1, min(2 * entries.numel() // chunk, B * HKV * num_sel_blocks * n_chunks))
        workspace = (num_slots, n_sub * BLOCK_S * BLOCK_D)
        wk = torch.empty(workspace, dtype=torch.float32, device=q.device)
        wv = torch.empty(workspace, dtype=torch.float32, device=q.device)
    grid = (num_sel_blocks * n_sub, B * HKV)
    _selected_bwd_dkdv_kernel[(*grid, n_chunks)](
        q, k, v, do, lse, delta, dk, dv, wk, wv, wdq, offsets, slots, entries,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
        Tq, Tk, num_sel_blocks, q_offset, scale * LOG2E, scale,
        HKV=HKV, G=G, D=D, N_SEL=n_sel, L_SEL=sel_block_len, N_SUB=n_sub, CHUNK=chunk, N_CHUNKS=n_chunks,
        DQ_PARTS=by_block, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, PRECISION=precision,
        **_launch("dkdv", q.dtype, tiles),
    )  # fmt: skip
    if n_chunks > 1:
        _selected_bwd_reduce_kernel[grid](
            dk, dv, wk, wv, offsets, slots, *_strides(dk), *_strides(dv), Tk, num_sel_blocks,
            HKV=HKV, D=D, L_SEL=sel_block_len, N_SUB=n_sub, CHUNK=chunk, N_CHUNKS=n_chunks,
            BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D,
        )  # fmt: skip
    if by_block:
        rows = _parts_rows("dq", G, BLOCK_D)
        _dq_parts_kernel[(cdiv(Tq, rows["M"]), B * HKV)](
            dq, wdq, block_idx, *_strides(dq), *_strides(block_idx), Tq, q_offset, scale,
            HKV=HKV, G=G, D=D, N_SEL=n_sel, L_SEL=sel_block_len, N_SUB=n_sub, BLOCK_D=BLOCK_D, **rows,
        )  # fmt: skip
    return dq, dk, dv


# --- autograd ----------------------------------------------------------------------------------------------


class SelectedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_idx: torch.Tensor,
        sel_block_len: int,
        q_offset: int,
        scale: float,
    ) -> torch.Tensor:
        o, lse = selected_fwd(q, k, v, block_idx, sel_block_len, q_offset, scale)
        ctx.save_for_backward(q, k, v, o, lse, block_idx)
        ctx.sel_block_len, ctx.q_offset, ctx.scale = sel_block_len, q_offset, scale
        return o

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, do: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse, block_idx = ctx.saved_tensors
        dq, dk, dv = selected_bwd(
            _last_dim_contiguous(do), q, k, v, o, lse, block_idx, ctx.sel_block_len, ctx.q_offset, ctx.scale
        )
        return dq, dk, dv, None, None, None, None


# --- public function ---------------------------------------------------------------------------------------

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@eager_under_compile
def triton_selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    sel_block_len: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Tq, HQ, D]`` over the keys ``s <= t`` of its selected blocks, in Triton.

    Same contract as `nsa_core.ops.selection.selected_attention`: ``k/v [B, Tk, HKV, D]`` with
    ``Tk = q_offset + Tq``; ``block_idx [B, Tq, HKV, n]`` from `select_blocks` (-1 marks an unused slot;
    the used slots of a row are distinct). Differentiable in ``q``, ``k`` and ``v``. Returns
    ``[B, Tq, HQ, D]`` in ``q``'s dtype (float16, bfloat16 or float32; scores accumulate in float32).
    """
    check_qkv(q, k, v, q_offset)
    if block_idx.shape[:3] != (q.shape[0], q.shape[1], k.shape[2]):
        raise ValueError(f"block_idx {tuple(block_idx.shape)} must be [B, Tq, HKV, n] for q {tuple(q.shape)}")
    if block_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_idx must be int32 or int64, got {block_idx.dtype}")
    if not isinstance(sel_block_len, int) or sel_block_len < 1:
        raise ValueError(f"sel_block_len={sel_block_len!r} must be a positive integer")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(
            f"triton selected attention runs float16, bfloat16 or float32 with one dtype for q, k, v; got "
            f"{q.dtype}, {k.dtype}, {v.dtype}: cast the inputs, or use backend 'gather'"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    block_idx = block_idx.contiguous()
    return SelectedAttentionFunction.apply(q, k, v, block_idx, sel_block_len, q_offset, scale)
