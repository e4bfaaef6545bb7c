"""Verdicts and hang kinds from recorded evidence, without processes.

The stack texts under ``recorded/`` are real: faulthandler SIGUSR1 dumps (two samples a second apart) and
``py-spy dump --native`` output of small processes wedged inside a torch backward hook, made by
``recorded/record_stacks.py`` (run it to regenerate them). The CUDA texts are written by hand in the same
format, since this machine has no GPU. The source lines that the runner reads with linecache are given
explicitly, so the tests do not depend on where the recording was made.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from nsa_diag import artifacts
from nsa_diag.classify import (
    Evidence,
    classify,
    focus_thread,
    hang_kind,
    pause_reason,
    samples_disagree,
)
from nsa_diag.evidence import procfs
from nsa_diag.evidence import stacks as stack_samples
from nsa_diag.evidence.stacks import fatal_error, parse_faulthandler, parse_pyspy, split_samples
from nsa_diag.records import Rate
from nsa_diag.spec import Where, WorkerReport
from nsa_diag.stackframes import Frame, ThreadStack

RECORDED = Path(__file__).parent / "recorded"
WHERE = Where(phase="backward", step=1, layer=1, event="begin", module="blocks.1")


def samples(kind: str) -> list[str]:
    found, fatal = split_samples((RECORDED / f"{kind}.faulthandler.txt").read_text())
    assert fatal is None
    assert len(found) == 2
    return found


def pyspy(kind: str) -> str:
    return (RECORDED / f"{kind}.pyspy.txt").read_text()


def top_key(text: str) -> str:
    """``file:line`` of the training thread's innermost Python frame in a faulthandler dump."""
    thread = focus_thread(parse_faulthandler(text))
    assert thread is not None
    return thread.python_frames[0].key


def stalled(kind: str, source: str | None = None, **fields: object) -> Evidence:
    texts = samples(kind)
    sources = {top_key(texts[-1]): source} if source else {}
    return Evidence(
        outcome="stalled", stack_samples=texts, where=WHERE, stalled_for_s=2.1, source_lines=sources,
        **{"heartbeat_advancing": True, **fields},  # type: ignore[arg-type]
    )  # fmt: skip


# --- parsing ------------------------------------------------------------------------------------------


def test_parse_faulthandler_threads_and_frames() -> None:
    threads = parse_faulthandler(samples("deadlock")[0])
    assert len(threads) == 2
    heartbeat, main = threads
    assert heartbeat.started_by_threading
    assert not heartbeat.is_main
    assert main.current
    assert main.is_main
    assert main.frames[0].func == "_fault"
    assert main.frames[0].file.endswith("record_stacks.py")
    assert [f.func for f in main.frames][-4:] == ["backward", "backward", "_victim", "<module>"]


def test_split_samples_finds_a_fatal_dump_and_its_error() -> None:
    text = (RECORDED / "segfault.faulthandler.txt").read_text()
    found, fatal = split_samples(text)
    assert found == []
    assert fatal is not None
    assert fatal_error(fatal) == "Segmentation fault"
    current = next(t for t in parse_faulthandler(fatal) if t.current)
    assert current.frames[0].func == "string_at"
    # A fatal error after a sample header is split off the sample.
    found, fatal = split_samples(samples("deadlock")[0].join(["=== stack sample 1 at x\n", ""]) + text)
    assert len(found) == 1
    assert fatal_error(fatal) == "Segmentation fault"


def test_parse_pyspy_native_and_python_frames() -> None:
    threads = parse_pyspy(pyspy("deadlock"))
    main = next(t for t in threads if t.name == "MainThread")
    assert main.status == "idle"
    assert main.is_main
    natives = [f.func for f in main.frames if f.native]
    assert "lock_PyThread_acquire_lock" in natives
    assert main.python_frames[0].func == "_fault"
    assert main.python_frames[0].line > 0
    heartbeat = next(t for t in threads if t is not main)
    assert heartbeat.started_by_threading
    busy = next(t for t in parse_pyspy(pyspy("busy")) if t.name == "MainThread")
    assert busy.current  # holds the GIL
    assert not busy.frames[0].native


# --- hang kinds from the recordings --------------------------------------------------------------------


def test_deadlock_from_the_source_line() -> None:
    v = classify(stalled("deadlock", "lock.acquire()", cpu_percent=0.0))
    assert (v.verdict, v.hang_kind) == ("hang", "python-deadlock")
    assert v.reason.startswith("no progress for 2.1 s at layer 1 backward step 1; ")
    assert "threading lock acquire" in v.reason
    assert "`lock.acquire()` at record_stacks.py:" in v.reason
    assert "in both stack samples" in v.reason
    assert "CPU 0%" in v.reason


@pytest.mark.parametrize(
    "evidence",
    [
        pytest.param({"pyspy": pyspy("deadlock")}, id="pyspy-native-frames"),
        pytest.param({"main_wchan": "futex_wait_queue"}, id="kernel-wchan"),
    ],
)
def test_deadlock_without_the_source_line(evidence: dict[str, object]) -> None:
    v = classify(stalled("deadlock", cpu_percent=0.0, **evidence))
    assert v.hang_kind == "python-deadlock"


def test_deadlock_with_nothing_that_shows_a_wait_is_unknown() -> None:
    v = classify(stalled("deadlock", cpu_percent=0.0))
    assert v.hang_kind == "unknown"
    assert "cause unclear" in v.reason


def test_event_wait_is_a_deadlock_named_by_its_threading_frame_and_caller() -> None:
    v = classify(stalled("event", cpu_percent=0.0))
    assert v.hang_kind == "python-deadlock"
    assert "threading wait (Condition/Event)" in v.reason
    assert "called from record_stacks.py:" in v.reason


def test_a_process_that_cannot_exit_names_the_threads_it_waits_for() -> None:
    """A job's training ended (its beacon at done) but its process never exits: the main thread is in
    threading._shutdown, which waits for the threads that are not daemons (exit-wait: a real dump of
    tests/diag/jobs/exit_thread_never_ends.py under watch, its metrics thread left in queue.get). The
    reason says so and names that thread at the job's own line, not the probe's heartbeat thread."""
    v = classify(stalled("exit-wait", cpu_percent=0.0))
    assert (v.verdict, v.hang_kind) == ("hang", "python-deadlock")
    assert "the process is exiting and cannot: its main thread waits in threading._shutdown" in v.reason
    assert v.reason.endswith(  # without the source lines, which the watcher reads from the files
        "threads still running: threading.py:327 in wait, called from "
        "exit_thread_never_ends.py:18 in uploader"
    ), v.reason
    assert "runtime.py" not in v.reason


