"""The probe inside one process of a user's job: its files, heartbeat, stack dumps and torch hooks.

`start` (called by the probe's ``sitecustomize`` when ``NSA_DIAG_PROBE_DIR`` is set) makes
``<NSA_DIAG_PROBE_DIR>/pid-<pid>/`` and in it:

- ``probe.json`` (written atomically): pid, ppid, argv, started, rank / local_rank / world_size (from the
  environment, null when absent), ``sigusr1`` ("probe" when faulthandler dumps on SIGUSR1, "user" when the
  process has a handler of its own: the probe then leaves the signal alone), ``torch`` (true once torch was
  imported by the job and the hooks installed), ``total_steps`` once the job says it;
- ``beacon.bin``: the progress beacon of `nsa_diag.beacon`, with a heartbeat thread ticking;
- ``stacks.txt``: faulthandler's dump of every thread on SIGUSR1, and its traceback on a fatal signal;
- ``nonfinite.json``: the first non-finite loss the job reported (`nsa_diag.probe.loss`);
- ``steps.jsonl``: one line per step (`StepTimes`, `StepClock`): its seconds and the part of them in
  forward, backward and the optimizer, from the same events (a rank's straggling under ``watch``:
  `nsa_diag.analysis.stragglers.watched_stragglers`); the first `MAX_STEP_LINES` steps.

The heartbeat thread also answers the watchdog's requests as our worker's does: ``dump.request`` (the
process's memory at the hang) and ``stack.request`` (a stack dump from Python when the SIGUSR1 handler
could not run). A fork (a DataLoader worker) restarts the probe in the child with its own folder.

torch is never imported here: a finder on ``sys.meta_path`` notices when the job imports it, lets torch
load, then installs one global module forward pre-hook that finds the model (the first module run that
has blocks where `nsa_diag.probe.hooks.find_blocks` looks), removes itself and hooks that model's blocks
(`nsa_diag.probe.hooks.attach_progress`), and torch's global optimizer-step hooks, which count the steps.
Standard library only, besides the beacon: the probe never imports typer, rich, pydantic, nor changes what
the job computes. Every failure of the probe is kept to the probe (recorded in ``probe.json``).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import importlib.abc
import importlib.machinery
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nsa_diag.beacon import PHASES, BeaconWriter
from nsa_diag.probe.liveness import LivenessSampler
from nsa_diag.redact import env_secret_values, redact_argv
from nsa_diag.wire import (
    AT_HANG_JSON,
    BEACON,
    BRANCHES_ENV,
    DUMP_DONE,
    DUMP_REQUEST,
    FR_PREFIX_ENV,
    NONFINITE_JSON,
    PROBE_DIR_ENV,
    PROBE_JSON,
    STACK_REQUEST,
    STACKS,
    STEPS_JSONL,
    AtHang,
    NonFiniteLoss,
    ProbeJson,
    StepTimes,
    Waiting,
    launcher_argv,
)

MAX_STEP_LINES = 20_000  # ~2 MB: a long job's later steps are not written
# torch.distributed's collectives the probe counts (per op) and marks while a call is under way: at a hang
# the ranks' counts tell which rank never entered the collective the others wait in (also where no flight
# recorder dump comes: a torch without the binding, a rank whose heartbeat cannot answer). One Python call
# around a call that costs milliseconds; nothing else changes.
COLLECTIVES = (
    "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
    "all_to_all_single", "send", "recv", "broadcast_object_list",
)  # fmt: skip
HEARTBEAT_S = 0.1

_probe: Probe | None = None


def current() -> Probe | None:
    """The probe of this process, or None when it runs without one."""
    return _probe


def flight_recorder_dump(backend: str = "nccl") -> bytes | None:
    """This process's flight recorder (pickle) through torch's Python binding, where this torch has one:
    ``_dump_nccl_trace`` for NCCL, ``_dump_fr_trace`` (the recorder of any backend that keeps one: gloo's
    too, with ``TORCH_FR_BUFFER_SIZE`` set) otherwise; the names and arguments moved between versions, so
    try what exists. None where neither exists. Called where torch is imported already."""
    import torch

    c10d = getattr(torch._C, "_distributed_c10d", None)
    names = ("_dump_nccl_trace", "_dump_fr_trace") if backend == "nccl" else ("_dump_fr_trace",)
    for name in names:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        for args in ((True, True, False), ()):
            try:
                data = dump(*args)
            except TypeError:
                continue
            return data if isinstance(data, bytes) else bytes(data)
    return None


def _int_env(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _write_json(path: Path, data: ProbeJson | AtHang | NonFiniteLoss) -> None:
    _write_bytes(path, (json.dumps(data, indent=1, default=str) + "\n").encode())


def _write_bytes(path: Path, data: bytes) -> None:
    """Atomic (temporary sibling, rename); on a failure (a full disk) no temporary file stays."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# the phases a step's time is split into, by the events' phases (a recompute is part of backward)
