"""Triton selected attention against the float64 torch path: outputs, dq, dk, dv, and the inverted index.

Under the interpreter (CPU, ``TRITON_INTERPRET=1``) the inputs are float32 and the bound is a relative RMS
error; on CUDA the same tests run at real sizes, and bf16/fp16 runs are bounded by a multiple of the error of
the `gather` backend run in the same dtype (flash-attention's rule).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from nsa_core.ops.selection import gather_selected_attention, select_blocks
from nsa_core.ops.triton import selection
from nsa_core.ops.triton.selection import (
    build_block_queries,
    hot_slots,
    selected_bwd,
    triton_selected_attention,
)

from ..utils import assert_close, assert_within_same_dtype_error
from .conftest import SIZES

FP32_RATIO = 2e-5  # float32 kernel vs float64 reference: summation order and exp2 only


@dataclass(frozen=True)
class Case:
    B: int
    T: int  # query tokens
    HKV: int
    G: int
    D: int
    sel_block_len: int = 16
    n_sel: int = 4
    n_init: int = 1
    n_local: int = 2
    q_offset: int = 0
    pattern: str = "random"  # importance: random, "hot" (every query prefers the first blocks)

    @property
    def id(self) -> str:
        off = f"-off{self.q_offset}" if self.q_offset else ""
        return (
            f"B{self.B}-T{self.T}{off}-HQ{self.HKV * self.G}-H{self.HKV}-D{self.D}-"
            f"ls{self.sel_block_len}-n{self.n_sel}-{self.pattern}"
        )


def _cases() -> list[Case]:
    cases = []
    for T in SIZES.seq_lens:
        for G in SIZES.groups:
            for D in SIZES.head_dims:
                ls, n = (64, 16) if SIZES.real else (16, 4)
                cases.append(Case(B=2, T=T, HKV=2, G=G, D=D, sel_block_len=ls, n_sel=n))
    D = SIZES.head_dims[0]
    T = SIZES.seq_lens[-1]
    cases += [
        Case(B=1, T=1, HKV=2, G=4, D=D, q_offset=44),  # decode: one query over a cache
        Case(B=2, T=5, HKV=2, G=2, D=D, q_offset=40),
        Case(B=1, T=T, HKV=2, G=2, D=D, sel_block_len=8, n_sel=5, pattern="hot"),  # everyone reads 0..4
        Case(B=1, T=T, HKV=1, G=3, D=D, sel_block_len=80, n_sel=2, n_init=0, n_local=1),  # 2 key tiles/block
        Case(B=1, T=T, HKV=2, G=2, D=D, sel_block_len=4, n_sel=6, n_init=2, n_local=3),  # l' < 16
        Case(B=1, T=min(T, 40), HKV=2, G=2, D=D, sel_block_len=16, n_sel=8),  # every row all forced/taken
    ]
    if SIZES.real:
        cases += [
            Case(B=1, T=4096, HKV=4, G=16, D=128, sel_block_len=64, n_sel=16, pattern="hot"),
            Case(B=1, T=2048, HKV=2, G=6, D=64, sel_block_len=64, n_sel=16),  # m7c-125m: the scan
            Case(B=1, T=5000, HKV=2, G=6, D=64, sel_block_len=64, n_sel=16),  # past the scan: token tiles
            Case(B=1, T=3000, HKV=2, G=4, D=192, sel_block_len=48, n_sel=8),  # D and l' not powers of 2
            Case(B=1, T=1, HKV=4, G=16, D=128, sel_block_len=64, n_sel=16, q_offset=8191),
        ]
    return cases


CASES = [pytest.param(c, id=c.id) for c in _cases()]


def make_block_idx(case: Case, device: str) -> torch.Tensor:
    num_keys = case.q_offset + case.T
    ns = -(-num_keys // case.sel_block_len)
    if case.pattern == "hot":
        importance = torch.linspace(1.0, 0.0, ns).expand(case.B, case.T, case.HKV, ns).contiguous()
    else:
        importance = torch.rand(case.B, case.T, case.HKV, ns)
    block_idx = select_blocks(
        importance,
        sel_block_len=case.sel_block_len,
        n_sel=case.n_sel,
        n_init=case.n_init,
        n_local=case.n_local,
        q_offset=case.q_offset,
    )
    return block_idx.to(device)


def make_inputs(case: Case, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    Tk = case.q_offset + case.T
    q = torch.randn(case.B, case.T, case.HKV * case.G, case.D, dtype=torch.float64)
    k = torch.randn(case.B, Tk, case.HKV, case.D, dtype=torch.float64)
    v = torch.randn(case.B, Tk, case.HKV, case.D, dtype=torch.float64)
    do = torch.randn(case.B, case.T, case.HKV * case.G, case.D, dtype=torch.float64)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v, do))


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    sel_block_len: int,
    q_offset: int = 0,
    scale: float | None = None,
    chunk: int = 512 if SIZES.real else 24,
) -> torch.Tensor:
    """`gather_selected_attention` in query chunks, each over its key prefix: real sizes fit in memory."""
    outputs = []
    for start in range(0, q.shape[1], chunk):
        stop = min(q.shape[1], start + chunk)
        end = q_offset + stop
        # checkpointed: the backward recomputes one chunk's gathered keys at a time instead of keeping all
        outputs.append(
            checkpoint(
                gather_selected_attention,
                q[:, start:stop],
                k[:, :end],
                v[:, :end],
                block_idx[:, start:stop],
                sel_block_len=sel_block_len,
                q_offset=q_offset + start,
                scale=scale,
                use_reentrant=False,
            )
        )
    return torch.cat(outputs, dim=1)


def run(fn, q, k, v, do) -> tuple[torch.Tensor, ...]:
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    o = fn(q, k, v)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


NAMES = ("o", "dq", "dk", "dv")


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_fp32(case: Case, device: str) -> None:
    block_idx = make_block_idx(case, device)
    kwargs = dict(sel_block_len=case.sel_block_len, q_offset=case.q_offset)
    q, k, v, do = make_inputs(case, device, torch.float64)
    ref = run(lambda *a: reference(*a, block_idx, **kwargs), q, k, v, do)
    tri = run(
        lambda *a: triton_selected_attention(*a, block_idx, **kwargs), *(x.float() for x in (q, k, v, do))
    )
    for name, r, t in zip(NAMES, ref, tri, strict=True):
        assert t.dtype == torch.float32
        assert_close(name, r, t, FP32_RATIO, atol=1e-5)


@pytest.mark.skipif(not SIZES.dtypes, reason="low-precision runs need CUDA (the interpreter's dot is fp32)")
@pytest.mark.parametrize("dtype", SIZES.dtypes or [torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_low_precision(case: Case, dtype: torch.dtype, device: str) -> None:
    block_idx = make_block_idx(case, device)
    kwargs = dict(sel_block_len=case.sel_block_len, q_offset=case.q_offset)
    q, k, v, do = make_inputs(case, device, torch.float64)
    ref = run(lambda *a: reference(*a, block_idx, **kwargs), q, k, v, do)
    low = [x.to(dtype) for x in (q, k, v, do)]
    base = run(lambda *a: reference(*a, block_idx, **kwargs), *low)
    tri = run(lambda *a: triton_selected_attention(*a, block_idx, **kwargs), *low)
    for name, r, b, t in zip(NAMES, ref, base, tri, strict=True):
        assert_within_same_dtype_error(name, r, b, t, floor=1e-3)  # e.g. dq of a decode step at t = 0: 0


@pytest.mark.parametrize(
    ("share", "pair"), [(0, False), (0, True), (101, False)], ids=["own-blocks", "own-paired", "union"]
)
@pytest.mark.parametrize("rows", [1, 16, 64], ids=lambda r: f"rows{r}")
def test_token_tiles_match_reference(
    rows: int, share: int, pair: bool, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward and dq in tiles of several query tokens: each token's own blocks (``share`` 0) in turn or
    side by side in one key tile (``pair``), or the union of the tile's blocks, each once (``share``
    101), give the reference's output and gradients."""
    from nsa_core.ops.triton import selection

    monkeypatch.setattr(selection, "SHARE_PCT", share)
    monkeypatch.setattr(selection, "PAIR_KEYS", {"fwd": pair, "dq": pair})
    monkeypatch.setattr(selection, "_TILE_ROWS", {"fwd": rows, "dq": rows})
    monkeypatch.setattr(selection, "SCAN_SPAN", 0)  # the token tiles, never the scan
    monkeypatch.setattr(selection, "BLOCKS_BYTES", 0)  # nor by selection block
    # one sequence: the tiles run along its rows (test_matches_reference_fp32 runs batches of two); a tile of
    # 16 or 64 rows ends past T = 37
    case = Case(B=1, T=37, HKV=2, G=3, D=16, sel_block_len=8, n_sel=4)
    block_idx = make_block_idx(case, device)
    kwargs = dict(sel_block_len=case.sel_block_len)
    q, k, v, do = make_inputs(case, device, torch.float64)
    ref = run(lambda *a: reference(*a, block_idx, **kwargs), q, k, v, do)
    tri = run(
        lambda *a: triton_selected_attention(*a, block_idx, **kwargs), *(x.float() for x in (q, k, v, do))
    )
    for name, r, t in zip(NAMES, ref, tri, strict=True):
        assert_close(name, r, t, FP32_RATIO, atol=1e-5)


