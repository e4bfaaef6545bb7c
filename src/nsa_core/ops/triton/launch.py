"""Kernel launches that skip Triton's per-launch binding once a kernel is compiled.

``kernel[grid](*args, **kwargs)`` on a `triton.JITFunction` binds the arguments to the kernel's signature,
specializes each of them (a tensor's dtype and 16-byte alignment, an integer's width, whether it is 1 or a
multiple of 16), builds the cache key of these and of the options (the ``str`` of a dict), looks the
compiled kernel up, checks the globals it read, and only then calls the compiled kernel's launcher. On
the host of an H200 machine that took 37-100 us a launch inside the m7c-125m step, 252 launches a step
(`benchmarks/step_host.py`): the step at 2k was bound by its host.

`Launcher` wraps a ``@triton.jit`` kernel and is launched the same way. The first launch of each key goes
through Triton (which compiles or finds the kernel and launches it); the launcher of the compiled kernel
it returns is kept under the key, and later launches with the same key call it directly. The key holds
everything Triton specializes on, and more where that is cheaper to compute:

- a tensor: its dtype and whether its address is a multiple of 16 bytes;
- an integer: whether it is 1, whether a multiple of 16, and its width (32 or 64 bits, signed or not);
- a float: only that it is one (Triton passes it as fp32);
- anything else (None, a bool, a constexpr's value, a ``num_warps`` option): its value;
- the current device;

so a launch never reuses a kernel compiled for a different specialization; a key Triton would not tell
apart costs one more pass through Triton. Launches go through Triton as before (every time) where the
fast path does not hold: under the interpreter (``TRITON_INTERPRET=1``), while Dynamo traces (torch.compile
then captures the kernel itself, as it does a plain `triton.JITFunction`), with a launch hook installed (a
profiler such as Proton's), with a pre-run hook on the kernel, with a grid given as a function, or where
an argument cannot be hashed. Triton's knobs read at launch (``TRITON_DEBUG``) are those of the key's
first launch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.compiler import is_compiling
from triton import knobs
from triton.runtime.jit import JITFunction

try:  # what Triton's CUDA driver calls for the current device and stream
    from torch._C import _cuda_getCurrentRawStream as _current_stream
    from torch._C import _cuda_getDevice as _current_device
except ImportError:  # a torch built without CUDA: the interpreter only
    _current_device = torch.cuda.current_device

    def _current_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream


_I32 = (-(2**31), 2**31 - 1)
_I64_MAX = 2**63 - 1


class Launcher:
    """A ``@triton.jit`` kernel launched as ``launcher[grid](*args, **kwargs)``, through Triton on the first
    launch of each specialization and straight to the compiled kernel after (see the module's docstring).

    ``kernel``: the wrapped `triton.JITFunction` (or the interpreter's function under
    ``TRITON_INTERPRET=1``, always launched through Triton).
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.direct = isinstance(kernel, JITFunction)
        self.__name__ = getattr(getattr(kernel, "fn", kernel), "__name__", type(kernel).__name__)
        # per key: the compiled kernel's launcher, its function handle and packed metadata
        self.compiled: dict[tuple, tuple[Callable, Any, Any]] = {}
        # per call form (positional count, keyword names): its binder, or None where it has none
        self._binders: dict[tuple, Callable | None] = {}
        if self.direct:
            self._names = list(kernel.arg_names)
            self._index = {name: i for i, name in enumerate(self._names)}
            self._constexprs = frozenset(kernel.constexprs)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return functools.partial(self.launch, grid)

    def launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """Launch the kernel over ``grid`` (one to three program counts) with its arguments and options."""
        if (
            not self.direct
            or is_compiling()  # Dynamo traces the kernel itself into its graph
            or callable(grid)
            or self.kernel.pre_run_hooks
            or not _launch_hooks_idle()
        ):
            self.kernel[grid](*args, **kwargs)
            return
        device = _current_device()
        form = (len(args), tuple(kwargs))
        binder = self._binders.get(form, _UNSEEN)
        if binder is _UNSEEN:
            binder = self._binders[form] = self._binder(args, kwargs)
        try:
            key, values = binder(device, args, kwargs) if binder is not None else (None, None)
        except (AttributeError, TypeError):  # an argument unlike the form's first: the generic key
            key = values = None
        try:
            if key is None:
                key = self.key(device, args, kwargs)
            entry = self.compiled.get(key)
        except TypeError:  # an argument that cannot be hashed: Triton's own path, every launch
            self.kernel[grid](*args, **kwargs)
            return
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            run, function = getattr(compiled, "run", None), getattr(compiled, "function", None)
            if run is not None and function is not None and hasattr(compiled, "packed_metadata"):
                self.compiled[key] = (run, function, compiled.packed_metadata)
            return
        if values is None:
            values = (*args, *(kwargs[name] for name in self._names[len(args) :]))
        run, function, packed = entry
        n = len(grid)
        stream = _current_stream(device)
        run(
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, function, packed,
            None, None, None, *values,
        )  # fmt: skip

    def key(self, device: int, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """The launch's cache key: the device, then what Triton specializes each argument on (or more),
        then each keyword's name and the same of its value; options (not the kernel's parameters) by
        value."""
        constexprs = self._constexprs
        key: list[Any] = [device]
        for i, value in enumerate(args):
            key.append(value if i in constexprs else _specialization(value))
        for name, value in kwargs.items():
            i = self._index.get(name)
            key.append(name)
            key.append(value if i is None or i in constexprs else _specialization(value))
        return tuple(key)

    def _binder(self, args: tuple, kwargs: dict[str, Any]) -> Callable | None:
        """``bind(device, args, kwargs) -> (key, values)`` for launches of this form: the same key as
        `key`, one expression an argument chosen by the kind of this launch's argument there (a tensor,
        an int, a float, a constexpr), and every parameter's value in the kernel's order. A later launch
        whose argument is of another kind raises AttributeError or TypeError in it (or takes
        `_specialization` there), and then takes `key`. None where a parameter is missing."""
        if any(name not in kwargs for name in self._names[len(args) :]):
            return None
        terms, names = ["device"], [f"a{i}" for i in range(len(args))]
        for i, value in enumerate(args):
            terms.append(_term(f"a{i}", value, i in self._constexprs))
        for j, (name, value) in enumerate(kwargs.items()):
            i = self._index.get(name)
            terms += [repr(name), _term(f"k{j}", value, i is None or i in self._constexprs)]
        keywords = {name: f"k{j}" for j, name in enumerate(kwargs)}
        values = names + [keywords[name] for name in self._names[len(args) :]]
        lines = ["def bind(device, args, kwargs):"]
        if args:
            lines.append(f"    {', '.join(names)}, = args")
        lines += [f"    k{j} = kwargs[{name!r}]" for j, name in enumerate(kwargs)]
        lines.append(f"    return ({', '.join(terms)},), ({', '.join(values)},)")
        scope = {"_specialization": _specialization, "_width": _width}
        exec("\n".join(lines), scope)
        return scope["bind"]


_UNSEEN = object()


def _term(name: str, value: Any, constexpr: bool) -> str:
    # the key's expression of one argument, in `_specialization`'s terms, for arguments of value's kind
    if constexpr:
        return name
    if isinstance(value, torch.Tensor):
        return f"({name}.dtype, {name}.data_ptr() % 16 == 0)"
    if value.__class__ is int:
        width = f"(32 if {_I32[0]} <= {name} <= {_I32[1]} else _width({name}))"
        spec = f"({width}, {name} == 1, {name} % 16 == 0)"
        return f"({spec} if {name}.__class__ is int else _specialization({name}))"
    if value.__class__ is float:
        return f"(float if {name}.__class__ is float else _specialization({name}))"
    return f"_specialization({name})"


def _specialization(value: Any) -> Any:
    # what Triton's specialization of a runtime argument depends on (see the module's docstring)
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    cls = value.__class__
    if cls is int:
        return _width(value), value == 1, value % 16 == 0
    if cls is float:
        return float
    return cls, value


def _width(value: int) -> int:
    return 32 if _I32[0] <= value <= _I32[1] else 64 if value <= _I64_MAX else 65


def _launch_hooks_idle() -> bool:
    # no launch hook installed: None up to Triton 3.6, an empty HookChain later
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or getattr(enter, "calls", None) == []) and (
        leave is None or getattr(leave, "calls", None) == []
    )
