"""The life of one run folder: `Session` runs a `Plan` and owns everything around its cases.

A command validates its options, builds its specs and hands the session a plan (`nsa_diag.session.plans`:
a list of cases, a sweep, a bisection; `nsa_diag.session.matrix`: a matrix). The plan says which cases run,
in which order and how they are shown while they run, and what it adds to the summary; the session does
the rest, the same way for every command:

1. the run folder, created only now that every check has passed (or the one a plan resumes), its lock
   (`nsa_diag.artifacts.lock_run_dir`: one process at a time; a second ``--resume`` of a folder in use is
   refused with the holder's pid and command, exit 2), and env.json; an --out where they cannot be written
   (read-only, full) is a usage error, and no half folder stays;
2. the cases, each through `nsa_diag.executor.run_case` into ``cases/<name>/`` (`Session.run_case`), under
   the plan's live display on stderr;
3. an interrupt (SIGINT, SIGTERM, SIGHUP): the runner has stopped the running case's processes and written its
   result.json; the session says so, and the summary is marked interrupted (exit 130);
4. the summary (`nsa_diag.summary.RunSummary`, built once), the plan's section, the follow-ups
   (--repeat, --minimize, --triage: `nsa_diag.session.followups`) and --junit;
5. summary.json and summary.md, then the table (or the JSON with --json) on stdout;
6. the exit code, decided once (`RunSummary.decide`) on the plan's measure of success.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nsa_diag import artifacts, interrupts, render
from nsa_diag.cases import replay_argv
from nsa_diag.errors import UsageError
from nsa_diag.executor import run_case
from nsa_diag.launchers import Launcher
from nsa_diag.session.followups import FollowUps, follow_up
from nsa_diag.spec import CaseResult, CaseSpec
from nsa_diag.summary import RunSummary

if TYPE_CHECKING:
    from rich.console import Console

    from nsa_diag.beacon import BeaconState
    from nsa_diag.cases import Expectation

ProgressCallback = Callable[["BeaconState | None", float], None]


def build_summary(
    command: str,
    run_dir: Path,
    specs: Sequence[CaseSpec],
    results: Sequence[CaseResult],
    *,
    started_at: float,
    expectations: Mapping[str, Expectation] | None = None,
    interrupted: bool = False,
) -> RunSummary:
    """The summary of `results` in `run_dir`, with the main thread's last frames of each hang, slow case
    or crash (`render.main_thread_stack` of its stacks.txt)."""
    return RunSummary.build(
        command,
        run_dir,
        specs,
        results,
        started_at=started_at,
        expectations=expectations,
        interrupted=interrupted,
        stack_of=render.main_thread_stack,
    )


def read_result(case_dir: Path) -> CaseResult | None:
    """The case's result.json, or None when it has none (or it cannot be read)."""
    try:
        return CaseResult.model_validate(artifacts.read_json(Path(case_dir) / artifacts.RESULT))
    except (OSError, ValueError):
        return None


