"""A user's job judged as a whole (`nsa_diag.launchers.command`): its own account and its verdict.

- `job_report`: when the job exited by itself, its account as our worker would have written it
  (``worker_result.json`` of the command's unit), from its exit status, the exceptions on its stderr
  (each rank's, `rank_errors`: torchrun's own ``ChildFailedError`` is never the cause; DDP's own errors
  explained with the parameters' names, `nsa_diag.analysis.ddp_errors`) and a non-finite loss the job
  told its probe about. A signal, or a non-zero exit without a traceback, gets none: a crash (`combine`
  quotes the job's last stderr line for such an exit: Python's "can't open file", a launcher's error).
- `combine`: the case's verdict. Exited: a rank killed by a signal of its own, else the ranks' exceptions
  (`rank_errors`, each also in that rank's record), else the command's unit. Stalled or
  past the timeout: the unit that decided, where it was ("rank 1, step 5, backward, layers.7"), the ranks'
  minority (`nsa_diag.analysis.ranks.cross_rank_diff`), the processes it waits on (a DataLoader worker).
  The ranks' stragglers (``evidence.stragglers``) are named in any verdict's reason but a hang's, as ddp's.
- `restarts`: the attempts torchrun restarted (``--max-restarts``), each with what ended it; any verdict's
  reason says them (``evidence.restarts``), and the last attempt's stderr alone gives the ranks' exceptions.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from nsa_diag import artifacts
from nsa_diag.analysis.ddp_errors import DdpError, explain_ddp_error
from nsa_diag.analysis.ranks import (
    PEER_LOST,
    cross_rank_diff,
    ends_said,
    minority_by_counts,
    minority_hang_kind,
    rank_exit_codes,
)
from nsa_diag.analysis.restarts import split_attempts
from nsa_diag.analysis.tracebacks import Traceback, last_exception, rank_exceptions, thread_deaths
from nsa_diag.classify import (
    cpp_terminate,
    dataloader_worker_idle,
    focus_thread,
    is_own_code,
    never_progressed,
    waits_on_children,
    waits_on_dataloader,
)
from nsa_diag.evidence.roles import TRAINING_ROLES
from nsa_diag.evidence.stacks import read_stacks
from nsa_diag.launchers.base import Ending
from nsa_diag.records import (
    CaseEvidence,
    EndedAttempt,
    NonFinite,
    ProcessRecord,
    RankException,
    Rate,
    RestartedHang,
    StackDiff,
    StopReport,
    Stragglers,
)
from nsa_diag.spec import OOM_MESSAGES, CaseResult, CaseSpec, Where, WorkerException, WorkerReport
from nsa_diag.stackframes import ThreadStack
from nsa_diag.watchdog import HangEvidence, WatchResult, progress_rate
from nsa_diag.wire import AT_HANG_JSON, NONFINITE_JSON, PROBE_JSON, AtHang, ProbeJson

__all__ = ["PROBE_JSON", "combine", "job_report", "no_signal", "unit_ends"]

STDERR_READ_BYTES = 256 * 1024


def no_signal(info: ProbeJson) -> str | None:
    """Why SIGUSR1 must not be sent to a process with this ``probe.json`` (None: its probe takes it)."""
    if not info:
        return "no probe in this process (not Python, or started without it): SIGUSR1 could end it"
    if info.get("sigusr1") != "probe":
        return "the process handles SIGUSR1 itself"
    return None


# --- the job's own account ------------------------------------------------------------------------------


def _stderr(case_dir: Path) -> str:
    try:
        with open(case_dir / artifacts.STDERR, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - STDERR_READ_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def last_traceback(text: str) -> WorkerException | None:
    """The last Python traceback in ``text`` (a job's stderr), whoever printed it, that is not a
    launcher's summary (`nsa_diag.analysis.tracebacks`)."""
    tb = last_exception(text)
    return _worker_exception(tb) if tb is not None else None


def _worker_exception(tb: Traceback) -> WorkerException:
    return WorkerException(type=tb.type, message=tb.message, traceback=tb.text)


def _is_oom(exc: WorkerException | Traceback) -> bool:
    return exc.type.endswith(("OutOfMemoryError", "MemoryError")) or any(
        m in exc.message for m in OOM_MESSAGES
    )


def _nonfinite(case_dir: Path, infos: Mapping[int, ProbeJson]) -> NonFinite | None:
    """The first non-finite loss a probed process of the job was told of (its ``nonfinite.json``)."""
    for pid in infos:
        with contextlib.suppress(OSError, ValueError):
            record = artifacts.read_json(case_dir / "procs" / f"pid-{pid}" / NONFINITE_JSON)
            return NonFinite.model_validate({**record, "pid": pid})
    return None


def _first_block(nonfinite: NonFinite) -> str:
    """Where that step's values first went non-finite, as its probe's block sums say (none checked: "")."""
    if not nonfinite.blocks_checked:
        return ""
    if nonfinite.module:
        at = nonfinite.module_step
        earlier = f" at step {at}, whose loss was finite" if at is not None and at != nonfinite.step else ""
        return (
            f"; the first non-finite values came out of {nonfinite.module}{earlier} (block outputs checked)"
        )
    return (
        f"; the outputs of its {nonfinite.blocks_checked} blocks were finite: it went non-finite after them "
        "(the head or the loss)"
    )


def job_report(code: int, case_dir: Path, infos: Mapping[int, ProbeJson]) -> WorkerReport | None:
    """The job's account (module docstring); None when its exit status alone tells (a crash).
    ``infos``: every probed process's ``probe.json``, by pid."""
    nonfinite = _nonfinite(case_dir, infos)
    if nonfinite is not None:
        reason = (
            f"non-finite loss {nonfinite.value} at step {nonfinite.step} "
            f"(pid {nonfinite.pid}, {nonfinite.seen or 'told to nsa_diag.probe.loss'})"
            f"{_first_block(nonfinite)}; the job exited with code {code}"
        )
        return WorkerReport(status="nonfinite", reason=reason, nonfinite=nonfinite)
    if code == 0:
        return WorkerReport(status="ok", reason="the job exited with code 0")
    if code < 0:
        return None
    text = restarts(_stderr(case_dir), infos).last_text
    errors = rank_errors(text, rank_infos(infos))
    if errors:
        return raised_report(errors, text, code)
    tb = last_exception(text)
    if tb is None:
        return None
    ddp = [i for i in infos.values() if i.get("ddp_params")]
    error = _explain(tb, ddp[0] if len(ddp) == 1 else {})
    return WorkerReport(
        status=error.status,
        reason=error.reason(code),
        exception=_worker_exception(tb),
        missing_grads=list(error.missing_grads),
    )


@dataclass(frozen=True)
class RankError:
    """An exception a process of the job raised (as its stderr shows it) and what it means: the
    verdict's status (error, grad-missing or oom), the missing gradients, DDP's own error explained."""

    exception: Traceback
    status: str
    missing_grads: tuple[str, ...] = ()
    ddp_error: DdpError | None = None

    def reason(self, code: int | None = None) -> str:
        """One line: what happened, where it was raised (and the exit ``code``)."""
        exc = self.exception
        at = _frames(exc.text)
        place = f"{exc.type} at {at}" if at else exc.type
        exit_code = f"exit code {code}" if code is not None else ""
        if self.ddp_error is not None:
            return f"{self.ddp_error.explanation} ({'; '.join(filter(None, [place, exit_code]))})"
        if exc.type.rsplit(".", 1)[-1] == "BdbQuit":
            exc = replace(exc, message=_DEBUGGER_QUIT)
        text = f"{exc.type}: {exc.first_line}" + (f" at {at}" if at else "")
        return text + (f" ({exit_code})" if exit_code else "")


_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):\s*\n\[\d+\]:(?:\n[^\n]*){0,4}?\n\s*rank\s*:\s*(\d+)"
)
# torch's DataLoader when a worker died of SIGKILL ("DataLoader worker (pid 123) is killed by signal:
# Killed."): the main process raises, the worker's death is the cause
_WORKER_KILLED = re.compile(r"DataLoader worker \(pid\(?s?\)? [\d, ]+\) is killed by signal: Killed")
# pdb's BdbQuit has no message: what happened is that the code entered the debugger (a breakpoint() or
# pdb.set_trace() left in it), and the debugger read the end of its input (the job's stdin is /dev/null)
_DEBUGGER_QUIT = (
    "the debugger was entered (a breakpoint() or pdb.set_trace() in the code) and quit at once: the job's "
    "stdin is not a terminal"
)


