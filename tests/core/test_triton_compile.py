"""Every Triton kernel compiles for an H100 (sm_90), here on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``) runs kernels as Python, so it accepts code the compiler refuses
(a loop over a tuple of pointers did; the first GPU run found it). This test runs the real launchers on CPU
tensors with every ``@triton.jit`` kernel replaced by a recorder, which keeps the arguments of each launch
instead of running it; each distinct launch is then compiled by Triton for ``GPUTarget("cuda", 90, 32)``
down to a cubin, with its ``num_warps`` / ``num_stages``. The launchers run as on the GPU (their outputs
are garbage: nothing is computed), over the shapes and dtypes the product uses: PERFORMANCE.md's
geometry in bf16, m7c-125m's in fp16, the tests' in float32, a hot selection block (the chunked dK/dV and
its reduction) and the dK/dV head splits.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles kernels; the interpreter replaces them", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nsa_core.ops.triton import compression, compressor, flash, gates, nsa, rope, selection  # noqa: E402
from nsa_core.ops.triton.launch import Launcher  # noqa: E402

MODULES = (flash, selection, compression, compressor, gates, rope)
POINTER_TYPES = {
    torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
    torch.int64: "*i64", torch.int32: "*i32", torch.bool: "*i1",
}  # fmt: skip
OPTIONS = ("num_warps", "num_stages")
SHARED_MEMORY_SM90 = 232448  # bytes a block may use on sm_90 (H100, H200)


class Recorder:
    """Stands in for a `triton.JITFunction`: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, fn: triton.runtime.JITFunction, launches: dict) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid: object):
        def launch(*args: object, **kwargs: object) -> None:
            names = self.fn.arg_names
            values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
            options = {k: v for k, v in kwargs.items() if k in OPTIONS}
            signature, constexprs = {}, {}
            for i, name in enumerate(names):
                value = values[name]
                if i in self.fn.constexprs:
                    signature[name], constexprs[name] = "constexpr", value
                elif isinstance(value, torch.Tensor):
                    signature[name] = POINTER_TYPES[value.dtype]
                elif isinstance(value, bool):
                    signature[name] = "i1"
                elif isinstance(value, int):
                    signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                elif isinstance(value, float):
                    signature[name] = "fp32"
                else:
                    raise TypeError(f"{self.fn.__name__}: argument {name}={value!r}")
            key = (self.fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
                   repr(sorted(options.items())))  # fmt: skip
            self.launches.setdefault(key, (self.fn, signature, constexprs, options))

        return launch


def _record(monkeypatch: pytest.MonkeyPatch) -> dict:
    launches: dict = {}
    for module in MODULES:
        for name, obj in vars(module).items():
            if isinstance(obj, Launcher) and name.endswith("_kernel"):
                monkeypatch.setattr(module, name, Recorder(obj.kernel, launches))
    return launches


