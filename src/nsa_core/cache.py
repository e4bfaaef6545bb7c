"""Decode cache: per layer, the keys and values each branch has seen so far.

The cache is what makes `TinyLM.decode` compute the same function as the batched forward: a decode step
is a forward over one new token whose keys are the cached ones plus its own. Tensors are extended by
concatenation (not written in place), so autograd can flow through a cache built during training, as the
sequential prefill does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def append(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """``old`` followed by ``new`` along time (dim 1); ``new`` alone for an empty cache."""
    return new if old is None else torch.cat([old, new], dim=1)


@dataclass
class LayerCache:
    """One attention layer's cache. Tensors are ``[B, T, HKV, D]`` (compressed: ``[B, Nc, HKV, D]``).

    A branch that the layer does not compute (``force_branch``) leaves its fields ``None``.
    """

    length: int = 0  # tokens seen
    k_cmp_raw: torch.Tensor | None = None  # compression-branch keys before phi (no RoPE)
    v_cmp_raw: torch.Tensor | None = None
    k_cmp: torch.Tensor | None = None  # compressed keys (RoPE at the block's last token)
    v_cmp: torch.Tensor | None = None
    k_sel: torch.Tensor | None = None  # selection-branch keys (RoPE)
    v_sel: torch.Tensor | None = None
    k_win: torch.Tensor | None = None  # window-branch keys (RoPE)
    v_win: torch.Tensor | None = None


@dataclass
class KVCache:
    """The decode cache of a whole model: one `LayerCache` per block."""

    layers: list[LayerCache] = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int) -> KVCache:
        return cls([LayerCache() for _ in range(num_layers)])

    @property
    def length(self) -> int:
        """Tokens seen so far (the position of the next token)."""
        return self.layers[0].length if self.layers else 0
