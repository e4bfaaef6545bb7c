"""NSAAttention against a per-token layer written from the spec, with the layer's own submodules.

The backend-parity tests compare models that share the layer code, so a mistake in that code (RoPE of a
compressed key at the wrong position, a gate mixed into the wrong branch, values rotated) passes them all.
Here each query is computed alone from the spec's definitions: the projections ``q_proj``, ``kv_cmp``,
``kv_sel``, ``kv_win`` (``Linear(dim, 2 * HKV * D)``, keys first), the block compressors ``phi_k``/``phi_v``
(applied to a ``[..., l, D]`` block), the gate (``sigmoid``, per head the branches cmp, sel, win) and
``o_proj`` are called as black boxes; everything between them is rewritten here.
"""

from __future__ import annotations

import pytest
import torch

from nsa_core import NSAAttention, apply_rope

from .utils import (
    DTYPE,
    MODEL_OVERRIDES,
    REFERENCE_BACKENDS,
    Geometry,
    assert_close,
    oracle_importance,
    oracle_select,
    tiny_config,
)

B, T = 2, 45  # longer than the window (32), no multiple of 4 or 8


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One query ``[D]`` over keys/values ``[S, D]``: (output, probabilities); zeros when ``S == 0``."""
    if k.shape[0] == 0:
        return torch.zeros_like(q), q.new_zeros(0)
    p = torch.softmax(k @ q * q.shape[-1] ** -0.5, dim=0)
    return p @ v, p


def spec_layer(attn: NSAAttention, x: torch.Tensor) -> torch.Tensor:
    cfg, nsa = attn.cfg, attn.cfg.nsa
    H, HKV, D, G = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.heads // cfg.kv_heads
    l, d = nsa.block_len, nsa.block_stride
    geo = Geometry(l, d, nsa.sel_block_len, nsa.n_sel, nsa.n_init, nsa.n_local, nsa.window)
    batch, seq_len, _ = x.shape
    pos = torch.arange(seq_len)

    def kv(proj: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = proj(x).view(batch, seq_len, 2, HKV, D).unbind(2)
        return k, v

    q = apply_rope(attn.q_proj(x).view(batch, seq_len, H, D), pos, cfg.rope_theta)
    k_cmp, v_cmp = kv(attn.kv_cmp)
    k_sel, v_sel = kv(attn.kv_sel)
    k_win, v_win = kv(attn.kv_win)
    k_sel, k_win = apply_rope(k_sel, pos, cfg.rope_theta), apply_rope(k_win, pos, cfg.rope_theta)
    # compressed keys: phi over tokens [i*d, i*d + l), rotated at the block's last token; values unrotated
    nc = geo.num_cmp_blocks(seq_len)
    ends = torch.arange(nc) * d + l - 1
    kc = torch.stack([attn.phi_k(k_cmp[:, i * d : i * d + l].transpose(1, 2)) for i in range(nc)], dim=1)
    vc = torch.stack([attn.phi_v(v_cmp[:, i * d : i * d + l].transpose(1, 2)) for i in range(nc)], dim=1)
    kc = apply_rope(kc, ends, cfg.rope_theta) if nc else kc
    gates = torch.sigmoid(attn.gate(x)).view(batch, seq_len, H, 3)

    out = torch.zeros(batch, seq_len, H, D, dtype=x.dtype)
    for b in range(batch):
        for t in range(seq_len):
            visible = int((ends <= t).sum())
            cmp_out, probs = [], []
            for h in range(H):
                o, p = attend(q[b, t, h], kc[b, :visible, h // G], vc[b, :visible, h // G])
                cmp_out.append(o)
                probs.append(torch.cat([p, p.new_zeros(nc - visible)]).tolist())
            importance = oracle_importance(probs, G, t + 1, geo)
            for h in range(H):
                blocks = [j for j in oracle_select(importance[h // G], t, geo) if j >= 0]
                keys = [
                    s
                    for j in blocks
                    for s in range(j * geo.sel_block_len, (j + 1) * geo.sel_block_len)
                    if s <= t
                ]
                sel_o, _ = attend(q[b, t, h], k_sel[b, keys, h // G], v_sel[b, keys, h // G])
                lo = max(0, t - geo.window + 1)
                win_o, _ = attend(q[b, t, h], k_win[b, lo : t + 1, h // G], v_win[b, lo : t + 1, h // G])
                g = gates[b, t, h]
                out[b, t, h] = g[0] * cmp_out[h] + g[1] * sel_o + g[2] * win_o
    return attn.o_proj(out.reshape(batch, seq_len, H * D))


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(REFERENCE_BACKENDS, id="reference"),
        pytest.param({}, id="default"),
        pytest.param(dict(heads=4, kv_heads=1), id="G4"),
        pytest.param(dict(heads=2, kv_heads=2), id="G1"),
    ],
)
def test_layer_matches_spec(overrides: dict) -> None:
    torch.manual_seed(0)
    attn = NSAAttention(tiny_config(**{**MODEL_OVERRIDES, **overrides})).to(DTYPE)
    x = torch.randn(B, T, attn.cfg.dim, dtype=DTYPE)
    assert_close("y", spec_layer(attn, x), attn(x))


def test_layer_gradients_match_spec() -> None:
    torch.manual_seed(0)
    attn = NSAAttention(tiny_config(**MODEL_OVERRIDES)).to(DTYPE)
    x = torch.randn(B, T, attn.cfg.dim, dtype=DTYPE, requires_grad=True)
    dy = torch.randn(B, T, attn.cfg.dim, dtype=DTYPE)
    params = [x, *attn.parameters()]
    ref_grads = torch.autograd.grad(spec_layer(attn, x), params, dy)
    tri_grads = torch.autograd.grad(attn(x), params, dy)
    names = ["x", *(name for name, _ in attn.named_parameters())]
    for name, ref, tri in zip(names, ref_grads, tri_grads, strict=True):
        assert_close(f"d{name}", ref, tri)


def test_layer_with_cache_extends_it() -> None:
    """``forward(x, cache)`` over chunks equals one forward over the whole sequence."""
    from nsa_core import LayerCache

    torch.manual_seed(0)
    attn = NSAAttention(tiny_config(**MODEL_OVERRIDES)).to(DTYPE)
    x = torch.randn(B, T, attn.cfg.dim, dtype=DTYPE)
    cache = LayerCache()
    with torch.no_grad():
        chunks = [attn(x[:, a:b], cache) for a, b in [(0, 11), (11, 12), (12, 40), (40, T)]]
        assert_close("chunked", attn(x), torch.cat(chunks, dim=1))
    assert cache.length == T
