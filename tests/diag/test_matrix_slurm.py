"""`nsa-diag matrix --executor slurm` through submitit, run here by submitit's local executor.

The local executor (`--submitit-cluster local`) takes the same path as Slurm (`nsa_diag.slurm.make_executor`
with ``cluster="local"``: the same pickled `nsa_diag.node.run_case_job`, the same job objects, states and
cancellation); each job is a real process on this machine that runs the case under the watchdog into the
run folder. What only a cluster has (sbatch, sacct, Slurm's own states) is covered by the pure tests of
`nsa_diag.slurm` here, not by a run.

Default set: the settings, the sbatch lines and the state table (no process), bad input (exit 2, one
line), one matrix of a passing, a hanging and a crashing case, and a job killed from outside. Slow: the
same file run locally and compared, an interrupted run (every job cancelled, every case a result, no
process left) resumed, and jobs cancelled or warned from outside.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest
from diag_cli import cli_env
from diag_cli import run_cli as run_subprocess

from nsa_diag.app import run_cli
from nsa_diag.errors import EXIT_ABORTED, EXIT_USAGE, UsageError
from nsa_diag.matrix import MatrixFileError, load_matrix
from nsa_diag.slurm import (
    LOCAL_CONTROLLERS_LOG,
    SlurmSettings,
    is_active,
    job_end,
    make_executor,
    parse_slurm_opt,
    settings_from_options,
    time_limit_minutes,
)

CLI_TIMEOUT_S = 240
LOCAL = ("--executor", "slurm", "--submitit-cluster", "local")

TRIO = """
    name: trio
    defaults: {preset: tiny, layers: 2, seq_len: 32, batch: 1, steps: 1, device: cpu, timeout: 60}
    cases:
      - name: ok
      - name: hang
        inject: ["deadlock:layer=1"]
        stall: 2
        expect: {verdict: hang, hang_kind: python-deadlock}
      - name: crash
        inject: ["segfault:layer=0"]
        expect: {verdict: crash}
    slurm:
      time: "10"
      options: {qos: normal}
"""


def write(tmp_path: Path, text: str, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def start_cli(*args: str | Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "nsa_diag", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=cli_env(),
    )


def family_of(pid: int, seen: set[int]) -> None:
    """Add every descendant of ``pid`` now alive to ``seen`` (the submitit controllers, the jobs, the
    workers)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        seen.update(p.pid for p in psutil.Process(pid).children(recursive=True))


