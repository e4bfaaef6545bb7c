"""Triton sliding-window attention against the float64 torch path: outputs, dq, dk and dv.

Under the interpreter (CPU, ``TRITON_INTERPRET=1``) the inputs are float32 with a relative RMS bound; on
CUDA the same tests run at real sizes, and bf16/fp16 runs are bounded by a multiple of the error of the
`chunked` torch backend run in the same dtype (flash-attention's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nsa_core.ops.triton.window import triton_sliding_window_attention
from nsa_core.ops.window import chunked_sliding_window_attention

from ..utils import assert_close, assert_within_same_dtype_error
from .conftest import SIZES

FP32_RATIO = 2e-5  # float32 kernel vs float64 reference: summation order and exp2 only
# bf16/fp16: error <= LOW_PRECISION_FACTOR x the same-dtype torch run's error + LOW_PRECISION_FLOOR
LOW_PRECISION_FACTOR = 2.0
LOW_PRECISION_FLOOR = 1e-4


@dataclass(frozen=True)
class Case:
    B: int
    T: int  # query tokens
    HKV: int
    G: int
    D: int
    window: int
    q_offset: int = 0

    @property
    def id(self) -> str:
        off = f"-off{self.q_offset}" if self.q_offset else ""
        return f"B{self.B}-T{self.T}{off}-HQ{self.HKV * self.G}-H{self.HKV}-D{self.D}-w{self.window}"


def _cases() -> list[Case]:
    w = 512 if SIZES.real else 16
    cases = [
        Case(B=2, T=T, HKV=2, G=G, D=D, window=w)
        for T in SIZES.seq_lens
        for G in SIZES.groups
        for D in SIZES.head_dims
    ]
    D, T = SIZES.head_dims[0], SIZES.seq_lens[-1]
    cases += [
        Case(B=1, T=1, HKV=2, G=4, D=D, window=w, q_offset=3 * w - 5),  # decode past the window
        Case(B=2, T=5, HKV=2, G=2, D=D, window=w, q_offset=w + 3),  # a chunk after a cache
        Case(B=1, T=T, HKV=1, G=3, D=D, window=1),  # every query reads itself alone
        Case(B=1, T=T, HKV=2, G=2, D=D, window=2 * T),  # window longer than the sequence: causal
        Case(B=1, T=T, HKV=2, G=1, D=D, window=w - 3),  # window no multiple of a tile
    ]
    if SIZES.real:
        cases += [
            Case(B=1, T=8192, HKV=4, G=16, D=128, window=512),  # the paper's geometry, PERFORMANCE.md's heads
            Case(B=1, T=2048, HKV=2, G=6, D=64, window=512),  # m7c-125m
            Case(B=1, T=3000, HKV=2, G=4, D=192, window=500),  # D and w not powers of 2
            Case(B=1, T=1, HKV=4, G=16, D=128, window=512, q_offset=8191),
        ]
    return cases


CASES = [pytest.param(c, id=c.id) for c in _cases()]


def _inputs(case: Case, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cpu").manual_seed(case.T * 7 + case.G)
    HQ, Tk = case.HKV * case.G, case.q_offset + case.T
    q = torch.randn(case.B, case.T, HQ, case.D, generator=gen, dtype=torch.float64)
    k = torch.randn(case.B, Tk, case.HKV, case.D, generator=gen, dtype=torch.float64)
    v = torch.randn(case.B, Tk, case.HKV, case.D, generator=gen, dtype=torch.float64)
    do = torch.randn(case.B, case.T, HQ, case.D, generator=gen, dtype=torch.float64)
    return tuple(x.to(device) for x in (q, k, v, do))


def _run(fn, case: Case, inputs: tuple[torch.Tensor, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    q, k, v, do = (x.detach().to(dtype).requires_grad_(i < 3) for i, x in enumerate(inputs))
    o = fn(q, k, v, window=case.window, q_offset=case.q_offset)
    o.backward(do)
    return [o.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("case", CASES)
def test_window_fp32_matches_reference(case: Case, device: str) -> None:
    inputs = _inputs(case, device)
    ref = _run(chunked_sliding_window_attention, case, inputs, torch.float64)
    tri = _run(triton_sliding_window_attention, case, inputs, torch.float32)
    for name, r, t in zip(("o", "dq", "dk", "dv"), ref, tri, strict=True):
        assert t.dtype == torch.float32
        assert_close(name, r, t, FP32_RATIO, atol=1e-5)  # dk of one key: ref 0, ours ~1e-7


SMALL_TILE_CASES = [
    pytest.param(c, id=c.id)
    for c in (
        Case(B=1, T=100, HKV=2, G=2, D=16, window=40),  # tiles inside the band, both edges masked
        Case(B=1, T=100, HKV=1, G=2, D=16, window=37),  # band edge inside a tile
        Case(B=1, T=100, HKV=1, G=1, D=16, window=200),  # causal only
        Case(B=2, T=45, HKV=1, G=2, D=16, window=33, q_offset=51),  # a chunk after a cache
    )
]


@pytest.mark.parametrize("case", SMALL_TILE_CASES)
def test_window_unmasked_tiles_match_reference(case: Case, device: str, small_tiles: int) -> None:
    """Tiles every query of a tile reads whole skip the mask: the band's edges must still be exact."""
    inputs = _inputs(case, device)
    ref = _run(chunked_sliding_window_attention, case, inputs, torch.float64)
    tri = _run(triton_sliding_window_attention, case, inputs, torch.float32)
    for name, r, t in zip(("o", "dq", "dk", "dv"), ref, tri, strict=True):
        assert_close(name, r, t, FP32_RATIO, atol=1e-5)


