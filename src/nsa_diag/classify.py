"""Verdict, hang kind and a one-line reason from the recorded evidence of a case (pure functions).

The executor records an `Evidence` (how the worker ended, its own result, stack samples, CPU%, heartbeat,
GPU utilisation, where the beacon last was) and `classify` decides, without touching processes or files:

- exited: ``worker_result.json`` status (``ok`` -> pass; oom, nonfinite, grad-missing, mismatch,
  unchecked, error, skipped as they are); killed by a signal the runner did not send, or exited without a
  result -> crash.
- timeout (``--timeout`` ran out) -> slow, with the rate and the time it would still need, and what showed
  work (`nsa_diag.watchdog.Work`) or the pause it was in (`pause_reason`); but a worker idle for longer
  than any gap between its progress events before, with no progress while the evidence was taken, no work
  and no pause, and seen stuck (collective, gil-held, python-deadlock below) -> hang: idle is not
  progress, whichever limit came first.
- interrupted (nsa-diag got SIGINT/SIGTERM) -> error.
- stalled (no progress for ``--stall`` seconds) -> hang, and the hang kind, first match wins:
  collective   torch.distributed frames (Python or c10d/NCCL/Gloo native) in the training thread;
  cuda-kernel  a device sync (torch.cuda.synchronize, cuda*Synchronize, or a ``.item()``/``.cpu()``-like
               line while the GPU is busy) at the same innermost frame in every sample;
  gil-held     the heartbeat thread stopped ticking (before or between the samples): no Python thread
               can run, so a C call holds the GIL;
  python-deadlock  the same top frame in every sample, blocked in a lock/wait (a blocking stdlib frame,
               the source line's call, py-spy's native frames or the kernel wait channel) and CPU < 20%,
               or napping in time.sleep (a loop that sleeps and checks, named from its source: no work,
               only sleeps, issue 48); a lock-order cycle between threads is named where the stacks and
               the ``with`` statements around their frames show it;
  python-busy  CPU >= 50% (or a running main thread at >= 20%) with the heartbeat alive, Python on top
               (py-spy, when there, agrees) and the same innermost frame in every sample;
  unknown      anything else, with what was seen.

`pause_reason` says when a stalled unit is not stuck at all, from the same evidence: a progress event came
while it was taken, its innermost frame moved between the samples while it used the CPU, it
writes or reads a checkpoint (``torch.serialization``) or files (/proc's I/O bytes, a disk wait), or it
waits for a DataLoader batch that one of its workers is busy producing. The executor then watches on
(`nsa_diag.watchdog.Watcher.rearm`) instead of stopping the job.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from nsa_diag.evidence.procfs import FILE_LOCK_FRAME, FILE_LOCK_WCHANS, is_python
from nsa_diag.evidence.stacks import fatal_error, parse_faulthandler, parse_pyspy
from nsa_diag.records import Rate
from nsa_diag.spec import HangKind, Verdict, Where, WorkerReport
from nsa_diag.stackframes import Frame, ThreadStack, gpu_wait, innermost_native
from nsa_diag.watchdog import WORK_CPU_MIN, WORK_IO_BYTES, Work

Outcome = Literal["exited", "stalled", "timeout", "interrupted"]
WORKER_VERDICTS = ("oom", "nonfinite", "grad-missing", "mismatch", "unchecked", "error", "skipped")
DEADLOCK_CPU_MAX = 20.0  # percent of one core: a blocked wait uses (almost) none
BUSY_CPU_MIN = 50.0
# Hang kinds that show a worker not working: past the timeout without progress, these are a hang, not slow.
STUCK_KINDS = ("collective", "gil-held", "python-deadlock")

FILE_LOCK_WAIT = "file lock wait"  # flock/lockf/fcntl(F_SETLKW) blocked on a lock another process holds
# Python frames (file suffix, function) that wait: threading, queue, subprocess, multiprocessing, futures.
_BLOCKING_PY = {
    ("threading.py", "wait"): "threading wait (Condition/Event)",
    ("threading.py", "acquire"): "threading lock acquire",
    ("threading.py", "_wait_for_tstate_lock"): "thread join",
    ("threading.py", "join"): "thread join",
    ("queue.py", "get"): "queue get",
    ("queue.py", "put"): "queue put",
    ("subprocess.py", "wait"): "subprocess wait",
    ("subprocess.py", "_try_wait"): "subprocess wait",
    ("connection.py", "_recv"): "multiprocessing receive",
    ("connection.py", "poll"): "multiprocessing poll",
    ("selectors.py", "select"): "select",
    ("_base.py", "result"): "future result",
    ("_base.py", "wait"): "futures wait",
}
# The call on a source line that blocks in C (faulthandler cannot show C functions).
_BLOCKING_SOURCE = (
    (re.compile(r"\b(flock|lockf)\(|F_SETLKW"), FILE_LOCK_WAIT + " (fcntl)"),
    (re.compile(r"\.acquire\("), "threading lock acquire"),
    (
        re.compile(r"^(async\s+)?with\s[^:]*(lock|mutex|sem)\w*\s*[:,]", re.IGNORECASE),
        "threading lock acquire",
    ),
    (re.compile(r"\.wait\("), "wait"),
    (re.compile(r"\.join\("), "join"),
    (re.compile(r"\bsleep\("), "sleep"),
    (re.compile(r"\.recv\w*\(|\.accept\("), "socket receive"),
    (re.compile(r"\.barrier\("), "barrier"),
)
# Native frames (py-spy --native) of a blocked thread: patterns searched in the function name.
_BLOCKING_NATIVE = (
    (re.compile(r"^_*(GI_+)?(libc_)?(flock|lockf|fcntl)(64)?$"), FILE_LOCK_WAIT),
    (re.compile(r"acquire_lock"), "threading lock acquire"),
    (re.compile(r"pthread_mutex_(timed)?lock|__lll_lock_wait"), "mutex lock"),
    (re.compile(r"pthread_cond_\w*wait|condition_variable::wait"), "condition wait"),
    (re.compile(r"^sem_(wait|timedwait|clockwait)$"), "semaphore wait"),
    (re.compile(r"^(clock_)?nanosleep$"), "sleep"),
    (re.compile(r"futex"), "futex wait"),
    (re.compile(r"^(__)?(e?poll(_wait)?|ppoll|p?select6?|read|recv\w*)$"), "I/O wait"),
)
# Kernel wait channels (/proc/<pid>/wchan) of a sleeping main thread.
_BLOCKING_WCHAN = (
    *((needle, FILE_LOCK_WAIT) for needle in FILE_LOCK_WCHANS),
    ("futex", "futex wait (lock or condition)"),
    ("nanosleep", "sleep"),
    ("poll", "I/O wait"),
    ("select", "I/O wait"),
    ("pipe", "pipe wait"),
    ("sk_wait", "socket wait"),
    ("do_wait", "child wait"),
)
_CUDA_SOURCE = re.compile(r"\.(item|cpu|tolist|numpy|synchronize)\(|\.to\(\s*['\"]cpu|cuda\._sleep\(")
_DIST_NATIVE = ("c10d::", "ProcessGroupNCCL", "ProcessGroupGloo", "gloo::", "nccl")


@dataclass(frozen=True)
class Evidence:
    """Everything `classify` looks at, recorded by the executor (and by tests, by hand)."""

    outcome: Outcome
    exit_code: int | None = None  # the worker's status; negative: killed by that signal
    signal: str | None = None  # "SIGSEGV": the signal that ended the worker, when the runner did not send it
    worker_result: WorkerReport | None = None  # worker_result.json
    stack_samples: Sequence[str] = ()  # faulthandler texts, one per sample, in order
    fatal_stack: str | None = None  # faulthandler's dump at a fatal signal (segfault, abort)
    pyspy: str | None = None  # py-spy dump text
    pyspy_more: Sequence[str] = ()  # further py-spy dumps a moment apart (CPU-bound units only)
    cpu_percent: float | None = None  # of the worker between the two samples (100 = one core)
    heartbeat_advancing: bool | None = None  # the heartbeat ticked before and between the samples
    gpu_utilization: float | None = None  # percent; None without NVML
    main_wchan: str | None = None  # kernel wait channel of the worker's main thread
    main_state: str | None = None  # its /proc state: R running, S sleeping, D uninterruptible
    where: Where | None = None  # last beacon position
    stalled_for_s: float | None = None
    elapsed_s: float = 0.0
    timeout_s: float | None = None
    rate: Rate | None = None  # timeout: watchdog.progress_rate()
    progressed: bool | None = None  # a progress event came while the evidence was taken
    longest_gap_s: float | None = None  # the longest time between progress events before (after setup)
    source_lines: Mapping[str, str] = field(default_factory=dict)  # "file:line" -> source text
    # "file:line" -> the loop around it: "`while not os.path.exists(p):` at poll.py:20" (`enclosing_loops`)
    loops: Mapping[str, str] = field(default_factory=dict)
    # "file:line" -> the context managers of the with statements around it (`stacks.enclosing_withs`)
    withs: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # thread id as faulthandler writes it ("0x00007f...") -> its name (the probe's at_hang.json)
    thread_names: Mapping[str, str] = field(default_factory=dict)
    stderr_tail: str = ""
    interrupted_by: str | None = None  # "SIGINT" / "SIGTERM" to nsa-diag
    io_bytes: int | None = None  # read + written while the evidence was taken (/proc)
    work: Work | None = None  # the liveness signals over the window before the stall or the timeout
    # Pauses of the processes this one waits on (its DataLoader workers): `pause_reason` of each, by label.
    workers: Mapping[str, str | None] = field(default_factory=dict)
    program: str | None = None  # its command line at the evidence (secrets withheld): "sleep 600"
    exe: str | None = None  # the program it ran then (/proc/<pid>/exe)
    exec_from: str | None = None  # the program it ran when first seen, where that differs: it exec'd `exe`
    file_locks: Sequence[str] = ()  # file locks other processes hold (`procfs.held_file_locks`)
    # its descendants that used the CPU while the evidence was taken (`procfs.busy_descendants`)
    children_working: Sequence[str] = ()
    children_idle: Sequence[str] = ()  # those that did not (`procfs.descendants_work`)


@dataclass(frozen=True)
class Classification:
    verdict: Verdict
    hang_kind: HangKind | None
    reason: str


# --- stacks -------------------------------------------------------------------------------------------


def _is_tooling(thread: ThreadStack) -> bool:
    """nsa-diag's own threads (heartbeat): started by threading, in nsa_diag code, not in torch."""
    files = [f.file.replace("\\", "/") for f in thread.frames]
    return (
        thread.started_by_threading
        and any("/nsa_diag/" in f for f in files)
        and not any("/torch/" in f for f in files)
    )


