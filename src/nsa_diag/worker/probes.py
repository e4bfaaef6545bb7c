"""What the worker measures and reports: progress events, the hooks that emit them, memory, the heartbeat,
and the checks that run only on failure (where non-finite values first appeared, which gradients are missing).

Every progress event goes to the shared-memory beacon at once (which the watchdog reads even when this
process is wedged) and to ``progress.jsonl`` (the record a person reads afterwards) within a heartbeat (0.1
s; `Progress`). The hooks (`nsa_diag.probe.hooks`) are registered by `nsa_diag` on the model's blocks and on
the NSA branch modules; `nsa_core` knows nothing of them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO

from nsa_diag import artifacts
from nsa_diag.beacon import BeaconWriter
from nsa_diag.probe.hooks import LAYER_LAYOUTS, attach_progress, find_blocks, nsa_attentions, on_backward
from nsa_diag.probe.liveness import LivenessSampler
from nsa_diag.spec import PRE_FLIGHT

__all__ = ["LAYER_LAYOUTS", "attach_progress", "find_blocks", "nsa_attentions"]  # from nsa_diag.probe.hooks

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.hooks import RemovableHandle


_JSON_TEXT: dict[str | int | None, str] = {None: "null"}  # module names, phases, layers: a few hundred
_JSON_TEXT_MAX = 4096


def _json(value: str | int | None) -> str:
    """JSON text of a progress field: None, an int, or a string (plain names are written as they are)."""
    text = _JSON_TEXT.get(value)
    if text is None:
        if isinstance(value, int):
            text = str(value)
        elif value.isidentifier() or (value.replace(".", "_").isidentifier() and value.isascii()):  # type: ignore[union-attr]
            text = f'"{value}"'
        else:
            text = json.dumps(value)
        if len(_JSON_TEXT) < _JSON_TEXT_MAX:
            _JSON_TEXT[value] = text
    return text


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN or infinity: a non-finite measurement is written as null (the status says why)."""
    return value if value is not None and math.isfinite(value) else None


class Progress:
    """Progress events of the training step: to the beacon at once, to ``progress.jsonl`` soon after.

    `step` and `in_backward` are set by the training loop; hooks read them: a block's forward that runs
    while ``loss.backward()`` is under way is a gradient-checkpoint recompute. `phase_override` relabels
    hook events (the reference model of a parity check runs in phase "check"); `pre_flight` prefixes them
    (a ddp rank's pre-flight: "pre-flight backward").

    The beacon, which the watchdog reads live, takes every event as it happens. The lines of layer events
    (the hooks': about 7 per layer and step) wait in memory and are written together by `flush`: at the
    next event of the training loop (an event without a layer: step, phase, check, done), with every
    `note`, and at every heartbeat (0.1 s). A process killed with SIGKILL, or dying of a fatal signal, loses
    the layer lines since the last flush (at most 0.1 s of them; more only while something held the GIL and
    kept the heartbeat from running); the beacon, a file mapping, still holds its last event.
    """

    def __init__(self, beacon: BeaconWriter, stream: IO[str]) -> None:
        self.beacon = beacon
        self.step: int | None = None
        self.in_backward = False
        self.phase_override: str | None = None
        self.pre_flight = False
        self.seq = 1  # BeaconWriter's constructor recorded event 1: setup begin
        self._where: tuple[Any, ...] = ("setup", None, None, None, None, "begin")
        self._stream = stream
        self._pending: list[tuple[Any, ...] | str] = []  # events (tuples) and notes (lines) not yet written
        self._lock = threading.Lock()  # seq, beacon, pending: hooks may run in autograd's device threads
        self._write_lock = threading.Lock()  # the file: lines go out in seq order, whichever thread flushes
        self._stream.write(_line((1, time.time(), "setup", None, None, None, None, "begin", None)))

    @property
    def forward_phase(self) -> str:
        """The phase of a block's forward right now: forward, or recompute inside backward."""
        if self.phase_override:
            return self.phase_override
        phase = "recompute" if self.in_backward else "forward"
        return f"{PRE_FLIGHT} {phase}" if self.pre_flight else phase

    @property
    def backward_phase(self) -> str:
        if self.phase_override:
            return self.phase_override
        return f"{PRE_FLIGHT} backward" if self.pre_flight else "backward"

    @property
    def where(self) -> dict[str, str | int | None]:
        """The last event's location (the fields of `nsa_diag.spec.Where`)."""
        return dict(zip(("phase", "step", "layer", "branch", "module", "event"), self._where, strict=True))

    def event(
        self,
        phase: str,
        event: str | None = None,
        *,
        layer: int | None = None,
        branch: str | None = None,
        module: str | None = None,
        **extra: Any,
    ) -> int:
        """Record one progress event; returns its sequence number. Layer events (the hooks', many per
        step) only update the beacon and queue their line; the loop's events write everything queued."""
        with self._lock:
            step = self.step
            seq = self.seq = self.beacon.update(
                phase=phase, step=step, layer=layer, branch=branch, event=event, module=module
            )
            self._where = (phase, step, layer, branch, module, event)
            self._pending.append((seq, time.time(), phase, step, layer, branch, module, event, extra))
        if layer is None:
            self.flush()
        return seq

    def again(self) -> int:
        """The last event's place once more: progress that moves nowhere (a kernel compiled)."""
        phase, _, layer, branch, module, event = self._where
        return self.event(phase, event, layer=layer, branch=branch, module=module)

    def note(self, event: str, **extra: Any) -> None:
        """A line in ``progress.jsonl`` that is not progress (e.g. an injected fault firing), written at
        once: the beacon, and so the watchdog's stall timer and its idea of where the step is, stay as
        they were."""
        with self._lock:
            state = {"seq": self.seq, "t": time.time(), "step": self.step, "event": event}
            self._pending.append(json.dumps({**state, **extra}, default=str) + "\n")
        self.flush()

    def flush(self) -> None:
        """Write the queued lines (the heartbeat thread calls this every tick)."""
        with self._write_lock:
            with self._lock:
                pending, self._pending = self._pending, []
            if pending:
                self._stream.write("".join(_line(p) if type(p) is tuple else p for p in pending))


