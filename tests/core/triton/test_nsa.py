"""The whole op in one autograd function (`triton_nsa_attention`) against the float64 references.

The reference is the gated sum of the three torch branches in float64 (`masked_compressed_attention`,
`gather_selected_attention` over the blocks the kernel chose, `chunked_sliding_window_attention`): the
output and the gradients of ``q``, the six key/value tensors and the gate logits. The fused selection
itself is tested in test_compression.py; here its ``block_idx`` must equal the composed path's. Float32
runs are bounded by a ratio; bf16/fp16 (CUDA) by a multiple of the composed Triton path's error in the
same dtype. The backward runs twice and must give the same gradients bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nsa_core.ops.compression import masked_compressed_attention, num_compressed_blocks
from nsa_core.ops.triton import (
    triton_compressed_attention,
    triton_gated_sum,
    triton_nsa_attention,
    triton_selected_attention,
    triton_sliding_window_attention,
)
from nsa_core.ops.window import chunked_sliding_window_attention

from ..utils import assert_close, assert_within_same_dtype_error
from .conftest import SIZES
from .test_selection import reference as selection_reference

FP32_RATIO = 2e-5
LOW_PRECISION_FACTOR = 2.0
LOW_PRECISION_FLOOR = 1e-4
NAMES = ("out", "dq", "dk_cmp", "dv_cmp", "dk_sel", "dv_sel", "dk_win", "dv_win", "d_gate")
SMALL = dict(block_len=8, block_stride=4, sel_block_len=16, n_sel=4, n_init=1, n_local=2, window=16)
PAPER = dict(block_len=32, block_stride=16, sel_block_len=64, n_sel=16, n_init=1, n_local=2, window=512)


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    HKV: int
    G: int
    D: int
    q_offset: int = 0
    paper: bool = False

    @property
    def geometry(self) -> dict[str, int]:
        return PAPER if self.paper else SMALL

    @property
    def id(self) -> str:
        off = f"-off{self.q_offset}" if self.q_offset else ""
        geometry = "paper" if self.paper else "small"
        return f"B{self.B}-T{self.T}{off}-HQ{self.HKV * self.G}-H{self.HKV}-D{self.D}-{geometry}"


def _cases() -> list[Case]:
    D, T = SIZES.head_dims[0], SIZES.seq_lens[-1]
    cases = [
        Case(B=2, T=T, HKV=2, G=SIZES.groups[-1], D=D),
        Case(B=1, T=SIZES.seq_lens[1], HKV=1, G=3, D=SIZES.head_dims[0 if SIZES.real else -1]),  # odd T
        Case(B=1, T=5, HKV=2, G=2, D=D, q_offset=40),  # a chunk after a cache
        Case(B=1, T=6, HKV=2, G=2, D=D),  # no complete compressed block: the composed path
    ]
    if SIZES.real:
        cases += [
            Case(B=1, T=5000, HKV=2, G=6, D=64, paper=True),  # m7c-125m past the scan: by selection block
            Case(B=1, T=4096, HKV=4, G=16, D=128, paper=True),  # PERFORMANCE.md's heads
            Case(B=1, T=2048, HKV=2, G=6, D=64, paper=True),  # m7c-125m
            Case(B=1, T=1000, HKV=2, G=4, D=64, q_offset=1100, paper=True),
        ]
    return cases


CASES = [pytest.param(c, id=c.id) for c in _cases()]


def _inputs(case: Case, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(case.T * 13 + case.G + case.D)
    g = case.geometry
    Tk, HQ = case.q_offset + case.T, case.HKV * case.G
    Nc = num_compressed_blocks(Tk, g["block_len"], g["block_stride"])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = randn(case.B, case.T, HQ, case.D)
    kv = [randn(case.B, Nc, case.HKV, case.D) for _ in range(2)]
    kv += [randn(case.B, Tk, case.HKV, case.D) for _ in range(4)]
    gate = 2.0 * randn(case.B, case.T, HQ, 3)
    do = randn(case.B, case.T, HQ, case.D)
    return [x.to(device) for x in (q, *kv, gate, do)]


def _fused(case: Case, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_nsa_attention(*xs, q_offset=case.q_offset, **case.geometry)


def _composed(case: Case, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gate = xs
    g = case.geometry
    select = dict(kv_heads=case.HKV, **{k: g[k] for k in ("sel_block_len", "n_sel", "n_init", "n_local")})
    o_cmp, block_idx = triton_compressed_attention(
        q, k_cmp, v_cmp, block_len=g["block_len"], block_stride=g["block_stride"], q_offset=case.q_offset,
        select=select,
    )  # fmt: skip
    o_sel = triton_selected_attention(
        q, k_sel, v_sel, block_idx, sel_block_len=g["sel_block_len"], q_offset=case.q_offset
    )
    o_win = triton_sliding_window_attention(q, k_win, v_win, window=g["window"], q_offset=case.q_offset)
    return triton_gated_sum(gate, o_cmp, o_sel, o_win), block_idx


def _reference(case: Case, block_idx: torch.Tensor):
    def run(*xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gate = xs
        g = case.geometry
        o_cmp, _ = masked_compressed_attention(
            q, k_cmp, v_cmp, block_len=g["block_len"], block_stride=g["block_stride"], q_offset=case.q_offset
        )
        o_sel = selection_reference(
            q, k_sel, v_sel, block_idx, sel_block_len=g["sel_block_len"], q_offset=case.q_offset
        )
        o_win = chunked_sliding_window_attention(q, k_win, v_win, window=g["window"], q_offset=case.q_offset)
        s = torch.sigmoid(gate)[..., None]
        return s[..., 0, :] * o_cmp + s[..., 1, :] * o_sel + s[..., 2, :] * o_win, block_idx

    return run


def _run(fn, xs: list[torch.Tensor], dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    *inputs, do = (x.detach().to(dtype) for x in xs)
    inputs = [x.requires_grad_(True) for x in inputs]
    out, block_idx = fn(inputs)
    out.backward(do)
    # no complete compressed block: k_cmp/v_cmp are empty and may get no gradient at all
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs]
    return [out.detach(), *grads], block_idx


# each case compiles some twenty float32 kernels (fused and composed) before it runs: on CUDA that took up
# to 200 s with other test files compiling beside it (H100 machine, 16 CPUs)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_fused_op_matches_reference_fp32(case: Case, device: str) -> None:
    xs = _inputs(case, device)
    tri, tri_idx = _run(lambda ins: _fused(case, ins), xs, torch.float32)
    _, composed_idx = _run(lambda ins: _composed(case, ins), xs, torch.float32)
    assert torch.equal(tri_idx, composed_idx), "the fused op chose other blocks than the composed path"
    ref, _ = _run(lambda ins: _reference(case, tri_idx)(*ins), xs, torch.float64)
    for name, r, t in zip(NAMES, ref, tri, strict=True):
        assert_close(name, r, t.double(), FP32_RATIO)


@pytest.mark.parametrize("dtype", SIZES.dtypes, ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c.values[0].paper])
def test_fused_op_low_precision_within_composed_error(case: Case, dtype: torch.dtype, device: str) -> None:
    xs = _inputs(case, device)
    tri, tri_idx = _run(lambda ins: _fused(case, ins), xs, dtype)
    base, _ = _run(lambda ins: _composed(case, ins), xs, dtype)
    ref, _ = _run(lambda ins: _reference(case, tri_idx)(*ins), xs, torch.float64)
    for name, r, b, t in zip(NAMES, ref, base, tri, strict=True):
        assert t.dtype == dtype
        assert_within_same_dtype_error(name, r, b, t, LOW_PRECISION_FLOOR, LOW_PRECISION_FACTOR)


# float32 at real size compiles its own kernels first: 239 s on an H100 with five test processes side by side
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [torch.float32, *SIZES.dtypes], ids=str)
def test_fused_backward_is_deterministic(dtype: torch.dtype, device: str) -> None:
    case = CASES[-3 if SIZES.real else 0].values[0]
    xs = _inputs(case, device)
    first, _ = _run(lambda ins: _fused(case, ins), xs, dtype)
    second, _ = _run(lambda ins: _fused(case, ins), xs, dtype)
    for name, a, b in zip(NAMES, first, second, strict=True):
        assert torch.equal(a, b), f"{name} differs between two runs"


@pytest.mark.timeout(600)
def test_fused_op_by_selection_block(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The selection by selection block inside the fused op (the forward's inverted index kept for the
    backward, dq's parts summed before the window's and compression's dq are added): the reference's
    output and gradients in float32, the same bits twice."""
    from nsa_core.ops.triton import selection

    monkeypatch.setattr(selection, "SCAN_SPAN", 0)
    monkeypatch.setattr(selection, "BLOCKS_BYTES", 1 << 40)
    monkeypatch.setattr(selection, "BLOCKS_GROUP", 64)
    case = CASES[0].values[0]
    xs = _inputs(case, device)
    tri, tri_idx = _run(lambda ins: _fused(case, ins), xs, torch.float32)
    again, _ = _run(lambda ins: _fused(case, ins), xs, torch.float32)
    ref, _ = _run(lambda ins: _reference(case, tri_idx)(*ins), xs, torch.float64)
    for name, r, t, t2 in zip(NAMES, ref, tri, again, strict=True):
        assert_close(name, r, t.double(), FP32_RATIO)
        assert torch.equal(t, t2), f"{name} differs between two runs"