def _in_autograd_wait(thread: ThreadStack) -> bool:
    top = thread.python_frames[:1]
    return bool(top) and "torch/autograd" in top[0].file.replace("\\", "/")


def focus_thread(threads: Sequence[ThreadStack]) -> ThreadStack | None:
    """The thread that runs the training step: the main thread, or the autograd engine thread running
    Python hooks while the main thread waits in ``backward()`` (CUDA backward runs on device threads)."""
    training = [t for t in threads if not _is_tooling(t) and t.frames]
    if not training:
        return None
    main = next((t for t in training if t.is_main), None) or next((t for t in training if t.current), None)
    main = main or training[0]
    if _in_autograd_wait(main):
        engine = [t for t in training if t is not main and not t.started_by_threading]
        if engine:
            return engine[0]
    return main


def _top_python(thread: ThreadStack | None) -> Frame | None:
    frames = thread.python_frames if thread else ()
    return frames[0] if frames else None


def _same_top(threads: Sequence[ThreadStack | None]) -> bool:
    tops = [_top_python(t) for t in threads]
    return len(tops) > 0 and all(t is not None for t in tops) and len({(t.file, t.line) for t in tops}) == 1  # type: ignore[union-attr]


def _last_asleep(focus: Sequence[ThreadStack | None], sources: Mapping[str, str]) -> ThreadStack | None:
    """The last sample whose own Python frames show a sleep, or None."""
    return next((t for t in reversed(focus) if is_sleep(_blocking(t, (), sources, None))), None)


