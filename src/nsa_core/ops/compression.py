"""Compression branch: overlapping blocks of keys/values and attention over the complete ones.

Compressed block ``i`` covers tokens ``[i*d, i*d + l)``; `unfold_blocks` exposes such blocks as a strided
view (the learnable phi that turns a block into one key lives in `nsa_core.layers.attention`). Compressed
attention returns, beside its output, the softmax probabilities that score blocks for selection.

Backends: ``reference`` (per-token loop, `naive_compressed_attention`) and ``masked`` (one batched
softmax over a ``[Tq, Nc]`` visibility mask; O(T * T/d) scores). The ``triton`` backend
(`nsa_core.ops.triton.compression`) returns the selected blocks instead of ``p``; `NSAAttention` calls it.
"""

from __future__ import annotations

import torch

from nsa_core.ops.common import check_qkv, group_queries, masked_softmax
from nsa_core.ops.reference import naive_compressed_attention


def num_compressed_blocks(num_keys: int, block_len: int, block_stride: int) -> int:
    """Complete compressed blocks among ``num_keys`` tokens."""
    return 0 if num_keys < block_len else (num_keys - block_len) // block_stride + 1


def unfold_blocks(x: torch.Tensor, block_len: int, block_stride: int, first: int = 0) -> torch.Tensor:
    """Blocks ``first ..`` of ``x [B, T, H, D]`` as a view ``[B, N, H, l, D]`` (``N`` complete blocks)."""
    T = x.shape[1]
    start = first * block_stride
    if T - start < block_len:
        return x.new_empty(x.shape[0], 0, x.shape[2], block_len, x.shape[3])
    # unfold puts the window last: [B, N, H, D, l] -> [B, N, H, l, D]
    return x[:, start:].unfold(1, block_len, block_stride).transpose(-1, -2)


def masked_compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched compressed attention; same contract as `naive_compressed_attention`."""
    B, Tq, HQ, D = q.shape
    Nc, HKV = k_cmp.shape[1], k_cmp.shape[2]
    scale = D**-0.5 if scale is None else scale
    qg = group_queries(q, HKV)  # [B, Tq, HKV, G, D]
    scores = torch.einsum("btkgd,bnkd->btkgn", qg, k_cmp) * scale  # [B, Tq, HKV, G, Nc]
    t = torch.arange(q_offset, q_offset + Tq, device=q.device)
    block_end = torch.arange(Nc, device=q.device) * block_stride + block_len - 1
    visible = (block_end[None, :] <= t[:, None])[None, :, None, None, :]  # [1, Tq, 1, 1, Nc]
    p = masked_softmax(scores, visible)
    o = torch.einsum("btkgn,bnkd->btkgd", p.to(v_cmp.dtype), v_cmp)
    return o.reshape(B, Tq, HQ, D), p.reshape(B, Tq, HQ, Nc)


def compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    *,
    block_len: int,
    block_stride: int,
    q_offset: int = 0,
    scale: float | None = None,
    backend: str = "masked",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Tq, HQ, D]`` over compressed ``k_cmp/v_cmp [B, Nc, HKV, D]``.

    Block ``i`` is visible to the query at ``t = q_offset + row`` iff ``i*d + l - 1 <= t``; a query that
    sees no block outputs zeros. Returns ``(o [B, Tq, HQ, D], p [B, Tq, HQ, Nc])``, ``p`` the probabilities
    (zero for invisible blocks) that `nsa_core.ops.selection.block_importance` turns into block scores.
    """
    check_qkv(q, k_cmp, v_cmp, q_offset, raw_keys=False)
    expected = num_compressed_blocks(q_offset + q.shape[1], block_len, block_stride)
    if k_cmp.shape[1] != expected:
        raise ValueError(
            f"k_cmp holds {k_cmp.shape[1]} blocks; {q_offset + q.shape[1]} keys make {expected} complete ones"
        )
    kwargs = dict(block_len=block_len, block_stride=block_stride, q_offset=q_offset, scale=scale)
    if backend == "masked":
        return masked_compressed_attention(q, k_cmp, v_cmp, **kwargs)
    elif backend == "reference":
        return naive_compressed_attention(q, k_cmp, v_cmp, **kwargs)
    elif backend == "triton":
        raise NotImplementedError(
            "the triton cmp backend never materialises p; call "
            "nsa_core.ops.triton.compression.triton_compressed_attention(..., select=...), which returns the "
            "selected blocks instead, or use backend 'masked'"
        )
    else:
        raise NotImplementedError(f"cmp backend {backend!r}; use 'reference' or 'masked'")