def alive(pids: set[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids: set[int], within_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def verdicts(run_dir: Path) -> dict[str, str]:
    return {case["name"]: case["verdict"] for case in summary_of(run_dir)["cases"]}


def result_of(run_dir: Path, name: str) -> dict:
    return json.loads((run_dir / "cases" / name / "result.json").read_text())


# --- settings and states, no process ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("30", 30), ("1:30", 2), ("01:00:00", 60), ("2-0", 2880), ("1-2:3", 1563), ("0-0:0:1", 1)],
)
def test_slurm_time_limits_in_minutes(text: str, minutes: int) -> None:
    assert time_limit_minutes(text) == minutes


def test_settings_merge_the_command_over_the_file_and_refuse_what_submitit_owns() -> None:
    file = SlurmSettings(partition="a", time="60", options={"qos": "low", "constraint": "h100"})
    cli = settings_from_options(partition="b", slurm_opts=["qos=high", "--mail_user=me"])
    merged = file.merged(cli)
    assert (merged.partition, merged.time) == ("b", "60")
    assert merged.options == {"qos": "high", "constraint": "h100", "mail-user": "me"}
    assert SlurmSettings().job_minutes(300) == 10
    assert merged.job_minutes(300) == 60
    for bad, says in [
        ("qos", "give KEY=VALUE"),
        ("output=x.log", "set by nsa-diag through submitit"),
        ("partition=gpu", "(--partition)"),
        ("Bad Key=1", "not an sbatch option name"),
    ]:
        with pytest.raises(UsageError, match=f"--slurm-opt.*{bad.split('=')[0]}.*") as info:
            parse_slurm_opt(bad)
        assert says in str(info.value)
    with pytest.raises(UsageError, match="--time '5m' is not a Slurm time limit"):
        settings_from_options(time="5m")


@pytest.mark.parametrize(
    ("state", "verdict", "says"),
    [
        ("TIMEOUT", "error", "reached its Slurm time limit (10 min; raise it with --time)"),
        ("PREEMPTED", "error", "Slurm preempted the job"),
        ("NODE_FAIL", "error", "the node running the job failed"),
        ("CANCELLED by 1234", "error", "ended CANCELLED by 1234 on gpu[01]: the job was cancelled"),
        ("OUT_OF_MEMORY", "oom", "exceeded its Slurm memory allocation"),
        ("FAILED", "error", "exited with a non-zero code"),
        ("BOOT_FAIL", "error", "failed to boot"),
        ("SOMETHING_NEW", "error", "ended in state SOMETHING_NEW"),
    ],
)
def test_every_final_state_gets_a_verdict_and_a_reason(state: str, verdict: str, says: str) -> None:
    end = job_end(state, job_id="77_3", minutes=10, nodes="gpu[01]")
    assert end.verdict == verdict
    assert end.reason.startswith(f"Slurm job 77_3 ended {state}")
    assert says in end.reason
    assert not is_active(state)


def test_active_states_and_the_local_executors() -> None:
    assert all(is_active(s) for s in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED"))
    end = job_end("INTERRUPTED", job_id="123", cluster="local", exit_signal="SIGKILL")
    assert end.reason == "local submitit job 123 ended INTERRUPTED: the job's process was killed by SIGKILL"
    # the controller exits normally when its task is killed: FINISHED, and no result of submitit's
    killed = job_end("FINISHED", job_id="123", cluster="local", result_saved=False)
    assert killed.reason.startswith("local submitit job 123 was killed (submitit's state: FINISHED): ")
    finished = job_end("FINISHED", job_id="123", cluster="local", result_saved=True)
    assert finished.reason.startswith("local submitit job 123 ended FINISHED: ")


def test_the_settings_become_these_sbatch_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit writes the sbatch script from our settings (its SlurmExecutor only looks for `srun` on
    PATH when it is made: an executable that is never run stands in for it; nothing is submitted)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    settings = SlurmSettings(partition="a", options={"qos": "low"}).merged(
        settings_from_options(
            partition="gpu", account="proj", gpus_per_node=1, time="00:30:00", slurm_opts=["qos=high"]
        )
    )
    executor = make_executor(
        settings, tmp_path / "slurm", minutes=settings.job_minutes(300), name="nsa-diag-m"
    )
    script = executor._executor._make_submission_file_text("python -m x", "uid")  # submitit's own text
    lines = set(script.splitlines())
    for line in ("--partition=gpu", "--account=proj", "--gpus-per-node=1", "--time=30", "--qos=high",
                 "--job-name=nsa-diag-m", "--nodes=1"):  # fmt: skip
        assert f"#SBATCH {line}" in lines
    assert f"#SBATCH --output={tmp_path}/slurm/%j_0_log.out" in lines


def test_a_matrix_files_slurm_section_is_checked_with_the_file(tmp_path: Path) -> None:
    good = load_matrix(write(tmp_path, TRIO))
    assert good.slurm == SlurmSettings(time="10", options={"qos": "normal"})
    bad = write(
        tmp_path,
        """
        cases: [{name: a}]
        slurm: {partiton: gpu, time: "1h", options: {output: x}}
        """,
        name="bad.yaml",
    )
    with pytest.raises(MatrixFileError) as info:
        load_matrix(bad)
    text = "\n".join(info.value.problems)
    assert "slurm.partiton: unknown key (did you mean 'partition'?)" in text
    assert "slurm.time" in text
    assert "not a Slurm time limit" in text
    assert "slurm.options: output: set by nsa-diag" in text
    assert all(line.startswith(f"{bad}:3: ") for line in info.value.problems)


# --- bad input on the command line -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--executor", "pbs"), "Invalid value for '--executor'"),
        ((*LOCAL, "--slurm-opt", "qos"), "--slurm-opt 'qos': give KEY=VALUE"),
        ((*LOCAL, "--slurm-opt", "output=x"), "output: set by nsa-diag through submitit"),
        ((*LOCAL, "--time", "soon"), "--time 'soon' is not a Slurm time limit"),
        (("--partition", "gpu"), "--partition applies to --executor slurm"),
        (("--submitit-cluster", "local"), "--submitit-cluster applies to --executor slurm"),
        (("--executor", "slurm", "--no-such-option"), "No such option: --no-such-option"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], says: str
) -> None:
    out = tmp_path / "runs"
    assert run_cli(["matrix", str(write(tmp_path, TRIO)), *args, "--out", str(out)]) == EXIT_USAGE
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert says in line
    assert not out.exists(), "nothing was created"


def test_no_submitit_or_no_slurm_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = write(tmp_path, TRIO), tmp_path / "runs"
    if shutil.which("sbatch") is None:  # this machine (CI) has no Slurm: said before anything is made
        assert run_cli(["matrix", str(path), "--executor", "slurm", "--out", str(out)]) == EXIT_USAGE
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert (
            line
            == "nsa-diag: --executor slurm: no Slurm here (sbatch not found); run nsa-diag on a login node"
        )
    monkeypatch.setitem(sys.modules, "submitit", None)  # `import submitit` raises ImportError
    assert run_cli(["matrix", str(path), *LOCAL, "--out", str(out)]) == EXIT_USAGE
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "nsa-diag: --executor slurm needs submitit: pip install 'nsa-diag[slurm]'"
    assert not out.exists()


# --- runs through submitit's local executor -----------------------------------------------------------------


@pytest.mark.slow  # 20 s; the killed job below keeps the submission path in make test
def test_a_passing_a_hanging_and_a_crashing_case_as_jobs(tmp_path: Path) -> None:
    path = write(tmp_path, TRIO)
    out = tmp_path / "runs"
    junit = tmp_path / "trio.xml"
    cli = start_cli("matrix", path, *LOCAL, "--out", out, "--junit", junit)
    seen: set[int] = set()
    while cli.poll() is None:
        family_of(cli.pid, seen)
        time.sleep(0.2)
    stdout, stderr = cli.communicate(timeout=CLI_TIMEOUT_S)
    assert cli.returncode == 0, stdout + stderr
    (run_dir,) = out.iterdir()
    assert verdicts(run_dir) == {"ok": "pass", "hang": "hang", "crash": "crash"}
    assert result_of(run_dir, "hang")["hang_kind"] == "python-deadlock"
    assert (run_dir / "cases/hang/stacks.txt").is_file()
    slurm = summary_of(run_dir)["matrix"]["slurm"]
    assert summary_of(run_dir)["matrix"]["executor"] == "slurm"
    assert slurm["cluster"] == "local"
    assert set(slurm["jobs"]) == {"ok", "hang", "crash"}
    assert slurm["settings"] == {"time": "10", "options": {"qos": "normal"}}
    for name, job_id in slurm["jobs"].items():  # submitit's files are in slurm/, not in the case folders
        assert (run_dir / "slurm" / f"{job_id}_0_log.err").is_file()
        assert result_of(run_dir, name)["evidence"]["job"]["submitit_local_job_id"] == job_id
    assert not list(run_dir.glob("cases/*/*.pkl"))
    suite = ET.parse(junit).getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "0", "0")
    assert "submitted 3 case(s)" in stderr
    assert seen
    assert not wait_gone(seen), "no process outlives the run"