class _Counted:
    """A kernel launched as ``kernel[grid](...)``, its launches counted."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


SHARED_NAMES = ("out", "dq", "dk_cmp", "dv_cmp", "dk", "dv", "d_gate")


def _run_shared(fn, xs: list[torch.Tensor], dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    # one k and one v for the selection and the window (k_sel, v_sel of xs), as the op is commonly called
    q, k_cmp, v_cmp, k, v, _, _, gate, do = (x.detach().to(dtype) for x in xs)
    leaves = [x.requires_grad_(True) for x in (q, k_cmp, v_cmp, k, v, gate)]
    q, k_cmp, v_cmp, k, v, gate = leaves
    out, block_idx = fn([q, k_cmp, v_cmp, k, v, k, v, gate])
    out.backward(do)
    return [out.detach(), *(x.grad for x in leaves)], block_idx


@pytest.mark.timeout(600)
@pytest.mark.parametrize("splits", ["partial sums", "one program per key tile"])
@pytest.mark.parametrize(
    "case", [CASES[0], *(c for c in CASES if c.values[0].paper)][: 3 if SIZES.real else 1]
)
def test_fused_op_with_shared_keys(
    case: Case, splits: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The selection and the window on the same k and v: the window's backward adds its dK/dV into the
    selection's (in the sum of its partial sums, or after its one pass) and the op returns one gradient
    each. The float64 reference's gradients (autograd's sums), the same bits twice, and in bf16/fp16
    within the composed path's error."""
    from nsa_core.ops.triton import flash

    if splits == "partial sums":  # programs enough for the heads to split and the queries to chunk
        monkeypatch.setattr(flash, "program_target", lambda device: 1 << 12)
    else:
        monkeypatch.setattr(flash, "SPLIT_WORKSPACE_BYTES", 0)  # no head splits, no query chunks
    sums = _Counted(flash._dkdv_sum_kernel)
    monkeypatch.setattr(flash, "_dkdv_sum_kernel", sums)
    xs = _inputs(case, device)
    tri, tri_idx = _run_shared(lambda ins: _fused(case, ins), xs, torch.float32)
    assert (sums.launches > 0) == (splits == "partial sums")
    again, _ = _run_shared(lambda ins: _fused(case, ins), xs, torch.float32)
    ref, _ = _run_shared(lambda ins: _reference(case, tri_idx)(*ins), xs, torch.float64)
    for name, r, t, t2 in zip(SHARED_NAMES, ref, tri, again, strict=True):
        assert_close(name, r, t.double(), FP32_RATIO)
        assert torch.equal(t, t2), f"{name} differs between two runs"
    for dtype in SIZES.dtypes:
        tri, _ = _run_shared(lambda ins: _fused(case, ins), xs, dtype)
        base, _ = _run_shared(lambda ins: _composed(case, ins), xs, dtype)
        for name, r, b, t in zip(SHARED_NAMES, ref, base, tri, strict=True):
            assert_within_same_dtype_error(name, r, b, t, LOW_PRECISION_FLOOR, LOW_PRECISION_FACTOR)


