"""Shared by the Triton kernel tests: where they run, at which sizes, and NaN-poisoned allocations.

The kernels run on a CUDA device, or on the CPU through Triton's interpreter when the pytest process starts
with ``TRITON_INTERPRET=1`` (``make test`` runs this folder once more that way). The flag is read when a
kernel module is imported, so it must be in the environment before pytest starts; it is never set here.
Elsewhere every test of this folder is skipped.

Sizes: interpreter runs are slow (every program is Python), so tests take their shapes from `sizes`, which
holds small ones (T <= 128, D 16/32) under the interpreter and real ones (D 64/128, T in the thousands) on
CUDA. Fresh floating-point allocations are filled with NaN (fla's habit): a kernel that leaves a tile
unwritten fails `assert_close` loudly instead of passing on zeros.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available() and not INTERPRET
RUNNABLE = INTERPRET or ON_CUDA
SKIP_REASON = "Triton kernels need a CUDA device or TRITON_INTERPRET=1 in pytest's environment"


@dataclass(frozen=True)
class Sizes:
    """Shapes for the Triton tests where they run now."""

    device: str
    head_dims: tuple[int, ...]  # D
    seq_lens: tuple[int, ...]  # T of a prefill (0 offset); never all multiples of the block sizes
    groups: tuple[int, ...]  # G = HQ / HKV
    dtypes: tuple[torch.dtype, ...]  # low-precision dtypes compared against a same-dtype torch run
    real: bool  # real sizes (CUDA) rather than interpreter sizes


INTERPRETER_SIZES = Sizes(
    device="cpu", head_dims=(16, 32), seq_lens=(1, 37, 64), groups=(1, 4), dtypes=(), real=False
)
CUDA_SIZES = Sizes(
    device="cuda",
    head_dims=(64, 128),
    seq_lens=(1, 1000, 4096),
    groups=(1, 4, 6, 16),
    dtypes=(torch.bfloat16, torch.float16),
    real=True,
)
SIZES = CUDA_SIZES if ON_CUDA else INTERPRETER_SIZES


def _patch_the_language_once_a_launch() -> None:
    """Triton's interpreter patches `triton.language` for each kernel launch (`GridExecutor.__call__`,
    restored when the launch ends), and again at every call of a ``@triton.jit`` helper inside the kernel
    (`InterpretedFunction.__call__`): that second patch finds the builtins patched already, re-sets the
    same attributes, and costs an `inspect.getmembers` of each language module every call, ~40 % of the
    interpreter's time in these tests. Inside a launch whose patch covered the helper's language modules,
    the helper's call skips it; everything else runs as Triton wrote it. Where Triton's internals differ
    from these (another version), nothing is changed."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    grid = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or scope_type is None or grid is None:
        return
    launch_call = grid.__call__
    launch: dict[str, Any] = {"depth": 0, "patched": set()}

    def languages(fn: Any) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}

    def patch_once(fn: Any) -> Any:
        langs = languages(fn)
        if launch["depth"] and langs and langs <= launch["patched"]:
            return scope_type()  # patched by this launch already: nothing to restore
        scope = patch_lang(fn)
        if launch["depth"]:
            launch["patched"] |= langs
        return scope

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        launch["depth"] += 1
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            launch["depth"] -= 1
            if not launch["depth"]:
                launch["patched"] = set()

    interpreter._patch_lang = patch_once
    grid.__call__ = call


if INTERPRET:
    _patch_the_language_once_a_launch()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this folder where no kernel can run; under the interpreter, mark `INTERPRETER_SLOW` slow."""
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if not str(item.path).startswith(here):
            continue
        if not RUNNABLE:
            item.add_marker(skip)
        elif INTERPRET and item.nodeid.split("tests/core/triton/", 1)[-1] in INTERPRETER_SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def sizes() -> Sizes:
    return SIZES


@pytest.fixture
def device() -> str:
    return SIZES.device


_EMPTY_FUNCTIONS = ("empty", "empty_like")


def _poisoned(make: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = make(*args, **kwargs)
        if out.is_floating_point():
            with (
                torch.no_grad()
            ):  # a leaf that requires grad (torch.utils.checkpoint makes one) may be filled
                out.fill_(float("nan"))
        return out

    return wrapper


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty`` / ``torch.empty_like`` return NaN-filled floating tensors during a Triton test."""
    for name in _EMPTY_FUNCTIONS:
        monkeypatch.setattr(torch, name, _poisoned(getattr(torch, name)))


SMALL_TILES = 16  # tl.dot's smallest tile


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> int:
    """The banded kernels on 16 x 16 tiles: at interpreter sizes most tiles are then inside the band, so
    the loops without a mask run (with 64 x 64 tiles every tile of a short sequence holds its edge)."""
    from nsa_core.ops.triton import flash

    tiles = dict(BLOCK_M=SMALL_TILES, BLOCK_N=SMALL_TILES)
    monkeypatch.setattr(flash, "LAUNCH", dict.fromkeys(("fwd", "dkdv", "dq"), tiles))
    return SMALL_TILES


