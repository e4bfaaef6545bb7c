"""Triton compressed attention and its fused selection against the float64 torch path.

Outputs and the gradients into ``q``, ``k_cmp`` and ``v_cmp``; the block importance against
`block_importance` of the reference probabilities; the top-n kernel against `select_blocks` on importance
full of exact ties; the fused ``block_idx`` against ``select_blocks(block_importance(p))``, where a slot may
differ only on a near tie (two blocks whose reference importance agrees to rounding). Under the
interpreter the inputs are float32; on CUDA bf16/fp16 runs are bounded by a multiple of the error of the
`masked` torch backend run in the same dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nsa_core.ops.compression import masked_compressed_attention, num_compressed_blocks
from nsa_core.ops.selection import block_importance, select_blocks
from nsa_core.ops.triton import compression as triton_compression
from nsa_core.ops.triton.compression import (
    triton_block_importance,
    triton_compressed_attention,
    triton_compressed_block_select,
    triton_top_n_blocks,
)

from ..utils import assert_close, assert_within_same_dtype_error
from .conftest import SIZES

FP32_RATIO = 2e-5  # float32 kernel vs float64 reference: summation order and exp2 only
# bf16/fp16: error <= LOW_PRECISION_FACTOR x the same-dtype torch run's error + LOW_PRECISION_FLOOR
LOW_PRECISION_FACTOR = 2.0
LOW_PRECISION_FLOOR = 1e-4
TIE_TOL = 1e-4  # relative to the row's largest importance: a near tie may rank either way
MAX_TIE_ROWS = 0.02  # at most this fraction of (query, group) rows may differ, each on near ties only


@dataclass(frozen=True)
class Case:
    B: int
    T: int  # query tokens
    HKV: int
    G: int
    D: int
    block_len: int = 8
    block_stride: int = 4
    sel_block_len: int = 16
    n_sel: int = 4
    n_init: int = 1
    n_local: int = 2
    q_offset: int = 0
    pattern: str = "random"  # "hot": one compressed block outranks all others for every query

    @property
    def id(self) -> str:
        off = f"-off{self.q_offset}" if self.q_offset else ""
        return (
            f"B{self.B}-T{self.T}{off}-HQ{self.HKV * self.G}-H{self.HKV}-D{self.D}-l{self.block_len}-"
            f"d{self.block_stride}-ls{self.sel_block_len}-n{self.n_sel}-i{self.n_init}-loc{self.n_local}-"
            f"{self.pattern}"
        )

    @property
    def num_blocks(self) -> int:
        return num_compressed_blocks(self.q_offset + self.T, self.block_len, self.block_stride)

    @property
    def select(self) -> dict[str, int]:
        return dict(
            kv_heads=self.HKV, sel_block_len=self.sel_block_len, n_sel=self.n_sel, n_init=self.n_init,
            n_local=self.n_local,
        )  # fmt: skip

    @property
    def geometry(self) -> dict[str, int]:
        return dict(block_len=self.block_len, block_stride=self.block_stride, q_offset=self.q_offset)


def _cases() -> list[Case]:
    paper = dict(block_len=32, block_stride=16, sel_block_len=64, n_sel=16) if SIZES.real else {}
    cases = [
        Case(B=2, T=T, HKV=2, G=G, D=D, **paper)
        for T in SIZES.seq_lens
        for G in SIZES.groups
        for D in SIZES.head_dims
    ]
    D, T = SIZES.head_dims[0], SIZES.seq_lens[-1]
    cases += [
        Case(B=1, T=1, HKV=2, G=4, D=D, q_offset=44),  # decode over a cache
        Case(B=1, T=1, HKV=2, G=2, D=D, q_offset=7),  # the first position that sees a block
        Case(B=2, T=5, HKV=2, G=2, D=D, q_offset=40),  # a chunk after a cache
        Case(B=1, T=6, HKV=2, G=2, D=D),  # no complete block: zeros, forced blocks only
        Case(B=1, T=T, HKV=1, G=3, D=D, block_len=4, block_stride=4, sel_block_len=8, n_sel=3),  # l = d
        Case(B=1, T=T, HKV=2, G=2, D=D, block_len=16, block_stride=4, sel_block_len=8, n_sel=5),  # l > l'
        Case(B=1, T=T, HKV=2, G=2, D=D, block_len=8, block_stride=2, sel_block_len=6, n_sel=5),  # l'/d = 3
        Case(B=1, T=T, HKV=2, G=2, D=D, n_init=0, n_local=1, pattern="hot"),  # hot block 0, not forced
        Case(B=1, T=min(T, 40), HKV=2, G=2, D=D, n_sel=8),  # every candidate taken
        Case(B=1, T=T, HKV=2, G=2, D=D, sel_block_len=4, n_sel=6, n_init=2, n_local=3),  # l' < l
    ]
    if SIZES.real:
        big = dict(block_len=32, block_stride=16, sel_block_len=64, n_sel=16)
        cases += [
            Case(B=1, T=8192, HKV=4, G=16, D=128, **big),  # PERFORMANCE.md's heads
            Case(B=1, T=8192, HKV=4, G=16, D=128, n_init=0, n_local=1, pattern="hot", **big),
            Case(B=1, T=2048, HKV=2, G=6, D=64, **big),  # m7c-125m
            Case(B=1, T=3000, HKV=2, G=4, D=192, block_len=32, block_stride=16, sel_block_len=48, n_sel=8),
            Case(B=1, T=1, HKV=4, G=16, D=128, q_offset=8191, **big),
        ]
    return cases


CASES = [pytest.param(c, id=c.id) for c in _cases()]


def _inputs(case: Case, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cpu").manual_seed(case.T * 7 + case.G + case.block_len)
    HQ, Nc = case.HKV * case.G, case.num_blocks
    q = torch.randn(case.B, case.T, HQ, case.D, generator=gen, dtype=torch.float64)
    k = torch.randn(case.B, Nc, case.HKV, case.D, generator=gen, dtype=torch.float64)
    v = torch.randn(case.B, Nc, case.HKV, case.D, generator=gen, dtype=torch.float64)
    do = torch.randn(case.B, case.T, HQ, case.D, generator=gen, dtype=torch.float64)
    if case.pattern == "hot" and Nc:
        hot = torch.randn(case.D, generator=gen, dtype=torch.float64)
        hot = 3.0 * hot / hot.norm() * case.D**0.5
        q, k = q + hot, k.clone()
        k[:, 0] += hot
    return tuple(x.to(device) for x in (q, k, v, do))


def _run(fn, case: Case, inputs: tuple[torch.Tensor, ...], dtype: torch.dtype) -> list[torch.Tensor | None]:
    q, k, v, do = (x.detach().to(dtype).requires_grad_(i < 3) for i, x in enumerate(inputs))
    o = fn(q, k, v, **case.geometry)[0]
    o.backward(do)
    return [o.detach(), q.grad, k.grad, v.grad]


def _reference_selection(case: Case, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, _ = inputs
    _, p = masked_compressed_attention(q, k, v, **case.geometry)
    num_keys = case.q_offset + case.T
    imp = block_importance(
        p, kv_heads=case.HKV, block_len=case.block_len, block_stride=case.block_stride,
        sel_block_len=case.sel_block_len, num_keys=num_keys,
    )  # fmt: skip
    idx = select_blocks(
        imp, sel_block_len=case.sel_block_len, n_sel=case.n_sel, n_init=case.n_init, n_local=case.n_local,
        q_offset=case.q_offset,
    )  # fmt: skip
    return imp, idx


def assert_same_selection(
    ref_idx: torch.Tensor, tri_idx: torch.Tensor, ref_imp: torch.Tensor, all_ties: bool = False
) -> None:
    """Equal block lists, except slots whose two blocks tie in the reference importance (to ``TIE_TOL``)."""
    assert tri_idx.dtype == torch.long
    assert tri_idx.shape == ref_idx.shape
    differ = ref_idx != tri_idx
    if not differ.any():
        return
    rows = differ.any(-1)
    if not all_ties:  # with a hot block every other block's importance is ~0: every row ties, by design
        assert rows.float().mean().item() <= MAX_TIE_ROWS, f"{int(rows.sum())} rows select other blocks"
    # every differing slot at once (a hot block makes every row tie: a slot-by-slot loop of .item() took
    # minutes at T = 8192 on the GPU)
    where = differ.nonzero()
    r, x = ref_idx[differ], tri_idx[differ]
    rows_imp = ref_imp[where[:, 0], where[:, 1], where[:, 2]]  # [n, Ns]
    imp_r, imp_x = (rows_imp.gather(1, i.clamp_min(0)[:, None])[:, 0] for i in (r, x))
    gap = (imp_r - imp_x).abs()
    bad = (torch.minimum(r, x) < 0) | (gap > TIE_TOL * rows_imp.abs().amax(1))
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        b, t, h, slot = where[i].tolist()
        pytest.fail(f"row {(b, t, h)} slot {slot}: {int(x[i])} for {int(r[i])}, gap {float(gap[i])}")


@pytest.mark.parametrize("case", CASES)
def test_compressed_fp32_matches_reference(case: Case, device: str) -> None:
    inputs = _inputs(case, device)
    ref = _run(masked_compressed_attention, case, inputs, torch.float64)
    tri = _run(triton_compressed_attention, case, inputs, torch.float32)
    for name, r, t in zip(("o", "dq", "dk_cmp", "dv_cmp"), ref, tri, strict=True):
        if r is None or t is None:  # no block yet: k_cmp/v_cmp are empty on both sides
            assert case.num_blocks == 0
            continue
        # hot block: every query puts all its weight on block 0 (a saturated softmax), so dq and dk_cmp are
        # p (dp - delta) with p ~ 1 and dp ~ delta: zero in float64 (1e-24), float32 cancellation noise
        # here, summed over every query for block 0's dk (1e-3 at 8k x 64 heads); o is compared as usual
        atol = 2e-3 if case.pattern == "hot" and name != "o" else 1e-5
        assert_close(name, r, t, FP32_RATIO, atol=atol)


SMALL_TILE_CASES = [
    pytest.param(c, id=c.id)
    for c in (
        Case(B=1, T=128, HKV=2, G=2, D=16, block_len=4, block_stride=2, sel_block_len=8),
        Case(B=1, T=101, HKV=1, G=3, D=16, block_len=6, block_stride=2, sel_block_len=8),
        Case(B=2, T=40, HKV=1, G=2, D=16, block_len=4, block_stride=2, sel_block_len=8, q_offset=67),
    )
]


@pytest.mark.parametrize("case", SMALL_TILE_CASES)
def test_compressed_unmasked_tiles_match_reference(case: Case, device: str, small_tiles: int) -> None:
    """Key tiles every query of a tile reads whole skip the causal mask: the edge must still be exact."""
    inputs = _inputs(case, device)
    ref = _run(masked_compressed_attention, case, inputs, torch.float64)
    tri = _run(triton_compressed_attention, case, inputs, torch.float32)
    for name, r, t in zip(("o", "dq", "dk_cmp", "dv_cmp"), ref, tri, strict=True):
        assert_close(name, r, t, FP32_RATIO, atol=1e-5)


@pytest.mark.parametrize("case", SMALL_TILE_CASES)
def test_compressed_backward_in_query_chunks_matches_reference(
    case: Case, device: str, small_tiles: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dK/dV dealt out in chunks of one query tile (and the group's heads split) equals the reference and,
    bit for bit up to the float32 sum's order, the backward in one program per key tile."""
    from nsa_core.ops.triton import flash

    inputs = _inputs(case, device)
    ref = _run(masked_compressed_attention, case, inputs, torch.float64)
    runs = []
    for target in (1, 1 << 30):  # one split; every head split and one query tile a program
        monkeypatch.setattr(flash, "program_target", lambda device, target=target: target)
        monkeypatch.setattr(flash, "DKDV_MIN_CHUNK", 1)
        runs.append(_run(triton_compressed_attention, case, inputs, torch.float32))
    Tq, Nk = case.T, case.num_blocks
    geometry = (case.block_stride, case.block_len - 1, 0, small_tiles, small_tiles)
    assert flash.dkdv_splits(Tq, Nk, case.B * case.HKV, case.G, case.D, case.q_offset, *geometry, 1)[2] == 1
    h_splits, chunk, splits = flash.dkdv_splits(
        Tq, Nk, case.B * case.HKV, case.G, case.D, case.q_offset, *geometry, 1 << 30
    )
    assert (h_splits, chunk) == (case.G, 1)
    assert splits > h_splits
    for name, r, t in zip(("o", "dq", "dk_cmp", "dv_cmp"), ref, runs[1], strict=True):
        assert_close(name, r, t, FP32_RATIO, atol=1e-5)
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_dkdv_chunks_cover_every_query_tile() -> None:
    """The chunks' query tiles reach the longest key tile's (the compressed keys' first tile reads every
    query), within the workspace; a short band or few programs get one chunk."""
    from nsa_core.ops.triton.flash import SPLIT_WORKSPACE_BYTES, dkdv_splits

    cmp = (16, 31, 0, 32, 64)  # key stride, offset, no window, BLOCK_M, BLOCK_N
    h, chunk, splits = dkdv_splits(16384, 1023, 2, 6, 64, 0, *cmp, 528)  # m7c-125m at 16k
    assert (h, splits % h) == (6, 0)
    assert 16384 // 32 <= chunk * (splits // h) < 16384 // 32 + chunk
    assert chunk < 16384 // 32
    assert dkdv_splits(16384, 16384, 2, 6, 64, 0, 1, 0, 512, 32, 64, 528)[2] == 2  # window: heads only
    assert dkdv_splits(16384, 1023, 2, 6, 64, 0, *cmp, 1) == (1, 512, 1)
    h, chunk, splits = dkdv_splits(262144, 16383, 4, 16, 128, 0, *cmp, 1 << 20)
    assert splits * 4 * 16383 * 128 * 8 <= SPLIT_WORKSPACE_BYTES
    assert chunk * (splits // h) >= 262144 // 32
    assert dkdv_splits(2048, 127, 2, 6, 64, 0, *cmp, 528, 8)[1] == 8  # 2k: at least 8 tiles a chunk
    assert dkdv_splits(6, 0, 2, 6, 64, 0, *cmp, 528, 8) == (1, 1, 1)  # no compressed key yet


def test_dkdv_splits_follow_the_workspace_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The splits are cached per shape and per cap: a cap set after a shape's first call applies to it
    (a test that set it to 0 for one program per key tile got the splits of an earlier test's same shape,
    on the GPU, in a lane that ran that test first)."""
    from nsa_core.ops.triton import flash

    cmp = (16, 31, 0, 32, 64)
    assert flash.dkdv_splits(16384, 1023, 2, 6, 64, 0, *cmp, 528)[2] > 1
    monkeypatch.setattr(flash, "SPLIT_WORKSPACE_BYTES", 0)
    assert flash.dkdv_splits(16384, 1023, 2, 6, 64, 0, *cmp, 528) == (1, 512, 1)


def _check_importance_and_selection(case: Case, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The importance and the fused selection in float32 against the reference; returns the selection."""
    ref_imp, ref_idx = _reference_selection(case, inputs)
    q, k, v, _ = (x.float() for x in inputs)
    tri_imp = triton_block_importance(
        q, k, block_len=case.block_len, block_stride=case.block_stride, sel_block_len=case.sel_block_len,
        q_offset=case.q_offset,
    )  # fmt: skip
    assert_close("importance", ref_imp, tri_imp, FP32_RATIO, atol=1e-5)
    _, tri_idx = triton_compressed_attention(q, k, v, select=case.select, **case.geometry)
    assert_same_selection(ref_idx, tri_idx, ref_imp, all_ties=case.pattern == "hot")
    return tri_idx


@pytest.mark.parametrize("case", CASES)
def test_fused_selection_matches_reference(case: Case, device: str) -> None:
    inputs = _inputs(case, device)
    tri_idx = _check_importance_and_selection(case, inputs)
    q, k, _, _ = (x.float() for x in inputs)
    only = triton_compressed_block_select(
        q, k, **{key: val for key, val in case.select.items() if key != "kv_heads"}, **case.geometry
    )
    assert torch.equal(only, tri_idx), "select-only entry disagrees with the fused one"


@pytest.mark.parametrize(
    "tiles",
    [dict(BLOCK_M=16, BLOCK_C=16, BLOCK_S=8), dict(BLOCK_M=32, BLOCK_C=64, BLOCK_S=32)],
    ids=lambda t: "-".join(f"{k[6:]}{v}" for k, v in t.items()),
)
def test_importance_tiles_match_reference(
    tiles: dict[str, int], device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other importance tiles (several steps per program, several programs per row): same result. With
    l' = 4 there are 16+ selection blocks, so a program whose tile starts past block 0 must also count the
    compressed block that reaches into its first chunk from the tile before (l = 2 d)."""
    monkeypatch.setattr(triton_compression, "LAUNCH", {"importance": tiles})
    case = Case(  # one sequence: the tiles are along its rows and blocks (batches: the fused selection's)
        B=1, T=SIZES.seq_lens[-1], HKV=2, G=3, D=SIZES.head_dims[0], block_len=4, block_stride=2,
        sel_block_len=4,
    )  # fmt: skip
    _check_importance_and_selection(case, _inputs(case, device))


@pytest.mark.skipif(not SIZES.dtypes, reason="bf16/fp16 runs need CUDA")
@pytest.mark.parametrize("dtype", SIZES.dtypes, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_compressed_low_precision_within_torch_error(case: Case, dtype: torch.dtype, device: str) -> None:
    inputs = _inputs(case, device)
    ref = _run(masked_compressed_attention, case, inputs, torch.float64)
    torch_lp = _run(masked_compressed_attention, case, inputs, dtype)
    tri = _run(triton_compressed_attention, case, inputs, dtype)
    for name, r, base, t in zip(("o", "dq", "dk_cmp", "dv_cmp"), ref, torch_lp, tri, strict=True):
        if r is None or t is None:
            assert case.num_blocks == 0
            continue
        assert t.dtype == dtype
        assert_within_same_dtype_error(name, r, base, t, LOW_PRECISION_FLOOR, LOW_PRECISION_FACTOR)
    # the selection in low precision: the blocks the float64 importance of the same rounded inputs picks,
    # up to its near ties (rounding q and k to bf16 alone reorders near ties in ~13% of random rows)
    rounded = tuple(x.to(dtype) for x in inputs)
    ref_imp, ref_idx = _reference_selection(case, tuple(x.double() for x in rounded))
    q, k, v, _ = rounded
    _, tri_idx = triton_compressed_attention(q, k, v, select=case.select, **case.geometry)
    assert_same_selection(ref_idx, tri_idx, ref_imp, all_ties=case.pattern == "hot")


TOP_N = [
    pytest.param(T, ls, n, ni, nl, off, id=f"T{T}-off{off}-ls{ls}-n{n}-i{ni}-loc{nl}")
    for T, ls, n, ni, nl, off in [
        (64, 4, 5, 1, 2, 0),
        (37, 8, 4, 0, 1, 0),
        (3, 16, 4, 1, 2, 61),
        (1, 4, 6, 2, 3, 90),
        (40, 16, 8, 1, 2, 0),  # more slots than candidates: -1 tails
    ]
]


@pytest.mark.parametrize(("T", "ls", "n", "ni", "nl", "off"), TOP_N)
def test_top_n_kernel_matches_select_blocks_on_ties(
    T: int, ls: int, n: int, ni: int, nl: int, off: int, device: str
) -> None:
    gen = torch.Generator().manual_seed(T + n)
    num_sel = -(-(off + T) // ls)
    imp = torch.randint(0, 3, (2, T, 2, num_sel), generator=gen).float().to(device)  # ties everywhere
    kwargs = dict(sel_block_len=ls, n_sel=n, n_init=ni, n_local=nl, q_offset=off)
    assert torch.equal(triton_top_n_blocks(imp, **kwargs), select_blocks(imp, **kwargs))


@pytest.mark.parametrize("tile, warps", [(16, None), (1024, None), (4096, 4), (1 << 16, 2)])
def test_top_n_launch_options_same_blocks(
    tile: int, warps: int | None, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pair a program up to 64, on one to four warps: the same blocks (ties everywhere)."""
    monkeypatch.setattr(triton_compression, "TOP_N_TILE", tile)
    monkeypatch.setattr(triton_compression, "TOP_N_WARPS", warps)
    launch = triton_compression.top_n_launch(70)
    block_r = max(1, min(64, tile // 128))
    assert launch == dict(NS_PAD=128, BLOCK_R=block_r, num_warps=warps or max(1, min(4, block_r // 4)))
    gen = torch.Generator().manual_seed(tile)
    imp = torch.randint(0, 3, (2, 97, 3, 70), generator=gen).float().to(device)
    kwargs = dict(sel_block_len=4, n_sel=6, n_init=1, n_local=2, q_offset=183)
    assert torch.equal(triton_top_n_blocks(imp, **kwargs), select_blocks(imp, **kwargs))


def test_top_n_launch_rule() -> None:
    launch = triton_compression.top_n_launch
    assert launch(32) == dict(NS_PAD=32, BLOCK_R=8, num_warps=1)  # m7c-125m at 2k: 8 pairs a program
    assert launch(70) == dict(NS_PAD=128, BLOCK_R=2, num_warps=1)
    assert launch(512) == dict(NS_PAD=512, BLOCK_R=1, num_warps=1)
    assert launch(1024) == dict(NS_PAD=1024, BLOCK_R=1, num_warps=2)
    assert launch(4000) == dict(NS_PAD=4096, BLOCK_R=1, num_warps=4)


def test_selection_in_row_chunks_equals_one_pass(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case(B=1, T=SIZES.seq_lens[-1], HKV=2, G=2, D=SIZES.head_dims[0])  # chunks of one sequence's rows
    q, k, v, _ = (x.float() for x in _inputs(case, device))
    _, whole = triton_compressed_attention(q, k, v, select=case.select, **case.geometry)
    # a buffer of a few rows: the importance and top-n run chunk after chunk
    monkeypatch.setattr(triton_compression, "IMPORTANCE_ELEMENTS", 16)
    _, chunked = triton_compressed_attention(q, k, v, select=case.select, **case.geometry)
    assert torch.equal(whole, chunked)


def test_compressed_rejects_bad_arguments(device: str) -> None:
    case = Case(B=1, T=16, HKV=1, G=2, D=16)
    q, k, v, _ = (x.float() for x in _inputs(case, device))
    with pytest.raises(ValueError, match="blocks"):
        triton_compressed_attention(q, k[:, :-1], v[:, :-1], **case.geometry)
    with pytest.raises(ValueError, match="select must hold"):
        triton_compressed_attention(q, k, v, select=dict(n_sel=4), **case.geometry)
    with pytest.raises(ValueError, match="kv_heads"):
        triton_compressed_attention(q, k, v, select={**case.select, "kv_heads": 2}, **case.geometry)
    with pytest.raises(ValueError, match="divide"):
        triton_compressed_attention(q, k, v, block_len=8, block_stride=3)