def rank_infos(infos: Mapping[int, ProbeJson]) -> dict[int, ProbeJson]:
    """rank -> ``probe.json`` of the job's rank processes, from every probed process's (by pid): a
    process with a rank that is neither a fork (a DataLoader worker) nor the child of one of that rank;
    of ranks that torchrun restarted, the last attempt's."""
    by_pid = {info.get("pid", pid): info for pid, info in infos.items()}
    ranks: dict[int, ProbeJson] = {}
    for info in infos.values():
        rank, parent = info.get("rank"), by_pid.get(info.get("ppid"), {})
        own = isinstance(rank, int) and not info.get("forked_from") and parent.get("rank") != rank
        if own and (rank not in ranks or attempt_of(info) >= attempt_of(ranks[rank])):
            ranks[rank] = info
    return ranks


def attempt_of(info: ProbeJson) -> int:
    """The torchrun attempt a process belongs to: its restart count (0: never restarted, or no torchrun)."""
    count = info.get("restart_count")
    return count if isinstance(count, int) else 0


@dataclass(frozen=True)
class Restarts:
    """torchrun's restarts of the job's ranks (`restarts`): how each restarted attempt ended, in a record
    and in words, and the last attempt's stderr (where its own exceptions are read)."""

    ended: list[EndedAttempt]
    said: list[str]
    last_text: str

    def text(self, final: str = "") -> str:
        """The sentence appended to a verdict's reason, or "" when torchrun restarted nothing: "; torchrun
        restarted the ranks N time(s): attempt 1 ended with rank 1: OSError: ... (exit code 1)", or "...:
        attempt 1 ended the same way" where every earlier attempt ended as the ``final`` reason says."""
        if not self.ended:
            return ""
        times = f"{len(self.ended)} time{'s' if len(self.ended) > 1 else ''}"
        gists = {re.sub(r"\d+", "#", said.split(": ", 1)[-1]) for said in self.said}
        if final and len(gists) == 1 and gists.pop() in re.sub(r"\d+", "#", final):
            which = "attempt 1" if len(self.ended) == 1 else f"attempts 1-{len(self.ended)}"
            return f"; torchrun had restarted the ranks {times}: {which} ended the same way"
        ends = "; ".join(
            f"attempt {e.attempt} ended with {said}" for e, said in zip(self.ended, self.said, strict=True)
        )
        return f"; torchrun restarted the ranks {times}: {ends}"


