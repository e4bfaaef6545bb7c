"""TinyLM: a decoder-only language model with NSA attention in every block.

embedding -> blocks (RMSNorm -> NSAAttention -> residual -> RMSNorm -> SwiGLU -> residual) -> RMSNorm ->
LM head. Gradient checkpointing covers the layer range of ``cfg.gc``; each checkpointed call is handed its
own block, so a recompute can only ever re-run that block (the seeds' loop closure re-ran the last one).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nsa_core.cache import KVCache, LayerCache
from nsa_core.config import ModelConfig
from nsa_core.layers.attention import NSAAttention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = NSAAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """Token ids ``[B, S]`` -> logits ``[B, S, vocab]`` for any ``S >= 1``.

    ``cfg.prefill`` decides how `forward` and `prefill` run: ``batched`` computes all positions at once;
    ``sequential`` feeds one token at a time through the decode cache. Both compute the same function.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def idle_parameter_names(self) -> list[str]:
        """Parameters this configuration never gives a gradient (the branches ``force_branch`` leaves out)."""
        return [
            f"blocks.{block.index}.attn.{name}"
            for block in self.blocks
            for name in block.attn.idle_parameter_names()
        ]

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        if tokens.dim() != 2 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must be [B, S] with S >= 1, got {tuple(tokens.shape)}")
        if tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")

    def _run(self, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        x = self.embed(tokens)
        checkpointed = self.cfg.gc_layers if cache is None and torch.is_grad_enabled() else range(0)
        for block in self.blocks:
            if block.index in checkpointed:
                x = checkpoint(block, x, use_reentrant=self.cfg.gc_reentrant)
            else:
                x = block(x, None if cache is None else cache.layers[block.index])
        return self.lm_head(self.norm(x))

    def _run_sequential(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return torch.cat([self._run(tokens[:, t : t + 1], cache) for t in range(tokens.shape[1])], dim=1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self._check_tokens(tokens)
        if self.cfg.prefill == "sequential":
            return self._run_sequential(tokens, KVCache.empty(self.cfg.layers))
        return self._run(tokens, None)

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
        """Logits of every position ``[B, S, vocab]`` and the cache to `decode` from."""
        self._check_tokens(tokens)
        cache = KVCache.empty(self.cfg.layers)
        if self.cfg.prefill == "sequential":
            return self._run_sequential(tokens, cache), cache
        return self._run(tokens, cache), cache

    def decode(self, next_tokens: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        """Logits ``[B, 1, vocab]`` of ``next_tokens [B, 1]`` at ``cache.length``; extends the cache."""
        self._check_tokens(next_tokens)
        if next_tokens.shape[1] != 1:
            raise ValueError(f"decode takes one token per sequence, [B, 1]; got {tuple(next_tokens.shape)}")
        if len(cache.layers) != self.cfg.layers:
            raise ValueError(f"cache has {len(cache.layers)} layers, the model {self.cfg.layers}")
        return self._run(next_tokens, cache), cache
