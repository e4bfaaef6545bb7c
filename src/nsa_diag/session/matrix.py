"""`nsa-diag matrix`'s plan: the cases of a matrix file, `jobs` at a time, into one resumable run folder.

The run folder is the usual one (``cases/<name>/``, ``env.json``, ``summary.json``, ``summary.md``) plus
``matrix.json`` (`Matrix.to_json`: the file, its axes, per case the tags, spec hash and axis values).

- Resume: in the folder of an interrupted run, a case whose ``result.json`` carries the spec hash of the
  case as the file now defines it is finished and not run again; a case that was interrupted, skipped,
  unchecked, or whose spec changed runs again (its old folder is removed first, so no log mixes two runs).
- Parallel: ``jobs`` threads each take the next case and run it through `Session.run_case` in its own
  worker process. Only the main thread handles signals (the executor installs its handlers only there): on
  Ctrl-C, SIGTERM or SIGHUP the main thread sets a flag that each running case's progress callback turns into
  `executor.Interrupted`, so each case stops its worker and writes its result.json; no new case starts.
- GPUs: with several visible GPUs every case that runs on CUDA gets one to itself through
  ``CUDA_VISIBLE_DEVICES`` (the executor's ``extra_env``) and waits for a free one; with a single GPU the
  running cases share it.
- A case that needs CUDA (``requires: cuda``, ``device: cuda``) on a machine without it is ``skipped``
  with the reason, without a worker, and counts as ok: the file declared the requirement.

`MatrixPlan` is what the `Session` runs; `make_plan` decides what happens to each case (`ResumePlan`),
and `render_plan` shows that for ``--dry-run``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypedDict

from nsa_diag import artifacts, interrupts, render
from nsa_diag.cases import Expectation, replay_argv
from nsa_diag.interrupts import Interrupted
from nsa_diag.matrix import Matrix, MatrixCase
from nsa_diag.records import CaseEvidence
from nsa_diag.session.cluster import ClusterConfig, SlurmRun
from nsa_diag.session.core import Plan, Session, read_result
from nsa_diag.spec import CaseResult, OverrideValue
from nsa_diag.summary import MatrixSection, SlurmSection

if TYPE_CHECKING:
    from rich.console import Console

    from nsa_diag.summary import RunSummary

MATRIX_JSON = "matrix.json"
NO_CUDA_REASON = "requires cuda: torch sees no CUDA device here"


# --- what to run -------------------------------------------------------------------------------------------


@dataclass
class ResumePlan:
    """What one invocation does with each selected case, in file order."""

    cases: list[MatrixCase]
    done: dict[str, CaseResult] = field(default_factory=dict)  # finished in the resumed folder
    skip: dict[str, str] = field(default_factory=dict)  # name -> why it is skipped without a worker
    stale: list[str] = field(default_factory=list)  # case folders of the resumed run that must be redone

    @property
    def to_run(self) -> list[MatrixCase]:
        return [c for c in self.cases if c.name not in self.done and c.name not in self.skip]

    def status(self, case: MatrixCase) -> str:
        if case.name in self.done:
            return f"done ({self.done[case.name].verdict})"
        if case.name in self.skip:
            return f"skip: {self.skip[case.name]}"
        return "rerun" if case.name in self.stale else "run"


# Outcomes of a case that never reached a verdict of its own: nsa-diag was interrupted, or the scheduler
# ended its job (`nsa_diag.session.cluster`); `--resume` runs such a case again.
UNFINISHED_OUTCOMES = ("interrupted", "scheduler-ended")


# Verdicts that say what this machine could not do rather than what the case did: rerun on --resume, where
# a GPU (skipped) or the memory for the check (unchecked) may be there now.
RERUN_VERDICTS = ("skipped", "unchecked")


def finished(result: CaseResult | None, case: MatrixCase) -> bool:
    """Whether a result found on disk stands for `case`: same spec hash, and the case ran to a verdict
    (not interrupted, not ended by the scheduler, not skipped for want of a GPU, not unchecked)."""
    return (
        result is not None
        and result.spec_hash == case.spec.spec_hash()
        and result.verdict not in RERUN_VERDICTS
        and result.evidence.outcome not in UNFINISHED_OUTCOMES
    )


def make_plan(cases: Sequence[MatrixCase], *, resume_dir: Path | None, cuda: bool) -> ResumePlan:
    """Per case: finished in the resumed folder (not rerun), stale (rerun), or skipped here."""
    plan = ResumePlan(list(cases))
    for case in cases:
        if resume_dir is not None:
            case_dir = Path(resume_dir) / "cases" / case.name
            result = read_result(case_dir)
            if finished(result, case):
                assert result is not None
                plan.done[case.name] = result
                continue
            if case_dir.exists():
                plan.stale.append(case.name)
        if case.needs_cuda() and not cuda:
            plan.skip[case.name] = NO_CUDA_REASON
    return plan


def expectations(plan: ResumePlan) -> dict[str, Expectation] | None:
    """What makes each case ok: its `expect`, `skipped` when skipped here for want of CUDA, else pass.
    None when every case just has to pass (the table then has no expected column)."""
    if not plan.skip and not any(case.expect for case in plan.cases):
        return None
    table = {}
    for case in plan.cases:
        if case.name in plan.skip:
            table[case.name] = Expectation(case.name, "skipped")
        else:
            table[case.name] = case.expect or Expectation(case.name, "pass")
    return table


def gpu_slots(count: int, visible: str | None) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each GPU a case can be given; none with fewer than two GPUs.

    ``visible`` is this process's own ``CUDA_VISIBLE_DEVICES``: torch numbers the GPUs it lists from 0.
    """
    if count < 2:
        return []
    if visible is not None and visible.strip():
        return [part.strip() for part in visible.split(",") if part.strip()][:count]
    return [str(index) for index in range(count)]