_TIMED = {"forward": "forward", "backward": "backward", "recompute": "backward", "optimizer": "optimizer"}


class StepClock:
    """The time of each step and of its phases, from the progress events (`Sink.event`): a phase runs from
    its first event to the first event of another phase (a forward's blocks, then backward, then the
    optimizer); the time after the step's end until the next forward is between steps."""

    def __init__(self) -> None:
        self.begun: float | None = None  # when the step under way began
        self.phase: str | None = None  # the timed phase under way
        self.since = 0.0
        self.spent = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}

    def saw(self, phase: str | None, now: float) -> None:
        timed = _TIMED.get(phase or "")
        if timed == self.phase:
            return
        if self.begun is None:
            self.begun = now
        if timed is None:
            return
        if self.phase is not None:
            self.spent[self.phase] += now - self.since
        self.phase, self.since = timed, now

    def idle(self, now: float) -> None:
        """The timed phase under way ended (the optimizer step): until the next, between steps."""
        if self.phase is not None:
            self.spent[self.phase] += now - self.since
            self.phase = None

    def restart(self, now: float) -> None:
        """A step begins now (`nsa_diag.probe.step`): what came before it is no step's."""
        self.begun, self.phase = now, None
        self.spent = dict.fromkeys(self.spent, 0.0)

    def end(self, step: int, now: float) -> StepTimes | None:
        """Step ``step`` ended now: its times (None when it had no event: no start known)."""
        begun = self.begun
        self.idle(now)
        spent = self.spent
        self.restart(now)
        if begun is None:
            return None
        return StepTimes(
            step=step, end=time.time(), step_s=round(now - begun, 6),
            forward_s=round(spent["forward"], 6), backward_s=round(spent["backward"], 6),
            optimizer_s=round(spent["optimizer"], 6),
        )  # fmt: skip


class Sink:
    """Where the hooks' and the API's progress goes: the beacon (a `nsa_diag.probe.hooks.ProgressSink`).

    ``step`` is the step under way, from 1: advanced by the first optimizer that steps (its post-hook
    records "step end"), or set by `nsa_diag.probe.step` (then the optimizer no longer advances it).
    A block's forward after a backward began, before the optimizer step, is a checkpoint recompute.
    """

    def __init__(self, beacon: BeaconWriter) -> None:
        self.beacon = beacon
        self.step = 1
        self.in_backward = False
        self.explicit = False
        self.optimizer: int | None = None  # id() of the optimizer whose steps count
        self.lock = threading.Lock()
        self.collectives: dict[str, int] = {}  # op -> calls entered
        self.waiting: Waiting | None = None  # the collective under way
        self.clock = StepClock()

    @property
    def forward_phase(self) -> str:
        return "recompute" if self.in_backward else "forward"

    @property
    def backward_phase(self) -> str:
        return "backward"

    def event(
        self,
        phase: str | None,
        event: str | None = None,
        *,
        layer: int | None = None,
        branch: str | None = None,
        module: str | None = None,
        **extra: Any,
    ) -> int:
        if phase == "backward":
            self.in_backward = True
        with self.lock:  # the hooks of a backward on CUDA run in autograd's device thread
            self.clock.saw(phase, time.perf_counter())
            return self.beacon.update(
                phase=phase, step=self.step, layer=layer, branch=branch, event=event, module=module
            )

    def optimizer_begin(self, optimizer: object) -> None:
        if self.optimizer is None:
            self.optimizer = id(optimizer)
        if id(optimizer) == self.optimizer:
            self.event("optimizer", "begin", module=type(optimizer).__name__)

    def optimizer_end(self, optimizer: object) -> None:
        if id(optimizer) != self.optimizer:
            return
        if _probe is not None and _probe.loss_watch is not None and _probe.loss_watch.pending:
            _probe.loss_watch.check_pending()
        self.in_backward = False
        self.event("step" if not self.explicit else "optimizer", "end", module=type(optimizer).__name__)
        with self.lock:
            self.clock.idle(time.perf_counter())
        if not self.explicit:
            self._step_ended()
            self.step += 1

    def _step_ended(self) -> None:
        with self.lock:
            times = self.clock.end(self.step, time.perf_counter())
        if times is not None and _probe is not None:
            _probe.record_step(times)

    def backward_called(self) -> None:
        """``Tensor.backward`` was called: the step's backward begins (before any block's)."""
        with self.lock:
            self.clock.saw("backward", time.perf_counter())

    def exiting(self) -> None:
        """The interpreter begins to exit: "done", with the steps completed (the watchdog then allows the
        exit its own limit: joining DataLoader workers and torch's teardown take seconds)."""
        done = self.step if self.explicit else self.step - 1
        with self.lock:
            self.beacon.update(phase="done", step=done if done > 0 else None, event="begin")

    def explicit_step(self, number: int) -> None:
        if self.explicit and number != self.step:
            self.event("step", "end")
            self._step_ended()
        elif not self.explicit:  # the job numbers its steps from now on
            with self.lock:
                self.clock.restart(time.perf_counter())
        self.explicit = True
        self.in_backward = False
        self.step = number
        self.event("step", "begin")

    def user_phase(self, name: str) -> None:
        if name in PHASES and name:
            self.event(name, "begin")
        else:  # a phase of the job's own ("eval", "checkpoint"): named in the module field
            self.event(None, "begin", module=name)


