"""torch's DistributedDataParallel errors in one line: what happened, to which parameters, and the fix.

Pure and standard library only: `nsa_diag.worker.ddp` explains the exception of one of our own ranks with
it, `nsa_diag.launchers.job` the exception a rank of a user's job printed on its stderr.

DDP's reducer names a parameter by its index among the parameters it reduces; `names` maps the indices
back: the parameters' names in DDP's own order, which is ``named_parameters()``'s order keeping those that
require a gradient and are not ignored (torch 2.13's ``DistributedDataParallel._build_params_for_reducer``;
the probe records it for every DDP model a watched job builds, ``ddp_params`` in its ``probe.json``). With
``TORCH_DISTRIBUTED_DEBUG=INFO`` or ``DETAIL`` torch prints the names itself, and recent torch names a
parameter marked ready twice; where neither is known a parameter reads ``#<index>``.

The messages, as torch 2.13's reducer words them (first match wins; the graph-changed one begins with the
unfinished-reduction one's words):

- ``... your training graph has changed in this iteration ...`` (static_graph=True) -> static-graph-changed
- ``Expected to have finished reduction in the prior iteration before starting a new one.`` with
  ``Parameter indices which did not receive grad for rank 0: 20 21`` (and, in debug mode,
  ``Parameters which did not receive grad for rank 0: aux_head.bias, aux_head.weight``) -> unused-parameters
- ``Expected to mark a variable ready only once.`` with ``Parameter at index 19 [with name
  layers.2.mlp.2.bias] has been marked as ready twice`` -> marked-ready-twice; a frame of
  ``torch/utils/checkpoint.py`` in ``backward`` on the traceback shows reentrant activation checkpointing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from nsa_diag.records import DdpErrorInfo

_GRAPH_CHANGED = re.compile(r"training graph has changed", re.IGNORECASE)
_UNFINISHED = re.compile(r"Expected to have finished reduction in the prior iteration")
_FIND_UNUSED_ON = re.compile(r"Since `find_unused_parameters=True` is enabled")
_READY_TWICE = re.compile(r"mark(?:ed)? (?:a variable )?(?:as )?ready (?:only once|twice)", re.IGNORECASE)
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+):[ \t]*([\d \t]+)")
_NAMES = re.compile(r"Parameters which did not receive grad for rank (\d+):[ \t]*([^\n]+)")
_AT_INDEX = re.compile(r"Parameter at index (\d+)(?: with name ([\w.]+))?")
# torch.utils.checkpoint's reentrant Function runs a backward of its own inside the outer one.
_REENTRANT_FRAME = re.compile(r"utils/checkpoint\.py\", line \d+, in backward")
SHOWN_PARAMS = 4  # names in the one-line explanation; CaseResult.missing_grads keeps them all

KINDS = ("unused-parameters", "marked-ready-twice", "static-graph-changed")


@dataclass(frozen=True)
class DdpError:
    """One of DDP's own errors, explained. ``params``: the parameters it names (names where known,
    ``#<index>`` where not); ``ranks``: the ranks the message speaks for ("... for rank 1")."""

    kind: str  # one of KINDS
    params: tuple[str, ...]
    cause: str
    fix: str
    ranks: tuple[int, ...] = field(default=())

    @property
    def explanation(self) -> str:
        return f"DDP: {self.cause}; fix: {self.fix}"

    def info(self) -> DdpErrorInfo:
        """The record a rank's report and the case's evidence keep (``ddp_error``)."""
        return DdpErrorInfo(kind=self.kind, params=list(self.params), explanation=self.explanation)


def _name(index: int, names: Sequence[str]) -> str:
    return names[index] if index < len(names) else f"#{index}"


def _params(message: str, names: Sequence[str]) -> tuple[list[str], list[int]]:
    """The parameters ``message`` names, in DDP's index order where ``names`` maps every index given
    (torch's own names otherwise), and the ranks it speaks for."""
    listed = _NAMES.findall(message)  # debug mode: torch's own names
    numbered = _INDICES.findall(message)
    ranks = sorted({int(rank) for rank, _ in [*listed, *numbered]})
    indices = [int(i) for _, text in numbered for i in text.split()]
    if indices and (all(i < len(names) for i in indices) or not listed):
        params = [_name(i, names) for i in indices]
    else:
        params = [n.strip().lstrip(".") for _, text in listed for n in text.split(",") if n.strip()]
    for index, name in _AT_INDEX.findall(message):
        params.append(name.lstrip(".") if name else _name(int(index), names))
    return list(dict.fromkeys(params)), ranks


