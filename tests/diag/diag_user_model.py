"""A user model for the worker tests (``--model diag_user_model:build``): no NSA inside, its own layer list.

Not a test module: the worker imports it from a subprocess with ``tests/diag`` on PYTHONPATH.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class UserLM(nn.Module):
    """Token ids ``[B, S]`` -> logits ``[B, S, vocab_size]``; the layers live in ``self.layers``."""

    def __init__(self, vocab_size: int = 64, dim: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(MLPBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(spec: Any) -> nn.Module:
    """The factory: ``factory(spec) -> nn.Module``."""
    return UserLM(layers=int(spec.overrides.get("layers", 3)))
