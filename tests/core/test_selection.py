"""Block importance and top-n selection: hand-computed examples, and fast == naive == the spec's rule.

The oracle in `utils` writes the spec's sentences down once more, independently of `naive_select_blocks`,
so a mistake shared by the fast path and the reference still fails here.
"""

from __future__ import annotations

import pytest
import torch

from nsa_core.ops.reference import naive_compressed_attention, naive_select_blocks
from nsa_core.ops.selection import block_importance, select_blocks

from .utils import DTYPE, TINY, Geometry, assert_close, oracle_importance, oracle_select, visible_blocks_mask

B, HKV = 2, 2

GEOMETRIES = [
    TINY,  # r = l/d = 2 compressed blocks per chunk, k = l'/d = 4 chunks per selection block
    Geometry(block_len=16, block_stride=4, sel_block_len=16, n_sel=3, n_init=0, n_local=1),  # r = 4
    Geometry(block_len=4, block_stride=4, sel_block_len=8, n_sel=5, n_init=2, n_local=2),  # r = 1: no overlap
    Geometry(block_len=16, block_stride=8, sel_block_len=8, n_sel=4, n_init=1, n_local=1),  # l > l'
]
SEQUENCES = [(1, 0), (37, 0), (64, 0), (1, 44), (5, 40)]


def seq_id(tq: int, q_offset: int) -> str:
    return f"T{tq}" if q_offset == 0 else f"Tq{tq}-off{q_offset}"


def compression_probs(source: str, group: int, tq: int, q_offset: int, geo: Geometry) -> torch.Tensor:
    """``p [B, Tq, HQ, Nc]``, zero on blocks the query cannot see."""
    nc = geo.num_cmp_blocks(q_offset + tq)
    hq = HKV * group
    if source == "attention":  # the real thing: softmax of random queries over random compressed keys
        q = torch.randn(B, tq, hq, 16, dtype=DTYPE)
        k_cmp = torch.randn(B, nc, HKV, 16, dtype=DTYPE)
        _, p = naive_compressed_attention(
            q, k_cmp, k_cmp, block_len=geo.block_len, block_stride=geo.block_stride, q_offset=q_offset
        )
        return p
    if source == "random":
        p = torch.rand(B, tq, hq, nc, dtype=DTYPE)
    elif source == "integer":  # small integers: exact sums and many ties, so the tie rule decides
        p = torch.randint(0, 3, (B, tq, hq, nc)).to(DTYPE)
    else:
        raise ValueError(source)
    return p * visible_blocks_mask(nc, q_offset, tq, geo)[None, :, None, :]


def importance_kwargs(geo: Geometry, num_keys: int) -> dict[str, int]:
    return dict(
        kv_heads=HKV,
        block_len=geo.block_len,
        block_stride=geo.block_stride,
        sel_block_len=geo.sel_block_len,
        num_keys=num_keys,
    )


def select_kwargs(geo: Geometry, q_offset: int) -> dict[str, int]:
    return dict(
        sel_block_len=geo.sel_block_len,
        n_sel=geo.n_sel,
        n_init=geo.n_init,
        n_local=geo.n_local,
        q_offset=q_offset,
    )


# --- hand-computed examples --------------------------------------------------------------------------------


def test_block_importance_hand_example() -> None:
    """l=4 d=2 l'=4, 10 keys: compressed blocks [0,4) [2,6) [4,8) [6,10), selection blocks [0,4) [4,8) [8,12).

    Chunks of d=2 tokens: c0 in block 0; c1 in 0,1; c2 in 1,2; c3 in 2,3; c4 in 3; c5 in none. Selection block
    j sums chunks 2j and 2j+1: imp0 = 2 p0 + p1, imp1 = p1 + 2 p2 + p3, imp2 = p3. Heads 0,1 form group 0.
    """
    p = torch.tensor(
        [[1.0, 10.0, 100.0, 1000.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]],
        dtype=DTYPE,
    )[None, None]  # [B=1, Tq=1, HQ=4, Nc=4]
    importance = block_importance(p, kv_heads=2, block_len=4, block_stride=2, sel_block_len=4, num_keys=10)
    expected = torch.tensor([[16.0, 1210.0, 1000.0], [0.0, 3.0, 1.0]], dtype=DTYPE)[None, None]
    assert importance.shape == (1, 1, 2, 3)
    assert_close("importance", expected, importance)


