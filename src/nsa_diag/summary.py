"""The run summary: one typed record of an invocation (`RunSummary`), written as ``summary.json``.

A `RunSummary` holds the invocation (command, argv, times), the outcome (``interrupted``, ``ok``,
``exit_code``), the verdict counts, the cases not run and one `CaseEntry` per case that has a result;
then the sections a plan or a follow-up adds (``matrix``, ``bisect``, ``repeats``, ``minimize``,
``triage``, ``junit``), each present in the file only when set. `RunSummary.build` is the one place a
summary is made, and `RunSummary.decide` the one place its exit code is: 130 when interrupted, else 0
when the run succeeded, else 1.

Both records also read like the JSON they are written as (``summary["counts"]``, ``"stack" in entry``),
so code and tests written against summary.json read them unchanged; `to_json` is the file's content.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from nsa_diag import __version__
from nsa_diag.errors import EXIT_ABORTED
from nsa_diag.records import Metrics, NonFinite, Parity, PeakMemory, Rate, Record
from nsa_diag.redact import redact_argv
from nsa_diag.spec import BuiltModel, CaseResult, CaseSpec

if TYPE_CHECKING:
    from nsa_diag.cases import Expectation

SHOWS_STACK = {"hang", "slow", "crash"}  # verdicts whose entry carries the main thread's last frames


class _JsonRecord(BaseModel):
    """A record that reads like its JSON: ``record[key]`` and ``key in record``; the
    keys in `OMIT_WHEN_NONE` are left out of the JSON (and are not "in" the record) while None."""

    model_config = ConfigDict(extra="forbid")
    OMIT_WHEN_NONE: ClassVar[tuple[str, ...]] = ()

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str) or key not in type(self).model_fields:
            return False
        return key not in self.OMIT_WHEN_NONE or getattr(self, key) is not None

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def to_json(self) -> dict[str, JsonValue]:
        """The record as written to its file, in field order."""
        data = self.model_dump(mode="json")
        return {key: value for key, value in data.items() if key in self}


class ExpectedVerdict(_JsonRecord):
    """What a case was expected to end as (selftest, a matrix case's ``expect``)."""

    verdict: str
    hang_kind: str | None = None

    def describe(self) -> str:
        return self.verdict + (f" / {self.hang_kind}" if self.hang_kind else "")


class CaseEntry(_JsonRecord):
    """One case of summary.json: the verdict, why, where, the headline numbers and, for a hang, slow
    case or crash, the innermost frames of the worker's main thread."""

    OMIT_WHEN_NONE: ClassVar[tuple[str, ...]] = ("stack", "stack_file", "expected", "model")

    name: str
    ok: bool
    verdict: str
    hang_kind: str | None = None
    reason: str
    where: str | None = None
    elapsed_s: float
    device: str | None = None
    steps_done: int = 0
    tokens_per_s: int | float | None = None
    loss: float | None = None
    peak_memory_bytes: int | None = None
    peak_memory_kind: str | None = None
    parity: Parity | None = None
    rate: Rate | None = None
    missing_grads: list[str] = []
    nonfinite: NonFinite | None = None
    dir: str
    replay: str
    stack: list[str] | None = None
    stack_file: str | None = None  # where `stack` was read: cases/<name>/stacks.txt, a rank's, a process's
    expected: ExpectedVerdict | None = None
    model: BuiltModel | None = None  # a --model: its layers and vocabulary as the worker found them

    @classmethod
    def of(
        cls,
        result: CaseResult,
        expected: Expectation | None = None,
        *,
        stack: Callable[[str], list[str]] | None = None,
    ) -> CaseEntry:
        """The entry of `result`; `stack(stacks_file)` gives the main thread's last frames in that file of
        the case folder (`CaseResult.stacks_file`), asked only for a verdict that shows them
        (`SHOWS_STACK`)."""
        metrics = result.metrics
        frames = stack(result.stacks_file()) if stack is not None and result.verdict in SHOWS_STACK else None
        peak, peak_kind = peak_memory(metrics)
        return cls(
            name=result.name,
            ok=expected.met_by(result.verdict, result.hang_kind) if expected else result.passed,
            verdict=result.verdict,
            hang_kind=result.hang_kind,
            reason=result.reason,
            where=_where(result),
            elapsed_s=round(result.elapsed_s, 3),
            device=result.device,
            steps_done=result.steps_done,
            tokens_per_s=metrics.tokens_per_s,
            loss=metrics.last_loss(),
            peak_memory_bytes=peak,
            peak_memory_kind=peak_kind,
            parity=result.parity,
            rate=result.rate,
            missing_grads=result.missing_grads,
            nonfinite=result.nonfinite,
            dir=f"cases/{result.name}",
            replay=f"cases/{result.name}/replay.sh",
            stack=frames,
            stack_file=f"cases/{result.name}/{result.stacks_file()}" if frames else None,
            expected=ExpectedVerdict(verdict=expected.verdict, hang_kind=expected.hang_kind)
            if expected is not None
            else None,
            model=result.model,
        )


# --- the follow-ups' sections (`nsa_diag.analysis.repeat`, `minimize`, `triage`) ----------------------


class Spread(Record):
    """min, median and max of some seconds (rounded to ms), and how many there were."""

    min: float
    median: float
    max: float
    n: int


class HangOdds(Record):
    """How many runs of a case hung, the probability k/n and its 95% Wilson score interval."""

    count: int
    probability: float | None = None
    ci95: list[float] = Field(default_factory=list)


class CaseRepeats(Record):
    """What the runs of one case say together (``repeats.cases``; `nsa_diag.analysis.repeat`)."""

    case: str
    repeat: int
    runs: int
    ok_runs: int
    failed_runs: int
    status: str  # pass | fail | transient
    ok: bool
    counts: dict[str, int] = Field(default_factory=dict)  # runs per verdict
    hang_kinds: dict[str, int] = Field(default_factory=dict)
    hang: HangOdds
    time_to_hang_s: Spread | None = None
    hang_steps: list[int] = Field(default_factory=list)
    elapsed_s: Spread | None = None
    failing_runs: list[str] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list)


