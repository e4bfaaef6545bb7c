"""Models with a planted bug, for `nsa-diag verify`, `gc-bisect --grads` and the reference check
(``--model diag_planted:...``).

Not a test module: the worker imports it from a subprocess with ``tests/diag`` on PYTHONPATH. Both are
`nsa_core.TinyLM` subclasses built from the case's config, so the checks can rebuild them per variant.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from nsa_core import Block, KVCache, TinyLM


class PeekingBlock(Block):
    """A block that also reads the next position's input: position t sees token t + 1 (not causal)."""

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        out = super().forward(x, cache)
        if x.shape[1] > 1:
            ahead = torch.cat([x[:, 1:], x[:, -1:]], dim=1)
            out = out + 0.5 * ahead
        return out


class PeekingLM(TinyLM):
    """TinyLM whose last block reads one future token."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        last = cfg.layers - 1
        self.blocks[last] = PeekingBlock(cfg, last)


class WrongRecomputeLM(TinyLM):
    """TinyLM with the seeds' checkpoint bug: the checkpointed function is a closure over the loop
    variable, so every recompute in backward re-runs the last block, not its own."""

    def _run(self, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        x = self.embed(tokens)
        checkpointed = self.cfg.gc_layers if cache is None and torch.is_grad_enabled() else range(0)
        for block in self.blocks:
            if block.index in checkpointed:
                x = checkpoint(lambda h: block(h), x, use_reentrant=self.cfg.gc_reentrant)  # noqa: B023
            else:
                x = block(x, None if cache is None else cache.layers[block.index])
        return self.lm_head(self.norm(x))


def peeking_lm(spec: Any) -> TinyLM:
    return PeekingLM(spec.nsa_config())


def wrong_recompute_lm(spec: Any) -> TinyLM:
    return WrongRecomputeLM(spec.nsa_config())


def no_room_lm(spec: Any) -> TinyLM:
    """A TinyLM in a worker that sees no memory free for a parity check (a GPU the training step fills): the
    reference fits at no size, so `--reference-check` and `backend` cases must end `unchecked`."""
    from nsa_diag.worker.train import Trainer

    Trainer._free_memory_bytes = lambda self: 0  # type: ignore[method-assign]
    return TinyLM(spec.nsa_config())