class Plan:
    """What a session runs: the cases, how they are chosen and shown, and what the plan adds to the
    summary. Subclasses implement `specs`, `execute` and `results`; the other hooks have defaults."""

    command: str = "run"  # the summary's command and the run folder's name
    stopped = "the running case was stopped"  # what an interrupt did, said on stderr
    resume_dir: Path | None = None  # a run folder to continue in, instead of a new one
    refresh_env = True  # on resume: write env.json again (this machine, now)
    catches_interrupt = True  # False: an interrupt ends the invocation at once (no summary)
    records_junit = True  # summary.json names the --junit file
    # A run folder several processes share (the nodes of a multi-node ddp case), created by the first and
    # joined by the others, each holding its own lock (`lock_name`); None: a new folder, or `resume_dir`.
    shared_dir: Path | None = None
    lock_name = artifacts.LOCK

    def home(self, run_dir: Path) -> Path:
        """Where this invocation's summary.json and summary.md go: the run folder, unless it shares it
        (a node R > 0 of a multi-node case: ``nodes/<R>/``)."""
        return run_dir

    def env_files(self, run_dir: Path) -> list[Path]:
        """Where this invocation writes env.json (a multi-node case: each node's, and node 0's as the
        run's)."""
        return [run_dir / artifacts.ENV]

    def prepare(self, follow: FollowUps) -> None:
        """Called first, before the run folder exists (e.g. to expand --repeat)."""

    def reopened(self, session: Session) -> None:
        """On resume, once the session holds the folder's lock: read again what the folder says was done
        (another process may have added to it since the command first looked)."""

    def specs(self) -> Sequence[CaseSpec]:
        """Every case the plan may run, in the summary's order (those without a result are ``not_run``)."""
        raise NotImplementedError

    def bases(self) -> tuple[Sequence[CaseSpec], Mapping[str, str] | None]:
        """The cases the follow-ups work on, and each run's case by name (None: each run is its own)."""
        return self.specs(), None

    def expectations(self) -> Mapping[str, Expectation] | None:
        """What makes each case ok, by name (None: passing)."""
        return None

    def begin(self, session: Session) -> None:
        """Once the run folder exists: the plan's opening files, and its opening lines on stderr."""
        session.note(f"nsa-diag {self.command}: {len(self.specs())} case(s) into {session.run_dir}")

    def execute(self, session: Session) -> None:
        """Run the cases through `session.run_case`; raises KeyboardInterrupt when interrupted (the
        results so far stay available to `results`)."""
        raise NotImplementedError

    def results(self) -> list[CaseResult]:
        """The results to summarize, in order."""
        raise NotImplementedError

    def extend(self, summary: RunSummary) -> None:
        """Add the plan's section to the summary."""

    def succeeded(self, summary: RunSummary) -> bool | None:
        """The plan's measure of success for the exit code; None: every case ok (``summary.ok``)."""
        return None

    def exit_code(self, summary: RunSummary) -> int:
        """The exit code once `succeeded` decided it (``summary.exit_code``); a plan may say more."""
        return summary.exit_code

    def junit_suite(self, summary: RunSummary) -> str:
        return summary.command

    def junit_results(self, results: Sequence[CaseResult]) -> Sequence[CaseResult]:
        return results

    def junit_ok(self, summary: RunSummary) -> Mapping[str, bool] | None:
        return summary.judged()

    def finish(self, session: Session, summary: RunSummary) -> None:
        """After summary.json is written: the plan's own files."""

    def to_json(self, summary: RunSummary) -> Any:
        """What --json prints."""
        return summary.to_json()

    def render(self, session: Session, summary: RunSummary) -> None:
        """What stdout shows without --json."""
        render.render_summary(summary)
        render.render_follow_ups(summary)


