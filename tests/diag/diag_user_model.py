"""User models for the worker tests (``--model diag_user_model:build``: no NSA inside, its own layer list;
``nsa_lm``: nsa_core's NSAAttention inside the user's own blocks).

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


# --- the shapes of the contract (`nsa-diag run --help`): outputs, vocabulary, layer layouts ----------------


class Output:
    """A Hugging Face-style output object: the logits in ``.logits``."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class Config:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size


class ShapedLM(nn.Module):
    """UserLM's computation with the output, vocabulary and layer list in another place."""

    def __init__(self, output: str, vocab: str, layout: str, vocab_size: int = 300, layers: int = 2) -> None:
        super().__init__()
        self.output, self.layout, self.vocab = output, layout, vocab
        if vocab == "attr":
            self.vocab_size = vocab_size
        elif vocab == "config":
            self.config = Config(vocab_size)
        self.embed = nn.Embedding(vocab_size, 16)
        blocks = nn.ModuleList(MLPBlock(16) for _ in range(layers))
        holder: nn.Module = self
        *outer, last = layout.split(".")
        for part in outer:
            child = nn.Module()
            holder.add_module(part, child)
            holder = child
        holder.add_module(last, blocks)
        self.blocks_ = [blocks]  # a plain list: not registered twice
        self.head = nn.Linear(16, vocab_size)

    def get_output_embeddings(self) -> nn.Module | None:
        return None if self.vocab == "none" else self.head

    def forward(self, tokens: torch.Tensor) -> Any:
        x = self.embed(tokens)
        for layer in self.blocks_[0]:
            x = layer(x)
        logits = self.head(x)
        if self.output == "tuple":
            return (logits, x)
        if self.output == "list":
            return [logits]
        if self.output == "logits":
            return Output(logits)
        if self.output == "flat":  # a broken contract: [B * S, V]
            return logits.flatten(0, 1)
        return logits


def shaped(spec: Any) -> nn.Module:
    """``--model diag_user_model:shaped`` with ``SHAPE=output,vocab,layout`` in the environment."""
    import os

    output, vocab, layout = os.environ.get("SHAPE", "tensor,attr,layers").split(",")
    return ShapedLM(output, vocab, layout)


def raising(spec: Any) -> nn.Module:
    raise RuntimeError("no checkpoint at /data/ckpt.pt")


# --- the seeds' own model, as their team wrote it: an attention with a compression branch whose projection
# never reaches the output (the grad-missing of their DDP runs), no nsa_core inside -------------------------


class SeedAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.cmp_proj = nn.Linear(dim, dim)  # its output is computed and then dropped
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        _compressed = self.cmp_proj(x).detach()  # the bug: the branch's result is detached, then unused
        att = torch.softmax(q @ k.transpose(-1, -2) / k.shape[-1] ** 0.5, dim=-1)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, 0.0)
        return self.out(att @ v)


class SeedBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = SeedAttention(dim)
        self.mlp = MLPBlock(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.attn(self.norm(x)))


class SeedLM(nn.Module):
    def __init__(self, vocab_size: int = 96, dim: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(SeedBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def seed_lm(spec: Any) -> nn.Module:
    return SeedLM(layers=int(spec.overrides.get("layers", 3)))


# --- a user's model with nsa_core's attention inside the user's own layer classes: backend parity applies
# through its NSAAttention modules (built from spec.nsa_config(), so the NSA options reach them) ------------


class NSABlock(nn.Module):
    """The user's pre-norm block around nsa_core's attention."""

    def __init__(self, cfg: Any) -> None:
        from nsa_core import NSAAttention

        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = NSAAttention(cfg)
        self.ff = nn.Sequential(nn.Linear(cfg.dim, 2 * cfg.dim), nn.GELU(), nn.Linear(2 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class NSAUserLM(nn.Module):
    """Token ids -> a ``(logits, hidden)`` tuple; the layers in ``self.layers``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.vocab_size = cfg.vocab
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(NSABlock(cfg) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x), x


class OffSelection(nn.Module):
    """A planted backend bug: the selection branch's output [B, T, HQ, D] is 1% too large unless the
    reference backend computed it (read from the attention that owns this tap)."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.owner = [attn]  # a plain list: not registered as a child (the attention owns this tap)

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.owner[0].nsa.sel_backend == "reference" else out * 1.01


def nsa_lm(spec: Any) -> nn.Module:
    """``--model diag_user_model:nsa_lm``: the NSA options apply through ``spec.nsa_config()``."""
    return NSAUserLM(spec.nsa_config())


def nsa_lm_off_selection(spec: Any) -> nn.Module:
    """``nsa_lm`` whose every selection backend but the reference is 1% off (`OffSelection`)."""
    model = NSAUserLM(spec.nsa_config())
    for layer in model.layers:
        layer.attn.branch_out["sel"] = OffSelection(layer.attn)
    return model