def test_a_wait_for_a_file_lock_is_said_at_the_jobs_own_line() -> None:
    """A job that prepares its data under a lock another process holds (file-lock: a real dump of
    tests/diag/jobs/locked_cache.py under watch while a second process held the lock): filelock polls the
    lock file with a sleep. The reason says it waits for a file lock, called from the job's own line (not
    only filelock's frame in site-packages), and that another process holds it."""
    v = classify(stalled("file-lock", "time.sleep(delay)", cpu_percent=1.0))  # the line the watcher reads
    assert v.hang_kind == "unknown"
    assert (
        "; waiting for a file lock (filelock polls it with a sleep) at `time.sleep(delay)` at "
        "_acquire.py:177 in _poll_until_acquired, called from locked_cache.py:18 in prepare in both stack "
        "samples"
    ) in v.reason, v.reason
    assert v.reason.endswith(
        "another process holds that lock (another job sharing the cache, or one left running)"
    )
    plain = classify(stalled("event", cpu_percent=0.0))  # a frame of Python's library: called from, as before
    assert "called from record_stacks.py:" in plain.reason
    held = "/data/cache/tokenized.lock (flock, pid 7: python prepare.py)"  # as `procfs.held_file_locks` says
    named = classify(stalled("file-lock", "time.sleep(delay)", cpu_percent=1.0, file_locks=[held]))
    assert named.reason.endswith(f"in both stack samples, CPU 1%: file locks other processes hold: {held}")


_SAVING = (
    "Current thread 0x00007f0000000001 (most recent call first):\n"
    '  File "/job/train.py", line 20 in save_checkpoint\n'
    '  File "/job/train.py", line 37 in main\n'
    '  File "/job/train.py", line 41 in <module>\n'
)


def test_a_blocking_file_lock_wait_is_said_with_its_holder() -> None:
    """A job blocked in ``fcntl.flock`` (or lockf, fcntl F_SETLKW) on a lock another process holds: seen
    in its source line, py-spy's native frame or its main thread's wait channel. The reason says it waits
    for a file lock and who holds it, like filelock's polling wait (it was "cause unclear")."""
    held = "/shared/checkpoints.lock (flock, pid 7: python other_job.py)"
    base = Evidence(
        outcome="stalled", stack_samples=[_SAVING, _SAVING], where=WHERE, stalled_for_s=2.1,
        heartbeat_advancing=True, cpu_percent=0.0,
    )  # fmt: skip
    by_source = classify(
        replace(
            base, source_lines={"/job/train.py:20": "fcntl.flock(lock, fcntl.LOCK_EX)"}, file_locks=[held]
        )
    )
    assert (by_source.verdict, by_source.hang_kind) == ("hang", "unknown")
    assert (
        "waiting for a file lock (fcntl) at `fcntl.flock(lock, fcntl.LOCK_EX)` at train.py:20 in "
        f"save_checkpoint in both stack samples, CPU 0%: file locks other processes hold: {held}"
    ) in by_source.reason, by_source.reason
    by_kernel = classify(replace(base, main_wchan="locks_lock_inode_wait"))
    assert (
        "waiting for a file lock (kernel wchan locks_lock_inode_wait) at train.py:20 in save_checkpoint"
    ) in by_kernel.reason, by_kernel.reason
    assert by_kernel.reason.endswith(
        "another process holds that lock (another job sharing the cache, or one left running)"
    )
    posix = classify(replace(base, main_wchan="fcntl_setlk"))
    assert "waiting for a file lock (kernel wchan fcntl_setlk)" in posix.reason, posix.reason
    native = (
        'Process 7: python train.py\n\nThread 7 (idle): "MainThread"\n    flock (libc.so.6)\n'
        "    save_checkpoint (/job/train.py:20)\n    main (/job/train.py:37)\n"
        "    <module> (/job/train.py:41)\n"
    )
    by_native = classify(replace(base, pyspy=native))
    assert "waiting for a file lock (flock) at train.py:20 in save_checkpoint" in by_native.reason, (
        by_native.reason
    )
    assert "file lock" not in classify(replace(base, main_wchan="do_epoll_wait")).reason  # not every wait


def test_held_file_locks_names_the_lock_file_and_its_holder(tmp_path: Path) -> None:
    """/proc/locks and the holder's open files: the lock file's path, the lock's kind, the holder's pid and
    command line; the waiter's own locks and unreadable lines are left out."""
    lock = tmp_path / "tokenized.lock"
    hold = "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(30)"  # noqa: E501
    holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        held = procfs.held_file_locks(os.getpid())
        assert any(
            h.startswith(f"{lock} (flock, pid {holder.pid}: {sys.executable} -c import fcntl") for h in held
        ), held
        assert not any(f"pid {holder.pid}:" in h for h in procfs.held_file_locks(holder.pid))
    finally:
        holder.kill()
        holder.wait()
    other = tmp_path / "other.lock"  # a second lock held: all are named for a waiter blocked on none
    holder2 = subprocess.Popen([sys.executable, "-c", hold, str(other)], stdout=subprocess.PIPE, text=True)
    wait = "import fcntl, sys; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX)"
    try:
        assert holder2.stdout is not None
        assert holder2.stdout.readline().strip() == "held"
        assert any(f"pid {holder2.pid}:" in h for h in procfs.held_file_locks(os.getpid()))
        holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        waiter = subprocess.Popen([sys.executable, "-c", wait, str(lock)])
        deadline = time.monotonic() + 30
        while not procfs.waits_for_file_lock(procfs.wchan(waiter.pid)):
            assert time.monotonic() < deadline
            assert waiter.poll() is None
            time.sleep(0.05)
        # blocked on ``lock``: its holder only, not the other lock's
        (named,) = procfs.held_file_locks(waiter.pid)
        assert named.startswith(f"{lock} (flock, pid {holder.pid}:"), named
    finally:
        for proc in (holder2, locals().get("holder"), locals().get("waiter")):
            if proc is not None:
                proc.kill()
                proc.wait()
    gone = "1: FLOCK  ADVISORY  WRITE 999999999 fe:00:1 0 EOF"  # no such process: its file cannot be read
    odd = f"{gone}\n2: -> FLOCK  ADVISORY  WRITE 5 fe:00:1 0 EOF\nbad\n"  # a waiter's line; garbage
    assert procfs.held_file_locks(1, odd) == []