def restarts(text: str, infos: Mapping[int, ProbeJson], hangs: Sequence[RestartedHang] = ()) -> Restarts:
    """The attempts of the job that torchrun restarted (``--max-restarts``; `nsa_diag.analysis.restarts`),
    from its stderr ``text`` and every probed process's ``probe.json`` (``infos``, any keys): the first
    process that failed in each, with its exception where that attempt's stderr shows one; an attempt
    that hung and whose ranks nsa-diag stopped for torchrun to restart (``hangs``) ended with that hang."""
    restarted = max((attempt_of(info) for info in infos.values()), default=0)
    if restarted == 0:
        return Restarts([], [], text)
    ends, last = split_attempts(text, restarted)
    by_pid = {info.get("pid", pid): info for pid, info in infos.items()}
    hung = {h.attempt: h for h in hangs}
    ended, said = [], []
    for n, end in enumerate(ends, 1):
        if (hang := hung.get(n - 1)) is not None:
            kind = f" ({hang.hang_kind})" if hang.hang_kind else ""
            said.append(f"a hang{kind}: {hang.reason} (nsa-diag stopped its ranks for torchrun to restart)")
            rank = hang.unit if hang.unit in {i.get("rank") for i in infos.values()} else None
            ended.append(
                EndedAttempt(attempt=n, pid=end.pid, rank=rank, exit_code=end.exit_code, hang=hang.reason)
            )
            continue
        rank = by_pid.get(end.pid, {}).get("rank")
        attempt = {pid: info for pid, info in by_pid.items() if attempt_of(info) == n - 1}
        errors = rank_errors(end.text, rank_infos(attempt))
        if errors and not (isinstance(rank, int) and rank in errors):
            rank = cause_rank(errors, end.text)
        error = errors.get(rank) if isinstance(rank, int) else None
        who = f"rank {rank}" if isinstance(rank, int) else f"pid {end.pid} (local rank {end.local_rank})"
        if error is not None:
            said.append(f"{who}: {error.reason(end.exit_code)}")
        elif end.exit_code < 0:
            said.append(f"{who} killed by {_signal_name(-end.exit_code)}")
        else:
            said.append(f"{who} exiting with code {end.exit_code}")
        ended.append(
            EndedAttempt(
                attempt=n, pid=end.pid, rank=rank if isinstance(rank, int) else None,
                exit_code=end.exit_code, exception=_rank_exception(error) if error is not None else None,
            )
        )  # fmt: skip
    return Restarts(ended, said, last)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# restarted ranks that hang or fail connecting their process group: with gloo on torch 2.13, 8 of 13 runs
# of tests/diag/jobs/elastic_retry.py after their restart (static or c10d rendezvous), none of 16 with the
# variable set
_RESTART_CONNECT = (
    "restarted ranks that cannot connect in init_process_group may be reading the last attempt's addresses "
    "from torchrun's store, which the job's process group shares (pytorch/pytorch#135712): "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives the process group a store of its own"
)


def rank_errors(text: str, infos: Mapping[int, ProbeJson]) -> dict[int, RankError]:
    """Each rank's exception on the job's stderr ``text`` (`nsa_diag.analysis.tracebacks`), explained
    with that rank's ``probe.json`` (``infos``, by rank: DDP's parameter order)."""
    found = rank_exceptions(text, infos.keys(), rank_exit_codes(text))
    return {rank: _explain(tb, infos.get(rank, {})) for rank, tb in found.items()}


def _explain(tb: Traceback, info: ProbeJson) -> RankError:
    names = info.get("ddp_params")
    options = info.get("ddp_options")
    find_unused = options.get("find_unused_parameters") if isinstance(options, dict) else None
    explained = explain_ddp_error(
        tb.message,
        [str(n) for n in names] if isinstance(names, list) else [],
        traceback=tb.text,
        find_unused=find_unused if isinstance(find_unused, bool) else None,
    )
    if explained is not None:
        unused = explained.kind == "unused-parameters"
        status = "grad-missing" if unused else "error"
        return RankError(tb, status, explained.params if unused else (), explained)
    return RankError(tb, "oom" if _is_oom(tb) else "error")


def cause_rank(errors: Mapping[int, RankError], text: str) -> int:
    """The rank whose exception is the job's: not one that only lost its peer, torchrun's first observed
    failure where that rank raised, else the lowest rank."""
    # a rank whose peer died raises too (gloo: "Connection closed by peer"): the peer's failure is the cause
    own = [r for r, e in errors.items() if not PEER_LOST.search(e.exception.message)] or list(errors)
    first = _ROOT_CAUSE.search(text)
    if first is not None and int(first.group(1)) in own:
        return int(first.group(1))
    return min(own)


def raised_report(errors: Mapping[int, RankError], text: str, code: int | None) -> WorkerReport:
    """The job's account when ranks raised: the cause's exception (`cause_rank`), the ranks that raised
    the same, one line for each rank that raised something else."""
    rank = cause_rank(errors, text)
    error = errors[rank]
    same = sorted(r for r, e in errors.items() if _gist(e) == _gist(error))
    reason = f"{_ranks_text(same)}: {error.reason(code)}"
    others = [r for r in sorted(errors) if r not in same]
    for other in others[:3]:
        reason += f"; rank {other}: {errors[other].reason()}"
    if len(others) > 3:
        reason += f"; {len(others) - 3} more rank(s) raised"
    if others and any(e.exception.found_by == "order" for e in errors.values()):
        reason += f"; {GUESSED}"
    return WorkerReport(
        status=error.status,
        reason=reason,
        exception=_worker_exception(error.exception),
        missing_grads=list(error.missing_grads),
    )


GUESSED = "which rank printed which traceback is a guess from their order (no [rankN]: prefix)"