# --- running ------------------------------------------------------------------------------------------------


def _skipped_result(case: MatrixCase, case_dir: Path, reason: str) -> CaseResult:
    artifacts.write_json(case_dir / artifacts.SPEC, case.spec)
    result = CaseResult(
        name=case.name,
        spec_hash=case.spec.spec_hash(),
        verdict="skipped",
        reason=reason,
        timeout_s=case.spec.timeout,
        evidence=CaseEvidence(outcome="not-started"),
        files=[artifacts.SPEC, artifacts.RESULT],
    )
    artifacts.write_json(case_dir / artifacts.RESULT, result)
    return result


@dataclass
class ParallelRun:
    """Runs cases `jobs` at a time; `run()` returns the results by name and whether it was interrupted."""

    session: Session
    jobs: int
    gpus: list[str]
    cuda: bool
    progress: MatrixProgress
    assigned: dict[str, str] = field(default_factory=dict)  # case -> CUDA_VISIBLE_DEVICES it got

    def __post_init__(self) -> None:
        self._cancel = threading.Event()
        self._signum = signal.SIGINT
        self._lock = threading.Lock()
        self._results: dict[str, CaseResult] = {}
        self._failures: list[BaseException] = []
        self._active = 0  # job threads started and not yet finished

    def _needs_gpu(self, case: MatrixCase) -> bool:
        return bool(self.gpus) and (case.spec.device == "cuda" or (case.spec.device == "auto" and self.cuda))

    def _run_one(self, case: MatrixCase, gpu: str | None) -> CaseResult:
        name = case.name

        def on_progress(state: Any, elapsed: float) -> None:
            if self._cancel.is_set():
                raise Interrupted(self._signum)
            self.progress.update(name, state, elapsed)

        case_dir = self.session.case_dir(name)
        self.progress.start(case, gpu)
        try:
            result = self.session.run_case(
                case.spec,
                on_progress=on_progress,
                extra_env={"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None,
            )
        except KeyboardInterrupt:  # stopped by the flag: the runner wrote result.json first
            result = read_result(case_dir) or CaseResult(
                name=name, spec_hash=case.spec.spec_hash(), verdict="error", reason="interrupted"
            )
        self.progress.end(result)
        return result

    def _work(self, pending: queue.Queue[MatrixCase], free_gpus: queue.Queue[str]) -> None:
        try:
            while not self._cancel.is_set():
                try:
                    case = pending.get_nowait()
                except queue.Empty:
                    return
                gpu = None
                if self._needs_gpu(case):
                    while gpu is None:
                        if self._cancel.is_set():
                            return
                        with contextlib.suppress(queue.Empty):
                            gpu = free_gpus.get(timeout=0.2)
                    self.assigned[case.name] = gpu
                try:
                    result = self._run_one(case, gpu)
                finally:
                    if gpu is not None:
                        free_gpus.put(gpu)
                with self._lock:
                    self._results[case.name] = result
        except BaseException as exc:  # a bug: stop the others, re-raise in the main thread
            self._failures.append(exc)
            self._cancel.set()
        finally:
            with self._lock:
                self._active -= 1

    def run(self, cases: Sequence[MatrixCase]) -> tuple[dict[str, CaseResult], bool]:
        pending: queue.Queue[MatrixCase] = queue.Queue()
        for case in cases:
            pending.put(case)
        free_gpus: queue.Queue[str] = queue.Queue()
        for gpu in self.gpus:
            free_gpus.put(gpu)
        threads = [
            threading.Thread(target=self._work, args=(pending, free_gpus), name=f"nsa-diag-job-{i}")
            for i in range(max(1, min(self.jobs, len(cases))))
        ]

        def interrupt(signum: int, frame: FrameType | None) -> None:
            interrupts.note(signum)
            raise Interrupted(signum)

        def note(signum: int, frame: FrameType | None) -> None:
            interrupts.note(signum)  # the running cases are being stopped: a second one must not cut that

        # The main thread waits on a counter, not in Thread.join(): a KeyboardInterrupt raised inside join()
        # can mark a thread that still runs as stopped (CPython <= 3.11, the bpo-45274 handling in
        # `_wait_for_tstate_lock`), and a later join() would then not wait for it.
        interrupted = False
        try:
            with interrupts.handled_by(interrupt):
                for thread in threads:
                    with self._lock:
                        self._active += 1
                    try:
                        thread.start()
                    except BaseException:
                        with self._lock:
                            self._active -= 1
                        raise
                while self._active:
                    time.sleep(0.1)
        except KeyboardInterrupt as exc:
            interrupted = True
            self._signum = signal.Signals[getattr(exc, "signal_name", "SIGINT")]
        finally:
            self._cancel.set()
            with interrupts.handled_by(note):
                while self._active:
                    time.sleep(0.1)
                for thread in threads:
                    if thread.ident is not None:
                        thread.join()
        if self._failures:
            raise self._failures[0]
        return dict(self._results), interrupted


# --- progress ---------------------------------------------------------------------------------------------


@dataclass
class _Running:
    """A running case as the display shows it: its number, its beacon's state, time, steps and GPU."""

    index: int
    steps: int
    gpu: str | None
    state: Any = None  # the last beacon state the job's thread saw
    elapsed: float = 0.0


class MatrixProgress(render.LiveDisplay):
    """The live display on stderr: one line per running case (where its worker is), and a count.

    On a terminal a transient display follows the beacons; elsewhere (CI logs, pipes) one line per case
    start and end. Its methods are called from the job threads.
    """

    def __init__(self, console: Console, total: int, *, already: int = 0) -> None:
        super().__init__(console)
        self.total = total
        self.started = already
        self.finished = already
        self._running: dict[str, _Running] = {}
        self._lock = threading.RLock()

    def _renderable(self) -> Any:
        from rich.console import Group
        from rich.markup import escape
        from rich.spinner import Spinner

        lines: list[Any] = [
            Spinner("dots", f"{self.finished}/{self.total} done, {len(self._running)} running", style="bold")
        ]
        for name, info in self._running.items():
            where = render.describe_state(info.state, info.steps)
            gpu = f" [GPU {info.gpu}]" if info.gpu is not None else ""
            head = f"  [{info.index}/{self.total}] {escape(name)}{gpu}"
            lines.append(f"{head}: {escape(where)} · {info.elapsed:.1f} s")
        return Group(*lines)

    def start(self, case: MatrixCase, gpu: str | None) -> None:
        with self._lock:
            self.started += 1
            info = _Running(index=self.started, steps=case.spec.steps, gpu=gpu)
            self._running[case.name] = info
            if self.live:
                self._refresh()
                return
            on_gpu = f" on GPU {gpu}" if gpu is not None else ""
            self.console.print(
                f"[{info.index}/{self.total}] {case.name}: running{on_gpu} "
                f"(stall {render.stall_text(case.spec.stall)}, "
                f"timeout {render.timeout_text(case.spec.timeout)})",
                markup=False,
                highlight=False,
            )

    def update(self, name: str, state: Any, elapsed: float) -> None:
        with self._lock:
            info = self._running.get(name)
            if info is not None:
                info.state, info.elapsed = state, elapsed
                self._refresh()

    def end(self, result: CaseResult) -> None:
        with self._lock:
            info = self._running.pop(result.name, None)
            self.finished += 1
            head = f"[{info.index if info is not None else '?'}/{self.total}] {result.name}"
            self.console.print(render.verdict_line(head, result), highlight=False)
            self._refresh()


# --- one invocation ---------------------------------------------------------------------------------------


def junit_results(
    results: Sequence[CaseResult], expected: Mapping[str, Expectation] | None
) -> list[CaseResult]:
    """The results as JUnit should judge them, with the summary's judgement (`RunSummary.judged`): a case
    that ended as its `expect` said is kept as it ended (JUnit passes it and says what was expected); one
    that did not is a failure whose message names what was expected, also when it passed."""
    out = []
    for result in results:
        exp = (expected or {}).get(result.name)
        if exp is None or exp.verdict == "pass" or exp.met_by(result.verdict, result.hang_kind):
            out.append(result)
        else:
            got = result.verdict + (f" / {result.hang_kind}" if result.hang_kind else "")
            reason = f"expected {exp.describe()}, got {got}: {result.reason}"
            out.append(
                result.model_copy(
                    update={"verdict": "error" if result.passed else result.verdict, "reason": reason}
                )
            )
    return out


class MatrixPlan(Plan):
    """The selected cases of a matrix file: the finished ones of a resumed folder kept, those that need
    CUDA skipped here, the others run `jobs` at a time (`ParallelRun`). Adds ``matrix.json`` to the run
    folder and the ``matrix`` section to the summary; JUnit judges each case by its ``expect``."""

    command = "matrix"
    stopped = "the running cases were stopped"
    records_junit = False  # summary.json of a matrix never named the JUnit file

    def __init__(
        self,
        matrix: Matrix,
        plan: ResumePlan,
        *,
        jobs: int,
        gpus: list[str],
        cuda: bool,
        resume_dir: Path | None = None,
        junit: Path | None = None,
        cluster: ClusterConfig | None = None,
    ) -> None:
        self.matrix, self.plan = matrix, plan
        self.jobs, self.gpus, self.cuda = jobs, gpus, cuda
        self.cluster = cluster  # None: here (--executor local); else each case a job (--executor slurm)
        self.job_ids: dict[str, str] = {}
        self.resume_dir = resume_dir
        self.junit = junit
        self._results: dict[str, CaseResult] = dict(plan.done)
        self.assigned: dict[str, str] = {}

    def specs(self) -> Sequence[Any]:
        return [case.spec for case in self.plan.cases]

    def expectations(self) -> Mapping[str, Expectation] | None:
        return expectations(self.plan)

    def reopened(self, session: Session) -> None:
        self.plan = make_plan(self.plan.cases, resume_dir=session.run_dir, cuda=self.cuda)
        self._results = dict(self.plan.done)

    def begin(self, session: Session) -> None:
        plan, run_dir = self.plan, session.run_dir
        artifacts.write_json(run_dir / MATRIX_JSON, self.matrix.to_json(plan.cases))
        for name in plan.stale:  # a rerun starts from an empty case folder: no log holds two runs
            if name not in plan.done:
                shutil.rmtree(run_dir / "cases" / name, ignore_errors=True)
        for case in plan.cases:
            if case.name in plan.skip:
                self._results[case.name] = _skipped_result(
                    case, artifacts.case_dir(run_dir, case.name), plan.skip[case.name]
                )
        to_run = plan.to_run
        verb = "continuing" if self.resume_dir is not None else "running"
        head = f"nsa-diag matrix {self.matrix.name}: {verb} {len(to_run)} of {len(plan.cases)} case(s)"
        lines = [f"{head} in {run_dir}"]
        if plan.done:
            lines.append(
                f"  {len(plan.done)} case(s) already finished in this folder with the same spec: not rerun"
            )
        if plan.skip:
            lines.append(f"  {len(plan.skip)} case(s) skipped: {NO_CUDA_REASON}")
        if self.cluster is not None:
            lines.append(f"  {self.cluster.describe()}")
            lines.append(f"  the jobs' own logs: {run_dir / 'slurm'}")
        elif self.jobs > 1:
            gpu_text = f", one GPU each of {', '.join(self.gpus)}" if self.gpus else ""
            lines.append(f"  {self.jobs} cases at a time{gpu_text}")
            if self.cuda and not self.gpus and any(c.spec.device != "cpu" for c in to_run):
                lines.append(
                    "  one GPU: the cases running at once share it (they must fit together; times interfere)"
                )
        for line in lines:
            session.note(line)

    def execute(self, session: Session) -> None:
        to_run = self.plan.to_run
        total = len(self.plan.cases)
        progress = MatrixProgress(session.err, total, already=total - len(to_run))
        runner: ParallelRun | SlurmRun
        if self.cluster is None:
            runner = ParallelRun(session, self.jobs, self.gpus, self.cuda, progress, self.assigned)
        else:
            name = f"nsa-diag-{self.matrix.name}"
            runner = SlurmRun(session, self.cluster, progress, name=name, job_ids=self.job_ids)
        with progress:
            ran, interrupted = runner.run(to_run)
        self._results.update(ran)
        if interrupted:
            raise KeyboardInterrupt  # the running cases were stopped, each with its result.json

    def results(self) -> list[CaseResult]:
        return [self._results[case.name] for case in self.plan.cases if case.name in self._results]

    def extend(self, summary: RunSummary) -> None:
        summary.matrix = MatrixSection(
            file=str(self.matrix.path),
            name=self.matrix.name,
            jobs=self.jobs,
            resumed=self.resume_dir is not None,
            not_rerun=sorted(self.plan.done),
            skipped_here=dict(self.plan.skip),
            gpus=dict(self.assigned),
            executor="local" if self.cluster is None else "slurm",
        )
        if self.cluster is not None:
            summary.matrix.slurm = SlurmSection(
                cluster=self.cluster.cluster,
                settings=self.cluster.settings.model_dump(exclude_defaults=True),
                jobs=dict(self.job_ids),
                at_a_time=self.cluster.jobs,  # None: every case submitted at once
                logs="slurm",
            )

    def junit_suite(self, summary: RunSummary) -> str:
        return f"matrix.{self.matrix.name}"

    def junit_results(self, results: Sequence[CaseResult]) -> Sequence[CaseResult]:
        return junit_results(results, self.expectations())

    def render(self, session: Session, summary: RunSummary) -> None:
        render.render_summary(summary)
        if self.junit is not None:
            render.stdout_console().print(
                f"JUnit XML: {self.junit}", soft_wrap=True, highlight=False, markup=False
            )


def environment_gpus(jobs: int, cases: Sequence[MatrixCase]) -> tuple[bool, list[str]]:
    """Whether CUDA is here, and the GPUs to hand out one per case (none for a single GPU or --jobs 1).

    torch is imported only when some case may run on CUDA."""
    if not any(case.needs_cuda() or case.spec.device == "auto" for case in cases):
        return False, []
    import torch

    cuda = bool(torch.cuda.is_available())
    if not cuda or jobs < 2:
        return cuda, []
    return cuda, gpu_slots(torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))


