"""Property-based tests (hypothesis) over random geometries: config validation and the selection rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nsa_core import NSAConfig
from nsa_core.ops.reference import naive_select_blocks
from nsa_core.ops.selection import block_importance, select_blocks

from .utils import DTYPE, Geometry, assert_close, oracle_importance, oracle_select, visible_blocks_mask

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


@SETTINGS
@given(
    block_len=st.integers(1, 12),
    block_stride=st.integers(1, 12),
    sel_block_len=st.integers(1, 24),
    n_sel=st.integers(1, 8),
    n_init=st.integers(0, 3),
    n_local=st.integers(0, 3),
    window=st.integers(0, 4),
)
def test_nsa_config_validation(
    block_len: int, block_stride: int, sel_block_len: int, n_sel: int, n_init: int, n_local: int, window: int
) -> None:
    """NSAConfig accepts exactly the geometries the spec allows, and refuses the rest with ValueError."""
    valid = (
        block_len % block_stride == 0
        and sel_block_len % block_stride == 0
        and n_local >= 1
        and n_sel > n_init + n_local
        and window >= 1
    )
    kwargs = dict(
        block_len=block_len,
        block_stride=block_stride,
        sel_block_len=sel_block_len,
        n_sel=n_sel,
        n_init=n_init,
        n_local=n_local,
        window=window,
    )
    if valid:
        assert NSAConfig(**kwargs).block_len == block_len
    else:
        with pytest.raises(ValueError):  # noqa: PT011 - which field is wrong varies by example
            NSAConfig(**kwargs)


@st.composite
def selection_cases(draw: st.DrawFn) -> tuple[Geometry, int, int, int, int, torch.Tensor]:
    d = draw(st.sampled_from([1, 2, 4]))
    r = draw(st.integers(1, 3))  # compressed blocks per chunk: l = r * d
    k = draw(st.integers(1, 3))  # chunks per selection block: l' = k * d
    n_init = draw(st.integers(0, 2))
    n_local = draw(st.integers(1, 2))
    n_sel = n_init + n_local + draw(st.integers(1, 3))
    geo = Geometry(
        block_len=r * d, block_stride=d, sel_block_len=k * d, n_sel=n_sel, n_init=n_init, n_local=n_local
    )
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    num_keys = draw(st.integers(1, 40))
    tq = draw(st.integers(1, min(num_keys, 6)))
    q_offset = num_keys - tq
    nc = geo.num_cmp_blocks(num_keys)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    p = torch.randint(0, 3, (1, tq, kv_heads * group, nc), generator=gen).to(DTYPE)  # ties galore
    p = p * visible_blocks_mask(nc, q_offset, tq, geo)[None, :, None, :]
    return geo, kv_heads, group, num_keys, q_offset, p


@SETTINGS
@given(case=selection_cases())
def test_selection_rule_on_random_geometries(case: tuple) -> None:
    """select_blocks(block_importance(p)) == naive_select_blocks(p) == the spec's rule, ties included."""
    geo, kv_heads, group, num_keys, q_offset, p = case
    importance = block_importance(
        p,
        kv_heads=kv_heads,
        block_len=geo.block_len,
        block_stride=geo.block_stride,
        sel_block_len=geo.sel_block_len,
        num_keys=num_keys,
    )
    tri_idx = select_blocks(
        importance,
        sel_block_len=geo.sel_block_len,
        n_sel=geo.n_sel,
        n_init=geo.n_init,
        n_local=geo.n_local,
        q_offset=q_offset,
    )
    ref_idx = naive_select_blocks(
        p, kv_heads=kv_heads, num_keys=num_keys, q_offset=q_offset, **geo.select_kwargs()
    )
    for i in range(p.shape[1]):
        scores = oracle_importance(p[0, i].tolist(), group, num_keys, geo)
        for g in range(kv_heads):
            assert_close(
                f"importance row {i} group {g}", torch.tensor(scores[g], dtype=DTYPE), importance[0, i, g]
            )
            expected = oracle_select(scores[g], q_offset + i, geo)
            assert ref_idx[0, i, g].tolist() == expected, f"naive, row {i} group {g}"
            assert tri_idx[0, i, g].tolist() == expected, f"select_blocks, row {i} group {g}"
