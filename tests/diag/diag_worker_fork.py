"""Worker processes for test_worker.py, forked from a server that imported torch once.

``python -m nsa_diag.worker CASE`` spends about 4 s of CPU on imports before it reads its spec (torch, and
torch._dynamo, which AdamW's constructor imports); test_worker.py starts some twenty workers at once. Here
a multiprocessing forkserver makes those imports once and forks each worker from itself, as a DataLoader
forks its workers after torch is imported. The child then does what ``python -m nsa_diag.worker CASE``
does after its imports, started as test_worker.py starts it: a session of its own, stdin from /dev/null,
stdout and stderr into the case's files, `nsa_diag.worker.tether.hold`, ``main([CASE])``, its exit code.
`ForkedWorker` answers as the `subprocess.Popen` the tests would have (pid, poll, wait, returncode).

The entry point itself (``python -m nsa_diag.worker``) stays tested: test_worker.py starts one case with
it, and its bad invocations; every runner and CLI test starts real workers with it.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

# What the server imports before it forks: everything a worker imports before its first step.
PRELOAD = ["torch", "torch._dynamo", "nsa_diag.worker.main", "nsa_diag.worker.train", __name__]


def _run_worker(case: str, stdout: str, stderr: str) -> None:
    """In the forked child: the worker's start as `subprocess.Popen` and ``python -m`` would make it."""
    os.setsid()
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    from nsa_diag.worker import tether

    tether.hold()
    from nsa_diag.worker.main import main

    code = main([case])
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


class ForkedWorker:
    """A worker forked from the server, with the part of `subprocess.Popen` test_worker.py uses."""

    def __init__(self, case: Path, stdout: Path, stderr: Path) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        self._process = context.Process(
            target=_run_worker, args=(str(case), str(stdout), str(stderr)), name=f"worker {case.name}"
        )
        self._process.start()
        self.pid: int = self._process.pid  # type: ignore[assignment]
        self.args = [sys.executable, "-m", "nsa_diag.worker", str(case)]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode


def stop_server() -> None:
    """Stop the forkserver and its resource tracker once the workers have ended (each worker holds the
    server's pipe that ends it; the tether would kill one that outlived it)."""
    from multiprocessing import forkserver, resource_tracker

    forkserver._forkserver._stop()
    # The forkserver started multiprocessing's resource tracker as our child: stop it too, or the next
    # module in this pytest process (test_ddp's "nothing left behind") finds it among our children.
    resource_tracker._resource_tracker._stop()