def _line(record: tuple[Any, ...]) -> str:
    """The JSON line of a progress event. Formatted by hand: hundreds are written per step, and json.dumps
    of a dict costs several times more; the part after the step (the place) is the same every step and is
    formatted once. Extras (rare) go through json."""
    seq, t, phase, step, layer, branch, module, event, extra = record
    place = (phase, layer, branch, module, event)
    tail = _TAILS.get(place)
    if tail is None:
        tail = (
            f'"phase": {_json(phase)}, "layer": {_json(layer)}, "branch": {_json(branch)}, '
            f'"module": {_json(module)}, "event": {_json(event)}'
        )
        if len(_TAILS) < PLACES_KEPT:
            _TAILS[place] = tail
    line = f'{{"seq": {seq}, "t": {t:.6f}, "step": {_json(step)}, {tail}'
    if extra:
        line += ", " + json.dumps(extra, default=str)[1:-1]
    return line + "}\n"


PLACES_KEPT = 8192  # formatted places kept by `_line` (a model's: ~7 a layer and phase)
_TAILS: dict[tuple[Any, ...], str] = {}


# ------------------------------------------------------------------------------------ kernel compilation


@contextlib.contextmanager
def checking(model: nn.Module, progress: Progress, layers_attr: str | None, branches: bool) -> Iterator[None]:
    """Progress of `model`'s blocks in phase "check" while a check runs it (the watchdog sees it advance)."""
    handles = attach_progress(model, progress, layers_attr, branches=branches)
    progress.phase_override = "check"
    try:
        yield
    finally:
        progress.phase_override = None
        for handle in handles:
            handle.remove()


