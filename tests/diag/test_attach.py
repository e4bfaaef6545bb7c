"""`nsa-diag attach PID` on real running jobs (scripts in tests/diag/jobs/attach_*.py, written as a user
writes them, importing nothing of nsa-diag): what it says about a deadlocked, a busy-waiting and a sleeping
job, a job stuck in backward beside its idle DataLoader workers, and two torchrun ranks (one spinning, one
blocked), and that each job is left running and unchanged (it still finishes, exit code 0, the same
output); a process without a SIGUSR1 handler gets no signal (it would die of it). attach never guesses:
CPU alone is never progress. Plus the judgement alone on constructed evidence, the probe's files read
through the contract, and bad PIDs (one line, exit 2)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from diag_cli import cli_env, run_cli

from nsa_diag.activity import judge_process, judge_tree, tree_roles
from nsa_diag.app import run_cli as cli_main
from nsa_diag.beacon import BeaconState, BeaconWriter
from nsa_diag.errors import UsageError
from nsa_diag.evidence import probefiles
from nsa_diag.evidence.live import (
    ProcessInfo,
    ProcessObservation,
    Sample,
    TreeObservation,
    check_target,
    other_user_refusal,
    process_info,
)
from nsa_diag.evidence.procfs import waits_for_file_lock, wchan
from nsa_diag.session.attach import summary_markdown

JOBS = Path(__file__).resolve().parent / "jobs"
READY_TIMEOUT_S = 30.0


@dataclass
class Job:
    proc: subprocess.Popen[str]
    stdout: Path
    stderr: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finish(self, timeout: float = 30.0) -> tuple[int, str, str]:
        """Tell the job to go on (a line on stdin), wait for its normal end: (exit code, stdout, stderr)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.close()
        code = self.proc.wait(timeout=timeout)
        return code, self.stdout.read_text(), self.stderr.read_text()


def _start(
    folder: Path, name: str, *args: str, env: dict[str, str] | None = None, launcher: tuple[str, ...] = (),
    ready_count: int = 1,
) -> Job:  # fmt: skip
    """Start a job script (with ``launcher``, e.g. torchrun's arguments, before it) with stdin a pipe and
    stdout/stderr into files in ``folder``; wait for ``ready_count`` "ready" lines."""
    out, err = folder / f"{name}.out", folder / f"{name}.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [*(launcher or (sys.executable,)), str(JOBS / f"{name}.py"), *args],
            stdin=subprocess.PIPE, stdout=stdout, stderr=stderr, text=True,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )  # fmt: skip
    job = Job(proc, out, err)
    deadline = time.monotonic() + READY_TIMEOUT_S * (3 if launcher else 1)
    try:
        while out.read_text().count("ready") < ready_count:
            assert proc.poll() is None, f"{name} ended early: {err.read_text()}"
            assert time.monotonic() < deadline, f"{name} did not get ready: {err.read_text()}"
            time.sleep(0.05)
    except BaseException:
        _kill(job)
        raise
    return job


def _kill(job: Job) -> None:
    """Kill every process of the job still running by its pid (torchrun's ranks live in sessions of their
    own)."""
    if job.proc.poll() is None:
        try:
            tree = [job.proc.pid, *(p.pid for p in psutil.Process(job.pid).children(recursive=True))]
        except psutil.Error:
            tree = [job.proc.pid]
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.proc.wait()


@pytest.fixture
def start_job(tmp_path: Path) -> Iterator[Any]:
    """`_start` in the test's folder; every process of a job still running at the end of the test is
    killed."""
    started: list[Job] = []

    def start(name: str, *args: str, **options: Any) -> Job:
        started.append(_start(tmp_path, name, *args, **options))
        return started[-1]

    yield start
    for job in started:
        _kill(job)


# Rounds that settle the state of a job these tests start, quicker than the default watch of up to 10 s
# (tested once, on the deadlocked job).
QUICK = ("--samples", "3", "--interval", "0.5")


def attach(
    pid: int, out: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], str]:
    proc = run_cli("attach", str(pid), "--out", out, "--json", *args, timeout=120, env=env)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {}, proc.stderr


def path_without_pyspy() -> str:
    """PATH with no folder that holds py-spy: what a machine without py-spy sees."""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(f for f in folders if f and not (Path(f) / "py-spy").exists())


def by_pid(record: dict[str, Any], pid: int) -> dict[str, Any]:
    return next(p for p in record["processes"] if p["pid"] == pid)


@dataclass
class Attached:
    """One attach run to a job, and how the job ended once told to go on after it."""

    pid: int
    code: int
    record: dict[str, Any]
    err: str
    runs: Path  # attach's --out
    finished: tuple[int, str, str]  # the job's exit code, stdout and stderr


@pytest.fixture(scope="module")
def sleeping(tmp_path_factory: pytest.TempPathFactory) -> Attached:
    """attach_sleep, with secrets on its command line and in its environment (--hub's value is only known as
    a secret from the job's environment: MY_TOKEN holds it), attached once with `QUICK` rounds, then told to
    finish. The secret, sleeping-job and report tests below read this one run (an attach and a job each
    were ~5 s of CPU)."""
    folder = tmp_path_factory.mktemp("sleeping")
    job = _start(
        folder, "attach_sleep", "--api-key", "k-9f8e7d6c", "--hub", "tok-5a4b3c2d",
        env={"MY_TOKEN": "tok-5a4b3c2d"},
    )  # fmt: skip
    try:
        code, record, err = attach(job.pid, folder / "runs", *QUICK)
        finished = job.finish()
    finally:
        _kill(job)
    return Attached(job.pid, code, record, err, folder / "runs", finished)


def test_no_file_records_a_secret_of_the_jobs_command_line_or_environment(sleeping: Attached) -> None:
    assert sleeping.code == 1, sleeping.err
    assert "k-9f8e7d6c" not in json.dumps(sleeping.record)  # nor on the console
    assert "tok-5a4b3c2d" not in json.dumps(sleeping.record)
    written = [p for p in sleeping.runs.rglob("*") if p.is_file()]
    assert written
    for path in written:
        data = path.read_bytes()
        for value in (b"k-9f8e7d6c", b"tok-5a4b3c2d"):
            assert value not in data, f"{path.name} records {value!r}"