SCAN_CASES = [
    Case(B=1, T=37, HKV=2, G=3, D=16, sel_block_len=16, n_sel=3),  # tiles end past T
    Case(B=2, T=29, HKV=1, G=2, D=16, sel_block_len=48, n_sel=2, n_init=0, n_local=1),  # 3 key tiles a block
    Case(B=1, T=9, HKV=2, G=4, D=32, sel_block_len=16, n_sel=3, q_offset=40),  # a chunk after a cache
    Case(B=1, T=40, HKV=2, G=2, D=16, sel_block_len=32, n_sel=2, pattern="hot"),
]
if SIZES.real:
    SCAN_CASES += [
        Case(B=2, T=2048, HKV=2, G=6, D=64, sel_block_len=64, n_sel=16),  # m7c-125m
        Case(B=1, T=4096, HKV=4, G=16, D=128, sel_block_len=64, n_sel=16),
        Case(B=1, T=3000, HKV=2, G=4, D=192, sel_block_len=48, n_sel=8),
    ]


# tiles of 16, 64 and 128 rows on the small cases; at real sizes (float64 references of thousands of
# tokens) the default 128
SCAN_PARAMS = [
    pytest.param(c, rows, id=f"{c.id}-rows{rows}")
    for c in SCAN_CASES
    for rows in ([128] if c.T > 100 else [16, 64, 128])
]