class PlanRow(TypedDict):
    """One case of ``matrix --dry-run``: what it is and what would happen to it."""

    name: str
    status: str
    tags: list[str]
    axes: dict[str, Any]  # the matrix file's axis values (the user's)
    origin: str
    model: str | None
    preset: str
    overrides: dict[str, OverrideValue]
    seq_len: int
    batch: int
    steps: int
    dtype: str
    device: str
    inject: list[str]
    expect: str | None
    spec_hash: str
    replay: list[str]


def plan_rows(matrix: Matrix, plan: ResumePlan) -> list[PlanRow]:
    """One row per selected case: what `--dry-run` lists."""
    rows: list[PlanRow] = []
    for case in plan.cases:
        spec = case.spec
        rows.append(
            {
                "name": case.name,
                "status": plan.status(case),
                "tags": list(case.tags),
                "axes": case.axes,
                "origin": case.origin,
                "model": spec.model,  # a user's model (`model:`); else the preset's TinyLM
                "preset": spec.preset,
                "overrides": spec.overrides,
                "seq_len": spec.seq_len,
                "batch": spec.batch,
                "steps": spec.steps,
                "dtype": spec.dtype,
                "device": spec.device,
                "inject": [str(inj) for inj in spec.inject],
                "expect": case.expect.describe() if case.expect else None,
                "spec_hash": spec.spec_hash(),
                "replay": ["nsa-diag", *replay_argv(spec, artifacts.DEFAULT_OUT)[3:-2]],  # less --out
            }
        )
    return rows