def _naps(focus: Sequence[ThreadStack | None], asleep: ThreadStack, sources: Mapping[str, str]) -> str | None:
    """Whether the samples show the thread napping where ``asleep`` (one of them, judged a sleep) is: ""
    when every sample is at its frame; else, when at least half are and the others run in the function
    around it, in no wait (a loop that sleeps and checks, caught between two naps on a loaded machine), the
    words that say so; None otherwise."""
    if _same_top(focus):
        return ""
    nap = _top_python(asleep)
    if nap is None or any(t is None for t in focus):
        return None
    others = [t for t in focus if t is not None and _top_python(t) != nap]
    around = all(
        any((f.file, f.func) == (nap.file, nap.func) for f in t.python_frames)
        and not _blocking(t, (), sources, None)
        for t in others
    )
    at_nap = len(focus) - len(others)
    if 2 * at_nap < len(focus) or not around:
        return None
    return f" in {at_nap} of {len(focus)} stack samples (in the others between two naps, in {nap.func})"


def samples_disagree(samples: Sequence[str]) -> bool:
    """Whether stack samples (faulthandler texts) put the training thread (`focus_thread`) at different top
    Python frames: the evidence then takes one more sample (`watchdog.gather_hang_evidence`), and
    `hang_kind` judges a wait by the last two where they agree (a job that went from a sleep into a wait
    between the first two)."""
    focus = [focus_thread(threads) for threads in map(parse_faulthandler, samples) if threads]
    return len(focus) >= 2 and not _same_top(focus)


def _pyspy_match(pyspy_threads: Sequence[ThreadStack], focus: ThreadStack | None) -> ThreadStack | None:
    """The py-spy thread that is the faulthandler ``focus`` thread (same top Python frame; else main)."""
    top = _top_python(focus)
    if top is not None:
        for t in pyspy_threads:
            mine = _top_python(t)
            if mine and mine.line == top.line and mine.file.endswith(top.file.rsplit("/", 1)[-1]):
                return t
    if focus is not None and focus.is_main:
        return next((t for t in pyspy_threads if t.is_main), None)
    return None


def _frame_text(frame: Frame | None, sources: Mapping[str, str]) -> str:
    if frame is None:
        return "no Python frame"
    source = sources.get(frame.key)
    return f"`{source}` at {frame.short()}" if source else frame.short()


# nsa-diag's probe: its wrappers of `Tensor.backward` and the collectives sit in a watched job's stacks (also
# from a source tree), under the job's own frame
PROBE_PATH = "/nsa_diag/probe/"
# paths of frames that are not the job's own code: Python's library, installed packages, the probe
NOT_OWN_CODE = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ", PROBE_PATH)


def is_own_code(file: str) -> bool:
    """Whether a frame's file is the job's own code (`NOT_OWN_CODE`)."""
    path = file.replace("\\", "/")
    return not any(part in path for part in NOT_OWN_CODE)


def _is_probe(frame: Frame) -> bool:
    return PROBE_PATH in frame.file.replace("\\", "/")


def _is_library(frame: Frame) -> bool:
    """A frame of Python's own library (threading, ctypes, ...; a frozen module such as ``<frozen
    genericpath>`` from Python 3.11 on): the interesting one is its caller."""
    path = frame.file.replace("\\", "/")
    return ("/lib/python3" in path and "-packages/" not in path) or path.startswith("<frozen ")


def _exiting(thread: ThreadStack) -> bool:
    """The interpreter's exit, which waits for every thread that is not a daemon (`threading._shutdown`)."""
    frames = thread.python_frames
    return bool(frames) and frames[0].func == "_shutdown" and frames[0].file.endswith("threading.py")


def _own_frame(thread: ThreadStack | None) -> Frame | None:
    """The innermost frame of the job's own code (not Python's library, an installed package or the
    probe): the user's line under a wait in torch, or None."""
    frames = thread.python_frames if thread else ()
    return next((f for f in frames if is_own_code(f.file)), None)


def _is_installed(frame: Frame) -> bool:
    """A frame of an installed package (site-packages): not the job's own code either."""
    path = frame.file.replace("\\", "/")
    return "/site-packages/" in path or "/dist-packages/" in path


def _thread_text(thread: ThreadStack | None, sources: Mapping[str, str]) -> str:
    """The top Python frame, and the first caller outside Python's library when the top is inside it; or,
    when the top is in an installed package, the job's own frame that called into it (a wait inside
    filelock, requests or a hub client is the job's line's); the probe's wrappers are passed over."""
    frames = thread.python_frames if thread else ()
    if not frames:
        return "no Python frame"
    text = _frame_text(frames[0], sources)
    caller = None
    if _is_library(frames[0]):
        caller = next((f for f in frames[1:] if not (_is_library(f) or _is_probe(f))), None)
    elif _is_installed(frames[0]):
        caller = next(
            (f for f in frames[1:] if not (_is_library(f) or _is_installed(f) or _is_probe(f))), None
        )
    if caller is not None:
        text += f", called from {_frame_text(caller, sources)}"
    return text


def _file_lock(thread: ThreadStack | None) -> bool:
    """Whether the thread waits in the filelock package's acquire (datasets', the hub's and many a job's
    cache lock: it polls the lock file with a sleep while another process holds it)."""
    return thread is not None and any(
        FILE_LOCK_FRAME in f.file.replace("\\", "/") and "acquire" in f.func for f in thread.python_frames
    )