# Under the interpreter these take 10-30 s each on a 2-core machine: `make test` leaves them to
# `make test-slow` (CI runs both). Node ids relative to this folder; on CUDA they are fast and not marked.
INTERPRETER_SLOW = (
    "test_nsa.py::test_fused_op_matches_reference_fp32[B2-T64-HQ8-H2-D16-small]",
    "test_nsa.py::test_fused_backward_is_deterministic[torch.float32]",
    "test_wiring.py::test_model_matches_torch_backends[branch-sel]",
    "test_wiring.py::test_sequential_prefill_matches_batched[fused]",
    "test_wiring.py::test_sequential_prefill_matches_batched[composed]",
    # the composed twins of the model's fused op (the branches' own kernels are tested alone)
    "test_wiring.py::test_model_matches_torch_backends[composed]",
    "test_wiring.py::test_the_model_runs_the_fused_op_and_says_where_each_branch_starts[composed]",
    "test_selection.py::test_hot_block_chunks_match_single_pass",
    "test_selection.py::test_matches_reference_fp32[B2-T64-HQ2-H2-D32-ls16-n4-random]",
    "test_selection.py::test_matches_reference_fp32[B2-T64-HQ8-H2-D32-ls16-n4-random]",
    "test_selection.py::test_matches_reference_fp32[B2-T64-HQ8-H2-D16-ls16-n4-random]",
    "test_selection.py::test_matches_reference_fp32[B2-T64-HQ2-H2-D16-ls16-n4-random]",
    "test_selection.py::test_matches_reference_fp32[B1-T64-HQ4-H2-D16-ls4-n6-random]",
    "test_selection.py::test_strided_inputs",
    "test_compression.py::test_fused_selection_matches_reference[B2-T64-HQ8-H2-D32-l8-d4-ls16-n4-i1-loc2-random]",
    # D=32 twins of D=16 cases that stay in make test (the same code path, a wider tile; each kernel keeps
    # its T=1 D=32 cases)
    "test_selection.py::test_matches_reference_fp32[B2-T37-HQ8-H2-D32-ls16-n4-random]",
    "test_selection.py::test_matches_reference_fp32[B2-T37-HQ2-H2-D32-ls16-n4-random]",
    "test_compression.py::test_fused_selection_matches_reference[B2-T64-HQ2-H2-D32-l8-d4-ls16-n4-i1-loc2-random]",
    "test_compression.py::test_fused_selection_matches_reference[B2-T37-HQ8-H2-D32-l8-d4-ls16-n4-i1-loc2-random]",
    "test_compression.py::test_fused_selection_matches_reference[B2-T37-HQ2-H2-D32-l8-d4-ls16-n4-i1-loc2-random]",
    # the unmasked window tiles at an odd window: w33 (from an offset) stays, beside w40's whole tiles
    "test_window.py::test_window_unmasked_tiles_match_reference[B1-T100-HQ2-H1-D16-w37]",
    "test_compression.py::test_compressed_fp32_matches_reference[B2-T37-HQ2-H2-D32-l8-d4-ls16-n4-i1-loc2-random]",
    "test_compression.py::test_compressed_fp32_matches_reference[B2-T37-HQ8-H2-D32-l8-d4-ls16-n4-i1-loc2-random]",
    "test_compression.py::test_compressed_fp32_matches_reference[B2-T64-HQ2-H2-D32-l8-d4-ls16-n4-i1-loc2-random]",
    "test_compression.py::test_compressed_fp32_matches_reference[B2-T64-HQ8-H2-D32-l8-d4-ls16-n4-i1-loc2-random]",
    "test_window.py::test_window_fp32_matches_reference[B2-T37-HQ2-H2-D32-w16]",
    "test_window.py::test_window_fp32_matches_reference[B2-T37-HQ8-H2-D32-w16]",
    "test_window.py::test_window_fp32_matches_reference[B2-T64-HQ2-H2-D32-w16]",
    "test_window.py::test_window_fp32_matches_reference[B2-T64-HQ8-H2-D32-w16]",
    # B=2 at T=64 (a multiple of every block), as test_selection's T=64 cases above: the B=2 T=37 cases
    # (full tiles, then a partial one) and the B=1 T=64 geometries stay
    "test_compression.py::test_fused_selection_matches_reference[B2-T64-HQ8-H2-D16-l8-d4-ls16-n4-i1-loc2-random]",
    "test_compression.py::test_fused_selection_matches_reference[B2-T64-HQ2-H2-D16-l8-d4-ls16-n4-i1-loc2-random]",
    # one token a tile has no union (its SHARE_PCT is 0 whatever the module's): rows1-own-blocks' twin
    "test_selection.py::test_token_tiles_match_reference[rows1-union]",
    # each token's own blocks over a tile of several tokens: rows16-own-blocks (5 tokens a tile) stays
    "test_selection.py::test_token_tiles_match_reference[rows64-own-blocks]",
    # the union of a tile's blocks: the default tiles take it at these sizes (a tile's few blocks are
    # under SHARE_PCT of its slots), as test_matches_reference_fp32[B2-T37-HQ2-...] (16 tokens a tile)
    # and [B2-T37-HQ8-...] (4 tokens a tile) run it
    "test_selection.py::test_token_tiles_match_reference[rows16-union]",
    "test_selection.py::test_token_tiles_match_reference[rows64-union]",
)
