"""Analytical estimate of a training step's peak memory from the model config, S, B, dtype and device.

The peak of a step is at the start of the last layer's backward (every layer's saved activations are
alive, the output head's gradient is made, and from step 2 on AdamW's moments are there), or at the
first optimizer step (parameters, gradients and the moments being made). So the estimate is

    params + max([moments from step 2] + head gradient + activations kept for backward + logits
                 + one layer's backward workspace + CUDA library workspace,
                 grads + moments + CUDA library workspace)

What is modelled (bytes):

- model state: fp32 parameters (counted exactly by building the model on the meta device), fp32
  gradients, AdamW's two fp32 moments (the optimizer state competes with the activations: it is made at
  the first step, after the activations are gone).
- activations kept for backward, per layer: norms, q/gate/o projections, SwiGLU MLP, and per computed
  branch (``force_branch`` honoured). Attention's score-sized tensors dominate. `masked_softmax`
  (nsa_core.ops.common) keeps two of them per score: the exponentials and the probabilities, both fp32
  (8 bytes per score), or in bf16/fp16 under autocast the fp32 exponentials and the half-precision
  probabilities the next matmul saves (6 bytes); these are the `_KEPT_PER_SCORE` constants, counted
  from the autograd graph (``torch.autograd.graph.saved_tensors_hooks`` summing the saved storages of
  each backend, CPU, fp32 and bf16 autocast) and exact there. Scores per layer and branch:
  - sel ``masked``: ``[B, S, HQ, S]`` plus the bool mask ``[B, S, HKV, S]``: O(S²); ``gather`` /
    ``packed``: ``[B, S, HQ, n·l']`` plus, per ``[B, S, HKV, n·l']`` key slot, the gathered key and
    value in the compute dtype, the int64 token index and the bool validity mask: O(S·n·l');
  - cmp ``masked``: ``[B, S, HQ, S/d]``, O(S²/d), plus the unfolded blocks; ``sel`` forced alone still
    ranks blocks with these scores, without gradient, in query chunks of at most 2^24 probabilities (a
    transient, not kept);
  - win ``masked``: ``[B, S, HQ, S]``: O(S²); ``chunked``: ``[B, S, HQ, 2w]``, O(S·w).
  - the ``reference`` backends are per-token loops and are modelled like ``masked`` (an upper bound).
- checkpointed layers keep only their input; the largest layer is recomputed once during backward.
- one layer's backward workspace: the gradients of a branch's score tensors while they are made,
  `_BACKWARD_PER_SCORE` bytes per score (the model's only fitted number, below), less what the
  branches whose backward ran before it in that layer have freed; the largest over the branches.
- the logits in fp32 and the cross-entropy's softmax: O(B·S·V).
- on CUDA, the cuBLAS workspaces the caching allocator holds: one per thread that runs matmuls (the
  main thread's forward, the autograd engine's backward thread), 32 MiB each on Hopper.

Fitted, and where: `_BACKWARD_PER_SCORE` fp32 (16) on the tiny preset on an H100 (all branches, sel
masked, S = 2048 and 4096, fp32) and half (10) on m7c-125m on an H100 (``--branch sel``, masked, S =
2048 and 4096, bf16). Every other measured point (m7c-125m all branches masked and gather, with
checkpointing, in fp32; tiny and small in bf16; the CPU sweeps) is out of sample: BENCHMARKS.md lists the
errors. What is not modelled: allocator caching and fragmentation, temporaries inside one op, autocast's
half-precision weight copies, and on the CPU the runtime's resident memory (torch, Python): the CPU
comparison is therefore made above the fitted fixed part.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pydantic import Field

from nsa_diag.records import Record

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SCORE_CHUNK_ELEMENTS = 1 << 24  # nsa_core.layers.attention: query chunks of the no-grad block ranking
# Bytes each attention score keeps for backward (exp and probabilities; see the module docstring).
_KEPT_PER_SCORE = {"fp32": 8, "bf16": 6, "fp16": 6}
# Bytes per score of one layer's largest branch while its backward runs (fitted; see the docstring).
_BACKWARD_PER_SCORE = {"fp32": 16, "bf16": 16, "fp16": 16}
_RANK_TRANSIENT_PER_SCORE = 8  # the no-grad ranking's scores and probabilities, fp32
# The per-token reference backends under bf16/fp16 autocast: each query's einsum casts the key and value
# rows it reads to half precision and keeps the copies, 2 x 2 bytes per key and head dimension (4.3-4.5
# measured with saved_tensors_hooks on the CPU, D = 16 and 32), where fp32 keeps views (about the 8 bytes
# of a masked score). m7c-125m's dense window reference in bf16 ran a 140 GiB H200 out of memory.
_REFERENCE_HALF_PER_KEY_DIM = 4
CUBLAS_WORKSPACE_BYTES = 32 << 20  # per thread running matmuls, Hopper (CUBLAS_WORKSPACE_CONFIG's default)
CUDA_MATMUL_THREADS = 2  # the main thread (forward) and the autograd engine's thread (backward)


class MemoryEstimate(Record):
    """Bytes of each part of the estimated peak; `total` is the peak itself (scale.json's ``estimate``)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    per_branch: dict[str, int] = Field(default_factory=dict)
    logits: int = 0
    transient: int = 0
    workspace: int = 0
    total: int = 0
    # Which phase holds the peak: "backward" (activations, growing with S) or "optimizer" (the AdamW
    # step: parameters, gradients, moments and the step's temporaries; the same at every S).
    phase: str = "backward"

    @property
    def fixed(self) -> int:
        """The part that does not grow with S: parameters, gradients, optimizer state."""
        return self.params + self.grads + self.optimizer


def count_params(cfg: Any) -> int:
    """Parameters of the built-in model of `cfg`, built on the meta device (no memory, exact count)."""
    import torch

    from nsa_core.models.tiny_lm import TinyLM

    with torch.device("meta"):
        model = TinyLM(cfg)
    return sum(p.numel() for p in model.parameters())


def _on_triton(cfg: Any, branch: str) -> bool:
    return getattr(cfg.nsa, f"{branch}_backend") == "triton"


def _scores(cfg: Any, branch: str, S: int, B: int) -> int:
    """Score-sized elements of one branch of one layer: queries x heads x keys each query scores.

    The Triton kernels keep no score (flash attention: a row's log-sum-exp instead): 0 for them.
    """
    nsa = cfg.nsa
    if _on_triton(cfg, branch):
        return 0
    if branch == "sel":
        keys = S if nsa.sel_backend in ("masked", "reference") else nsa.n_sel * nsa.sel_block_len
    elif branch == "cmp":
        keys = max(0, (S - nsa.block_len) // nsa.block_stride + 1)
    elif branch == "win":
        keys = S if nsa.win_backend in ("masked", "reference") else min(S, 2 * nsa.window)
    else:
        raise ValueError(f"unknown branch {branch!r}")
    return B * S * cfg.heads * keys


def _branch_bytes(cfg: Any, branch: str, S: int, B: int, dtype: str) -> int:
    """Activations of one branch of one layer kept for backward."""
    nsa = cfg.nsa
    a = _DTYPE_BYTES[dtype]
    H, HKV, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    kv = 2 * B * S * HKV * D * a + B * S * H * D * a  # its k/v projection and its output
    kept = _KEPT_PER_SCORE[dtype] * _scores(cfg, branch, S, B)
    if _on_triton(cfg, branch):
        kept += B * S * H * 4  # the rows' log-sum-exp (float32)
    if branch == "sel":
        kv += B * S * HKV * D * a  # rotated keys
        if nsa.sel_backend == "triton":
            kept += B * S * HKV * nsa.n_sel * 8  # the chosen blocks (int64)
        elif nsa.sel_backend in ("masked", "reference"):
            kept += B * S * HKV * S  # the bool mask of the selected blocks
        else:
            slots = B * S * HKV * nsa.n_sel * nsa.sel_block_len
            kept += slots * (2 * D * a + 8 + 1)  # gathered key and value, int64 index, bool validity
    elif branch == "cmp":
        nc = max(0, (S - nsa.block_len) // nsa.block_stride + 1)
        kept += 2 * B * nc * HKV * nsa.block_len * D * a  # the unfolded key and value blocks
    if getattr(nsa, f"{branch}_backend") == "reference" and dtype != "fp32":
        kept += _REFERENCE_HALF_PER_KEY_DIM * D * B * S * H * _reference_keys(cfg, branch, S)
    return int(kv + kept)


def _reference_keys(cfg: Any, branch: str, S: int) -> int:
    """Keys each query head reads in the per-token reference of ``branch`` (at most; the last query)."""
    nsa = cfg.nsa
    if branch == "sel":
        return min(S, nsa.n_sel * nsa.sel_block_len)
    if branch == "win":
        return min(S, nsa.window)
    return max(0, (S - nsa.block_len) // nsa.block_stride + 1)


def _backward_workspace(cfg: Any, per_branch: dict[str, int], S: int, B: int, dtype: str) -> int:
    """One layer's backward workspace at its largest. The layer runs cmp, sel, win forward, so backward
    runs win, sel, cmp: when a branch's backward starts, the branches after it in forward have freed
    what they kept."""
    order = [b for b in ("cmp", "sel", "win") if b in per_branch]
    return max(
        _BACKWARD_PER_SCORE[dtype] * _scores(cfg, b, S, B)
        + (_triton_backward(cfg, b, S, B, dtype) if _on_triton(cfg, b) else 0)
        - sum(per_branch[later] for later in order[i + 1 :])
        for i, b in enumerate(order)
    )


def _triton_backward(cfg: Any, branch: str, S: int, B: int, dtype: str) -> int:
    """A Triton branch's backward workspace: dq, dk, dv and the rows' delta; selection adds its inverted
    index (int32 query rows, int64 sort keys and order) and float32 key gradients."""
    a = _DTYPE_BYTES[dtype]
    H, HKV, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    grads = B * S * H * D * a + 2 * B * S * HKV * D * a + B * S * H * 4
    if branch == "sel":
        entries = B * S * HKV * cfg.nsa.n_sel
        grads += entries * (4 + 8 + 8) + 2 * B * S * HKV * D * 4
    return grads


def _rank_transient(cfg: Any, S: int, B: int) -> int:
    """``force_branch="sel"``: block ranking without gradient, in query chunks (alive one chunk at a time)."""
    nsa = cfg.nsa
    nc = max(1, (S - nsa.block_len) // nsa.block_stride + 1)
    chunk = min(S, max(1, SCORE_CHUNK_ELEMENTS // max(1, B * cfg.heads * nc)))
    return int(_RANK_TRANSIENT_PER_SCORE * B * chunk * cfg.heads * nc)


def estimate_peak_memory(
    cfg: Any, *, seq_len: int, batch: int, dtype: str = "fp32", device: str = "cpu", steps: int = 1
) -> MemoryEstimate:
    """The estimated peak bytes of `steps` training steps (forward, backward, AdamW) of `cfg`."""
    a = _DTYPE_BYTES[dtype]
    S, B = seq_len, batch
    n_params = count_params(cfg)
    params = grads = 4 * n_params
    optimizer = 8 * n_params
    branches = cfg.nsa.branches
    per_branch = {b: _branch_bytes(cfg, b, S, B, dtype) for b in branches}
    H, D, dim, hidden = cfg.heads, cfg.head_dim, cfg.dim, cfg.ffn_hidden
    common = B * S * a * (6 * dim + 5 * H * D + 2 * 3 * H + 4 * hidden) + B * S * 4 * 2 * dim  # norms in fp32
    layer = common + sum(per_branch.values())
    checkpointed = len(cfg.gc_layers)
    kept = (cfg.layers - checkpointed) * layer + checkpointed * B * S * dim * a
    recompute = layer if checkpointed else 0
    activations = kept + recompute
    logits = 3 * B * S * cfg.vocab * 4
    backward = _backward_workspace(cfg, per_branch, S, B, dtype)
    transient = backward + (_rank_transient(cfg, S, B) if branches == ("sel",) else 0)
    workspace = CUDA_MATMUL_THREADS * CUBLAS_WORKSPACE_BYTES if device.startswith("cuda") else 0
    # At the peak (the last layer's backward starts) only the output head's gradient exists yet; AdamW's
    # moments exist from the end of step 1 on, so from step 2 they sit under the activations too.
    head_grad = 4 * cfg.vocab * cfg.dim
    moments = optimizer if steps > 1 else 0
    # On CUDA AdamW runs its foreach implementation, whose step holds about one more float32 copy of the
    # parameters in temporaries (H100: a flat 20% above the estimate at small S before this was counted)
    step_temporaries = 4 * n_params if device.startswith("cuda") else 0
    backward_phase = moments + head_grad + activations + logits + transient + workspace
    optimizer_phase = grads + optimizer + workspace + step_temporaries
    total = params + max(backward_phase, optimizer_phase)
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        per_branch=per_branch,
        logits=logits,
        transient=transient,
        workspace=workspace,
        total=total,
        phase="backward" if backward_phase >= optimizer_phase else "optimizer",
    )


# --- a parity check's reference, sized to the case ------------------------------------------------------

BRANCH_NAMES = ("sel", "cmp", "win")
# Backends that check a branch in less memory than the dense reference (each agrees with it to 1e-15 in
# float64: nsa-diag verify, tests/core), in order of preference: sel and win linear in S, cmp S²/d.
LEAN_REFERENCES = {"sel": ("gather", "packed"), "cmp": ("masked",), "win": ("chunked",)}


def estimate_check_memory(
    cfg: Any, *, seq_len: int, batch: int, dtype: str = "fp32", device: str = "cpu"
) -> int:
    """Peak bytes of one forward and backward of `cfg` with no optimizer (a parity check's reference model):
    parameters, gradients, the activations kept for backward, logits and one layer's backward workspace."""
    est = estimate_peak_memory(cfg, seq_len=seq_len, batch=batch, dtype=dtype, device=device, steps=1)
    return est.params + est.grads + est.activations + est.logits + est.transient + est.workspace


# The per-token reference's memory is modelled loosely (thousands of small saved tensors, rounded and
# cached by the allocator): it must fit twice over. On an H200, m7c-125m's dense window reference in bf16,
# estimated at 103 GiB, ran out of memory beyond 110 GiB free.
REFERENCE_MARGIN = 2.0


@dataclass(frozen=True)
class ReferencePlan:
    """The backends a parity check's reference runs, and whether that fits the memory there is."""

    backends: dict[str, str]  # branch -> backend of the reference model
    need_bytes: int  # estimated peak of the reference pass(es)
    budget_bytes: int | None  # what may be used (None: not known, not limited)
    lean: bool  # some branch checked by a lean backend instead of the dense reference
    margin: float = 1.0  # need x margin must fit (REFERENCE_MARGIN where a branch runs the reference)
    fallback: ReferencePlan | None = None  # the lean plan to try if this one runs out of memory anyway

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.need_bytes * self.margin <= self.budget_bytes

    def describe(self) -> str:
        names = ", ".join(f"{branch} {backend}" for branch, backend in self.backends.items())
        budget = "" if self.budget_bytes is None else f" of {_size(self.budget_bytes)} free"
        margin = f" (x{self.margin:g} margin)" if self.margin != 1 else ""
        return f"reference backends {names}; about {_size(self.need_bytes)}{margin}{budget}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def plan_reference(
    cfg: Any, *, seq_len: int, batch: int, dtype: str, device: str, budget_bytes: int | None
) -> ReferencePlan:
    """The reference of a parity check of `cfg`'s backends: the dense reference backends where they fit
    ``budget_bytes`` (with `REFERENCE_MARGIN`), else per computed branch the first lean backend that is not
    the one under test; a dense plan carries that lean one as its ``fallback``. The reference runs in fp32
    and, in bf16/fp16, once more under autocast: both are counted."""

    def need(backends: dict[str, str]) -> int:
        ref = replace(cfg, nsa=replace(cfg.nsa, **{f"{b}_backend": v for b, v in backends.items()}))
        total = estimate_check_memory(ref, seq_len=seq_len, batch=batch, dtype="fp32", device=device)
        if dtype != "fp32":
            total += estimate_check_memory(ref, seq_len=seq_len, batch=batch, dtype=dtype, device=device)
        return total

    def plan_of(backends: dict[str, str], lean: bool, fallback: ReferencePlan | None = None) -> ReferencePlan:
        dense_branches = any(backends[b] == "reference" for b in cfg.nsa.branches)
        margin = REFERENCE_MARGIN if dense_branches else 1.0
        return ReferencePlan(backends, need(backends), budget_bytes, lean, margin, fallback)

    tested = {b: getattr(cfg.nsa, f"{b}_backend") for b in BRANCH_NAMES}

    def leaner(branch: str) -> str:
        return next((c for c in LEAN_REFERENCES[branch] if c != tested[branch]), "reference")

    # Too many Python iterations: lean for that branch whatever the memory (the per-token loops of m7c-125m's
    # selection at S = 2048 took 3.5 minutes of a 5-minute timeout on an H200).
    slow = {b for b in cfg.nsa.branches if reference_loops(cfg, b, seq_len, batch) > REFERENCE_MAX_LOOPS}
    dense = {b: leaner(b) if b in slow else "reference" for b in BRANCH_NAMES}
    lean = {b: leaner(b) if b in cfg.nsa.branches else dense[b] for b in BRANCH_NAMES}
    lean_plan = plan_of(lean, lean=True) if lean != dense else None
    plan = plan_of(dense, lean=bool(slow), fallback=lean_plan)
    if plan.fits or lean_plan is None:
        return plan
    return lean_plan


# Python-level iterations of the per-token reference backends above which a lean backend checks the branch.
REFERENCE_MAX_LOOPS = 1_000_000


def reference_loops(cfg: Any, branch: str, seq_len: int, batch: int) -> int:
    """Python-level iterations of one forward of ``branch``'s reference backend over all layers: a loop per
    query token; selection also per KV head and candidate block (its block ranking)."""
    per_layer = batch * seq_len
    if branch == "sel":
        per_layer *= cfg.kv_heads * max(1, seq_len // cfg.nsa.sel_block_len)
    return per_layer * cfg.layers


# --- a parity check at a size that fits, with the same weights ------------------------------------------


@dataclass(frozen=True)
class CheckSize:
    """The size a parity check runs at: the case's, or a reduction of it (same weights, same batch's first
    rows, first layers and first tokens)."""

    batch: int
    seq_len: int
    layers: int

    def describe(self, full: CheckSize) -> str:
        """What was reduced, against the case's size `full`: "batch 1 of 2, the first 1088 of 2048 tokens"."""
        parts = []
        if self.batch != full.batch:
            parts.append(f"batch {self.batch} of {full.batch}")
        if self.layers != full.layers:
            parts.append(f"the first {self.layers} of {full.layers} layers")
        if self.seq_len != full.seq_len:
            parts.append(f"the first {self.seq_len} of {full.seq_len} tokens")
        return ", ".join(parts) or "the case's size"


def smallest_sparse_seq_len(cfg: Any) -> int:
    """The shortest sequence on which a check still exercises what makes NSA what it is: more selection
    blocks than are selected (one block more than n_sel·l') and longer than the sliding window."""
    nsa = cfg.nsa
    return max(nsa.n_sel * nsa.sel_block_len + nsa.sel_block_len, nsa.window + nsa.block_len)


def smaller_sizes(full: CheckSize, *, min_seq_len: int, fewer_layers: bool) -> list[CheckSize]:
    """Reductions of `full`, least first: the batch halved down to 1 (its rows are independent: each row is
    computed as in the case), then the layers halved down to 1 (``fewer_layers``: a model rebuilt from its
    config, its first layers, the same code), then the sequence halved down to `min_seq_len` (a causal
    model's first tokens are computed as in the case; below it selection would no longer be sparse)."""
    sizes, size = [], full
    while True:
        if size.batch > 1:
            size = replace(size, batch=max(1, size.batch // 2))
        elif fewer_layers and size.layers > 1:
            size = replace(size, layers=max(1, size.layers // 2))
        elif size.seq_len > min_seq_len:
            size = replace(size, seq_len=max(min_seq_len, size.seq_len // 2))
        else:
            return sizes
        sizes.append(size)


def with_layers(cfg: Any, layers: int) -> Any:
    """`cfg` with its first `layers` layers; checkpointing dropped where its range lies beyond them (it
    changes no value, only what is recomputed)."""
    if layers == cfg.layers:
        return cfg
    try:
        return replace(cfg, layers=layers)
    except ValueError:
        return replace(cfg, layers=layers, gc="none")


def check_plans(
    cfg: Any,
    *,
    size: CheckSize,
    dtype: str,
    device: str,
    budget_bytes: int | None,
    fewer_layers: bool,
) -> tuple[ReferencePlan, list[tuple[CheckSize, ReferencePlan]]]:
    """The reference plan at the case's size, and the sizes at which the check fits, each with its plan: the
    case's size first where it fits, then every smaller size (`smaller_sizes`) whose reference fits beside a
    copy of the model under test at that size (its forward and backward are run again there, in the case's
    dtype). A parity check tries them in order, the next one when the last ran out of memory anyway."""
    full = plan_reference(
        cfg, seq_len=size.seq_len, batch=size.batch, dtype=dtype, device=device, budget_bytes=budget_bytes
    )
    fitting = [(size, full)] if full.fits else []
    for smaller in smaller_sizes(size, min_seq_len=smallest_sparse_seq_len(cfg), fewer_layers=fewer_layers):
        small_cfg = with_layers(cfg, smaller.layers)
        budget = budget_bytes
        if budget is not None:
            copy = estimate_check_memory(
                small_cfg, seq_len=smaller.seq_len, batch=smaller.batch, dtype=dtype, device=device
            )
            budget = max(0, budget - copy)
        plan = plan_reference(
            small_cfg, seq_len=smaller.seq_len, batch=smaller.batch, dtype=dtype, device=device,
            budget_bytes=budget,
        )  # fmt: skip
        if plan.fits:
            fitting.append((smaller, plan))
    return full, fitting