class RepeatsSection(Record):
    """summary.json's ``repeats`` (--repeat N): per case, what its runs say together."""

    repeat: int
    folders: str
    transient: list[str] = Field(default_factory=list)
    cases: list[CaseRepeats] = Field(default_factory=list)


class CaseShape(Record):
    """The dimensions minimization shrinks (``layers``: None for a --model)."""

    layers: int | None = None
    seq_len: int
    batch: int
    steps: int
    branch: str


class MinimizeTrial(Record):
    """One trial of a minimization: the change, whether it ran and reproduced, its verdict."""

    name: str
    change: str
    ran: bool
    reproduces: bool
    verdict: str | None = None
    hang_kind: str | None = None
    reason: str
    elapsed_s: float | None = None


class MinimizeRecord(Record):
    """One failing case minimized (``minimize`` of summary.json, `nsa_diag.analysis.minimize`): from its
    shape to the smallest that still fails so, the trials, and the command that reproduces it."""

    case: str
    target: str
    target_verdict: str
    target_hang_kind: str | None = None
    start: CaseShape
    smallest: CaseShape
    reduced: bool
    runs: int
    trials: list[MinimizeTrial] = Field(default_factory=list)
    stopped: str | None = None
    interrupted: bool
    argv: list[str] = Field(default_factory=list)
    command: str
    spec: CaseSpec  # the smallest
    dir: str | None = None  # its trials' folder in the run folder
    reproduce: str | None = None  # its reproduce.sh there


class OomFigures(Record):
    """The memory figures at an out-of-memory failure: those its message gives (`parse_oom_message`: the
    request, the device's total and free memory, PyTorch's allocated and reserved, other processes by
    pid) and those derived with the case's metrics (`measure`)."""

    source: str | None = None  # cuda-caching-allocator | cpu-allocator | unknown
    requested_bytes: int | None = None
    requested_is_lower_bound: bool | None = None  # CUDA's "more than 1EB"
    total_bytes: int | None = None
    free_bytes: int | None = None
    process_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    reserved_bytes: int | None = None
    max_allocated_bytes: int | None = None
    max_reserved_bytes: int | None = None
    peak_rss_bytes: int | None = None
    device_used_bytes: int | None = None
    outside_pytorch_bytes: int | None = None
    other_processes: dict[int, int] | None = None  # pid -> bytes