def test_deadlocked_job_is_python_deadlock_and_finishes_unchanged(start_job: Any, tmp_path: Path) -> None:
    """The default watch: nothing moves, so attach watches the whole 10 s (a round a second) and asks for
    a dump at 0, 1, 4, 7 and 10 s: the same frame in all five."""
    job = start_job("attach_deadlock")
    code, record, err = attach(job.pid, tmp_path / "runs")
    assert code == 1, err
    assert (record["state"], record["hang_kind"]) == ("stalled", "python-deadlock"), record["reason"]
    assert "lock.acquire()" in record["reason"]
    assert "attach_deadlock.py:24" in record["reason"]
    assert "in all 5 stack samples" in record["reason"]
    assert 9.5 <= record["observed_s"] < 30, record["observed_s"]
    assert record["samples"] == 11
    me = by_pid(record, job.pid)
    assert (me["role"], me["state"]) == ("training", "stalled")
    assert me["sigusr1_caught"]
    assert me["signals_sent"] == 5
    assert me["stack_samples"] == 5
    run_dir = next((tmp_path / "runs").iterdir())
    for name in ("env.json", "result.json", "summary.md", f"processes/{job.pid}/proc.json"):
        assert (run_dir / name).is_file(), name
    assert "attach_deadlock.py" in (run_dir / f"processes/{job.pid}/stacks.txt").read_text()
    assert job.proc.poll() is None  # still running, untouched
    code, stdout, stderr = job.finish()
    assert code == 0
    assert stdout == "step 1 loss 332.8335\nready\nstep 2 done\n"
    # its own handler wrote the five dumps attach asked for into its stderr (two threads each), nothing else
    assert stderr.count("most recent call first") == 10
    assert "Traceback" not in stderr


def test_a_job_blocked_on_a_file_lock_names_the_process_that_holds_it(tmp_path: Path) -> None:
    """tests/diag/jobs/flock_checkpoint.py blocks in fcntl.flock at its checkpoint save while another
    process holds the shared folder's lock: stalled, a file lock wait, the lock file and its holder named
    (from its stacks with py-spy, from its wait channel without)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    lock = shared / "checkpoints.lock"
    hold = "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(300)"  # noqa: E501
    holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdout=subprocess.PIPE, text=True)
    job: subprocess.Popen[str] | None = None
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "job.out", "w") as out:
            job = subprocess.Popen(
                [sys.executable, str(JOBS / "flock_checkpoint.py")], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "CHECKPOINT_DIR": str(shared)}, text=True,
            )  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not waits_for_file_lock(wchan(job.pid)):
            assert job.poll() is None, (tmp_path / "job.out").read_text()
            assert time.monotonic() < deadline, (tmp_path / "job.out").read_text()
            time.sleep(0.05)
        code, record, err = attach(job.pid, tmp_path / "runs", *QUICK)
        assert job.poll() is None  # untouched
    finally:
        for proc in (holder, job):
            if proc is not None:
                proc.kill()
                proc.wait()
    assert code == 1, err
    assert record["state"] == "stalled", record["reason"]
    assert "file lock" in record["reason"]
    assert f"{lock} (flock, pid {holder.pid}:" in record["reason"], record["reason"]


def test_busy_loop_at_one_frame_is_unclear_not_progressing(start_job: Any, tmp_path: Path) -> None:
    """A job spinning on a flag uses a core with the same innermost frame in every sample. That is no proof
    of work: one long computation looks the same from outside (attach once called it progressing from
    its CPU alone). It is not proof of a hang either: unclear (exit 1), python-busy, and the reason says
    what would tell."""
    job = start_job("attach_busy")
    code, record, err = attach(job.pid, tmp_path / "runs", *QUICK)
    assert code == 1, err
    assert (record["state"], record["hang_kind"]) == ("unclear", "python-busy"), record["reason"]
    assert "`while not told: pass` at attach_busy.py:24" in record["reason"]
    assert "look alike" in record["reason"]
    assert "nsa-diag watch" in record["reason"]
    me = by_pid(record, job.pid)
    assert me["state"] == "unclear"
    assert me["progress"].get("by") is None
    assert me["cpu_percent"] >= 20 or me["runnable_percent"] >= 50, me
    code, stdout, _ = job.finish()
    assert (code, stdout) == (0, "ready\ndone\n")


def test_sleeping_job_and_its_child_get_no_signal(sleeping: Attached) -> None:
    """Neither process catches SIGUSR1: attach sends none (its default action would kill them). The job
    naps in time.sleep: paused (no work while attach watched; `watch` calls it a hang past its stall limit),
    seen in py-spy's samples or, without
    py-spy, in its main thread's kernel wait channel; its child is a helper, never the culprit. Both live
    on and finish normally."""
    code, record, err = sleeping.code, sleeping.record, sleeping.err
    assert code == 1, err
    assert (record["state"], record["hang_kind"], record["focus_pid"]) == ("paused", None, sleeping.pid), (
        record
    )
    assert "sleeping" in record["reason"]
    assert "no work, only sleeps" in record["reason"]
    assert len(record["processes"]) == 2  # the job and its child
    assert [p["role"] for p in record["processes"]] == ["training", "helper"]
    for p in record["processes"]:
        assert p["sigusr1_caught"] is False
        assert p["signals_sent"] == 0
        assert p["sigusr1"].startswith("not signalled: no SIGUSR1 handler")
        assert p["stack_samples"] == 0
        if not record["pyspy_installed"]:
            assert "no stack" in p["why"]
    assert "py-spy" in (record["pyspy_advice"] or "") or record["pyspy_installed"]
    assert sleeping.finished == (0, "ready\nchild done\nchild exited with 0\n", "")


@pytest.mark.slow
def test_deadlock_in_backward_names_the_training_process_not_its_idle_workers(
    start_job: Any, tmp_path: Path
) -> None:
    """A job stuck in backward (its hook waits for a lock) with two DataLoader workers idle, waiting for
    indices (they catch SIGUSR1 too: forked after the job registered faulthandler). The verdict, its focus
    and its frame are the training process's; the workers are idle DataLoader workers, with or without
    --no-children; attached alone, a worker is not judged as the job."""
    job = start_job("attach_backward_workers")
    code, record, err = attach(job.pid, tmp_path / "runs", *QUICK)
    assert code == 1, err
    assert (record["state"], record["hang_kind"]) == ("stalled", "python-deadlock"), record["reason"]
    assert record["focus_pid"] == job.pid
    assert record["reason"].startswith(f"pid {job.pid}: blocked in ")
    assert "`with stats_lock:` at attach_backward_workers.py:30 in record_grad" in record["reason"]
    workers = [p for p in record["processes"] if p["pid"] != job.pid]
    assert len(workers) == 2
    for p in workers:
        assert (p["role"], p["state"]) == ("dataloader-worker", "idle"), p
        assert p["why"].startswith("idle DataLoader worker"), p["why"]
        assert f"pid {p['pid']}: idle DataLoader worker" in record["reason"]

    code, alone, err = attach(job.pid, tmp_path / "runs", *QUICK, "--no-children")
    assert code == 1, err
    assert (alone["state"], alone["focus_pid"], len(alone["processes"])) == ("stalled", job.pid, 1)
    assert "`with stats_lock:`" in alone["reason"]

    worker = workers[0]["pid"]
    code, one, err = attach(worker, tmp_path / "runs", *QUICK, "--no-children")
    assert code == 1, err
    assert (one["state"], one["focus_pid"]) == ("unclear", None), one["reason"]
    assert one["reason"].startswith("no training process among the processes watched")
    assert f"attach its training process, pid {job.pid}" in one["reason"]

    code, stdout, _ = job.finish(timeout=60)
    assert code == 0
    assert stdout.splitlines()[:4] == ["step 1 done", "step 2 done", "ready", "flushed 2 gradient norms"]
    assert stdout.splitlines()[-1] == "step 4 done"


@pytest.mark.slow
def test_ranks_one_spinning_one_blocked_are_unclear_without_stacks_and_stalled_with(
    start_job: Any, tmp_path: Path
) -> None:
    """Two gloo ranks under torchrun: rank 0 waits in all_reduce at 100% CPU (its progress thread
    busy-waits), rank 1 is blocked on an event. Without any stack (no py-spy on PATH, --no-signal) one
    rank's CPU proves nothing: unclear, saying what would settle it; with the ranks' own faulthandler
    dumps: stalled, rank 1 the minority rank, blocked in `go.wait()`. torchrun's agent is the launcher."""
    torchrun = Path(sys.executable).with_name("torchrun")
    job = start_job(
        "attach_ranks", launcher=(str(torchrun), "--standalone", "--nproc-per-node", "2"),
        env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}, ready_count=2,
    )  # fmt: skip
    blind = {"PATH": path_without_pyspy(), "NSA_DIAG_PYSPY": "none"}  # not the one beside nsa-diag either
    code, record, err = attach(job.pid, tmp_path / "runs", *QUICK, "--no-signal", env=blind)
    assert code == 1, err
    assert not record["pyspy_installed"]
    assert record["state"] == "unclear", record["reason"]
    roles = {p["rank"]: p["role"] for p in record["processes"]}
    assert roles == {None: "launcher", 0: "rank", 1: "rank"}, record["processes"]
    rank0 = next(p for p in record["processes"] if p["rank"] == 0)
    assert record["focus_pid"] == rank0["pid"]
    assert rank0["state"] == "unclear"
    assert rank0["cpu_percent"] >= 20 or rank0["runnable_percent"] >= 50, rank0
    assert "no stack to tell work from a spin" in record["reason"]
    assert "what would settle it: py-spy installed" in record["reason"]
    assert "drop --no-signal" in record["reason"]
    assert "nsa-diag watch" in record["reason"]
    assert "waiting on its ranks" in record["reason"]

    code, record, err = attach(job.pid, tmp_path / "runs", *QUICK, env=blind)
    assert code == 1, err
    assert (record["state"], record["hang_kind"]) == ("stalled", "python-deadlock"), record["reason"]
    rank1 = next(p for p in record["processes"] if p["rank"] == 1)
    assert (record["focus_pid"], record["minority_ranks"]) == (rank1["pid"], [1])
    assert record["reason"].startswith(f"rank 1 (pid {rank1['pid']}): blocked in threading wait")
    assert "`go.wait()` at attach_ranks.py" in record["reason"]
    assert "minority rank(s) 1" in record["reason"]
    assert "(collective)" in record["reason"]  # rank 0, named as what it is

    code, stdout, _ = job.finish(timeout=60)
    assert code == 0
    assert sorted(line for line in stdout.splitlines() if "step 2" in line) == [
        "rank 0 step 2 done: [4.0, 4.0, 4.0, 4.0]",
        "rank 1 step 2 done: [4.0, 4.0, 4.0, 4.0]",
    ]


