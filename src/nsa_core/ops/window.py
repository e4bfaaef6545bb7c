"""Sliding-window branch: the query at ``t`` attends to keys ``t - w + 1 .. t``.

Backends:
- ``reference``: per-token loop (`naive_sliding_window_attention`).
- ``masked``: one dense ``[Tq, Tk]`` band mask; O(S^2) memory, as the seeds had it.
- ``chunked``: queries in chunks of ``C = min(Tq, w)``; each chunk reads only its ``C + w - 1`` keys, so
  scores and memory are O(S * w).
- ``triton``: `nsa_core.ops.triton.window`, banded flash attention, O(S * w) forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nsa_core.ops.common import check_qkv, group_queries, masked_softmax, triton_op
from nsa_core.ops.reference import naive_sliding_window_attention


def masked_sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Sliding-window attention through a dense band mask."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    t = torch.arange(q_offset, q_offset + Tq, device=q.device)[:, None]
    s = torch.arange(Tk, device=q.device)[None, :]
    band = (s <= t) & (s > t - window)  # [Tq, Tk]
    scores = torch.einsum("btkgd,bskd->btkgs", group_queries(q, HKV), k) * scale
    p = masked_softmax(scores, band[None, :, None, None, :])
    return torch.einsum("btkgs,bskd->btkgd", p.to(v.dtype), v).reshape(B, Tq, HQ, D)


def chunked_sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Sliding-window attention in query chunks, O(S * w) in time and memory."""
    B, Tq, HQ, D = q.shape
    HKV = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    chunk = min(Tq, window)
    span = chunk + window - 1  # keys one chunk reads
    num_chunks = -(-Tq // chunk)
    # keep the keys some query can see, then pad so that key s sits at index s - q_offset + w - 1
    first_key = max(0, q_offset - window + 1)
    pad_front = first_key - q_offset + window - 1
    pad_back = num_chunks * chunk - Tq
    real = torch.arange(num_chunks * chunk + window - 1, device=q.device)
    real = (real >= pad_front) & (real < pad_front + k.shape[1] - first_key)

    def windows(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x[:, first_key:], (0, 0, 0, 0, pad_front, pad_back))
        return x.unfold(1, span, chunk)  # [B, n, HKV, D, span]

    k_win, v_win = windows(k), windows(v)
    q_chunks = F.pad(q, (0, 0, 0, 0, 0, pad_back)).view(B, num_chunks, chunk, HKV, HQ // HKV, D)
    i = torch.arange(chunk, device=q.device)[:, None]
    j = torch.arange(span, device=q.device)[None, :]
    band = (j >= i) & (j <= i + window - 1)  # [C, span]: query i of a chunk reads keys i .. i + w - 1
    key_real = real.unfold(0, span, chunk)  # [n, span]
    mask = band[None, :, :] & key_real[:, None, :]  # [n, C, span]
    scores = torch.einsum("bnckgd,bnkdj->bnckgj", q_chunks, k_win) * scale
    p = masked_softmax(scores, mask[None, :, :, None, None, :])
    o = torch.einsum("bnckgj,bnkdj->bnckgd", p.to(v.dtype), v_win)
    return o.reshape(B, num_chunks * chunk, HQ, D)[:, :Tq]


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    q_offset: int = 0,
    scale: float | None = None,
    backend: str = "chunked",
) -> torch.Tensor:
    """Attention of ``q [B, Tq, HQ, D]`` over keys ``t - w + 1 .. t`` of ``k/v [B, Tk, HKV, D]``.

    ``Tk = q_offset + Tq``; the query in row ``i`` sits at ``t = q_offset + i``. Returns ``[B, Tq, HQ, D]``.
    """
    check_qkv(q, k, v, q_offset)
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    kwargs = dict(window=window, q_offset=q_offset, scale=scale)
    if backend == "chunked":
        return chunked_sliding_window_attention(q, k, v, **kwargs)
    elif backend == "masked":
        return masked_sliding_window_attention(q, k, v, **kwargs)
    elif backend == "reference":
        return naive_sliding_window_attention(q, k, v, **kwargs)
    elif backend == "triton":
        return triton_op("window", "triton_sliding_window_attention")(q, k, v, **kwargs)
    else:
        raise NotImplementedError(f"win backend {backend!r}; use reference, masked, chunked or triton")
