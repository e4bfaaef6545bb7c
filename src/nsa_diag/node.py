"""What a scheduler runs on a node: one case through `nsa_diag.executor.run_case`, from plain data.

submitit pickles the function a job runs and its arguments; `run_case_job` is that function for
``nsa-diag matrix --executor slurm``: a top-level function of an nsa_diag module (the job imports it by
name, from the same installation: the run folder and the package are on a filesystem the nodes share),
taking the spec as JSON and the case folder as a path. It runs the case exactly as a local matrix does
(same launcher, watchdog, evidence, result.json), on the node, and returns a small dict for submitit to
pickle; the parent reads the case's result.json, not that dict.

Signals on the node: Slurm sends SIGTERM to a job it cancels, preempts or ends at its time limit (SIGKILL
follows after its KillWait), and submitit asks sbatch for SIGUSR2 some seconds before the time limit.
`run_case` turns SIGTERM (and SIGINT, SIGHUP) into a stopped case with its result.json; SIGUSR2 is turned
into a SIGTERM here, so the case is stopped the same way before the hard limit, and its result says it
was Slurm's warning. The worker dies with this process in any case (`nsa_diag.worker.tether`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

from nsa_diag import artifacts, redact
from nsa_diag.executor import run_case
from nsa_diag.records import JobFacts
from nsa_diag.spec import CaseResult, CaseSpec

WARNING_SIGNAL = "SIGUSR2"
WARNING_TEXT = "Slurm's warning signal (SIGUSR2): the job's time limit is near, or it is preempted"
# Variables that say which job and node ran a case (recorded in its result's evidence).
_JOB_VARS = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SUBMITIT_LOCAL_JOB_ID")


@contextlib.contextmanager
def _warning_as_sigterm(seen: list[str]) -> Iterator[None]:
    """SIGUSR2 -> SIGTERM to this process (the case's interrupt path), noted in ``seen``."""

    def handle(signum: int, frame: FrameType | None) -> None:
        seen.append(signal.Signals(signum).name)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGUSR2, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR2, previous)


def _job_facts() -> JobFacts:
    variables = {name.lower(): os.environ[name] for name in _JOB_VARS if os.environ.get(name)}
    return JobFacts.model_validate({"host": socket.gethostname(), **variables})


def _annotate(case_dir: Path, facts: JobFacts, warned: bool) -> CaseResult | None:
    """Add where the case ran (and Slurm's warning, when it stopped the case) to its result.json."""
    path = case_dir / artifacts.RESULT
    try:
        result = CaseResult.model_validate(artifacts.read_json(path))
    except (OSError, ValueError):
        return None
    evidence = result.evidence.model_copy(update={"job": facts})
    reason = result.reason
    if warned:
        reason = f"stopped on {WARNING_TEXT}; {result.reason}"
        evidence.interrupted_by = WARNING_SIGNAL
    result = result.model_copy(update={"evidence": evidence, "reason": reason})
    artifacts.write_json(path, result)
    return result


class JobEnd(JobFacts):
    """What became of a case run as a job: its verdict, the signal that stopped it (if one did), and
    where it ran."""

    verdict: str | None = None
    stopped_by: str | None = None


def run_case_job(spec_json: str, case_dir: str, replay_argv: Sequence[str] | None = None) -> JobEnd:
    """Run one case into ``case_dir`` on this node; what became of it (the verdict, where it ran, and the
    signal that stopped it, if one did). Never raises for the case's own failures: they are its verdict."""
    spec = CaseSpec.model_validate_json(spec_json)
    folder = Path(case_dir)
    artifacts.withhold(redact.env_secret_values(os.environ))  # as nsa-diag's own process does (app.py)
    facts = _job_facts()
    warned: list[str] = []
    stopped_by = None
    with _warning_as_sigterm(warned):
        try:
            # killed from outside, this job's case is recorded by the nsa-diag that submitted it (with the
            # scheduler's word), not by the case's guardian
            replay = list(replay_argv) if replay_argv is not None else None
            run_case(spec, folder, replay_argv=replay, record_if_killed=False)
        except KeyboardInterrupt as exc:  # stopped by a signal; result.json is written
            stopped_by = getattr(exc, "signal_name", "SIGINT")
    result = _annotate(folder, facts, bool(warned) and stopped_by is not None)
    return JobEnd(
        verdict=result.verdict if result is not None else None,
        stopped_by=WARNING_SIGNAL if warned and stopped_by else stopped_by,
        **facts.given(),
    )
