"""Selection branch: block importance (Eq. 9 and 10), top-n with forced blocks, and selected attention.

Importance comes from the compression probabilities: selection block ``j`` (tokens ``[j*l', (j+1)*l')``)
is split into ``l'/d`` chunks of ``d`` tokens, each chunk collects the probability of every compressed block
that contains it (Eq. 9), and the query heads of a KV group add their scores (Eq. 10), so all heads of a
group read the same blocks. The initial and local blocks are always taken.

Backends of the attention over the chosen blocks:
- ``reference``: per-token loop (`naive_selected_attention`).
- ``masked``: a dense ``[Tq, Tk]`` mask per KV group. O(S^2) memory, on purpose: it reproduces the seeds'.
- ``gather``: gathers the ``n * l'`` chosen keys of every query; O(S * n * l') memory, einsum attention.
- ``packed``: the same chosen keys packed as one short sequence per (query, KV group) and attended by
  ``scaled_dot_product_attention`` with the group's query heads as the query length; O(S * n * l').
- ``triton``: `nsa_core.ops.triton.selection`, streaming the chosen blocks per (query, KV group), with a
  backward through an inverted index of the queries that chose each block; O(S * n) memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nsa_core.ops.common import check_qkv, group_queries, masked_softmax, triton_op, upcast
from nsa_core.ops.reference import naive_selected_attention


def block_importance(
    p: torch.Tensor,
    *,
    kv_heads: int,
    block_len: int,
    block_stride: int,
    sel_block_len: int,
    num_keys: int,
) -> torch.Tensor:
    """Selection-block importance per KV group from compression probabilities ``p [B, Tq, HQ, Nc]``.

    Returns ``[B, Tq, HKV, Ns]`` with ``Ns = ceil(num_keys / sel_block_len)``.
    """
    B, Tq, HQ, Nc = p.shape
    r, k = block_len // block_stride, sel_block_len // block_stride
    num_sel_blocks = -(-num_keys // sel_block_len)
    num_chunks = num_sel_blocks * k
    if Nc > num_chunks:
        raise ValueError(f"p has {Nc} compressed blocks, more than {num_keys} keys can hold")
    p_group = p.view(B, Tq, kv_heads, HQ // kv_heads, Nc).sum(3)  # Eq. 10: [B, Tq, HKV, Nc]
    # chunk c collects blocks c-r+1 .. c: pad r-1 zeros in front, then a width-r running sum
    padded = F.pad(p_group, (r - 1, num_chunks - Nc))  # [B, Tq, HKV, num_chunks + r - 1]
    chunks = padded.unfold(-1, r, 1).sum(-1)  # [B, Tq, HKV, num_chunks]
    return chunks.view(B, Tq, kv_heads, num_sel_blocks, k).sum(-1)  # Eq. 9


def select_blocks(
    importance: torch.Tensor,
    *,
    sel_block_len: int,
    n_sel: int,
    n_init: int,
    n_local: int,
    q_offset: int = 0,
) -> torch.Tensor:
    """The ``n_sel`` blocks each query reads: forced ones first, then by importance, ties to the lower index.

    ``importance [B, Tq, HKV, Ns]``; blocks starting after the query are never taken; slots left over
    hold -1. Returns ``block_idx [B, Tq, HKV, n_sel]`` (int64).
    """
    B, Tq, HKV, Ns = importance.shape
    device = importance.device
    t = torch.arange(q_offset, q_offset + Tq, device=device)[:, None]  # [Tq, 1]
    j = torch.arange(Ns, device=device)[None, :]  # [1, Ns]
    own = t // sel_block_len
    candidate = (j * sel_block_len <= t)[None, :, None, :]
    forced = ((j < n_init) | ((j <= own) & (j > own - n_local)))[None, :, None, :]
    key = importance.detach()
    key = torch.where(forced, torch.full_like(key, float("inf")), key)
    key = torch.where(candidate, key, torch.full_like(key, float("-inf")))
    # a stable descending sort keeps equal keys in ascending block order: the tie rule
    ranked, order = torch.sort(key, dim=-1, descending=True, stable=True)
    take = min(n_sel, Ns)
    idx = torch.where(ranked[..., :take] == float("-inf"), -1, order[..., :take])
    if take < n_sel:
        idx = F.pad(idx, (0, n_sel - take), value=-1)
    return idx


def _selected_token_index(
    block_idx: torch.Tensor, sel_block_len: int, q_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # token positions of every selected block, and which of them a query may read (s <= t, slot used)
    B, Tq, HKV, n = block_idx.shape
    offsets = torch.arange(sel_block_len, device=block_idx.device)
    tokens = block_idx[..., None] * sel_block_len + offsets  # [B, Tq, HKV, n, l']
    t = torch.arange(q_offset, q_offset + Tq, device=block_idx.device)[None, :, None, None, None]
    valid = (block_idx[..., None] >= 0) & (tokens <= t)
    tokens = torch.where(valid, tokens, 0)
    return tokens.view(B, Tq, HKV, n * sel_block_len), valid.view(B, Tq, HKV, n * sel_block_len)


def _gather_keys(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # x [B, Tk, HKV, D], tokens [B, Tq, HKV, S] -> [B, Tq, HKV, S, D]
    # Half-precision keys are gathered from a float32 copy: the gather's backward scatter-adds the
    # gradients of every query that chose a key, and summed in bf16 they lost ~3x the accuracy of the
    # masked backend's matmul (nsa-diag verify, m7c-125m, H100). The result is cast back.
    B, Tq, HKV, S = tokens.shape
    D = x.shape[-1]
    index = tokens.permute(0, 2, 1, 3).reshape(B, HKV, Tq * S, 1).expand(-1, -1, -1, D)
    gathered = torch.gather(upcast(x).transpose(1, 2), 2, index)  # [B, HKV, Tq*S, D]
    return gathered.view(B, HKV, Tq, S, D).transpose(1, 2).to(x.dtype)


def masked_selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    sel_block_len: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Selected attention through a dense ``[B, Tq, HKV, Tk]`` mask (quadratic memory, on purpose)."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    num_sel_blocks = -(-Tk // sel_block_len)
    slots = torch.where(block_idx < 0, num_sel_blocks, block_idx)  # unused slots hit a spare column
    chosen = torch.zeros(B, Tq, HKV, num_sel_blocks + 1, dtype=torch.bool, device=q.device)
    chosen = chosen.scatter(-1, slots, True)[..., :num_sel_blocks]
    s = torch.arange(Tk, device=q.device)
    t = torch.arange(q_offset, q_offset + Tq, device=q.device)
    causal = (s[None, :] <= t[:, None])[None, :, None, :]
    allowed = chosen[..., s // sel_block_len] & causal  # [B, Tq, HKV, Tk]
    scores = torch.einsum("btkgd,bskd->btkgs", group_queries(q, HKV), k) * scale
    p = masked_softmax(scores, allowed[:, :, :, None, :])
    return torch.einsum("btkgs,bskd->btkgd", p.to(v.dtype), v).reshape(B, Tq, HQ, D)


def gather_selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    sel_block_len: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Selected attention over the gathered ``n * l'`` keys of each query."""
    B, Tq, HQ, D = q.shape
    HKV = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    tokens, valid = _selected_token_index(block_idx, sel_block_len, q_offset)
    k_sel, v_sel = _gather_keys(k, tokens), _gather_keys(v, tokens)  # [B, Tq, HKV, S, D]
    scores = torch.einsum("btkgd,btksd->btkgs", group_queries(q, HKV), k_sel) * scale
    p = masked_softmax(scores, valid[:, :, :, None, :])
    return torch.einsum("btkgs,btksd->btkgd", p.to(v.dtype), v_sel).reshape(B, Tq, HQ, D)