class OomRerun(Record):
    """The oom case run again with one allocator setting (PYTORCH_CUDA_ALLOC_CONF)."""

    name: str
    alloc_conf: str
    verdict: str | None = None  # None: not rerun (the case already runs with it)
    reason: str
    peak_memory: PeakMemory | None = None


class TriageRecord(Record):
    """One oom case triaged (``triage`` of summary.json, `nsa_diag.analysis.triage`): its class
    (capacity, fragmentation, outside-pytorch, undetermined) and why, the figures and the reruns."""

    case: str
    device: str | None = None
    kind: str = Field(alias="class")
    why: str
    figures: OomFigures
    message: str
    reruns: list[OomRerun] = Field(default_factory=list)
    note: str | None = None
    interrupted: bool
    dir: str | None = None  # its reruns' folder in the run folder


class SlurmSection(Record):
    """How a matrix ran on Slurm: the cluster, the settings given, each case's job id, how many jobs
    at a time (None: all at once) and the logs' folder."""

    cluster: str
    settings: dict[str, str | int | dict[str, str]] = Field(default_factory=dict)  # those set (SlurmSettings)
    jobs: dict[str, str] = Field(default_factory=dict)
    at_a_time: int | None = None
    logs: str


class MatrixSection(Record):
    """summary.json's ``matrix`` (nsa-diag matrix): the file, the jobs, whether it resumed, the cases not
    rerun or skipped here, each case's GPU, and the executor (with Slurm's part)."""

    file: str
    name: str
    jobs: int
    resumed: bool
    not_rerun: list[str] = Field(default_factory=list)
    skipped_here: dict[str, str] = Field(default_factory=dict)
    gpus: dict[str, str] = Field(default_factory=dict)
    executor: str  # local | slurm
    slurm: SlurmSection | None = None


class RunSummary(_JsonRecord):
    """summary.json: the invocation, the exit code, one entry per case that has a result, and the
    sections of the plan (``matrix``, ``bisect``) and of the follow-ups."""

    OMIT_WHEN_NONE: ClassVar[tuple[str, ...]] = (
        "left_out", "matrix", "bisect", "repeats", "minimize", "triage", "junit"
    )  # fmt: skip

    command: str
    argv: list[str]
    nsa_diag_version: str
    run_dir: str
    started_at: str
    finished_at: str
    elapsed_s: float
    interrupted: bool
    ok: bool
    exit_code: int
    counts: dict[str, int]
    not_run: list[str]
    cases: list[CaseEntry]
    # checks the command left out because they cannot run here, with why (selftest's gpu-spin without CUDA)
    left_out: dict[str, str] | None = None
    matrix: MatrixSection | None = None  # nsa-diag matrix: the file, jobs, resume, GPUs
    bisect: dict[str, JsonValue] | None = None  # nsa-diag gc-bisect: bisect.json less the starting spec
    repeats: RepeatsSection | None = None  # --repeat (nsa_diag.analysis.repeat.repeats_section)
    minimize: list[MinimizeRecord] | None = None  # --minimize: one record per failing case
    triage: list[TriageRecord] | None = None  # --triage: one record per oom case
    junit: str | None = None  # --junit: the file written

    @classmethod
    def build(
        cls,
        command: str,
        run_dir: Path,
        specs: Sequence[CaseSpec],
        results: Sequence[CaseResult],
        *,
        started_at: float,
        expectations: Mapping[str, Expectation] | None = None,
        interrupted: bool = False,
        stack_of: Callable[[Path, str], list[str]] | None = None,
    ) -> RunSummary:
        """The summary of `results` (of the cases `specs`; those without a result are ``not_run``).

        `stack_of(case_dir, stacks_file)`: the main thread's last frames of a case, for the verdicts that
        show them.
        The exit code is `decide`d on every case being ok; a plan with another measure decides again.
        """
        expectations = expectations or {}

        def stack(name: str) -> Callable[[str], list[str]] | None:
            if stack_of is None:
                return None
            return lambda stacks_file: stack_of(Path(run_dir) / "cases" / name, stacks_file)

        cases = [CaseEntry.of(r, expectations.get(r.name), stack=stack(r.name)) for r in results]
        done = {result.name for result in results}
        not_run = [spec.name for spec in specs if spec.name not in done]
        counts: dict[str, int] = {}
        for case in cases:
            counts[case.verdict] = counts.get(case.verdict, 0) + 1
        all_ok = bool(cases) and all(case.ok for case in cases) and not not_run
        summary = cls(
            command=command,
            argv=redact_argv(["nsa-diag", *sys.argv[1:]]),  # `nsa_diag.redact`: no secret argument
            nsa_diag_version=__version__,
            run_dir=str(run_dir),
            started_at=_iso(started_at),
            finished_at=_iso(time.time()),
            elapsed_s=round(time.time() - started_at, 3),
            interrupted=interrupted,
            ok=all_ok and not interrupted,
            exit_code=EXIT_ABORTED,
            counts=counts,
            not_run=not_run,
            cases=cases,
        )
        summary.decide()
        return summary

    def to_json(self) -> dict[str, JsonValue]:
        data = super().to_json()
        data["cases"] = [case.to_json() for case in self.cases]
        return data

    def decide(self, succeeded: bool | None = None) -> int:
        """Set and return the exit code: 130 when interrupted, else 0 when the run succeeded (by
        default: every case ok and none left unrun, ``ok``), else 1."""
        if self.interrupted:
            self.exit_code = EXIT_ABORTED
        else:
            self.exit_code = 0 if (self.ok if succeeded is None else succeeded) else 1
        return self.exit_code

    def status(self) -> str:
        """The outcome in words: all ok, not all ok or interrupted, and what was not checked."""
        return status_text(
            ok=self.ok, interrupted=self.interrupted, counts=self.counts, left_out=self.left_out or {}
        )

    def mark_interrupted(self) -> None:
        """The run was interrupted after its cases (in a follow-up): not ok; `decide` then gives 130."""
        self.interrupted, self.ok = True, False

    def judged(self) -> dict[str, bool]:
        """Whether each case with an expectation ended as expected (what JUnit reports for it)."""
        return {case.name: case.ok for case in self.cases if case.expected is not None}

    def expected_text(self) -> dict[str, str]:
        """What each case with an expectation was expected to end as ("hang / python-deadlock")."""
        return {case.name: case.expected.describe() for case in self.cases if case.expected is not None}