def _held(file_locks: Sequence[str]) -> str:
    """Who holds the file lock a process waits for (`procfs.held_file_locks`), or what that means."""
    if file_locks:
        return f"file locks other processes hold: {'; '.join(file_locks)}"
    return "another process holds that lock (another job sharing the cache, or one left running)"


def _native_match(
    frames: Sequence[Frame], table: Sequence[tuple[re.Pattern[str], str]]
) -> tuple[str, Frame] | None:
    for frame in frames:
        for pattern, what in table:
            if pattern.search(frame.func):
                return what, frame
    return None


def _blocking(
    focus: ThreadStack | None, native: Sequence[Frame], sources: Mapping[str, str], wchan: str | None
) -> str | None:
    """What the focus thread is blocked in, from the most specific evidence available."""
    for frame in focus.python_frames[:2] if focus else ():
        what = _BLOCKING_PY.get((frame.file.replace("\\", "/").rsplit("/", 1)[-1], frame.func))
        if what:
            return what
    top = _top_python(focus)
    source = sources.get(top.key, "") if top else ""
    for pattern, what in _BLOCKING_SOURCE:
        if pattern.search(source):
            return what
    hit = _native_match(native, _BLOCKING_NATIVE)
    if hit:
        return f"{hit[0]} ({hit[1].func})"
    for needle, what in _BLOCKING_WCHAN:
        if wchan and needle in wchan:
            return f"{what} (kernel wchan {wchan})"
    return None


def _importing(focus: ThreadStack | None) -> bool:
    """Whether the thread is importing a module (an import machinery frame on its stack)."""
    return focus is not None and any(f.file.startswith("<frozen importlib") for f in focus.python_frames)


def _distributed(focus: ThreadStack | None, native: Sequence[Frame]) -> Frame | None:
    """The torch.distributed frame the thread waits in, or None. A thread that is importing runs
    torch.distributed's module code (``transformers`` imports ``torch.distributed.tensor``): only a frame
    of ``distributed_c10d.py``, where collectives are called, counts then."""
    importing = _importing(focus)
    for frame in focus.python_frames if focus else ():
        path = frame.file.replace("\\", "/")
        if "torch/distributed/" not in path or frame.func == "<module>":
            continue
        if importing and not path.endswith("distributed_c10d.py"):
            continue
        return frame
    hit = next((f for f in native if any(n in f.func for n in _DIST_NATIVE)), None)
    return hit


def _cuda_sync(focus: ThreadStack | None, native: Sequence[Frame]) -> str | None:
    """A device sync the focus thread waits in (Python or native frame), or None."""
    hit = gpu_wait(focus, native)
    return hit.short() if hit is not None else None


def _cuda_source(focus: ThreadStack | None, sources: Mapping[str, str]) -> str | None:
    top = _top_python(focus)
    source = sources.get(top.key, "") if top else ""
    return _frame_text(top, sources) if _CUDA_SOURCE.search(source) else None


# what a wait made of sleeps is: no work (issue 48); `attach` reports it as a pause it saw, `watch` past the
# stall limit as a hang
SLEEP_NO_WORK = "no work, only sleeps"


def is_sleep(blocked: str | None) -> bool:
    """Whether a `_blocking` answer is a sleep (``time.sleep``, nanosleep): a pause, not a deadlock."""
    return bool(blocked) and blocked.startswith("sleep")  # type: ignore[union-attr]


def waits_on_dataloader(thread: ThreadStack | None) -> bool:
    """Whether the thread waits inside torch's DataLoader (for its next batch)."""
    return thread is not None and any(
        "torch/utils/data/" in f.file.replace("\\", "/") for f in thread.python_frames
    )


# where a process waits for its child processes: subprocess, multiprocessing (a Pool's map, a Process's join,
# a queue or pipe), concurrent.futures (a ProcessPoolExecutor's results)
CHILD_WAITS = ("subprocess.py", "multiprocessing/popen_fork.py", "multiprocessing/connection.py",
               "multiprocessing/queues.py", "multiprocessing/pool.py", "concurrent/futures/")  # fmt: skip


def waits_on_children(thread: ThreadStack | None) -> bool:
    """Whether the thread waits in subprocess, multiprocessing or concurrent.futures (`CHILD_WAITS`, in its
    six innermost Python frames): for its child processes."""
    files = [f.file.replace("\\", "/") for f in thread.python_frames[:6]] if thread else []
    return any(f.endswith(w) or w in f for f in files for w in CHILD_WAITS)


def last_focus(ev: Evidence) -> ThreadStack | None:
    """The thread the last stack sample is about (`focus_thread`), or None without a sample."""
    samples = [threads for threads in map(parse_faulthandler, ev.stack_samples) if threads]
    return focus_thread(samples[-1]) if samples else None


def dataloader_worker_idle(thread: ThreadStack | None) -> bool:
    """Whether a DataLoader worker's thread waits for its next indices (in torch's worker loop, not in a
    sample's read): idle by design, never the culprit."""
    if thread is None:
        return False
    paths = [f.file.replace("\\", "/") for f in thread.python_frames]
    in_loop = any(path.endswith("torch/utils/data/_utils/worker.py") for path in paths)
    reading = any(path.endswith("torch/utils/data/_utils/fetch.py") for path in paths)
    return in_loop and not reading


def _saving(thread: ThreadStack | None) -> Frame | None:
    """The frame of torch.serialization (a checkpoint written or read) on the thread's stack, or None."""
    for frame in thread.python_frames if thread else ():
        if frame.file.replace("\\", "/").endswith("torch/serialization.py"):
            return frame
    return None


_NATIVE_SIGNATURE = 4  # innermost native frames compared between two py-spy dumps


def _native_signature(thread: ThreadStack | None) -> tuple[str, ...] | None:
    """The innermost native frames of a py-spy thread, by function (an unnamed frame by its library, not
    its address: a loop in one function shows different addresses), when none of them is a wait (a lock,
    sleep, I/O, GPU sync or collective); None when there are none, or it waits."""
    native = innermost_native(thread)
    if not native or _native_match(native, _BLOCKING_NATIVE) or _cuda_sync(thread, native):
        return None
    if _distributed(thread, native):
        return None
    return tuple(f.file if f.func.startswith("0x") else f.func for f in native[:_NATIVE_SIGNATURE])