def _gist(error: RankError) -> str:
    """The error without its numbers: ranks that raised it "for rank 0" and "for rank 1" raised the same."""
    return re.sub(r"\d+", "#", error.reason())


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def _frames(traceback: str) -> str | None:
    """``"distributed.py:1775 in _pre_forward, called from train.py:52 in main"``: the innermost frame,
    and the innermost of the job's own code (outside Python's library and installed packages)."""
    frames = [m.groups() for m in (_FRAME.match(line) for line in traceback.splitlines()) if m]
    if not frames:
        return None
    text = _frame_text(frames[-1])
    own = [f for f in frames if is_own_code(f[0])]
    if own and own[-1] != frames[-1]:
        text += f", called from {_frame_text(own[-1])}"
    return text


def _frame_text(frame: tuple[str, ...]) -> str:
    file, line, func = frame
    return f"{os.path.basename(file)}:{line} in {func}"


# --- per unit, and the job's verdict -----------------------------------------------------------------


def unit_ends(
    case_dir: Path,
    units: Sequence[Any],
    watched: Sequence[WatchResult],
    hangs: Mapping[int, HangEvidence],
    stop: StopReport,
    ranks: Mapping[int, int],
) -> dict[int, tuple[WatchResult, StopReport]]:
    """Each unit's end: the command's own exit status; a rank's from torchrun's failure summary (or
    mp.spawn's exception); any other process that had exited before the evidence: 0 when its probe saw a
    normal exit, the signal the job's stderr says ended it (`ends_said`), else unknown."""
    stderr = _stderr(case_dir)
    codes, said = rank_exit_codes(stderr), ends_said(stderr)
    ends = {}
    for i, (unit, w) in enumerate(zip(units, watched, strict=True)):
        info = _info(unit.folder)
        own = info.get("exit_code") if isinstance(info.get("exit_code"), int) else None  # os._exit's
        # stopped by its launcher after another rank failed (its probe may still have seen it exit), or a
        # DataLoader worker torch said was killed
        by_stderr = said.get(info["pid"]) if isinstance(info.get("pid"), int) else None
        if own is not None:
            normal = own
        elif by_stderr is not None:
            normal = by_stderr
        else:
            normal = 0 if info.get("exited") else None
        if i == 0:
            code = stop.exit_code
        elif unit.key in ranks:
            code = codes.get(unit.key, normal)
        else:
            code = normal
        if w.outcome != "exited" and unit.key not in hangs and i != 0:
            w = replace(w, outcome="exited", decision=None, exit_code=code)
        ends[unit.key] = (
            w,
            stop.model_copy(update={"exit_code": code if w.outcome == "exited" else stop.exit_code}),
        )
    return ends


def _info(folder: Path) -> ProbeJson:
    try:
        return cast(ProbeJson, dict(artifacts.read_json(folder / PROBE_JSON)))
    except (OSError, ValueError):
        return ProbeJson()


def location(result: CaseResult, rank: int | None) -> str:
    """``"rank 1, step 5, backward, layers.7"``: where a unit was, as far as its probe could know."""
    return place(result.where, rank)


def place(w: Where | None, rank: int | None) -> str:
    """`location` of a beacon's position ``w``."""
    parts = [f"rank {rank}"] if rank is not None else []
    if w is not None and w.phase == "step" and w.event == "end" and w.step is not None:
        parts.append(f"step {w.step + 1}, before any hooked block (step {w.step}'s optimizer step done)")
    elif w is not None:
        if w.step is not None:
            parts.append(f"step {w.step}")
        if w.phase:
            parts.append(w.phase)
        if w.module:
            parts.append(w.module if w.phase else f"in {w.module}")
    return ", ".join(parts) or "before any progress the probe could see"


def _label(key: int, info: ProbeJson, ranks: Mapping[int, int], root: int) -> str:
    pid = ranks.get(key, key)
    what = f"rank {key} (pid {pid})" if key in ranks else f"pid {pid}"
    if key == root:
        what += " (the command)"
    elif info.get("forked_from"):
        what += f" (forked from pid {info['forked_from']})"
    return what


def _focus(folder: Path) -> ThreadStack | None:
    for threads in reversed(read_stacks(folder / artifacts.STACKS).sample_threads()):
        thread = focus_thread(threads)
        if thread is not None:
            return thread
    return None


def _waited_on(
    key: int,
    thread: ThreadStack | None,
    per_unit: Mapping[int, CaseResult],
    roles: Mapping[int, str],
    parents: Mapping[int, int | None],
) -> list[int]:
    """The processes the stalled unit ``key`` waits on: its DataLoader workers when its stack waits inside
    the DataLoader, its other children when it waits in subprocess or multiprocessing; else none (a process
    stuck on its own lock waits on no one)."""
    children = [k for k in per_unit if k != key and parents.get(k) == key]
    if waits_on_dataloader(thread):
        return [k for k in children if roles.get(k) == "dataloader-worker"]
    if waits_on_children(thread):
        return [k for k in children if roles.get(k) != "dataloader-worker"]
    return []


def job_rate(w: WatchResult, spec: CaseSpec, total: int | None) -> Rate:
    """Progress rate of a unit; with the job's total steps, the fraction done and the ETA."""
    now = w.history[-1].t
    if total:
        return progress_rate(w.history, now, spec.model_copy(update={"steps": total}))
    rate = progress_rate(w.history, now, spec.model_copy(update={"steps": sys.maxsize}))
    known = rate.model_dump(exclude={"fraction_done", "eta_s", "estimated_total_s"})
    eta = (
        "unknown: the job's total steps are unknown "
        "(nsa-diag watch --total-steps N, or nsa_diag.probe.total_steps(n))"
    )
    return Rate.model_validate({**known, "steps_total": None, "eta": eta})


