"""Model and NSA configuration: frozen dataclasses validated on construction, and the presets.

Every switch that changes what the model computes (backends, forced branch, prefill mode, gradient
checkpointing) is a typed field checked here once. Nothing in `nsa_core` reads environment variables.

Notation follows the NSA paper (arXiv 2502.11089): compression block length ``l`` (``block_len``) and
stride ``d`` (``block_stride``), selection block length ``l'`` (``sel_block_len``), ``n`` selected blocks
(``n_sel``) of which ``n_init`` initial and ``n_local`` local ones are always taken, sliding window ``w``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SEL_BACKENDS = ("reference", "masked", "gather", "packed")
CMP_BACKENDS = ("reference", "masked")
WIN_BACKENDS = ("reference", "masked", "chunked")
# Accepted by all three *_backend fields but kept out of the tuples above, which list the backends that run
# on any device (suites and CLIs iterate them): Triton kernels need CUDA, or Triton's CPU interpreter.
TRITON_BACKENDS = ("triton",)
PREFILL_MODES = ("batched", "sequential")
BRANCHES = ("cmp", "sel", "win")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(choices)}")


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class NSAConfig:
    """Geometry and backends of one NSA attention layer.

    Compressed block ``i`` covers tokens ``[i*d, i*d + l)`` and is visible to the query at ``t`` once
    complete (``i*d + l - 1 <= t``). Selection block ``j`` covers ``[j*l', (j+1)*l')``.
    """

    block_len: int = 8  # l: tokens per compressed block
    block_stride: int = 4  # d: stride between compressed blocks (d divides l and l')
    sel_block_len: int = 16  # l': tokens per selection block
    n_sel: int = 4  # n: selected blocks per query and KV group, forced ones included
    n_init: int = 1  # initial blocks always selected
    n_local: int = 2  # local blocks always selected: the one holding t and the n_local - 1 before it
    window: int = 32  # w: the sliding window attends keys t-w+1 .. t
    sel_backend: str = "gather"
    cmp_backend: str = "masked"
    win_backend: str = "chunked"
    force_branch: str | None = None  # compute only this branch ("cmp", "sel" or "win")
    # the three branches on Triton run as one autograd function (`triton_nsa_attention`); False composes the
    # branch functions (the same values; each branch's output then passes its `branch_out` tap)
    fused: bool = True

    def __post_init__(self) -> None:
        for name in ("block_len", "block_stride", "sel_block_len", "n_sel", "window"):
            _check_positive(name, getattr(self, name))
        for name in ("n_init", "n_local"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer")
        if self.block_len % self.block_stride:
            raise ValueError(
                f"block_stride={self.block_stride} must divide block_len={self.block_len}; "
                f"pick a stride among the divisors of {self.block_len}"
            )
        if self.sel_block_len % self.block_stride:
            raise ValueError(
                f"block_stride={self.block_stride} must divide sel_block_len={self.sel_block_len}; "
                f"make sel_block_len a multiple of {self.block_stride}"
            )
        if self.n_local < 1:
            raise ValueError("n_local=0: the block holding the query must be selected; set n_local >= 1")
        if self.n_sel <= self.n_init + self.n_local:
            raise ValueError(
                f"n_sel={self.n_sel} must exceed the forced blocks n_init + n_local = "
                f"{self.n_init + self.n_local}; raise n_sel or lower n_init/n_local"
            )
        _check_choice("sel_backend", self.sel_backend, SEL_BACKENDS + TRITON_BACKENDS)
        _check_choice("cmp_backend", self.cmp_backend, CMP_BACKENDS + TRITON_BACKENDS)
        _check_choice("win_backend", self.win_backend, WIN_BACKENDS + TRITON_BACKENDS)
        if self.force_branch is not None:
            _check_choice("force_branch", self.force_branch, BRANCHES)
        if not isinstance(self.fused, bool):
            raise ValueError(f"fused={self.fused!r} must be True or False")

    @property
    def branches(self) -> tuple[str, ...]:
        """The branches this layer computes."""
        return BRANCHES if self.force_branch is None else (self.force_branch,)


def parse_gc(gc: str, layers: int) -> range:
    """Parse a checkpoint spec (``none``, ``all`` or ``A:B`` for layers A..B-1) into a layer range."""
    if gc == "none":
        return range(0)
    if gc == "all":
        return range(layers)
    start, sep, stop = gc.partition(":")
    if not sep or not start.strip().isdigit() or not stop.strip().isdigit():
        raise ValueError(f"gc={gc!r} must be 'none', 'all' or 'A:B' (checkpoint layers A to B-1)")
    a, b = int(start), int(stop)
    if not 0 <= a < b <= layers:
        raise ValueError(f"gc={gc!r} needs 0 <= A < B <= layers={layers}")
    return range(a, b)


@dataclass(frozen=True)
class ModelConfig:
    """A TinyLM with NSA attention in every block."""

    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4  # query heads
    kv_heads: int = 2  # key/value heads; heads / kv_heads query heads share each KV group
    head_dim: int = 16
    mlp_hidden: int | None = None  # SwiGLU hidden size; None: 8/3 * dim rounded up to a multiple of 8
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    prefill: str = "batched"  # "sequential" runs model(tokens) token by token through the decode cache
    gc: str = "none"  # gradient checkpointing: "none", "all" or "A:B"
    gc_reentrant: bool = False
    nsa: NSAConfig = field(default_factory=NSAConfig)

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "layers", "heads", "kv_heads", "head_dim"):
            _check_positive(name, getattr(self, name))
        if self.mlp_hidden is not None:
            _check_positive("mlp_hidden", self.mlp_hidden)
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads={self.heads} must be divisible by kv_heads={self.kv_heads}; "
                f"use a kv_heads among the divisors of {self.heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r} must be positive")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps!r} must be positive")
        _check_choice("prefill", self.prefill, PREFILL_MODES)
        if not isinstance(self.nsa, NSAConfig):
            raise ValueError(f"nsa must be an NSAConfig, got {type(self.nsa).__name__}")
        if not isinstance(self.gc_reentrant, bool):
            raise ValueError(f"gc_reentrant={self.gc_reentrant!r} must be a bool")
        gc_layers = parse_gc(self.gc, self.layers)
        if len(gc_layers) and self.prefill == "sequential":
            raise ValueError(
                f"gc={self.gc!r} with prefill='sequential': checkpointing recomputes a block in backward, "
                "which would replay its decode-cache update; use prefill='batched' or gc='none'"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (G)."""
        return self.heads // self.kv_heads

    @property
    def ffn_hidden(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return (8 * self.dim // 3 + 7) // 8 * 8

    @property
    def gc_layers(self) -> range:
        """The layers run under gradient checkpointing."""
        return parse_gc(self.gc, self.layers)


_NSA_FIELDS = frozenset(f.name for f in dataclasses.fields(NSAConfig))
_MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig)) - {"nsa"}

