"""Every attention backend against the naive reference, in float64: outputs and the gradients of q, k, v.

Shapes cover GQA group sizes 1, 2 and 4, sequence lengths below one block, not a multiple of any block and
longer than the window, and decode-style chunks (``Tq`` queries at the end of ``Tk = q_offset + Tq`` keys).
Selected attention is fed the same ``block_idx`` on both sides, so it is tested apart from the selection.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import nsa_core
from nsa_core.ops.compression import compressed_attention, masked_compressed_attention
from nsa_core.ops.reference import (
    naive_compressed_attention,
    naive_select_blocks,
    naive_selected_attention,
    naive_sliding_window_attention,
)
from nsa_core.ops.selection import (
    gather_selected_attention,
    masked_selected_attention,
    packed_selected_attention,
    select_blocks,
    selected_attention,
)
from nsa_core.ops.window import (
    chunked_sliding_window_attention,
    masked_sliding_window_attention,
    sliding_window_attention,
)

from .utils import DTYPE, TINY, Geometry, assert_close, get_err_ratio, visible_blocks_mask

B, HKV, D = 2, 2, 16

# (Tq, q_offset): whole sequences (q_offset = 0), then decode-style chunks at the end of longer keys
SEQUENCES = [
    (1, 0),  # one token: no compressed block, one selection block
    (7, 0),  # shorter than one compressed block
    (37, 0),  # no multiple of l=8, d=4 or l'=16; longer than the window 32
    (64, 0),  # two windows
    (1, 7),  # decode at the first position that sees a compressed block
    (1, 44),  # decode past the window
    (5, 40),  # a chunk of 5 queries after 40 cached keys
    (3, 61),  # a chunk ending at 64 keys
]
GROUPS = (1, 2, 4)
# the backends under test: every one the config accepts, except the reference they are compared with
CMP_BACKENDS = [b for b in nsa_core.CMP_BACKENDS if b != "reference"]
SEL_BACKENDS = [b for b in nsa_core.SEL_BACKENDS if b != "reference"]
WIN_BACKENDS = [b for b in nsa_core.WIN_BACKENDS if b != "reference"]


def seq_id(tq: int, q_offset: int) -> str:
    return f"T{tq}" if q_offset == 0 else f"Tq{tq}-off{q_offset}"


CASES = [
    pytest.param(group, tq, q_offset, id=f"B{B}-{seq_id(tq, q_offset)}-HQ{HKV * group}-HKV{HKV}-D{D}")
    for group in GROUPS
    for tq, q_offset in SEQUENCES
]


def rand(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=DTYPE).requires_grad_(grad)


def grads(
    out: torch.Tensor, inputs: tuple[torch.Tensor, ...], dout: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    # inputs a query never reads (no visible block) get zeros, not None
    return torch.autograd.grad(out, inputs, dout, allow_unused=True, materialize_grads=True)


def check_parity(
    ref_fn: Callable[..., torch.Tensor],
    tri_fn: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """``tri_fn(q, k, v)`` equals ``ref_fn(q, k, v)`` in its output and in dq, dk, dv."""
    ref_o = ref_fn(q, k, v)
    tri_o = tri_fn(q, k, v)
    dout = torch.randn_like(ref_o)
    ref_dq, ref_dk, ref_dv = grads(ref_o, (q, k, v), dout)
    tri_dq, tri_dk, tri_dv = grads(tri_o, (q, k, v), dout)
    assert_close("o", ref_o, tri_o)
    assert_close("dq", ref_dq, tri_dq)
    assert_close("dk", ref_dk, tri_dk)
    assert_close("dv", ref_dv, tri_dv)


# --- compression -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CMP_BACKENDS)
@pytest.mark.parametrize("group, tq, q_offset", CASES)
def test_compressed_attention(backend: str, group: int, tq: int, q_offset: int) -> None:
    geo = TINY
    nc = geo.num_cmp_blocks(q_offset + tq)
    q, k_cmp, v_cmp = rand(B, tq, HKV * group, D), rand(B, nc, HKV, D), rand(B, nc, HKV, D)
    kwargs = dict(block_len=geo.block_len, block_stride=geo.block_stride, q_offset=q_offset)

    ref_o, ref_p = naive_compressed_attention(q, k_cmp, v_cmp, **kwargs)
    tri_o, tri_p = compressed_attention(q, k_cmp, v_cmp, backend=backend, **kwargs)
    assert_close("p", ref_p, tri_p)
    check_parity(
        lambda *a: naive_compressed_attention(*a, **kwargs)[0],
        lambda *a: compressed_attention(*a, backend=backend, **kwargs)[0],
        q,
        k_cmp,
        v_cmp,
    )
    assert tri_o.shape == (B, tq, HKV * group, D)
    assert tri_p.shape == (B, tq, HKV * group, nc)


@pytest.mark.parametrize("backend", ["reference", *CMP_BACKENDS])
def test_compressed_probabilities_are_a_softmax_over_visible_blocks(backend: str) -> None:
    geo, tq, q_offset = TINY, 30, 10
    nc = geo.num_cmp_blocks(q_offset + tq)
    q, k_cmp, v_cmp = rand(B, tq, 4, D, grad=False), rand(B, nc, HKV, D), rand(B, nc, HKV, D)
    _, p = compressed_attention(
        q,
        k_cmp,
        v_cmp,
        block_len=geo.block_len,
        block_stride=geo.block_stride,
        q_offset=q_offset,
        backend=backend,
    )
    visible = visible_blocks_mask(nc, q_offset, tq, geo)[None, :, None, :].expand_as(p)
    assert (p[~visible] == 0).all(), "invisible compressed blocks must get p = 0"
    assert (p[visible] > 0).all()
    sees_any = visible.any(-1)
    assert_close("row sums", sees_any.to(DTYPE), p.sum(-1))


@pytest.mark.parametrize("backend", ["reference", *CMP_BACKENDS])
def test_query_seeing_no_compressed_block(backend: str) -> None:
    """Queries before the first complete block (t < l - 1) output 0 with p = 0, and their gradients are 0."""
    geo, tq = TINY, 12  # queries 0..6 see nothing, 7..11 see blocks
    nc = geo.num_cmp_blocks(tq)
    q, k_cmp, v_cmp = rand(B, tq, 4, D), rand(B, nc, HKV, D), rand(B, nc, HKV, D)
    o, p = compressed_attention(
        q, k_cmp, v_cmp, block_len=geo.block_len, block_stride=geo.block_stride, backend=backend
    )
    blind = geo.block_len - 1
    assert (o[:, :blind] == 0).all()
    assert (p[:, :blind] == 0).all()
    assert (o[:, blind:].abs().sum(-1) > 0).all()
    dq, dk, dv = grads(o, (q, k_cmp, v_cmp), torch.randn_like(o))
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(g).all(), f"{name} has NaN/Inf"
    assert (dq[:, :blind] == 0).all()


@pytest.mark.parametrize("backend", ["reference", *CMP_BACKENDS])
def test_compressed_attention_without_any_block(backend: str) -> None:
    """Fewer keys than one block: ``Nc = 0`` compressed keys, all outputs 0, gradients finite."""
    q, k_cmp, v_cmp = rand(B, 5, 4, D), rand(B, 0, HKV, D), rand(B, 0, HKV, D)
    o, p = compressed_attention(q, k_cmp, v_cmp, block_len=8, block_stride=4, backend=backend)
    assert o.shape == (B, 5, 4, D)
    assert p.shape == (B, 5, 4, 0)
    assert (o == 0).all()
    (dq,) = grads(o, (q,), torch.randn_like(o))
    assert (dq == 0).all()


# --- selection ---------------------------------------------------------------------------------------------


def random_block_idx(group: int, tq: int, q_offset: int, geo: Geometry) -> torch.Tensor:
    """``block_idx`` chosen by the reference selection from random compression probabilities."""
    nc = geo.num_cmp_blocks(q_offset + tq)
    p = torch.rand(B, tq, HKV * group, nc, dtype=DTYPE)
    p = p * visible_blocks_mask(nc, q_offset, tq, geo)[None, :, None, :]
    return naive_select_blocks(
        p, kv_heads=HKV, num_keys=q_offset + tq, q_offset=q_offset, **geo.select_kwargs()
    )


@pytest.mark.parametrize("backend", SEL_BACKENDS)
@pytest.mark.parametrize("group, tq, q_offset", CASES)
def test_selected_attention(backend: str, group: int, tq: int, q_offset: int) -> None:
    geo = TINY
    block_idx = random_block_idx(group, tq, q_offset, geo)
    q, k, v = rand(B, tq, HKV * group, D), rand(B, q_offset + tq, HKV, D), rand(B, q_offset + tq, HKV, D)
    kwargs = dict(sel_block_len=geo.sel_block_len, q_offset=q_offset)
    check_parity(
        lambda *a: naive_selected_attention(*a, block_idx, **kwargs),
        lambda *a: selected_attention(*a, block_idx, backend=backend, **kwargs),
        q,
        k,
        v,
    )


@pytest.mark.parametrize("backend", SEL_BACKENDS)
@pytest.mark.parametrize(
    "geo, tq, q_offset",
    [
        pytest.param(Geometry(sel_block_len=8, n_sel=6), 53, 0, id="ls8-n6-T53"),
        pytest.param(Geometry(sel_block_len=32, n_sel=3, n_init=0, n_local=1), 70, 0, id="ls32-n3-T70"),
        pytest.param(Geometry(sel_block_len=4, n_sel=5, block_len=4), 2, 38, id="ls4-n5-Tq2-off38"),
    ],
)
def test_selected_attention_from_select_blocks(backend: str, geo: Geometry, tq: int, q_offset: int) -> None:
    """``block_idx`` from `select_blocks` on random importance, other selection block sizes."""
    ns = -(-(q_offset + tq) // geo.sel_block_len)
    importance = torch.rand(B, tq, HKV, ns, dtype=DTYPE)
    block_idx = select_blocks(
        importance,
        sel_block_len=geo.sel_block_len,
        n_sel=geo.n_sel,
        n_init=geo.n_init,
        n_local=geo.n_local,
        q_offset=q_offset,
    )
    q, k, v = rand(B, tq, 2 * HKV, D), rand(B, q_offset + tq, HKV, D), rand(B, q_offset + tq, HKV, D)
    kwargs = dict(sel_block_len=geo.sel_block_len, q_offset=q_offset)
    check_parity(
        lambda *a: naive_selected_attention(*a, block_idx, **kwargs),
        lambda *a: selected_attention(*a, block_idx, backend=backend, **kwargs),
        q,
        k,
        v,
    )


@pytest.mark.parametrize("backend", ["reference", *SEL_BACKENDS])
def test_selected_attention_ignores_slot_order(backend: str) -> None:
    """The selected blocks are a set: shuffling the slots (padding included) changes nothing."""
    tq = 53
    block_idx = random_block_idx(2, tq, 0, TINY)
    shuffled = block_idx[..., torch.randperm(block_idx.shape[-1])]
    q, k, v = (
        rand(B, tq, 2 * HKV, D, grad=False),
        rand(B, tq, HKV, D, grad=False),
        rand(B, tq, HKV, D, grad=False),
    )
    kwargs = dict(sel_block_len=TINY.sel_block_len, backend=backend)
    assert_close(
        "o", selected_attention(q, k, v, block_idx, **kwargs), selected_attention(q, k, v, shuffled, **kwargs)
    )


def test_selected_attention_reads_only_its_blocks() -> None:
    """With only the query's own block selected, selected attention is causal attention inside that block."""
    lsel, tq = TINY.sel_block_len, 40
    own = (torch.arange(tq) // lsel)[None, :, None, None].expand(B, tq, HKV, 1)
    block_idx = torch.cat([own, torch.full_like(own, -1)], dim=-1)
    q, k, v = (
        rand(B, tq, HKV, D, grad=False),
        rand(B, tq, HKV, D, grad=False),
        rand(B, tq, HKV, D, grad=False),
    )
    mask = (torch.arange(tq)[None, :] <= torch.arange(tq)[:, None]) & (
        torch.arange(tq)[None, :] // lsel == torch.arange(tq)[:, None] // lsel
    )
    scores = torch.einsum("bthd,bshd->bhts", q, k) * D**-0.5
    expected = torch.einsum("bhts,bshd->bthd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    for backend in ["reference", *SEL_BACKENDS]:
        assert_close(
            backend, expected, selected_attention(q, k, v, block_idx, sel_block_len=lsel, backend=backend)
        )


# --- sliding window ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", WIN_BACKENDS)
@pytest.mark.parametrize("window", [32, 5], ids=["w32", "w5"])
@pytest.mark.parametrize("group, tq, q_offset", CASES)
def test_sliding_window_attention(backend: str, window: int, group: int, tq: int, q_offset: int) -> None:
    q, k, v = rand(B, tq, HKV * group, D), rand(B, q_offset + tq, HKV, D), rand(B, q_offset + tq, HKV, D)
    kwargs = dict(window=window, q_offset=q_offset)
    check_parity(
        lambda *a: naive_sliding_window_attention(*a, **kwargs),
        lambda *a: sliding_window_attention(*a, backend=backend, **kwargs),
        q,
        k,
        v,
    )


@pytest.mark.parametrize("backend", ["reference", *WIN_BACKENDS])
@pytest.mark.parametrize(
    "window, tq, q_offset",
    [
        pytest.param(1, 9, 0, id="w1-T9"),
        pytest.param(1, 1, 20, id="w1-Tq1-off20"),
        pytest.param(100, 45, 0, id="w100-T45"),
        pytest.param(100, 3, 42, id="w100-Tq3-off42"),
    ],
)
def test_sliding_window_extremes(backend: str, window: int, tq: int, q_offset: int) -> None:
    """A window of 1 reads only the query's own key; a window wider than the keys is causal attention."""
    tk = q_offset + tq
    q, k, v = (
        rand(B, tq, HKV, D, grad=False),
        rand(B, tk, HKV, D, grad=False),
        rand(B, tk, HKV, D, grad=False),
    )
    t, s = torch.arange(q_offset, tk)[:, None], torch.arange(tk)[None, :]
    mask = (s <= t) & (s > t - window)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * D**-0.5
    expected = torch.einsum("bhts,bshd->bthd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    tri = sliding_window_attention(q, k, v, window=window, q_offset=q_offset, backend=backend)
    assert_close("o", expected, tri)


# --- dispatch and contracts --------------------------------------------------------------------------------


def test_direct_functions_equal_dispatch() -> None:
    geo, tq = TINY, 37
    nc = geo.num_cmp_blocks(tq)
    q, k, v = rand(B, tq, 4, D, grad=False), rand(B, tq, HKV, D, grad=False), rand(B, tq, HKV, D, grad=False)
    k_cmp, v_cmp = rand(B, nc, HKV, D, grad=False), rand(B, nc, HKV, D, grad=False)
    cmp_kw = dict(block_len=geo.block_len, block_stride=geo.block_stride)
    assert_close(
        "cmp masked",
        compressed_attention(q, k_cmp, v_cmp, backend="masked", **cmp_kw)[0],
        masked_compressed_attention(q, k_cmp, v_cmp, **cmp_kw)[0],
    )
    assert_close(
        "cmp reference",
        compressed_attention(q, k_cmp, v_cmp, backend="reference", **cmp_kw)[0],
        naive_compressed_attention(q, k_cmp, v_cmp, **cmp_kw)[0],
    )
    block_idx = random_block_idx(2, tq, 0, geo)
    sel_kw = dict(sel_block_len=geo.sel_block_len)
    for backend, fn in [
        ("reference", naive_selected_attention),
        ("masked", masked_selected_attention),
        ("gather", gather_selected_attention),
        ("packed", packed_selected_attention),
    ]:
        assert_close(
            f"sel {backend}",
            selected_attention(q, k, v, block_idx, backend=backend, **sel_kw),
            fn(q, k, v, block_idx, **sel_kw),
        )
    for backend, fn in [
        ("reference", naive_sliding_window_attention),
        ("masked", masked_sliding_window_attention),
        ("chunked", chunked_sliding_window_attention),
    ]:
        assert_close(
            f"win {backend}",
            sliding_window_attention(q, k, v, window=8, backend=backend),
            fn(q, k, v, window=8),
        )


@pytest.mark.parametrize("family", ["cmp", "sel", "win"])
def test_unknown_backend_is_refused(family: str) -> None:
    _, tri_fn, qkv = family_ops(family, "flash", tq=20)
    with pytest.raises((NotImplementedError, ValueError), match="flash"):
        tri_fn(*qkv)


def test_keys_must_cover_the_queries() -> None:
    """``Tk`` must equal ``q_offset + Tq``: a mismatch is a ValueError, not a silently wrong mask."""
    q, k, v = rand(1, 4, 2, D, grad=False), rand(1, 10, 2, D, grad=False), rand(1, 10, 2, D, grad=False)
    with pytest.raises(ValueError, match=r"Tk|keys"):
        sliding_window_attention(q, k, v, window=8, q_offset=0)
    with pytest.raises(ValueError, match=r"Tk|keys"):
        selected_attention(q, k, v, torch.zeros(1, 4, 2, 4, dtype=torch.long), sel_block_len=16, q_offset=3)
    with pytest.raises(ValueError, match="block"):  # 10 keys make 1 complete block of 8, not 2
        compressed_attention(q, k[:, :2], v[:, :2], block_len=8, block_stride=4, q_offset=6)


Op = Callable[..., torch.Tensor]


def family_ops(
    family: str, backend: str, tq: int, scale: float | None = None, geo: Geometry = TINY
) -> tuple[Op, Op, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(ref_fn, tri_fn, (q, k, v))`` of a branch: the naive op, the backend's op, random float64 inputs."""
    q, k, v = rand(B, tq, 2 * HKV, D), rand(B, tq, HKV, D), rand(B, tq, HKV, D)
    if family == "cmp":
        nc = geo.num_cmp_blocks(tq)
        k, v = rand(B, nc, HKV, D), rand(B, nc, HKV, D)
        kw = dict(block_len=geo.block_len, block_stride=geo.block_stride, scale=scale)

        def ref_fn(*a: torch.Tensor) -> torch.Tensor:
            return naive_compressed_attention(*a, **kw)[0]

        def tri_fn(*a: torch.Tensor) -> torch.Tensor:
            return compressed_attention(*a, backend=backend, **kw)[0]

    elif family == "sel":
        block_idx = random_block_idx(2, tq, 0, geo)
        kw = dict(sel_block_len=geo.sel_block_len, scale=scale)

        def ref_fn(*a: torch.Tensor) -> torch.Tensor:
            return naive_selected_attention(*a, block_idx, **kw)

        def tri_fn(*a: torch.Tensor) -> torch.Tensor:
            return selected_attention(*a, block_idx, backend=backend, **kw)

    else:
        kw = dict(window=geo.window, scale=scale)

        def ref_fn(*a: torch.Tensor) -> torch.Tensor:
            return naive_sliding_window_attention(*a, **kw)

        def tri_fn(*a: torch.Tensor) -> torch.Tensor:
            return sliding_window_attention(*a, backend=backend, **kw)

    return ref_fn, tri_fn, (q, k, v)


FAMILIES = [
    *(pytest.param("cmp", b, id=f"cmp-{b}") for b in CMP_BACKENDS),
    *(pytest.param("sel", b, id=f"sel-{b}") for b in SEL_BACKENDS),
    *(pytest.param("win", b, id=f"win-{b}") for b in WIN_BACKENDS),
]


@pytest.mark.parametrize("family, backend", FAMILIES)
def test_custom_scale(family: str, backend: str) -> None:
    ref_fn, tri_fn, qkv = family_ops(family, backend, tq=37, scale=0.37)
    check_parity(ref_fn, tri_fn, *qkv)


# --- lower precision: the error bound is the reference's own error in that dtype --------------------------


def lowp_errors(
    ref_fn: Op, tri_fn: Op, dtype: torch.dtype, *inputs: torch.Tensor
) -> dict[str, tuple[float, float]]:
    """Per output and gradient: (error of ``tri_fn`` in ``dtype``, error of ``ref_fn`` in ``dtype``), both
    measured against ``ref_fn`` in float64, as relative RMS."""
    dout = torch.randn(inputs[0].shape, dtype=DTYPE)
    results = {}
    for label, fn, dt in (("gold", ref_fn, DTYPE), ("ref", ref_fn, dtype), ("tri", tri_fn, dtype)):
        xs = tuple(x.detach().to(dt).requires_grad_() for x in inputs)
        out = fn(*xs)
        results[label] = (out.double(), *(g.double() for g in grads(out, xs, dout.to(dt))))
    names = ("o", "dq", "dk", "dv")
    return {
        name: (get_err_ratio(gold, tri), get_err_ratio(gold, ref))
        for name, gold, ref, tri in zip(names, results["gold"], results["ref"], results["tri"], strict=True)
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family, backend", FAMILIES)
def test_low_precision_error_within_reference_error(family: str, backend: str, dtype: torch.dtype) -> None:
    """In float32/bfloat16 a backend errs at most twice as much as the reference does in that dtype
    (flash-attention's bound), measured against the reference in float64."""
    ref_fn, tri_fn, qkv = family_ops(family, backend, tq=64)
    for name, (tri_err, ref_err) in lowp_errors(ref_fn, tri_fn, dtype, *qkv).items():
        assert tri_err <= 2 * ref_err + 1e-6, (
            f"{name}: {backend} error {tri_err:.2e} > 2 x reference {ref_err:.2e}"
        )