def test_a_deadlock_needs_low_cpu_and_the_same_top_frame() -> None:
    assert classify(stalled("deadlock", "lock.acquire()", cpu_percent=35.0)).hang_kind == "unknown"
    mixed = stalled("deadlock", "lock.acquire()", cpu_percent=0.0)
    other = samples("busy")[1]
    moved = Evidence(**{**mixed.__dict__, "stack_samples": [mixed.stack_samples[0], other]})
    kind, why = hang_kind(moved)
    assert kind == "unknown"
    assert "top frames differ" in why


def test_a_wait_the_last_two_of_three_samples_agree_on_is_a_deadlock() -> None:
    # the evidence takes a third sample where the first two disagree (`samples_disagree`): a job on its
    # way out of a sleep into a wait that never ends (an upload thread that died) was `unknown` with two
    event = stalled("event", cpu_percent=0.0)
    first = samples("busy")[0]
    two = Evidence(**{**event.__dict__, "stack_samples": [first, event.stack_samples[1]]})
    three = Evidence(**{**event.__dict__, "stack_samples": [first, *event.stack_samples]})
    assert samples_disagree(two.stack_samples)
    assert not samples_disagree(event.stack_samples)
    assert hang_kind(two)[0] == "unknown"
    kind, why = hang_kind(three)
    assert kind == "python-deadlock"
    assert "threading wait (Condition/Event)" in why
    assert "in the last two of 3 stack samples (the first at " in why
    # and not where the last two disagree, or the CPU works
    moved = Evidence(**{**event.__dict__, "stack_samples": [event.stack_samples[0], first, first]})
    assert hang_kind(moved)[0] != "python-deadlock"
    assert hang_kind(replace(three, cpu_percent=60.0))[0] != "python-deadlock"


def test_busy_loop() -> None:
    v = classify(stalled("busy", "n += 1", cpu_percent=70.9, main_state="R", pyspy=pyspy("busy")))
    assert v.hang_kind == "python-busy"
    assert "busy in Python at `n += 1` at record_stacks.py:" in v.reason
    assert "CPU 71%" in v.reason


def test_busy_loop_on_a_loaded_machine_counts_a_running_main_thread() -> None:
    assert classify(stalled("busy", cpu_percent=30.0, main_state="R")).hang_kind == "python-busy"
    assert classify(stalled("busy", cpu_percent=30.0, main_state="S")).hang_kind == "unknown"


def test_busy_in_native_code_is_not_called_python_busy_when_pyspy_shows_it() -> None:
    v = classify(stalled("native-busy", cpu_percent=98.9, pyspy=pyspy("native-busy")))
    assert v.hang_kind == "unknown"
    assert "native code mkl_" in v.reason
    # Without py-spy the Python frames are all there is.
    assert classify(stalled("native-busy", cpu_percent=98.9)).hang_kind == "python-busy"


def test_gil_held_when_the_heartbeat_stopped() -> None:
    v = classify(
        stalled(
            "gil-hog",
            "libc.pthread_mutex_lock(mutex)",
            cpu_percent=0.0,
            heartbeat_advancing=False,
            pyspy=pyspy("gil-hog"),
            main_wchan="futex_wait_queue",
        )
    )
    assert v.hang_kind == "gil-held"
    assert "the GIL is held at `libc.pthread_mutex_lock(mutex)`" in v.reason
    assert "(native: pthread_mutex_lock (libc.so.6))" in v.reason


def test_the_same_gil_hog_with_a_live_heartbeat_would_be_a_deadlock() -> None:
    v = classify(
        stalled("gil-hog", "libc.pthread_mutex_lock(mutex)", cpu_percent=0.0, pyspy=pyspy("gil-hog"))
    )
    assert v.hang_kind == "python-deadlock"


def test_collective_from_torch_distributed_frames() -> None:
    v = classify(stalled("collective", cpu_percent=0.0, pyspy=pyspy("collective")))
    assert v.hang_kind == "collective"
    assert "distributed_c10d.py:" in v.reason
    assert "in all_reduce" in v.reason


# --- hand-written CUDA and autograd-thread dumps --------------------------------------------------------

SITE = "/usr/lib/python3.11/site-packages"
HEARTBEAT = f"""Thread 0x00007f0000000001 (most recent call first):
  File "{SITE}/nsa_diag/worker/probes.py", line 269 in run
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap
"""
TRAIN_TAIL = f"""  File "{SITE}/nsa_diag/worker/train.py", line 220 in _step
  File "{SITE}/nsa_diag/worker/main.py", line 60 in run
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
CUDA_SYNC = f"""{HEARTBEAT}
Current thread 0x00007f0000000002 (most recent call first):
  File "{SITE}/torch/cuda/__init__.py", line 1083 in synchronize
  File "{SITE}/nsa_diag/worker/inject.py", line 117 in _gpu_spin_synchronize
{TRAIN_TAIL}"""
ITEM = f"""{HEARTBEAT}
Current thread 0x00007f0000000002 (most recent call first):
  File "{SITE}/nsa_diag/worker/train.py", line 209 in _forward
{TRAIN_TAIL}"""
ENGINE_THREAD = f"""{HEARTBEAT}
Thread 0x00007f0000000003 (most recent call first):
  File "{SITE}/nsa_diag/worker/inject.py", line 70 in _deadlock_lock_acquire
  File "{SITE}/nsa_diag/worker/inject.py", line 138 in fire
  File "{SITE}/torch/utils/hooks.py", line 210 in hook

Current thread 0x00007f0000000002 (most recent call first):
  File "{SITE}/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "{SITE}/torch/autograd/__init__.py", line 395 in backward
  File "{SITE}/torch/_tensor.py", line 623 in backward
{TRAIN_TAIL}"""
PYSPY_CUDA = """Thread 4242 (active): "MainThread"
    cudaStreamSynchronize (libcudart.so.12)
    at::native::_local_scalar_dense_cuda (libtorch_cuda.so)
    _forward (nsa_diag/worker/train.py:209)