# the m7c-125m geometry at 2048 (the scan) and at 5000 (by selection block)
GRAPH_CASES = [CASES[-2], CASES[-4]] if SIZES.real else CASES[:1]


@pytest.mark.parametrize("dtype", SIZES.dtypes, ids=str)
@pytest.mark.parametrize("case", GRAPH_CASES)
def test_fused_op_replays_in_a_cuda_graph(case: Case, dtype: torch.dtype, device: str) -> None:
    """The op issues no host synchronisation and allocates nothing whose size depends on the data, so its
    forward and backward can be captured in CUDA graphs (`torch.cuda.make_graphed_callables`: what
    removes the host from a short sequence's step); a replay gives the eager output and gradients bit
    for bit, also on new inputs copied into the graph's."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a CUDA device (the interpreter runs kernels on the CPU)")

    class Op(torch.nn.Module):
        def forward(self, *xs: torch.Tensor) -> torch.Tensor:
            return _fused(case, list(xs))[0]

    def inputs(seed: int) -> list[torch.Tensor]:
        *xs, do = _inputs(case, device)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        xs = [x + 0.1 * torch.randn(x.shape, generator=gen, dtype=x.dtype).to(device) for x in xs]
        return [*xs, do]

    graphed = torch.cuda.make_graphed_callables(
        Op(), tuple(x.to(dtype).requires_grad_(True) for x in inputs(0)[:-1])
    )
    for seed in (1, 2):
        xs = inputs(seed)
        eager, _ = _run(lambda ins: (Op()(*ins), None), xs, dtype)
        replayed, _ = _run(lambda ins: (graphed(*ins), None), xs, dtype)
        for name, a, b in zip(NAMES, eager, replayed, strict=True):
            assert torch.equal(a, b), f"{name}: the CUDA graph's replay differs from the eager op"


def test_fused_op_rejects_bad_arguments(device: str) -> None:
    case = Case(B=1, T=24, HKV=1, G=2, D=16)
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gate, _ = _inputs(case, device)
    kv = (k_cmp, v_cmp, k_sel, v_sel, k_win, v_win)
    with pytest.raises(ValueError, match="gate_logits"):
        triton_nsa_attention(q, *kv, gate[..., :2], **SMALL)
    with pytest.raises(ValueError, match="window"):
        triton_nsa_attention(q, *kv, gate, **{**SMALL, "window": 0})
    with pytest.raises(NotImplementedError, match="float16, bfloat16 or float32"):
        triton_nsa_attention(q, *kv, gate, **SMALL)  # float64


@pytest.mark.slow  # Dynamo and the interpreter: ~7-10 s each on the CPU (make test-slow runs it there)
@pytest.mark.parametrize("op", ["fused", "composed"])
def test_the_ops_run_between_graphs_of_a_compiled_function(op: str, device: str) -> None:
    """torch.compile (inductor on CUDA, aot_eager under the interpreter) of a function that calls the ops
    between other torch ops: each op runs as it does eagerly, between graphs (traced, inductor compiled its
    kernels again with fp64 float arguments and refused them); its calls are the only graph breaks, and
    the output and every gradient are the eager function's."""
    from torch._dynamo.utils import counters

    case = _cases()[0]
    xs = _inputs(case, device)
    ops = _fused if op == "fused" else _composed

    def fn(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        q, *rest = inputs
        out, block_idx = ops(case, [q * 0.5, *rest])
        return torch.tanh(out) * 2.0, block_idx

    eager, eager_idx = _run(fn, xs, torch.float32)
    torch._dynamo.reset()
    counters.clear()
    compiled, compiled_idx = _run(
        torch.compile(fn, backend="inductor" if SIZES.real else "aot_eager"), xs, torch.float32
    )
    breaks = dict(counters["graph_break"])
    assert breaks
    assert all("untraced" in reason for reason in breaks), breaks
    assert torch.equal(compiled_idx, eager_idx)
    for name, e, c in zip(NAMES, eager, compiled, strict=True):
        assert_close(name, e.double(), c.double(), 1e-5)
