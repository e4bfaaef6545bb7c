"""The worker process: ``python -m nsa_diag.worker <case_dir>`` runs the case of ``<case_dir>/spec.json``.

The runner starts it in its own process group with the environment already set. In order, it:

1. opens ``stacks.txt`` and points `faulthandler` at it, for fatal signals and for SIGUSR1 (all threads):
   the runner's stack samples, which work while this process is wedged in C++;
2. maps the progress beacon (``beacon.bin``) and starts the heartbeat thread, which also answers the
   runner's ``dump.request`` with memory evidence;
3. trains (`nsa_diag.worker.train`), reporting every event to the beacon and to ``progress.jsonl``;
4. writes ``worker_result.json`` and exits 0 when the status is ok, 1 otherwise (2: bad invocation).

Faults that end the process (segfault, abort, ``os._exit``) leave no worker result: the runner tells
them from the exit status, the stacks and the beacon.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import time
from pathlib import Path

from nsa_diag import artifacts
from nsa_diag.beacon import BeaconWriter
from nsa_diag.spec import CaseSpec
from nsa_diag.worker.outcome import Outcome, exception_info, worker_report
from nsa_diag.worker.probes import Heartbeat, MemoryRecorder, Progress

USAGE = "usage: python -m nsa_diag.worker <case_dir>   (the folder holding spec.json)"


def _at_hang(memory: MemoryRecorder) -> None:
    """What the heartbeat thread records when the runner is about to kill a hung worker."""
    memory.record("at_hang")
    memory.dump_snapshot()


def run(case_dir: Path, started: float) -> int:
    """Run the case in ``case_dir``; the process exit code."""
    stacks = artifacts.open_append(case_dir / artifacts.STACKS, binary=True)
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)

    beacon = BeaconWriter(case_dir / artifacts.BEACON)
    progress = Progress(beacon, artifacts.open_append(case_dir / artifacts.PROGRESS))
    memory = MemoryRecorder(case_dir)
    Heartbeat(beacon, case_dir, on_dump=lambda: _at_hang(memory), stacks=stacks, progress=progress).start()

    try:
        spec = CaseSpec.model_validate_json((case_dir / artifacts.SPEC).read_text())
    except Exception as exc:
        reason = f"cannot read {artifacts.SPEC}: {type(exc).__name__}: {exc}"
        report = worker_report(Outcome("error", reason, exception_info(exc)))
    else:
        progress.event("setup", detail="spec read")
        # The trainer imports torch-facing modules: only after faulthandler and the beacon are up.
        from nsa_diag.worker.train import Trainer

        report = Trainer(spec, case_dir, progress, memory).run(started)
    progress.event("done", "end", status=report.status, reason=report.reason)
    artifacts.write_json(case_dir / artifacts.WORKER_RESULT, report)
    return 0 if report.status == "ok" else 1


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(USAGE, file=sys.stderr)
        return 2
    return run(Path(args[0]), started)