def _native_moved(threads: Sequence[ThreadStack | None]) -> tuple[str, str] | None:
    """py-spy dumps of one thread in native code that is no wait, at different innermost functions: C code
    that computes (a GEMM, then an add), not one that spins in one place; the two that differ, or None."""
    signatures = [_native_signature(t) for t in threads]
    known = [sig for sig in signatures if sig is not None]
    for a in known:
        for b in known:
            if a != b:
                i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), 0)
                return _short_name(a[i] if i < len(a) else a[-1]), _short_name(b[i] if i < len(b) else b[-1])
    return None


def _short_name(func: str, width: int = 60) -> str:
    """A C++ function's name without its template arguments, cut to ``width``."""
    name = re.sub(r"<[^<>]*(?:<[^<>]*(?:<[^<>]*>[^<>]*)*>[^<>]*)*>", "<>", func)
    return name if len(name) <= width else name[: width - 3] + "..."


def native_moved(ev: Evidence) -> str | None:
    """The innermost native frames of two py-spy dumps (``pyspy``, ``pyspy_more``) that differ while the
    unit used the CPU, as ``"a -> b"``: C code that computes; None when there are not two such dumps."""
    cpu = ev.cpu_percent
    if not (ev.pyspy and ev.pyspy_more and cpu is not None and cpu >= WORK_CPU_MIN):
        return None
    last = last_focus(ev)
    moved = _native_moved([_pyspy_match(parse_pyspy(t), last) for t in (ev.pyspy, *ev.pyspy_more)])
    return " -> ".join(moved) if moved else None


def pause_reason(ev: Evidence) -> str | None:
    """Why a unit past its stall limit is not stuck (module docstring), or None when nothing says so: what
    shows it doing work (progress, a moving frame at CPU, I/O, a checkpoint, a disk wait, its DataLoader
    worker producing its batch, its child programs working). A sleep is no work: a job that only sleeps and
    checks for the stall waits for something that does not come (issue 48)."""
    return _not_stuck(ev)


def _not_stuck(ev: Evidence) -> str | None:
    if ev.progressed:
        return "a progress event came while the evidence was taken"
    samples = [threads for threads in map(parse_faulthandler, ev.stack_samples) if threads]
    focus = [focus_thread(threads) for threads in samples]
    last = focus[-1] if focus else None
    sources = ev.source_lines
    cpu = ev.cpu_percent
    tops = [_top_python(t) for t in focus]
    if len(tops) >= 2 and all(tops) and cpu is not None and cpu >= WORK_CPU_MIN:
        a, b = tops[0], tops[-1]
        assert a is not None
        assert b is not None
        if (a.file, a.line) != (b.file, b.line):
            moved = f"{a.short()} -> {b.short()}"
            return f"its innermost frame moved between the stack samples ({moved}) at CPU {cpu:.0f}%"
    moved_native = native_moved(ev)
    if moved_native:
        return f"its native frames moved between two py-spy dumps ({moved_native}) at CPU {cpu:.0f}%"
    if (ev.io_bytes or 0) >= WORK_IO_BYTES:
        return f"it read or wrote {(ev.io_bytes or 0) / 2**20:.1f} MiB while the evidence was taken"
    saving = _saving(last)
    if saving is not None:
        at = _thread_text(last, sources)
        return f"reading or writing a checkpoint (torch.serialization, {saving.short()}) at {at}"
    if ev.main_state == "D" and last is not None and last.is_main:
        return f"in a disk wait (state D: file I/O) at {_thread_text(last, sources)}"
    if waits_on_dataloader(last):
        busy = [f"{label}: {why}" for label, why in ev.workers.items() if why]
        if busy:
            return (
                "waiting for its next batch, which its DataLoader worker is producing ("
                + "; ".join(busy)
                + ")"
            )
    elif ev.children_working and waits_on_children(last):
        # a program it runs and waits for uses the CPU (a compiler, a packer: not Python, whose children have
        # their own evidence)
        return "it waits for its child process(es), which are working: " + "; ".join(ev.children_working)
    return None


# --- verdicts -----------------------------------------------------------------------------------------


def _at(where: Where | None) -> str:
    return where.describe() if where else "an unknown place (no progress reported)"


def _pct(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0f}%"


def _busy(ev: Evidence) -> bool:
    """CPU-bound: >= 50% of a core, or a running (R) main thread at >= 20% (other processes share the
    cores: a busy loop on a loaded machine gets less than a core)."""
    if ev.cpu_percent is None:
        return False
    running = ev.main_state == "R" and ev.cpu_percent >= DEADLOCK_CPU_MAX
    return ev.cpu_percent >= BUSY_CPU_MIN or running


def _samples_phrase(n: int) -> str:
    return {1: "in the stack sample", 2: "in both stack samples"}.get(n, f"in all {n} stack samples")


def not_python(ev: Evidence) -> bool:
    """Whether the unit's process runs a program that is not Python (no probe; or it exec'd one)."""
    return ev.exe is not None and not is_python(ev.exe)


def program_text(ev: Evidence) -> str:
    """``"the process exec'd into `sleep 600` (no longer Python: /usr/bin/sleep, was python3.12)"``, or
    ``"`sleep 60` is not Python (no probe)"``: what the unit's process runs, said where it is not Python."""
    program = ev.program or (os.path.basename(ev.exe) if ev.exe else "an unknown program")
    if ev.exec_from is not None:
        longer = "no longer Python: " if not_python(ev) and is_python(ev.exec_from) else ""
        return f"the process exec'd into `{program}` ({longer}{ev.exe}, was {os.path.basename(ev.exec_from)})"
    return f"`{program}` is not Python (no probe)" if not_python(ev) else f"`{program}`"