def _slow_reason(rate: Rate, timeout: float | None, where: str, evidence: CaseEvidence) -> str:
    """A slow job's reason: what showed it still worked (the liveness signals) or the pause it was in
    (``evidence``'s ``work`` and ``activity``), its steps and rate, and its ETA."""
    work, activity = evidence.work, evidence.activity
    box = f"{timeout:g} s timeout" if timeout is not None else "time box"
    if work is not None and work.working:
        still = f"still working past the {box} ({work.text})"
    elif activity:
        still = f"not stuck when the {box} ran out ({activity})"
    else:
        still = f"progress continued past the {box}"
    text = f"{still}: {rate.steps_done} step(s) done at {rate.steps_per_s:g} steps/s, now at {where}"
    if rate.eta_s is not None:
        return (
            text + f"; ETA {rate.eta_s:g} s more ({rate.steps_total} steps, "
            f"~{rate.estimated_total_s:g} s in all)"
        )
    return text + "; ETA unknown (total steps unknown)"


def process_state(
    key: int, res: CaseResult, role: str | None, info: ProbeJson, folder: Path | None, alive: bool
) -> str:
    """What one process of the job was doing when the case ended, true of it whatever its role (module
    docstring): exited normally, killed, idle, waiting on its ranks, working, stuck, or its own verdict."""
    if not alive:
        if res.signal:
            return f"killed by {res.signal}"
        code = res.exit_code if res.exit_code is not None else info.get("exit_code")
        if code == 0 or (code is None and info.get("exited")):
            return "exited normally" + (f" (code {code})" if code is not None else "")
        if code is not None:
            return f"exited with code {code}"
        return "ended (exit status unknown: not nsa-diag's child, and its probe saw no normal exit)"
    thread = _focus(folder) if folder is not None else None
    activity = res.evidence.activity
    # what it did instead of being stuck: work the liveness signals saw, or a pause (a sleep, a checkpoint)
    doing = "working" if res.evidence.work is not None and res.evidence.work.working else "paused"
    if role == "dataloader-worker":
        if activity:
            return f"{doing}: {activity}"
        if dataloader_worker_idle(thread):
            return "idle: waiting for indices from the training process"
        return f"stuck: {res.reason}" if res.verdict == "hang" else "waiting (its stacks say no more)"
    if role == "launcher":
        return "waiting on its ranks (torch's launcher)"
    if role == "shell":
        return "waiting for its child process"
    if activity:
        return f"{doing}: {activity}"
    if res.verdict == "hang":
        return f"stuck ({res.hang_kind}): {res.reason}"
    return res.verdict


def _record(
    key: int,
    res: CaseResult,
    role: str | None,
    info: ProbeJson,
    ranks: Mapping[int, int],
    root: int,
    folder: Path | None,
    alive: bool,
) -> ProcessRecord:
    training = role in TRAINING_ROLES or role is None
    state = process_state(key, res, role, info, folder, alive)
    reason = res.reason
    if not training and res.verdict == "crash" and res.exit_code is None and not res.signal:
        # a helper that ended with the job (a Pool's worker its pool terminated): no crash of ours to name
        reason = state
    return ProcessRecord(
        label=_label(key, info, ranks, root), role=role, state=state,
        verdict=res.verdict if training else None, hang_kind=res.hang_kind if training else None,
        reason=reason, where=location(res, key if key in ranks else None),
        exit_code=res.exit_code,
    )  # fmt: skip


def _timeout_decider(per_unit: Mapping[int, CaseResult], training: Sequence[int], fallback: int) -> int:
    """At the timeout every unit's time ran out at once: the verdict is about the training process furthest
    behind (fewest steps), not whichever process came first (torchrun's agent)."""
    if not training:
        return fallback
    return min(training, key=lambda k: (per_unit[k].steps_done, k))


