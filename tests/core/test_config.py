"""Config: the presets' documented values, flat overrides, errors that name the field, frozenness."""

from __future__ import annotations

import dataclasses
import re

import pytest

from nsa_core import ModelConfig, NSAConfig, parse_gc, preset

# the values the issue documents for each preset: model fields, then NSA geometry
PRESET_VALUES = {
    "tiny": dict(
        vocab=256, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16,
        block_len=8, block_stride=4, sel_block_len=16, n_sel=4, n_init=1, n_local=2, window=32,
    ),
    "small": dict(
        dim=128, heads=8, kv_heads=2, head_dim=16,
        block_len=16, block_stride=8, sel_block_len=32, n_sel=8, window=64,
    ),
    "m7c-125m": dict(
        dim=768, layers=12, heads=12, kv_heads=2, head_dim=64,
        block_len=32, block_stride=16, sel_block_len=64, n_sel=16, window=512,
    ),
}  # fmt: skip
NSA_FIELDS = {f.name for f in dataclasses.fields(NSAConfig)}


def field_value(cfg: ModelConfig, name: str) -> object:
    return getattr(cfg.nsa, name) if name in NSA_FIELDS else getattr(cfg, name)


@pytest.mark.parametrize("name", list(PRESET_VALUES))
def test_preset_values(name: str) -> None:
    cfg = preset(name)
    assert isinstance(cfg, ModelConfig)
    assert isinstance(cfg.nsa, NSAConfig)
    got = {field: field_value(cfg, field) for field in PRESET_VALUES[name]}
    assert got == PRESET_VALUES[name]
    assert cfg.group_size == cfg.heads // cfg.kv_heads


def test_unknown_preset_names_it() -> None:
    with pytest.raises(ValueError, match="huge"):
        preset("huge")


def test_flat_overrides() -> None:
    cfg = preset("tiny", layers=4, dim=32, window=16, sel_backend="masked", force_branch="win", gc="1:3")
    assert (cfg.layers, cfg.dim, cfg.gc) == (4, 32, "1:3")
    assert (cfg.nsa.window, cfg.nsa.sel_backend, cfg.nsa.force_branch) == (16, "masked", "win")
    # fields not overridden keep the preset's values
    assert (cfg.heads, cfg.nsa.block_len, cfg.nsa.n_sel) == (4, 8, 4)


@pytest.mark.parametrize("bad", ["windw", "n_heads", "nsa"])
def test_unknown_override_names_it(bad: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{bad}\b"):
        preset("tiny", **{bad: 1})


# (overrides of the tiny preset, a field the error message must name)
BAD_CONFIGS = [
    pytest.param(dict(block_stride=3), "block_stride", id="stride-not-dividing-block_len"),
    pytest.param(dict(sel_block_len=18), "sel_block_len", id="stride-not-dividing-sel_block_len"),
    pytest.param(dict(block_len=12, block_stride=8), "block_stride", id="stride-8-block-12"),
    pytest.param(dict(n_sel=3), "n_sel", id="n_sel-equal-forced"),
    pytest.param(dict(n_sel=2, n_init=0, n_local=2), "n_sel", id="n_sel-equal-local"),
    pytest.param(dict(n_sel=2, n_init=2, n_local=2), "n_sel", id="n_sel-below-forced"),
    pytest.param(dict(n_local=0), "n_local", id="n_local-zero"),
    pytest.param(dict(n_init=-1), "n_init", id="n_init-negative"),
    pytest.param(dict(window=0), "window", id="window-zero"),
    pytest.param(dict(block_len=0), "block_len", id="block_len-zero"),
    pytest.param(dict(heads=4, kv_heads=3), "kv_heads", id="heads-not-divisible"),
    pytest.param(dict(heads=6, kv_heads=4), "kv_heads", id="heads6-kv4"),
    pytest.param(dict(head_dim=15), "head_dim", id="odd-head_dim"),
    pytest.param(dict(layers=0), "layers", id="layers-zero"),
    pytest.param(dict(sel_backend="flash"), "sel_backend", id="unknown-sel_backend"),
    pytest.param(dict(cmp_backend="gather"), "cmp_backend", id="unknown-cmp_backend"),
    pytest.param(dict(win_backend="packed"), "win_backend", id="unknown-win_backend"),
    pytest.param(dict(prefill="chunked"), "prefill", id="unknown-prefill"),
    pytest.param(dict(force_branch="all"), "force_branch", id="unknown-force_branch"),
    pytest.param(dict(gc="3:1"), "gc", id="gc-reversed"),
    pytest.param(dict(gc="0:99"), "gc", id="gc-beyond-layers"),
    pytest.param(dict(gc="1:1"), "gc", id="gc-empty-range"),
    pytest.param(dict(gc="0:3"), "gc", id="gc-one-past-layers"),
    pytest.param(dict(gc="x"), "gc", id="gc-garbage"),
    pytest.param(dict(gc="-1:2"), "gc", id="gc-negative"),
    pytest.param(dict(gc=""), "gc", id="gc-empty"),
    pytest.param(dict(gc="1:"), "gc", id="gc-open-ended"),
    pytest.param(dict(gc="all", prefill="sequential"), "prefill", id="gc-all-with-sequential"),
    pytest.param(dict(gc="0:1", prefill="sequential"), "prefill", id="gc-range-with-sequential"),
    pytest.param(dict(gc_reentrant="yes"), "gc_reentrant", id="gc_reentrant-not-bool"),
]


@pytest.mark.parametrize("overrides, field", BAD_CONFIGS)
def test_bad_config_names_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{re.escape(field)}\b") as info:
        preset("tiny", **overrides)
    assert type(info.value) is ValueError


def test_gc_with_sequential_names_both() -> None:
    with pytest.raises(ValueError, match=r"\bgc\b.*sequential"):
        preset("tiny", gc="all", prefill="sequential")


@pytest.mark.parametrize(
    "gc, layers, expected",
    [
        pytest.param("none", 4, range(0), id="none"),
        pytest.param("all", 4, range(4), id="all"),
        pytest.param("1:3", 4, range(1, 3), id="1:3"),
        pytest.param("2:4", 4, range(2, 4), id="2:4"),
        pytest.param("0:1", 1, range(0, 1), id="0:1-of-1"),
    ],
)
def test_gc_layers(gc: str, layers: int, expected: range) -> None:
    assert parse_gc(gc, layers) == expected
    assert preset("tiny", layers=layers, gc=gc).gc_layers == expected


def test_sequential_without_gc_is_fine() -> None:
    cfg = preset("tiny", prefill="sequential", gc="none")
    assert cfg.prefill == "sequential"


def test_configs_are_frozen() -> None:
    cfg = preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 32  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.nsa.window = 16  # type: ignore[misc]
    # a changed copy goes through validation again
    assert dataclasses.replace(cfg.nsa, window=16).window == 16
    with pytest.raises(ValueError, match="n_sel"):
        dataclasses.replace(cfg.nsa, n_sel=1)


def test_configs_are_hashable_and_compare_by_value() -> None:
    assert preset("tiny", layers=3) == preset("tiny", layers=3)
    assert hash(preset("tiny")) == hash(preset("tiny"))
    assert preset("tiny") != preset("tiny", sel_backend="packed")
