"""nsa-diag under attack, with real processes and signals: what each signal to nsa-diag does, who owns a
run folder, that no process of a case outlives nsa-diag, and where torchrun's store listens.

The cases are the tiny model on the CPU (a deadlock at layer 1, or two gloo ranks through torchrun); each
test leaves no process behind, whatever it did to nsa-diag.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from diag_cli import ROOT, cli_env

CPU_CASE = ("--seq-len", "64", "--device", "cpu")
DEADLOCK = ("run", "--inject", "deadlock:layer=1", "--stall", "60", "--timeout", "60", *CPU_CASE)
DDP_DEADLOCK = ("ddp", "--nproc", "2", "--backend", "gloo", *DEADLOCK[1:])
WAIT_S = 90.0  # a loaded machine may take a minute to reach a hung layer 1


def nsa_diag(*args: str | Path, **popen: object) -> subprocess.Popen[str]:
    """``python -m nsa_diag ARGS`` started, not awaited (the caller signals it, then `finish`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "nsa_diag", *map(str, args)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        **{"cwd": ROOT, **popen},  # type: ignore[arg-type]
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def wait_for(what: Callable[[], object], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what.__doc__ or what}")


def hung_at_layer_1(out: Path) -> Callable[[], bool]:
    def hung() -> bool:
        """the worker (every rank) to enter the injected deadlock"""
        progress = [*out.glob("*/cases/*/progress.jsonl"), *out.glob("*/cases/*/ranks/*/progress.jsonl")]
        return bool(progress) and all('"kind": "deadlock"' in p.read_text(errors="replace") for p in progress)

    return hung


def alive(pids: list[int]) -> list[str]:
    """Those of `pids` still running (not zombies), with their command lines."""
    left = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(proc.cmdline())[:100]}")
        except psutil.NoSuchProcess:
            continue
    return left


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


# --- a signal that arrives while nsa-diag starts is never lost (issue 15, defect 12) ---------------------


@pytest.mark.parametrize(
    "delay",
    [0.2, 0.6, 1.4] + [pytest.param(d, marks=pytest.mark.slow) for d in (0.4, 0.8, 1.0, 2.0)],
)
def test_sigint_early_in_the_start_always_interrupts(tmp_path: Path, delay: float) -> None:
    """A Ctrl-C while Typer, pydantic or torch load (``import torch`` swallows a KeyboardInterrupt raised
    while it initialises NumPy) ends nsa-diag with 130, no case run to its end."""
    cli = nsa_diag(*DEADLOCK, "--out", tmp_path)
    time.sleep(delay)
    cli.send_signal(signal.SIGINT)
    code, _, err = finish(cli, timeout=60)
    assert code in (130, -signal.SIGINT), err
    for result in tmp_path.glob("*/cases/*/result.json"):  # a case that had begun was stopped
        assert json.loads(result.read_text())["evidence"]["outcome"] == "interrupted", err