def state_text(ev: Evidence) -> str:
    """``"sleeping (state S, kernel wchan hrtimer_nanosleep), CPU 0%, no I/O"``: /proc of the main thread."""
    wchan = ev.main_wchan if ev.main_wchan not in (None, "", "0") else None
    if wchan and "nanosleep" in wchan:
        what = "sleeping"
    else:
        what = _STATE_WORDS.get(ev.main_state or "", "in an unknown state")
    details = [f"state {ev.main_state}"] if ev.main_state else []
    if wchan:
        details.append(f"kernel wchan {wchan}")
    parts = [what + (f" ({', '.join(details)})" if details else ""), f"CPU {_pct(ev.cpu_percent)}"]
    if ev.io_bytes is not None:
        parts.append("no I/O" if ev.io_bytes == 0 else f"{ev.io_bytes / 1024:.0f} KiB read or written")
    return ", ".join(parts)


_STATE_WORDS = {"S": "waiting", "D": "in a disk wait", "R": "running", "T": "stopped", "t": "stopped"}


def is_idle(ev: Evidence) -> bool:
    """No work at all while the evidence was taken: no progress event, no liveness signal, CPU under
    `DEADLOCK_CPU_MAX`, less than `WORK_IO_BYTES` read or written, not in a disk wait."""
    working = ev.work is not None and ev.work.working
    return (
        not ev.progressed
        and not working
        and ev.cpu_percent is not None
        and ev.cpu_percent < DEADLOCK_CPU_MAX
        and (ev.io_bytes or 0) < WORK_IO_BYTES
        and ev.main_state != "D"
    )


def never_progressed(where: Where | None) -> bool:
    """Whether a unit whose beacon was last at ``where`` reported no progress at all (a program without the
    probe, a probed process before its first event): nothing it did can be called slow progress."""
    if where is None or where.step is not None:
        return where is None
    return where.phase is None or (where.phase == "setup" and where.event != "end")


def hang_kind(ev: Evidence) -> tuple[HangKind, str]:
    """The hang kind and what shows it (the part of the reason after the place)."""
    samples = [threads for threads in map(parse_faulthandler, ev.stack_samples) if threads]
    focus = [focus_thread(threads) for threads in samples]
    last = focus[-1] if focus else None
    pyspy_focus = _pyspy_match(parse_pyspy(ev.pyspy), last) if ev.pyspy else None
    native = innermost_native(pyspy_focus)
    sources = ev.source_lines
    at_top = _thread_text(last, sources)
    same = _same_top(focus)
    # a third sample, taken where the first two disagreed, settles where the thread is when it agrees with
    # the second: the first was still on its way (out of a sleep, say) into what it now waits in
    settled = same or (len(focus) >= 3 and _same_top(focus[-2:]))
    both = _samples_phrase(len(samples))
    if settled and not same:
        first = _thread_text(focus[0], sources)
        both = f"in the last two of {len(samples)} stack samples (the first at {first})"
    cpu = f"CPU {_pct(ev.cpu_percent)}"
    gpu = f"GPU {_pct(ev.gpu_utilization)}"

    if not_python(ev):  # no Python stacks, no heartbeat: only /proc tells what it does
        return "unknown", f"{program_text(ev)}: {state_text(ev)}"

    dist = _distributed(last, native)
    if dist and (same or all(_distributed(t, ()) for t in focus)):
        own = _own_frame(last)
        called = f", called from {_frame_text(own, sources)}" if own is not None else ""
        return "collective", f"blocked in torch.distributed at {dist.short()}{called} {both}"

    sync = _cuda_sync(last, native)
    if sync and same:
        own = _own_frame(last)
        called = f", called from {_frame_text(own, sources)}" if own is not None else ""
        return "cuda-kernel", f"waiting for the GPU in {sync}{called} {both}, {gpu}"
    cuda_line = _cuda_source(last, sources)
    if cuda_line and same and (ev.gpu_utilization or 0) > 0:
        return "cuda-kernel", f"waiting for the GPU at {cuda_line} {both}, {gpu}"

    if ev.heartbeat_advancing is False:
        named = next((f for f in native if not f.func.startswith("0x")), None)
        native_note = f" (native: {named.short()})" if named else ""
        return "gil-held", f"the heartbeat stopped too: the GIL is held at {at_top}{native_note}, {cpu}"

    if last is not None and settled and _exiting(last):
        running = [t for t in samples[-1] if t is not last and not _is_tooling(t) and t.python_frames]
        texts = "; ".join(
            (f"thread {t.name}: " if t.name else "") + _thread_text(t, sources) for t in running
        )
        return "python-deadlock", (
            "the process is exiting and cannot: its main thread waits in threading._shutdown for the threads "
            f"that are not daemons to end, {both}, {cpu}; threads still running: "
            + (texts or "none with Python frames")
        )

    blocked = _blocking(last, native, sources, ev.main_wchan if last is not None and last.is_main else None)
    idle = ev.cpu_percent is None or ev.cpu_percent < DEADLOCK_CPU_MAX
    asleep = last if is_sleep(blocked) else _last_asleep(focus, sources)
    naps = _naps(focus, asleep, sources) if asleep is not None else None
    if asleep is not None and naps is not None and idle:
        at_nap = _thread_text(asleep, sources)
        if _file_lock(asleep):
            return "unknown", (
                f"waiting for a file lock (filelock polls it with a sleep) at {at_nap} {both}, {cpu}: "
                + _held(ev.file_locks)
            )
        return "python-deadlock", _sleep_text(asleep, at_nap, naps or f" {both}", ev)
    if blocked and settled and idle:
        if blocked.startswith(FILE_LOCK_WAIT):
            return "unknown", (
                f"waiting for a file lock ({blocked.removeprefix(FILE_LOCK_WAIT).strip(' ()')}) "
                f"at {at_top} {both}, {cpu}: {_held(ev.file_locks)}"
            )
        cycle = lock_cycle(samples[-1], ev) if samples else None
        more = f"; {cycle}" if cycle else ""
        if ev.children_idle and waits_on_children(last) and not waits_on_dataloader(last):
            more += "; the child program(s) it waits for do no work: " + ", ".join(ev.children_idle)
        return "python-deadlock", f"blocked in {blocked} at {at_top} {both}, {cpu}{more}"

    if _busy(ev) and last is not None:
        top = pyspy_focus.frames[0] if pyspy_focus is not None and pyspy_focus.frames else None
        if top is not None and top.native and "gil" not in (pyspy_focus.status or ""):  # type: ignore[union-attr]
            return "unknown", f"CPU busy ({cpu}) in native code {top.short()} under {at_top}"
        if not same:
            return (
                "unknown",
                f"CPU busy ({cpu}) with its innermost frame moving between samples, now {at_top}",
            )
        return "python-busy", f"busy in Python at {at_top} {both}, {cpu}, heartbeat alive"

    seen = [cpu, f"heartbeat {'alive' if ev.heartbeat_advancing else 'unknown'}"]
    seen.append(f"top frame {at_top}" if last is not None else "no stack sample")
    if last is not None and not same:
        seen.append("top frames differ between samples")
    if blocked:
        seen.append(f"waiting in {blocked}")
    return "unknown", "cause unclear: " + ", ".join(seen)


