"""Plain language models as users write them (``--model diag_plain_model:<factory>``): an ``nn.Embedding``,
an ``nn.ModuleList`` of blocks and an ``nn.Linear`` head, with no ``vocab_size`` attribute and nothing of
nsa_diag. Each factory but `plain` plants one way of failing in training; none fails in a forward without
gradients (all that nsa-diag's pre-flight runs before the case).

Not a test module: the worker imports it from a subprocess with ``tests/diag`` on PYTHONPATH.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
from torch import nn

VOCAB, DIM = 256, 32
HELD_S = 600.0  # a planted hang ends by itself after this long, should nothing stop it


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class PlainLM(nn.Module):
    """Token ids ``[B, S]`` -> logits ``[B, S, 256]``; block ``i`` is ``blocks.get(i, Block)()``."""

    def __init__(self, layers: int = 3, blocks: dict[int, type[nn.Module]] | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList((blocks or {}).get(i, Block)() for i in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def plain(spec: Any) -> nn.Module:
    return PlainLM()


# --- a deadlock in layer 2's backward: a lock taken in forward and taken again in backward ---------------

_SHARED = threading.Lock()


class _HoldShared(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _SHARED.acquire(timeout=HELD_S)  # meant to be released once backward is done; it never gets there
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _SHARED.acquire(timeout=HELD_S)  # already held since forward: waits
        _SHARED.release()
        return grad


class LockingBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_HoldShared.apply(x))


def deadlock(spec: Any) -> nn.Module:
    return PlainLM(blocks={2: LockingBlock})


# --- a busy loop in layer 1's backward: a fixed-point iteration that never converges ----------------------


class _Renormalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        scale, deadline = 2.0, time.monotonic() + HELD_S
        while abs(scale - 1.0) > 1e-6 and time.monotonic() < deadline:
            scale = 2.0 - scale  # the bug: oscillates between 0 and 2
        return grad


class SpinningBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_Renormalize.apply(x))


def busy(spec: Any) -> nn.Module:
    return PlainLM(blocks={1: SpinningBlock})


# --- non-finite from the second training forward on: a running scale that its first update zeroes -------


class RunningScaleBlock(Block):
    """Divides by a running estimate of its output's scale (a buffer, as BatchNorm keeps its statistics);
    the bug: a momentum of 1 where 0.1 was meant, and the new estimate left out, so the first update
    makes the scale 0 and every later forward divides by it."""

    momentum = 1.0

    def __init__(self, dim: int = DIM) -> None:
        super().__init__(dim)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x) / self.scale
        if self.training and torch.is_grad_enabled():
            self.scale = (1 - self.momentum) * self.scale  # meant: (1 - m) * scale + m * out.std()
        return out


def nan_after_update(spec: Any) -> nn.Module:
    return PlainLM(blocks={1: RunningScaleBlock})


# --- an abort in layer 0's backward (a native library's failed assertion) -------------------------------


class _NativeCheck(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        os.abort()


class AbortingBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_NativeCheck.apply(x))


def abort(spec: Any) -> nn.Module:
    return PlainLM(blocks={0: AbortingBlock})


# --- an exception in layer 1's training forward: a bias of the wrong width added only when training -----


class DropBiasBlock(Block):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__(dim)
        self.train_bias = nn.Parameter(torch.zeros(dim + 1))  # the bug: one too wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.train_bias if torch.is_grad_enabled() else out


def raises(spec: Any) -> nn.Module:
    return PlainLM(blocks={1: DropBiasBlock})


# --- where the vocabulary and the layers are not where nsa-diag looks first -------------------------------


class Wrapper(nn.Module):
    """The plain model one module deeper (a task wrapper): its layers are ``net.layers``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = PlainLM()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)


def wrapped(spec: Any) -> nn.Module:
    return Wrapper()


class TiedLM(nn.Module):
    """Token and position embeddings, the head tied to the token embedding (no nn.Linear at the end):
    nothing in it says which embedding is the vocabulary's, so the user says it with ``--vocab 256``."""

    def __init__(self, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(max_len, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) @ self.tokens.weight.T


def tied(spec: Any) -> nn.Module:
    return TiedLM()


class EncoderDecoderLM(nn.Module):
    """Two stacks of the same length, neither in a known place: which are "the layers" is the user's
    call (``--layers-attr encoder`` or ``decoder``)."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.ModuleList(Block() for _ in range(layers))
        self.decoder = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in (*self.encoder, *self.decoder):
            x = layer(x)
        return self.head(x)


def two_stacks(spec: Any) -> nn.Module:
    return EncoderDecoderLM()
