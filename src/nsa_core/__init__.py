"""nsa_core: a correct Native Sparse Attention (NSA) model with interchangeable backends.

Pure compute: no files, no printing, no environment variables. The diagnostics toolkit drives it.

    >>> import torch, nsa_core
    >>> cfg = nsa_core.preset("tiny", sel_backend="gather")
    >>> model = nsa_core.TinyLM(cfg)
    >>> logits = model(torch.randint(0, cfg.vocab, (2, 40)))   # [B, S, vocab]
"""

from nsa_core.cache import KVCache, LayerCache
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
from nsa_core.layers.attention import NSAAttention, apply_rope
from nsa_core.models.tiny_lm import Block, RMSNorm, SwiGLU, TinyLM

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