class Probe:
    """This process's probe: its folder, beacon, heartbeat thread, faulthandler and torch hooks."""

    def __init__(self, root: Path, sink: Sink | None = None) -> None:
        self.root = root
        self.folder = root / f"pid-{os.getpid()}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.info = ProbeJson(
            pid=os.getpid(),
            ppid=os.getppid(),
            argv=redact_argv(getattr(sys, "argv", [sys.executable]), env_secret_values(os.environ)),
            executable=sys.executable,
            started=time.time(),
            rank=_int_env("RANK"),
            local_rank=_int_env("LOCAL_RANK"),
            world_size=_int_env("WORLD_SIZE"),
            restart_count=_int_env("TORCHELASTIC_RESTART_COUNT"),
            sigusr1="probe",
            torch=False,
            role="launcher" if launcher_argv(list(getattr(sys, "orig_argv", None) or sys.argv)) else None,
        )
        self.beacon = BeaconWriter(self.folder / BEACON)
        self.liveness = LivenessSampler(self.beacon, threading.get_ident())
        if sink is None:
            sink = Sink(self.beacon)
        else:  # a forked child keeps the parent's sink (the hooks hold it), pointed at its own beacon
            sink.beacon, sink.lock = self.beacon, threading.Lock()
        self.sink = sink
        self.stacks = open(self.folder / STACKS, "ab")  # noqa: SIM115 - kept open for the process's life
        self.steps_file: Any = None  # steps.jsonl, opened at the first step
        self.step_lines = 0
        self.nonfinite_seen = False
        self.loss_watch: LossWatch | None = None
        self.block_watch: BlockWatch | None = None
        self._heartbeat_stop = False
        self._setup_signals()
        self.save()
        self._start_heartbeat()
        atexit.register(self._at_exit)
        _at_shutdown(self._shutting_down)

    # --- files --------------------------------------------------------------------------------------

    def save(self) -> None:
        with contextlib.suppress(OSError):
            _write_json(self.folder / PROBE_JSON, self.info)

    def note(self, key: str, value: object) -> None:
        """Set ``key`` of probe.json (one of `ProbeJson`'s) and rewrite the file."""
        self.info[key] = value  # type: ignore[literal-required]
        self.save()

    # --- signals ------------------------------------------------------------------------------------

    def _setup_signals(self) -> None:
        faulthandler.enable(file=self.stacks, all_threads=True)
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            self.info["sigusr1"] = "user"  # inherited or set before us: not ours to take
        else:
            faulthandler.register(signal.SIGUSR1, file=self.stacks, all_threads=True, chain=False)

    def user_took_sigusr1(self) -> None:
        """The job installs its own SIGUSR1 handler: faulthandler lets go, the watchdog stops signalling."""
        if self.info["sigusr1"] == "probe":
            faulthandler.unregister(signal.SIGUSR1)
            self.note("sigusr1", "user")

    def _shutting_down(self) -> None:
        if self.info["pid"] == os.getpid():
            with contextlib.suppress(Exception):
                self.sink.exiting()

    def _at_exit(self) -> None:
        """A normal interpreter exit (not a signal, not ``os._exit``): its time, for the exit status of a
        process that is not nsa-diag's child. Then SIGUSR1 is ignored: the interpreter's finalization
        removes faulthandler's handler, and a stack sample the watchdog asks for then would end the process
        by the signal's default action (a job that was exiting well reported killed by SIGUSR1). This
        handler, registered at start-up, runs after the job's own: a hang in those is still sampled."""
        if self.info["pid"] != os.getpid():
            return
        self.note("exited", time.time())
        if self.info["sigusr1"] == "probe":
            with contextlib.suppress(Exception):
                faulthandler.unregister(signal.SIGUSR1)
                getattr(signal.signal, "__wrapped__", signal.signal)(signal.SIGUSR1, signal.SIG_IGN)

    # --- heartbeat ----------------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        threading.Thread(target=self._heartbeat_loop, name="nsa-diag-probe-heartbeat", daemon=True).start()

    def _heartbeat_loop(self) -> None:
        # A plain sleep, not Event.wait: in stack samples this thread shows no lock or condition frame a
        # classifier could take for the job's deadlock.
        request, done, stack_request = (self.folder / n for n in (DUMP_REQUEST, DUMP_DONE, STACK_REQUEST))
        answered, sample_answered = False, ""
        while not self._heartbeat_stop:
            time.sleep(HEARTBEAT_S)
            self.beacon.tick()
            with contextlib.suppress(Exception):  # the liveness counts are evidence, never the job's problem
                self.liveness.sample()
            if not answered and request.exists():
                answered = True
                try:
                    at_hang = AtHang(
                        memory=memory_now(),
                        step=self.sink.step,
                        collectives=dict(self.sink.collectives),
                        waiting=self.sink.waiting,
                        threads={f"0x{t.ident:016x}": t.name for t in threading.enumerate() if t.ident},
                    )
                    _write_json(self.folder / AT_HANG_JSON, at_hang)
                    with contextlib.suppress(Exception):  # best effort, as the memory's
                        self._dump_flight_recorder()
                    done.write_text("ok\n")
                except Exception as exc:  # evidence is best effort; say what failed
                    done.write_text(f"failed: {type(exc).__name__}: {exc}\n")
            if stack_request.exists():
                number = stack_request.read_text(errors="replace").strip()
                if number and number != sample_answered:
                    sample_answered = number
                    faulthandler.dump_traceback(file=self.stacks, all_threads=True)

    def _dump_flight_recorder(self) -> None:
        # a rank of a process group without NCCL's debug pipe (watch asks NCCL's through the pipe): its
        # recorder, for `nsa_diag.analysis.flight` as `nsa-diag fr` reads it
        prefix = os.environ.get(FR_PREFIX_ENV)
        dist = sys.modules.get("torch.distributed")
        if not prefix or dist is None or not dist.is_available() or not dist.is_initialized():
            return
        backend = str(dist.get_backend())
        path = Path(f"{prefix}{dist.get_rank()}")
        if "nccl" not in backend and not path.exists() and (data := flight_recorder_dump(backend)):
            _write_bytes(path, data)

    # --- the job's own reports ----------------------------------------------------------------------

    def record_loss(
        self,
        value: Any,
        step: int | None = None,
        seen: str = "told to nsa_diag.probe.loss",
    ) -> None:
        """Record a non-finite loss (the first one), with where the block watch first saw non-finite
        values (this step's block outputs read now where they were not read yet)."""
        try:
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):
            return
        if not math.isfinite(number) and not self.nonfinite_seen:
            self.nonfinite_seen = True
            step = self.sink.step if step is None else step
            record = NonFiniteLoss(where="loss", value=str(number), step=step, time=time.time(), seen=seen)
            watch = self.block_watch
            if watch is not None:
                with contextlib.suppress(Exception):  # the loss is recorded whatever the blocks say
                    if watch.first is None and watch.read != step:
                        watch.saw(step, watch.values(step))
                    if watch.checked:
                        record["module"] = watch.first[1] if watch.first else None
                        if watch.first:
                            record["module_step"] = watch.first[0]
                        record["blocks_checked"] = watch.checked
            _write_json(self.folder / NONFINITE_JSON, record)

    def record_step(self, times: StepTimes) -> None:
        """One line of ``steps.jsonl`` (the first `MAX_STEP_LINES`); a failure stays the probe's."""
        if self.step_lines >= MAX_STEP_LINES or self.info["pid"] != os.getpid():
            return
        self.step_lines += 1
        try:
            if self.steps_file is None:
                self.steps_file = open(self.folder / STEPS_JSONL, "a", encoding="utf-8")  # noqa: SIM115
            self.steps_file.write(json.dumps(times) + "\n")
            self.steps_file.flush()
        except (OSError, ValueError) as exc:
            self.step_lines = MAX_STEP_LINES
            self.note("steps_error", f"{type(exc).__name__}: {exc}")

    def set_total_steps(self, n: int) -> None:
        self.note("total_steps", n)

    # --- fork ---------------------------------------------------------------------------------------

    def restart_in_child(self) -> None:
        """After a fork: this process is a new one (a DataLoader worker) with its own folder and threads."""
        global _probe
        _probe = None
        try:
            child = Probe(self.root, sink=self.sink)
        except Exception:
            return
        child.info["forked_from"] = self.info["pid"]
        child.info["torch"] = self.info.get("torch", False)
        child.save()
        _probe = child
        _wrap_os_exit()


