"""Where the host's time in an m7c-125m training step goes, NSA against dense attention.

`model_step.py` shows NSA's step bound by its host at 2k on some machines (host 70-115 ms a step against
dense's 39-58), while on the CPU, with the Triton launches left out, one NSA layer's Python and torch ops
cost what a dense layer's do. This script measures the difference where it arises, on the GPU, for each
model of `model_step.py` (the same step: forward, cross-entropy, backward, AdamW):

- host and step time, medians of ``--steps`` (host: until the step returns; no step synchronises);
- NSA again with each Triton launch timed on the host (``Launcher.launch``: its key and the compiled
  kernel's launcher, `nsa_core.ops.triton.launch`), by kernel: calls a step and microseconds each;
- NSA again with every Triton launch made a no-op after the warm-up (``Launcher.launch`` replaced: the
  Python around the launches, the torch ops and the autograd engine stay; the kernels' work goes);
- a cProfile of ``--profiled`` steps, its own time per step grouped by where it is spent: Triton's
  launcher and `Launcher`, nsa_core's Python, the autograd engine (its C++ between Python calls, torch's
  backward ops included), torch ops called from Python, the optimizer, torch's Python (module calls), the
  rest;
- the Python garbage collections a step and their time.

    python benchmarks/step_host.py --seq-len 2048 --batch 8
    python benchmarks/step_host.py --device cpu --preset tiny --seq-len 64 --batch 1  # the script's check

On the CPU (``TRITON_INTERPRET=1``, a small preset) the figures say nothing of a GPU's host; that run only
checks the script.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

import nsa_core
from model_step import DenseAttention  # benchmarks/ is the script's folder
from nsa_core.ops.triton.launch import Launcher

# cProfile's entries by where their own time is spent: the first group whose test matches
GROUPS: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    ("autograd engine (C++)", lambda file, name: "run_backward" in name),
    (
        "Triton launcher",
        lambda file, name: "/triton/" in file and ("/nsa_core/" not in file or "/launch.py" in file),
    ),
    ("nsa_core Python", lambda file, name: "/nsa_core/" in file),
    ("optimizer", lambda file, name: "/torch/optim/" in file),
    ("torch ops from Python", lambda file, name: file == "~" and "torch" in name),
    ("torch Python (modules)", lambda file, name: "/torch/" in file),
    ("other", lambda file, name: True),
)


def group_of(file: str, name: str) -> str:
    return next(group for group, test in GROUPS if test(file, name))


@contextlib.contextmanager
def _triton_runs_replaced(replace: Callable[[Callable], Callable]) -> Iterator[None]:
    """Every Triton launch of nsa_core (``Launcher.launch``: its key, then the compiled kernel's launcher,
    or Triton's own launch on a key's first use) through ``replace(launch)``, put back after."""
    launch = Launcher.launch
    Launcher.launch = replace(launch)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Launcher.launch = launch  # type: ignore[method-assign]


def triton_launches_timed(
    seconds: collections.Counter[str], calls: collections.Counter[str]
) -> contextlib.AbstractContextManager[None]:
    """Every Triton launch timed on the host, by kernel name, into ``seconds`` and ``calls``."""

    def timed(launch: Callable) -> Callable:
        def timed_launch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            began = time.perf_counter()
            try:
                return launch(self, *args, **kwargs)
            finally:
                seconds[self.__name__] += time.perf_counter() - began
                calls[self.__name__] += 1

        return timed_launch

    return _triton_runs_replaced(timed)


def triton_launches_skipped() -> contextlib.AbstractContextManager[None]:
    """Every Triton kernel launch a no-op (compiled or interpreted)."""
    return _triton_runs_replaced(lambda launch: lambda self, *args, **kwargs: None)


class GcCount:
    """Garbage collections by generation and their time, while installed (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.count: collections.Counter[int] = collections.Counter()
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._start


def build(kind: str, preset: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    triton = dict(sel_backend="triton", cmp_backend="triton", win_backend="triton")
    cfg = nsa_core.preset(preset, **triton)
    model = nsa_core.TinyLM(cfg)
    if kind == "dense":
        for block in model.blocks:
            block.attn = DenseAttention(cfg)
    return model.to(device=device, dtype=dtype)


def measure(kind: str, args: argparse.Namespace, dtype: torch.dtype) -> collections.Counter[str]:
    """Print the host and step times (and NSA's without its Triton launches); return cProfile's groups."""
    cuda = args.device.startswith("cuda")
    torch.manual_seed(0)
    model = build(kind, args.preset, args.device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, model.cfg.vocab, (args.batch, args.seq_len + 1), device=args.device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step() -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed() -> tuple[float, float]:
        host, wall = [], []
        for _ in range(args.steps):
            sync()
            began = time.perf_counter()
            step()
            host.append(time.perf_counter() - began)
            sync()
            wall.append(time.perf_counter() - began)
        return statistics.median(host) * 1e3, statistics.median(wall) * 1e3

    for _ in range(3):
        step()
    sync()
    counter = GcCount()
    gc.callbacks.append(counter)
    try:
        host, wall = timed()
    finally:
        gc.callbacks.remove(counter)
    collected = ", ".join(f"gen{g} {n / args.steps:.2f}" for g, n in sorted(counter.count.items()))
    print(
        f"{kind:<6} host {host:7.1f} ms, step {wall:7.1f} ms; gc a step: {collected or 'none'}, "
        f"{counter.seconds / args.steps * 1e3:.2f} ms"
    )
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.profiled):
        step()
    profiler.disable()
    sync()
    groups: collections.Counter[str] = collections.Counter()
    for (file, _, name), row in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        groups[group_of(file, name)] += row[2] / args.profiled * 1e3  # own time, ms a step
    if kind == "nsa":
        seconds: collections.Counter[str] = collections.Counter()
        calls: collections.Counter[str] = collections.Counter()
        with triton_launches_timed(seconds, calls):
            host, wall = timed()
        inside = sum(seconds.values()) / args.steps * 1e3
        print(
            f"nsa, Triton launches timed: host {host:7.1f} ms, step {wall:7.1f} ms; {inside:.1f} ms a step "
            f"inside Triton's launches ({sum(calls.values()) / args.steps:.0f} a step):"
        )
        for name, total in seconds.most_common(args.kernels):
            per_call = total / calls[name] * 1e6
            print(f"  {name:<36} {calls[name] / args.steps:5.0f} a step {per_call:8.1f} us each")
        # last: the skipped kernels leave garbage in the weights' updates
        with triton_launches_skipped():
            host, wall = timed()
        print(f"nsa, Triton launches skipped: host {host:7.1f} ms, step {wall:7.1f} ms")
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profiled", type=int, default=3)
    parser.add_argument("--kernels", type=int, default=12, help="Triton kernels listed by their host time")
    parser.add_argument("--preset", default="m7c-125m", choices=list(nsa_core.PRESETS))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("benchmarks/step_host.py needs a CUDA device (or --device cpu to check the script)")
    dtype = torch.bfloat16 if cuda else torch.float32
    where = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{where}, torch {torch.__version__}, {args.preset}, S={args.seq_len} B={args.batch}")
    profiles = {}
    for kind in ("dense", "nsa"):
        profiles[kind] = measure(kind, args, dtype)
        if cuda:
            torch.cuda.empty_cache()  # the model and optimizer of `measure` are gone
    print(f"\ncProfile, own time in ms a step (x{args.profiled} steps):")
    print(f"| {'where':<24} | {'dense':>8} | {'nsa':>8} |")
    print(f"|{'-' * 26}|{'-' * 10}|{'-' * 10}|")
    for group in dict.fromkeys(group for group, _ in GROUPS):
        dense, nsa = profiles["dense"][group], profiles["nsa"][group]
        print(f"| {group:<24} | {dense:8.1f} | {nsa:8.1f} |")
    totals = [sum(profiles[kind].values()) for kind in ("dense", "nsa")]
    print(f"| {'all':<24} | {totals[0]:8.1f} | {totals[1]:8.1f} |")


if __name__ == "__main__":
    main()