class Session:
    """One invocation's run folder, from its creation to the exit code: ``Session(plan, ...).run()``.

    `out`: where the run folder is created (``<out>/<time>-<command>[-<tag>]``); `replay_out`: the
    ``--out`` of each case's replay.sh (default `out`); `follow`: the follow-up options, checked
    (`nsa_diag.session.followups.check_follow_ups`).
    """

    def __init__(
        self,
        plan: Plan,
        *,
        out: Path | None,
        tag: str | None = None,
        json_output: bool = False,
        follow: FollowUps | None = None,
        replay_out: Path | None = None,
    ) -> None:
        self.plan = plan
        self.out = Path(out or artifacts.DEFAULT_OUT)
        self.tag = tag
        self.json_output = json_output
        self.follow = follow or FollowUps()
        self.replay_out = Path(replay_out) if replay_out is not None else self.out
        self.err: Console = render.stderr_console()
        self._run_dir: Path | None = None

    @property
    def run_dir(self) -> Path:
        assert self._run_dir is not None, "the run folder exists once Session.run has begun"
        return self._run_dir

    # --- for plans ----------------------------------------------------------------------------------------

    def note(self, text: str, *, soft_wrap: bool = False) -> None:
        """A line on stderr (plain text, no markup), secrets withheld as in the files (`artifacts.scrub`)."""
        self.err.print(artifacts.scrub(text), markup=False, highlight=False, soft_wrap=soft_wrap)

    def case_dir(self, name: str) -> Path:
        return artifacts.case_dir(self.run_dir, name)

    def run_case(
        self,
        spec: CaseSpec,
        *,
        folder: Path | None = None,
        on_progress: ProgressCallback | None = None,
        extra_env: Mapping[str, str] | None = None,
        launcher: Launcher | None = None,
    ) -> CaseResult:
        """Run `spec` into ``folder/<name>/`` (default: the run folder's ``cases/``); its result.
        ``launcher``: how its job starts (default: `nsa_diag.launchers.default_launcher`'s choice); its
        replay.sh runs `nsa_diag.cases.replay_argv` whatever the launcher.

        Raises `Interrupted` (a KeyboardInterrupt) after the runner stopped the case and wrote result.json.
        Callable from any thread (a matrix runs several cases at once)."""
        case_dir = Path(folder) / spec.name if folder is not None else self.case_dir(spec.name)
        return run_case(
            spec,
            case_dir,
            launcher,
            replay_argv=replay_argv(spec, self.replay_out),
            on_progress=on_progress,
            extra_env=extra_env,
        )

    def run_shown(
        self, live: render.LiveProgress, spec: CaseSpec, *, folder: Path | None = None
    ) -> CaseResult:
        """`run_case` with `live` following it: its start, where its worker is, its verdict."""
        live.case_start(spec)
        result = self.run_case(spec, folder=folder, on_progress=live.progress)
        live.case_end(result)
        return result

    def trial_runner(self, folder: Path) -> Callable[[CaseSpec], CaseResult]:
        """Runs one follow-up case into ``folder/<its name>/`` under its own live display."""

        def run_trial(spec: CaseSpec) -> CaseResult:
            with render.LiveProgress(self.err, [spec]) as live:
                return self.run_shown(live, spec, folder=folder)

        return run_trial

    # --- the run ----------------------------------------------------------------------------------------

    def run(self) -> int:
        """Run the plan into its run folder, holding the folder's lock throughout; report it, and return
        the exit code."""
        self.plan.prepare(self.follow)
        interrupts.check()  # noted while the command started (e.g. importing torch): nothing is created
        lock = self._open_run_dir()
        try:
            return self._run()
        finally:
            lock.release()

    def _open_run_dir(self) -> artifacts.RunFolderLock:
        """Create the run folder, or take the one the plan resumes, and its lock. A folder another process
        holds is refused (`UsageError`, exit 2) before anything in it changes."""
        plan = self.plan
        if plan.shared_dir is not None:
            return self._join_run_dir(plan.shared_dir)
        if plan.resume_dir is None:
            self._run_dir = artifacts.new_run_dir(plan.command, self.out, self.tag)
            return artifacts.lock_run_dir(self._run_dir)
        try:
            lock = artifacts.lock_run_dir(plan.resume_dir)
        except artifacts.FolderInUse as exc:
            raise UsageError(
                f"--resume {plan.resume_dir}: in use by {exc.holder}; wait for it to end, or stop it"
            ) from None
        self._run_dir = Path(plan.resume_dir)
        try:
            plan.reopened(self)
        except BaseException:
            lock.release()
            raise
        return lock

    def _join_run_dir(self, shared: Path) -> artifacts.RunFolderLock:
        """Create or join the folder the plan shares with other processes, under the plan's own lock of
        it; one that another process holds under the same lock is refused (`UsageError`)."""
        self._run_dir = artifacts.shared_run_dir(shared)
        try:
            lock = artifacts.lock_run_dir(self._run_dir, self.plan.lock_name)
        except artifacts.FolderInUse as exc:
            raise UsageError(f"{shared}: {self.plan.lock_name} is held by {exc.holder}") from None
        try:
            self.plan.reopened(self)
        except BaseException:
            lock.release()
            raise
        return lock

    def _run(self) -> int:
        from nsa_diag.evidence.env import collect_env

        plan, follow = self.plan, self.follow
        resumed = plan.resume_dir is not None
        keep = resumed or plan.shared_dir is not None  # a folder this invocation did not make alone
        started = time.time()
        interrupted = False
        try:  # from here on an interrupt ends in a summary marked interrupted, also while env.json is taken
            try:
                if not resumed or plan.refresh_env:
                    env = collect_env()
                    for path in plan.env_files(self.run_dir):
                        artifacts.write_json(path, env)
                plan.begin(self)
            except OSError as exc:  # e.g. the disk filled up: said before the first case, no half run folder
                if not keep:
                    artifacts.remove_run_dir(self.run_dir)
                raise UsageError(
                    f"{self.run_dir}: cannot write the run's files: {exc.strerror or exc}"
                ) from None
            plan.execute(self)
        except KeyboardInterrupt:
            if not plan.catches_interrupt:
                raise
            interrupted = True
            self.note(f"nsa-diag: interrupted; {plan.stopped}")
        results = plan.results()
        summary = build_summary(
            plan.command,
            self.run_dir,
            plan.specs(),
            results,
            started_at=started,
            expectations=plan.expectations(),
            interrupted=interrupted,
        )
        plan.extend(summary)
        bases, base_of = plan.bases()
        follow_up(
            summary,
            self.run_dir,
            bases,
            results,
            follow=follow,
            base_of=base_of,
            run_trials=self.trial_runner,
            err=self.err,
        )
        summary.decide(plan.succeeded(summary))
        summary.exit_code = plan.exit_code(summary)
        self._junit(summary, results)
        render.write_summary(plan.home(self.run_dir), summary)
        plan.finish(self, summary)
        if self.json_output:
            render.print_json(plan.to_json(summary))
        else:
            plan.render(self, summary)
        return summary.exit_code

    def _junit(self, summary: RunSummary, results: Sequence[CaseResult]) -> None:
        if self.follow.junit is None:
            return
        from nsa_diag.junit import write_junit

        plan = self.plan
        write_junit(
            self.follow.junit,
            plan.junit_suite(summary),
            plan.junit_results(results),
            elapsed_s=summary.elapsed_s,
            ok=plan.junit_ok(summary),
            expected=summary.expected_text(),
        )
        if plan.records_junit:
            summary.junit = str(self.follow.junit)