"""


def cuda_evidence(text: str, **fields: object) -> Evidence:
    return Evidence(
        outcome="stalled", stack_samples=[text, text], where=WHERE, heartbeat_advancing=True, **fields
    )  # type: ignore[arg-type]


def test_cuda_kernel_from_a_synchronize_frame() -> None:
    v = classify(cuda_evidence(CUDA_SYNC, cpu_percent=100.0, gpu_utilization=100.0))
    assert v.hang_kind == "cuda-kernel"
    assert "__init__.py:1083 in synchronize" in v.reason
    assert "GPU 100%" in v.reason


def test_cuda_kernel_from_an_item_line_while_the_gpu_is_busy() -> None:
    sources = {f"{SITE}/nsa_diag/worker/train.py:209": "loss_value = loss.item()"}
    assert classify(
        cuda_evidence(ITEM, cpu_percent=100.0, gpu_utilization=97.0, source_lines=sources)
    ).hang_kind == ("cuda-kernel")
    idle_gpu = classify(cuda_evidence(ITEM, cpu_percent=100.0, gpu_utilization=0.0, source_lines=sources))
    assert idle_gpu.hang_kind != "cuda-kernel"
    native = classify(cuda_evidence(ITEM, cpu_percent=100.0, pyspy=PYSPY_CUDA))
    assert native.hang_kind == "cuda-kernel"
    assert "cudaStreamSynchronize" in native.reason


def test_hook_on_an_autograd_engine_thread_is_the_focus() -> None:
    threads = parse_faulthandler(ENGINE_THREAD)
    focus = focus_thread(threads)
    assert focus is not None
    assert focus.frames[0].func == "_deadlock_lock_acquire"
    sources = {f"{SITE}/nsa_diag/worker/inject.py:70": "lock.acquire()"}
    v = classify(cuda_evidence(ENGINE_THREAD, cpu_percent=0.0, source_lines=sources))
    assert v.hang_kind == "python-deadlock"
    assert "inject.py:70 in _deadlock_lock_acquire" in v.reason


def test_the_workers_heartbeat_thread_is_never_the_focus() -> None:
    only_heartbeat = parse_faulthandler(HEARTBEAT)
    assert focus_thread(only_heartbeat) is None
    v = classify(cuda_evidence(HEARTBEAT, cpu_percent=0.0))
    assert v.hang_kind == "unknown"
    assert "no stack sample" in v.reason


# --- other verdicts -----------------------------------------------------------------------------------


def ok_result(status: str = "ok", reason: str = "2 step(s) done") -> WorkerReport:
    return WorkerReport(status=status, reason=reason, steps_done=2)


def test_pass() -> None:
    v = classify(Evidence(outcome="exited", exit_code=0, worker_result=ok_result()))
    assert (v.verdict, v.hang_kind, v.reason) == ("pass", None, "2 step(s) done")


@pytest.mark.parametrize("status", ["oom", "nonfinite", "grad-missing", "mismatch", "error", "skipped"])
def test_worker_statuses_are_verdicts(status: str) -> None:
    v = classify(Evidence(outcome="exited", exit_code=1, worker_result=ok_result(status, f"why {status}")))
    assert (v.verdict, v.reason) == (status, f"why {status}")


def test_crash_by_signal_names_the_signal_the_error_and_the_frame() -> None:
    fatal = split_samples((RECORDED / "segfault.faulthandler.txt").read_text())[1]
    v = classify(Evidence(outcome="exited", exit_code=-11, signal="SIGSEGV", fatal_stack=fatal, where=WHERE))
    assert v.verdict == "crash"
    assert v.reason.startswith("killed by SIGSEGV (Segmentation fault) at layer 1 backward step 1 in ")
    assert "__init__.py:519 in string_at, called from record_stacks.py:" in v.reason


def test_exit_without_a_result_is_a_crash() -> None:
    v = classify(Evidence(outcome="exited", exit_code=17, where=WHERE, stderr_tail="some\nlast words\n"))
    assert v.verdict == "crash"
    assert "exited with code 17 without a result at layer 1 backward" in v.reason
    assert "stderr: last words" in v.reason
    ok_then_dead = classify(
        Evidence(outcome="exited", exit_code=-6, worker_result=ok_result(), signal="SIGABRT")
    )
    assert ok_then_dead.verdict == "crash"


def test_timeout_is_slow_with_rate_and_eta() -> None:
    rate = Rate(steps_per_s=0.4, events_per_s=23.0, steps_done=2, steps_total=20, eta_s=45.0)
    v = classify(Evidence(outcome="timeout", where=WHERE, timeout_s=6.0, elapsed_s=6.1, rate=rate))
    assert v.verdict == "slow"
    assert v.hang_kind is None
    assert "6 s timeout" in v.reason
    assert "0.4 steps/s" in v.reason
    assert "2/20 steps done" in v.reason
    assert "needs about 45 s more" in v.reason


def timed_out(kind: str, **fields: object) -> Evidence:
    """A worker the timeout stopped: the stacks of ``kind``, idle 2.5 s, a 6 s timeout."""
    evidence = {"outcome": "timeout", "timeout_s": 6.0, "elapsed_s": 6.1, "stalled_for_s": 2.5, **fields}
    return replace(stalled(kind, "lock.acquire()", cpu_percent=0.0), **evidence)  # type: ignore[arg-type]


def test_a_worker_importing_torch_distributed_at_the_timeout_is_slow_not_a_collective_hang() -> None:
    # Seen on a loaded CI machine: selftest's slow case on a Hugging Face model was still in setup when its
    # 6 s timeout came, importing transformers (which imports torch.distributed.tensor): both samples
    # had torch.distributed module code on the stack, under the import machinery, in different places.
    texts = samples("importing")
    assert all("torch/distributed/" in text for text in texts)
    ev = Evidence(
        outcome="timeout", stack_samples=texts, where=None, timeout_s=6.0, elapsed_s=7.3, stalled_for_s=2.0,
        progressed=False, longest_gap_s=None, heartbeat_advancing=True, cpu_percent=48.0, main_state="R",
    )  # fmt: skip
    kind, _ = hang_kind(ev)
    assert kind != "collective"
    assert classify(ev).verdict == "slow"


def test_a_stuck_worker_at_the_timeout_is_a_hang_not_slow() -> None:
    # Issue 15 #1: before step 1 ends the stall limit is long, so a --timeout shorter than it came
    # first and an idle worker was called "still progressing".
    v = classify(timed_out("deadlock", progressed=False, longest_gap_s=0.3))
    assert (v.verdict, v.hang_kind) == ("hang", "python-deadlock")
    assert v.reason.startswith(
        "no progress for 2.5 s at layer 1 backward step 1 when the 6 s timeout ran out"
    )
    assert "lock acquire" in v.reason
    assert classify(timed_out("deadlock", progressed=False)).verdict == "hang"  # no gap seen before


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"progressed": True, "longest_gap_s": 0.3}, id="progress-while-sampled"),
        pytest.param({"progressed": False, "longest_gap_s": 4.0}, id="idle-no-longer-than-gaps-before"),
        pytest.param({"progressed": None}, id="no-beacon"),
    ],
)
def test_a_timeout_is_slow_unless_the_idle_is_unprecedented_and_nothing_moves(fields: dict) -> None:
    assert classify(timed_out("deadlock", **fields)).verdict == "slow"


def test_a_busy_worker_at_the_timeout_is_slow() -> None:
    v = classify(timed_out("busy", progressed=False, cpu_percent=97.0, pyspy=pyspy("busy")))
    assert (v.verdict, v.hang_kind) == ("slow", None)


def exec_into_sleep(**fields: object) -> Evidence:
    """What the executor records of a probed training process that exec'd into ``sleep`` after step 3: its
    beacon and heartbeat stopped with the Python image, no stack samples (sleep takes no SIGUSR1)."""
    evidence = {
        "outcome": "stalled", "where": Where(phase="optimizer", step=3, event="end"), "stalled_for_s": 3.1,
        "heartbeat_advancing": False, "cpu_percent": 0.0, "main_state": "S",
        "main_wchan": "hrtimer_nanosleep", "io_bytes": 0, "program": "sleep 600", "exe": "/usr/bin/sleep",
        "exec_from": "/usr/bin/python3.11",
        **fields,
    }  # fmt: skip
    return Evidence(**evidence)  # type: ignore[arg-type]


def test_a_process_that_exec_d_another_program_is_no_gil_held_hang() -> None:
    # Issue 27 #10: its stopped heartbeat was read as "the GIL is held at no Python frame".
    v = classify(exec_into_sleep())
    assert (v.verdict, v.hang_kind) == ("hang", "unknown")
    assert "GIL" not in v.reason
    assert (
        "the process exec'd into `sleep 600` (no longer Python: /usr/bin/sleep, was python3.11)" in v.reason
    )
    assert v.reason.endswith("sleeping (state S, kernel wchan hrtimer_nanosleep), CPU 0%, no I/O")
    timeout = {"outcome": "timeout", "timeout_s": 6.0, "elapsed_s": 6.1, "progressed": False}
    at_timeout = classify(exec_into_sleep(**timeout))  # idle, not slow
    assert (at_timeout.verdict, at_timeout.hang_kind) == ("hang", "unknown"), at_timeout.reason
    busy = classify(exec_into_sleep(**timeout, cpu_percent=99.0, main_state="R", main_wchan="0"))
    assert busy.verdict == "slow", busy.reason  # a program that computes may still end


def test_an_idle_program_that_reported_no_progress_is_a_hang_at_the_timeout_not_slow() -> None:
    # Issue 27 #13: `watch --timeout 5 -- sleep 60` was slow, "progress continued ... 0 steps at 0 steps/s".
    rate = Rate(steps_done=0, steps_per_s=0.0, events_per_s=0.0, steps_total=None)
    idle = Evidence(
        outcome="timeout", timeout_s=5.0, elapsed_s=5.2, rate=rate, cpu_percent=0.0, main_state="S",
        main_wchan="hrtimer_nanosleep", io_bytes=0, program="sleep 60", exe="/usr/bin/sleep",
    )  # fmt: skip
    v = classify(idle)
    assert (v.verdict, v.hang_kind) == ("hang", "unknown")
    assert v.reason == (
        "no progress reported when the 5 s timeout ran out, and idle; `sleep 60` is not Python (no probe): "
        "sleeping (state S, kernel wchan hrtimer_nanosleep), CPU 0%, no I/O"
    )
    busy = classify(replace(idle, cpu_percent=98.0, main_state="R", main_wchan="0"))
    assert busy.verdict == "slow"
    assert "no progress reported, and not idle" in busy.reason
    assert "progressing" not in busy.reason


def test_interrupted_is_an_error() -> None:
    v = classify(Evidence(outcome="interrupted", interrupted_by="SIGINT", elapsed_s=3.0, where=WHERE))
    assert v.verdict == "error"
    assert v.reason == "interrupted by SIGINT after 3.0 s at layer 1 backward step 1"


def test_reasons_are_one_line() -> None:
    for kind in ("deadlock", "event", "busy", "gil-hog", "collective", "native-busy"):
        v = classify(stalled(kind, cpu_percent=0.0, pyspy=pyspy(kind)))
        assert "\n" not in v.reason


def test_native_frames_that_compute_are_not_read_as_waits() -> None:
    text = """Thread 4242 (idle): "MainThread"
    at::native::index_select_out_cpu_ (libtorch_cpu.so)
    _fault (record_stacks.py:51)
    <module> (record_stacks.py:125)