def _probe_folder(probe_dir: Path, pid: int, started: float, sigusr1: str) -> Path:
    folder = probefiles.process_folder(probe_dir, pid)
    folder.mkdir(parents=True)
    record = {
        "pid": pid, "ppid": os.getpid(), "argv": ["train.py"], "started": started, "rank": 1,
        "local_rank": 1, "world_size": 2, "sigusr1": sigusr1, "torch": True,
    }  # fmt: skip
    (folder / probefiles.PROBE_JSON).write_text(json.dumps(record))
    return folder


def test_probe_beacon_gives_progress_and_place_and_no_signal_without_handler(
    start_job: Any, tmp_path: Path
) -> None:
    """A probe folder as the probe writes it (made here by hand: the beacon written by this test) for a
    job that has no SIGUSR1 handler although its probe.json claims one: attach reads "rank 1, step N,
    backward, layers.7" and the progress rate from the beacon, and trusts the kernel, not the file."""
    probe_dir = tmp_path / "probe"
    job = start_job("attach_sleep", env={probefiles.PROBE_DIR_ENV: str(probe_dir)})
    folder = _probe_folder(probe_dir, job.pid, time.time(), sigusr1="probe")
    writer = BeaconWriter(folder / probefiles.BEACON)
    stop = threading.Event()

    def train() -> None:
        step = 1
        while not stop.wait(0.05):
            step += 1
            writer.update(phase="backward", step=step, layer=7, module="layers.7", event="begin")
            writer.tick()

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        code, record, err = attach(job.pid, tmp_path / "runs", "--no-children")
    finally:
        stop.set()
        thread.join()
        writer.close()
    assert code == 0, err
    assert record["state"] == "progressing", record["reason"]
    assert record["observed_s"] < 5  # the default watch ends at the first round that shows work
    me = by_pid(record, job.pid)
    assert me["progress"]["by"] == "beacon"
    assert me["progress"]["events_per_s"] > 1
    assert me["location"].startswith("rank 1, step ")
    assert me["location"].endswith(", backward, layers.7")
    assert me["signals_sent"] == 0
    assert "the kernel says nothing does" in me["sigusr1"]
    # watch's status line, from another shell
    (status,) = record["status"]
    assert status.startswith(f"rank 1 (pid {job.pid}): step "), status
    assert re.search(r" · layer 7 backward · [0-9.]+ steps/s \([0-9]+ step\(s\) in [0-9.]+ s\)$", status)
    assert len(record["processes"]) == 1  # --no-children
    code, stdout, _ = job.finish()
    assert (code, stdout) == (0, "ready\nchild done\nchild exited with 0\n")


