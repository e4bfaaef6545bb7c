"""Compressed attention in Triton, with the block importance and the top-n selection fused after it.

Attention over compressed blocks is the banded flash kernel of `nsa_core.ops.triton.flash` with
``key_stride = d, key_offset = l - 1`` (block ``i`` is visible at ``t`` iff ``i*d + l - 1 <= t``), forward
and backward, gradients into ``q``, ``k_cmp`` and ``v_cmp``.

With ``select``, the blocks for the selection branch come from a second pass that never holds a
``[T, Nc]`` tensor: per (query tile, KV group, tile of selection blocks) it recomputes the probabilities of
the compressed blocks overlapping those selection blocks with each row's final log-sum-exp, sums them over
the ``G`` query heads (Eq. 10) and maps them onto selection blocks through the overlap counts of Eq. 9
(``W[c, j]`` = chunks of ``d`` tokens of selection block ``j`` inside compressed block ``c``), one small
matrix product per tile. The importance lands in a ``[B, rows, HKV, Ns]`` float32 buffer for a chunk of
query rows bounded to ``IMPORTANCE_ELEMENTS`` (64 MiB), then a program per tile of (query, KV group) pairs
takes each pair's top ``n``: forced blocks first in ascending order, then by importance, ties to the lower
index, -1 for unused slots: exactly `select_blocks(block_importance(p))` of `nsa_core.ops.selection`.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from nsa_core.ops.common import check_qkv, eager_under_compile
from nsa_core.ops.compression import num_compressed_blocks
from nsa_core.ops.triton.flash import (
    LOG2_E,
    banded_backward,
    banded_forward,
    block_sizes,
    cdiv,
    kernel_dtypes,
    launch_options,
    next_power_of_2,
)
from nsa_core.ops.triton.launch import Launcher

IMPORTANCE_ELEMENTS = 1 << 24  # importance buffer per query chunk: 64 MiB of float32

# Overrides of `importance_config` (BLOCK_M, BLOCK_C, BLOCK_S, num_warps, num_stages); empty: the defaults.
# benchmarks/tune_triton.py sets it to time other tile shapes.
LAUNCH: dict[str, dict[str, int]] = {}


def importance_config(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """Tiles of the importance kernel: ``BLOCK_M`` query rows, ``BLOCK_C`` compressed blocks a step and
    ``BLOCK_S`` selection blocks a program. Each program reloads the ``G`` query tiles of its group once
    per step; wider steps or more rows were slower on an H100 (benchmarks/tune_triton.py, family
    cmp-imp), so the defaults are the banded kernels' tiles."""
    block_m, block_c, block_d = block_sizes(head_dim)
    config = dict(BLOCK_M=block_m, BLOCK_C=block_c, BLOCK_S=16, **launch_options(dtype, block_d))
    return {**config, **LAUNCH.get("importance", {})}