def test_an_interrupt_swallowed_while_loading_still_stops_nsa_diag(tmp_path: Path) -> None:
    """The swallowing, made certain: a library catches the KeyboardInterrupt of a SIGINT (as torch's C++
    NumPy initialisation does); nsa-diag still exits 130 before it creates a run folder."""
    script = textwrap.dedent(
        f"""
        import os, signal, time
        from nsa_diag import interrupts
        interrupts.install()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass  # what a library that swallows it does
        from nsa_diag.app import main
        main({[*DEADLOCK, "--out", str(tmp_path)]!r})
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(), timeout=60, check=False
    )
    assert proc.returncode == 130, proc.stderr
    assert list(tmp_path.iterdir()) == []


# --- SIGHUP: a closed terminal is an interrupt (issue 15, defect 3) -------------------------------------


@pytest.mark.slow
def test_sighup_under_ddp_stops_torchrun_and_its_ranks_and_writes_the_result(tmp_path: Path) -> None:
    cli = nsa_diag(*DDP_DEADLOCK, "--out", tmp_path)
    try:
        wait_for(hung_at_layer_1(tmp_path))
        family = [p.pid for p in psutil.Process(cli.pid).children(recursive=True)]
        assert len(family) >= 3, family  # torchrun's agent and two ranks
        cli.send_signal(signal.SIGHUP)
        code, _, err = finish(cli)
    finally:
        kill_all([cli.pid])
    assert code == 130, err
    (result_path,) = tmp_path.glob("*/cases/*/result.json")
    result = json.loads(result_path.read_text())
    assert result["reason"].startswith("interrupted by SIGHUP after "), result["reason"]
    assert json.loads(next(tmp_path.glob("*/summary.json")).read_text())["interrupted"]
    time.sleep(0.5)
    left = alive(family)
    kill_all(family)
    assert left == []


# --- a run folder has one owner at a time (issue 15, defect 2) ------------------------------------------


def _files(run_dir: Path) -> dict[str, int]:
    """Every file of the run folder that the running case does not keep writing, with its mtime."""
    live = {"beacon.bin", "progress.jsonl", "stacks.txt", "stdout.log", "stderr.log"}
    return {
        str(p.relative_to(run_dir)): p.stat().st_mtime_ns
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name not in live
    }


def _lock_holder(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / ".nsa-diag.lock").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def test_a_second_resume_of_a_folder_in_use_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    matrix = tmp_path / "m.yaml"
    matrix.write_text(
        textwrap.dedent(
            """
            name: lock
            defaults: {preset: tiny, device: cpu, layers: 2, seq_len: 32, batch: 1, stall: 120, timeout: 120}
            cases:
              - name: a
                inject: ["deadlock:layer=1"]
              - name: b
            """
        )
    )
    out = tmp_path / "runs"
    first = nsa_diag("matrix", matrix, "--out", out)
    family: list[int] = []
    try:
        wait_for(hung_at_layer_1(out))
        (run_dir,) = out.iterdir()
        family = [p.pid for p in psutil.Process(first.pid).children(recursive=True)]
        before = _files(run_dir)
        holder = json.loads((run_dir / ".nsa-diag.lock").read_text())
        assert holder["pid"] == first.pid
        assert holder["command"].startswith("nsa-diag matrix ")

        second = nsa_diag("matrix", matrix, "--resume", run_dir)
        code, _, err = finish(second, timeout=60)
        assert code == 2, err
        assert f"in use by pid {first.pid} (nsa-diag matrix " in err
        assert len(err.strip().splitlines()) == 1, err
        assert _files(run_dir) == before  # the running case's folder is untouched, b not started
        assert first.poll() is None

        # a holder killed outright leaves no lock behind: a resume goes ahead (stopped at once here)
        first.kill()
        first.wait()
        kill_all(family)
        third = nsa_diag("matrix", matrix, "--resume", run_dir)
        family += [third.pid]
        assert third.stderr is not None
        opening = third.stderr.readline()  # said once it holds the folder
        assert opening.startswith("nsa-diag matrix lock: continuing"), opening
        assert _lock_holder(run_dir) == third.pid
        third.send_signal(signal.SIGINT)
        code, _, err = finish(third)
        assert code == 130, err
        assert not (run_dir / ".nsa-diag.lock").exists()  # released at the end
    finally:
        kill_all([first.pid, *family])
        first.communicate()


# --- no process of a case outlives nsa-diag, however it dies (issue 15, defect 4) -----------------------


def _family_when_hung(cli: subprocess.Popen[str], out: Path, processes: int) -> list[int]:
    """nsa-diag's descendants once the case hangs at layer 1 and all `processes` of it are up (its
    guardian, `_guardians`, aside)."""
    wait_for(hung_at_layer_1(out))
    family: list[int] = []

    def up() -> bool:
        """the case's processes to start"""
        family[:] = [p.pid for p in psutil.Process(cli.pid).children(recursive=True)]
        family[:] = [pid for pid in family if pid not in _guardians(family)]
        return len(family) >= processes

    wait_for(up, 30)
    return family