"""
    kind, why = hang_kind(stalled("native-busy", cpu_percent=5.0, pyspy=text))
    assert kind == "unknown"
    assert "waiting in" not in why


def test_a_worker_that_finished_but_does_not_exit_is_a_hang_that_says_so() -> None:
    done = Where(phase="done", event="end")
    ev = Evidence(
        outcome="stalled",
        worker_result=ok_result("grad-missing"),
        stack_samples=["Current thread 0x00007f0a0f3bdb80 (most recent call first):\n  Garbage-collecting\n"],
        where=done,
        stalled_for_s=31.0,
        heartbeat_advancing=False,
    )
    v = classify(ev)
    assert v.verdict == "hang"
    assert v.reason.startswith(
        "the worker reported grad-missing but did not exit: no progress for 31.0 s at done;"
    )


@contextlib.contextmanager
def _child_with_handler(code: str, *, stdin: bool = False) -> Iterator[subprocess.Popen[str]]:
    """A real child running ``code``, once it has printed "ready" and registered its SIGUSR1 handler;
    killed on the way out."""
    from nsa_diag.watchdog import catches_sigusr1

    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE if stdin else None, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 5
        while catches_sigusr1(child.pid) is False and time.monotonic() < deadline:
            time.sleep(0.01)
        yield child
    finally:
        child.kill()
        child.wait()


def test_wait_for_dump_waits_past_the_header_for_the_dump(tmp_path: Path) -> None:
    """A real SIGUSR1 dump of a child: the wait ends with the dump in the file, not at the header alone
    (a late dump on a loaded machine once left samples empty)."""
    path = tmp_path / "stacks.txt"
    code = (
        "import faulthandler, signal, sys, time\n"
        f"f = open({str(path)!r}, 'a')\n"
        "faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    with _child_with_handler(code) as child:
        header_end = stack_samples.request_sample(child.pid, path, 1)
        assert header_end is not None
        stack_samples.wait_for_dump(path, header_end, timeout_s=5)
        assert "<string>" in path.read_text(), path.read_text()  # the child's frame, from its dump
    assert stack_samples.request_sample(child.pid, path, 2) is None  # gone


def test_wait_for_dump_waits_for_a_late_handler(tmp_path: Path) -> None:
    """The worker's handler runs 1.5 s after the signal (blocked, as on a loaded machine): the wait still
    ends with the dump in the file, before the next sample's header could land ahead of it."""
    path = tmp_path / "stacks.txt"
    code = (
        "import faulthandler, signal, sys, time\n"
        f"f = open({str(path)!r}, 'a')\n"
        "faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"  # the signal is pending from here
        "time.sleep(1.5)\n"
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1])\n"
        "time.sleep(30)\n"
    )
    with _child_with_handler(code, stdin=True) as child:
        assert child.stdin is not None
        header_end = stack_samples.request_sample(child.pid, path, 1)
        assert header_end is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        stack_samples.wait_for_dump(path, header_end)
        assert "<string>" in path.read_text(), path.read_text()