_WITH_HEAD = re.compile(r"^(?:async\s+)?with\s+(.+?)\s*:\s*$")
_ACQUIRE = re.compile(r"([\w.\[\]'\"]+)\.acquire\(")


def _lock_name(text: str) -> str:
    """``self._state_lock`` -> ``_state_lock``: locks are matched by their last name (a lock is one object
    under several paths: ``self.lock`` in a method, ``model.lock`` outside)."""
    return text.strip().rsplit(".", 1)[-1]


def _waits_for(thread: ThreadStack, sources: Mapping[str, str]) -> tuple[str, Frame] | None:
    """The lock a thread waits to take, where its own innermost frame's source shows it (``with x:``,
    ``x.acquire()``), and that frame."""
    own = _own_frame(thread)
    text = sources.get(own.key, "") if own is not None else ""
    if own is None or not text:
        return None
    head = _WITH_HEAD.match(text)
    if head:
        return head.group(1).split(" as ")[0].split(",")[0].strip(), own
    acquire = _ACQUIRE.search(text)
    return (acquire.group(1), own) if acquire else None


def thread_label(thread: ThreadStack, names: Mapping[str, str]) -> str:
    """ "the main thread", "thread checkpoint-saver" (its name, from the probe), or "thread 0x7f..."."""
    if thread.is_main:
        return "the main thread"
    name = thread.name or names.get(thread.thread_id)
    return f"thread {name}" if name else f"thread {thread.thread_id}"


def lock_cycle(threads: Sequence[ThreadStack], ev: Evidence) -> str | None:
    """A lock-order deadlock, where the stacks show it: each thread of a cycle waits to take a lock (its
    own line: ``with b:``) that the next one holds (a ``with`` around one of its frames), as "a lock-order
    deadlock: the main thread holds `a` (train.py:44) and waits for `b` at train.py:45; thread saver holds
    `b` (train.py:26) and waits for `a` at train.py:27"; None where no cycle shows."""
    waits: dict[int, tuple[str, Frame]] = {}
    holds: dict[int, list[tuple[str, str]]] = {}
    candidates = [t for t in threads if not _is_tooling(t) and t.python_frames]
    for i, thread in enumerate(candidates):
        wait = _waits_for(thread, ev.source_lines)
        if wait is not None:
            waits[i] = wait
        held = [w for f in thread.python_frames for w in ev.withs.get(f.key, ())]
        holds[i] = [(_lock_name(h.split(" at ")[0]), h) for h in held]

    def holder(lock: str, not_by: int) -> int | None:
        return next((j for j, hs in holds.items() if j != not_by and any(n == lock for n, _ in hs)), None)

    for start in sorted(waits, key=lambda k: not candidates[k].is_main):  # from the main thread's side
        chain, i = [start], start
        while True:
            j = holder(_lock_name(waits[i][0]), i)
            if j is None or j not in waits:
                break
            if j == start:
                parts = []
                for at_k, k in enumerate(chain):
                    before = chain[at_k - 1]  # it waits for what this one holds
                    wanted = _lock_name(waits[before][0])
                    held = next((h for n, h in holds[k] if n == wanted), wanted)
                    name, _, at = held.partition(" at ")
                    lock, frame = waits[k]
                    parts.append(
                        f"{thread_label(candidates[k], ev.thread_names)} holds `{name}` ({at}) and waits for "
                        f"`{lock}` at {frame.short()}"
                    )
                return "a lock-order deadlock: " + "; ".join(parts)
            if j in chain:
                break
            chain.append(j)
            i = j
    return None


def _sleep_text(asleep: ThreadStack, at: str, naps: str, ev: Evidence) -> str:
    """A wait made of sleeps, no work for the stall (issue 48): the loop that sleeps and what it checks,
    where the source shows it: "sleeping in the loop `while not os.path.exists(path):` at poll.py:20, at
    `time.sleep(1)` at poll.py:21 in <module> in both stack samples, CPU 0%: ..."."""
    loop = next(
        (ev.loops[f.key] for f in asleep.python_frames[:3] if f.key in ev.loops and not _is_library(f)), None
    )
    head = f"sleeping in the loop {loop}, at " if loop else "sleeping at "
    what = ": what the loop checks for does not come" if loop else ""
    return f"{head}{at}{naps}, CPU {_pct(ev.cpu_percent)}: {SLEEP_NO_WORK}{what}"


