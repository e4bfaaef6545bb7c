"""The model of a case and the contract nsa-diag holds it to: the built-in `nsa_core.TinyLM`, or the user's
``--model pkg.module:factory``.

The contract for a user's model (also in ``nsa-diag run --help`` and the README):

- ``factory(spec) -> nn.Module``, or ``factory()`` (it then reads no option); model options reach the
  model only through the spec the factory reads (``spec.overrides``, ``spec.nsa_config()``);
- ``model(ids [B, S])`` returns logits ``[B, S, V]`` as a tensor, as the first element of a tuple or list,
  or as an object's ``.logits`` (Hugging Face ``CausalLMOutput``);
- the vocabulary V is what the model declares (``vocab_size``, ``config.vocab_size``, its input or output
  embedding, its only ``nn.Embedding``), else ``--vocab``, else its last module's ``out_features``
  (`vocab_of`);
- the layers are the ``nn.ModuleList`` at ``--layers-attr NAME``, at one of
  `nsa_diag.probe.hooks.LAYER_LAYOUTS`, or the longest list of same-type blocks a few attributes down
  (`nsa_diag.probe.hooks.find_blocks`).

A model that breaks it fails with `ContractError` naming what is wrong, before any training step.
`checkpoint_layers` is nsa-diag's own ``--gc`` for a model that is not a TinyLM (which checkpoints itself).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nsa_diag.spec import CaseSpec
from nsa_diag.worker.nsa_variant import nsa_idle_parameters
from nsa_diag.worker.outcome import CaseFailed, LoadedModel
from nsa_diag.worker.probes import find_blocks, nsa_attentions

if TYPE_CHECKING:
    import torch
    from torch import nn


class ContractError(CaseFailed):
    """The model breaks the contract (the factory raised, the output or the vocabulary is not usable)."""

    def __init__(self, reason: str) -> None:
        super().__init__("error", reason)


def load_factory(ref: str) -> Callable[[CaseSpec], Any]:
    """``"pkg.module:factory"`` -> the factory; ContractError saying what could not be imported.

    The worker starts with the working directory off ``sys.path`` (``-P``); a ``--model`` module is the
    user's own code, imported from there as they expect, so it is put first on the path for this alone.
    """
    module_name, _, attr = ref.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ContractError(f"model {ref}: cannot import {module_name}: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ContractError(f"model {ref}: {module_name} has no callable {attr!r}")
    if _takes_nothing(factory):  # `def make_model():`, or a model class whose __init__ takes no parameter
        return lambda spec: factory()
    return factory


def _takes_nothing(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` is called with no argument: it has no parameter that could take the spec."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin or C extension: called with the spec, as documented
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return not any(p.kind in positional or p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


def vocab_of(model: nn.Module, answer: int | None = None) -> tuple[int, str]:
    """The vocabulary size of a user's model and where it came from; ContractError when nothing says it.

    What the model declares comes first: ``vocab_size``, ``config.vocab_size``, a TinyLM's ``cfg.vocab``,
    ``get_input_embeddings()``, ``get_output_embeddings()``, the model's only ``nn.Embedding``. Then
    ``answer`` (``--vocab``: the user's word for it), and last a guess: the ``out_features`` of the model's
    last module (its head, for a head-last model). A declared size that differs from the answer is
    returned as it is, for the command to refuse the answer.
    """
    declared = _declared_vocab(model)
    if declared is not None:
        return declared
    if answer is not None:
        return answer, "--vocab"
    name, last = list(model.named_modules())[-1]
    out_features = getattr(last, "out_features", None)
    if name and _size(out_features):
        return out_features, f"{name}.out_features (the last module)"
    embeddings = _embeddings(model)
    have = (
        f"{len(embeddings)} nn.Embedding ({', '.join(f'{n} {e.num_embeddings}' for n, e in embeddings[:4])})"
        if embeddings
        else "no nn.Embedding"
    )
    raise ContractError(
        f"{type(model).__name__}: no vocabulary size: it has no vocab_size (nor config.vocab_size, "
        f"get_input_embeddings(), get_output_embeddings()), {have}, and its last module "
        f"({name or 'the model'}: {type(last).__name__}) has no out_features: pass --vocab N (nsa-diag draws "
        "token ids below it)"
    )


def _size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _embeddings(model: nn.Module) -> list[tuple[str, nn.Embedding]]:
    from torch import nn

    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Embedding)]


def _rows(module: Any) -> int | None:
    """The first dimension of a module's 2-D weight (an embedding's or an output projection's rows)."""
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None


def _declared_vocab(model: nn.Module) -> tuple[int, str] | None:
    """The vocabulary size as the model itself says it (`vocab_of`'s first sources), or None."""
    tinylm_vocab = getattr(model, "cfg", None).vocab if is_self_checkpointing(model) else None  # type: ignore[union-attr]
    for where, value in (
        ("vocab_size", getattr(model, "vocab_size", None)),
        ("config.vocab_size", getattr(getattr(model, "config", None), "vocab_size", None)),
        ("cfg.vocab", tinylm_vocab),  # an nsa_core.TinyLM (or subclass)
    ):
        if _size(value):
            return value, where
    for method in ("get_input_embeddings", "get_output_embeddings"):  # what it says it uses (Hugging Face's)
        get = getattr(model, method, None)
        rows = _rows(get()) if callable(get) else None
        if rows:
            return rows, f"{method}()"
    embeddings = _embeddings(model)
    if len(embeddings) == 1:
        name, embedding = embeddings[0]
        return embedding.num_embeddings, f"{name} (the only nn.Embedding)"
    return None


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: a tensor, the first element of a tuple or list, or ``.logits``."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise ContractError(
        f"the model returned {type(output).__name__}: expected logits [B, S, V] as a tensor, the first "
        "element of a tuple or list, or an object's .logits"
    )