def report_compiles(progress: Progress) -> bool:
    """Count each Triton kernel compiled as progress (`Progress.again`): a CUDA case's first step compiles
    tens of kernels, seconds each, between two of the hooks' events, and a fixed ``--stall`` would call
    that a hang. Chains to a hook already set. False where this Triton has no post-compile hook
    (``triton.knobs.runtime.jit_post_compile_hook``: Triton 3.4 and later); nothing is changed then."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    previous = runtime.jit_post_compile_hook

    def compiled(*args: Any, **kwargs: Any) -> Any:
        progress.again()
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = compiled
    return True


_COMPILER_REPORTED: list[Progress] = []  # Dynamo keeps its callbacks for the process: registered once


def report_compiler(progress: Progress) -> bool:
    """Count torch.compile's start and end of each compilation as progress (`Progress.again`): Dynamo and
    its backend compile inside the first forward, seconds to minutes between two events. False where this
    torch has no compile callbacks (``torch._dynamo.callback``)."""
    if _COMPILER_REPORTED:
        return True
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return False
    callback_handler.register_start_callback(lambda *args: progress.again())
    callback_handler.register_end_callback(lambda *args: progress.again())
    _COMPILER_REPORTED.append(progress)
    return True


def graph_breaks(backend: str) -> str:
    """One line for the case's notes: the graph breaks Dynamo counted so far and the commonest reason."""
    from torch._dynamo.utils import counters

    breaks = counters.get("graph_break", {})
    total = sum(breaks.values())
    line = f"torch.compile (backend {backend}): {total} graph break(s)"
    if total:
        reason, count = max(breaks.items(), key=lambda item: item[1])
        line += f", the commonest ({count}x): {str(reason).strip().splitlines()[0][:160]}"
    return line


# --------------------------------------------------------------------------------------- profiler ranges


def attach_profiler_ranges(blocks: Iterable[nn.Module], progress: Progress) -> list[RemovableHandle]:
    """``torch.profiler.record_function`` ranges per layer and per NSA branch, for ``--profile`` only:
    ``layer 1 forward``, ``layer 1 backward``, ``layer 1 recompute``, ``layer 1 sel forward``, ... so that a
    trace viewer (Perfetto) shows where each aten op ran. A range opens in a pre-hook and closes in the
    matching hook, at the same places as the progress events (`attach_progress`)."""
    handles: list[RemovableHandle] = []
    for layer, block in enumerate(blocks):
        handles += _range_hooks(block, block, f"layer {layer}", progress)
        for _, attn in nsa_attentions(block):
            handles.append(_fused_ranges(attn, f"layer {layer}", progress))
            for branch in attn.nsa.branches:
                kv, tap = getattr(attn, f"kv_{branch}"), attn.branch_out[branch]
                handles += _range_hooks(kv, tap, f"layer {layer} {branch}", progress)
    return handles


def _fused_ranges(attn: Any, label: str, progress: Progress) -> RemovableHandle:
    """Where the layer runs the fused op, a range per branch's kernels (``layer 1 sel forward``), from the
    op's branch hook that starts the branch to the next (the composed path's ranges also hold the branch's
    key/value projection; the fused op's hold its kernels alone)."""
    from torch.profiler import record_function

    open_range: list[record_function] = []

    def mark(module: Any, phase: str, branch: str | None) -> None:
        if open_range:
            open_range.pop().__exit__(None, None, None)
        if branch is not None:
            shown = progress.forward_phase if phase == "forward" else progress.backward_phase
            open_range.append(record_function(f"{label} {branch} {shown}"))
            open_range[-1].__enter__()

    return attn.register_branch_hook(mark)


def _range_hooks(first: nn.Module, last: nn.Module, label: str, progress: Progress) -> list[RemovableHandle]:
    """A range from ``first``'s forward pre-hook to ``last``'s forward hook, and from ``last``'s backward
    pre-hook to ``first``'s backward hook; a stack per direction, as a recompute nests inside backward."""
    from torch.profiler import record_function

    forward: list[record_function] = []
    backward: list[record_function] = []

    def open_range(stack: list[record_function], phase: str) -> None:
        stack.append(record_function(f"{label} {phase}"))
        stack[-1].__enter__()

    def close_range(stack: list[record_function]) -> None:
        if stack:  # a hook of a module whose range opened before the profiler started closes nothing
            stack.pop().__exit__(None, None, None)

    return [
        first.register_forward_pre_hook(lambda m, args: open_range(forward, progress.forward_phase)),
        last.register_forward_hook(lambda m, args, out: close_range(forward)),
        on_backward(last, begin=lambda m, g: open_range(backward, progress.backward_phase)),
        on_backward(first, end=lambda m: close_range(backward), input_shared=first is not last),
    ]


