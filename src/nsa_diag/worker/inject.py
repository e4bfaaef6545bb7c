"""Fault injection (``--inject KIND[:layer=,phase=,step=,rank=,seconds=]``): real faults, at a chosen place.

Each fault is a hook on ``blocks[layer]`` registered after the progress hooks, so the beacon already says
where the step is when the fault fires. It fires at training step ``inj.step`` (``slow``: every step from
it on) in ``inj.phase``: ``forward`` in the block's forward pre-hook, ``recompute`` in the same hook while a
checkpointed block re-runs its forward inside backward, ``backward`` where the block's backward begins. On
CUDA, backward hooks (and so backward faults) run in autograd's device thread while the main thread waits
in ``backward()``; on the CPU they run in the main thread.

The faults are what a training job really does when it goes wrong, not simulations: a lock taken twice, a
Python loop that never ends, an allocation no device can satisfy, a read of address 0, a C call that keeps
the GIL. Their function names say what they do, so stack samples read plainly (``_deadlock_lock_acquire``).

    kind          what it does                                   how the case ends
    deadlock      threading.Lock acquired twice                  hangs, heartbeat alive, ~0% CPU
    busy          endless pure-Python loop                       hangs, heartbeat alive, 100% CPU
    slow          time.sleep(seconds) per call                   progress continues
    nan           block inputs (forward, recompute) or output    status nonfinite, module blocks.L
                  gradients (backward) + NaN
    oom           allocates 4 EiB on the model's device          status oom
    segfault      reads address 0                                SIGSEGV (faulthandler dump in stacks.txt)
    abort         os.abort()                                     SIGABRT
    exit          os._exit(17)                                   exit code 17, no worker_result.json
    unused-param  detaches attn.kv_win's output (a --model       status grad-missing, kv_win.weight
                  without NSA: its layer's first module with
                  parameters)
    gil-hog       blocking read() through ctypes.PyDLL           hangs, heartbeat stopped
    gpu-spin      torch.cuda._sleep + synchronize (CUDA only)    hangs in the kernel; CPU: status skipped
    skip-collective  ddp only: rank R skips the step's loss        the other ranks wait in it: hang,
                     all-reduce (nsa_diag.worker.ddp)            collective; one process: skipped
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nsa_diag.probe.hooks import on_backward
from nsa_diag.records import Injected
from nsa_diag.spec import Injection
from nsa_diag.worker.probes import Progress, nsa_attentions

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.hooks import RemovableHandle

# Hangs last an hour: far beyond any stall limit, short enough that a forgotten process ends by itself
# (SIGALRM, whose default action ends the process).
HANG_SECONDS = 3600
GPU_SPIN_CYCLES = HANG_SECONDS * 2_000_000_000  # ~an hour at 2 GHz


def this_rank() -> int:
    """The ddp rank of this process (torchrun sets RANK); 0 when not distributed."""
    return int(os.environ.get("RANK", "0"))


def active(injections: Sequence[Injection]) -> list[Injection]:
    """The injections meant for this rank."""
    rank = this_rank()
    return [inj for inj in injections if inj.rank is None or inj.rank == rank]


def skip_reason(injections: Sequence[Injection], device: torch.device) -> str | None:
    """Why the case cannot run here at all, or None."""
    for inj in active(injections):
        if inj.kind == "gpu-spin" and device.type != "cuda":
            return "gpu-spin needs CUDA"
        if inj.kind == "skip-collective" and int(os.environ.get("WORLD_SIZE", "1")) < 2:
            return "skip-collective needs ddp (nsa-diag ddp): a single process has no collective to skip"
    return None


# ------------------------------------------------------------------------------------------------ faults


def _end_within_an_hour() -> None:
    signal.alarm(HANG_SECONDS)


def _deadlock_lock_acquire() -> None:
    _end_within_an_hour()
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns: the lock is ours already (blocks in C with the GIL released)


def _busy_python_loop() -> None:
    _end_within_an_hour()
    n = 0
    while True:  # pure Python: holds the GIL only between bytecodes, so other threads still run
        n += 1


def _slow_sleep(seconds: float) -> None:
    time.sleep(seconds)


def _oom_allocate(device: torch.device) -> None:
    import torch

    torch.empty(1 << 62, dtype=torch.uint8, device=device)  # 4 EiB: the allocator's real out-of-memory path


def _segfault_read_null() -> None:
    ctypes.string_at(0)


def _abort() -> None:
    os.abort()


def _exit_17() -> None:
    os._exit(17)


def _gil_hog_c_read() -> None:
    # PyDLL keeps the GIL across the call: no other Python thread (the heartbeat) can run. A read of an
    # empty pipe rather than sleep(3): the runner's SIGUSR1 (stack samples) ends a sleep early, while
    # faulthandler's handler is installed with SA_RESTART, so the read resumes and the GIL stays held.
    _end_within_an_hour()
    read_end, write_end = os.pipe()
    buffer = ctypes.create_string_buffer(1)
    ctypes.PyDLL(None).read(read_end, buffer, 1)
    os.close(write_end)


def _gpu_spin_synchronize() -> None:
    import torch

    _end_within_an_hour()
    torch.cuda._sleep(GPU_SPIN_CYCLES)  # a kernel that spins on the clock
    torch.cuda.synchronize()


def _poison(values: Any) -> Any:
    """Floating tensors plus NaN, other values as they are (tuples kept as tuples). An addition saves no
    tensor for backward, so a checkpointed block recomputes the same saved tensors whether it fired or not
    (non-reentrant checkpointing checks that)."""
    import torch

    if isinstance(values, torch.Tensor):
        return values + math.nan if values.is_floating_point() else values
    if isinstance(values, tuple):
        return tuple(_poison(v) for v in values)
    return values


class Fault:
    """One injection attached to one block; `fired` counts the times it went off."""

    def __init__(self, inj: Injection, progress: Progress, device: torch.device, module: str) -> None:
        self.inj, self.progress, self.device, self.module = inj, progress, device, module
        self.fired = 0
        self.handle: RemovableHandle | None = None

    def due(self, phase: str) -> bool:
        step = self.progress.step
        if step is None or self.progress.phase_override:
            return False
        if self.inj.kind == "unused-param":  # a forward hook; fires wherever that forward runs
            return step == self.inj.step
        at_step = step >= self.inj.step if self.inj.kind == "slow" else step == self.inj.step
        return at_step and phase == self.inj.phase

    def fire(self, phase: str, values: Any) -> Any:
        """Do the fault; returns replacement values (``nan``, ``unused-param``) or None."""
        inj = self.inj
        self.fired += 1
        self.progress.note("inject", kind=inj.kind, layer=inj.layer, phase=phase, module=self.module)
        if inj.kind == "deadlock":
            _deadlock_lock_acquire()
        elif inj.kind == "busy":
            _busy_python_loop()
        elif inj.kind == "slow":
            _slow_sleep(inj.seconds)
        elif inj.kind == "nan":
            return _poison(values)
        elif inj.kind == "unused-param":
            return values.detach()
        elif inj.kind == "oom":
            _oom_allocate(self.device)
        elif inj.kind == "segfault":
            _segfault_read_null()
        elif inj.kind == "abort":
            _abort()
        elif inj.kind == "exit":
            _exit_17()
        elif inj.kind == "gil-hog":
            _gil_hog_c_read()
        elif inj.kind == "gpu-spin":
            _gpu_spin_synchronize()
        else:
            raise NotImplementedError(f"injection {inj.kind!r} has no hook in a single process")
        return None

    def forward_pre_hook(self, module: nn.Module, args: Any) -> Any:
        phase = self.progress.forward_phase
        return self.fire(phase, args) if self.due(phase) else None

    def backward_pre_hook(self, module: nn.Module, grad_output: Any) -> Any:
        return self.fire("backward", grad_output) if self.due("backward") else None

    def output_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        phase = self.progress.forward_phase
        return self.fire(phase, output) if self.due(phase) else None

    def report(self) -> Injected:
        return Injected(inject=str(self.inj), module=self.module, fired=self.fired)


def attach(
    injections: Sequence[Injection],
    blocks: Sequence[nn.Module],
    prefix: str,
    progress: Progress,
    device: torch.device,
) -> list[Fault]:
    """Register this rank's injections on ``blocks``; ValueError for a layer the model does not have.

    ``unused-param`` detaches the output of ``blocks[layer]``'s ``attn.kv_win`` at step ``inj.step``, in
    the forward and in any recompute of it (the phase key does not apply): ``kv_win.weight`` gets no
    gradient, as when a branch's output is dropped by mistake.
    """
    faults: list[Fault] = []
    for inj in active(injections):
        if inj.kind == "skip-collective":  # not a block hook: the ddp rank worker skips its all-reduce
            continue
        if inj.layer >= len(blocks):
            raise ValueError(
                f"--inject {inj}: layer {inj.layer} does not exist (the model has {len(blocks)})"
            )
        block = blocks[inj.layer]
        name = f"{prefix}.{inj.layer}" if prefix else str(inj.layer)
        if inj.kind == "unused-param":
            rel, target = _unused_param_target(block)
            if target is None:
                raise ValueError(f"--inject {inj}: {name} has no module with parameters that could go unused")
            fault = Fault(inj, progress, device, f"{name}.{rel}" if rel else name)
            fault.handle = target.register_forward_hook(fault.output_hook)
        else:
            fault = Fault(inj, progress, device, name)
            if inj.phase == "backward":  # after the progress hook at the same point: the beacon says where
                fault.handle = on_backward(block, begin=fault.backward_pre_hook)
            else:
                fault.handle = block.register_forward_pre_hook(fault.forward_pre_hook)
        faults.append(fault)
    return faults


def _unused_param_target(block: nn.Module) -> tuple[str, nn.Module | None]:
    """What ``unused-param`` detaches in ``block``: its first NSAAttention's ``kv_win``, or in a model
    without one the first module with parameters of its own (its name relative to the block)."""
    attns = nsa_attentions(block)
    if attns:
        rel, attn = attns[0]
        return (f"{rel}.kv_win" if rel else "kv_win"), attn.kv_win
    for rel, module in block.named_modules():
        if rel and any(True for _ in module.parameters(recurse=False)):
            return rel, module
    return "", None