def test_probe_files_read_through_the_contract(tmp_path: Path) -> None:
    """probe.json parsed and typed, a stale one (an earlier process with the same pid) refused, the
    beacon read with no help from its writer, and the place said as the issue spells it."""
    folder = _probe_folder(tmp_path, 4242, started=1000.0, sigusr1="user")
    probe, note = probefiles.find_probe(4242, {probefiles.PROBE_DIR_ENV: str(tmp_path)}, 1000.5)
    assert probe is not None
    assert note.startswith("probe in")
    assert (probe.rank, probe.world_size, probe.sigusr1, probe.torch) == (1, 2, "user", True)
    stale, why = probefiles.find_probe(4242, {probefiles.PROBE_DIR_ENV: str(tmp_path)}, 2000.0)
    assert stale is None
    assert "earlier process" in why
    none, why = probefiles.find_probe(4242, {}, None)
    assert none is None
    assert probefiles.PROBE_DIR_ENV in why
    assert probefiles.read_probe_beacon(probe) is None
    assert probefiles.location(probe, None) is None
    writer = BeaconWriter(folder / probefiles.BEACON)
    writer.update(phase="backward", step=5, layer=7, module="layers.7", event="begin")
    state = probefiles.read_probe_beacon(probe)
    writer.close()
    assert probefiles.location(probe, state) == "rank 1, step 5, backward, layers.7"
    assert probefiles.process_folders(tmp_path) == [folder]


def test_signal_plan_of_this_process_follows_the_kernel() -> None:
    """pytest's own process: Python, no SIGUSR1 handler unless one is registered; the plan follows."""
    import faulthandler

    assert process_info(os.getpid(), send_signal=True).signalled is False  # type: ignore[union-attr]
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        info = process_info(os.getpid(), send_signal=True)
        assert info is not None
        assert info.signalled
        assert info.sigusr1_caught
        assert process_info(os.getpid(), send_signal=False).signalled is False  # type: ignore[union-attr]
    finally:
        faulthandler.unregister(signal.SIGUSR1)


# --- the judgement alone, on recorded evidence ---------------------------------------------------------


def _observation(
    pid: int, cpu_s: Sequence[float], dumps: Sequence[str] = (), beacons: Sequence[Any] = (),
    rank: str | None = None, ppid: int = 1, cmdline: tuple[str, ...] = ("python", "train.py"),
    wchan: str | Sequence[str | None] | None = None, state: str | Sequence[str] = "R",
    pyspy: Sequence[str] = (), caught: bool = True,
) -> ProcessObservation:  # fmt: skip
    """One process's rounds a second apart: its CPU seconds at each, its SIGUSR1 dumps (``dumps``) or
    py-spy samples (``pyspy``), beacon reads, RANK, its main thread's /proc state and wait channel (the same
    in every round, or one per round)."""
    wchans = [wchan] * len(cpu_s) if wchan is None or isinstance(wchan, str) else list(wchan)
    states = [state] * len(cpu_s) if isinstance(state, str) else list(state)
    info = ProcessInfo(
        pid=pid, ppid=ppid, cmdline=cmdline, python=True, started=0.0,
        env_vars={"RANK": rank} if rank is not None else {}, env_vars_withheld=(), probe=None,
        probe_note="", sigusr1_caught=caught, signal_plan="", signalled=caught,
    )  # fmt: skip
    samples = [
        Sample(
            at=float(n),
            wall=1000.0 + n,
            beacon=beacons[n] if n < len(beacons) else None,
            proc={
                "pid": pid,
                "utime_s": cpu,
                "stime_s": 0.0,
                "threads": [{"tid": pid, "state": states[n], "wchan": wchans[n]}],
            },
        )
        for n, cpu in enumerate(cpu_s)
    ]
    return ProcessObservation(info, samples=samples, dumps=list(dumps), pyspy_samples=list(pyspy))


def _tree(*processes: ProcessObservation, **facts: Any) -> TreeObservation:
    return TreeObservation(
        root=processes[0].pid, started=0.0, duration_s=1.0, gpu_snapshot={}, gpu_usage={},
        pyspy_installed=facts.pop("pyspy_installed", False), ptrace={}, processes=list(processes), **facts,
    )  # fmt: skip


def _dump(frames: list[tuple[str, int, str]]) -> str:
    lines = [f'  File "{file}", line {line} in {func}' for file, line, func in frames]
    return "Current thread 0x00007f0000000001 (most recent call first):\n" + "\n".join(lines) + "\n"


def _pyspy(frames: list[tuple[str, int, str]], pid: int = 7) -> str:
    lines = [f"    {func} ({file}:{line})" for file, line, func in frames]
    return (
        f"Process {pid}: python train.py\nPython v3.11.7\n\nThread {pid} (idle)\n" + "\n".join(lines) + "\n"
    )


def _native_pyspy(*native: str) -> str:
    """A py-spy --native dump whose main thread is in ``native`` (innermost first) under a backward."""
    lines = ["Process 7: python train.py", "", 'Thread 7 (active): "MainThread"']
    lines += [f"    {func} (libtorch_cpu.so)" for func in native]
    lines += ["    _engine_run_backward (torch/autograd/graph.py:979)", "    main (train.py:40)"]
    return "\n".join(lines) + "\n"


SYNC = _dump(
    [("/x/site-packages/torch/cuda/__init__.py", 1080, "synchronize"), ("/x/train.py", 30, "<module>")]
)
ALL_REDUCE = _dump(
    [
        ("/x/site-packages/torch/distributed/distributed_c10d.py", 3252, "all_reduce"),
        ("/x/train.py", 9, "<module>"),
    ]
)
CONDITION_WAIT = _dump([("/usr/lib/python3.11/threading.py", 320, "wait"), ("/x/train.py", 12, "<module>")])
WORKER_IDLE = _dump(
    [
        ("/usr/lib/python3.11/selectors.py", 415, "select"),
        ("/usr/lib/python3.11/multiprocessing/connection.py", 440, "_poll"),
        ("/usr/lib/python3.11/multiprocessing/queues.py", 113, "get"),
        ("/x/site-packages/torch/utils/data/_utils/worker.py", 308, "_worker_loop"),
        ("/usr/lib/python3.11/multiprocessing/process.py", 108, "run"),
        ("/x/train.py", 40, "<module>"),
    ]
)
BACKWARD_LOCK = _dump(
    [
        ("/x/train.py", 81, "record_grad"),
        ("/x/site-packages/torch/utils/hooks.py", 138, "hook"),
        ("/x/site-packages/torch/autograd/graph.py", 825, "_engine_run_backward"),
        ("/x/site-packages/torch/_tensor.py", 626, "backward"),
        ("/x/train.py", 120, "<module>"),
    ]
)