def _guardians(pids: list[int]) -> list[int]:
    """Of ``pids``, the cases' guardians (`nsa_diag.guard`): nsa-diag's own, which outlive it on purpose
    to sweep the case and write its result, then exit."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if "nsa_diag.guard" in psutil.Process(pid).cmdline():
                found.append(pid)
    return found


def _gone_within(pids: list[int], seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(pids)
    kill_all(pids)
    return left


def test_sigkill_of_nsa_diag_takes_the_worker_with_it(tmp_path: Path) -> None:
    cli = nsa_diag(*DEADLOCK, "--out", tmp_path)
    family: list[int] = []
    try:
        family = _family_when_hung(cli, tmp_path, 1)
        guardians = _guardians([p.pid for p in psutil.Process(cli.pid).children(recursive=True)])
        cli.kill()
        cli.communicate()
        assert _gone_within(family, 5) == []
        assert _gone_within(guardians, 60) == [], "the guardian writes the result, then exits"
    finally:
        kill_all([cli.pid, *family])


def _listening(pids: list[int]) -> list[tuple[int, str, int]]:
    found = []
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        found += [(pid, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    return found


def test_ddp_listens_on_loopback_only_and_dies_with_a_killed_nsa_diag(tmp_path: Path) -> None:
    """torchrun's store (issue 15, defect 5) and gloo listen on 127.0.0.1, not on every interface; a
    SIGKILL of nsa-diag takes torchrun's agent and both ranks with it, and their sockets."""
    cli = nsa_diag(*DDP_DEADLOCK, "--out", tmp_path)
    family: list[int] = []
    try:
        family = _family_when_hung(cli, tmp_path, 3)
        listening = _listening(family)
        assert listening, "torchrun's store should be listening"
        assert {ip for _, ip, _ in listening} == {"127.0.0.1"}, listening
        cli.kill()
        cli.communicate()
        assert _gone_within(family, 5) == []
        assert _listening(family) == []
    finally:
        kill_all([cli.pid, *family])


def test_a_child_whose_nsa_diag_is_already_gone_dies_at_once() -> None:
    """The parent-death signal comes only if the parent dies after it is asked for: a child that finds
    that nsa-diag (``NSA_DIAG_PID``) is no longer its parent or grandparent dies at once."""
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    script = "from nsa_diag.worker import tether; tether.hold(); print('still alive')"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=cli_env(NSA_DIAG_PID=ended.stdout.strip()),
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert "still alive" not in proc.stdout


def test_without_a_parent_death_signal_the_parent_watch_ends_an_orphan() -> None:
    """Where the kernel has no parent-death signal (not Linux), the tether's thread watches the parent."""
    orphan = (
        "import time; from nsa_diag.worker import tether; tether.die_with_parent = lambda: False; "
        "tether.hold(); print('held', flush=True); time.sleep(60)"
    )
    parent = (
        "import subprocess, sys, time; "
        f"child = subprocess.Popen([sys.executable, '-c', {orphan!r}], stdout=subprocess.PIPE, text=True); "
        "child.stdout.readline(); print(child.pid, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", parent],
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(),
        stdin=subprocess.DEVNULL,
    )
    child = 0
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        proc.kill()
        proc.wait()
        assert _gone_within([child], 5) == []
    finally:
        kill_all([proc.pid, child])