def render_plan(matrix: Matrix, plan: ResumePlan, *, json_output: bool) -> None:
    """`--dry-run`: the cases and what would happen to each, nothing run and no folder created."""
    rows = plan_rows(matrix, plan)
    if json_output:
        render.print_json({"file": str(matrix.path), "name": matrix.name, "cases": rows})
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title=f"nsa-diag matrix {matrix.name} ({matrix.path}): {len(rows)} case(s)", title_justify="left"
    )
    for column in (
        "case",
        "status",
        "tags",
        "model",
        "S",
        "B",
        "steps",
        "dtype",
        "device",
        "inject",
        "expect",
    ):
        table.add_column(column, overflow="fold")
    for row in rows:
        model = (row["model"] or row["preset"]) + "".join(
            f" {k}={v}" for k, v in row["overrides"].items() if v is not None
        )
        table.add_row(
            escape(row["name"]),
            escape(row["status"]),
            escape(",".join(row["tags"])) or "-",
            escape(model),
            str(row["seq_len"]),
            str(row["batch"]),
            str(row["steps"]),
            row["dtype"],
            row["device"],
            escape(" ".join(row["inject"])) or "-",
            escape(row["expect"] or "pass"),
        )
    console = render.stdout_console()
    console.print(table)
    console.print(
        f"{len(plan.to_run)} to run, {len(plan.done)} finished, {len(plan.skip)} skipped here",
        highlight=False,
    )
