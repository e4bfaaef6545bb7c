"""The Triton block compressor against `BlockCompressor` itself run in float64: the output and the gradients
of the raw keys and of the five weights, over block geometries where a token lies in one, two or three
blocks, a tail of tokens in no block, and a first block past zero (a cache's next blocks). On CUDA the
bf16/fp16 runs are bounded by a multiple of the module's own error in the same dtype."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nsa_core.layers.attention import BlockCompressor
from nsa_core.ops.compression import unfold_blocks
from nsa_core.ops.triton.compressor import runs_in_triton, triton_block_compress, triton_block_compress_pair

from ..utils import assert_close, assert_within_same_dtype_error
from .conftest import SIZES

FP32_RATIO = 1e-5  # float32 kernels against float64: summation order only


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    D: int
    block_len: int
    block_stride: int
    first: int = 0

    @property
    def id(self) -> str:
        return f"B{self.B}-T{self.T}-H{self.H}-D{self.D}-l{self.block_len}-d{self.block_stride}-f{self.first}"


def _cases() -> list[Case]:
    cases = []
    for D in SIZES.head_dims:
        T = max(SIZES.seq_lens)
        cases += [
            Case(2, T + 5, 2, D, 8, 4),  # a token in two blocks, a tail in none
            Case(1, T, 3, D, 8, 8),  # one block a token
            Case(1, T + 3, 1, D, 12, 4, first=2),  # three blocks a token, from block 2 on
        ]
    if SIZES.real:
        cases.append(Case(2, 2048, 2, 64, 32, 16))  # m7c-125m's compressor
    return cases


CASES = _cases()


def _module(case: Case, dtype: torch.dtype, device: str) -> BlockCompressor:
    torch.manual_seed(case.T + case.D)
    phi = BlockCompressor(case.block_len, case.D)
    with torch.no_grad():
        phi.pos.normal_()  # O(1) position codes: their gradient is compared at its own scale
    return phi.to(device=device, dtype=dtype)


def _weights(phi: BlockCompressor) -> tuple[torch.Tensor, ...]:
    return (phi.pos, phi.mlp[0].weight, phi.mlp[0].bias, phi.mlp[2].weight, phi.mlp[2].bias)


def _run(case: Case, dtype: torch.dtype, device: str, triton: bool) -> list[torch.Tensor]:
    """The output, then the gradients of raw and of the five weights, as float64 on the CPU."""
    phi = _module(case, dtype, device)
    gen = torch.Generator().manual_seed(case.T)
    raw64 = torch.randn(case.B, case.T, case.H, case.D, generator=gen, dtype=torch.float64)
    raw = raw64.to(device=device, dtype=dtype).requires_grad_(True)
    geometry = dict(block_len=case.block_len, block_stride=case.block_stride, first=case.first)
    if triton:
        assert runs_in_triton(raw, _weights(phi), case.block_len)
        out = triton_block_compress(raw, _weights(phi), **geometry)
    else:
        out = phi(unfold_blocks(raw, **geometry))
    dy = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    out.backward(dy)
    return [x.detach().double().cpu() for x in (out, raw.grad, *(w.grad for w in _weights(phi)))]


NAMES = ("out", "d_raw", "d_pos", "d_w1", "d_b1", "d_w2", "d_b2")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_compressor_fp32_matches_float64_module(case: Case, device: str) -> None:
    ref = _run(case, torch.float64, "cpu", triton=False)
    tri = _run(case, torch.float32, device, triton=True)
    for name, r, t in zip(NAMES, ref, tri, strict=True):
        assert_close(name, r, t, FP32_RATIO, atol=1e-5)


@pytest.mark.skipif(not SIZES.dtypes, reason="bf16/fp16 runs need CUDA")
@pytest.mark.parametrize("dtype", SIZES.dtypes, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_compressor_low_precision_within_module_error(case: Case, dtype: torch.dtype, device: str) -> None:
    ref = _run(case, torch.float64, "cpu", triton=False)
    base = _run(case, dtype, device, triton=False)
    tri = _run(case, dtype, device, triton=True)
    for name, r, b, t in zip(NAMES, ref, base, tri, strict=True):
        assert_within_same_dtype_error(name, r, b, t, floor=1e-3)


def test_compressor_falls_back_to_torch(device: str) -> None:
    # no complete block, a head dim the kernels do not take, weights of another dtype: the module's result
    for D, T, wdtype in ((16, 3, torch.float32), (24, 40, torch.float32), (16, 40, torch.float64)):
        phi = BlockCompressor(8, D).to(device=device, dtype=wdtype)
        raw = torch.randn(1, T, 2, D, device=device)
        out = triton_block_compress(raw.to(wdtype), _weights(phi), block_len=8, block_stride=4)
        expected = phi(unfold_blocks(raw.to(wdtype), 8, 4))
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="block_stride=0"):
        triton_block_compress(raw, _weights(phi), block_len=8, block_stride=0)


@pytest.mark.parametrize("dtype", SIZES.dtypes, ids=str)
def test_compressor_replays_in_a_cuda_graph(dtype: torch.dtype, device: str) -> None:
    """No host synchronisation and no data-dependent allocation: forward and backward captured in CUDA graphs
    (`torch.cuda.make_graphed_callables`) replay the eager output and gradients bit for bit."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a CUDA device (the interpreter runs kernels on the CPU)")
    case = CASES[-1]
    phi = _module(case, dtype, device)
    geometry = dict(block_len=case.block_len, block_stride=case.block_stride)

    def eager(raw: torch.Tensor) -> torch.Tensor:
        return triton_block_compress(raw, _weights(phi), **geometry)

    class Phi(torch.nn.Module):  # phi's weights are the graph's parameters: their gradients are replayed
        def __init__(self) -> None:
            super().__init__()
            self.phi = phi

        def forward(self, raw: torch.Tensor) -> torch.Tensor:
            return eager(raw)

    shape = (case.B, case.T, case.H, case.D)
    graphed = torch.cuda.make_graphed_callables(
        Phi(), (torch.randn(shape, device=device, dtype=dtype, requires_grad=True),)
    )
    for seed in (1, 2):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        raw = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        results = []
        for fn in (eager, graphed):
            phi.zero_grad(set_to_none=True)
            x = raw.clone().requires_grad_(True)
            out = fn(x)
            out.backward(torch.ones_like(out))
            results.append([out.detach(), x.grad, *(w.grad.clone() for w in _weights(phi))])
        for name, a, b in zip(NAMES, *results, strict=True):
            assert torch.equal(a, b), f"{name}: the CUDA graph's replay differs from the eager run"


