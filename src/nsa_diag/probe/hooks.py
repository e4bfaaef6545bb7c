"""Progress hooks on a model's layers and NSA branches: the one mechanism that reports "step 5, backward,
layers.7" for our cases (`nsa_diag.worker`) and for a user's own job (`nsa_diag.probe`).

Imports only the standard library and torch (nsa_core only when the model holds NSA modules): a user's
process loads this through the probe, and must not pay for typer, rich or pydantic.

Events go to a `ProgressSink` (the worker's `nsa_diag.worker.probes.Progress`; the probe's own sink in a
user's process): ``event(phase, event, layer=, branch=, module=)``, and the phase of a forward now
(``forward``, or ``recompute`` inside backward) and of a backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.hooks import RemovableHandle


class ProgressSink(Protocol):
    """Where the hooks' events go (`nsa_diag.worker.probes.Progress` is one)."""

    @property
    def forward_phase(self) -> str: ...

    @property
    def backward_phase(self) -> str: ...

    def event(
        self,
        phase: str,
        event: str | None = None,
        *,
        layer: int | None = None,
        branch: str | None = None,
        module: str | None = None,
        **extra: Any,
    ) -> int: ...


# Where models keep their layers, tried in this order (``--layers-attr NAME`` names another): Llama-style
# and nsa-diag's own test models, Hugging Face decoders (LlamaForCausalLM), GPT-2, BERT encoders, TinyLM.
LAYER_LAYOUTS = ("layers", "model.layers", "transformer.h", "encoder.layer", "blocks")


def _attribute(model: nn.Module, path: str) -> Any:
    found: Any = model
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def find_blocks(model: nn.Module, layers_attr: str | None = None) -> tuple[str, nn.ModuleList]:
    """The model's layers: the `nn.ModuleList` (or `nn.Sequential`) at ``layers_attr``, or at the first of
    `LAYER_LAYOUTS` the model has; layer i is its i-th child. ValueError saying what was tried."""
    from torch import nn

    tried = (layers_attr,) if layers_attr else LAYER_LAYOUTS
    for path in tried:
        found = _attribute(model, path)
        if isinstance(found, nn.ModuleList | nn.Sequential) and len(found):
            return path, found  # type: ignore[return-value]
        if layers_attr and found is not None:
            raise ValueError(
                f"--layers-attr {layers_attr}: {type(model).__name__}.{layers_attr} is a "
                f"{type(found).__name__}, not a non-empty nn.ModuleList of layers"
            )
    if layers_attr:
        raise ValueError(
            f"--layers-attr {layers_attr}: {type(model).__name__} has no attribute {layers_attr}"
        )
    raise ValueError(
        f"{type(model).__name__} keeps its layers in none of {', '.join(LAYER_LAYOUTS)} (an nn.ModuleList): "
        "name the list with --layers-attr NAME (nsa-diag reports progress and injects faults per layer)"
    )


def nsa_attentions(block: nn.Module) -> list[tuple[str, Any]]:
    """The `nsa_core.NSAAttention` modules inside ``block`` with their names relative to it."""
    from nsa_core import NSAAttention

    return [(name, m) for name, m in block.named_modules() if isinstance(m, NSAAttention)]


def attach_progress(
    model: nn.Module, progress: ProgressSink, layers_attr: str | None = None
) -> list[RemovableHandle]:
    """Progress hooks on every block (forward begin/end, backward begin/end) and on every NSA branch.

    Branch forward begins at the forward pre-hook of ``attn.kv_<branch>`` and ends at the forward hook of
    ``attn.branch_out[branch]``; branch backward begins at the backward pre-hook of ``branch_out[branch]``
    and ends at the backward hook of ``kv_<branch>``. Only branches the layer computes are hooked.
    """
    prefix, blocks = find_blocks(model, layers_attr)
    handles: list[RemovableHandle] = []
    for layer, block in enumerate(blocks):
        name = f"{prefix}.{layer}" if prefix else str(layer)
        handles += _block_hooks(block, layer, name, progress)
        for rel, attn in nsa_attentions(block):
            for branch in attn.nsa.branches:
                base = f"{name}.{rel}" if rel else name
                handles += _branch_hooks(attn, branch, layer, base, progress)
    return handles


def _block_hooks(block: nn.Module, layer: int, name: str, progress: ProgressSink) -> list[RemovableHandle]:
    def forward_begin(module: nn.Module, args: Any) -> None:
        progress.event(progress.forward_phase, "begin", layer=layer, module=name)

    def forward_end(module: nn.Module, args: Any, output: Any) -> None:
        progress.event(progress.forward_phase, "end", layer=layer, module=name)

    def backward_begin(module: nn.Module, grad_output: Any) -> None:
        progress.event(progress.backward_phase, "begin", layer=layer, module=name)

    def backward_end(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        progress.event(progress.backward_phase, "end", layer=layer, module=name)

    return [
        block.register_forward_pre_hook(forward_begin),
        block.register_forward_hook(forward_end),
        block.register_full_backward_pre_hook(backward_begin),
        block.register_full_backward_hook(backward_end),
    ]


def _branch_hooks(
    attn: Any, branch: str, layer: int, base: str, progress: ProgressSink
) -> list[RemovableHandle]:
    kv, tap = getattr(attn, f"kv_{branch}"), attn.branch_out[branch]
    kv_name, tap_name = f"{base}.kv_{branch}", f"{base}.branch_out.{branch}"

    def forward_begin(module: nn.Module, args: Any) -> None:
        progress.event(progress.forward_phase, "begin", layer=layer, branch=branch, module=kv_name)

    def forward_end(module: nn.Module, args: Any, output: Any) -> None:
        progress.event(progress.forward_phase, "end", layer=layer, branch=branch, module=tap_name)

    def backward_begin(module: nn.Module, grad_output: Any) -> None:
        progress.event(progress.backward_phase, "begin", layer=layer, branch=branch, module=tap_name)

    def backward_end(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        progress.event(progress.backward_phase, "end", layer=layer, branch=branch, module=kv_name)

    return [
        kv.register_forward_pre_hook(forward_begin),
        tap.register_forward_hook(forward_end),
        tap.register_full_backward_pre_hook(backward_begin),
        kv.register_full_backward_hook(backward_end),
    ]