def test_select_blocks_hand_example() -> None:
    """l'=4, n=5, 1 initial + 2 local blocks; 26 keys make 7 selection blocks.

    Group 0 importance [0, .5, .9, .5, 9, 9, 100]: block 0 is forced however low it scores, block 6 starts at
    24 and is never a candidate before t=24, blocks 1 and 3 tie and the lower index goes first.
    """
    imp = torch.tensor(
        [[0.0, 0.5, 0.9, 0.5, 9.0, 9.0, 100.0], [0.0, 0.9, 0.5, 0.5, 0.0, 0.0, 0.0]], dtype=DTYPE
    )
    importance = imp[None, None].expand(1, 26, 2, 7)
    idx = select_blocks(importance, sel_block_len=4, n_sel=5, n_init=1, n_local=2)
    assert idx.dtype == torch.long
    assert idx.shape == (1, 26, 2, 5)
    expected = {  # t -> (group 0, group 1)
        0: ([0, -1, -1, -1, -1], [0, -1, -1, -1, -1]),  # one candidate: padding
        5: ([0, 1, -1, -1, -1], [0, 1, -1, -1, -1]),  # initial and local overlap: no duplicate
        13: ([0, 2, 3, 1, -1], [0, 2, 3, 1, -1]),
        21: ([0, 4, 5, 2, 1], [0, 4, 5, 1, 2]),  # forced first, then by importance, tie 1 vs 3 -> 1
        25: ([0, 5, 6, 4, 2], [0, 5, 6, 1, 2]),  # 6 is now local; 4 beats 2
    }
    for t, (group0, group1) in expected.items():
        assert idx[0, t, 0].tolist() == group0, f"t={t} group 0"
        assert idx[0, t, 1].tolist() == group1, f"t={t} group 1"
    # the same rows as decode steps
    for t in expected:
        step = select_blocks(
            importance[:, t : t + 1], sel_block_len=4, n_sel=5, n_init=1, n_local=2, q_offset=t
        )
        assert torch.equal(step, idx[:, t : t + 1]), f"t={t} with q_offset"


@pytest.mark.parametrize("fn", ["select_blocks", "naive_select_blocks"])
def test_all_forced_rows(fn: str) -> None:
    """Before n_init + n_local selection blocks exist, every candidate is forced: blocks 0..own, then -1."""
    geo, tq = TINY, 48  # tiny: 1 initial + 2 local blocks of 16 tokens
    if fn == "select_blocks":
        importance = torch.rand(B, tq, HKV, 3, dtype=DTYPE)
        idx = select_blocks(importance, **select_kwargs(geo, 0))
    else:
        p = compression_probs("random", 2, tq, 0, geo)
        idx = naive_select_blocks(p, kv_heads=HKV, num_keys=tq, **geo.select_kwargs())
    for t in range(tq):
        own = t // geo.sel_block_len
        expected = list(range(own + 1)) + [-1] * (geo.n_sel - own - 1)
        assert (idx[:, t] == torch.tensor(expected)).all(), f"t={t}: {idx[:, t].tolist()} != {expected}"


def test_select_blocks_single_token() -> None:
    idx = select_blocks(torch.rand(1, 1, 1, 1, dtype=DTYPE), **select_kwargs(TINY, 0))
    assert idx.tolist() == [[[[0, -1, -1, -1]]]]


# --- fast == naive == the spec's rule ----------------------------------------------------------------------


