"""Naive per-token NSA: the ground truth every backend is tested against.

One function per branch, each mirroring its fast counterpart argument for argument. Every function loops
over query tokens (and, for selection, over batch and KV groups) and writes the paper's definitions down
directly; no masks over the whole sequence, no clever indexing. Run it in float64 for tests.

Shapes: queries ``[B, Tq, HQ, D]`` at absolute positions ``q_offset .. q_offset + Tq - 1``; raw keys and
values ``[B, Tk, HKV, D]`` with ``Tk = q_offset + Tq``; compressed keys and values ``[B, Nc, HKV, D]``.
Query head ``h`` reads KV head ``h // G`` with ``G = HQ // HKV``. Frozen: tune the fast paths, not this file.
"""

from __future__ import annotations

import torch


def _expand_kv(x: torch.Tensor, group_size: int) -> torch.Tensor:
    # [B, T, HKV, D] -> [B, T, HQ, D]: query head h reads KV head h // G
    return x.repeat_interleave(group_size, dim=2)


def _upcast(scores: torch.Tensor) -> torch.Tensor:
    # softmax in at least float32
    return scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q [B, HQ, D], k/v [B, S, HQ, D] -> [B, HQ, D]
    probs = torch.softmax(_upcast(torch.einsum("bhd,bshd->bhs", q, k)) * scale, dim=-1)
    return torch.einsum("bhs,bshd->bhd", probs.to(v.dtype), v)


def naive_compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over the compressed blocks complete at its position.

    Block ``i`` covers tokens ``[i*d, i*d + l)``; the query at ``t`` sees it iff ``i*d + l - 1 <= t``.
    A query that sees no block outputs zeros and has zero probabilities.

    Returns ``(o [B, Tq, HQ, D], p [B, Tq, HQ, Nc])`` where ``p`` is the softmax over visible blocks
    (float32 for half-precision inputs).
    """
    B, Tq, HQ, D = q.shape
    Nc, HKV = k_cmp.shape[1], k_cmp.shape[2]
    scale = D**-0.5 if scale is None else scale
    k_all, v_all = _expand_kv(k_cmp, HQ // HKV), _expand_kv(v_cmp, HQ // HKV)
    outputs, probs = [], []
    for i in range(Tq):
        t = q_offset + i
        visible = 0 if t < block_len - 1 else min(Nc, (t - block_len + 1) // block_stride + 1)
        if visible == 0:
            outputs.append(q[:, i] * 0)
            probs.append(_upcast(q.new_zeros(B, HQ, Nc)))
            continue
        k, v = k_all[:, :visible], v_all[:, :visible]
        scores = _upcast(torch.einsum("bhd,bshd->bhs", q[:, i], k)) * scale
        p = torch.softmax(scores, dim=-1)  # kept in float32 for half inputs: it ranks blocks
        outputs.append(torch.einsum("bhs,bshd->bhd", p.to(v.dtype), v))
        probs.append(torch.cat([p, p.new_zeros(B, HQ, Nc - visible)], dim=-1))
    return torch.stack(outputs, dim=1), torch.stack(probs, dim=1)


def naive_select_blocks(
    p: torch.Tensor,
    *,
    kv_heads: int,
    block_len: int,
    block_stride: int,
    sel_block_len: int,
    n_sel: int,
    n_init: int,
    n_local: int,
    num_keys: int,
    q_offset: int = 0,
) -> torch.Tensor:
    """Top-n selection blocks per query and KV group from the compression probabilities ``p [B, Tq, HQ, Nc]``.

    Importance of selection block ``j`` (Eq. 9): each of its ``l'/d`` chunks of ``d`` tokens collects the
    probability of every compressed block that contains the chunk; summed over the query heads of the KV
    group (Eq. 10). Forced blocks (the ``n_init`` first, the ``n_local`` ending at the query's own) come
    first in ascending order, then the rest by importance, ties to the lower index; only blocks starting at
    or before the query are candidates; unused slots hold -1.

    Returns ``block_idx [B, Tq, HKV, n_sel]`` (int64).
    """
    B, Tq, HQ, Nc = p.shape
    group = HQ // kv_heads
    r, k = block_len // block_stride, sel_block_len // block_stride
    num_sel_blocks = -(-num_keys // sel_block_len)
    device = p.device
    p = p.detach().double().cpu()
    out = torch.full((B, Tq, kv_heads, n_sel), -1, dtype=torch.long)
    for b in range(B):
        for i in range(Tq):
            t = q_offset + i
            own = t // sel_block_len
            for g in range(kv_heads):
                p_group = p[b, i, g * group : (g + 1) * group].sum(0).tolist()  # Eq. 10
                importance = []
                for j in range(num_sel_blocks):
                    total = 0.0
                    for m in range(k):  # chunk c = j*k + m
                        for n in range(r):  # compressed block i = c - n contains chunk c
                            ci = j * k + m - n
                            if 0 <= ci < Nc:
                                total += p_group[ci]
                    importance.append(total)
                candidates = [j for j in range(num_sel_blocks) if j * sel_block_len <= t]
                forced = [j for j in candidates if j < n_init or own - n_local < j <= own]
                rest = sorted((j for j in candidates if j not in forced), key=lambda j: (-importance[j], j))
                chosen = (forced + rest)[:n_sel]
                out[b, i, g, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
    return out.to(device)


def naive_selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    sel_block_len: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of each query over the keys ``s <= t`` of its selected blocks ``block_idx [B, Tq, HKV, n]``.

    Every query head of a KV group attends to the blocks selected for that group. Returns ``[B, Tq, HQ, D]``.
    """
    B, Tq, HQ, D = q.shape
    HKV = k.shape[2]
    group = HQ // HKV
    scale = D**-0.5 if scale is None else scale
    idx = block_idx.cpu()
    rows = []
    for b in range(B):
        tokens = []
        for i in range(Tq):
            t = q_offset + i
            heads = []
            for g in range(HKV):
                blocks = sorted(j for j in idx[b, i, g].tolist() if j >= 0)
                keys = [
                    s for j in blocks for s in range(j * sel_block_len, (j + 1) * sel_block_len) if s <= t
                ]
                pos = torch.tensor(keys, dtype=torch.long, device=k.device)
                kk, vv = k[b, pos, g], v[b, pos, g]  # [S, D]
                qq = q[b, i, g * group : (g + 1) * group]  # [G, D]
                probs = torch.softmax(_upcast(qq @ kk.T) * scale, dim=-1)
                heads.append(probs.to(vv.dtype) @ vv)
            tokens.append(torch.cat(heads, dim=0))
        rows.append(torch.stack(tokens, dim=0))
    return torch.stack(rows, dim=0)


def naive_sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of the query at ``t`` over keys ``max(0, t - w + 1) .. t``. Returns ``[B, Tq, HQ, D]``."""
    B, Tq, HQ, D = q.shape
    group = HQ // k.shape[2]
    scale = D**-0.5 if scale is None else scale
    k_all, v_all = _expand_kv(k, group), _expand_kv(v, group)
    outputs = []
    for i in range(Tq):
        t = q_offset + i
        lo = max(0, t - window + 1)
        outputs.append(_attend(q[:, i], k_all[:, lo : t + 1], v_all[:, lo : t + 1], scale))
    return torch.stack(outputs, dim=1)