def test_cpu_alone_is_never_progress() -> None:
    """At 100% CPU with no stack (no handler, no py-spy) attach cannot tell work from a spin: unclear, not
    progressing. With the same frame in every sample it is still unclear (python-busy: a busy loop and one
    long computation look alike), and CPU spent in a wait (torch.cuda.synchronize spins) is stalled."""
    blind = judge_process(_observation(8, (10.0, 11.0, 12.0), caught=False))
    assert (blind.state, blind.progress.get("by")) == ("unclear", None)
    assert "no stack to tell work from a spin" in blind.why
    spin = _dump([("/x/train.py", 40, "<module>")])
    busy = judge_process(_observation(8, (10.0, 11.0), [spin, spin]))
    assert (busy.state, busy.kind, busy.progress.get("by")) == ("unclear", "python-busy", None)
    wait = judge_process(_observation(7, (10.0, 11.0), [SYNC, SYNC]))
    assert (wait.state, wait.kind, wait.cpu_percent) == ("stalled", "cuda-kernel", 100.0)
    tree = judge_tree(_tree(_observation(8, (10.0, 11.0, 12.0), caught=False)))
    assert (tree.state, tree.focus_pid) == ("unclear", 8)
    assert "what would settle it: py-spy installed" in tree.reason
    assert "nsa-diag watch" in tree.reason


def test_moving_stacks_with_cpu_are_progress() -> None:
    """Innermost frames that differ between samples while the process uses the CPU are work, from
    faulthandler dumps or py-spy samples alike; the same moves without CPU (a poll that wakes) are not."""
    forward = _dump(
        [("/x/site-packages/torch/nn/functional.py", 2210, "linear"), ("/x/train.py", 60, "<module>")]
    )
    loss = _dump([("/x/train.py", 64, "<module>")])
    act = judge_process(_observation(7, (10.0, 11.0, 12.0), [forward, forward, loss]))
    assert (act.state, act.progress["by"]) == ("progressing", "stacks")
    assert "functional.py:2210 in linear -> train.py:64 in <module>" in act.why
    frames = [("/x/site-packages/torch/nn/functional.py", 2210, "linear")], [("/x/train.py", 64, "<module>")]
    spied = judge_process(_observation(7, (10.0, 11.0), pyspy=[_pyspy(f) for f in frames], caught=False))
    assert (spied.state, spied.progress["by"]) == ("progressing", "stacks")
    idle = judge_process(_observation(7, (10.0, 10.0, 10.0), [forward, forward, loss]))
    assert idle.state != "progressing"
    tree = judge_tree(_tree(_observation(7, (10.0, 11.0, 12.0), [forward, forward, loss])))
    assert (tree.state, tree.focus_pid) == ("progressing", 7)

    # One Python frame (a CPU backward), C code that computes: py-spy's native frames differ between dumps.
    backward = _dump(
        [("/x/torch/autograd/graph.py", 979, "_engine_run_backward"), ("/x/train.py", 40, "main")]
    )
    computing = _observation(7, (10.0, 11.0), [backward, backward])
    computing.pyspy_text = _native_pyspy("mkl_blas_avx512_sgemm_kernel_0", "at::native::addmm")
    computing.pyspy_more = [_native_pyspy("at::native::add_kernel", "at::TensorIteratorBase::for_each")]
    act = judge_process(computing)
    assert (act.state, act.progress["by"]) == ("progressing", "native"), act.why
    assert "mkl_blas_avx512_sgemm_kernel_0 -> at::native::add_kernel" in act.why
    computing.pyspy_more = [computing.pyspy_text]  # the same native frames: one place, no proof of work
    assert judge_process(computing).state == "unclear"


def test_sleeping_is_paused_not_deadlocked(tmp_path: Path) -> None:
    """time.sleep seen for seconds is a pause (no work while attach watched; under `watch`, a hang past the
    stall limit), from its stacks (py-spy's here, where its kind is the wait's) or, with no stack, from its
    main thread's wait channel in every round; a lock wait at 0% CPU is stalled, python-deadlock."""
    script = tmp_path / "train.py"
    script.write_text("import time\n\nwhile True:\n    time.sleep(30)\n")
    naps = [_pyspy([(str(script), 4, "<module>")])] * 3
    napping = judge_process(_observation(7, (1.0, 1.0, 1.0), pyspy=naps, caught=False, state="S"))
    assert (napping.state, napping.kind) == ("paused", "python-deadlock"), napping.why
    assert "sleeping in the loop `while True:` at train.py:3" in napping.why
    assert "no work, only sleeps" in napping.why
    blind = judge_process(
        _observation(7, (1.0, 1.0, 1.0), caught=False, state="S", wchan="hrtimer_nanosleep")
    )
    assert blind.state == "paused"
    assert "hrtimer_nanosleep in every round" in blind.why
    tree = judge_tree(
        _tree(_observation(7, (1.0, 1.0, 1.0), caught=False, state="S", wchan="hrtimer_nanosleep"))
    )
    assert (tree.state, tree.hang_kind) == ("paused", None)
    locked = judge_process(
        _observation(7, (1.0, 1.0), [CONDITION_WAIT] * 2, state="S", wchan="futex_wait_queue")
    )
    assert (locked.state, locked.kind) == ("stalled", "python-deadlock")


