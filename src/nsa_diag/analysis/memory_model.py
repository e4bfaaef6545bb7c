"""Analytical estimate of a training step's peak memory from the model config, S, B and dtype.

What is modelled (bytes):

- model state: fp32 parameters (counted exactly by building the model on the meta device), fp32
  gradients, AdamW's two fp32 moments. Peak is the larger of "parameters + gradients + activations"
  (end of forward, start of backward) and "parameters + gradients + optimizer state" (first step).
- activations kept for backward per layer, per token: norms, q/gate/o projections, the branch outputs
  and their gated sum, the SwiGLU MLP; and per computed branch (``force_branch`` honoured):
  - sel ``masked``: the dense ``[B, S, HQ, S]`` scores/probabilities and the ``[B, S, HKV, S]`` bool
    mask: O(S²); ``gather``/``packed``: the ``n·l'`` gathered keys and values per query and their scores,
    with the int64 index: O(S·n·l');
  - cmp ``masked``: ``[B, S, HQ, S/d]`` scores/probabilities, O(S²/d), plus the unfolded blocks;
    ``sel`` forced alone still ranks blocks with these scores, without gradient, in query chunks of at
    most 2^24 probabilities (a transient, not kept);
  - win ``masked``: O(S²); ``chunked``: O(S·2w).
  - the ``reference`` backends are per-token loops and are modelled like ``masked`` (an upper bound).
- checkpointed layers keep only their input; the largest layer is recomputed once during backward.
- the logits in fp32 and the cross-entropy's softmax: O(B·S·V).

What is not: allocator caching and fragmentation, the CUDA context and cuBLAS workspaces, temporaries
that live inside one op (einsum reshapes), autocast weight copies in bf16/fp16, and on the CPU the
runtime's resident memory (torch, Python): the CPU comparison is therefore made above the fixed part.
The per-element multipliers in `_FACTORS` (how many score-sized tensors are alive at peak) are the
model's only fitted numbers: ``dense_scores`` and ``rank_transient`` were chosen on ten measured CPU fp32
points of the tiny preset (``--branch sel``, masked and gather, S = 512..4096, batch 1), where the total
(with the sweep's fitted fixed part for the runtime) came within 9%; that is an in-sample figure.
``gather_scores`` is not separately identified by those runs. Not yet checked on CUDA, in bf16, with
checkpointing, or on larger presets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SCORE_CHUNK_ELEMENTS = 1 << 24  # nsa_core.layers.attention: query chunks of the no-grad block ranking
# Score-sized tensors alive at peak per attention op (scores, masked fill, exp, probabilities, grads).
_FACTORS = {"dense_scores": 3.5, "gather_scores": 4.0, "rank_transient": 2.0}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of each part of the estimated peak; `total` is the peak itself."""

    params: int
    grads: int
    optimizer: int
    activations: int
    per_branch: dict[str, int]
    logits: int
    transient: int
    total: int

    @property
    def fixed(self) -> int:
        """The part that does not grow with S: parameters, gradients, optimizer state."""
        return self.params + self.grads + self.optimizer

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def count_params(cfg: Any) -> int:
    """Parameters of the built-in model of `cfg`, built on the meta device (no memory, exact count)."""
    import torch

    from nsa_core.models.tiny_lm import TinyLM

    with torch.device("meta"):
        model = TinyLM(cfg)
    return sum(p.numel() for p in model.parameters())


def _branch_bytes(cfg: Any, branch: str, S: int, B: int, a: int) -> int:
    """Activations of one branch of one layer kept for backward."""
    nsa = cfg.nsa
    H, HKV, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    kv = 2 * B * S * HKV * D * a + B * S * H * D * a  # its k/v projection and its output
    if branch == "sel":
        backend = nsa.sel_backend
        kv += B * S * HKV * D * a  # rotated keys
        if backend in ("masked", "reference"):
            scores = _FACTORS["dense_scores"] * B * S * H * S * 4 + B * S * HKV * S
        else:
            keys = nsa.n_sel * nsa.sel_block_len
            gathered = 2 * B * S * HKV * keys * D * a + B * S * HKV * keys * 8
            scores = gathered + _FACTORS["gather_scores"] * B * S * H * keys * 4
        return int(kv + scores)
    if branch == "cmp":
        nc = max(0, (S - nsa.block_len) // nsa.block_stride + 1)
        blocks = 2 * B * nc * HKV * nsa.block_len * D * a
        scores = _FACTORS["dense_scores"] * B * S * H * nc * 4
        return int(kv + blocks + scores)
    if branch == "win":
        span = S if nsa.win_backend in ("masked", "reference") else min(S, 2 * nsa.window)
        return int(kv + _FACTORS["dense_scores"] * B * S * H * span * 4)
    raise ValueError(f"unknown branch {branch!r}")


def _rank_transient(cfg: Any, S: int, B: int) -> int:
    """``force_branch="sel"``: block ranking without gradient, in query chunks (alive one chunk at a time)."""
    nsa = cfg.nsa
    nc = max(1, (S - nsa.block_len) // nsa.block_stride + 1)
    chunk = min(S, max(1, SCORE_CHUNK_ELEMENTS // max(1, B * cfg.heads * nc)))
    return int(_FACTORS["rank_transient"] * B * chunk * cfg.heads * nc * 4)


def estimate_peak_memory(cfg: Any, *, seq_len: int, batch: int, dtype: str = "fp32") -> MemoryEstimate:
    """The estimated peak bytes of one training step (forward, backward, AdamW) of `cfg`."""
    a = _DTYPE_BYTES[dtype]
    S, B = seq_len, batch
    n_params = count_params(cfg)
    params = grads = 4 * n_params
    optimizer = 8 * n_params
    branches = cfg.nsa.branches
    per_branch = {b: _branch_bytes(cfg, b, S, B, a) for b in branches}
    H, D, dim, hidden = cfg.heads, cfg.head_dim, cfg.dim, cfg.ffn_hidden
    common = B * S * a * (6 * dim + 5 * H * D + 2 * 3 * H + 4 * hidden) + B * S * 4 * 2 * dim  # norms in fp32
    layer = common + sum(per_branch.values())
    checkpointed = len(cfg.gc_layers)
    kept = (cfg.layers - checkpointed) * layer + checkpointed * B * S * dim * a
    recompute = layer if checkpointed else 0
    activations = kept + recompute
    logits = 3 * B * S * cfg.vocab * 4
    transient = _rank_transient(cfg, S, B) if branches == ("sel",) else 0
    total = params + max(grads + activations + logits + transient, grads + optimizer)
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        per_branch=per_branch,
        logits=logits,
        transient=transient,
        total=total,
    )
