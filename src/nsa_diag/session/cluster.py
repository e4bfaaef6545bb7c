"""`nsa-diag matrix --executor slurm`: each case a Slurm job through submitit, followed from here.

Each case is submitted as a job (the cases of one submission form one Slurm array) that runs, on its node,
`nsa_diag.node.run_case_job`: the same `nsa_diag.executor.run_case` as a local matrix, with the same
watchdog and evidence, writing ``cases/<name>/`` into the run folder, which must be on a filesystem the
nodes share. submitit's own files (sbatch scripts, pickles, the jobs' logs) go to ``<run folder>/slurm/``.
This process (on the login node) shows live progress from the case folders (``spec.json`` appears when a
case starts on its node, its beacon says where the worker is) and the jobs' states, and collects each
case's ``result.json``; the session then writes the summary, report and JUnit as for a local run.

Every submitted case ends with a result.json:

- its own, written on its node (any verdict);
- a job Slurm ended before the case had a verdict (time limit, preemption, node failure, a cancellation
  not ours, its memory limit, ...): the parent writes (or completes) result.json with the Slurm state and
  the reason (`nsa_diag.slurm.job_end`): verdict ``error`` (``oom`` for Slurm's memory limit), evidence
  ``outcome: scheduler-ended`` with the job's id, state, nodes and the tail of its log. Such a case is not
  finished for ``--resume``, which submits it again (`nsa_diag.session.matrix.finished`);
- Ctrl-C, SIGTERM or SIGHUP here: every submitted job is cancelled (``job.cancel()``: scancel), the jobs get
  `CANCEL_WAIT_S` to stop their cases (on its node a case stopped by SIGTERM writes its own result.json),
  and each case still without one gets ``outcome: interrupted``; no more jobs are submitted; exit 130.

A SIGKILL of this process leaves the submitted jobs running (they belong to the cluster); their cases
still write their result.json, and ``--resume`` keeps those that finished.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nsa_diag import artifacts
from nsa_diag.beacon import read_beacon
from nsa_diag.cases import replay_argv
from nsa_diag.executor import InterruptGuard
from nsa_diag.matrix import MatrixCase
from nsa_diag.node import run_case_job
from nsa_diag.records import CaseEvidence, JobFacts
from nsa_diag.results import case_files, error_result
from nsa_diag.session.core import Session, read_result
from nsa_diag.slurm import (
    LOG_FOLDER,
    Cluster,
    SlurmSettings,
    base_state,
    controllers_stderr,
    is_active,
    job_end,
    log_tail,
)
from nsa_diag.spec import CaseResult


class CaseProgress(Protocol):
    """The live display a run reports to (`nsa_diag.session.matrix.MatrixProgress`)."""

    def start(self, case: MatrixCase, gpu: str | None) -> None: ...

    def update(self, name: str, state: Any, elapsed: float) -> None: ...

    def end(self, result: CaseResult) -> None: ...


POLL_S = 0.5
# A case's own result.json with these outcomes has no verdict of the case: its job's end says what happened
# (nsa-diag-ended: the case's guardian wrote it, as the job's process was killed; `nsa_diag.guard`).
NO_VERDICT = ("interrupted", "nsa-diag-ended")
# A job has ended but its case's result.json is not there yet: how long a shared filesystem may take to show
# it (submitit waits as long for its own result file); on this machine's own disk, a moment.
RESULT_GRACE_S = {"slurm": 15.0, "local": 1.0}
# After an interrupt: how long the cancelled jobs get to stop their cases and write their results (Slurm
# sends SIGTERM, then SIGKILL after its KillWait, 30 s by default; the local executor waits 1 s).
CANCEL_WAIT_S = {"slurm": 60.0, "local": 15.0}
SACCT_EVERY_S = 15.0  # how often the jobs' states are asked of Slurm (one sacct call for all of them)


@dataclass(frozen=True)
class ClusterConfig:
    """How the cases are submitted: the Slurm settings, the submitit cluster (``local``: submitit's local
    executor, a process per job here, through the same submission path), and at most ``jobs`` cases
    submitted and unfinished at a time (None: all at once, one array)."""

    settings: SlurmSettings
    cluster: Cluster = "slurm"
    jobs: int | None = None

    def describe(self) -> str:
        set_ = self.settings.model_dump(exclude_defaults=True)
        options = set_.pop("options", {})
        text = ", ".join(f"{k}={v}" for k, v in {**set_, **options}.items()) or "the cluster's defaults"
        where = "Slurm" if self.cluster == "slurm" else "submitit's local executor (a process per job here)"
        return f"each case a job through {where}; {text}"


@dataclass
class Tracked:
    """A submitted case and its job."""

    case: MatrixCase
    job: Any
    folder: Path
    started: float | None = None  # when its spec.json appeared (the case began on its node)
    ended: float | None = None  # when its job was first seen ended without a result.json
    state: str = "PENDING"


def job_state(job: Any) -> str:
    """The job's state as its scheduler last said (``UNKNOWN`` when it cannot say)."""
    try:
        return str(job.state)
    except Exception:  # sacct failing must not end the run: the case folder still tells
        return "UNKNOWN"