def check_logits(logits: torch.Tensor, batch: int, seq_len: int, vocab: int) -> None:
    """ContractError unless ``logits`` is ``[batch, seq_len, vocab]`` of a floating dtype."""
    want = (batch, seq_len, vocab)
    if tuple(logits.shape) != want or not logits.is_floating_point():
        raise ContractError(
            f"the model's logits are {list(logits.shape)} {str(logits.dtype).removeprefix('torch.')}: "
            f"expected [B, S, V] = {list(want)} floating point (V: the vocabulary size)"
        )


def is_self_checkpointing(model: nn.Module) -> bool:
    """An `nsa_core.TinyLM` (or subclass) checkpoints its own layers by its config's ``gc``."""
    import nsa_core

    return isinstance(model, nsa_core.TinyLM)


def checkpoint_layers(blocks: nn.ModuleList, layers: range, reentrant: bool) -> None:
    """Run ``blocks[i]`` for i in ``layers`` under `torch.utils.checkpoint` whenever gradients are on.

    The layer keeps its name, class and parameters (its class becomes a subclass whose ``__call__``
    checkpoints): the checkpointed function is the layer's own ``__call__``, so its hooks (progress,
    faults) run again in the recompute, as with `nsa_core.TinyLM`'s checkpointing.
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    for index in layers:
        layer = blocks[index]
        cls = type(layer)
        call = cls.__call__

        def checkpointed(self: nn.Module, *args: Any, _call: Any = call, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _call(self, *args, **kwargs)
            if reentrant:  # reentrant checkpointing takes no keyword arguments: bound to the function
                return checkpoint(functools.partial(_call, self, **kwargs), *args, use_reentrant=True)
            return checkpoint(_call, self, *args, use_reentrant=False, **kwargs)

        layer.__class__ = type(cls.__name__, (cls,), {"__call__": checkpointed, "__module__": cls.__module__})


def build_model(spec: CaseSpec, device: torch.device) -> LoadedModel:
    """The built-in `nsa_core.TinyLM` of the spec's config, or the user's ``factory(spec)`` held to the
    contract (its layers under nsa-diag's ``--gc`` unless it checkpoints itself)."""
    import torch
    from torch import nn

    torch.manual_seed(spec.seed)
    if spec.model is None:
        import nsa_core

        cfg = spec.nsa_config()
        model: nn.Module = nsa_core.TinyLM(cfg)
        vocab, idle = cfg.vocab, model.idle_parameter_names()
        prefix, blocks = find_blocks(model)
        return LoadedModel(model.to(device), prefix, blocks, vocab, idle, cfg, "cfg.vocab")
    factory = load_factory(spec.model)
    try:
        model = factory(spec)
    except Exception as exc:
        raise ContractError(f"model {spec.model}: the factory raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ContractError(f"model {spec.model} returned {type(model).__name__}, not an nn.Module")
    vocab, vocab_from = vocab_of(model, spec.overrides.get("vocab"))
    idle_names = getattr(model, "idle_parameter_names", None)
    own = list(idle_names()) if callable(idle_names) else []
    idle = list(dict.fromkeys(own + nsa_idle_parameters(model)))  # force_branch leaves these untrained
    try:
        prefix, blocks = find_blocks(model, spec.layers_attr)
    except ValueError as exc:
        raise ContractError(f"model {spec.model}: {exc}") from None
    if not is_self_checkpointing(model):
        gc, reentrant = str(spec.overrides.get("gc", "none")), bool(spec.overrides.get("gc_reentrant"))
        checkpoint_layers(blocks, parse_layers(gc, len(blocks)), reentrant)
    return LoadedModel(model.to(device), prefix, blocks, vocab, idle, None, vocab_from)


def parse_layers(gc: str, layers: int) -> range:
    """``--gc`` over a model of ``layers`` layers; ContractError when the range is not in it."""
    from nsa_core.config import parse_gc

    try:
        return parse_gc(gc, layers)
    except ValueError as exc:
        raise ContractError(f"--gc {gc}: {exc}") from None


def nsa_settings(model: nn.Module, blocks: nn.ModuleList) -> tuple[list[int], dict[str, list[Any]]]:
    """The layers holding `nsa_core.NSAAttention` modules, and each NSA field's values across them."""
    import dataclasses

    from nsa_core import NSAAttention

    layers = [i for i, block in enumerate(blocks) if nsa_attentions(block)]
    values: dict[str, list[Any]] = {}
    for module in model.modules():
        if isinstance(module, NSAAttention):
            for key, value in dataclasses.asdict(module.nsa).items():
                if value not in values.setdefault(key, []):
                    values[key].append(value)
            for key in ("dim", "heads", "kv_heads", "head_dim"):
                value = getattr(module.cfg, key)
                if value not in values.setdefault(key, []):
                    values[key].append(value)
    return layers, values
