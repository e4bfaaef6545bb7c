"""The public API is pinned: `nsa_core.__all__`, the ops' public functions, and no I/O dependencies."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import nsa_core

PUBLIC = [
    "BRANCHES",
    "Block",
    "CMP_BACKENDS",
    "KVCache",
    "LayerCache",
    "ModelConfig",
    "NSAAttention",
    "NSAConfig",
    "PREFILL_MODES",
    "PRESETS",
    "RMSNorm",
    "SEL_BACKENDS",
    "SwiGLU",
    "TRITON_BACKENDS",
    "TinyLM",
    "WIN_BACKENDS",
    "apply_rope",
    "parse_gc",
    "preset",
]
# the ops the spec names, by module
OPS = {
    "nsa_core.ops.reference": [
        "naive_compressed_attention",
        "naive_select_blocks",
        "naive_selected_attention",
        "naive_sliding_window_attention",
    ],
    "nsa_core.ops.compression": ["compressed_attention", "masked_compressed_attention"],
    "nsa_core.ops.selection": [
        "block_importance",
        "gather_selected_attention",
        "masked_selected_attention",
        "packed_selected_attention",
        "select_blocks",
        "selected_attention",
    ],
    "nsa_core.ops.window": [
        "chunked_sliding_window_attention",
        "masked_sliding_window_attention",
        "sliding_window_attention",
    ],
}


def test_all_is_pinned() -> None:
    assert sorted(nsa_core.__all__) == sorted(PUBLIC)
    assert len(set(nsa_core.__all__)) == len(nsa_core.__all__), "duplicates in __all__"


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_importable(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from nsa_core import {name}", namespace)
    assert namespace[name] is getattr(nsa_core, name)


@pytest.mark.parametrize("module", list(OPS))
def test_ops_importable(module: str) -> None:
    mod = importlib.import_module(module)
    for name in OPS[module]:
        assert callable(getattr(mod, name, None)), f"{module}.{name} is missing"


def test_backend_lists_match_the_spec() -> None:
    assert nsa_core.SEL_BACKENDS == ("reference", "masked", "gather", "packed")
    assert nsa_core.CMP_BACKENDS == ("reference", "masked")
    assert nsa_core.WIN_BACKENDS == ("reference", "masked", "chunked")
    assert nsa_core.PREFILL_MODES == ("batched", "sequential")
    assert nsa_core.BRANCHES == ("cmp", "sel", "win")


def test_import_pulls_in_no_cli_or_io_packages() -> None:
    """nsa_core is pure compute: importing it loads neither nsa_diag nor Typer, Rich or pydantic."""
    src = Path(nsa_core.__file__).resolve().parents[1]
    code = (
        "import sys, nsa_core\n"
        "banned = {'nsa_diag', 'typer', 'rich', 'pydantic'}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in banned)\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(src)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing nsa_core loaded {result.stdout.strip()}"
