"""nsa_core: a correct Native Sparse Attention (NSA) model with interchangeable backends.

Pure compute: no files, no printing, no environment variables. The diagnostics toolkit drives it.

    >>> import torch, nsa_core
    >>> cfg = nsa_core.preset("tiny", sel_backend="gather")
    >>> model = nsa_core.TinyLM(cfg)
    >>> logits = model(torch.randint(0, cfg.vocab, (2, 40)))   # [B, S, vocab]

The configuration (`nsa_core.config`) needs only the standard library; the modules, which need torch, are
imported on first use (``nsa_core.TinyLM``, ``from nsa_core import NSAAttention``), so that a program that
only builds and checks configurations, as nsa-diag's command line does, does not pay torch's import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nsa_core.config import (
    BRANCHES,
    CMP_BACKENDS,
    PREFILL_MODES,
    PRESETS,
    SEL_BACKENDS,
    TRITON_BACKENDS,
    WIN_BACKENDS,
    ModelConfig,
    NSAConfig,
    parse_gc,
    preset,
)

if TYPE_CHECKING:
    from nsa_core.cache import KVCache, LayerCache
    from nsa_core.layers.attention import NSAAttention, apply_rope
    from nsa_core.models.tiny_lm import Block, RMSNorm, SwiGLU, TinyLM

# name -> the module that defines it, imported on first use
_LAZY = {
    "KVCache": "nsa_core.cache",
    "LayerCache": "nsa_core.cache",
    "NSAAttention": "nsa_core.layers.attention",
    "apply_rope": "nsa_core.layers.attention",
    "Block": "nsa_core.models.tiny_lm",
    "RMSNorm": "nsa_core.models.tiny_lm",
    "SwiGLU": "nsa_core.models.tiny_lm",
    "TinyLM": "nsa_core.models.tiny_lm",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nsa_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BRANCHES",
    "CMP_BACKENDS",
    "PREFILL_MODES",
    "PRESETS",
    "SEL_BACKENDS",
    "TRITON_BACKENDS",
    "WIN_BACKENDS",
    "Block",
    "KVCache",
    "LayerCache",
    "ModelConfig",
    "NSAAttention",
    "NSAConfig",
    "RMSNorm",
    "SwiGLU",
    "TinyLM",
    "apply_rope",
    "parse_gc",
    "preset",
]