@pytest.mark.skipif(not SIZES.dtypes, reason="bf16/fp16 runs need CUDA")
@pytest.mark.parametrize("dtype", SIZES.dtypes, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_window_low_precision_within_torch_error(case: Case, dtype: torch.dtype, device: str) -> None:
    inputs = _inputs(case, device)
    ref = _run(chunked_sliding_window_attention, case, inputs, torch.float64)
    torch_lp = _run(chunked_sliding_window_attention, case, inputs, dtype)
    tri = _run(triton_sliding_window_attention, case, inputs, dtype)
    for name, r, base, t in zip(("o", "dq", "dk", "dv"), ref, torch_lp, tri, strict=True):
        assert t.dtype == dtype
        # w = 1: dq is zero, and rounding noise
        assert_within_same_dtype_error(name, r, base, t, LOW_PRECISION_FLOOR, LOW_PRECISION_FACTOR)


def test_window_backward_is_deterministic(device: str) -> None:
    case = Case(B=1, T=SIZES.seq_lens[-1], HKV=2, G=SIZES.groups[-1], D=SIZES.head_dims[0], window=16)
    inputs = _inputs(case, device)
    first = _run(triton_sliding_window_attention, case, inputs, torch.float32)
    second = _run(triton_sliding_window_attention, case, inputs, torch.float32)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_window_rejects_bad_arguments(device: str) -> None:
    q = torch.randn(1, 4, 2, 16, device=device)
    k = torch.randn(1, 4, 1, 16, device=device)
    with pytest.raises(ValueError, match="window"):
        triton_sliding_window_attention(q, k, k, window=0)
    with pytest.raises(ValueError, match="q_offset"):
        triton_sliding_window_attention(q, k, k, window=4, q_offset=2)
    with pytest.raises(ValueError, match="dtype"):
        triton_sliding_window_attention(q, k.double(), k.double(), window=4)


def test_head_splits_give_the_same_gradients(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """dK/dV split over the query heads of a group (few key tiles) equals the unsplit backward."""
    from nsa_core.ops.triton import flash

    case = Case(B=1, T=SIZES.seq_lens[-1], HKV=2, G=4, D=SIZES.head_dims[0], window=16)
    inputs = _inputs(case, device)
    runs = []
    for target in (1, 1 << 30):  # never split; split the G = 4 heads into 4
        monkeypatch.setattr(flash, "program_target", lambda device, target=target: target)
        runs.append(_run(triton_sliding_window_attention, case, inputs, torch.float32))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_head_splits_respect_the_workspace() -> None:
    from nsa_core.ops.triton.flash import SPLIT_WORKSPACE_BYTES, head_splits

    assert head_splits(32, 16, 1 << 10, 528) == 16  # 32 programs: 16 splits reach 512 < 528, the most
    assert head_splits(256, 16, 1 << 10, 528) == 4  # 4 x 256 >= 528
    assert head_splits(256, 6, 1 << 10, 528) == 3  # divisors of G only
    assert head_splits(4096, 16, 1 << 10, 528) == 1
    big = SPLIT_WORKSPACE_BYTES // 8 // 2  # two splits fit, four do not
    assert head_splits(32, 16, big, 528) == 2