@pytest.mark.parametrize("source", ["random", "integer", "attention"])
@pytest.mark.parametrize("tq, q_offset", [pytest.param(tq, off, id=seq_id(tq, off)) for tq, off in SEQUENCES])
@pytest.mark.parametrize("geo", [pytest.param(g, id=g.id) for g in GEOMETRIES])
def test_selection_matches_naive_and_rule(geo: Geometry, tq: int, q_offset: int, source: str) -> None:
    group, num_keys = 2, q_offset + tq
    p = compression_probs(source, group, tq, q_offset, geo)

    tri_importance = block_importance(p, **importance_kwargs(geo, num_keys))
    tri_idx = select_blocks(tri_importance, **select_kwargs(geo, q_offset))
    ref_idx = naive_select_blocks(
        p, kv_heads=HKV, num_keys=num_keys, q_offset=q_offset, **geo.select_kwargs()
    )
    ns = -(-num_keys // geo.sel_block_len)
    assert tri_importance.shape == (B, tq, HKV, ns)
    assert tri_idx.shape == ref_idx.shape == (B, tq, HKV, geo.n_sel)
    assert tri_idx.dtype == ref_idx.dtype == torch.long

    # importance and selection against the rule written from the spec, row by row
    oracle_imp = torch.zeros(B, tq, HKV, ns, dtype=DTYPE)
    oracle_idx = torch.zeros(B, tq, HKV, geo.n_sel, dtype=torch.long)
    for b in range(B):
        for i in range(tq):
            scores = oracle_importance(p[b, i].tolist(), group, num_keys, geo)
            for g in range(HKV):
                oracle_imp[b, i, g] = torch.tensor(scores[g], dtype=DTYPE)
                oracle_idx[b, i, g] = torch.tensor(oracle_select(scores[g], q_offset + i, geo))
    assert_close("importance", oracle_imp, tri_importance)
    mismatch = (ref_idx != oracle_idx).any(-1).nonzero()
    assert not len(mismatch), (
        f"naive_select_blocks differs from the rule at (b, i, g) {mismatch[:5].tolist()}"
    )
    mismatch = (tri_idx != ref_idx).any(-1).nonzero()
    assert not len(mismatch), (
        f"select_blocks differs from naive_select_blocks at (b, i, g) {mismatch[:5].tolist()}"
    )


@pytest.mark.parametrize("geo", [pytest.param(g, id=g.id) for g in GEOMETRIES[:2]])
def test_selection_decode_rows_equal_batched_rows(geo: Geometry) -> None:
    """The rows of a decode chunk (q_offset > 0) are the batched rows at the same positions."""
    tk, q_offset = 53, 41
    p = compression_probs("integer", 2, tk, 0, geo)
    importance = block_importance(p, **importance_kwargs(geo, tk))
    batched = select_blocks(importance, **select_kwargs(geo, 0))
    chunk = select_blocks(importance[:, q_offset:], **select_kwargs(geo, q_offset))
    assert torch.equal(chunk, batched[:, q_offset:])
    naive_batched = naive_select_blocks(p, kv_heads=HKV, num_keys=tk, **geo.select_kwargs())
    naive_chunk = naive_select_blocks(
        p[:, q_offset:], kv_heads=HKV, num_keys=tk, q_offset=q_offset, **geo.select_kwargs()
    )
    assert torch.equal(naive_chunk, naive_batched[:, q_offset:])
    assert torch.equal(naive_batched, batched)


def test_selection_is_per_kv_group() -> None:
    """Importance sums the G query heads of each KV group only: group 1's heads leave group 0 alone."""
    geo, tq, group = TINY, 40, 2
    p = compression_probs("random", group, tq, 0, geo)
    p2 = p.clone()
    p2[:, :, group:] = compression_probs("random", group, tq, 0, geo)[:, :, group:]
    imp, imp2 = (block_importance(x, **importance_kwargs(geo, tq)) for x in (p, p2))
    assert torch.equal(imp[:, :, 0], imp2[:, :, 0])
    assert not torch.equal(imp[:, :, 1], imp2[:, :, 1])
    # and the heads of a group add: doubling one head's p equals adding it once more
    p3 = p.clone()
    p3[:, :, 0] *= 2
    extra = p.clone()
    extra[:, :, 1:] = 0
    expected = imp + block_importance(extra, **importance_kwargs(geo, tq))
    assert_close("importance", expected, block_importance(p3, **importance_kwargs(geo, tq)))
