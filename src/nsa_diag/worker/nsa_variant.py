"""A user's ``--model`` seen through the nsa_core attention it holds: the `NSAAttention` modules, the NSA
config that sizes a check of them, and a copy of the model whose NSA modules run other settings.

nsa-diag cannot rebuild a user's model from a config (its factory is theirs), so a parity check compares the
model as built with a deep copy of it (same weights, same buffers, same classes, the same ``--gc``
wrapping) in which every `NSAAttention` runs other backends. Only the attention modules change: whatever
else the model computes is computed the same way on both sides, so a difference is the backends'.

The copy leaves out the hooks nsa-diag put on the model (progress, faults, profiler ranges: they hold the
case's beacon and must not fire twice); the user's own hooks go with it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from nsa_core import ModelConfig, NSAAttention

# The hook tables of an nn.Module (`torch.nn.Module.__init__`); the ``_with_kwargs`` and ``_always_called``
# tables are keyed by the ids of the hooks in the first two.
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_HOOK_FLAGS = {
    "_forward_hooks_with_kwargs": "_forward_hooks",
    "_forward_hooks_always_called": "_forward_hooks",
    "_forward_pre_hooks_with_kwargs": "_forward_pre_hooks",
}


def nsa_modules(model: nn.Module) -> list[NSAAttention]:
    """Every `nsa_core.NSAAttention` inside ``model``, in module order."""
    from nsa_core import NSAAttention

    return [m for m in model.modules() if isinstance(m, NSAAttention)]


def nsa_idle_parameters(model: nn.Module) -> list[str]:
    """The parameters of ``model``'s NSA modules that their config never trains (the branches
    ``force_branch`` leaves out), by their names in ``model``: no gradient there is what was asked for."""
    from nsa_core import NSAAttention

    return [
        f"{name}.{param}" if name else param
        for name, module in model.named_modules()
        if isinstance(module, NSAAttention)
        for param in module.idle_parameter_names()
    ]


def nsa_config(model: nn.Module) -> ModelConfig | None:
    """The NSA config that sizes a check of ``model``'s attention: its first NSA module's config, with as
    many layers as the model has NSA modules (the memory estimate counts attention per layer). None when the
    model holds no NSA module."""
    modules = nsa_modules(model)
    if not modules:
        return None
    cfg = modules[0].cfg
    try:
        return dataclasses.replace(cfg, layers=len(modules), gc="none")
    except ValueError:  # a config that does not validate with another layer count: size it as built
        return cfg


def _ours(hook: Any) -> bool:
    """A hook nsa-diag registered (progress, faults, profiler ranges): defined in a module of nsa_diag."""
    function = getattr(hook, "__func__", hook)
    return str(getattr(function, "__module__", "")).startswith("nsa_diag.")


def _without_our_hooks(model: nn.Module) -> dict[int, Any]:
    """A `copy.deepcopy` memo that gives every module of ``model`` hook tables without nsa-diag's hooks."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        kept: dict[str, set[int]] = {}
        for name in _HOOK_TABLES:
            table = module.__dict__.get(name)
            if table is None:
                continue
            copied = type(table)((k, v) for k, v in table.items() if not _ours(v))
            kept[name] = set(copied)
            memo[id(table)] = copied
        for name, owner in _HOOK_FLAGS.items():
            table = module.__dict__.get(name)
            if table is not None:
                memo[id(table)] = type(table)((k, v) for k, v in table.items() if k in kept.get(owner, ()))
    return memo


def with_nsa(model: nn.Module, **changes: Any) -> nn.Module:
    """A deep copy of ``model`` (no gradients, none of nsa-diag's hooks) whose every `NSAAttention` runs with
    the NSA config fields ``changes`` (``sel_backend="reference"``, ...). ValueError for an invalid value."""
    variant = copy.deepcopy(model, _without_our_hooks(model))
    for param in variant.parameters():
        param.grad = None
    for module in nsa_modules(variant):
        nsa = dataclasses.replace(module.nsa, **changes)
        module.cfg, module.nsa = dataclasses.replace(module.cfg, nsa=nsa), nsa
    return variant
