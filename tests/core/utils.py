"""Helpers shared by the nsa_core tests: one comparison helper, the tiny geometry, models built from presets.

`assert_close` follows fla's ``assert_close(prefix, ref, tri, ratio)``: it reports the relative RMS error
``rms(ref - tri) / rms(ref)`` and the largest absolute difference, and fails on any NaN or Inf in either
tensor, so a backend that leaves a tile unwritten or divides by an empty softmax fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nsa_core import CMP_BACKENDS, SEL_BACKENDS, WIN_BACKENDS, ModelConfig, NSAConfig, TinyLM, preset

# float64 everywhere: backends differ from the reference only by summation order (~1e-15 relative)
DTYPE = torch.float64
RATIO = 1e-9  # relative RMS error allowed between a float64 backend and the float64 reference
ATOL = 1e-12  # below this largest absolute difference a comparison passes whatever the ratio (zero tensors)


def get_abs_err(ref: torch.Tensor, tri: torch.Tensor) -> float:
    return (ref.double() - tri.double()).abs().max().item() if ref.numel() else 0.0


# A gradient that is zero in exact arithmetic (a saturated softmax: p = 1 on one key, so p (dp - delta) = 0;
# a decode step at t = 0 reads one key) comes out of float32/bf16 kernels as rounding noise of the size of
# the cancelled terms: a relative error against it is meaningless. Low-precision comparisons pass when the
# largest absolute difference stays below this; gradients elsewhere are O(1) in these tests.
LOW_PRECISION_ATOL = 1e-3


def assert_within_same_dtype_error(
    name: str, ref: torch.Tensor, base: torch.Tensor, tri: torch.Tensor, floor: float, factor: float = 2.0
) -> None:
    """A bf16/fp16 kernel result ``tri`` against the float64 ``ref``: finite, the same shape, and at most
    ``factor`` x the error of the same-dtype torch run ``base`` plus ``floor`` (flash-attention's rule);
    a result within `LOW_PRECISION_ATOL` of ``ref`` passes whatever the ratio (a gradient that is zero)."""
    assert tri.shape == ref.shape, name
    assert torch.isfinite(tri).all(), f"{name}: non-finite values"
    if get_abs_err(ref, tri) <= LOW_PRECISION_ATOL:
        return
    base_err, tri_err = get_err_ratio(ref, base), get_err_ratio(ref, tri)
    assert tri_err <= factor * base_err + floor, f"{name}: {tri_err:.3e} vs same-dtype torch {base_err:.3e}"


def get_err_ratio(ref: torch.Tensor, tri: torch.Tensor) -> float:
    if not ref.numel():
        return 0.0
    err = (ref.double() - tri.double()).square().mean().sqrt()
    base = ref.double().square().mean().sqrt()
    return (err / (base + 1e-300)).item()


def assert_close(
    name: str, ref: torch.Tensor | None, tri: torch.Tensor | None, ratio: float = RATIO, atol: float = ATOL
) -> None:
    """Fail unless ``tri`` matches ``ref``: same shape, both finite, relative RMS error below ``ratio``."""
    assert ref is not None, f"{name}: reference is None (no gradient reached it?)"
    assert tri is not None, f"{name}: tested tensor is None (no gradient reached it?)"
    assert ref.shape == tri.shape, f"{name}: shape {tuple(tri.shape)} != reference {tuple(ref.shape)}"
    for label, x in (("reference", ref), ("tested", tri)):
        if not x.is_floating_point():
            continue
        bad = ~torch.isfinite(x)
        if bad.any():
            first = tuple(bad.nonzero()[0].tolist())
            raise AssertionError(f"{name}: {label} has {int(bad.sum())} NaN/Inf values, first at {first}")
    abs_err, err_ratio = get_abs_err(ref, tri), get_err_ratio(ref, tri)
    msg = f"{name:>24} max abs diff {abs_err:.3e}  rel RMS err {err_ratio:.3e} (limit {ratio:.1e})"
    if abs_err <= atol:
        return
    assert err_ratio < ratio, msg


def assert_grads_close(
    ref_model: torch.nn.Module, tri_model: torch.nn.Module, ratio: float = RATIO, allow_none: bool = False
) -> None:
    """Every parameter gradient of ``tri_model`` matches ``ref_model``'s.

    Every parameter must have a gradient, unless ``allow_none``: then a parameter may have none, where the
    other model's gradient is None or all zeros (a backend may touch an empty tensor where another skips it).
    """
    ref_params = dict(ref_model.named_parameters())
    tri_params = dict(tri_model.named_parameters())
    assert sorted(ref_params) == sorted(tri_params), "models have different parameter names"
    for name, ref_p in ref_params.items():
        ref_grad, tri_grad = ref_p.grad, tri_params[name].grad
        if allow_none and (ref_grad is None or tri_grad is None):
            other = tri_grad if ref_grad is None else ref_grad
            assert other is None or not other.any(), f"{name}.grad: None on one side, nonzero on the other"
            continue
        assert_close(f"{name}.grad", ref_grad, tri_grad, ratio)


@dataclass(frozen=True)
class Geometry:
    """NSA geometry passed to the ops as keyword arguments."""

    block_len: int = 8
    block_stride: int = 4
    sel_block_len: int = 16
    n_sel: int = 4
    n_init: int = 1
    n_local: int = 2
    window: int = 32

    @property
    def id(self) -> str:
        return (
            f"l{self.block_len}-d{self.block_stride}-ls{self.sel_block_len}-"
            f"n{self.n_sel}-i{self.n_init}-loc{self.n_local}"
        )

    def num_cmp_blocks(self, num_keys: int) -> int:
        if num_keys < self.block_len:
            return 0
        return (num_keys - self.block_len) // self.block_stride + 1

    def select_kwargs(self) -> dict[str, int]:
        return dict(
            block_len=self.block_len,
            block_stride=self.block_stride,
            sel_block_len=self.sel_block_len,
            n_sel=self.n_sel,
            n_init=self.n_init,
            n_local=self.n_local,
        )


TINY = Geometry()  # the tiny preset's geometry


def visible_blocks_mask(num_blocks: int, q_offset: int, tq: int, geo: Geometry) -> torch.Tensor:
    """``[Tq, Nc]``: compressed block ``i`` is visible to the query at ``t`` iff ``i*d + l - 1 <= t``."""
    t = torch.arange(q_offset, q_offset + tq)[:, None]
    ends = torch.arange(num_blocks)[None, :] * geo.block_stride + geo.block_len - 1
    return ends <= t


def oracle_importance(
    p_row: list[list[float]], group: int, num_keys: int, geo: Geometry
) -> list[list[float]]:
    """Importance of one query, written from the spec's words: ``p_row[h][i]`` -> ``[HKV][Ns]``."""
    r = geo.block_len // geo.block_stride
    k = geo.sel_block_len // geo.block_stride
    nc = len(p_row[0]) if p_row else 0
    ns = -(-num_keys // geo.sel_block_len)
    out = []
    for g in range(len(p_row) // group):
        scores = []
        for j in range(ns):
            total = 0.0
            for c in range(j * k, (j + 1) * k):  # the chunks of selection block j
                for i in range(c - r + 1, c + 1):  # compressed blocks that contain chunk c
                    if 0 <= i < nc:
                        total += sum(p_row[h][i] for h in range(g * group, (g + 1) * group))
            scores.append(total)
        out.append(scores)
    return out


def oracle_select(importance: list[float], t: int, geo: Geometry) -> list[int]:
    """The selection rule of one query and KV group, written from the spec's words."""
    lsel = geo.sel_block_len
    candidates = [j for j in range(len(importance)) if j * lsel <= t]
    own = t // lsel
    forced = [j for j in candidates if j < geo.n_init or own - geo.n_local + 1 <= j <= own]
    others = sorted((j for j in candidates if j not in forced), key=lambda j: (-importance[j], j))
    chosen = (forced + others)[: geo.n_sel]
    return chosen + [-1] * (geo.n_sel - len(chosen))


# Model tests: the tiny preset with selection blocks of 8 tokens, so that at S = 53 a query has up to 7
# candidate blocks for n_sel = 4 slots and the importance ranking decides (with l' = 16 every block would be
# taken up to S = 64). S = 53 is no multiple of d=4, l=8 or l'=8 and is longer than the window w=32.
MODEL_OVERRIDES: dict[str, Any] = dict(sel_block_len=8)
BATCH, SEQ_LEN = 2, 53
REFERENCE_BACKENDS = dict(sel_backend="reference", cmp_backend="reference", win_backend="reference")


def backend_combos() -> list[dict[str, str]]:
    """Each sel backend with the default cmp and win, each cmp backend, each win backend (deduplicated)."""
    default = NSAConfig()
    combos = [
        dict(sel_backend=b, cmp_backend=default.cmp_backend, win_backend=default.win_backend)
        for b in SEL_BACKENDS
    ]
    combos += [
        dict(sel_backend=default.sel_backend, cmp_backend=b, win_backend=default.win_backend)
        for b in CMP_BACKENDS
    ]
    combos += [
        dict(sel_backend=default.sel_backend, cmp_backend=default.cmp_backend, win_backend=b)
        for b in WIN_BACKENDS
    ]
    unique = []
    for combo in combos:
        if combo not in unique:
            unique.append(combo)
    return unique


def combo_id(combo: dict[str, str]) -> str:
    return "sel_{sel_backend}-cmp_{cmp_backend}-win_{win_backend}".format(**combo)


def tiny_config(**overrides: Any) -> ModelConfig:
    return preset("tiny", **overrides)


def make_model(seed: int = 0, **overrides: Any) -> TinyLM:
    """A float64 TinyLM of the tiny preset with ``overrides``, initialised from ``seed``."""
    torch.manual_seed(seed)
    return TinyLM(tiny_config(**overrides)).to(DTYPE)


def clone_model(source: torch.nn.Module, **overrides: Any) -> TinyLM:
    """A model of another config (same shapes) holding ``source``'s weights, loaded strictly."""
    model = TinyLM(tiny_config(**overrides)).to(DTYPE)
    model.load_state_dict(source.state_dict(), strict=True)
    return model


def random_tokens(batch: int, seq_len: int, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_len), generator=gen)


def logits_loss(logits: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A loss whose gradient reaches every logit with a fixed random weight (no symmetric cancellation)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(logits.shape, generator=gen, dtype=logits.dtype)
    return (logits * weight).sum()