def test_a_loop_that_naps_is_paused_when_caught_awake_between_naps(tmp_path: Path) -> None:
    """`while not done(): time.sleep(0.2)` on a loaded machine: a round or a sample now and then catches the
    thread awake, between two naps (CI once called such a job stalled). Still paused: most rounds asleep
    and the others running, or most samples at the sleep and the others in the loop around it, in no
    wait. A loop that went from its naps into a lock wait is not paused, nor one that is mostly awake."""
    blind = judge_process(
        _observation(
            7, (1.0, 1.0, 1.0, 1.0), caught=False, state=("S", "R", "S", "S"),
            wchan=("hrtimer_nanosleep", None, "hrtimer_nanosleep", "hrtimer_nanosleep"),
        )
    )  # fmt: skip
    assert blind.state == "paused", blind.why
    assert "hrtimer_nanosleep in 3 of 4 rounds (running in the others)" in blind.why
    mostly_awake = judge_process(
        _observation(
            7, (1.0, 1.0, 1.0), caught=False, state=("S", "R", "R"), wchan=("hrtimer_nanosleep", None, None)
        )
    )
    assert mostly_awake.state != "paused", mostly_awake.why
    in_a_lock = judge_process(
        _observation(
            7, (1.0, 1.0, 1.0), caught=False, state="S",
            wchan=("hrtimer_nanosleep", "hrtimer_nanosleep", "futex_wait_queue"),
        )
    )  # fmt: skip
    assert in_a_lock.state != "paused", in_a_lock.why

    script = tmp_path / "train.py"
    script.write_text(
        "import threading\nimport time\n\nstop = threading.Event()\nlock = threading.Lock()\n"
        "while not stop.is_set():\n    time.sleep(0.2)\nlock.acquire()\n"
    )
    nap = [(str(script), 7, "<module>")]
    check = [("/usr/lib/python3.11/threading.py", 601, "Event.is_set"), (str(script), 6, "<module>")]
    lock = [(str(script), 8, "<module>")]
    caught_awake = [_pyspy(nap), _pyspy(check), _pyspy(nap)]
    napping = judge_process(_observation(7, (1.0, 1.0, 1.0), pyspy=caught_awake, caught=False, state="S"))
    assert napping.state == "paused", napping.why
    assert "in 2 of 3 stack samples (in the others between two naps, in <module>)" in napping.why
    assert "no work, only sleeps" in napping.why
    last_awake = [_pyspy(nap), _pyspy(nap), _pyspy(check)]
    assert (
        judge_process(_observation(7, (1.0,) * 3, pyspy=last_awake, caught=False, state="S")).state
        == "paused"
    )
    into_lock = [_pyspy(nap), _pyspy(lock), _pyspy(lock)]
    locked = judge_process(_observation(7, (1.0,) * 3, pyspy=into_lock, caught=False, state="S"))
    assert locked.state == "stalled", locked.why


def test_idle_dataloader_workers_are_never_the_focus() -> None:
    """The training process stuck in backward beside two idle DataLoader workers (all blocked: the
    workers in poll, the leaves of the tree): the focus and the reason are the training process's; the
    workers are idle DataLoader workers (their role from their stacks, with or without the training
    process in the tree). Once the training process waits for a batch a worker is producing, it is
    paused."""
    main = _observation(100, (5.0, 5.0, 5.0), [BACKWARD_LOCK] * 3, state="S", wchan="futex_wait_queue")
    workers = [
        _observation(pid, (1.0, 1.0, 1.0), [WORKER_IDLE] * 3, ppid=100, state="S", wchan="do_sys_poll")
        for pid in (101, 102)
    ]
    act = judge_tree(_tree(main, *workers))
    assert (act.state, act.hang_kind, act.focus_pid) == ("stalled", "python-deadlock", 100), act.reason
    assert act.reason.startswith("pid 100: blocked in futex wait")
    assert "train.py:81 in record_grad" in act.reason
    assert "selectors.py" not in act.reason.split(";")[0]
    for a in act.processes[1:]:
        assert (a.role, a.state) == ("dataloader-worker", "idle")
        assert f"pid {a.pid}: idle DataLoader worker" in act.reason
    alone = judge_tree(_tree(*workers))
    assert (alone.state, alone.focus_pid) == ("unclear", None)
    assert "no training process among the processes watched" in alone.reason
    assert "attach its training process, pid 100" in alone.reason

    next_batch = _dump(
        [
            ("/usr/lib/python3.11/threading.py", 327, "wait"),
            ("/x/site-packages/torch/utils/data/dataloader.py", 1295, "_get_data"),
            ("/x/train.py", 110, "<module>"),
        ]
    )
    reading = [
        _dump(
            [
                ("/x/data.py", line, "decode"),
                ("/x/site-packages/torch/utils/data/_utils/fetch.py", 52, "fetch"),
                ("/x/site-packages/torch/utils/data/_utils/worker.py", 349, "_worker_loop"),
                ("/x/train.py", 40, "<module>"),
            ]
        )
        for line in (10, 14, 18)
    ]
    waiting = _observation(100, (5.0, 5.0, 5.0), [next_batch] * 3, state="S", wchan="futex_wait_queue")
    busy = _observation(101, (1.0, 2.0, 3.0), reading, ppid=100)
    act = judge_tree(_tree(waiting, busy))
    assert (act.state, act.focus_pid) == ("paused", 100), act.reason
    assert "its DataLoader worker is producing" in act.reason


def test_beacon_progress_and_a_stopped_heartbeat_is_gil_held() -> None:
    """With a beacon, progress events are progress; none, with a heartbeat that did not tick either, is a
    held GIL (with the time since the last event)."""

    def beacon(seq: int, heartbeat: int) -> BeaconState:
        return BeaconState(seq, 900.0, 5, 7, "backward", None, "begin", 7, heartbeat, 990.0, "layers.7")

    act = judge_process(
        _observation(7, (10.0, 11.0), [CONDITION_WAIT] * 2, (beacon(40, 900), beacon(40, 900)))
    )
    assert (act.state, act.kind) == ("stalled", "gil-held")
    assert act.stalled_for_s == 101.0
    assert "no progress event for 101.0 s" in act.why
    moving = judge_process(_observation(7, (10.0, 10.0), [], (beacon(40, 900), beacon(52, 910))))
    assert (moving.state, moving.progress["events_per_s"]) == ("progressing", 12.0)
    assert moving.location == "step 5, backward, layers.7"


def test_tree_names_the_minority_rank() -> None:
    """Rank 0 waits in all_reduce, rank 1 is blocked on a condition of its own: rank 1 is the minority
    (`cross_rank_diff`: the rank outside the collective), the focus and the hang kind; rank 0 is named as
    what it is. Without stacks, rank 0 spinning at 100% and rank 1 blocked is only unclear."""
    tree = _tree(
        _observation(10, (1.0, 1.0), [ALL_REDUCE] * 2, rank="0", state="S", wchan="futex_wait_queue"),
        _observation(11, (1.0, 1.0), [CONDITION_WAIT] * 2, rank="1", state="S", wchan="futex_wait_queue"),
    )
    act = judge_tree(tree)
    assert (act.state, act.hang_kind, act.focus_pid, act.minority_ranks) == (
        "stalled",
        "python-deadlock",
        11,
        (1,),
    )
    assert act.reason.startswith("rank 1 (pid 11): blocked in threading wait")
    assert "minority rank(s) 1" in act.reason
    assert "rank 0 (pid 10): stalled (collective)" in act.reason
    blind = judge_tree(
        _tree(
            _observation(10, (1.0, 2.0), rank="0", caught=False, state="S", wchan="futex_wait_queue"),
            _observation(11, (1.0, 1.0), rank="1", caught=False, state="S", wchan="futex_wait_queue"),
            _observation(
                9,
                (1.0, 1.0),
                cmdline=("/v/bin/python", "/v/bin/torchrun", "--nproc-per-node", "2"),
                caught=False,
                state="S",
                wchan="hrtimer_nanosleep",
            ),
        )
    )
    assert (blind.state, blind.focus_pid) == ("unclear", 10), blind.reason
    assert "torch's launcher (torchrun's agent): waiting on its ranks" in blind.reason
    assert "what would settle it: py-spy installed" in blind.reason