@pytest.mark.parametrize("max_splits", [16, 2], ids=["splits", "capped"])
def test_compressor_weight_sums_split_over_rows(
    max_splits: int, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long sequences split the weights' sums over row ranges, added in order by a second kernel: the same
    gradients as the float64 module, with as many splits as the rows ask for or fewer, longer ones."""
    from nsa_core.ops.triton import compressor

    monkeypatch.setattr(compressor, "SPLIT_ROWS", compressor.BLOCK_ROWS)
    monkeypatch.setattr(compressor, "MAX_SPLITS", max_splits)
    reduce = compressor._compress_bwd_weight_reduce_kernel
    grids: list[tuple[int, ...]] = []
    original = reduce.launch
    monkeypatch.setattr(reduce, "launch", lambda grid, *a, **k: (grids.append(grid), original(grid, *a, **k)))
    case = Case(2, 3 * max(SIZES.seq_lens) + 5, 4, SIZES.head_dims[0], 8, 4)  # 2 x 4 heads x 48 blocks
    ref = _run(case, torch.float64, "cpu", triton=False)
    tri = _run(case, torch.float32, device, triton=True)
    assert grids == [(case.block_len + 1, 1)]  # split: the partial sums added once (one member)
    for name, r, t in zip(NAMES, ref, tri, strict=True):
        assert_close(name, r, t, FP32_RATIO, atol=1e-5)


def _pair_run(case: Case, dtype: torch.dtype, device: str, pair: bool) -> list[torch.Tensor]:
    """Keys' and values' phi (two modules, two raw tensors) through `triton_block_compress_pair` or two
    `triton_block_compress` calls: both outputs, then the gradients of both raws and of both weight sets."""
    phis = [_module(case, dtype, device) for _ in range(2)]
    with torch.no_grad():
        for w in _weights(phis[1]):
            w.mul_(-0.5)  # the values' weights unlike the keys'
    gen = torch.Generator().manual_seed(case.T + 1)
    raws = [
        torch.randn(case.B, case.T, case.H, case.D, generator=gen)
        .to(device=device, dtype=dtype)
        .requires_grad_()
        for _ in range(2)
    ]
    geometry = dict(block_len=case.block_len, block_stride=case.block_stride, first=case.first)
    if pair:
        outs = triton_block_compress_pair(tuple(raws), tuple(_weights(phi) for phi in phis), **geometry)
    else:
        outs = [
            triton_block_compress(raw, _weights(phi), **geometry) for raw, phi in zip(raws, phis, strict=True)
        ]
    dys = [torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype) for out in outs]
    torch.autograd.backward(outs, dys)
    grads = [w.grad for phi in phis for w in _weights(phi)]
    return [x.detach() for x in (*outs, *(raw.grad for raw in raws), *grads)]


@pytest.mark.parametrize("split", [False, True], ids=["one pass", "split sums"])
@pytest.mark.parametrize("case", CASES[:3] + CASES[-1:], ids=lambda c: c.id)
def test_compressor_pair_equals_two_calls(
    case: Case, split: bool, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys' and values' phi in the same launches: both outputs and all fourteen gradients equal those
    of two calls bit for bit (the same kernels, the member a program axis), in float32 and bf16/fp16, with
    the weights' sums in one pass and split over row ranges."""
    from nsa_core.ops.triton import compressor

    if split:
        monkeypatch.setattr(compressor, "SPLIT_ROWS", compressor.BLOCK_ROWS)
    launches = []
    original = compressor.BlockCompressFunction.apply
    monkeypatch.setattr(
        compressor.BlockCompressFunction, "apply", lambda *a: (launches.append(len(a)), original(*a))[1]
    )
    for dtype in (torch.float32, *SIZES.dtypes):
        launches.clear()
        pair = _pair_run(case, dtype, device, pair=True)
        assert launches == [3 + 12], "the pair did not run as one function"
        two = _pair_run(case, dtype, device, pair=False)
        for i, (a, b) in enumerate(zip(pair, two, strict=True)):
            assert torch.equal(a, b), f"{dtype} tensor {i} of the pair differs from two calls"


def test_compressor_pair_of_unlike_tensors_makes_two_calls(device: str) -> None:
    # raws of two layouts (one a transposed view): two calls, each as `triton_block_compress` alone
    case = CASES[0]
    phis = [_module(case, torch.float32, device) for _ in range(2)]
    raw = torch.randn(case.B, case.T, case.H, case.D, device=device)
    other = torch.randn(case.B, case.H, case.T, case.D, device=device).transpose(1, 2)
    geometry = dict(block_len=case.block_len, block_stride=case.block_stride)
    pair = triton_block_compress_pair((raw, other), tuple(_weights(phi) for phi in phis), **geometry)
    for out, x, phi in zip(pair, (raw, other), phis, strict=True):
        assert torch.equal(out, triton_block_compress(x, _weights(phi), **geometry))
    with pytest.raises(ValueError, match="block_stride=0"):
        triton_block_compress_pair(
            (raw, raw), tuple(_weights(phi) for phi in phis), block_len=8, block_stride=0
        )
