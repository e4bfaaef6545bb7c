"""NSAAttention: projections, RoPE, compression phi, gates and the dispatch to the three branches.

One code path serves the batched forward, the sequential prefill and decode: queries at positions
``pos0 .. pos0 + T - 1`` attend to the keys of every position up to their own, where ``pos0`` is the
length of the cache (0 without one). The branch functions in `nsa_core.ops` take ``q_offset = pos0``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from nsa_core.cache import LayerCache, append
from nsa_core.config import ModelConfig
from nsa_core.ops.common import triton_op, untraced
from nsa_core.ops.compression import compressed_attention, num_compressed_blocks, unfold_blocks
from nsa_core.ops.reference import naive_select_blocks
from nsa_core.ops.selection import block_importance, select_blocks, selected_attention
from nsa_core.ops.window import sliding_window_attention

# The modules each branch owns; q_proj, gate and o_proj serve all three.
BRANCH_MODULES = {"cmp": ("kv_cmp", "phi_k", "phi_v"), "sel": ("kv_sel",), "win": ("kv_win",)}

# A branch hook: hook(module, phase, branch), phase "forward" or "backward", branch None when the op is done.
BranchHook = Callable[[nn.Module, str, "str | None"], None]

# The fused op's dtypes (`triton_nsa_attention`); others compose the branches, which say what they take.
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Scoring without gradient runs in query chunks of at most this many probabilities ([B, chunk, HQ, Nc]).
SCORE_CHUNK_ELEMENTS = 1 << 24


def rope_table(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [1, T, 1, D/2]`` of the rotary embedding at ``positions [T]``, in ``dtype``: computed once
    for the tensors a layer rotates at the same positions (its queries and two key sets)."""
    half = head_dim // 2
    angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = theta ** (-torch.arange(half, dtype=angle_dtype, device=positions.device) / half)
    angles = positions.to(angle_dtype)[:, None] * inv_freq[None, :]  # [T, D/2]
    return angles.cos().to(dtype)[None, :, None, :], angles.sin().to(dtype)[None, :, None, :]


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float = 10000.0,
    table: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rotary embedding of ``x [B, T, H, D]`` at ``positions [T]``, per head, rotating the two halves of D.

    Dot products of a rotated query and key depend only on their position difference. ``table``: the
    `rope_table` of these positions in ``x``'s dtype, where the caller rotates several tensors.
    """
    cos, sin = table if table is not None else rope_table(positions, x.shape[-1], theta, x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class BlockCompressor(nn.Module):
    """phi: one vector per block of ``l`` tokens: an MLP over the block plus an intra-block position code."""

    def __init__(self, block_len: int, head_dim: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(block_len, head_dim) * 0.02)
        self.mlp = nn.Sequential(
            nn.Linear(block_len * head_dim, head_dim), nn.SiLU(), nn.Linear(head_dim, head_dim)
        )

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        # [B, N, H, l, D] -> [B, N, H, D]
        return self.mlp((blocks + self.pos).flatten(-2))

    def weights(self) -> tuple[torch.Tensor, ...]:
        """``(pos, W1, b1, W2, b2)``: what `nsa_core.ops.triton.compressor` computes phi from."""
        first, second = self.mlp[0], self.mlp[2]
        return self.pos, first.weight, first.bias, second.weight, second.bias

    def plain(self) -> bool:
        """Whether running phi as the kernels of `triton_block_compress` hides nothing: the module and its
        MLP as built (no hook, no replaced layer, plain weight tensors) and no global module hook."""
        modules = (self, *self.mlp)
        kinds = tuple(type(m) for m in self.mlp)
        hooked = any(
            m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
            for m in modules
        )
        weights = all(type(w.data) is torch.Tensor for w in self.weights())
        built = kinds == (nn.Linear, nn.SiLU, nn.Linear)
        return built and not hooked and weights and not _global_module_hooks()


class NSAAttention(nn.Module):
    """Native Sparse Attention (arXiv 2502.11089) with grouped-query heads.

    Three branches with their own key/value projections, combined by per-head sigmoid gates:
    compressed (attention over learned summaries of overlapping blocks), selected (attention over the
    top-n blocks the compressed scores rank, plus forced initial and local blocks) and sliding window.

    With the three branches on Triton (and ``nsa.fused``, the default), the attention and the gates run as
    one autograd function (`triton_nsa_attention`): no branch output is kept for autograd, and the branch
    taps (``branch_out``) are not passed; `register_branch_hook` then says where each branch's kernels
    start, forward and backward. Otherwise the branch functions are composed, and each branch's output
    passes its ``branch_out`` tap (an ``nn.Identity`` whose hooks see the branch's forward end and
    backward start).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg, self.nsa = cfg, cfg.nsa
        H, HKV, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, H * D, bias=False)
        self.kv_cmp = nn.Linear(cfg.dim, 2 * HKV * D, bias=False)
        self.kv_sel = nn.Linear(cfg.dim, 2 * HKV * D, bias=False)
        self.kv_win = nn.Linear(cfg.dim, 2 * HKV * D, bias=False)
        self.phi_k = BlockCompressor(self.nsa.block_len, D)
        self.phi_v = BlockCompressor(self.nsa.block_len, D)
        self.gate = nn.Sequential(nn.Linear(cfg.dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, 3 * H))
        self.o_proj = nn.Linear(H * D, cfg.dim, bias=False)
        # Identity taps on each branch's output [B, T, HQ, D]: points where tools hook a branch's forward end
        # and backward start (the branch's kv projection marks its forward start and backward end).
        self.branch_out = nn.ModuleDict({name: nn.Identity() for name in ("cmp", "sel", "win")})
        self._branch_hooks: OrderedDict[int, BranchHook] = OrderedDict()
        # the fused path's RoPE frequencies per device (float32 [D/2]), made on first use
        self._frequencies: dict[torch.device, torch.Tensor] = {}

    @property
    def runs_fused(self) -> bool:
        """Whether forward runs the fused op (`triton_nsa_attention`) rather than the composed branches."""
        nsa = self.nsa
        triton = nsa.sel_backend == nsa.cmp_backend == nsa.win_backend == "triton"
        return nsa.fused and triton and len(nsa.branches) == 3

    def register_branch_hook(self, hook: BranchHook) -> RemovableHandle:
        """Call ``hook(module, phase, branch)`` on the host where the fused op starts a branch's kernels
        (``phase`` "forward" or "backward"; ``branch`` "cmp", "sel", "win", or None once that direction's
        kernels are all launched). Only the fused op calls it (`runs_fused`); the composed branches have
        the ``branch_out`` taps. Hooks run in the order registered; ``handle.remove()`` removes one."""
        handle = RemovableHandle(self._branch_hooks)
        self._branch_hooks[handle.id] = hook
        return handle

    def _on_branch(self, phase: str, branch: str | None) -> None:
        for hook in tuple(self._branch_hooks.values()):
            hook(self, phase, branch)

    def idle_parameter_names(self) -> list[str]:
        """Parameters the configuration never trains: those of the branches `force_branch` leaves out."""
        idle = [
            name
            for branch in ("cmp", "sel", "win")
            if branch not in self.nsa.branches
            for name in BRANCH_MODULES[branch]
        ]
        return [n for n, _ in self.named_parameters() if n.split(".")[0] in idle]

    def _kv(self, proj: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        k, v = proj(x).view(B, T, 2, self.cfg.kv_heads, self.cfg.head_dim).unbind(2)
        return k, v

    def _compress(self, phi: BlockCompressor, raw: torch.Tensor, first: int, rotate: bool) -> torch.Tensor:
        # blocks `first`.. that `raw` completes, through phi; keys rotated at each block's last token
        out = phi(unfold_blocks(raw, self.nsa.block_len, self.nsa.block_stride, first))
        if rotate and out.shape[1]:
            ends = torch.arange(first, first + out.shape[1], device=raw.device)
            out = apply_rope(out, ends * self.nsa.block_stride + self.nsa.block_len - 1, self.cfg.rope_theta)
        return out

    def _choose_blocks(self, p: torch.Tensor, q_offset: int) -> torch.Tensor:
        # p [B, Tq, HQ, Nc] of queries at q_offset.. -> block_idx [B, Tq, HKV, n]
        nsa = self.nsa
        num_keys = q_offset + p.shape[1]
        geometry = self._selection_geometry()
        blocks = dict(kv_heads=self.cfg.kv_heads, block_len=nsa.block_len, block_stride=nsa.block_stride)
        if nsa.sel_backend == "reference":
            return naive_select_blocks(p, num_keys=num_keys, q_offset=q_offset, **blocks, **geometry)
        importance = block_importance(p, sel_block_len=nsa.sel_block_len, num_keys=num_keys, **blocks)
        return select_blocks(importance, q_offset=q_offset, **geometry)

    def _selection_geometry(self) -> dict[str, int]:
        nsa = self.nsa
        return dict(sel_block_len=nsa.sel_block_len, n_sel=nsa.n_sel, n_init=nsa.n_init, n_local=nsa.n_local)

    @torch.no_grad()
    def _rank_in_chunks(self, q: torch.Tensor, k_cmp: torch.Tensor, pos0: int) -> torch.Tensor:
        # Scoring alone (force_branch="sel"): query chunks bound the [chunk, Nc] probabilities, so memory
        # stays linear in T. Chunk i's queries see only the blocks complete by its last query.
        nsa = self.nsa
        if nsa.cmp_backend == "triton":  # never holds the probabilities: no chunks needed
            select_only = triton_op("compression", "triton_compressed_block_select")
            return select_only(
                q,
                k_cmp,
                block_len=nsa.block_len,
                block_stride=nsa.block_stride,
                q_offset=pos0,
                **self._selection_geometry(),
            )
        T = q.shape[1]
        chunk = max(1, SCORE_CHUNK_ELEMENTS // max(1, q.shape[0] * q.shape[2] * k_cmp.shape[1]))
        chosen = []
        for start in range(0, T, chunk):
            stop = min(T, start + chunk)
            visible = num_compressed_blocks(pos0 + stop, nsa.block_len, nsa.block_stride)
            _, p = compressed_attention(
                q[:, start:stop],
                k_cmp[:, :visible],
                k_cmp[:, :visible],  # values are not needed for the probabilities
                block_len=nsa.block_len,
                block_stride=nsa.block_stride,
                q_offset=pos0 + start,
                backend=nsa.cmp_backend,
            )
            chosen.append(self._choose_blocks(p, pos0 + start))
        return torch.cat(chosen, dim=1)

    @property
    def runs_triton(self) -> bool:
        """Whether any branch runs on the Triton backends (the fused op among them)."""
        nsa = self.nsa
        return "triton" in (nsa.sel_backend, nsa.cmp_backend, nsa.win_backend)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """``x [B, T, dim]`` -> ``[B, T, dim]``; with a cache, ``x`` is the next tokens; the cache grows.

        Under ``torch.compile`` a layer on the Triton backends runs as it does eagerly, between two graphs
        (Dynamo counts the call as a graph break; `nsa_core.ops.common.eager_under_compile` says why). The
        projections, norms and MLPs around it compile as usual; with the torch backends the whole layer is
        traced."""
        if self.runs_triton and torch.compiler.is_compiling():
            return untraced(self._forward, x, cache)
        return self._forward(x, cache)

    def _forward(self, x: torch.Tensor, cache: LayerCache | None) -> torch.Tensor:
        cfg, nsa = self.cfg, self.nsa
        B, T, _ = x.shape
        c = cache if cache is not None else LayerCache()
        pos0 = c.length
        num_keys = pos0 + T
        if self.runs_fused and self.q_proj.weight.dtype in FUSED_DTYPES:
            return self._fused(x, c)
        positions = torch.arange(pos0, num_keys, device=x.device)
        q = self.q_proj(x).view(B, T, cfg.heads, cfg.head_dim)
        rope = rope_table(positions, cfg.head_dim, cfg.rope_theta, q.dtype)  # for q and two key sets
        q = apply_rope(q, positions, table=rope)
        branches = nsa.branches
        outputs: dict[str, torch.Tensor] = {}

        block_idx = None
        if "cmp" in branches or "sel" in branches:
            # with force_branch="sel" the compressed keys only rank blocks: no gradient, no values
            scoring_only = "cmp" not in branches
            with torch.set_grad_enabled(torch.is_grad_enabled() and not scoring_only):
                k_raw, v_raw = self._kv(self.kv_cmp, x)
                c.k_cmp_raw = append(c.k_cmp_raw, k_raw)
                first = num_compressed_blocks(pos0, nsa.block_len, nsa.block_stride)
                c.k_cmp = append(c.k_cmp, self._compress(self.phi_k, c.k_cmp_raw, first, rotate=True))
            if scoring_only:
                block_idx = self._rank_in_chunks(q.detach(), c.k_cmp.detach(), pos0)
            else:
                c.v_cmp_raw = append(c.v_cmp_raw, v_raw)
                c.v_cmp = append(c.v_cmp, self._compress(self.phi_v, c.v_cmp_raw, first, rotate=False))
                geometry = dict(block_len=nsa.block_len, block_stride=nsa.block_stride, q_offset=pos0)
                if nsa.cmp_backend == "triton":
                    # the kernel ranks the blocks in the same pass, without a [T, Nc] probability tensor
                    select = None
                    if "sel" in branches:
                        select = dict(kv_heads=cfg.kv_heads, **self._selection_geometry())
                    compressed = triton_op("compression", "triton_compressed_attention")
                    outputs["cmp"], block_idx = compressed(q, c.k_cmp, c.v_cmp, select=select, **geometry)
                else:
                    outputs["cmp"], p = compressed_attention(
                        q, c.k_cmp, c.v_cmp, backend=nsa.cmp_backend, **geometry
                    )
                    if "sel" in branches:
                        block_idx = self._choose_blocks(p.detach(), pos0)

        if "sel" in branches:
            k_sel, v_sel = self._kv(self.kv_sel, x)
            c.k_sel = append(c.k_sel, apply_rope(k_sel, positions, table=rope))
            c.v_sel = append(c.v_sel, v_sel)
            outputs["sel"] = selected_attention(
                q,
                c.k_sel,
                c.v_sel,
                block_idx,
                sel_block_len=nsa.sel_block_len,
                q_offset=pos0,
                backend=nsa.sel_backend,
            )

        if "win" in branches:
            k_win, v_win = self._kv(self.kv_win, x)
            c.k_win = append(c.k_win, apply_rope(k_win, positions, table=rope))
            c.v_win = append(c.v_win, v_win)
            outputs["win"] = sliding_window_attention(
                q, c.k_win, c.v_win, window=nsa.window, q_offset=pos0, backend=nsa.win_backend
            )

        c.length = num_keys
        outputs = {name: self.branch_out[name](o) for name, o in outputs.items()}
        gate_logits = self.gate(x).view(B, T, cfg.heads, 3)  # per head: cmp, sel, win
        if len(outputs) == 3 and nsa.sel_backend == nsa.cmp_backend == nsa.win_backend == "triton":
            gated_sum = triton_op("gates", "triton_gated_sum")  # one pass each way instead of ~10
            out = gated_sum(gate_logits, outputs["cmp"], outputs["sel"], outputs["win"])
        else:
            gates = torch.sigmoid(gate_logits)[..., None]
            out = sum(gates[:, :, :, ("cmp", "sel", "win").index(name)] * o for name, o in outputs.items())
        return self.o_proj(out.reshape(B, T, cfg.heads * cfg.head_dim))

    def _fused(self, x: torch.Tensor, c: LayerCache) -> torch.Tensor:
        # one GEMM and one split-and-rotate kernel for q and the six key/value tensors, the compressors,
        # then one op for the three branches and the gates; the cache as on the composed path
        cfg, nsa = self.cfg, self.nsa
        B, T, _ = x.shape
        pos0 = c.length
        rope = triton_op("rope", "rope")
        inv_freq = self._rope_frequencies(x.device)
        q, k_raw, v_raw, k_sel, v_sel, k_win, v_win = triton_op("rope", "qkv_rope")(
            self._projections(x), inv_freq, heads=cfg.heads, kv_heads=cfg.kv_heads, pos_start=pos0
        )
        first = num_compressed_blocks(pos0, nsa.block_len, nsa.block_stride)
        c.k_cmp_raw, c.v_cmp_raw = append(c.k_cmp_raw, k_raw), append(c.v_cmp_raw, v_raw)
        k_cmp, v_cmp = self._phis(c.k_cmp_raw, c.v_cmp_raw, first)
        if k_cmp.shape[1]:  # keys rotated at each block's last token
            last = first * nsa.block_stride + nsa.block_len - 1
            k_cmp = rope(k_cmp, inv_freq, pos_start=last, pos_step=nsa.block_stride)
        c.k_cmp, c.v_cmp = append(c.k_cmp, k_cmp), append(c.v_cmp, v_cmp)
        c.k_sel, c.v_sel = append(c.k_sel, k_sel), append(c.v_sel, v_sel)
        c.k_win, c.v_win = append(c.k_win, k_win), append(c.v_win, v_win)
        c.length = pos0 + T
        gate_logits = self.gate(x).view(B, T, cfg.heads, 3)  # per head: cmp, sel, win
        nsa_op = triton_op("nsa", "triton_nsa_attention")
        out, _ = nsa_op(
            q, c.k_cmp, c.v_cmp, c.k_sel, c.v_sel, c.k_win, c.v_win, gate_logits,
            block_len=nsa.block_len, block_stride=nsa.block_stride, window=nsa.window, q_offset=pos0,
            on_branch=self._on_branch if self._branch_hooks else None, **self._selection_geometry(),
        )  # fmt: skip
        return self.o_proj(out.reshape(B, T, cfg.heads * cfg.head_dim))

    def _phis(
        self, k_raw: torch.Tensor, v_raw: torch.Tensor, first: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # the fused path's compressors: their Triton kernels (no block copy; the keys' and the values' in
        # the same launches, one forward, three or four backward) where both modules are plain, else each
        # plain one alone and the module itself where a hook or a replaced layer must see it run
        nsa = self.nsa
        geometry = dict(block_len=nsa.block_len, block_stride=nsa.block_stride, first=first)
        if self.phi_k.plain() and self.phi_v.plain():
            pair = triton_op("compressor", "triton_block_compress_pair")
            return pair((k_raw, v_raw), (self.phi_k.weights(), self.phi_v.weights()), **geometry)
        compress = triton_op("compressor", "triton_block_compress")

        def one(phi: BlockCompressor, raw: torch.Tensor) -> torch.Tensor:
            if phi.plain():
                return compress(raw, phi.weights(), **geometry)
            return phi(unfold_blocks(raw, nsa.block_len, nsa.block_stride, first))

        return one(self.phi_k, k_raw), one(self.phi_v, v_raw)

    def _projections(self, x: torch.Tensor) -> torch.Tensor:
        """``[q | k_cmp v_cmp | k_sel v_sel | k_win v_win]`` of ``x`` as one GEMM over the four weights side
        by side, or, where a hook, a wrapper or a bias could see or change a projection, each module called
        as itself (an injected fault, a profiler's module hook, a sharded or adapted weight)."""
        projections = (self.q_proj, self.kv_cmp, self.kv_sel, self.kv_win)
        if all(_plain_linear(m) for m in projections) and not _global_module_hooks():
            return F.linear(x, torch.cat([m.weight for m in projections]))
        return torch.cat([m(x) for m in projections], dim=-1)

    def _rope_frequencies(self, device: torch.device) -> torch.Tensor:
        freq = self._frequencies.get(device)
        if freq is None:
            frequencies = triton_op("rope", "rope_frequencies")
            freq = self._frequencies[device] = frequencies(self.cfg.head_dim, self.cfg.rope_theta, device)
        return freq


def _plain_linear(m: nn.Module) -> bool:
    # an nn.Linear without bias, hooks, or a weight other than a plain tensor (DTensor, quantised)
    hooks = m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
    return type(m) is nn.Linear and m.bias is None and not hooks and type(m.weight.data) is torch.Tensor


def _global_module_hooks() -> bool:
    return bool(
        module_hooks._global_forward_hooks
        or module_hooks._global_forward_pre_hooks
        or module_hooks._global_backward_hooks
        or module_hooks._global_backward_pre_hooks
    )