# ----------------------------------------------------------------------------------------------- memory


def cpu_peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux, bytes on macOS


def cpu_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def memory_now(device: torch.device | None) -> dict[str, Any]:
    """Memory facts of this moment: the CUDA caching allocator's statistics, or the process RSS on the CPU."""
    if device is not None and device.type == "cuda":
        import torch

        return dict(torch.cuda.memory_stats(device).items())
    return {"cpu_rss_bytes": cpu_rss_bytes(), "cpu_peak_rss_bytes": cpu_peak_rss_bytes()}


def peak_memory(device: torch.device | None) -> dict[str, int]:
    if device is not None and device.type == "cuda":
        import torch

        return {
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    return {"cpu_peak_rss_bytes": cpu_peak_rss_bytes()}


class MemoryRecorder:
    """Keeps ``memory_stats.json`` ({moment: stats}) and ``memory_summary.txt`` (CUDA) of the case folder.

    Called from the main thread (after forward/backward of step 1) and the heartbeat thread ("at_hang"),
    hence the lock. `snapshot_path` is set when a CUDA memory history is being recorded.
    """

    def __init__(self, case_dir: Path) -> None:
        self.case_dir = Path(case_dir)
        self.device: torch.device | None = None
        self.snapshot_path: Path | None = None
        self._stats: dict[str, Any] = {}
        self._lock = threading.Lock()

    def record(self, moment: str) -> None:
        stats = memory_now(self.device)
        summary = None
        if self.device is not None and self.device.type == "cuda":
            import torch

            summary = torch.cuda.memory_summary(self.device)
        with self._lock:
            self._stats[moment] = stats
            artifacts.write_json(self.case_dir / artifacts.MEMORY_STATS, self._stats)
            if summary is not None:
                header = f"=== {moment} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
                artifacts.append_text(self.case_dir / artifacts.MEMORY_SUMMARY, header + summary + "\n")

    def dump_snapshot(self) -> None:
        """Write the CUDA allocator's recorded history (``--memory-snapshot``), if one is being kept."""
        if self.snapshot_path is None:
            return
        import torch

        with self._lock:
            artifacts.write_with(self.snapshot_path, lambda p: torch.cuda.memory._dump_snapshot(str(p)))


class Heartbeat(threading.Thread):
    """Daemon thread: a beacon heartbeat every 0.1 s, the queued progress lines written (`Progress.flush`),
    and memory evidence when the runner asks for it.

    The runner creates ``dump.request`` before it kills a hung worker; this thread then records memory
    "at_hang" and creates ``dump.done``. While the GIL is held (a C call that never releases it) this
    thread cannot run: the heartbeat stops, which is exactly how the watchdog tells a held GIL.

    When a SIGUSR1 stack sample stays empty (its handler never ran: seen on a loaded GPU machine with the
    training thread blocked on a lock), the runner writes the sample's number into ``stack.request`` and
    this thread dumps every thread's stack into ``stacks`` from Python, under the sample's header.
    """

    def __init__(
        self,
        beacon: BeaconWriter,
        case_dir: Path,
        on_dump: Callable[[], None],
        stacks: BinaryIO | None = None,
        progress: Progress | None = None,
    ) -> None:
        super().__init__(name="nsa-diag-heartbeat", daemon=True)
        self.beacon = beacon
        self.progress = progress
        self.request = Path(case_dir) / artifacts.DUMP_REQUEST
        self.done = Path(case_dir) / artifacts.DUMP_DONE
        self.stack_request = Path(case_dir) / artifacts.STACK_REQUEST
        self.on_dump = on_dump
        self.stacks = stacks
        self.stopped = False
        self.liveness = LivenessSampler(beacon, threading.get_ident())  # made by the training thread

    def run(self) -> None:
        self._heartbeat_loop()

    def _heartbeat_loop(self) -> None:
        # A plain sleep, not Event.wait: in stack samples this thread shows no lock or condition frames a
        # classifier could mistake for the training thread's deadlock ("probes.py ... in _heartbeat_loop").
        answered = False
        sample_answered = ""  # the number of the last stack sample dumped from here
        while not self.stopped:
            time.sleep(0.1)
            self.beacon.tick()
            self.liveness.sample()
            if self.progress is not None:
                self.progress.flush()
            if not answered and self.request.exists():
                answered = True
                try:
                    self.on_dump()
                    artifacts.write_text(self.done, "ok\n")
                except Exception as exc:  # evidence is best effort; say what failed
                    artifacts.write_text(self.done, f"failed: {type(exc).__name__}: {exc}\n")
            if self.stacks is not None and self.stack_request.exists():
                number = self.stack_request.read_text(errors="replace").strip()
                if number and number != sample_answered:
                    sample_answered = number
                    faulthandler.dump_traceback(file=self.stacks, all_threads=True)


# ------------------------------------------------------------------------------------ failure-only checks


def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> float:
    """Total 2-norm of the gradients present (non-finite if any gradient is)."""
    import torch

    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    sharded = any(hasattr(g, "to_local") for g in grads)  # FSDP2's DTensors: each element on one rank
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    total = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in local]))
    if sharded:  # the squares of the shards add up over the ranks
        import torch.distributed as dist

        squares = total.square()
        dist.all_reduce(squares)
        total = squares.sqrt()
    return float(total)