def test_an_error_an_interrupt_caused_is_the_interrupt_not_an_internal_error() -> None:
    """A Ctrl-C that cuts an import short leaves a half-loaded extension ("cannot load module more than
    once per process" at the next import): nsa-diag says it was interrupted, exit 130, not exit 3."""
    script = textwrap.dedent(
        """
        import signal
        from nsa_diag import app, interrupts
        interrupts.note(signal.SIGINT)

        def boom() -> None:
            raise ImportError("cannot load module more than once per process")

        app.app.command("boom")(boom)
        raise SystemExit(app.run_cli(["boom"]))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(), timeout=60, check=False
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == (
        "nsa-diag: interrupted by SIGINT (ImportError: cannot load module more than once per process)"
    )


# --- processes that leave the job's session, and a SIGKILLed watch (issue 27 #4, #5) --------------------


def _marked(case_dir: Path) -> list[int]:
    from nsa_diag.guard import marked

    return marked(str(case_dir.resolve()))


def test_a_daemon_that_leaves_the_jobs_session_is_stopped_with_the_case(tmp_path: Path) -> None:
    """`setsid -f` puts the sleep in a session of its own: not the job's group, not its tree. The case's
    marker finds it; the job passed, and the result names what was stopped."""
    job = "setsid -f sleep 640; exit 0"
    code, _, err = finish(nsa_diag("watch", "--out", tmp_path / "runs", "--", "sh", "-c", job))
    assert code == 0, err[-2000:]
    (case,) = (tmp_path / "runs").glob("*/cases/watch")
    result = json.loads((case / "result.json").read_text())
    assert result["verdict"] == "pass", result["reason"]
    (swept,) = result["evidence"]["stop"]["swept"]
    assert "left the job's process group or session" in result["reason"]
    assert not psutil.pid_exists(swept) or psutil.Process(swept).status() == psutil.STATUS_ZOMBIE
    assert _marked(case) == []


def test_sigkill_of_nsa_diag_watch_takes_the_job_with_it_and_the_case_gets_a_result(tmp_path: Path) -> None:
    """Nothing of nsa-diag runs after a SIGKILL: the case's guardian sees its pipe close and stops every
    process of the case (the job's shell, its child), then writes the result nsa-diag could not."""
    job = "sleep 623 & exec python3 -c 'import time; time.sleep(624)'"
    cli = nsa_diag("watch", "--out", tmp_path / "runs", "--", "sh", "-c", job)
    family: list[int] = []
    try:

        def started() -> bool:
            """the job's two processes run"""
            cases = list((tmp_path / "runs").glob("*/cases/watch"))
            family[:] = _marked(cases[0]) if cases else []
            return len(family) >= 2

        wait_for(started)
        cli.kill()
        cli.communicate()
        assert _gone_within(family, 10) == []
        (case,) = (tmp_path / "runs").glob("*/cases/watch")
        wait_for(lambda: (case / "result.json").exists(), timeout=10)
        result = json.loads((case / "result.json").read_text())
        assert result["verdict"] == "error"
        assert result["reason"].startswith("nsa-diag ended while the case ran")
    finally:
        kill_all([cli.pid, *family])


def test_a_model_factory_that_double_forks_a_daemon_leaves_nothing_behind(tmp_path: Path) -> None:
    """`run --model` with a factory that starts a daemon (fork, setsid, fork): the case passes and the
    daemon is stopped with it."""
    (tmp_path / "daemonizing.py").write_text(
        textwrap.dedent(
            """
            import os, time
            import nsa_core

            def build(spec):
                if os.fork() == 0:
                    os.setsid()
                    if os.fork() == 0:
                        time.sleep(650)
                    os._exit(0)
                return nsa_core.TinyLM(nsa_core.preset("tiny"))
            """
        )
    )
    cli = nsa_diag("run", "--model", "daemonizing:build", *CPU_CASE, "--out", tmp_path / "runs", cwd=tmp_path)
    code, _, err = finish(cli, timeout=240)
    (case,) = (tmp_path / "runs").glob("*/cases/*")
    result = json.loads((case / "result.json").read_text())
    assert _marked(case) == []
    assert result["evidence"]["stop"].get("swept"), result["reason"]
    assert code == 0, err[-2000:]


_SLOW_FACTORY = """
import time

def build(spec):
    time.sleep(3600)  # waits for a download that never comes
"""


@pytest.mark.slow
def test_the_model_pre_flight_is_bounded_by_the_timeout_and_stopped_with_nsa_diag(tmp_path: Path) -> None:
    """A factory that never returns: the pre-flight gives up at --timeout (one line, exit 2), not a fixed
    600 s; and SIGINT during it is exit 130 with nothing of the pre-flight left (issue 27 #6)."""
    (tmp_path / "stuck.py").write_text(_SLOW_FACTORY)
    start = time.monotonic()
    code, _, err = finish(
        nsa_diag("run", "--model", "stuck:build", *CPU_CASE, "--timeout", "15", "--out", tmp_path / "a",
                 cwd=tmp_path),
        timeout=120,
    )  # fmt: skip
    assert code == 2, err[-2000:]
    assert "took more than 15 s (pre-flight, bounded by --timeout)" in err
    assert len(err.strip().splitlines()) == 1, err
    assert time.monotonic() - start < 90
    assert not (tmp_path / "a").exists()

    cli = nsa_diag("run", "--model", "stuck:build", *CPU_CASE, "--out", tmp_path / "b", cwd=tmp_path)
    try:

        def building() -> bool:
            """the pre-flight child runs the factory"""
            return any("nsa_diag.worker.preflight" in " ".join(p.cmdline()) for p in _children(cli.pid))

        wait_for(building)
        family = [p.pid for p in _children(cli.pid)]
        cli.send_signal(signal.SIGINT)
        code, _, err = finish(cli, timeout=60)
        assert code == 130, err[-2000:]
        assert _gone_within(family, 10) == []
    finally:
        kill_all([cli.pid])


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