def _slow_reason(ev: Evidence) -> str:
    rate = ev.rate
    working = ev.work is not None and ev.work.working
    paused = None if working or ev.progressed else pause_reason(ev)
    if working:
        assert ev.work is not None
        timeout = ev.timeout_s or ev.elapsed_s
        still = f"still working ({ev.work.describe()}) when the {timeout:g} s timeout ran out"
    elif paused:
        idle = f" for {ev.stalled_for_s:.0f} s" if ev.stalled_for_s is not None else ""
        still = (
            f"paused{idle}, not stuck ({paused}), when the {ev.timeout_s or ev.elapsed_s:g} s timeout ran out"
        )
    elif never_progressed(ev.where):
        program = f"{program_text(ev)}: " if not_python(ev) else ""
        still = (
            f"no progress reported, and not idle when the {ev.timeout_s or ev.elapsed_s:g} s timeout ran out "
            f"({program}{state_text(ev)}; CPU alone does not tell work from a spin)"
        )
    else:
        still = f"still progressing when the {ev.timeout_s or ev.elapsed_s:g} s timeout ran out"
    parts = [f"{still}, at {_at(ev.where)}"]
    if rate is not None:
        parts.append(f"{rate.steps_per_s:.3g} steps/s")
        parts.append(f"{rate.events_per_s:.3g} progress events/s")
        if rate.steps_total is not None:
            parts.append(f"{rate.steps_done}/{rate.steps_total} steps done")
        if rate.eta_s is not None:
            parts.append(f"needs about {rate.eta_s:.0f} s more")
    return "; ".join(parts)


def _crash(ev: Evidence) -> Classification:
    at = _at(ev.where)
    fatal = fatal_error(ev.fatal_stack)
    frame = None
    if ev.fatal_stack:
        threads = parse_faulthandler(ev.fatal_stack)
        current = next((t for t in threads if t.current), None) or focus_thread(threads)
        frame = _top_python(current)
    where_frame = f" in {_thread_text(current, ev.source_lines)}" if frame else ""
    if ev.signal:
        what = f" ({fatal})" if fatal else ""
        thrown = cpp_terminate(ev.stderr_tail) if ev.signal == "SIGABRT" else None
        said = f"; stderr: {thrown}" if thrown else ""
        return Classification("crash", None, f"killed by {ev.signal}{what} at {at}{where_frame}{said}")
    wr = ev.worker_result
    if wr is not None and wr.status == "ok":
        return Classification(
            "crash", None, f"reported ok, then exited with code {ev.exit_code} at {at}{where_frame}"
        )
    tail = _last_line(ev.stderr_tail)
    said = f"; stderr: {tail}" if tail else ""
    ended = f"exited with code {ev.exit_code}" if ev.exit_code is not None else "ended (exit status unknown)"
    return Classification("crash", None, f"{ended} without a result at {at}{where_frame}{said}")


# C++'s std::terminate on an uncaught exception (then abort: SIGABRT), as libstdc++ prints it
_TERMINATE = re.compile(
    r"terminate called after throwing an instance of '([^']+)'\s*\n\s*what\(\):\s*([^\n]*)"
)


def cpp_terminate(text: str) -> str | None:
    """The last C++ exception that ended a process through std::terminate in ``text`` (a gloo or NCCL
    error thrown on a thread of torch's): its type and message, cut to 300 characters; or None."""
    found = _TERMINATE.findall(text)
    if not found:
        return None
    kind, message = found[-1]
    message = " ".join(message.split())
    return f"C++ exception {kind}: {message[:300]}" + ("..." if len(message) > 300 else "")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _exited(ev: Evidence) -> Classification:
    wr = ev.worker_result
    if ev.signal or wr is None or (ev.exit_code not in (0, None) and wr.status == "ok"):
        return _crash(ev)
    status = wr.status
    reason = " ".join(wr.reason.split())
    if status == "ok":
        return Classification("pass", None, reason or f"{wr.steps_done} steps completed")
    if status in WORKER_VERDICTS:
        return Classification(status, None, reason or f"the worker reported {status}")  # type: ignore[arg-type]
    return Classification("error", None, f"the worker reported an unknown status {status!r}: {reason}")


def classify(ev: Evidence) -> Classification:
    """The verdict, hang kind (hangs only) and a one-line reason for ``ev``."""
    if ev.outcome == "interrupted":
        return Classification(
            "error",
            None,
            f"interrupted by {ev.interrupted_by or 'a signal'} after {ev.elapsed_s:.1f} s at {_at(ev.where)}",
        )
    if ev.outcome == "timeout":
        timeout = ev.timeout_s or ev.elapsed_s
        if never_progressed(ev.where) and is_idle(
            ev
        ):  # slow needs progress or work that went on: there was neither
            kind, why = hang_kind(ev)
            reason = f"no progress reported when the {timeout:g} s timeout ran out, and idle; {why}"
            return Classification("hang", kind, reason)
        unprecedented = (
            ev.longest_gap_s is None or ev.stalled_for_s is None or ev.stalled_for_s > ev.longest_gap_s
        )
        working = ev.work is not None and ev.work.working
        if ev.progressed is False and unprecedented and not working and pause_reason(ev) is None:
            kind, why = hang_kind(ev)
            if kind in STUCK_KINDS or (ev.exec_from is not None and is_idle(ev)):
                idle = f" for {ev.stalled_for_s:.1f} s" if ev.stalled_for_s is not None else ""
                reason = (
                    f"no progress{idle} at {_at(ev.where)} when the {ev.timeout_s or ev.elapsed_s:g} s"
                    f" timeout ran out, nor while the evidence was taken; {why}"
                )
                return Classification("hang", kind, reason)
        return Classification("slow", None, _slow_reason(ev))
    if ev.outcome == "stalled":
        kind, why = hang_kind(ev)
        stalled = (
            f"no progress for {ev.stalled_for_s:.1f} s" if ev.stalled_for_s is not None else "no progress"
        )
        reason = f"{stalled} at {_at(ev.where)}; {why}"
        if ev.worker_result is not None:  # it finished the case, then did not exit (shutdown hang)
            reason = f"the worker reported {ev.worker_result.status} but did not exit: {reason}"
        return Classification("hang", kind, reason)
    return _exited(ev)