def packed_selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    sel_block_len: int,
    q_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Selected attention with every (query, KV group) packed as one SDPA batch entry.

    Each packed entry holds the ``G`` query heads of the group as its queries and the ``n * l'`` chosen keys;
    every query reads at least its own token, so no row is fully masked.
    """
    B, Tq, HQ, D = q.shape
    HKV = k.shape[2]
    G = HQ // HKV
    tokens, valid = _selected_token_index(block_idx, sel_block_len, q_offset)
    S = tokens.shape[-1]
    k_sel, v_sel = _gather_keys(k, tokens), _gather_keys(v, tokens)  # [B, Tq, HKV, S, D]
    N = B * Tq * HKV
    o = F.scaled_dot_product_attention(
        q.reshape(N, 1, G, D),
        k_sel.reshape(N, 1, S, D),
        v_sel.reshape(N, 1, S, D),
        attn_mask=valid.reshape(N, 1, 1, S),
        scale=scale,
    )
    return o.reshape(B, Tq, HQ, D)


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    sel_block_len: int,
    q_offset: int = 0,
    scale: float | None = None,
    backend: str = "gather",
) -> torch.Tensor:
    """Attention of ``q [B, Tq, HQ, D]`` over the keys ``s <= t`` of its selected blocks.

    ``k/v [B, Tk, HKV, D]`` with ``Tk = q_offset + Tq``; ``block_idx [B, Tq, HKV, n]`` from `select_blocks`
    (-1 marks an unused slot). Returns ``[B, Tq, HQ, D]``.
    """
    check_qkv(q, k, v, q_offset)
    if block_idx.shape[:3] != (q.shape[0], q.shape[1], k.shape[2]):
        raise ValueError(f"block_idx {tuple(block_idx.shape)} must be [B, Tq, HKV, n] for q {tuple(q.shape)}")
    kwargs = dict(sel_block_len=sel_block_len, q_offset=q_offset, scale=scale)
    if backend == "gather":
        return gather_selected_attention(q, k, v, block_idx, **kwargs)
    elif backend == "packed":
        return packed_selected_attention(q, k, v, block_idx, **kwargs)
    elif backend == "masked":
        return masked_selected_attention(q, k, v, block_idx, **kwargs)
    elif backend == "reference":
        return naive_selected_attention(q, k, v, block_idx, **kwargs)
    elif backend == "triton":
        return triton_op("selection", "triton_selected_attention")(q, k, v, block_idx, **kwargs)
    else:
        raise NotImplementedError(f"sel backend {backend!r}; use reference, masked, gather, packed or triton")