@pytest.mark.parametrize(("case", "rows"), SCAN_PARAMS)
def test_scan_matches_reference(case: Case, rows: int, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan (every key up to a tile's last position, masked by each row's blocks) gives the reference's
    output and gradients, whatever the rows of its tiles, with unused slots, a query offset and l' > 64."""
    from nsa_core.ops.triton import selection

    monkeypatch.setattr(selection, "SCAN_SPAN", 1 << 20)  # the scan at any length
    monkeypatch.setattr(selection, "SCAN_ROWS", rows)
    block_idx = make_block_idx(case, device)
    kwargs = dict(sel_block_len=case.sel_block_len, q_offset=case.q_offset)
    _check_against_reference(case, block_idx, device, kwargs)


def _check_against_reference(
    case: Case, block_idx: torch.Tensor, device: str, kwargs: dict
) -> tuple[torch.Tensor, ...]:
    """The kernels against the float64 reference: in the model's precision (CUDA) within a multiple of the
    gather backend's error in it, in float32 within FP32_RATIO, and the same bits twice. Returns the
    float32 run's output and gradients."""
    q, k, v, do = make_inputs(case, device, torch.float64)
    ref = run(lambda *a: reference(*a, block_idx, **kwargs), q, k, v, do)
    if SIZES.dtypes:  # the kernels in the model's precision, bounded by the gather backend's error in it
        low = [x.to(SIZES.dtypes[0]) for x in (q, k, v, do)]
        base = run(lambda *a: reference(*a, block_idx, **kwargs), *low)
        tri = run(lambda *a: triton_selected_attention(*a, block_idx, **kwargs), *low)
        for name, r, b, t in zip(NAMES, ref, base, tri, strict=True):
            assert_within_same_dtype_error(name, r, b, t, floor=1e-3)
    ins = [x.float() for x in (q, k, v, do)]
    tri = run(lambda *a: triton_selected_attention(*a, block_idx, **kwargs), *ins)
    again = run(lambda *a: triton_selected_attention(*a, block_idx, **kwargs), *ins)
    for name, r, t, t2 in zip(NAMES, ref, tri, again, strict=True):
        assert_close(name, r, t, FP32_RATIO, atol=1e-5)
        assert torch.equal(t, t2), f"{name}: two runs differ"
    return tri


def test_scan_is_chosen_for_short_sequences() -> None:
    """The plan: the scan where the keys are at most SCAN_SPAN x n x l' and a key tile fits a block; token
    tiles beyond; tiles of SCAN_ROWS rows for half precision at D <= 64, fewer for wider key tiles."""
    from nsa_core.ops.triton import selection

    def plan(
        keys: int, dtype=torch.bfloat16, D: int = 64, ls: int = 64, G: int = 6, kind: str = "fwd"
    ) -> dict[str, int]:
        return selection._plan(kind, dtype, selection._tiles(G, D, ls), G, 16, ls, keys)

    span = selection.SCAN_SPAN * 16 * 64
    assert plan(span)["SCAN"]
    assert not plan(span + 1)["SCAN"]
    assert plan(span)["M"] == selection.SCAN_ROWS // 6
    assert plan(span)["BLOCK_R"] == 128
    assert plan(span, D=128)["BLOCK_R"] == plan(span, dtype=torch.float32)["BLOCK_R"] == 64
    assert plan(1000, ls=48)["BLOCK_S"] == 16  # a power of two dividing l'
    assert not plan(100, ls=8)["SCAN"]  # key tiles of 8: under the smallest dot
    assert plan(span + 1)["M"] == 2
    assert plan(span + 1)["BLOCK_S"] == 64
    assert plan(span + 1)["PAIR"] == 2  # its two tokens' blocks side by side: key tiles of 128
    assert plan(span + 1, kind="dq")["PAIR"] == 0  # dq: in turn (faster there)
    assert plan(span + 1, dtype=torch.float32)["PAIR"] == 0  # 32 KB key tiles: in turn


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_tile_union_lists_each_block_of_a_tile_once(tokens: int, device: str) -> None:
    from nsa_core.ops.triton.selection import tile_union

    case = Case(B=2, T=37, HKV=2, G=1, D=16, sel_block_len=4, n_sel=6, n_init=1, n_local=2)
    block_idx = make_block_idx(case, device)
    block_idx[0, 5, 1, 3] = -1  # an unused slot
    union, count = tile_union(block_idx, tokens)
    assert union.shape[:3] == count.shape == (2, 2, -(-37 // tokens))
    for b in range(2):
        for h in range(2):
            for i in range(count.shape[-1]):
                rows = block_idx[b, i * tokens : (i + 1) * tokens, h].flatten().tolist()
                first_seen = list(dict.fromkeys(x for x in rows if x >= 0))
                assert union[b, h, i, : count[b, h, i]].tolist() == first_seen


@pytest.mark.parametrize("by_block", [False, True], ids=["token-dq", "block-dq"])
def test_hot_block_chunks_match_single_pass(
    by_block: bool, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks chosen by more queries than a chunk take the workspace path: same gradients, deterministic;
    with dq per token, and with dq's parts written by dK/dV (by selection block)."""
    monkeypatch.setattr(selection, "SCAN_SPAN", 0)  # the inverted index's path
    monkeypatch.setattr(selection, "BLOCKS_BYTES", 1 << 40 if by_block else 0)
    monkeypatch.setattr(selection, "BLOCKS_GROUP", 64)
    case = Case(B=1, T=SIZES.seq_lens[-1], HKV=2, G=2, D=SIZES.head_dims[0], sel_block_len=8, n_sel=5)
    case = Case(**{**case.__dict__, "pattern": "hot"})
    block_idx = make_block_idx(case, device).contiguous()
    q, k, v, do = (x.float() for x in make_inputs(case, device, torch.float64))
    scale = case.D**-0.5
    o, lse = _forward(q, k, v, block_idx, case)
    whole = selected_bwd(do, q, k, v, o, lse, block_idx, case.sel_block_len, 0, scale)
    chunked = selected_bwd(do, q, k, v, o, lse, block_idx, case.sel_block_len, 0, scale, chunk=7)
    again = selected_bwd(do, q, k, v, o, lse, block_idx, case.sel_block_len, 0, scale, chunk=7)
    for name, a, b, c in zip(("dq", "dk", "dv"), whole, chunked, again, strict=True):
        assert_close(name, a, b, FP32_RATIO, atol=1e-5)
        assert torch.equal(b, c), f"{name}: two runs differ"


BLOCK_CASES = [
    Case(B=2, T=37, HKV=2, G=3, D=16, sel_block_len=8, n_sel=4),  # steps of several entries, past T
    Case(B=1, T=37, HKV=1, G=16, D=16, sel_block_len=8, n_sel=4),  # two entries a step
    Case(B=2, T=29, HKV=2, G=1, D=32, sel_block_len=8, n_sel=3, n_local=1),
    Case(B=1, T=9, HKV=2, G=4, D=32, sel_block_len=16, n_sel=3, q_offset=40),  # a chunk after a cache
    Case(B=1, T=170, HKV=1, G=2, D=16, sel_block_len=80, n_sel=2, n_init=0, n_local=1),  # 2 key tiles/block
    Case(B=1, T=64, HKV=2, G=2, D=16, sel_block_len=8, n_sel=5, pattern="hot"),  # everyone reads 0..4
]
assert BLOCK_CASES[5].pattern == "hot"  # BLOCK_PARAMS' second small-chunk case
if SIZES.real:
    BLOCK_CASES += [
        Case(B=1, T=16384, HKV=2, G=6, D=64, sel_block_len=64, n_sel=16),  # m7c-125m at 16k
        Case(B=1, T=8192, HKV=4, G=16, D=128, sel_block_len=64, n_sel=16),  # the paper's heads
        Case(B=1, T=3000, HKV=2, G=4, D=192, sel_block_len=48, n_sel=8),  # D and l' not powers of 2
    ]


# each case with the default entries a forward program walks; the first and the hot one also with 5 (a
# block's list over several programs), and at real sizes m7c-125m's with 1024
BLOCK_PARAMS = [pytest.param(c, 256, id=f"{c.id}-chunk256") for c in BLOCK_CASES] + [
    pytest.param(c, 5, id=f"{c.id}-chunk5") for c in (BLOCK_CASES[0], BLOCK_CASES[5])
]
if SIZES.real:  # m7c-125m at 16k in the chunks of its 64k (`_blocks_chunk`)
    BLOCK_PARAMS.append(pytest.param(BLOCK_CASES[6], 1024, id=f"{BLOCK_CASES[6].id}-chunk1024"))


@pytest.mark.parametrize(("case", "chunk"), BLOCK_PARAMS)
def test_by_selection_block_matches_reference(
    case: Case, chunk: int, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward and dq by selection block (each block's query list against its keys, the parts merged
    per query in slot order) give the reference's output and gradients, whatever the entries a forward
    program walks, with rows that chose no block, and the same bits twice."""
    monkeypatch.setattr(selection, "SCAN_SPAN", 0)  # never the scan
    monkeypatch.setattr(selection, "BLOCKS_BYTES", 1 << 40)
    monkeypatch.setattr(selection, "BLOCKS_GROUP", 64)  # whatever the group
    monkeypatch.setattr(selection, "BLOCKS_CHUNK", chunk)
    block_idx = make_block_idx(case, device)
    block_idx[:, 3] = -1  # a row with no block: zeros out, no gradient
    kwargs = dict(sel_block_len=case.sel_block_len, q_offset=case.q_offset)
    o, dq, *_ = _check_against_reference(case, block_idx, device, kwargs)
    assert not o[:, 3].any()
    assert not dq[:, 3].any()


def test_by_selection_block_is_chosen_past_the_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """By selection block past the scan's lengths, where each workspace fits BLOCKS_BYTES (m7c-125m in bf16
    at 64k: 1.5 GiB of parts) and a KV group has at most BLOCKS_GROUP query heads (the paper's 16 heads a
    group stay per token at any length)."""

    def blocks(T: int, HQ: int, D: int, G: int, ls: int = 64, n: int = 16, dtype=torch.bfloat16) -> bool:
        return selection._blocks(torch.empty(1, T, HQ, D, device="meta", dtype=dtype), G, n, ls, T)

    span = selection.SCAN_SPAN * 16 * 64
    assert not blocks(span, 12, 64, 6)  # the scan
    assert blocks(span + 1, 12, 64, 6)
    assert blocks(65536, 12, 64, 6)
    assert not blocks(65536, 12, 64, 6, dtype=torch.float32)  # float32 parts: twice the bytes
    assert not blocks(131072, 12, 64, 6)
    assert blocks(16384, 32, 128, 8)
    assert not blocks(16384, 32, 128, 16)  # the group
    assert not blocks(span + 1, 64, 128, 16)
    assert blocks(1000, 4, 16, 2, ls=8, n=4)  # no scan under 16-key tiles
    monkeypatch.setattr(selection, "BLOCKS_GROUP", 16)
    assert blocks(span + 1, 64, 128, 16)
    monkeypatch.setattr(selection, "BLOCKS_BYTES", 0)
    assert not blocks(16384, 12, 64, 6)


def test_forward_by_block_chunks_grow_with_the_lists() -> None:
    """A forward program walks BLOCKS_CHUNK entries, more (up to 4x) where the lists are long enough to
    keep BLOCKS_PROGRAMS programs: m7c-125m at 16k 256, at 64k 1024 (H200, BENCHMARKS.md)."""

    def slots(T: int) -> int:  # m7c-125m's list entries at most: 2 KV groups x 16 slots a token
        return 2 * T * 16

    assert selection._blocks_chunk(slots(16384)) == selection.BLOCKS_CHUNK == 256
    assert selection._blocks_chunk(slots(32768)) == 512
    assert selection._blocks_chunk(slots(65536)) == 1024
    assert selection._blocks_chunk(slots(1 << 20)) == 1024
    assert selection._blocks_chunk(slots(37)) == 256


def test_hot_slots_are_the_prefix_sum_of_each_buckets_chunks(device: str) -> None:
    """The workspace slots of hot buckets: the definition in torch, over more buckets than one step holds."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 40, (2500,), generator=generator)
    counts[::7] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(device)
    chunk, n_chunks = 7, 5
    per_bucket = torch.where(counts > chunk, torch.clamp((counts + chunk - 1) // chunk, max=n_chunks), 0)
    expected = per_bucket.cumsum(0) - per_bucket
    assert torch.equal(hot_slots(offsets, chunk, n_chunks).cpu(), expected)


def _forward(q, k, v, block_idx, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    from nsa_core.ops.triton.selection import selected_fwd

    return selected_fwd(q, k, v, block_idx, case.sel_block_len, case.q_offset, case.D**-0.5)


def test_rows_without_blocks_give_zeros(device: str) -> None:
    """A row whose slots are all -1 outputs zeros and passes no gradient (the reference does the same)."""
    case = Case(B=1, T=20, HKV=2, G=2, D=SIZES.head_dims[0])
    block_idx = make_block_idx(case, device)
    block_idx[:, 3] = -1
    q, k, v, do = (x.float() for x in make_inputs(case, device, torch.float64))
    kwargs = dict(sel_block_len=case.sel_block_len)
    ref = run(lambda *a: reference(*a, block_idx, **kwargs), q, k, v, do)
    tri = run(lambda *a: triton_selected_attention(*a, block_idx, **kwargs), q, k, v, do)
    assert not tri[0][:, 3].any()
    assert not tri[1][:, 3].any()
    for name, r, t in zip(NAMES, ref, tri, strict=True):
        assert_close(name, r, t, FP32_RATIO, atol=1e-5)


def test_strided_inputs(device: str) -> None:
    """k and v as views of one projection (as `NSAAttention._kv` makes them), q with a custom scale."""
    case = Case(B=2, T=37, HKV=2, G=2, D=SIZES.head_dims[0])
    block_idx = make_block_idx(case, device)
    q, _, _, do = (x.float() for x in make_inputs(case, device, torch.float64))
    kv = torch.randn(case.B, case.T, 2, case.HKV, case.D, device=device)
    k, v = kv.unbind(2)
    kwargs = dict(sel_block_len=case.sel_block_len, scale=0.3)
    ref = run(lambda *a: reference(*a, block_idx, **kwargs), q, k, v, do)
    tri = run(lambda *a: triton_selected_attention(*a, block_idx, **kwargs), q, k, v, do)
    for name, r, t in zip(NAMES, ref, tri, strict=True):
        assert_close(name, r, t, FP32_RATIO, atol=1e-5)


def test_inverted_index(device: str) -> None:
    """Bucket (b, h, j) lists, in ascending order, the query rows whose group chose block j (causal only),
    each as row * n + the slot that holds j."""
    block_idx = torch.tensor([[[[0, -1]], [[0, 1]], [[1, 0]], [[2, 1]]]])  # [B=1, Tq=4, HKV=1, n=2]
    # q_offset=4, l'=4: rows 0..3 sit at t = 4..7; block 2 starts at 8 > t, so row 3's choice of it drops
    offsets, entries = build_block_queries(block_idx.to(device), num_keys=8, sel_block_len=4, q_offset=4)
    assert offsets.tolist() == [0, 3, 6]  # Ns = 2 buckets
    # block 0: rows 0, 1 (slot 0), 2 (slot 1); block 1: rows 1 (slot 1), 2 (slot 0), 3 (slot 1)
    assert entries[: offsets[-1]].tolist() == [0, 2, 5, 3, 4, 7]  # entries past the total are undefined


def _sorted_index(
    block_idx: torch.Tensor, num_keys: int, sel_block_len: int, q_offset: int
) -> list[list[int]]:
    # the index by its definition: per bucket (b, h, j), the rows whose group chose block j, ascending,
    # each as row * n + slot
    B, Tq, HKV, n = block_idx.shape
    Ns = -(-num_keys // sel_block_len)
    buckets: list[list[int]] = [[] for _ in range(B * HKV * Ns)]
    for b, t, h, i in itertools.product(range(B), range(Tq), range(HKV), range(n)):
        j = int(block_idx[b, t, h, i])
        if j >= 0 and j * sel_block_len <= q_offset + t:
            buckets[(b * HKV + h) * Ns + j].append(t * n + i)
    return buckets


@pytest.mark.parametrize("entries", [None, 64], ids=["one-chunk-size", "grown-chunks"])
def test_inverted_index_matches_its_definition(
    device: str, entries: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random choices with unused slots and blocks after their row, over several chunks of rows (and with
    chunks grown to bound the counters): the counting sort gives every bucket's rows in ascending order."""
    if entries is not None:
        monkeypatch.setattr(selection, "INDEX_ENTRIES", entries)
    gen = torch.Generator().manual_seed(3)
    B, Tq, HKV, n, l_sel, q_offset = 2, 45, 2, 3, 4, 7
    num_keys = q_offset + Tq
    block_idx = torch.randint(-1, -(-num_keys // l_sel), (B, Tq, HKV, n), generator=gen)
    block_idx[..., 1] = torch.where(block_idx[..., 1] == block_idx[..., 0], -1, block_idx[..., 1])
    block_idx[..., 2] = torch.where(
        (block_idx[..., 2] == block_idx[..., 0]) | (block_idx[..., 2] == block_idx[..., 1]),
        -1,
        block_idx[..., 2],
    )
    offsets, entries = build_block_queries(block_idx.to(device), num_keys, l_sel, q_offset)
    offsets, entries = offsets.cpu().tolist(), entries.cpu().tolist()
    expected = _sorted_index(block_idx, num_keys, l_sel, q_offset)
    assert len(offsets) == len(expected) + 1
    assert offsets[0] == 0
    assert [entries[offsets[i] : offsets[i + 1]] for i in range(len(expected))] == expected


def test_contract_errors() -> None:
    q, k = torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="block_idx"):
        triton_selected_attention(q, k, k, torch.zeros(1, 4, 2, 2, dtype=torch.long), sel_block_len=4)
    with pytest.raises(NotImplementedError, match="gather"):
        triton_selected_attention(
            q.double(), k.double(), k.double(), torch.zeros(1, 4, 1, 2, dtype=torch.long), sel_block_len=4
        )