def test_a_sample_the_signal_handler_does_not_write_comes_from_the_heartbeat_thread(tmp_path: Path) -> None:
    """SIGUSR1 blocked in every thread of a real child (its handler never runs): `take_sample` asks the
    worker's real heartbeat thread, which dumps every thread under the sample's header."""
    path = tmp_path / artifacts.STACKS
    code = (
        "import faulthandler, signal, sys, threading, time\n"
        "from pathlib import Path\n"
        "from nsa_diag.beacon import BeaconWriter\n"
        "from nsa_diag.worker.probes import Heartbeat\n"
        f"case = Path({str(tmp_path)!r})\n"
        "stacks = open(case / 'stacks.txt', 'ab')\n"
        "faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])  # inherited by the heartbeat thread\n"
        "Heartbeat(BeaconWriter(case / 'beacon.bin'), case, on_dump=lambda: None, stacks=stacks).start()\n"
        "print('ready', flush=True)\n"
        "def _deadlock_here():\n"
        "    lock = threading.Lock(); lock.acquire(); lock.acquire(timeout=30)\n"
        "_deadlock_here()\n"
    )
    with _child_with_handler(code) as child:
        writer = stack_samples.take_sample(child.pid, tmp_path, path, 1, True)
        assert writer == "heartbeat thread", path.read_text()
        threads = parse_faulthandler(path.read_text().split("\n", 1)[1])
        assert any(f.func == "_deadlock_here" for t in threads for f in t.frames), path.read_text()
        # with the heartbeat stopped (a held GIL) nobody else is asked: the sample stays empty
        assert stack_samples.take_sample(child.pid, tmp_path, path, 2, False) is None


# --- pauses: not stuck, whatever the stall limit says ---------------------------------------------------


def dump(*frames: tuple[str, int, str]) -> str:
    """A faulthandler dump of the main thread, innermost frame first."""
    lines = ["Current thread 0x00007f0000000001 (most recent call first):"]
    lines += [f'  File "{file}", line {line} in {func}' for file, line, func in frames]
    return "\n".join(lines) + "\n"


TRAIN = "/home/me/project/train.py"
SLEEP = dump((TRAIN, 33, "save_checkpoint"), (TRAIN, 50, "main"), (TRAIN, 54, "<module>"))
GETITEM = dump((TRAIN, 15, "__getitem__"), ("/x/torch/utils/data/_utils/fetch.py", 52, "fetch"))
WAITS_FOR_BATCH = dump(
    ("/usr/lib/python3.11/selectors.py", 415, "select"),
    ("/usr/lib/python3.11/multiprocessing/connection.py", 930, "wait"),
    ("/x/torch/utils/data/dataloader.py", 1291, "_try_get_data"),
    (TRAIN, 25, "main"),
)


def test_a_sleep_is_no_work_a_hang_past_the_stall_that_names_its_loop() -> None:
    """Issue 48: a wait made of sleeps does no work; past the stall it is a hang whatever it waits for, and
    the loop around the sleep says what it checks."""
    ev = Evidence(
        outcome="stalled", stack_samples=[SLEEP, SLEEP], cpu_percent=0.0, heartbeat_advancing=True,
        source_lines={f"{TRAIN}:33": "time.sleep(PAUSE_S)"}, where=WHERE,
    )  # fmt: skip
    assert pause_reason(ev) is None
    kind, why = hang_kind(ev)
    assert kind == "python-deadlock"
    assert why == (
        "sleeping at `time.sleep(PAUSE_S)` at train.py:33 in save_checkpoint in both stack samples, CPU 0%: "
        "no work, only sleeps"
    )
    polling = replace(ev, loops={f"{TRAIN}:33": "`while not os.path.exists(path):` at train.py:32"})
    assert hang_kind(polling)[1] == (
        "sleeping in the loop `while not os.path.exists(path):` at train.py:32, at `time.sleep(PAUSE_S)` at "
        "train.py:33 in save_checkpoint in both stack samples, CPU 0%: no work, only sleeps: what the loop "
        "checks for does not come"
    )
    assert classify(polling).verdict == "hang"
    # past a time box, idle for longer than any gap before, with no work: a hang too, not slow
    late = classify(
        replace(
            ev, outcome="timeout", progressed=False, timeout_s=300, stalled_for_s=200.0, longest_gap_s=1.0
        )
    )
    assert late.verdict == "hang"