def _files(run_dir: Path) -> dict[str, set[str]]:
    """Per case, the files its folder holds (the evidence, not timings)."""
    return {case.name: {f.name for f in case.iterdir()} for case in (run_dir / "cases").iterdir()}


@pytest.mark.slow
def test_the_run_folder_is_the_same_as_a_local_runs(tmp_path: Path) -> None:
    path = write(tmp_path, TRIO)
    runs = {}
    for executor, extra in (("local", ("--jobs", "3")), ("slurm", LOCAL[2:])):
        out = tmp_path / executor
        junit = tmp_path / f"{executor}.xml"
        proc = run_subprocess("matrix", path, "--executor", executor, *extra, "--out", out, "--junit", junit)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (runs[executor],) = out.iterdir()
    local, slurm = runs["local"], runs["slurm"]
    assert verdicts(local) == verdicts(slurm)
    assert {p.name for p in local.iterdir()} == {p.name for p in slurm.iterdir()} - {"slurm"}
    assert _files(local) == _files(slurm)
    a, b = summary_of(local), summary_of(slurm)
    assert set(a) == set(b)
    assert [(c["name"], c["verdict"], c.get("hang_kind"), c["ok"]) for c in a["cases"]] == [
        (c["name"], c["verdict"], c.get("hang_kind"), c["ok"]) for c in b["cases"]
    ]
    for name in verdicts(local):
        x, y = result_of(local, name), result_of(slurm, name)
        assert (x["verdict"], x["hang_kind"], x["where"], sorted(x["files"])) == (
            y["verdict"],
            y["hang_kind"],
            y["where"],
            sorted(y["files"]),
        )
    cases = [
        {(t.get("name"), t.find("failure") is None) for t in ET.parse(tmp_path / f"{e}.xml").iter("testcase")}
        for e in ("local", "slurm")
    ]
    assert cases[0] == cases[1]
    for run_dir in (local, slurm):
        assert run_subprocess("report", run_dir).returncode == 0
    assert (local / "report.md").read_text().count("\n|") == (slurm / "report.md").read_text().count("\n|")