def _at_shutdown(func: Any) -> None:
    """``func`` at the very start of the interpreter's exit, before threads are joined and atexit runs
    (``threading._register_atexit``, Python 3.9+; else an atexit handler, which runs later)."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(func)
    except RuntimeError:
        atexit.register(func)


def _wrap_os_exit() -> None:
    """In a forked child (a DataLoader worker: multiprocessing ends it with ``os._exit(code)``, past atexit),
    note the exit code first, so that its end is known to be normal."""
    original = getattr(os._exit, "__wrapped__", os._exit)

    def _exit(code: int) -> None:
        if _probe is not None and _probe.info["pid"] == os.getpid():
            with contextlib.suppress(Exception):
                _probe.info["exit_code"] = code
                _probe.note("exited", time.time())
        original(code)

    _exit.__wrapped__ = original  # type: ignore[attr-defined]
    os._exit = _exit  # type: ignore[assignment]


def memory_now() -> dict[str, Any]:
    """This process's memory at the moment (for ``dump.done.json``): RSS, and CUDA's allocator statistics
    when torch is loaded and CUDA initialised."""
    out: dict[str, Any] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS", "VmHWM")):
                    key, _, value = line.partition(":")
                    out[key] = value.strip()
    except OSError:
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        out["cuda_reserved_bytes"] = torch.cuda.memory_reserved()
    return out


# --- torch, once the job imports it ---------------------------------------------------------------------


class _TorchFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch`` is about to be imported, it wraps the real loader so that the
    hooks are installed right after torch's own module has run, then leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        _remove_finder()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            try:
                install_torch_hooks(module)
            except Exception as exc:  # never the job's problem
                if _probe is not None:
                    _probe.note("torch_hooks_error", f"{type(exc).__name__}: {exc}")

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchFinder)]


def install_torch_hooks(torch: Any) -> None:
    """The optimizer-step hooks and the one-shot model finder (module docstring)."""
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim

    def step_begin(opt: Any, args: Any, kwargs: Any) -> None:
        if _probe is not None:
            _probe.sink.optimizer_begin(opt)

    def step_end(opt: Any, args: Any, kwargs: Any) -> None:
        if _probe is not None:
            _probe.sink.optimizer_end(opt)

    _wrap_collectives(torch)
    _wrap_dataloader_worker(torch)
    _wrap_init_process_group(torch)
    _wrap_backward(torch)
    _wrap_ddp(torch)
    optim.register_optimizer_step_pre_hook(step_begin)
    optim.register_optimizer_step_post_hook(step_end)
    finder = _ModelFinder()
    finder.handle = nn_module.register_module_forward_pre_hook(finder)
    if _probe is not None:
        _probe.note("torch", True)


def _wrap_collectives(torch: Any) -> None:
    """Count the job's calls of torch.distributed's collectives (`COLLECTIVES`) per op."""
    import functools
    import warnings

    warnings.filterwarnings(  # our full backward hooks' own warning, not the job's
        "ignore",
        message="Full backward hook is firing when gradients are computed with respect to module outputs",
    )
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available():
        return

    def wrap(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def collective(*args: Any, **kwargs: Any) -> Any:
            sink = _probe.sink if _probe is not None else None
            if sink is None:
                return fn(*args, **kwargs)
            n = sink.collectives[name] = sink.collectives.get(name, 0) + 1
            sink.waiting = Waiting(op=name, n=n)
            try:
                return fn(*args, **kwargs)
            finally:
                sink.waiting = None

        return collective

    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if callable(fn):
            setattr(dist, name, wrap(name, fn))


class LossWatch:
    """The loss of every step, seen where the job calls ``backward()`` on it (no code change): a one-element
    floating tensor's value is checked for NaN/Inf. On the CPU at once; on a GPU without waiting for it:
    the value is copied into pinned memory behind an event and read at a later backward (or step) once the
    event has completed, so the check adds two small asynchronous operations to a step and no sync."""

    PENDING_MAX = 4  # GPU values not yet read; beyond this the oldest is dropped (a stalled stream)

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.pending: list[tuple[int, Any, Any, list[str]]] = []  # (step, pinned values, event, block names)

    def seen(self, tensor: Any, torch: Any) -> None:
        if self.probe.nonfinite_seen or tensor.numel() != 1 or not tensor.is_floating_point():
            return
        step = self.probe.sink.step
        self.check_pending()
        watch = self.probe.block_watch
        if tensor.device.type == "cpu":
            if watch is not None:
                watch.saw(step, watch.values(step))
            self.probe.record_loss(tensor.detach(), step, seen="the tensor backward() was called on")
            return
        if tensor.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        names, values = self.staged(tensor, step, torch)
        value = torch.empty(values.numel(), dtype=torch.float32, pin_memory=True)
        value.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((step, value, event, names))
        del self.pending[: -self.PENDING_MAX]

    def staged(self, tensor: Any, step: int, torch: Any) -> tuple[list[str], Any]:
        """What is read of a step once its event completes: the loss, then the sums of the step's block
        outputs (`BlockWatch`, where they are on the loss's device), one fp32 tensor on that device, and
        the blocks' names."""
        watch = self.probe.block_watch
        names, sums = watch.sums(step) if watch is not None else ([], [])
        if any(s.device != tensor.device for s in sums):
            names, sums = [], []
        return names, torch.cat([tensor.detach().reshape(1).float(), *(s.reshape(1) for s in sums)])

    def check_pending(self) -> None:
        """Read the values of the steps whose event has completed. Called from the job's own calls (its
        backward, its optimizer's step): a failure here is the probe's, said once, never the job's."""
        try:
            while self.pending and self.pending[0][2].query():
                step, value, _, names = self.pending.pop(0)
                loss, *sums = value.tolist()
                if names and self.probe.block_watch is not None:
                    self.probe.block_watch.saw(step, list(zip(names, sums, strict=True)))
                self.probe.record_loss(loss, step, seen="the tensor backward() was called on")
        except Exception as exc:
            self.pending.clear()
            note = getattr(self.probe, "note", None)
            if note is not None and not self.probe.info.get("loss_watch_error"):
                note("loss_watch_error", f"{type(exc).__name__}: {exc}")


class BlockWatch:
    """Where a NaN first appears, without a code change: the sum of each block's forward output (fp32,
    one reduction kernel a block, no sync: a NaN or Inf anywhere in the output makes it non-finite), kept
    for the step under way and read with its loss (`LossWatch`: on a GPU behind the same event). The
    first block of the first step whose sum is not finite is where the values went bad, whether or not
    that step's loss was (all finite when the loss is not: after the blocks, in the head or the loss). A
    recompute inside backward, a forward Dynamo traces and a tensor subclass (a DTensor) are not summed."""

    def __init__(self, sink: Any, names: list[str]) -> None:
        self.sink = sink
        self.names = names
        self.step: int | None = None
        self.by_block: dict[int, Any] = {}  # block index -> 0-d sum tensor, this step's first forward
        self.handles: list[Any] = []  # the blocks' forward hooks
        self.first: tuple[int, str] | None = None  # (step, block) of the first non-finite output seen
        self.checked = 0  # the most blocks read in one step
        self.read: int | None = None  # the last step read

    def saw(self, step: int, values: list[tuple[str, float]]) -> None:
        """The block sums of ``step``, read."""
        self.read = step
        self.checked = max(self.checked, len(values))
        if self.first is None:
            bad = next((name for name, value in values if not math.isfinite(value)), None)
            if bad is not None:
                self.first = (step, bad)

    @classmethod
    def attach(cls, model: Any, sink: Any) -> BlockWatch:
        """Sum the blocks of ``model`` (`nsa_diag.probe.hooks.find_blocks`) for ``sink`` (its ``step`` and
        ``in_backward``, as `Sink` keeps them)."""
        import torch

        from nsa_diag.probe.hooks import find_blocks, requiring_grad, tracing

        prefix, blocks = find_blocks(model)
        watch = cls(sink, [f"{prefix}.{i}" if prefix else str(i) for i in range(len(blocks))])
        compiling = tracing()

        def summed(index: int) -> Any:
            def hook(module: Any, args: Any, output: Any) -> None:
                if compiling() or sink.in_backward:
                    return
                out = requiring_grad(output, torch.Tensor)
                # a plain tensor only: a subclass's sum (a DTensor's, sharded) is no number to read here
                if type(out) is not torch.Tensor or not out.is_floating_point():
                    return
                if watch.step != sink.step:
                    watch.step, watch.by_block = sink.step, {}
                if index not in watch.by_block:  # a block run twice a step (a shared layer): its first
                    watch.by_block[index] = torch.sum(out.detach(), dtype=torch.float32)

            return hook

        watch.handles = [block.register_forward_hook(summed(index)) for index, block in enumerate(blocks)]
        return watch

    def sums(self, step: int) -> tuple[list[str], list[Any]]:
        """The names and sums of ``step``'s block outputs in block order (none for another step)."""
        if self.step != step:
            return [], []
        indices = sorted(self.by_block)
        return [self.names[i] for i in indices], [self.by_block[i] for i in indices]

    def values(self, step: int) -> list[tuple[str, float]]:
        """`sums` read, by block name (a sync on a GPU: called once, when the loss is non-finite)."""
        names, sums = self.sums(step)
        return [(name, float(s)) for name, s in zip(names, sums, strict=True)]


def _wrap_backward(torch: Any) -> None:
    """`LossWatch` on ``Tensor.backward`` (what training loops, Accelerate and Lightning call on the loss)."""
    import functools

    original = torch.Tensor.backward
    if getattr(original, "_nsa_diag_probe", False):
        return

    @functools.wraps(original)
    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _probe is not None:
            with contextlib.suppress(Exception):
                _probe.sink.backward_called()
            try:
                if _probe.loss_watch is None:
                    _probe.loss_watch = LossWatch(_probe)
                _probe.loss_watch.seen(self, torch)
            except Exception as exc:  # never the job's problem; said once
                if _probe.loss_watch is not None and not _probe.info.get("loss_watch_error"):
                    _probe.note("loss_watch_error", f"{type(exc).__name__}: {exc}")
        return original(self, *args, **kwargs)

    backward._nsa_diag_probe = True  # type: ignore[attr-defined]
    torch.Tensor.backward = backward


def _wrap_dataloader_worker(torch: Any) -> None:
    """A DataLoader worker process notes its role (``role``, ``worker_id``) when its loop starts: at a hang
    it is reported as what it is (idle, or busy reading a sample), never as the training process."""
    import functools

    worker = getattr(getattr(getattr(torch.utils, "data", None), "_utils", None), "worker", None)
    loop = getattr(worker, "_worker_loop", None)
    if loop is None or getattr(loop, "_nsa_diag_probe", False):
        return

    @functools.wraps(loop)
    def _worker_loop(*args: Any, **kwargs: Any) -> Any:
        if _probe is not None:
            worker_id = kwargs.get("worker_id", args[7] if len(args) > 7 else None)
            with contextlib.suppress(Exception):
                _probe.info["worker_id"] = worker_id if isinstance(worker_id, int) else None
                _probe.note("role", "dataloader-worker")
        return loop(*args, **kwargs)

    _worker_loop._nsa_diag_probe = True  # type: ignore[attr-defined]
    worker._worker_loop = _worker_loop


def _wrap_init_process_group(torch: Any) -> None:
    """A process that joins a process group notes its rank (``torch.multiprocessing.spawn``'s workers have
    no RANK variable): it is a rank of the job; and, before the call, the world size it asks for where it
    gives one (``init_world_size``)."""
    import functools

    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available():
        return
    init = getattr(dist, "init_process_group", None)
    if init is None or getattr(init, "_nsa_diag_probe", False):
        return

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        asked = kwargs.get("world_size", args[3] if len(args) > 3 else -1)
        if _probe is not None and isinstance(asked, int) and asked > 0:
            with contextlib.suppress(Exception):
                _probe.note("init_world_size", asked)
        result = init(*args, **kwargs)
        if _probe is not None:
            with contextlib.suppress(Exception):
                _probe.info["world_size"] = dist.get_world_size()
                _probe.note("rank", dist.get_rank())
        return result

    init_process_group._nsa_diag_probe = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group


def _wrap_ddp(torch: Any) -> None:
    """After each ``DistributedDataParallel.__init__``: the names of the parameters DDP reduces, in the
    order of its indices, into ``probe.json`` (``ddp_params``; with ``ddp_options``: its
    find_unused_parameters and static_graph), for DDP's errors name parameters by index. The order is
    torch 2.13's ``_build_params_for_reducer``: module by module (``named_modules()``), each module's own
    parameters that require a gradient and whose ``"<module>.<param>"`` is not in
    ``parameters_to_ignore``, a parameter shared by several modules once, where first seen. The last DDP
    model built wins. DDP runs exactly as it would: the original ``__init__`` first, and nothing of ours
    raises into the job."""
    import functools

    parallel = getattr(getattr(torch, "nn", None), "parallel", None)
    ddp = getattr(parallel, "DistributedDataParallel", None)
    original = getattr(ddp, "__init__", None)
    if ddp is None or original is None or getattr(original, "_nsa_diag_probe", False):
        return

    @functools.wraps(original)
    def ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if _probe is None:
            return
        try:
            ignored = getattr(self, "parameters_to_ignore", set())
            seen: set[int] = set()
            names = []
            for module_name, module in self.module.named_modules():
                for param_name, param in module.named_parameters(recurse=False):
                    if not param.requires_grad or f"{module_name}.{param_name}" in ignored:
                        continue
                    if id(param) not in seen:
                        seen.add(id(param))
                        names.append(f"{module_name}.{param_name}" if module_name else param_name)
            _probe.info["ddp_options"] = {
                "find_unused_parameters": bool(getattr(self, "find_unused_parameters", False)),
                "static_graph": bool(getattr(self, "static_graph", False)),
            }
            _probe.note("ddp_params", names)
        except Exception as exc:  # never the job's problem
            _probe.note("ddp_params_error", f"{type(exc).__name__}: {exc}")

    ddp_init._nsa_diag_probe = True  # type: ignore[attr-defined]
    ddp.__init__ = ddp_init


class _ModelFinder:
    """A global forward pre-hook that runs until it finds the model: the first module whose forward runs
    and that keeps its blocks where `nsa_diag.probe.hooks.find_blocks` looks (a DDP wrapper is passed
    over: the module it wraps is the model). Then it hooks that model's
    blocks and removes itself: from then on the job's modules run with no global hook."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.seen: set[int] = set()

    def __call__(self, module: Any, args: Any) -> None:
        key = id(module)
        if key in self.seen:
            return
        self.seen.add(key)
        from torch.nn.parallel import DataParallel, DistributedDataParallel

        from nsa_diag.probe.hooks import attach_progress, find_blocks

        if isinstance(module, DistributedDataParallel | DataParallel):
            return  # the model it wraps runs next, found with its own names (layers.1, not module.layers.1)
        try:
            prefix, _ = find_blocks(module)
        except ValueError:
            return
        self.handle.remove()
        if _probe is None:
            return
        try:
            attach_progress(module, _probe.sink, branches=os.environ.get(BRANCHES_ENV) == "1")
            _probe.block_watch = BlockWatch.attach(module, _probe.sink)
        except Exception as exc:  # e.g. nsa_core not importable: the step counter still works
            _probe.note("model_hooks_error", f"{type(exc).__name__}: {exc}")
            return
        _probe.note("model", {"type": type(module).__name__, "blocks": prefix})


# --- start ----------------------------------------------------------------------------------------------


def _wrap_signal_signal() -> None:
    """The job's own SIGUSR1 handler wins: when it installs one, the probe lets the signal go."""
    original = signal.signal

    def signal_signal(signalnum: Any, handler: Any) -> Any:
        if signalnum == signal.SIGUSR1 and _probe is not None:
            _probe.user_took_sigusr1()
        return original(signalnum, handler)

    signal_signal.__doc__ = original.__doc__
    signal_signal.__wrapped__ = original  # type: ignore[attr-defined]
    signal.signal = signal_signal  # type: ignore[assignment]


def _after_fork_in_child() -> None:
    if _probe is not None:
        _probe.restart_in_child()


def start(root: str | os.PathLike[str] | None = None) -> Probe | None:
    """Start the probe in this process (once): into ``root``, default ``$NSA_DIAG_PROBE_DIR``."""
    global _probe
    if _probe is not None:
        return _probe
    folder = root if root is not None else os.environ.get(PROBE_DIR_ENV)
    if not folder:
        return None
    _probe = Probe(Path(folder))
    _wrap_signal_signal()
    os.register_at_fork(after_in_child=_after_fork_in_child)
    if "torch" in sys.modules:
        install_torch_hooks(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _TorchFinder())
    return _probe
