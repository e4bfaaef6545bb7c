"""Small pieces shared by the batched NSA backends: masked softmax, GQA views, argument checks."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def eager_under_compile(fn: F) -> F:
    """``fn``, which torch.compile runs as it is, between two graphs (a graph break), rather than tracing
    it; an eager call costs one check more. For the functions that launch our Triton kernels: traced, the
    kernels become the graph's user-defined Triton kernels, which inductor compiles again with a launch
    signature of its own (a Python float argument becomes fp64 there), and ours are not written for it."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return untraced(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@torch.compiler.disable
def untraced(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` where torch.compile does not trace it (`eager_under_compile`)."""
    return fn(*args, **kwargs)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Scores of half-precision inputs are normalised in float32; float32/float64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over ``dim`` restricted to ``mask``; rows with no allowed entry are all zeros (never NaN)."""
    scores = upcast(scores).masked_fill(~mask, float("-inf"))
    if scores.shape[dim] == 0:
        return scores
    # the row max is detached: softmax is shift-invariant, and an all-masked row gets 0 instead of -inf
    row_max = scores.detach().amax(dim=dim, keepdim=True).nan_to_num(0.0, neginf=0.0)
    weights = torch.exp(scores - row_max)
    return weights / weights.sum(dim=dim, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, T, HQ, D] -> [B, T, HKV, G, D]``: the query heads of each KV group side by side."""
    B, T, HQ, D = q.shape
    return q.view(B, T, kv_heads, HQ // kv_heads, D)


def check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, *, raw_keys: bool = True
) -> None:
    """Check the contract: ``q [B, Tq, HQ, D]``, ``k/v [B, Tk, HKV, D]`` with ``Tk = q_offset + Tq``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of KV heads {k.shape[2]}")
    if q_offset < 0:
        raise ValueError(f"q_offset={q_offset} must be >= 0")
    if raw_keys and k.shape[1] != q_offset + q.shape[1]:
        raise ValueError(
            f"keys must cover positions 0 .. q_offset + Tq - 1: got Tk={k.shape[1]}, "
            f"q_offset={q_offset}, Tq={q.shape[1]}"
        )


def triton_op(module: str, name: str) -> Any:
    """``nsa_core.ops.triton.<module>.<name>``, imported on first use so that nsa_core runs without Triton."""
    try:
        return getattr(importlib.import_module(f"nsa_core.ops.triton.{module}"), name)
    except ImportError as error:
        raise NotImplementedError(
            f"the 'triton' backends need the triton package ({error}); install triton (it comes with CUDA "
            "builds of torch) or pick another backend, e.g. sel_backend='gather', cmp_backend='masked', "
            "win_backend='chunked'"
        ) from error