SLOW_THREE = """
    name: three
    defaults: {preset: tiny, layers: 2, seq_len: 32, batch: 1, device: cpu, timeout: 120}
    cases:
      - name: a
      - name: b
        steps: 20
        inject: ["slow:seconds=1"]
      - name: c
        steps: 20
        inject: ["slow:seconds=1"]
"""


@pytest.mark.slow
def test_an_interrupt_cancels_every_job_and_resume_submits_only_the_unfinished(tmp_path: Path) -> None:
    path = write(tmp_path, SLOW_THREE)
    out = tmp_path / "runs"
    cli = start_cli("matrix", path, *LOCAL, "--out", out)
    seen: set[int] = set()
    deadline = time.monotonic() + CLI_TIMEOUT_S
    while time.monotonic() < deadline and cli.poll() is None:
        family_of(cli.pid, seen)
        running = [list(out.glob(f"*/cases/{n}/progress.jsonl")) for n in "bc"]
        if all(running) and list(out.glob("*/cases/a/result.json")):
            break
        time.sleep(0.2)
    family_of(cli.pid, seen)
    cli.send_signal(signal.SIGINT)
    stdout, stderr = cli.communicate(timeout=CLI_TIMEOUT_S)
    assert cli.returncode == EXIT_ABORTED, stdout + stderr
    assert not wait_gone(seen), "the cancelled jobs and their workers are gone"
    (run_dir,) = out.iterdir()
    assert verdicts(run_dir) == {"a": "pass", "b": "error", "c": "error"}
    for name in "bc":
        result = result_of(run_dir, name)
        assert result["evidence"]["outcome"] == "interrupted"
        assert result["reason"].startswith("interrupted by SIGINT: nsa-diag cancelled its job ")
        assert result["evidence"]["job"]["cluster"] == "local"
    assert summary_of(run_dir)["interrupted"]
    a_mtime = (run_dir / "cases/a/result.json").stat().st_mtime_ns

    resumed = write(tmp_path, SLOW_THREE.replace("steps: 20", "steps: 1"), name="m.yaml")
    proc = run_subprocess("matrix", resumed, *LOCAL, "--resume", run_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 case(s) already finished in this folder with the same spec: not rerun" in proc.stderr
    assert "submitted 2 case(s)" in proc.stderr
    assert (run_dir / "cases/a/result.json").stat().st_mtime_ns == a_mtime
    assert verdicts(run_dir) == {"a": "pass", "b": "pass", "c": "pass"}
    assert summary_of(run_dir)["matrix"]["not_rerun"] == ["a"]


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_is_one_line_without_the_local_controllers_tracebacks(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches its whole foreground process group: nsa-diag and submitit's local job
    controller, whose KeyboardInterrupt tracebacks (it inherited nsa-diag's stderr) buried nsa-diag's one
    line. They go to the run's slurm/ folder instead."""
    path = write(tmp_path, SLOW_THREE)
    out = tmp_path / "runs"
    cli = subprocess.Popen(
        [sys.executable, "-m", "nsa_diag", "matrix", str(path), *LOCAL, "--out", str(out), "--only", "b"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=cli_env(),
        start_new_session=True,
    )  # fmt: skip
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + CLI_TIMEOUT_S
        while time.monotonic() < deadline and not list(out.glob("*/cases/b/progress.jsonl")):
            assert cli.poll() is None, cli.communicate()
            time.sleep(0.2)
        family_of(cli.pid, seen)
        os.killpg(cli.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        stdout, stderr = cli.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == EXIT_ABORTED, stdout + stderr
    assert "Traceback" not in stderr, stderr
    assert "KeyboardInterrupt" not in stderr, stderr
    assert "nsa-diag: interrupted" in stderr
    assert not wait_gone(seen)
    (run_dir,) = out.iterdir()
    assert result_of(run_dir, "b")["verdict"] == "error"
    assert "KeyboardInterrupt" in (run_dir / "slurm" / LOCAL_CONTROLLERS_LOG).read_text()


@pytest.mark.parametrize(
    "how",
    [
        "sigkill-job",  # the short sibling in the default set: a job gone without a word
        pytest.param("cancel-job", marks=pytest.mark.slow),
        pytest.param("usr2-warning", marks=pytest.mark.slow),
    ],
)
def test_a_job_ended_from_outside_gets_a_result_with_its_state(tmp_path: Path, how: str) -> None:
    """As Slurm ends a job (a node lost, scancel, the time limit near): the job's process is killed (the
    case never writes its result), cancelled the way `job.cancel()` does it (SIGINT to the job's
    controller), or sent the SIGUSR2 that submitit asks Slurm for before the time limit."""
    path = write(tmp_path, SLOW_THREE)
    out = tmp_path / "runs"
    cli = start_cli("matrix", path, *LOCAL, "--out", out, "--only", "b")
    seen: set[int] = set()
    deadline = time.monotonic() + CLI_TIMEOUT_S
    while time.monotonic() < deadline and not list(out.glob("*/cases/b/progress.jsonl")):
        assert cli.poll() is None, cli.communicate()
        time.sleep(0.2)
    family_of(cli.pid, seen)
    (controller,) = psutil.Process(cli.pid).children()  # the local job: its id is this pid
    (task,) = controller.children()  # python -m submitit.core._submit: runs run_case_job
    if how == "sigkill-job":
        task.send_signal(signal.SIGKILL)
    elif how == "usr2-warning":
        task.send_signal(signal.SIGUSR2)
    else:
        controller.send_signal(signal.SIGINT)
    stdout, stderr = cli.communicate(timeout=CLI_TIMEOUT_S)
    assert cli.returncode == 1, stdout + stderr
    assert not wait_gone(seen)
    (run_dir,) = out.iterdir()
    result = result_of(run_dir, "b")
    assert result["verdict"] == "error"
    assert result["evidence"]["outcome"] == "scheduler-ended"
    job = result["evidence"]["job"]
    assert job["id"] == str(controller.pid)
    assert job["state"] in ("FINISHED", "INTERRUPTED")
    if how == "sigkill-job":  # its controller exits normally (FINISHED) when its task is killed
        killed = f"local submitit job {controller.pid} was killed"
        assert result["reason"].startswith(killed), result["reason"]
        assert "ended FINISHED" not in result["reason"]
        assert "without a result" in result["reason"]
    else:
        assert result["reason"].startswith(f"local submitit job {controller.pid} ended {job['state']}")
    if how == "usr2-warning":  # the case was stopped on its node, with its evidence, before the limit
        assert "on its node: stopped on Slurm's warning signal (SIGUSR2)" in result["reason"]
        assert result["evidence"]["interrupted_by"] == "SIGUSR2"
    elif how == "cancel-job":
        assert "on its node: interrupted by SIGINT" in result["reason"]
    assert {"spec.json", "result.json"} <= set(result["files"])
