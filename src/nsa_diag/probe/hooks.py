"""Progress hooks on a model's layers and NSA branches: the one mechanism that reports "step 5, backward,
layers.7" for our cases (`nsa_diag.worker`) and for a user's own job (`nsa_diag.probe`).

Imports only the standard library and torch (nsa_core only when the model holds NSA modules): a user's
process loads this through the probe, and must not pay for typer, rich or pydantic.

Events go to a `ProgressSink` (the worker's `nsa_diag.worker.probes.Progress`; the probe's own sink in a
user's process): ``event(phase, event, layer=, branch=, module=)``, and the phase of a forward now
(``forward``, or ``recompute`` inside backward) and of a backward.

Backward events come from hooks on the autograd graph itself, installed by a forward hook each time the
module runs with gradients (`on_backward`): a pre-hook on the node that made the module's output (its
backward begins) and a hook on the module's input gradient (its backward ends). Full module backward hooks
(``register_full_backward_hook``) would give the same places, but they wrap every input and output in a
Python autograd Function: two more graph nodes, a view per tensor, and Python in the backward pass per
hooked module (168 nodes a step for a 12-layer NSA model; with a line written per event, the probe cost
+7 to +19% of an H100 step). Graph hooks add no node, no op and no view: the step computes exactly what it
computes without them (`benchmarks/probe_overhead.py` measures what is left).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
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
# Then any nn.ModuleList of same-type blocks this many attributes down or less: the model itself (a name
# of its own, ``model.stack``), wrapped once (``Wrapper.net.layers``) or twice (``Wrapper.lm.model.layers``).
DISCOVERY_DEPTH = 3
CANDIDATES_SHOWN = 6  # an ambiguous model's lists named in its one-line refusal


def _attribute(model: nn.Module, path: str) -> Any:
    found: Any = model
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def layer_lists(model: nn.Module, depth: int = DISCOVERY_DEPTH) -> list[tuple[str, nn.ModuleList]]:
    """Every non-empty `nn.ModuleList` at most ``depth`` attributes below ``model`` whose children are all
    of one type, in module order. Lists inside another `nn.ModuleList` are left out: those are parts of a
    layer (a block's heads or experts), not the layers."""
    from torch import nn

    found: list[tuple[str, nn.ModuleList]] = []

    def visit(module: nn.Module, path: str, level: int) -> None:
        for name, child in module.named_children():
            where = f"{path}.{name}" if path else name
            if isinstance(child, nn.ModuleList):
                if len(child) and len({type(block) for block in child}) == 1:
                    found.append((where, child))
            elif level < depth:
                visit(child, where, level + 1)

    visit(model, "", 1)
    return found


def find_blocks(model: nn.Module, layers_attr: str | None = None) -> tuple[str, nn.ModuleList]:
    """The model's layers and where they are: the `nn.ModuleList` (or `nn.Sequential`) at ``layers_attr``,
    else at the first of `LAYER_LAYOUTS` the model has, else the longest of its `layer_lists` (the model
    wrapped in another module, a layer list of its own name). Layer i is the list's i-th child. ValueError
    in one line saying what was tried, or which lists tie when the longest is not one."""
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
    lists = layer_lists(model)
    longest = max((len(blocks) for _, blocks in lists), default=0)
    tied = [(path, blocks) for path, blocks in lists if len(blocks) == longest]
    if len(tied) == 1:
        return tied[0]
    name = type(model).__name__
    if tied:
        shown = ", ".join(f"{path} ({len(b)} x {type(b[0]).__name__})" for path, b in tied[:CANDIDATES_SHOWN])
        more = f" and {len(tied) - CANDIDATES_SHOWN} more" if len(tied) > CANDIDATES_SHOWN else ""
        raise ValueError(
            f"{name} has {len(tied)} lists of layers of the same length, and nsa-diag cannot tell which are "
            f"its layers: {shown}{more}: name one with --layers-attr NAME"
        )
    raise ValueError(
        f"{name} keeps its layers in none of {', '.join(LAYER_LAYOUTS)}, and has no nn.ModuleList of "
        f"same-type blocks up to {DISCOVERY_DEPTH} attributes down: name the list with --layers-attr NAME "
        "(nsa-diag reports progress and injects faults per layer)"
    )


def nsa_attentions(block: nn.Module) -> list[tuple[str, Any]]:
    """The `nsa_core.NSAAttention` modules inside ``block`` with their names relative to it.

    A model holding one has imported nsa_core; in a process that has not (a user's job under the probe),
    there is none, and nsa_core is not imported for nothing."""
    if "nsa_core" not in sys.modules:
        return []
    from nsa_core import NSAAttention

    return [(name, m) for name, m in block.named_modules() if isinstance(m, NSAAttention)]


def attach_progress(
    model: nn.Module, progress: ProgressSink, layers_attr: str | None = None, *, branches: bool = False
) -> list[RemovableHandle]:
    """Progress hooks on every block: forward begin/end, backward begin/end; with ``branches``, also a mark
    per NSA branch where its backward begins.

    Where the layer runs the fused op (`NSAAttention.runs_fused`: the three branches on Triton), the mark is
    the op's own branch hook, called as the op's backward starts the branch's kernels (selection, window,
    then compression); where it composes the branches, a pre-hook on the node that made
    ``attn.branch_out[branch]``'s output (the branch's attention). Either way its place lasts until the
    next event (the next branch's mark, or the block's backward end).
    Only branches the layer computes are marked. Marks cost as much as the blocks' own events (measured on
    an m7c-125m step that the host bounds, `benchmarks/probe_overhead.py`), so they are asked for
    (``--branch-marks``); ends per branch, and marks in forward, would double that again for little: in
    backward only the branch's key/value projection runs between its end and the next mark, and a hang in
    forward is placed by the block and a stack sample. Removing the handles stops all of it (graph hooks
    already installed on a step in flight still fire for that step).
    """
    prefix, blocks = find_blocks(model, layers_attr)
    handles: list[RemovableHandle] = []
    for layer, block in enumerate(blocks):
        name = f"{prefix}.{layer}" if prefix else str(layer)
        handles += _block_hooks(block, layer, name, progress)
        for rel, attn in nsa_attentions(block) if branches else ():
            base = f"{name}.{rel}" if rel else name
            handles.append(_fused_branch_hook(attn, layer, base, progress))
            for branch in attn.nsa.branches:
                handles += _branch_hooks(attn, branch, layer, base, progress)
    return handles


def tracing() -> Callable[[], bool]:
    """``torch.compiler.is_compiling``: True while Dynamo traces. A hook that returns at once then is traced
    as nothing, so it breaks no graph; a compiled region's progress comes from around it (steps, the
    compiler, the optimizer) and its place from stack samples. Never True where torch has no compiler."""
    import torch

    compiler = getattr(torch, "compiler", None)
    return getattr(compiler, "is_compiling", None) or (lambda: False)


def _block_hooks(block: nn.Module, layer: int, name: str, progress: ProgressSink) -> list[RemovableHandle]:
    compiling = tracing()

    def forward_begin(module: nn.Module, args: Any) -> None:
        if compiling():
            return
        progress.event(progress.forward_phase, "begin", layer=layer, module=name)

    def forward_end(module: nn.Module) -> None:
        progress.event(progress.forward_phase, "end", layer=layer, module=name)

    def backward_begin(module: nn.Module, grad_outputs: Any) -> None:
        progress.event(progress.backward_phase, "begin", layer=layer, module=name)

    def backward_end(module: nn.Module) -> None:
        progress.event(progress.backward_phase, "end", layer=layer, module=name)

    return [
        block.register_forward_pre_hook(forward_begin),
        on_backward(block, begin=backward_begin, end=backward_end, forward_end=forward_end),
    ]


def _branch_hooks(
    attn: Any, branch: str, layer: int, base: str, progress: ProgressSink
) -> list[RemovableHandle]:
    tap_name = f"{base}.branch_out.{branch}"

    def backward_begin(module: nn.Module, grad_outputs: Any) -> None:
        progress.event(progress.backward_phase, "begin", layer=layer, branch=branch, module=tap_name)

    return [on_backward(attn.branch_out[branch], begin=backward_begin)]


def _fused_branch_hook(attn: Any, layer: int, base: str, progress: ProgressSink) -> RemovableHandle:
    # the fused op calls it on the host as each branch's kernels start; the composed path never does
    def mark(module: nn.Module, phase: str, branch: str | None) -> None:
        if phase == "backward" and branch is not None:
            tap_name = f"{base}.branch_out.{branch}"  # the same place as the composed path's tap
            progress.event(progress.backward_phase, "begin", layer=layer, branch=branch, module=tap_name)

    return attn.register_branch_hook(mark)


# ------------------------------------------------------------------------------- backward graph hooks

BackwardBegin = Callable[["nn.Module", tuple[Any, ...]], Any]
ModuleHook = Callable[["nn.Module"], None]
CONSUMER_SEARCH_DEPTH = 6  # nn.Linear on [B, T, C] is 3 nodes deep (unsafe view, mm, view); casts add one
CONSUMER_SEARCH_WIDTH = 16


def on_backward(
    module: nn.Module,
    begin: BackwardBegin | None = None,
    end: ModuleHook | None = None,
    *,
    input_shared: bool = False,
    forward_end: ModuleHook | None = None,
) -> RemovableHandle:
    """Call ``begin(module, grad_outputs)`` when ``module``'s backward begins and ``end(module)`` when it has
    computed its input's gradient: what ``register_full_backward_pre_hook`` / ``register_full_backward_hook``
    report, without their extra graph nodes. Returns the handle of the forward hook that installs them.

    Each forward with gradients installs, on that forward's graph: a pre-hook on the node that made the
    first output tensor requiring grad (a tensor, or the first in a tuple, list, dict or Hugging Face output
    object); ``begin`` may return replacement gradients for that node, as a backward pre-hook may. ``end``:

    - by default, a hook on the first input requiring grad (positional, then keyword) that fires when its
      gradient is complete: right for a layer whose input only it consumes. It fires only if this forward's
      ``begin`` point was reached, so the forward a non-reentrant checkpoint re-runs inside backward (whose
      graph is never differentiated) reports nothing twice; a reentrant checkpoint's re-run, whose graph is
      differentiated, reports as the old hooks did.
    - ``input_shared=True``: a hook after the node, within the module's own graph, that takes the input
      (found a few nodes deep; the output's node if not): right when other modules consume the same input.

    With no input requiring grad, ``end`` fires with ``begin``; so it does for a layer that returns its input
    as it is (its begin shares the previous layer's node, and comes right after that layer's begin). Hooks
    on this module registered later run after earlier ones at the same point (fault injection relies on it:
    the progress event comes first). ``forward_end(module)``, if given, is called first by the same forward
    hook, after every forward (one hook fewer per module and step than a forward hook of its own).
    """
    import torch

    tensor_type = torch.Tensor
    leaf_hook: list[RemovableHandle] = []  # the hook on a leaf input: such a tensor may come back next step
    compiling = tracing()

    def install(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if compiling():  # inside a graph torch.compile traces: nothing (`tracing`)
            return
        if forward_end is not None:
            forward_end(mod)
        out = output if isinstance(output, tensor_type) else requiring_grad(output, tensor_type)
        if out is None or not out.requires_grad or out.grad_fn is None:
            return
        node = out.grad_fn
        if end is None:
            node.register_prehook(lambda grads: begin(mod, grads))  # type: ignore[misc]
            return
        x = requiring_grad(args, tensor_type)
        if x is None:
            x = requiring_grad(kwargs, tensor_type)
        if x is not None and input_shared:
            if begin is not None:
                node.register_prehook(lambda grads: begin(mod, grads))
            (_consumer(node, x) or node).register_hook(lambda grad_inputs, grad_outputs: end(mod))
            return
        span = _Span(mod, begin, end)
        node.register_prehook(span.backward_begin)
        if x is None or x is out:  # no input gradient to wait for (or a layer passing its input on)
            span.ends_with_begin = True
        elif x.grad_fn is not None:  # a new tensor each forward: its hooks go with it
            x.register_hook(span.backward_end)
        else:  # a leaf outlives the step: keep one hook on it, not one per forward
            while leaf_hook:
                leaf_hook.pop().remove()
            leaf_hook.append(x.register_hook(span.backward_end))

    return module.register_forward_hook(install, with_kwargs=True)


class _Span:
    """One forward's backward: begins at a pre-hook on its output's node, ends at a hook on its input's
    gradient, but only once begun (see `on_backward`), or at once with the begin when no input needs one."""

    __slots__ = ("began", "begin", "end", "ends_with_begin", "module")

    def __init__(self, module: nn.Module, begin: BackwardBegin | None, end: ModuleHook) -> None:
        self.module, self.begin, self.end = module, begin, end
        self.began = self.ends_with_begin = False

    def backward_begin(self, grad_outputs: tuple[Any, ...]) -> Any:
        self.began = True
        replaced = self.begin(self.module, grad_outputs) if self.begin is not None else None
        if self.ends_with_begin:
            self.end(self.module)
        return replaced

    def backward_end(self, grad: Any) -> None:
        if self.began:
            self.began = False
            self.end(self.module)


def requiring_grad(value: Any, tensor_type: type, depth: int = 2) -> torch.Tensor | None:
    """The first tensor requiring grad in ``value``: a tensor, or one inside a tuple, list or dict (a
    Hugging Face output object is a dict) up to ``depth`` levels down."""
    if isinstance(value, tensor_type):
        return value if value.requires_grad else None  # type: ignore[return-value]
    if depth == 0:
        return None
    if isinstance(value, tuple | list):
        items: Any = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return None
    for item in items:
        found = requiring_grad(item, tensor_type, depth - 1)
        if found is not None:
            return found
    return None


def _consumer(node: Any, x: torch.Tensor) -> Any:
    """The node below ``node`` (breadth first, a few levels) that takes ``x`` as an input, or None."""
    target = x.grad_fn
    frontier = [node]
    for _ in range(CONSUMER_SEARCH_DEPTH):
        following = []
        for current in frontier:
            for fn, _ in current.next_functions:
                if fn is None:
                    continue
                if fn is target if target is not None else getattr(fn, "variable", None) is x:
                    return current
                following.append(fn)
        frontier = following[:CONSUMER_SEARCH_WIDTH]
    return None