def test_under_nccl_the_rank_not_waiting_for_the_gpu_is_the_minority() -> None:
    """As seen on two H200s: rank 0 waits in loss.item() for an all_reduce whose partner never comes (py-spy:
    a device sync in libcuda, 100% CPU), rank 1 in Condition.wait for a batch from a prefetch thread that
    died. No collective frame on either stack: waiting for the GPU is what tells rank 0 waits for rank 1."""
    item = _dump([("/x/train.py", 38, "main"), ("/x/train.py", 52, "<module>")])
    rank0 = _observation(10, (1.0, 2.0), [item] * 2, rank="0")
    rank0.pyspy_text = (
        'Process 10: python train.py\n\nThread 10 (active): "MainThread"\n'
        "    cuStreamSynchronize (libcuda.so.580)\n    0x7f5445e14820 (libcuda.so.580)\n"
        "    main (train.py:38)\n    <module> (train.py:52)\n"
    )
    rank1 = _observation(11, (1.0, 1.0), [CONDITION_WAIT] * 2, rank="1", state="S", wchan="futex_wait_queue")
    act = judge_tree(_tree(rank0, rank1))
    assert (act.state, act.focus_pid, act.minority_ranks) == ("stalled", 11, (1,)), act.reason
    assert "minority rank(s) 1" in act.reason
    assert "wait for the GPU or in a collective" in act.reason


def test_roles_of_a_torchrun_tree_from_proc_alone() -> None:
    """torchrun run by Python (its script's shebang) is the launcher, also with --no-children (its ranks
    then known only as relatives); a DataLoader worker forked from a rank (RANK inherited) is not a rank."""
    launcher = _observation(
        9, (1.0, 1.0), cmdline=("/v/bin/python", "/v/bin/torchrun", "--standalone", "t.py")
    )
    rank = _observation(10, (1.0, 1.0), rank="0", ppid=9)
    worker = _observation(11, (1.0, 1.0), [WORKER_IDLE], rank="0", ppid=10)
    assert tree_roles(_tree(launcher, rank, worker)) == {9: "launcher", 10: "rank", 11: "dataloader-worker"}
    alone = _tree(launcher, relatives=[rank.info])
    assert tree_roles(alone)[9] == "launcher"
    act = judge_tree(alone)
    assert (act.state, act.focus_pid) == ("unclear", None)
    assert "attach it without --no-children, or attach a rank" in act.reason


def test_refused_ptrace_is_said_once() -> None:
    """Three processes py-spy could not dump: one note for the tree, in summary.md as on the console."""
    record = {
        "pid": 1, "state": "unclear", "hang_kind": None, "reason": "r", "no_verdict": "n", "observed_s": 1.0,
        "pyspy_advice": "ptrace is not permitted: run `sudo py-spy dump --pid 5` (and likewise for pid 6, 7)",
        "processes": [
            {"pid": pid, "role": "rank", "rank": pid - 5, "cmdline": ["python"], "state": "unclear",
             "kind": None, "cpu_percent": 0.0, "location": None, "stack_samples": 0,
             "pyspy": {"taken": False}, "sigusr1": "not signalled"}
            for pid in (5, 6, 7)
        ],
    }  # fmt: skip
    assert summary_markdown(record).count("ptrace is not permitted") == 1