def test_a_lock_order_deadlock_names_both_threads_what_each_holds_and_waits_for(tmp_path: Path) -> None:
    """Issue 48: the cycle, where the stacks show it: each thread waits to take (its line's ``with``) the
    lock the other holds (a ``with`` around one of its frames); the probe names the threads."""
    script = tmp_path / "train.py"
    script.write_text(
        "import threading\n"  # 1
        "metrics_lock = threading.Lock()\n"  # 2
        "state_lock = threading.Lock()\n"  # 3
        "def saver():\n"  # 4
        "    with state_lock:\n"  # 5
        "        with metrics_lock:\n"  # 6
        "            pass\n"  # 7
        "def step(self):\n"  # 8
        "    with self.metrics_lock:\n"  # 9
        "        with state_lock:\n"  # 10
        "            pass\n"  # 11
    )
    path = str(script)
    sample = (
        "Thread 0x00007f00000000aa (most recent call first):\n"
        f'  File "{path}", line 6 in saver\n'
        '  File "/usr/lib/python3.11/threading.py", line 982 in run\n'
        "\n"
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        f'  File "{path}", line 10 in step\n'
        f'  File "{path}", line 12 in <module>\n'
    )
    threads = parse_faulthandler(sample)
    ev = Evidence(
        outcome="stalled", stack_samples=[sample, sample], cpu_percent=0.0, heartbeat_advancing=True,
        source_lines=stack_samples.source_lines(threads), withs=stack_samples.enclosing_withs(threads),
        thread_names={"0x00007f00000000aa": "checkpoint-saver"}, where=WHERE,
    )  # fmt: skip
    kind, why = hang_kind(ev)
    assert kind == "python-deadlock", why
    assert why.endswith(
        "; a lock-order deadlock: the main thread holds `self.metrics_lock` (train.py:9) and waits for "
        "`state_lock` at train.py:10 in step; thread checkpoint-saver holds `state_lock` (train.py:5) and "
        "waits for `metrics_lock` at train.py:6 in saver"
    ), why
    # one thread waiting on a lock nobody's stack shows held: no cycle claimed
    alone = replace(ev, stack_samples=[sample.split("\n\n")[1]] * 2)
    assert "lock-order" not in hang_kind(alone)[1]


def test_a_wait_for_child_programs_that_do_nothing_names_them() -> None:
    waits = dump(
        ("/usr/lib/python3.11/subprocess.py", 2004, "_try_wait"),
        ("/usr/lib/python3.11/subprocess.py", 1264, "wait"),
        (TRAIN, 33, "sync_checkpoint"),
    )
    ev = Evidence(
        outcome="stalled", stack_samples=[waits, waits], cpu_percent=0.0, heartbeat_advancing=True,
        where=WHERE, children_idle=("pid 41 `cat /mnt/backup/pipe` at CPU 0%",),
    )  # fmt: skip
    kind, why = hang_kind(ev)
    assert kind == "python-deadlock", why
    assert "called from train.py:33 in sync_checkpoint" in why
    assert why.endswith(
        "; the child program(s) it waits for do no work: pid 41 `cat /mnt/backup/pipe` at CPU 0%"
    )


def test_the_loop_around_a_frame_is_read_from_its_source(tmp_path: Path) -> None:
    script = tmp_path / "poll.py"
    script.write_text(
        "import os, time\n"
        "for step in range(3):\n"
        "    path = '/data/shard_7'\n"
        "    while not os.path.exists(path):  # the next shard\n"
        "        time.sleep(1)\n"
    )
    thread = ThreadStack("0x1", (Frame(str(script), 5, "<module>"),))
    assert stack_samples.enclosing_loops([thread]) == {
        f"{script}:5": "`while not os.path.exists(path):` at poll.py:4"
    }
    script.write_text("def f(:\n")  # not Python: nothing, never an error
    assert stack_samples.enclosing_loops([thread]) == {}


def test_frames_that_move_between_samples_with_cpu_are_work() -> None:
    a = dump((TRAIN, 19, "forward"), (TRAIN, 40, "main"))
    b = dump((TRAIN, 21, "forward"), (TRAIN, 40, "main"))
    moving = Evidence(outcome="stalled", stack_samples=[a, b], cpu_percent=97.0, heartbeat_advancing=True)
    assert pause_reason(moving) == (
        "its innermost frame moved between the stack samples (train.py:19 in forward -> train.py:21 in "
        "forward) at CPU 97%"
    )
    assert pause_reason(replace(moving, cpu_percent=2.0)) is None  # a poll loop waking now and then
    spin = replace(moving, stack_samples=[a, a])
    assert pause_reason(spin) is None
    assert hang_kind(spin)[0] == "python-busy"
    assert hang_kind(moving)[0] == "unknown"  # busy, but not on one frame: never python-busy


def test_a_spin_in_a_frozen_module_names_the_jobs_line_that_called_it() -> None:
    """`while not os.path.exists(path): pass`: from Python 3.11 the innermost frame is the frozen
    ``<frozen genericpath>``, Python's own library: the reason names the job's line that calls it."""
    spin = dump(("<frozen genericpath>", 19, "exists"), (TRAIN, 6, "wait_for_shard"), (TRAIN, 16, "main"))
    ev = Evidence(outcome="stalled", stack_samples=[spin, spin], cpu_percent=73.0, heartbeat_advancing=True)
    kind, why = hang_kind(ev)
    assert kind == "python-busy"
    assert why.startswith(
        "busy in Python at <frozen genericpath>:19 in exists, called from train.py:6 in wait_for_shard"
    )


def test_a_batch_its_dataloader_worker_produces_is_a_pause_an_idle_or_stuck_worker_is_not() -> None:
    main = Evidence(
        outcome="stalled", stack_samples=[WAITS_FOR_BATCH, WAITS_FOR_BATCH], cpu_percent=0.0,
        heartbeat_advancing=True,
    )  # fmt: skip
    assert pause_reason(main) is None
    producing = replace(main, workers={"pid 12": "CPU 98%", "pid 13": None})
    assert pause_reason(producing) == (
        "waiting for its next batch, which its DataLoader worker is producing (pid 12: CPU 98%)"
    )
    assert pause_reason(replace(main, workers={"pid 12": None, "pid 13": None})) is None


