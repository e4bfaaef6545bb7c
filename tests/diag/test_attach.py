"""`nsa-diag attach PID` on real running jobs (scripts in tests/diag/jobs/attach_*.py, written as a user
writes them, importing nothing of nsa-diag): what it says about a deadlocked, a busy and a sleeping job,
and that each job is left running and unchanged (it still finishes, exit code 0, the same output); a
process without a SIGUSR1 handler gets no signal (it would die of it). Plus the probe's files read
through the contract, and bad PIDs (one line, exit 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from diag_cli import cli_env, run_cli

from nsa_diag.activity import judge_process, judge_tree
from nsa_diag.app import run_cli as cli_main
from nsa_diag.errors import UsageError
from nsa_diag.evidence import probefiles
from nsa_diag.evidence.live import (
    ProcessInfo,
    ProcessObservation,
    Sample,
    TreeObservation,
    check_target,
    process_info,
)
from nsa_diag.worker.beacon import BeaconState, BeaconWriter

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


@pytest.fixture
def start_job(tmp_path: Path) -> Iterator[Any]:
    """Start a job script with stdin a pipe and stdout/stderr into files; wait for its "ready" line.
    Every job still running at the end of the test is killed (by its pid)."""
    started: list[Job] = []

    def start(name: str, *args: str, env: dict[str, str] | None = None) -> Job:
        out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, str(JOBS / f"{name}.py"), *args],
                stdin=subprocess.PIPE, stdout=stdout, stderr=stderr, text=True,
                env={**os.environ, **(env or {})}, start_new_session=True,
            )  # fmt: skip
        job = Job(proc, out, err)
        started.append(job)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "ready" not in out.read_text():
            assert proc.poll() is None, f"{name} ended early: {err.read_text()}"
            assert time.monotonic() < deadline, f"{name} did not get ready"
            time.sleep(0.05)
        return job

    yield start
    for job in started:
        if job.proc.poll() is None:
            os.killpg(job.pid, 9)
            job.proc.wait()


def attach(pid: int, out: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    proc = run_cli("attach", str(pid), "--out", out, "--json", *args, timeout=120)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {}, proc.stderr


def by_pid(record: dict[str, Any], pid: int) -> dict[str, Any]:
    return next(p for p in record["processes"] if p["pid"] == pid)


def test_no_file_records_a_secret_of_the_jobs_command_line_or_environment(
    start_job: Any, tmp_path: Path
) -> None:
    # --hub's value is only known as a secret from the job's environment (MY_TOKEN holds it)
    job = start_job(
        "attach_sleep", "--api-key", "k-9f8e7d6c", "--hub", "tok-5a4b3c2d", env={"MY_TOKEN": "tok-5a4b3c2d"}
    )
    code, record, err = attach(job.pid, tmp_path / "runs")
    assert code == 1, err
    assert "k-9f8e7d6c" not in json.dumps(record)  # nor on the console
    assert "tok-5a4b3c2d" not in json.dumps(record)
    written = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert written
    for path in written:
        data = path.read_bytes()
        for value in (b"k-9f8e7d6c", b"tok-5a4b3c2d"):
            assert value not in data, f"{path.name} records {value!r}"
    job.proc.communicate("go\n", timeout=30)


def test_deadlocked_job_is_python_deadlock_and_finishes_unchanged(start_job: Any, tmp_path: Path) -> None:
    job = start_job("attach_deadlock")
    code, record, err = attach(job.pid, tmp_path / "runs")
    assert code == 1, err
    assert (record["state"], record["hang_kind"]) == ("stalled", "python-deadlock"), record["reason"]
    assert "lock.acquire()" in record["reason"]
    assert "attach_deadlock.py:24" in record["reason"]
    me = by_pid(record, job.pid)
    assert me["sigusr1_caught"]
    assert me["signals_sent"] == 2
    assert me["stack_samples"] == 2
    run_dir = next((tmp_path / "runs").iterdir())
    for name in ("env.json", "result.json", "summary.md", f"processes/{job.pid}/proc.json"):
        assert (run_dir / name).is_file(), name
    assert "attach_deadlock.py" in (run_dir / f"processes/{job.pid}/stacks.txt").read_text()
    assert job.proc.poll() is None  # still running, untouched
    code, stdout, stderr = job.finish()
    assert code == 0
    assert stdout == "step 1 loss 332.8335\nready\nstep 2 done\n"
    # its own handler wrote the two dumps attach asked for into its stderr, and nothing else is there
    assert stderr.count("most recent call first") == 4
    assert "Traceback" not in stderr


def test_busy_job_is_progressing_and_finishes_unchanged(start_job: Any, tmp_path: Path) -> None:
    job = start_job("attach_busy")
    code, record, err = attach(job.pid, tmp_path / "runs")
    assert code == 0, err
    assert (record["state"], record["hang_kind"]) == ("progressing", None), record["reason"]
    me = by_pid(record, job.pid)
    assert me["progress"]["by"] == "cpu"
    assert me["cpu_percent"] >= 20 or me["runnable_percent"] >= 50, me
    assert me["kind"] == "python-busy", me["why"]
    code, stdout, _ = job.finish()
    assert (code, stdout) == (0, "ready\ndone\n")


def test_sleeping_job_and_its_child_get_no_signal(start_job: Any, tmp_path: Path) -> None:
    """Neither process catches SIGUSR1: attach sends none (its default action would kill them), reports
    both stalled without stacks, and both live on and finish normally."""
    job = start_job("attach_sleep")
    code, record, err = attach(job.pid, tmp_path / "runs")
    assert code == 1, err
    assert record["state"] == "stalled", record["reason"]
    assert len(record["processes"]) == 2  # the job and its child
    for p in record["processes"]:
        assert p["sigusr1_caught"] is False
        assert p["signals_sent"] == 0
        assert p["sigusr1"].startswith("not signalled: no SIGUSR1 handler")
        assert p["stack_samples"] == 0
        if not record["pyspy_installed"]:
            assert "no stack" in p["why"]
    assert "py-spy" in by_pid(record, job.pid)["pyspy"].get("advice", "") or record["pyspy_installed"]
    code, stdout, stderr = job.finish()
    assert (code, stdout, stderr) == (0, "ready\nchild done\nchild exited with 0\n", "")


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
    me = by_pid(record, job.pid)
    assert me["progress"]["by"] == "beacon"
    assert me["progress"]["events_per_s"] > 1
    assert me["location"].startswith("rank 1, step ")
    assert me["location"].endswith(", backward, layers.7")
    assert me["signals_sent"] == 0
    assert "the kernel says nothing does" in me["sigusr1"]
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
    pid: int, cpu_s: tuple[float, float], dumps: list[str], beacons: tuple[Any, Any] = (None, None),
    rank: str | None = None,
) -> ProcessObservation:  # fmt: skip
    info = ProcessInfo(
        pid=pid, ppid=1, cmdline=("python", "train.py"), python=True, started=0.0,
        env_vars={"RANK": rank} if rank is not None else {}, env_vars_withheld=(), probe=None,
        probe_note="", sigusr1_caught=True, signal_plan="", signalled=True,
    )  # fmt: skip
    samples = [
        Sample(
            at=float(n),
            wall=1000.0 + n,
            beacon=beacons[n],
            proc={
                "pid": pid,
                "utime_s": cpu,
                "stime_s": 0.0,
                "threads": [{"tid": pid, "state": "R", "wchan": None}],
            },
        )
        for n, cpu in enumerate(cpu_s)
    ]
    return ProcessObservation(info, samples=samples, dumps=dumps)


def _dump(frames: list[tuple[str, int, str]]) -> str:
    lines = [f'  File "{file}", line {line} in {func}' for file, line, func in frames]
    return "Current thread 0x00007f0000000001 (most recent call first):\n" + "\n".join(lines) + "\n"


SYNC = _dump(
    [("/x/site-packages/torch/cuda/__init__.py", 1080, "synchronize"), ("/x/train.py", 30, "<module>")]
)
ALL_REDUCE = _dump(
    [
        ("/x/site-packages/torch/distributed/distributed_c10d.py", 3252, "all_reduce"),
        ("/x/train.py", 9, "<module>"),
    ]
)
SLEEP = _dump([("/usr/lib/python3.11/threading.py", 320, "wait"), ("/x/train.py", 12, "<module>")])


def test_cpu_spent_waiting_for_the_gpu_is_not_progress() -> None:
    """A process spinning at 100% CPU inside torch.cuda.synchronize() (CUDA's default spin-wait) is
    stalled in cuda-kernel, not progressing: CPU spent in a wait is not work."""
    act = judge_process(_observation(7, (10.0, 11.0), [SYNC, SYNC]))
    assert (act.state, act.kind, act.cpu_percent) == ("stalled", "cuda-kernel", 100.0)
    spin = _dump([("/x/train.py", 40, "<module>")])
    busy = judge_process(_observation(8, (10.0, 11.0), [spin, spin]))
    assert (busy.state, busy.progress["by"]) == ("progressing", "cpu")


def test_beacon_decides_and_a_stopped_heartbeat_is_gil_held() -> None:
    """With a beacon, CPU does not count: no new progress event is stalled (with the time since the last
    one), and a heartbeat that did not tick either means a held GIL."""

    def beacon(seq: int, heartbeat: int) -> BeaconState:
        return BeaconState(seq, 900.0, 5, 7, "backward", None, "begin", 7, heartbeat, 990.0, "layers.7")

    act = judge_process(_observation(7, (10.0, 11.0), [SLEEP, SLEEP], (beacon(40, 900), beacon(40, 900))))
    assert (act.state, act.kind) == ("stalled", "gil-held")
    assert act.stalled_for_s == 101.0
    assert "no progress event for 101.0 s" in act.why
    moving = judge_process(_observation(7, (10.0, 10.0), [], (beacon(40, 900), beacon(52, 910))))
    assert (moving.state, moving.progress["events_per_s"]) == ("progressing", 12.0)
    assert moving.location == "step 5, backward, layers.7"


def test_tree_names_the_rank_in_a_collective_and_the_rank_elsewhere() -> None:
    tree = TreeObservation(
        root=1, started=0.0, duration_s=1.0, gpu_snapshot={}, gpu_usage={}, pyspy_installed=False, ptrace={},
        processes=[
            _observation(10, (1.0, 1.0), [ALL_REDUCE, ALL_REDUCE], rank="0"),
            _observation(11, (1.0, 1.0), [SLEEP, SLEEP], rank="1"),
        ],
    )  # fmt: skip
    act = judge_tree(tree)
    assert (act.state, act.hang_kind, act.focus_pid) == ("stalled", "collective", 10)
    assert "pid 10 (rank 0)" in act.reason
    assert "pid 11 (rank 1): python-deadlock" in act.reason


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