def status_text(
    *, ok: bool, interrupted: bool, counts: Mapping[str, int], left_out: Mapping[str, str]
) -> str:
    """The run's outcome in words: "all ok" only when every case made its checks; cases whose check did
    not run (`unchecked`), cases skipped here and checks left out are said after it, never folded in."""
    if interrupted:
        return "not all ok (interrupted)"
    notes = []
    if counts.get("unchecked"):
        notes.append(f"{counts['unchecked']} check(s) did not run")
    if counts.get("skipped"):
        notes.append(f"{counts['skipped']} skipped here")
    if left_out:
        notes.append(f"not checked here: {', '.join(left_out)}")
    return ("all ok" if ok else "not all ok") + (f"; {', '.join(notes)}" if notes else "")


PEAK_KINDS = {
    "cuda_max_allocated_bytes": "CUDA max allocated",
    "cpu_peak_rss_bytes": "peak RSS of the worker",
}


def peak_memory(metrics: Metrics) -> tuple[int | None, str | None]:
    """The headline peak memory of a case and what it measures."""
    if metrics.peak_memory is None:
        return None, None
    peak, key = metrics.peak_memory.headline()
    return peak, PEAK_KINDS[key] if key is not None else None


def _where(result: CaseResult) -> str | None:
    """Where the case went wrong: the first non-finite module, else the beacon's last location."""
    nonfinite = result.nonfinite
    if nonfinite is not None and nonfinite.module:
        if nonfinite.module_step is not None:  # a watched job's probe: the block's output, at its step
            return f"{nonfinite.module} (output) step {nonfinite.module_step}"
        step = f" step {nonfinite.step}" if nonfinite.step is not None else ""
        return f"{nonfinite.module} ({nonfinite.where or '?'}){step}"
    if result.where is None or result.where.phase == "done":  # the worker finished: the beacon says nothing
        return None
    return result.where.describe()


def _iso(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")