def _run_op(T: int, HQ: int, HKV: int, D: int, dtype: torch.dtype, geometry: dict) -> None:
    """The full NSA op's launchers, forward and backward, on CPU tensors (nothing is computed)."""
    g = geometry
    q = torch.randn(1, T, HQ, D, dtype=dtype)
    k, v = torch.randn(1, T, HKV, D, dtype=dtype), torch.randn(1, T, HKV, D, dtype=dtype)
    Nc = (T - g["block_len"]) // g["block_stride"] + 1
    k_cmp, v_cmp = torch.randn(1, Nc, HKV, D, dtype=dtype), torch.randn(1, Nc, HKV, D, dtype=dtype)
    scale = D**-0.5
    select = {key: g[key] for key in ("sel_block_len", "n_sel", "n_init", "n_local")}
    compression.triton_compressed_block_select(
        q, k_cmp, block_len=g["block_len"], block_stride=g["block_stride"], **select
    )
    for key_stride, key_offset, window, kk, vv in (
        (1, 0, g["window"], k, v),
        (g["block_stride"], g["block_len"] - 1, None, k_cmp, v_cmp),
    ):
        geo = dict(key_stride=key_stride, key_offset=key_offset, window=window, q_offset=0, scale=scale)
        o, lse = flash.banded_forward(q, kk, vv, **geo)
        flash.banded_forward(q, kk, vv, compute_o=False, **geo)
        flash.banded_backward(
            torch.randn_like(q), q, kk, vv, torch.randn_like(q), torch.zeros_like(lse), **geo
        )
    idx = torch.randint(0, T // g["sel_block_len"], (1, T, HKV, g["n_sel"]))
    do = torch.randn_like(q)
    span, blocks = selection.SCAN_SPAN, selection.BLOCKS_BYTES
    try:  # the token tiles and by selection block (long sequences), then the scan (short ones)
        for selection.SCAN_SPAN, selection.BLOCKS_BYTES in ((0, 0), (0, 1 << 40), (1 << 30, blocks)):
            o, lse = selection.selected_fwd(q, k, v, idx, g["sel_block_len"], 0, scale)
            selection.selected_bwd(
                do, q, k, v, torch.randn_like(q), torch.zeros_like(lse), idx, g["sel_block_len"], 0, scale
            )
    finally:
        selection.SCAN_SPAN, selection.BLOCKS_BYTES = span, blocks
    # tiles of several tokens (the tile union and its path) where the group alone fills the 16 rows
    if HQ // HKV >= 16:
        rows = dict(selection._TILE_ROWS)
        try:
            selection._TILE_ROWS.update(fwd=32, dq=32)
            selection.SCAN_SPAN, selection.BLOCKS_BYTES = 0, 0  # the tiles at any length
            o, lse = selection.selected_fwd(q, k, v, idx, g["sel_block_len"], 0, scale)
            selection.selected_bwd(
                do, q, k, v, torch.randn_like(q), torch.zeros_like(lse), idx, g["sel_block_len"], 0, scale
            )
        finally:
            selection._TILE_ROWS.update(rows)
            selection.SCAN_SPAN, selection.BLOCKS_BYTES = span, blocks
    # a hot block: dK/dV in chunks, then their reduction
    hot = torch.zeros_like(idx)
    try:
        selection.SCAN_SPAN = 0  # the inverted index's path at any length, dq per token and by block
        o, lse = torch.randn_like(q), torch.zeros_like(lse)
        for selection.BLOCKS_BYTES in (0, 1 << 40):
            selection.selected_bwd(do, q, k, v, o, lse, hot, g["sel_block_len"], 0, scale, chunk=16)
    finally:
        selection.SCAN_SPAN, selection.BLOCKS_BYTES = span, blocks
    gate = torch.randn(1, T, HQ, 3, dtype=dtype)
    gates.GatedSumFunction.forward(_Ctx(), gate, q, q, q)
    ctx = _Ctx()
    ctx.saved_tensors = (gate, q, q, q)
    gates.GatedSumFunction.backward(ctx, do)
    # the whole op in one function: dq added into one tensor, delta and lse from the gates' pass
    geometry = nsa.NSAGeometry(**g)
    ctx = _Ctx()
    nsa.NSAAttentionFunction.forward(ctx, q, k_cmp, v_cmp, k, v, k, v, gate, geometry, 0, scale, None)
    nsa.NSAAttentionFunction.backward(ctx, do, None)
    # the layer's projections split and rotated, and the compressed keys rotated, each way
    inv_freq = rope.rope_frequencies(D, 10000.0, q.device)
    y = torch.randn(1, T, (HQ + 6 * HKV) * D, dtype=dtype)
    ctx = _Ctx()
    outs = rope.QKVRopeFunction.forward(ctx, y, inv_freq, HQ, HKV, 0)
    rope.QKVRopeFunction.backward(ctx, *outs)
    ctx = _Ctx()
    rope.RopeFunction.forward(ctx, k_cmp, inv_freq, g["block_len"] - 1, g["block_stride"])
    rope.RopeFunction.backward(ctx, k_cmp)
    # the block compressor phi, each way
    l = g["block_len"]
    weights = tuple(torch.randn(*shape, dtype=dtype) for shape in ((l, D), (D, l * D), (D,), (D, D), (D,)))
    ctx = _Ctx()
    ctx.needs_input_grad = (False,) * 3 + (True,) * 6
    out = compressor.BlockCompressFunction.forward(ctx, l, g["block_stride"], 0, k, *weights)
    split_rows = compressor.SPLIT_ROWS
    try:  # the weights' sums in one pass, then split over rows with their reduction
        for rows in (split_rows, 16):
            compressor.SPLIT_ROWS = rows
            compressor.BlockCompressFunction.backward(ctx, out)
    finally:
        compressor.SPLIT_ROWS = split_rows
    # ... and the keys' and values' phi in the same launches
    ctx = _Ctx()
    ctx.needs_input_grad = (False,) * 3 + (True,) * 12
    outs = compressor.BlockCompressFunction.forward(ctx, l, g["block_stride"], 0, k, v, *weights, *weights)
    compressor.BlockCompressFunction.backward(ctx, *outs)


class _Ctx:
    saved_tensors: tuple = ()

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass


PAPER = dict(block_len=32, block_stride=16, sel_block_len=64, n_sel=16, n_init=1, n_local=2, window=512)
SMALL = dict(block_len=8, block_stride=4, sel_block_len=16, n_sel=4, n_init=1, n_local=2, window=32)
SETUPS = [
    pytest.param(dict(T=1024, HQ=64, HKV=4, D=128, dtype=torch.bfloat16, geometry=PAPER), id="paper-bf16"),
    pytest.param(dict(T=1024, HQ=12, HKV=2, D=64, dtype=torch.float16, geometry=PAPER), id="m7c-fp16"),
    pytest.param(dict(T=128, HQ=8, HKV=2, D=64, dtype=torch.float32, geometry=SMALL), id="tests-fp32"),
]


# ~50 kernels compiled to cubin on the CPU: 80 s of CPU for the float32 setup on a fresh cache, over 120 s on
# a loaded machine, 323 s alone on this project's 2-core machine on 2026-12-02 (the paper setup 178 s, m7c's
# 109 s; the compressor's kernels about 26 s of the float32 setup's): a limit for a hang, not for a slow CPU
@pytest.mark.timeout(900)
@pytest.mark.parametrize("setup", SETUPS)
def test_every_kernel_compiles_for_sm90(setup: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    launches = _record(monkeypatch)
    monkeypatch.setattr(flash, "program_target", lambda device: 1 << 12)  # and the dK/dV head splits
    monkeypatch.setattr(selection, "BLOCKS_GROUP", 64)  # by selection block whatever the group
    _run_op(**setup)
    names = {key[0] for key in launches}
    expected = {
        name for module in MODULES for name, obj in vars(module).items()
        if isinstance(obj, (Recorder, Launcher, triton.runtime.JITFunction)) and name.endswith("_kernel")
    }  # fmt: skip
    assert names == expected, f"never launched: {sorted(expected - names)}"
    target = GPUTarget("cuda", 90, 32)
    for fn, signature, constexprs, options in launches.values():
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)
        except Exception as exc:  # the compiler's own message names the line
            pytest.fail(f"{fn.__name__} {constexprs} {options}: {type(exc).__name__}: {exc}")
        assert "cubin" in compiled.asm, fn.__name__
        # what the launch would refuse (OutOfResources) on an H100 or H200: 227 KB of shared memory a block
        assert compiled.metadata.shared <= SHARED_MEMORY_SM90, f"{fn.__name__} {constexprs} {options}"


def test_every_kernel_launches_through_a_launcher() -> None:
    # a kernel left a plain JITFunction would pay Triton's binding on every launch (`launch.Launcher`)
    bare = [
        f"{module.__name__}.{name}" for module in MODULES for name, obj in vars(module).items()
        if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel")
    ]  # fmt: skip
    assert not bare


def test_the_ops_launches_keep_their_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch of the op's launchers gets its key from its call form's binder (not the generic key's
    loop, not Triton's path for an unhashable argument), and a second pass over the same shapes makes no
    new key: on the GPU each launch after the first of a key goes straight to the compiled kernel."""
    keys: dict[str, set] = {}
    generic: list[str] = []

    def record(self: Launcher, grid: object, *args: object, **kwargs: object) -> None:
        assert self.direct, f"{self.__name__} is not a compiled kernel here"
        form = (len(args), tuple(kwargs))
        if form not in self._binders:
            self._binders[form] = self._binder(args, kwargs)
        try:
            key, _ = self._binders[form](0, args, kwargs)  # type: ignore[misc]
        except (AttributeError, TypeError):
            generic.append(self.__name__)
            key = self.key(0, args, kwargs)
        hash(key)
        keys.setdefault(self.__name__, set()).add(key)

    monkeypatch.setattr(Launcher, "launch", record)
    monkeypatch.setattr(flash, "program_target", lambda device: 1 << 12)
    monkeypatch.setattr(selection, "BLOCKS_GROUP", 64)
    setup = dict(T=1024, HQ=12, HKV=2, D=64, dtype=torch.bfloat16, geometry=PAPER)
    _run_op(**setup)
    first = {name: len(k) for name, k in keys.items()}
    _run_op(**setup)
    assert {name: len(k) for name, k in keys.items()} == first
    assert not generic