def missing_grads(model: nn.Module, idle: Iterable[str]) -> list[str]:
    """Trainable parameters with no gradient after backward, except those the configuration leaves idle."""
    idle = set(idle)
    return [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None and n not in idle]


def _tensors(value: Any) -> list[torch.Tensor]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nonfinite(value: Any) -> bool:
    import torch

    # Detached and without grad: isfinite is built from differentiable ops (abs) that would otherwise save
    # tensors, and a checkpoint recompute that saves more than its forward did fails torch's check.
    with torch.no_grad():
        return any(
            t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()) for t in _tensors(value)
        )


class NonfiniteLocator:
    """Hooks on every module that record where non-finite values first appear, in execution order.

    Forward: a module's inputs (pre-hook) and outputs. Backward: the gradient reaching a module's outputs
    (pre-hook) and the gradient it passes to its inputs, and forward recomputes of checkpointed layers inside
    backward. Registered after the progress and injection hooks,
    so it sees what they did. Used only to re-run a failed step: checking every tensor costs a sync each.
    """

    def __init__(self, model: nn.Module, progress: Progress, *, forward: bool, backward: bool) -> None:
        self.model, self.progress = model, progress
        self.forward, self.backward = forward, backward
        self.first: dict[str, str] | None = None
        self._handles: list[RemovableHandle] = []

    def _hit(self, name: str, seen: str, value: Any) -> None:
        if self.first is None and _nonfinite(value):
            self.first = {"module": name or type(self.model).__name__, "seen": seen}

    def _forward_hit(self, name: str, seen: str, value: Any) -> None:
        # Checking gradients, forwards count only as recomputes inside backward (checkpointed layers).
        if self.forward:
            self._hit(name, seen, value)
        elif self.progress.in_backward:
            self._hit(name, f"{seen} (recompute)", value)

    def __enter__(self) -> NonfiniteLocator:
        import warnings

        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, n=name: self._forward_hit(n, "input", args)))  # fmt: skip
            self._handles.append(module.register_forward_hook(
                lambda m, args, out, n=name: self._forward_hit(n, "output", out)))  # fmt: skip
            if self.backward:
                # Output gradients where the progress and injection graph hooks see them, after them
                # (a full backward pre-hook would run before: it sits on a node of its own above them).
                output_gradient = lambda m, g_out, n=name: self._hit(n, "output gradient", g_out)  # noqa: E731
                self._handles.append(on_backward(module, begin=output_gradient))
                self._handles.append(module.register_full_backward_hook(
                    lambda m, g_in, g_out, n=name: self._hit(n, "input gradient", g_in)))  # fmt: skip
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")  # "full backward hook ... no inputs require gradients" on the root
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._warnings.__exit__(*exc)

    def first_nonfinite_grad(self) -> dict[str, str] | None:
        """Fallback when no hook saw it: the parameter, in backward order, whose gradient is non-finite."""
        for name, p in reversed(list(self.model.named_parameters())):
            if p.grad is not None and _nonfinite(p.grad):
                return {"module": name.rpartition(".")[0] or name, "seen": f"gradient of parameter {name}"}
        return None