# fmt: off
PRESETS: dict[str, dict[str, Any]] = {
    # Runs in seconds on a laptop CPU: the embedded default.
    "tiny": dict(
        vocab=256, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16,
        block_len=8, block_stride=4, sel_block_len=16, n_sel=4, n_init=1, n_local=2, window=32,
    ),
    # The seeds' small model.
    "small": dict(
        vocab=256, dim=128, layers=2, heads=8, kv_heads=2, head_dim=16,
        block_len=16, block_stride=8, sel_block_len=32, n_sel=8, n_init=1, n_local=2, window=64,
    ),
    # The seeds' production model (m7c-125m): 12 layers, dim 768, GQA 12/2, paper geometry.
    "m7c-125m": dict(
        vocab=50304, dim=768, layers=12, heads=12, kv_heads=2, head_dim=64,
        block_len=32, block_stride=16, sel_block_len=64, n_sel=16, n_init=1, n_local=2, window=512,
    ),
}
# fmt: on


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Build the `ModelConfig` of a preset, with flat field overrides.

    Overrides name fields of either `ModelConfig` (``dim``, ``layers``, ``gc``...) or `NSAConfig`
    (``block_len``, ``sel_backend``, ``force_branch``...),
    e.g. ``preset("tiny", layers=4, sel_backend="masked")``.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    unknown = sorted(set(overrides) - _NSA_FIELDS - _MODEL_FIELDS)
    if unknown:
        raise ValueError(
            f"unknown override(s) {', '.join(unknown)}; valid fields are "
            f"{', '.join(sorted(_MODEL_FIELDS | _NSA_FIELDS))}"
        )
    values = {**PRESETS[name], **overrides}
    nsa = NSAConfig(**{k: v for k, v in values.items() if k in _NSA_FIELDS})
    return ModelConfig(nsa=nsa, **{k: v for k, v in values.items() if k in _MODEL_FIELDS})