def combine(
    spec: CaseSpec,
    end: Ending,
    *,
    root: int,
    infos: Mapping[int, ProbeJson],
    ranks: Mapping[int, int],
    rates: Mapping[int, Rate],
    folders: Mapping[int, Path],
    roles: Mapping[int, str] | None = None,
    parents: Mapping[int, int | None] | None = None,
    alive: Sequence[int] = (),
    stragglers: Stragglers | None = None,
    blamed: Sequence[int] = (),
) -> CaseResult:
    """The job's result from its units' (module docstring). ``roles`` and ``parents`` (by unit key): what
    each process is and which unit it was forked from; ``alive``: the unit keys still running when the
    evidence was taken; ``stragglers``: the ranks' step times compared; ``blamed``: the ranks the flight
    recorders' dumps blame (`nsa_diag.analysis.flight`), for a hang the stacks do not settle."""
    outcome, per_unit, decider, stop = end.outcome, end.per_unit, end.decider, end.stop
    roles, parents = roles or {}, parents or {}
    running = set(alive) if outcome != "exited" else set()
    processes = {
        str(key): _record(
            key, res, roles.get(key), infos.get(key, {}), ranks, root, folders.get(key), key in running
        )
        for key, res in per_unit.items()
    }
    evidence = CaseEvidence(stop=stop)
    evidence.add(end.notes)
    evidence.processes = processes
    if stragglers is not None:
        evidence.stragglers = stragglers
    # said even when the job passes, as ddp does; a hang's reason is where the job stopped
    named = f"; straggler {stragglers.describe()}" if stragglers is not None and stragglers.slow else ""
    training = [k for k in per_unit if roles.get(k) in TRAINING_ROLES]
    steps = max((per_unit[k].steps_done for k in training or per_unit), default=0)
    stderr = _stderr(end.case_dir)  # the job's stderr, read once
    again = restarts(stderr, infos, end.notes.restarted_hangs) if ranks else Restarts([], [], "")
    if again.ended:
        evidence.restarts = again.ended
    if outcome == "exited":
        text = again.last_text
        raised = rank_errors(text, {r: infos.get(r, {}) for r in ranks}) if ranks else {}
        _note_raised(raised, processes, evidence)
        crashed = [k for k in ranks if k in per_unit and per_unit[k].verdict == "crash" and k not in raised]
        signalled = [k for k in crashed if per_unit[k].signal not in (None, "SIGTERM")]
        if raised and not signalled and per_unit[root].verdict in ("crash", "error", "oom", "grad-missing"):
            # A rank's exception is the cause; the ranks torchrun stopped after it (SIGTERM) are not, nor
            # those that exited without a traceback. A rank killed by a signal of its own still is.
            report = raised_report(raised, text, per_unit[root].exit_code)
            base = per_unit[root]
            left = _left_early(raised, per_unit, ranks)
            restarted = again.text(report.reason) + _connect_hint(again, report.reason)
            update = {
                "verdict": report.status, "missing_grads": report.missing_grads,
                "reason": report.reason + left + restarted + named, "steps_done": steps,
                "evidence": _merged(base.evidence, evidence),
            }  # fmt: skip
            return base.model_copy(update=update)
        source = root
        if crashed and per_unit[root].verdict in ("crash", "error"):
            source = min(crashed, key=lambda k: (per_unit[k].signal == "SIGTERM", k))
        base = per_unit[source]
        reason = base.reason if source == root else f"rank {source}: {base.reason}"
        if source != root and base.signal == "SIGABRT" and "stderr:" not in reason:
            thrown = cpp_terminate(stderr)  # a rank's C++ exception, on the job's stderr
            reason += f"; the job's stderr: {thrown}" if thrown else ""
        if source == root and base.verdict == "crash" and base.signal is None and base.exit_code:
            reason = _exit_reason(base.exit_code, base.where, steps, stderr)
        if source == root and base.verdict == "error":
            reason += _lost_workers(stderr, processes, roles)
        if (base.signal == "SIGKILL" or _WORKER_KILLED.search(reason)) and not stop.sigkill:
            reason += "; nsa-diag did not send that SIGKILL: the kernel's OOM killer usually does (see dmesg)"
        if (stacks_file := _stacks_file(folders.get(source), end.case_dir)) is not None:
            evidence.stacks_file = stacks_file
        reason += again.text(reason if base.verdict != "pass" else "") + named
        update = {"reason": reason, "steps_done": steps, "evidence": _merged(base.evidence, evidence)}
        return base.model_copy(update=update)

    key = decider if decider is not None else root
    if outcome == "timeout":
        key = _timeout_decider(per_unit, training, key)
    # the ranks' minority, for all but a slow job (whose reason is its rate)
    diff = _minority(ranks, folders) if len(ranks) > 1 and per_unit[key].verdict != "slow" else None
    if diff is not None and not diff.minority_ranks and blamed:
        # the stacks and the probe's counts do not tell (a collective inside DDP's backward), the ranks'
        # flight recorders do: the ranks that never entered the collective the others wait in
        diff.minority_ranks = [r for r in blamed if r in ranks]
        diff.majority_ranks = [r for r in ranks if r not in diff.minority_ranks]
        diff.basis = "the flight recorder: the rank(s) that never entered the collective the others wait in"
    held_up = ""
    culprit = diff.minority_ranks[0] if diff is not None and diff.minority_ranks else None
    hung = per_unit[key].verdict == "hang" and culprit in per_unit and per_unit[culprit].verdict == "hang"
    if culprit is not None and culprit != key and hung:
        # the rank the others wait for heads the verdict (a person names the stuck rank first); the rank
        # whose watchdog stopped the job waits for it
        waiter = per_unit[key]
        held_up = (
            f"; {_label(key, infos.get(key, {}), ranks, root)} waits for it at "
            f"{location(waiter, None)}: {waiter.reason}"  # the label names its rank
        )
        key = culprit
    elif culprit is not None and culprit == key and diff is not None:
        # the stuck rank stalled first (no work, its own wait): say which rank waits for it, and where
        waiters = [
            r for r in diff.majority_ranks
            if r in per_unit and per_unit[r].verdict == "hang" and per_unit[r].hang_kind == "collective"
        ]  # fmt: skip
        if waiters:
            waiter = per_unit[waiters[0]]
            held_up = (
                f"; {_label(waiters[0], infos.get(waiters[0], {}), ranks, root)} waits for it at "
                f"{location(waiter, None)}: {waiter.reason}"
            )
    base = per_unit[key]
    rank = key if key in ranks else None
    where = location(base, rank)
    evidence = _merged(base.evidence, evidence)
    evidence.location = where
    if (stacks_file := _stacks_file(folders.get(key), end.case_dir)) is not None:
        evidence.stacks_file = stacks_file
    if base.verdict == "slow":
        rate = rates.get(key) or Rate()
        # a unit that reported no progress has no rate to give: its own reason says what it was doing
        reason = (
            base.reason
            if never_progressed(base.where)
            else _slow_reason(rate, spec.timeout, where, base.evidence)
        )
        reason += again.text() + named
        if stop.kept_alive:
            reason += f"; left running (--keep-alive): pids {', '.join(map(str, stop.kept_alive))}"
        return base.model_copy(
            update={"steps_done": steps, "evidence": evidence, "rate": rate, "reason": reason}
        )
    reason, kind = base.reason + held_up, base.hang_kind
    if diff is not None:
        kind, reason = _rank_hang(per_unit, ranks, diff, key, evidence, reason, kind)
    thread = _focus(folders[key]) if key in folders else None
    waited = _waited_on(key, thread, per_unit, roles, parents)
    if waited:
        texts = [f"{_label(k, infos.get(k, {}), ranks, root)}: {processes[str(k)].state}" for k in waited]
        what = (
            "its next batch from its DataLoader worker(s)"
            if waits_on_dataloader(thread)
            else "its child process"
        )
        reason += f"; the stalled process waits for {what}: " + "; ".join(texts)
        evidence.waits_on = waited
    if base.verdict == "hang":
        reason += _dead_threads(stderr) + _world_mismatch(infos)
    # the label names the rank ("rank 1 (pid 4242)"): the place goes on without it
    where_text = f"{_label(key, infos.get(key, {}), ranks, root)}: {location(base, None)}"
    reason += again.text() + _connect_hint(again, reason)
    if stop.kept_alive:
        reason += f"; left running (--keep-alive): pids {', '.join(map(str, stop.kept_alive))}"
    update = {
        "steps_done": steps,
        "evidence": evidence,
        "reason": f"{where_text}: {reason}",
        "hang_kind": kind,
    }
    return base.model_copy(update=update)