def test_checkpoint_io_and_a_progress_event_are_pauses() -> None:
    saving = dump(("/x/torch/serialization.py", 900, "_save"), (TRAIN, 31, "save_checkpoint"))
    ev = Evidence(
        outcome="stalled", stack_samples=[saving, saving], cpu_percent=3.0, heartbeat_advancing=True
    )
    assert (pause_reason(ev) or "").startswith("reading or writing a checkpoint (torch.serialization")
    quiet = Evidence(outcome="stalled", stack_samples=[SLEEP, SLEEP], cpu_percent=1.0, io_bytes=50 << 20)
    assert pause_reason(quiet) == "it read or wrote 50.0 MiB while the evidence was taken"
    assert pause_reason(Evidence(outcome="stalled", progressed=True)) == (
        "a progress event came while the evidence was taken"
    )


def test_a_deadlock_is_no_pause() -> None:
    ev = stalled("deadlock", "lock.acquire()")
    assert pause_reason(ev) is None
    assert hang_kind(ev)[0] == "python-deadlock"


def _pyspy_main(*native: str) -> str:
    """A py-spy --native dump whose main thread is in ``native`` (innermost first) under a backward."""
    lines = ["Process 1: python train.py", "", 'Thread 1 (active): "MainThread"']
    lines += [f"    {func} (libtorch_cpu.so)" for func in native]
    lines += ["    _engine_run_backward (torch/autograd/graph.py:979)", "    main (train.py:40)"]
    return "\n".join(lines) + "\n"


def test_native_frames_that_change_between_pyspy_dumps_are_work_a_native_spin_is_not() -> None:
    main = dump(("/x/torch/autograd/graph.py", 979, "_engine_run_backward"), (TRAIN, 40, "main"))
    ev = Evidence(
        outcome="stalled", stack_samples=[main, main], cpu_percent=190.0, heartbeat_advancing=True,
        pyspy=_pyspy_main("mkl_blas_avx512_sgemm_kernel_0", "at::native::addmm"),
        pyspy_more=(_pyspy_main("at::native::add_kernel", "at::TensorIteratorBase::for_each"),),
    )  # fmt: skip
    assert pause_reason(ev) == (
        "its native frames moved between two py-spy dumps (mkl_blas_avx512_sgemm_kernel_0 -> "
        "at::native::add_kernel) at CPU 190%"
    )
    spin = replace(ev, pyspy_more=(ev.pyspy,))
    assert pause_reason(spin) is None
    waiting = replace(ev, pyspy_more=(_pyspy_main("pthread_cond_wait", "c10::Notifier"),))
    assert pause_reason(waiting) is None  # a wait in one dump is no computation


def test_a_python_m_main_thread_is_found_in_a_sample_the_heartbeat_thread_wrote() -> None:
    """Recorded on an H200: `run --compile inductor --inject gpu-spin:layer=1,phase=forward` (our worker,
    ``python -m``). SIGUSR1 wrote nothing, so the heartbeat thread dumped the stacks: the current thread is
    the heartbeat, and the main thread, waiting for the GPU, starts at ``<frozen runpy>``. Taken for an
    inductor compile worker's timer thread, it was a python-busy hang; it is a cuda-kernel one."""
    texts = samples("gpu_spin_compiled")
    threads = parse_faulthandler(texts[0])
    focus = focus_thread(threads)
    assert focus is not None
    assert focus.is_main
    assert focus.python_frames[0].func == "synchronize"
    assert focus.python_frames[-1].file == "<frozen runpy>"
    evidence = Evidence(
        outcome="stalled", stack_samples=texts, where=WHERE, heartbeat_advancing=True, cpu_percent=100.0,
        gpu_utilization=100.0,
    )  # fmt: skip
    v = classify(evidence)
    assert v.hang_kind == "cuda-kernel", v.reason
    assert "in synchronize" in v.reason


SUBPROCESS_WAIT = """Current thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/subprocess.py", line 2004 in _try_wait
  File "/usr/lib/python3.11/subprocess.py", line 2046 in _wait
  File "/usr/lib/python3.11/subprocess.py", line 1264 in wait
  File "/usr/lib/python3.11/subprocess.py", line 550 in run
  File "/jobs/external_tool.py", line 26 in main
  File "/jobs/external_tool.py", line 31 in <module>
"""


def test_a_process_waiting_for_a_busy_program_is_paused() -> None:
    """Waiting in subprocess for a child program (no probe: a compiler, a packer) that uses the CPU is a
    pause; waiting for one that does not is not (the watch test runs both for real)."""
    ev = Evidence(
        outcome="stalled", stack_samples=[SUBPROCESS_WAIT, SUBPROCESS_WAIT], where=WHERE, cpu_percent=1.0,
        heartbeat_advancing=True, children_working=("pid 4242 (cc1plus) at CPU 97%",),
    )  # fmt: skip
    assert (
        pause_reason(ev)
        == "it waits for its child process(es), which are working: pid 4242 (cc1plus) at CPU 97%"
    )
    assert pause_reason(replace(ev, children_working=())) is None


def test_busy_descendants_are_the_programs_that_use_the_cpu_but_python() -> None:
    """A shell loop (busy), a sleeping shell (idle) and a Python loop (left to its own evidence)."""
    kids = [
        subprocess.Popen(["sh", "-c", "timeout 5 sh -c 'while :; do :; done'"]),
        subprocess.Popen(["sleep", "5"]),
        subprocess.Popen([sys.executable, "-c", "while True: pass"]),
    ]
    try:
        time.sleep(0.3)
        before = procfs.descendants_cpu(os.getpid())
        assert {k.pid for k in kids} <= set(before)
        time.sleep(1.0)
        busy = procfs.busy_descendants(before, os.getpid(), 1.0, 5.0)
    finally:
        for kid in kids:
            kid.kill()
            kid.wait()
    assert any(" (sh) at CPU " in b for b in busy), busy
    assert not any(f"pid {kids[1].pid} " in b or f"pid {kids[2].pid} " in b for b in busy), busy