def job_nodes(job: Any) -> str | None:
    try:
        return job.get_info(mode="cache").get("NodeList")
    except Exception:
        return None


def exit_signal(job: Any) -> str | None:
    """The signal that killed a local executor's job process, if one did."""
    import signal

    code = getattr(getattr(job, "_process", None), "returncode", None)
    if isinstance(code, int) and code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return None


def result_saved(job: Any) -> bool | None:
    """Whether submitit saved the job's return value or exception (its result pickle); None: unknown."""
    try:
        return Path(job.paths.result_pickle).exists()
    except Exception:
        return None


@dataclass
class SlurmRun:
    """Submits the cases, follows them and collects their results; `run()` returns the results by name and
    whether it was interrupted (the counterpart of `nsa_diag.session.matrix.ParallelRun`)."""

    session: Session
    config: ClusterConfig
    progress: CaseProgress
    name: str = "nsa-diag"
    job_ids: dict[str, str] = field(default_factory=dict)  # case -> its job's id

    def __post_init__(self) -> None:
        self.results: dict[str, CaseResult] = {}
        self.active: dict[str, Tracked] = {}
        self.minutes = 0
        self._last_sacct = 0.0

    # --- submitting -----------------------------------------------------------------------------------

    def _executor(self, cases: Sequence[MatrixCase]) -> Any:
        from nsa_diag.slurm import make_executor

        self.minutes = self.config.settings.job_minutes(max(case.spec.timeout for case in cases))
        folder = self.session.run_dir.resolve() / LOG_FOLDER
        return make_executor(
            self.config.settings, folder, cluster=self.config.cluster, minutes=self.minutes, name=self.name
        )

    def _submit(self, executor: Any, batch: Sequence[MatrixCase]) -> None:
        """Submit ``batch`` (one array on Slurm); each case's folder exists before its job starts."""
        folders = [self.session.case_dir(case.name) for case in batch]
        logs = self.session.run_dir.resolve() / LOG_FOLDER
        with controllers_stderr(logs, self.config.cluster), executor.batch():
            jobs = [
                executor.submit(
                    run_case_job,
                    case.spec.model_dump_json(),
                    str(folder.resolve()),
                    replay_argv(case.spec, self.session.replay_out),
                )
                for case, folder in zip(batch, folders, strict=True)
            ]
        for case, folder, job in zip(batch, folders, jobs, strict=True):
            self.active[case.name] = Tracked(case, job, folder)
            self.job_ids[case.name] = str(job.job_id)
        ids = [str(job.job_id) for job in jobs]
        shown = ", ".join(ids[:4]) + (f", ... ({len(ids)} jobs)" if len(ids) > 4 else "")
        self.session.note(f"submitted {len(batch)} case(s): job(s) {shown}", soft_wrap=True)

    def _submit_or_refuse(self, executor: Any, batch: Sequence[MatrixCase]) -> None:
        """`_submit`; a first submission the scheduler refuses (a bad partition or account: sbatch's own
        message) is a `UsageError`, as nothing was submitted."""
        try:
            self._submit(executor, batch)
        except Exception as exc:
            if self.job_ids:
                raise
            from nsa_diag.errors import UsageError

            raise UsageError(
                f"the jobs could not be submitted ({self.session.run_dir} holds no case): "
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"
            ) from None

    # --- following ------------------------------------------------------------------------------------

    def _refresh_states(self) -> None:
        """Ask Slurm for every job's state, at most every `SACCT_EVERY_S` (submitit's watcher caches it)."""
        if self.config.cluster != "slurm" or not self.active:
            return
        if time.monotonic() - self._last_sacct < SACCT_EVERY_S:
            return
        self._last_sacct = time.monotonic()
        with contextlib.suppress(Exception):
            next(iter(self.active.values())).job.get_info(mode="force")  # one sacct for all registered

    def _ended(self, tracked: Tracked) -> bool:
        """Whether the job is over: its result pickle exists, or its state says it ended."""
        tracked.state = job_state(tracked.job)
        try:
            if tracked.job.done():
                return True
        except Exception:
            pass
        base = base_state(tracked.state)
        return base != "UNKNOWN" and not is_active(tracked.state)

    def _show_start(self, tracked: Tracked) -> None:
        if tracked.started is None:
            tracked.started = time.time()
            self.progress.start(tracked.case, None)

    def _poll(self, guard: InterruptGuard) -> None:
        self._refresh_states()
        grace = RESULT_GRACE_S[self.config.cluster]
        for name, tracked in list(self.active.items()):
            if tracked.started is None and (tracked.folder / artifacts.SPEC).exists():
                self._show_start(tracked)
            if tracked.started is not None:
                state = read_beacon(tracked.folder / artifacts.BEACON, retries=3)
                self.progress.update(name, state, time.time() - tracked.started)
            if not self._ended(tracked):
                continue
            result = read_result(tracked.folder)
            if result is None:
                tracked.ended = tracked.ended or time.monotonic()
                if time.monotonic() - tracked.ended < grace:
                    continue
            with guard.deferred():
                self._finish(tracked, result, interrupted_by=None)

    # --- results --------------------------------------------------------------------------------------

    def _job_facts(self, tracked: Tracked, evidence: CaseEvidence) -> JobFacts:
        """The job as this nsa-diag saw it, added to what its node said of it in ``evidence``."""
        job = tracked.job
        log = Path(job.paths.stderr)
        run_dir = self.session.run_dir.resolve()
        facts = (evidence.job or JobFacts()).model_copy(
            update={
                "executor": "slurm",
                "cluster": self.config.cluster,
                "id": str(job.job_id),
                "state": tracked.state,
                "nodes": job_nodes(job),
                "log": str(log.relative_to(run_dir)) if log.is_relative_to(run_dir) else str(log),
            }
        )
        tail = log_tail(log)
        if tail:
            facts.log_tail = tail
        return facts

    def _write(self, tracked: Tracked, result: CaseResult) -> CaseResult:
        folder = tracked.folder
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / artifacts.SPEC).exists():  # the job never began its case
            artifacts.write_json(folder / artifacts.SPEC, tracked.case.spec)
        artifacts.write_json(folder / artifacts.RESULT, result)
        result = result.model_copy(update={"files": case_files(folder)})
        artifacts.write_json(folder / artifacts.RESULT, result)
        return result

    def _finish(self, tracked: Tracked, result: CaseResult | None, *, interrupted_by: str | None) -> None:
        """The case's final result: its own, completed with how its job ended when the job did not let it
        reach a verdict, or written here when it has none."""
        spec = tracked.case.spec
        elapsed = time.time() - tracked.started if tracked.started is not None else 0.0
        outcome = result.evidence.outcome if result is not None else None
        if interrupted_by is not None:
            if result is None or outcome in NO_VERDICT:
                how = f"interrupted by {interrupted_by}: nsa-diag cancelled its job {tracked.job.job_id}"
                before = "" if result is None else f"; on its node: {result.reason}"
                if result is None:
                    result = error_result(spec, how, elapsed, CaseEvidence(outcome="interrupted"))
                evidence = result.evidence.model_copy(
                    update={
                        "outcome": "interrupted",
                        "interrupted_by": interrupted_by,
                        "job": self._job_facts(tracked, result.evidence),
                    }
                )
                result = self._write(
                    tracked, result.model_copy(update={"reason": how + before, "evidence": evidence})
                )
        elif result is None or outcome in NO_VERDICT:
            end = job_end(
                tracked.state,
                job_id=str(tracked.job.job_id),
                cluster=self.config.cluster,
                minutes=self.minutes,
                nodes=job_nodes(tracked.job),
                exit_signal=exit_signal(tracked.job),
                result_saved=result_saved(tracked.job),
            )
            if result is None:
                result = error_result(spec, end.reason, elapsed, CaseEvidence())
                reason = end.reason
            elif outcome == "nsa-diag-ended":  # the case's guardian wrote it: the job's process was killed
                stopped = result.reason.partition("; ")[2]
                reason = end.reason + (f"; {stopped}" if stopped else "")
            else:  # stopped on its node by a signal (SIGTERM from Slurm, its SIGUSR2 warning, ...)
                reason = f"{end.head}; on its node: {result.reason}"
            evidence = result.evidence.model_copy(
                update={"outcome": "scheduler-ended", "job": self._job_facts(tracked, result.evidence)}
            )
            update = {"verdict": end.verdict, "reason": reason, "evidence": evidence}
            result = self._write(tracked, result.model_copy(update=update))
        assert result is not None
        if tracked.started is None:
            self._show_start(tracked)
        self.results[tracked.case.name] = result
        self.active.pop(tracked.case.name, None)
        self.progress.end(result)

    def _cancel_all(self, signal_name: str) -> None:
        """Cancel every submitted job, give them `CANCEL_WAIT_S` to stop their cases, and give each case
        its result."""
        for tracked in self.active.values():
            with contextlib.suppress(Exception):
                tracked.job.cancel(check=False)
        deadline = time.monotonic() + CANCEL_WAIT_S[self.config.cluster]
        self._last_sacct = 0.0
        while self.active and time.monotonic() < deadline:
            self._refresh_states()
            for tracked in list(self.active.values()):
                if self._ended(tracked):
                    self._finish(tracked, read_result(tracked.folder), interrupted_by=signal_name)
            time.sleep(POLL_S)
        for tracked in list(self.active.values()):  # still not ended: said so in its result
            tracked.state = (
                f"{job_state(tracked.job)} (not ended {CANCEL_WAIT_S[self.config.cluster]:g} s after scancel)"
            )
            self._finish(tracked, read_result(tracked.folder), interrupted_by=signal_name)

    # --- the run --------------------------------------------------------------------------------------

    def run(self, cases: Sequence[MatrixCase]) -> tuple[dict[str, CaseResult], bool]:
        if not cases:
            return {}, False
        pending = deque(cases)
        cap = self.config.jobs or len(cases)
        guard = InterruptGuard()
        interrupted = False
        with guard:
            try:
                with guard.deferred():
                    executor = self._executor(cases)
                while pending or self.active:
                    free = cap - len(self.active)
                    if pending and free > 0:
                        batch = [pending.popleft() for _ in range(min(free, len(pending)))]
                        with guard.deferred():  # a submission is never cut in half
                            self._submit_or_refuse(executor, batch)
                    self._poll(guard)
                    time.sleep(POLL_S)
            except KeyboardInterrupt as exc:
                guard.close()
                interrupted = True
                self._cancel_all(getattr(exc, "signal_name", "SIGINT"))
        return dict(self.results), interrupted
