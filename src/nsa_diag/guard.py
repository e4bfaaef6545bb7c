"""No process of a case outlives it: a per-case marker in the environment, a sweep, and a guardian process.

Every process a case starts gets ``NSA_DIAG_CASE=<the case folder>`` in its environment (the launchers'
`nsa_diag.executor` sets it), and every process those start inherits it: a DataLoader worker, a torchrun
rank, a shell's child, a daemon that double-forked or called ``setsid`` to leave the job's session and
process group. `sweep` finds them all by that marker in ``/proc/<pid>/environ`` (this user's processes)
and stops them: SIGTERM, a grace period, SIGKILL (`nsa_diag.stopping`). The executor sweeps after it
stopped a case's job, whatever ended it (a pass included: a daemon left behind is stopped and named in the
case's result).

When nsa-diag itself is killed (SIGKILL, the OOM killer) nothing of it runs any more, so each case also
has a **guardian**: ``python -m nsa_diag.guard`` in a session of its own, started before the job, without
the marker, holding the read end of a pipe whose only write end is nsa-diag's. When nsa-diag ends, however
it ends, the pipe closes; the guardian then sweeps the case, writes its result.json if none was written
(an error: nsa-diag was killed; not for a case run as a scheduler's job, which the submitting nsa-diag
records with the scheduler's word), and exits. `Guardian.release` (the case ended
normally, or ``watch --keep-alive`` left the job running on purpose) tells it to exit without sweeping.

Standard library only (and `nsa_diag.stopping`, which is too when imported): the guardian starts in a
fraction of a second and imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nsa_diag.stopping import ProcessTree, alive, stop_tree

CASE_ENV = "NSA_DIAG_CASE"
GRACE_S = 2.0
RELEASE = b"release\n"
NO_RECORD = "--no-record"  # sweep only: the case's result is another process's to write
PROC = Path("/proc")


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(PROC / str(pid) / "environ", "rb") as f:
            data = f.read(1 << 20)
    except OSError:  # gone, or not ours to read
        return False
    return needle in data.split(b"\0")


def marked(marker: str, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Live processes (this user's) whose environment holds ``NSA_DIAG_CASE=<marker>``, but ``exclude``."""
    needle = f"{CASE_ENV}={marker}".encode()
    me = os.getpid()
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir(PROC):
            if entry.isdigit() and int(entry) != me and int(entry) not in exclude:
                pid = int(entry)
                if _environ_has(pid, needle) and alive(pid):
                    found.append(pid)
    return sorted(found)


def sweep(marker: str, grace_s: float = GRACE_S, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Stop every live process marked with ``marker`` (`nsa_diag.stopping`: SIGTERM, ``grace_s``, SIGKILL);
    the pids found."""
    tree = ProcessTree(find=lambda: marked(marker, exclude))
    stop_tree(tree, grace_s=grace_s)
    return sorted(tree.seen)


class Guardian:
    """The guardian process of one case (module docstring)."""

    def __init__(self, marker: str, record: bool = True) -> None:
        self.marker = marker
        read_end, self.write_end = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != CASE_ENV}
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
        try:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-m", "nsa_diag.guard", marker, *(() if record else (NO_RECORD,))],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except OSError:
            self.proc = None
        finally:
            os.close(read_end)
        os.set_inheritable(self.write_end, False)

    def release(self) -> None:
        """The case ended as it should: the guardian exits without sweeping."""
        with contextlib.suppress(OSError):
            os.write(self.write_end, RELEASE)
        with contextlib.suppress(OSError):
            os.close(self.write_end)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _guard(marker: str, record: bool = True) -> int:
    """The guardian's body: wait for nsa-diag's word or its end (EOF on stdin), sweep on the latter."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in nsa-diag's terminal is nsa-diag's to handle
    data = b""
    while True:
        try:
            chunk = os.read(0, 64)
        except InterruptedError:
            continue
        except OSError:
            chunk = b""
        if not chunk:
            break
        data += chunk
        if RELEASE in data:
            return 0
    started = time.time()
    swept = sweep(marker)
    if record:
        _record(Path(marker), swept, started)
    return 0


def _record(case_dir: Path, swept: list[int], when: float) -> None:
    """The case's result.json when nsa-diag ended without writing one (killed): an error that says so."""
    if (case_dir / "result.json").exists() or not (case_dir / "spec.json").is_file():
        return
    try:
        from nsa_diag import artifacts
        from nsa_diag.records import CaseEvidence, Guardian
        from nsa_diag.spec import CaseResult, CaseSpec

        spec = CaseSpec.model_validate(artifacts.read_json(case_dir / "spec.json"))
        stopped = f"; its guardian stopped pid(s) {', '.join(map(str, swept))}" if swept else ""
        result = CaseResult(
            name=spec.name, spec_hash=spec.spec_hash(), verdict="error", timeout_s=spec.timeout,
            reason=f"nsa-diag ended while the case ran (killed: it wrote no result){stopped}",
            evidence=CaseEvidence(outcome="nsa-diag-ended", guardian=Guardian(swept=swept, at=when)),
        )  # fmt: skip
        # nsa-diag's parent (a cluster run's) may write the case's result meanwhile: it is never replaced
        artifacts.write_json_new(case_dir / "result.json", result)
    except Exception:  # the sweep is what matters; a result is best effort here
        return


if __name__ == "__main__":
    sys.exit(_guard(sys.argv[1], record=NO_RECORD not in sys.argv[2:]))