def _world_mismatch(infos: Mapping[int, ProbeJson]) -> str:
    """A clause for a hang of a job whose own ``init_process_group(world_size=N)`` asked for another number
    of ranks than its launcher started (``WORLD_SIZE``, torchrun's): the group waits for ranks that never
    come (a world size written into the code or a config for another machine); "" otherwise."""
    for key, info in sorted(infos.items()):
        asked, started = info.get("init_world_size"), info.get("world_size")
        if asked is not None and started is not None and asked != started:
            who = f"rank {info['rank']}" if info.get("rank") is not None else f"pid {info.get('pid', key)}"
            return (
                f"; {who}'s init_process_group asked for world_size={asked}, but the job started {started} "
                f"ranks (WORLD_SIZE={started}): the process group waits for ranks that never come"
            )
    return ""


def _dead_threads(stderr: str) -> str:
    """A clause for a hang whose job printed a thread's uncaught exception before it stalled (a producer
    thread that died leaves the loop waiting for its next item): the last such thread, where it raised,
    and how many died; "" when none did."""
    deaths = thread_deaths(stderr)
    if not deaths:
        return ""
    name, tb = deaths[-1]
    at = _frames(tb.text)
    more = f" ({len(deaths)} threads died; the last)" if len(deaths) > 1 else ""
    return (
        f"; earlier, the job's thread '{name}' died of an uncaught exception{more}: "
        f"{tb.type}: {tb.first_line}" + (f" at {at}" if at else "")
    )


# what the main process gets when a DataLoader worker dies while it sends a batch (torch raises its own
# "DataLoader worker (pid N) is killed by signal" only when it notices the death first)
_BROKEN_PIPES = ("ConnectionResetError", "EOFError", "BrokenPipeError", "ConnectionRefusedError")


def _lost_workers(stderr: str, processes: Mapping[str, ProcessRecord], roles: Mapping[int, str]) -> str:
    """A clause for an error that is a broken connection inside torch's DataLoader or multiprocessing, or
    torch's "DataLoader worker (pid(s) N) exited unexpectedly": the DataLoader workers that ended without
    an exit their probe saw, which such an error follows (a worker the kernel killed: the OOM killer); ""
    otherwise. Which of these errors the main process gets for one killed worker is a race."""
    tb = last_exception(stderr)
    if tb is None:
        return ""
    unexpected = "DataLoader worker (pid" in tb.message and "exited unexpectedly" in tb.message
    broken = tb.type.rsplit(".", 1)[-1] in _BROKEN_PIPES and (
        "torch/utils/data/" in tb.text
        or "multiprocessing/" in tb.text
        or tb.cut  # Python could not print all its frames (`tracebacks`: the exception it dumped)
    )
    if not (unexpected or broken):
        return ""
    ended = [
        key for key, record in processes.items()
        if roles.get(int(key)) == "dataloader-worker" and record.state.startswith(("ended", "killed by"))
    ]  # fmt: skip
    if not ended:
        return ""
    pids = ", ".join(f"pid {key}" for key in ended)
    return (
        f"; DataLoader workers ended without a normal exit ({pids}): a worker the kernel kills (its OOM "
        "killer: see dmesg) ends so, and the main process then fails as it reads from it"
    )


def _left_early(
    raised: Mapping[int, RankError], per_unit: Mapping[int, CaseResult], ranks: Mapping[int, int]
) -> str:
    """Where every rank that raised only lost its peer (`PEER_LOST`) while another rank had exited
    normally: that rank left the training loop first, and its exit ended the collectives the others were
    in (gloo raises there; NCCL would wait until its timeout). Said after the exception: "rank 1 exited
    normally (code 0) after 4 step(s) ...". Empty otherwise: a rank's own exception is the cause."""
    if not raised or not all(PEER_LOST.search(e.exception.message) for e in raised.values()):
        return ""
    left = [
        r for r in sorted(ranks)
        if r not in raised and r in per_unit and per_unit[r].exit_code == 0 and per_unit[r].signal is None
    ]  # fmt: skip
    if not left:
        return ""
    exited = "; ".join(
        f"rank {r} exited normally (code 0) after {per_unit[r].steps_done} step(s)" for r in left
    )
    raised_in = "".join(
        f"; rank {r} raised in step {per_unit[r].steps_done + 1}" for r in sorted(raised) if r in per_unit
    )
    return (
        f"; {exited}{raised_in}, in a collective {_ranks_text(left)} never joined: a rank that leaves the "
        "training loop before the others (fewer batches on that rank: data sharded unevenly across ranks, "
        "or a break or return of its own) ends its peers' collectives"
    )