@triton.jit
def _importance_tile(
    acc,
    q,
    k_cmp,
    lse,
    b,
    hk,
    offs_m,
    mask_m,
    t,
    start,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    HQ,
    G,
    Tq,
    Nc,
    D,
    scale_log2,
    j0,
    BLOCK_LEN: tl.constexpr,
    BLOCK_STRIDE: tl.constexpr,
    R: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # acc [BM, BS] += group-summed probabilities of compressed blocks start.. mapped onto selection blocks
    offs_c = start + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    mask_c, mask_d = (offs_c >= 0) & (offs_c < Nc), offs_d < D
    k_t = tl.load(
        k_cmp + b * stride_kb + hk * stride_kh + offs_c.to(tl.int64)[None, :] * stride_kt + offs_d[:, None],
        mask=mask_c[None, :] & mask_d[:, None],
        other=0.0,
    )  # [BD, BC]
    vis = (offs_c[None, :] * BLOCK_STRIDE + BLOCK_LEN - 1 <= t[:, None]) & mask_c[None, :] & mask_m[:, None]
    p_group = tl.zeros([BLOCK_M, BLOCK_C], dtype=ACC)
    row_q = offs_m.to(tl.int64)[:, None] * stride_qt + offs_d[None, :]
    for g in range(G):
        h = hk * G + g
        q_tile = tl.load(
            q + b * stride_qb + h * stride_qh + row_q, mask=mask_m[:, None] & mask_d[None, :], other=0.0
        )  # [BM, BD]
        row_lse = tl.load(lse + (b * HQ + h) * Tq + offs_m, mask=mask_m, other=0.0)
        s = tl.dot(q_tile, k_t, input_precision=PRECISION, out_dtype=ACC) * scale_log2
        p_group += tl.where(vis, tl.exp2(s - row_lse[:, None]), 0.0)  # Eq. 10: sum over the group
    # Eq. 9: chunk m of selection block j is chunk j*K + m; compressed block c holds chunks c .. c + R - 1
    offs_s = j0 + tl.arange(0, BLOCK_S)
    first = tl.maximum(offs_c[:, None], offs_s[None, :] * K)
    last = tl.minimum(offs_c[:, None] + R - 1, offs_s[None, :] * K + K - 1)
    overlap = tl.maximum(last - first + 1, 0).to(ACC)  # [BC, BS]
    return acc + tl.dot(p_group, overlap, input_precision="ieee", out_dtype=ACC)


@Launcher
@triton.jit(do_not_specialize=["HQ", "HKV", "G", "Tq", "Nc", "Ns", "q_offset", "row0", "rows"])
def _importance_kernel(
    q,
    k_cmp,
    lse,
    imp,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_ib,
    HQ,
    HKV,
    G,
    Tq,
    Nc,
    Ns,
    D,
    q_offset,
    row0,
    rows,
    scale_log2,
    BLOCK_LEN: tl.constexpr,
    BLOCK_STRIDE: tl.constexpr,
    R: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_SPILL: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # one program per (query tile, selection tile, KV group): imp [B, rows, HKV, Ns] for rows row0..
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_bk = tl.program_id(2).to(tl.int64)
    b, hk = pid_bk // HKV, pid_bk % HKV
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m = row0 + local
    mask_m = local < rows
    t = q_offset + offs_m
    t1 = q_offset + row0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, rows) - 1
    c_hi = tl.where(t1 >= BLOCK_LEN - 1, (t1 - BLOCK_LEN + 1) // BLOCK_STRIDE + 1, 0)
    c_hi = tl.minimum(c_hi, Nc)  # compressed blocks some row of the tile sees
    j0 = pid_s * BLOCK_S
    c0 = j0 * K
    acc = tl.zeros([BLOCK_M, BLOCK_S], dtype=ACC)
    # blocks c0 - R + 1 .. c0 - 1 reach into this tile's first chunks
    if (R > 1) & (c0 > 0) & (c0 - R + 1 < c_hi):
        acc = _importance_tile(
            acc, q, k_cmp, lse, b, hk, offs_m, mask_m, t, c0 - BLOCK_SPILL,
            stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
            HQ, G, Tq, Nc, D, scale_log2, j0,
            BLOCK_LEN, BLOCK_STRIDE, R, K, BLOCK_M, BLOCK_SPILL, BLOCK_S, BLOCK_D, ACC, PRECISION,
        )  # fmt: skip
    for start in range(c0, tl.minimum(c_hi, c0 + BLOCK_S * K), BLOCK_C):
        acc = _importance_tile(
            acc, q, k_cmp, lse, b, hk, offs_m, mask_m, t, start,
            stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
            HQ, G, Tq, Nc, D, scale_log2, j0,
            BLOCK_LEN, BLOCK_STRIDE, R, K, BLOCK_M, BLOCK_C, BLOCK_S, BLOCK_D, ACC, PRECISION,
        )  # fmt: skip
    offs_s = j0 + tl.arange(0, BLOCK_S)
    ptr = imp + b * stride_ib + (local.to(tl.int64)[:, None] * HKV + hk) * Ns + offs_s[None, :]
    tl.store(ptr, acc.to(imp.dtype.element_ty), mask=mask_m[:, None] & (offs_s < Ns)[None, :])


@Launcher
@triton.jit(do_not_specialize=["HKV", "Ns", "q_offset", "row0", "rows"])
def _top_n_kernel(
    imp,
    idx,
    stride_ib,
    stride_xb,
    HKV,
    Ns,
    q_offset,
    row0,
    rows,
    SEL_BLOCK_LEN: tl.constexpr,
    N_INIT: tl.constexpr,
    N_LOCAL: tl.constexpr,
    N_SEL: tl.constexpr,
    NS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # one program per (BLOCK_R consecutive (query row, KV group) pairs, batch); idx [B, Tq, HKV, N_SEL] int64
    i_r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # row * HKV + hk
    m_r = r < rows * HKV
    t = q_offset + row0 + r // HKV  # [R]
    offs = tl.arange(0, NS_PAD)
    m = m_r[:, None] & (offs < Ns)[None, :]
    score = tl.load(imp + b * stride_ib + r[:, None] * Ns + offs[None, :], mask=m, other=0.0)
    own = (t // SEL_BLOCK_LEN)[:, None]
    candidate = m & (offs[None, :] * SEL_BLOCK_LEN <= t[:, None])
    forced = (offs[None, :] < N_INIT) | ((offs[None, :] <= own) & (offs[None, :] > own - N_LOCAL))
    key = tl.where(forced, float("inf"), score)
    key = tl.where(candidate, key, float("-inf"))
    o_n = tl.arange(0, BLOCK_N)
    chosen = tl.full([BLOCK_R, BLOCK_N], -1, tl.int64)
    for slot in tl.static_range(N_SEL):
        best = tl.max(key, 1)  # [R]
        j = tl.min(tl.where(key == best[:, None], offs[None, :], NS_PAD), 1)  # ties to the lower index
        pick = tl.where(best == float("-inf"), -1, j).to(tl.int64)
        chosen = tl.where(o_n[None, :] == slot, pick[:, None], chosen)
        key = tl.where(offs[None, :] == j[:, None], float("-inf"), key)
    out = idx + b * stride_xb + (row0 * HKV + r)[:, None] * N_SEL + o_n[None, :]
    tl.store(out, chosen, mask=m_r[:, None] & (o_n < N_SEL)[None, :])


# top-n: (query row, KV group) pairs a program ranks, so that a tile holds about this many scores (one pair
# a program left 31 of 32 lanes of each warp idle at 2k: ~80 us a layer of m7c-125m's step at 8 x 2048),
# on a warp per 512 scores, one to four (`top_n_launch`): 8 to 16 scores a thread. Against 4096 scores on
# four warps (the rule before) the kernel took 46 us against 479 at 8k with 16 heads a group (4 KV groups),
# 70 against 254 at m7c-125m's 16k, 28 against 41 at its 8 x 2k, 150 against 177 a chunk of 64k (G = 16)
# and 156 against 172 a chunk of 128k (H200, benchmarks in BENCHMARKS.md).
TOP_N_TILE = 256
TOP_N_WARPS: int | None = None  # the rule's warps; an int: that many (benchmarks time other choices)


def top_n_launch(num_sel_blocks: int) -> dict[str, int]:
    """``NS_PAD`` (the blocks of a row up to a power of two), ``BLOCK_R`` (pairs a program) and
    ``num_warps`` of the top-n kernel for rows of ``num_sel_blocks`` selection blocks."""
    ns_pad = max(16, next_power_of_2(num_sel_blocks))
    block_r = max(1, min(64, TOP_N_TILE // ns_pad))
    warps = TOP_N_WARPS if TOP_N_WARPS is not None else max(1, min(4, ns_pad * block_r // 512))
    return dict(NS_PAD=ns_pad, BLOCK_R=block_r, num_warps=warps)


# ---------------------------------------------------------------------------------------------- launchers


def _launch_importance(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse: torch.Tensor,
    imp: torch.Tensor,
    row0: int,
    rows: int,
    *,
    block_len: int,
    block_stride: int,
    sel_block_len: int,
    q_offset: int,
    scale: float,
) -> None:
    # imp[:, :rows] = importance [B, rows, HKV, Ns] of query rows row0 .. row0 + rows - 1
    B, Tq, HQ, D = q.shape
    Nc, HKV = k_cmp.shape[1], k_cmp.shape[2]
    num_sel_blocks = imp.shape[-1]
    assert imp.stride()[1:] == (HKV * num_sel_blocks, num_sel_blocks, 1)
    if Nc == 0:
        imp[:, :rows].zero_()
        return
    acc, precision = kernel_dtypes(q.dtype)
    config = importance_config(q.dtype, D)
    R, K = block_len // block_stride, sel_block_len // block_stride
    grid = (cdiv(rows, config["BLOCK_M"]), cdiv(num_sel_blocks, config["BLOCK_S"]), B * HKV)
    _importance_kernel[grid](
        q, k_cmp, lse, imp, *q.stride()[:3], *k_cmp.stride()[:3], imp.stride(0),
        HQ, HKV, HQ // HKV, Tq, Nc, num_sel_blocks, D, q_offset, row0, rows, scale * LOG2_E,
        BLOCK_LEN=block_len, BLOCK_STRIDE=block_stride, R=R, K=K,
        BLOCK_SPILL=max(16, next_power_of_2(max(1, R - 1))), BLOCK_D=block_sizes(D)[2],
        ACC=acc, PRECISION=precision, **config,
    )  # fmt: skip


def _launch_top_n(
    imp: torch.Tensor,
    block_idx: torch.Tensor,
    row0: int,
    rows: int,
    *,
    sel_block_len: int,
    n_init: int,
    n_local: int,
    q_offset: int,
) -> None:
    # block_idx[:, row0 : row0 + rows] = top-n of imp[:, :rows]
    B, _, HKV, num_sel_blocks = imp.shape
    assert imp.stride()[1:] == (HKV * num_sel_blocks, num_sel_blocks, 1)
    assert block_idx.is_contiguous()
    n_sel = block_idx.shape[-1]
    launch = top_n_launch(num_sel_blocks)
    _top_n_kernel[(cdiv(rows * HKV, launch["BLOCK_R"]), B)](
        imp, block_idx, imp.stride(0), block_idx.stride(0), HKV, num_sel_blocks, q_offset, row0, rows,
        SEL_BLOCK_LEN=sel_block_len, N_INIT=n_init, N_LOCAL=n_local, N_SEL=n_sel,
        BLOCK_N=next_power_of_2(n_sel), **launch,
    )  # fmt: skip


def select_from_lse(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    sel_block_len: int,
    n_sel: int,
    n_init: int,
    n_local: int,
    q_offset: int,
    scale: float,
) -> torch.Tensor:
    """``block_idx [B, Tq, HKV, n_sel]`` from the compressed attention's row log-sum-exp ``lse``.

    Query rows go in chunks whose importance buffer holds at most ``IMPORTANCE_ELEMENTS`` values.
    """
    B, Tq, HQ, D = q.shape
    HKV = k_cmp.shape[2]
    num_sel_blocks = -(-(q_offset + Tq) // sel_block_len)
    block_m = importance_config(q.dtype, D)["BLOCK_M"]
    chunk = max(block_m, IMPORTANCE_ELEMENTS // (B * HKV * num_sel_blocks) // block_m * block_m)
    chunk = min(chunk, Tq)
    imp_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    imp = torch.empty(B, chunk, HKV, num_sel_blocks, dtype=imp_dtype, device=q.device)
    block_idx = torch.empty(B, Tq, HKV, n_sel, dtype=torch.long, device=q.device)
    geometry = dict(block_len=block_len, block_stride=block_stride, sel_block_len=sel_block_len)
    for row0 in range(0, Tq, chunk):
        rows = min(chunk, Tq - row0)
        _launch_importance(q, k_cmp, lse, imp, row0, rows, q_offset=q_offset, scale=scale, **geometry)
        _launch_top_n(
            imp, block_idx, row0, rows,
            sel_block_len=sel_block_len, n_init=n_init, n_local=n_local, q_offset=q_offset,
        )  # fmt: skip
    return block_idx


def triton_top_n_blocks(
    importance: torch.Tensor,
    *,
    sel_block_len: int,
    n_sel: int,
    n_init: int,
    n_local: int,
    q_offset: int = 0,
) -> torch.Tensor:
    """The top-n kernel alone on a full ``importance [B, Tq, HKV, Ns]``: same contract as `select_blocks`.

    For tests and tools; the fused path never holds the whole importance tensor.
    """
    importance = importance.detach().contiguous()
    B, Tq, HKV, _ = importance.shape
    block_idx = torch.empty(B, Tq, HKV, n_sel, dtype=torch.long, device=importance.device)
    if Tq:
        _launch_top_n(
            importance, block_idx, 0, Tq,
            sel_block_len=sel_block_len, n_init=n_init, n_local=n_local, q_offset=q_offset,
        )  # fmt: skip
    return block_idx


def triton_block_importance(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    sel_block_len: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """The importance kernel alone, for all rows: ``[B, Tq, HKV, Ns]`` (float32; float64 for float64).

    Equals ``block_importance(p)`` of `nsa_core.ops.selection` for the compression probabilities ``p``.
    For tests and tools: it holds the ``[T, Ns]`` tensor the fused path avoids.
    """
    check_compressed(q, k_cmp, k_cmp, block_len, block_stride, q_offset)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, Tq, _, _ = q.shape
    num_sel_blocks = -(-(q_offset + Tq) // sel_block_len)
    imp_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    imp = torch.empty(B, Tq, k_cmp.shape[2], num_sel_blocks, dtype=imp_dtype, device=q.device)
    if Tq == 0:
        return imp
    with torch.no_grad():
        q, k_cmp = q.detach().contiguous(), k_cmp.detach().contiguous()
        lse = q.new_zeros(0)
        if k_cmp.shape[1]:
            geometry = dict(key_stride=block_stride, key_offset=block_len - 1, window=None, q_offset=q_offset)
            _, lse = banded_forward(q, k_cmp, k_cmp, scale=scale, compute_o=False, **geometry)
        _launch_importance(
            q, k_cmp, lse, imp, 0, Tq, block_len=block_len, block_stride=block_stride,
            sel_block_len=sel_block_len, q_offset=q_offset, scale=scale,
        )  # fmt: skip
    return imp


class CompressedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_cmp, v_cmp, block_len, block_stride, q_offset, scale):  # type: ignore[override]
        geometry = dict(key_stride=block_stride, key_offset=block_len - 1, window=None, q_offset=q_offset)
        o, lse = banded_forward(q, k_cmp, v_cmp, scale=scale, **geometry)
        ctx.save_for_backward(q, k_cmp, v_cmp, o, lse)
        ctx.geometry, ctx.scale = geometry, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):  # type: ignore[override]
        q, k_cmp, v_cmp, o, lse = ctx.saved_tensors
        dq, dk, dv = banded_backward(do, q, k_cmp, v_cmp, o, lse, scale=ctx.scale, **ctx.geometry)
        return dq, dk, dv, None, None, None, None


# ------------------------------------------------------------------------------------------ public functions

SELECT_KEYS = ("kv_heads", "sel_block_len", "n_sel", "n_init", "n_local")


def check_compressed(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    block_len: int,
    block_stride: int,
    q_offset: int,
) -> None:
    check_qkv(q, k_cmp, v_cmp, q_offset, raw_keys=False)
    if q.dtype != k_cmp.dtype or k_cmp.dtype != v_cmp.dtype:
        raise ValueError(f"q, k_cmp, v_cmp must share one dtype; got {q.dtype}, {k_cmp.dtype}, {v_cmp.dtype}")
    if block_stride < 1 or block_len < 1 or block_len % block_stride:
        raise ValueError(f"block_stride={block_stride} must divide block_len={block_len} (both >= 1)")
    expected = num_compressed_blocks(q_offset + q.shape[1], block_len, block_stride)
    if k_cmp.shape[1] != expected:
        raise ValueError(
            f"k_cmp holds {k_cmp.shape[1]} blocks; {q_offset + q.shape[1]} keys make {expected} complete ones"
        )


def check_select(select: dict[str, Any], kv_heads: int, block_stride: int) -> None:
    if sorted(select) != sorted(SELECT_KEYS):
        raise ValueError(f"select must hold exactly {SELECT_KEYS}; got {tuple(sorted(select))}")
    if select["kv_heads"] != kv_heads:
        raise ValueError(f"select kv_heads={select['kv_heads']} but k_cmp has {kv_heads} KV heads")
    if select["sel_block_len"] < 1 or select["sel_block_len"] % block_stride:
        raise ValueError(f"block_stride={block_stride} must divide sel_block_len={select['sel_block_len']}")
    if select["n_sel"] < 1 or select["n_init"] < 0 or select["n_local"] < 0:
        raise ValueError(f"n_sel >= 1, n_init >= 0 and n_local >= 0 are required; got {select}")


@eager_under_compile
def triton_compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    q_offset: int = 0,
    scale: float | None = None,
    select: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``q [B, Tq, HQ, D]`` over compressed ``k_cmp/v_cmp [B, Nc, HKV, D]``, and the blocks.

    Block ``i`` (tokens ``[i*d, i*d + l)``) is visible to the query at ``t = q_offset + row`` iff
    ``i*d + l - 1 <= t``; a query that sees no block outputs zeros. Differentiable in ``q``, ``k_cmp`` and
    ``v_cmp``. With ``select = dict(kv_heads, sel_block_len, n_sel, n_init, n_local)`` also returns the
    selection ``block_idx [B, Tq, HKV, n_sel]`` (int64, -1 unused), equal to
    ``select_blocks(block_importance(p))`` of the probabilities ``p`` the `compressed_attention` of
    `nsa_core.ops.compression` returns, without materialising ``p``; otherwise ``None``.
    Returns ``(o [B, Tq, HQ, D], block_idx | None)``.
    """
    check_compressed(q, k_cmp, v_cmp, block_len, block_stride, q_offset)
    if select is not None:
        check_select(select, k_cmp.shape[2], block_stride)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[1] == 0:
        block_idx = None if select is None else q.new_empty(*q.shape[:2], k_cmp.shape[2], select["n_sel"])
        return torch.zeros_like(q), None if block_idx is None else block_idx.long()
    q = q.contiguous()
    if k_cmp.shape[1] == 0:
        # no query sees a block yet: zero output (as the reference: q * 0), the forced blocks alone
        o, lse = q * 0, None
    else:
        o, lse = CompressedAttentionFunction.apply(
            q, k_cmp.contiguous(), v_cmp.contiguous(), block_len, block_stride, q_offset, scale
        )
    if select is None:
        return o, None
    block_idx = select_from_lse(
        q.detach(), k_cmp.detach().contiguous(), lse if lse is not None else q.new_zeros(0),
        block_len=block_len, block_stride=block_stride, q_offset=q_offset, scale=scale,
        **{key: select[key] for key in SELECT_KEYS if key != "kv_heads"},
    )  # fmt: skip
    return o, block_idx


@eager_under_compile
def triton_compressed_block_select(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    sel_block_len: int,
    n_sel: int,
    n_init: int,
    n_local: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """The selection alone (``force_branch="sel"``): ``block_idx [B, Tq, HKV, n_sel]``, no gradient.

    The same blocks as ``triton_compressed_attention(..., select=...)[1]``; the forward pass skips the
    values, so ``v_cmp`` is not needed.
    """
    check_compressed(q, k_cmp, k_cmp, block_len, block_stride, q_offset)
    select = dict(kv_heads=k_cmp.shape[2], sel_block_len=sel_block_len, n_sel=n_sel, n_init=n_init,
                  n_local=n_local)  # fmt: skip
    check_select(select, k_cmp.shape[2], block_stride)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[1] == 0:
        return torch.empty(*q.shape[:2], k_cmp.shape[2], n_sel, dtype=torch.long, device=q.device)
    with torch.no_grad():
        q, k_cmp = q.detach().contiguous(), k_cmp.detach().contiguous()
        lse = q.new_zeros(0)
        if k_cmp.shape[1]:
            geometry = dict(key_stride=block_stride, key_offset=block_len - 1, window=None, q_offset=q_offset)
            _, lse = banded_forward(q, k_cmp, k_cmp, scale=scale, compute_o=False, **geometry)
        return select_from_lse(
            q, k_cmp, lse, block_len=block_len, block_stride=block_stride, sel_block_len=sel_block_len,
            n_sel=n_sel, n_init=n_init, n_local=n_local, q_offset=q_offset, scale=scale,
        )  # fmt: skip