def _named(params: Sequence[str], one: str, several: str) -> str:
    if not params:
        return f"{several} (not named in the message)"
    shown = ", ".join(params[:SHOWN_PARAMS])
    if len(params) > SHOWN_PARAMS:
        shown += f" ... ({len(params)} in all)"
    if any(p.startswith("#") for p in params):  # DDP's indices that no recorded order maps
        shown += " (DDP's indices: TORCH_DISTRIBUTED_DEBUG=INFO prints names)"
    return f"{one if len(params) == 1 else several} {shown}"


def explain_ddp_error(
    message: str,
    names: Sequence[str] = (),
    *,
    traceback: str = "",
    find_unused: bool | None = None,
    cli: bool = False,
) -> DdpError | None:
    """DDP's own error ``message`` explained (None when it is not one of DDP's).

    ``names``: the parameters in DDP's index order (module docstring); ``traceback``: the exception's
    traceback (reentrant checkpointing shows in it); ``find_unused``: the model's find_unused_parameters,
    where known; ``cli``: the fix names `nsa-diag ddp`'s flags too (our own worker's case).
    """
    params, ranks = _params(message, names)

    def flag(text: str) -> str:
        return f" ({text})" if cli else ""

    if _GRAPH_CHANGED.search(message):
        cause = "the set of parameters used changed between iterations under static_graph=True"
        if params:
            cause += f" ({', '.join(params[:SHOWN_PARAMS])})"
        fix = "drop static_graph and pass find_unused_parameters=True" + flag("nsa-diag ddp --find-unused")
        return DdpError("static-graph-changed", tuple(params), cause, fix, tuple(ranks))
    if _UNFINISHED.search(message):
        who = _named(params, "parameter", "parameters")
        if _FIND_UNUSED_ON.search(message):
            cause = (
                f"{who} got no gradient in the previous iteration although find_unused_parameters=True: "
                "an output of forward that depends on them never reached the loss (DDP finds unused "
                "parameters from forward's outputs)"
            )
            fix = "make every output of forward take part in the loss, or do not return the unused ones"
        else:
            cause = f"{who} got no gradient in the previous iteration, so their bucket was never reduced"
            fix = (
                "find_unused_parameters=True in DistributedDataParallel(...)"
                + flag("nsa-diag ddp --find-unused")
                + ", or static_graph=True if the same parameters go unused at every step"
                + flag("--static-graph")
                + ", or make them take part in the loss"
            )
        return DdpError("unused-parameters", tuple(params), cause, fix, tuple(ranks))
    if _READY_TWICE.search(message):
        who = _named(params, "parameter", "parameters")
        if _REENTRANT_FRAME.search(traceback) or _REENTRANT_FRAME.search(message):
            why = "reentrant activation checkpointing (torch.utils.checkpoint with use_reentrant=True) "
            if find_unused:
                why += (
                    "runs the checkpointed forward without autograd, so find_unused_parameters=True took its "
                    "parameters for unused and marked them ready after forward, and the recompute in "
                    "backward marked them again"
                )
            elif find_unused is False:
                why += (
                    "runs one backward per checkpointed call, and a parameter used in several of them (a "
                    "module checkpointed twice, shared weights) is marked ready in each"
                )
            else:
                why += (
                    "marks the checkpointed parameters ready again in its recompute: under "
                    "find_unused_parameters=True (which cannot see into the checkpoint and marks them after "
                    "forward), or when a module is checkpointed twice (shared weights)"
                )
        else:
            why = (
                "a parameter used outside forward or in several backward passes of one iteration, or "
                "reentrant activation checkpointing (use_reentrant=True), fires its gradient hook twice"
            )
        cause = f"{who} marked ready twice in one backward: {why}"
        fix = (
            "non-reentrant checkpointing (torch.utils.checkpoint(..., use_reentrant=False)"
            + flag("--gc without --gc-reentrant")
            + "), or static_graph=True in DistributedDataParallel(...) if the graph never changes"
            + flag("--static-graph")
        )
        if find_unused:
            fix += ", or find_unused_parameters=False if no parameter is really unused"
        return DdpError("marked-ready-twice", tuple(params), cause, fix, tuple(ranks))
    return None