def _connect_hint(again: Restarts, reason: str) -> str:
    """`_RESTART_CONNECT` where restarted ranks hang or raise while connecting their process group."""
    connecting = re.search(r"init_process_group|_new_process_group_helper|connectFullMesh", reason)
    return f"; {_RESTART_CONNECT}" if again.ended and connecting else ""


def _merged(base: CaseEvidence, more: CaseEvidence) -> CaseEvidence:
    """``base`` with the fields ``more`` was given (``{**base, **more}``)."""
    merged = base.model_copy()
    merged.add(more)
    return merged


def _stacks_file(folder: Path | None, case_dir: Path) -> str | None:
    """The deciding process's stacks.txt in the case folder (`CaseResult.stacks_file`), where it took
    one."""
    if folder is None or not (folder / artifacts.STACKS).is_file():
        return None
    try:
        return (folder / artifacts.STACKS).relative_to(case_dir).as_posix()
    except ValueError:
        return None


_WORDLESS = re.compile(r"^[^A-Za-z0-9]*$")  # a rule of "=" or "-" (torchrun's summary) says nothing


def _exit_reason(code: int, w: Where | None, steps: int, stderr: str) -> str:
    """The command exited with ``code`` by itself, with no traceback: the code, how far it got (``w``,
    ``steps``), and the last line it printed on ``stderr``, which says why (Python's "can't open file",
    a launcher's own error)."""
    if w is None or w.phase in (None, "setup", "done"):
        when = f"after {steps} step(s)" if steps else "before its first step"
    else:
        when = f"at {place(w, None)}"
    lines = [line.strip() for line in stderr.splitlines() if not _WORDLESS.match(line)]
    said = f"; its last stderr line: {lines[-1][:300]}" if lines else "; it printed nothing on stderr"
    return f"exited with code {code} {when}{said}"


def _note_raised(
    raised: Mapping[int, RankError], processes: Mapping[str, ProcessRecord], evidence: CaseEvidence
) -> None:
    """Each rank that raised: its own exception in its record of ``processes`` and in the evidence."""
    for rank, error in raised.items():
        record = processes.get(str(rank))
        if record is not None:
            guessed = f" ({GUESSED})" if error.exception.found_by == "order" else ""
            record.verdict, record.hang_kind = error.status, None
            record.reason = error.reason() + guessed
            record.state = f"raised {error.exception.type}" + (
                f" ({error.status})" if error.status != "error" else ""
            )
    if raised:
        evidence.rank_exceptions = {str(rank): _rank_exception(e) for rank, e in sorted(raised.items())}


def _rank_exception(e: RankError) -> RankException:
    return RankException(
        type=e.exception.type, message=e.exception.first_line[:500], found_by=e.exception.found_by,
        **({"ddp_error": e.ddp_error.info()} if e.ddp_error is not None else {}),
    )  # fmt: skip


def _minority(ranks: Mapping[int, int], folders: Mapping[int, Path]) -> StackDiff:
    """The ranks' stacks compared (stack clusters; on a tie, the ranks outside a collective)."""
    threads = {r: _focus(folders[r]) for r in ranks if r in folders}
    diff = cross_rank_diff(threads, {})
    if not diff.minority_ranks:
        collective_minority(diff, folders, ranks)
    return diff


def _rank_hang(
    per_unit: Mapping[int, CaseResult],
    ranks: Mapping[int, int],
    diff: StackDiff,
    headline: int,
    evidence: CaseEvidence,
    reason: str,
    kind: str | None,
) -> tuple[str | None, str]:
    """The ranks' minority (`_minority`) into the evidence and the reason, and the hang kind. ``headline``:
    the unit the reason is about, whose place it has said already."""
    evidence.stack_diff = diff
    minority = diff.minority_ranks
    evidence.minority_ranks = minority
    kinds = {r: per_unit[r].hang_kind for r in ranks if r in per_unit}
    counted = diff.basis.startswith("collective counts")
    kind = minority_hang_kind(kinds, minority, counted, kind)
    if minority:
        r = minority[0]
        div = diff.first_divergent_frame.get(str(r))
        text = f"minority rank(s) {', '.join(map(str, minority))}"
        if r in per_unit and r != headline:
            text += f" at {location(per_unit[r], r)}"
        if div is not None and div.frame:
            text += f", first divergent frame {div.frame}"
        reason += f"; {text} ({diff.basis})"
    return kind, reason


def collective_minority(diff: StackDiff, folders: Mapping[int, Path], ranks: Mapping[int, int]) -> None:
    """On a tie of stacks: the ranks that entered fewer calls of the collective the others wait in (the
    probe's counts at the hang in each rank's ``at_hang.json``; `analysis.ranks.minority_by_counts`)."""
    at_hang: dict[int, AtHang] = {}
    for r in ranks:
        with contextlib.suppress(OSError, ValueError):
            at_hang[r] = artifacts.read_json(folders[r] / AT_HANG_JSON)
    minority_by_counts(diff, at_hang)