def test_bad_pids_get_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In process (the CLI's own `run_cli`), so that "nsa-diag itself" is this process."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    cases = {
        str(gone.pid): "no process with PID",
        "1": "PID 1 is the system's init process",
        str(os.getpid()): "is this nsa-diag process itself",
        str(os.getppid()): "is an ancestor of this nsa-diag process",
        "0": "is not a process id",
        "abc": "Invalid value for 'PID'",
    }
    for pid, said in cases.items():
        code = cli_main(["attach", pid, "--out", str(tmp_path / "runs")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert (code, len(lines)) == (2, 1), (pid, lines)
        assert said in lines[0], (pid, lines)
    assert not (tmp_path / "runs").exists()  # nothing half-made


# A process with a second thread, and one with a child it never reaps: each prints the id to attach to.
_THREAD_JOB = """
import threading, time
def run():
    print(threading.get_native_id(), flush=True)
    time.sleep(60)
threading.Thread(target=run, daemon=True).start()
time.sleep(60)
"""
_ZOMBIE_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "pass"])
print(child.pid, flush=True)
time.sleep(60)  # never waits for it: the child stays a zombie
"""


@pytest.mark.parametrize(
    ("job", "says"),
    [
        pytest.param(
            _THREAD_JOB, "PID {id} is a thread of process {pid}, not a process: attach {pid}", id="thread"
        ),
        pytest.param(
            _ZOMBIE_PARENT,
            "PID {id} has exited: a zombie its parent (PID {pid}) has not reaped; nothing to attach to",
            id="zombie",
        ),
    ],
)
def test_a_thread_id_or_a_zombie_is_said_as_what_it_is(
    job: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`attach TID`: /proc has a folder for every thread, so a thread id looked like a process; a zombie
    read as "no process". Each is one line, exit 2, nothing written. In process, as the bad pids above (a
    refusal before anything is looked at: a subprocess would add only its start-up, ~3 s of CPU)."""
    proc = subprocess.Popen([sys.executable, "-c", job], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        target = int(proc.stdout.readline())
        if "zombie" in says:
            deadline = time.monotonic() + 10
            while psutil.Process(target).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
                time.sleep(0.05)
        code = cli_main(["attach", str(target), "--out", str(tmp_path / "runs")])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.splitlines() == ["nsa-diag: " + says.format(id=target, pid=proc.pid)]
        assert not (tmp_path / "runs").exists()
        assert proc.poll() is None  # looked at, not touched
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_another_users_process_is_refused() -> None:
    """As user nobody (a forked child of this root process), a process of root is refused in one line."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        child = os.fork()
        if child == 0:  # the child: become nobody, then check the victim
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                check_target(victim.pid)
            except UsageError as exc:
                code = 0 if "belongs to another user" in str(exc) and "\n" not in str(exc) else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_another_users_process_needs_consent_as_root_and_is_refused_otherwise() -> None:
    """Whether attach refuses a process, as a function of our effective uid and the process's owner
    (real, effective uid): the root case is tested here for any user, and on real processes below."""
    assert other_user_refusal(42, 1000, (1000, 1000), allow_other_user=False) is None
    assert other_user_refusal(42, 0, (0, 0), allow_other_user=False) is None
    assert other_user_refusal(42, 1000, (1000, 0), allow_other_user=False) is None  # setuid: still ours
    for euid, owner in [(1000, (1001, 1001)), (1000, (0, 0)), (0, (1000, 1000))]:
        said = other_user_refusal(42, euid, owner, allow_other_user=False)
        assert said is not None
        assert said.startswith(f"PID 42 belongs to another user (uid {owner[0]})")
        assert "\n" not in said
    as_root = other_user_refusal(42, 0, (1000, 1000), allow_other_user=False)
    assert as_root is not None
    assert "--allow-other-user" in as_root
    assert other_user_refusal(42, 0, (1000, 1000), allow_other_user=True) is None  # root, with consent
    # consent is root's to use: a user still cannot look into another user's job
    assert other_user_refusal(42, 1000, (1001, 1001), allow_other_user=True) is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to attach to another user's process")
def test_as_root_another_users_job_is_refused_in_one_line_and_not_signalled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27 #12: as root, attach went on into another user's job (SIGUSR1 included). A Python process
    of user nobody that catches SIGUSR1 (attach would signal it) is refused: one line, exit 2, no signal,
    no run folder; with --allow-other-user attach goes on and asks it for a dump."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the job: user nobody, a SIGUSR1 handler that says so on the pipe
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            signal.signal(signal.SIGUSR1, lambda *_: os.write(write_end, b"got SIGUSR1\n"))
            os.write(write_end, b"ready\n")
            while True:
                time.sleep(0.1)
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb", buffering=0) as said:
            assert said.readline() == b"ready\n"
            os.set_blocking(read_end, False)
            out = tmp_path / "refused"
            # refused in process, as the bad pids above; the attach that goes on runs as a user runs it
            code = cli_main(["attach", str(child), "--out", str(out), "--samples", "2"])
            err = capsys.readouterr().err
            lines = err.strip().splitlines()
            assert (code, len(lines)) == (2, 1), err
            assert f"PID {child} belongs to another user (uid 65534)" in lines[0]
            assert "--allow-other-user" in lines[0]
            assert not out.exists()
            time.sleep(0.3)
            assert said.read() is None  # nothing on the pipe: no signal came
            allowed = run_cli(
                "attach", str(child), "--out", tmp_path / "allowed", "--samples", "2", "--interval", "0.2",
                "--allow-other-user", timeout=120,
            )  # fmt: skip
            assert allowed.returncode in (0, 1), allowed.stderr[-2000:]
            time.sleep(0.3)
            assert b"got SIGUSR1" in (said.read() or b"")
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_help_has_examples_and_does_not_import_torch() -> None:
    code = (
        "import sys; from nsa_diag.app import run_cli; "
        "code = run_cli(['attach', '--help']); print(code, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
    )  # fmt: skip
    assert "Examples" in done.stdout
    assert "nsa-diag attach 12345" in done.stdout
    assert "--no-signal" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "0 False"


@pytest.mark.slow
def test_ctrl_c_of_attach_is_exit_130_with_a_result_and_the_job_untouched(
    start_job: Any, tmp_path: Path
) -> None:
    job = start_job("attach_sleep")
    err_path = tmp_path / "attach.err"
    with open(err_path, "w") as err:
        attach_proc = subprocess.Popen(
            [sys.executable, "-m", "nsa_diag", "attach", str(job.pid), "--out", str(tmp_path / "runs"),
             "--samples", "20"],
            stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
            env=cli_env(),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "watching PID" not in err_path.read_text():
            assert attach_proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        attach_proc.send_signal(signal.SIGINT)
        assert attach_proc.wait(timeout=30) == 130, err_path.read_text()
    finally:
        if attach_proc.poll() is None:
            attach_proc.kill()
            attach_proc.wait()
    result = json.loads(next((tmp_path / "runs").iterdir()).joinpath("result.json").read_text())
    assert result["state"] == "interrupted"
    assert "interrupted by SIGINT" in err_path.read_text()
    code, stdout, stderr = job.finish()
    assert (code, stdout, stderr) == (0, "ready\nchild done\nchild exited with 0\n", "")


@pytest.mark.slow
def test_job_spinning_in_a_cuda_kernel_is_cuda_kernel(start_job: Any, tmp_path: Path) -> None:
    """On a GPU machine: a job waiting in torch.cuda.synchronize() for a kernel that spins 20 s."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    job = start_job("attach_gpu_spin", "20")
    code, record, err = attach(job.pid, tmp_path / "runs")
    assert code == 1, err
    assert (record["state"], record["hang_kind"]) == ("stalled", "cuda-kernel"), record["reason"]
    assert record["gpu"]["available"], record["gpu"]
    me = by_pid(record, job.pid)
    print("NVML rows of the job:", me["gpu"], "GPU %:", me["gpu_percent"], "CPU %:", me["cpu_percent"])
    code, stdout, _ = job.finish(timeout=120)
    assert (code, stdout) == (0, "ready\ndone\n")


def test_report_and_compare_read_an_attach_run_folder(sleeping: Attached, tmp_path: Path) -> None:
    """An attach run folder (result.json at its top, no cases/) is read by report and compare: the state
    stands where a case's verdict would, with its reason."""
    assert sleeping.code == 1, sleeping.err
    (attached,) = sleeping.runs.iterdir()
    run = tmp_path / attached.name  # a copy: report writes report.md into the folder it reads
    shutil.copytree(attached, run)
    done = run_cli("report", run)
    assert done.returncode == 0, done.stderr
    report = (run / "report.md").read_text()
    assert "# nsa-diag attach" in report
    assert "paused" in report
    assert "no work, only sleeps" in report
    done = run_cli("compare", run, run, "--json")
    assert done.returncode == 0, done.stderr
    comparison = json.loads(done.stdout)
    assert comparison["a"]["command"] == "attach"
    assert comparison["a"]["cases"] == 1
