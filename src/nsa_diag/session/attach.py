"""The run folder of `nsa-diag attach PID`: observe a live tree, judge it, write it down, say it.

    <out>/<YYYYmmdd-HHMMSS>-attach[-<tag>]/
      env.json  result.json  summary.md  [gpu.json  nvidia-smi.txt]
      processes/<pid>/  proc.json  [stacks.txt  pyspy.txt]

``result.json`` is attach's own record, not a case's: ``state`` (progressing | paused | stalled | unclear |
gone | interrupted, see `nsa_diag.activity`), ``hang_kind`` when stalled or unclear, ``reason``, the
minority ranks, the processes with their role, state, kind, location, CPU/GPU, what was signalled and why,
and where each piece of evidence is; ``pyspy_advice``, once for the tree, when py-spy could not give a
stack. It has no ``verdict``: attach watches for seconds, too short for ``hang`` and unable to know
``pass``.

How long: by default up to `WATCH_S` seconds, a round every ``--interval`` (1 s), ending as soon as the
rounds show work (`nsa_diag.activity`: the beacon progressed, stacks moved, I/O); ``--samples N`` takes
exactly N rounds. Exit code 0 when the tree was progressing; 1 when it was stalled, unclear, paused or
ended; 130 when interrupted.
"""

from __future__ import annotations

import datetime
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from nsa_diag import artifacts, interrupts, render
from nsa_diag.activity import ProcessActivityJson, TreeActivity, judge_tree
from nsa_diag.cases import check_output
from nsa_diag.errors import EXIT_ABORTED, UsageError
from nsa_diag.evidence import gpu
from nsa_diag.evidence.live import (
    PROCESSES,
    ProcessInfoJson,
    PtraceFacts,
    TreeObservation,
    check_target,
    observe_tree,
)
from nsa_diag.evidence.roles import TRAINING_ROLES
from nsa_diag.records import GpuFiles, PyspyDump, StackDiff
from nsa_diag.session.status import progress_line

if TYPE_CHECKING:
    from rich.console import Console

SUMMARY_MD = "summary.md"
NO_VERDICT = (
    "attach watched for {s:.1f} s: it reports what the tree did then (state), never pass or hang, which "
    "need the job's end or a stall limit; `nsa-diag watch` gives verdicts"
)
# The default watch: long enough for a stuck frame to stay stuck and a moving one to move (a dump at 0, 1, 4,
# 7 and 10 s: `nsa_diag.evidence.live.DUMP_EVERY_S`), short enough to wait for. It ends at the first round
# that shows work.
WATCH_S = 10.0


@dataclass(frozen=True)
class AttachRequest:
    """What `nsa-diag attach` was asked, checked by `check`."""

    pid: int
    samples: int | None = None  # None: up to WATCH_S, ending once work shows; N: exactly N rounds
    interval_s: float = 1.0
    children: bool = True
    send_signal: bool = True
    out: Path = artifacts.DEFAULT_OUT
    tag: str | None = None
    allow_other_user: bool = False  # as root, look into another user's job (`evidence.live.check_target`)

    def check(self) -> None:
        if self.samples is not None and self.samples < 2:
            raise UsageError(f"--samples {self.samples}: at least 2 (CPU time and progress are differences)")
        if not 0.1 <= self.interval_s <= 60:
            raise UsageError(f"--interval {self.interval_s:g}: between 0.1 and 60 seconds")
        check_output(self.out, self.tag)
        check_target(self.pid, allow_other_user=self.allow_other_user)

    @property
    def rounds(self) -> int:
        if self.samples is not None:
            return self.samples
        return max(2, round(WATCH_S / self.interval_s) + 1)


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


def _files(run_dir: Path, pid: int) -> list[str]:
    folder = run_dir / PROCESSES / str(pid)
    return sorted(str(p.relative_to(run_dir)) for p in folder.iterdir()) if folder.is_dir() else []


class AttachedProcess(ProcessInfoJson, ProcessActivityJson):
    """One process of attach's result.json: what it is, what it did, and the evidence taken of it."""

    signals_sent: int
    dumps: list[str]
    stack_samples: int
    pyspy_samples: int
    pyspy: PyspyDump | None
    gpu: list[dict[str, Any]]  # NVML's rows of this pid
    files: list[str]


class AttachResult(TypedDict, total=False):
    """attach's result.json: the tree's state (attach gives no verdict), its focus, the ranks' minority,
    how it was observed, and each process (`AttachedProcess`); only the first five when attach itself was
    interrupted."""

    command: str
    pid: int
    state: str
    hang_kind: str | None
    reason: str
    focus_pid: int | None
    minority_ranks: list[int]
    stack_diff: StackDiff | None
    pyspy_advice: str | None
    no_verdict: str
    started_at: str
    observed_s: float
    samples: int
    samples_asked: int
    interval_s: float
    children: bool
    signal: bool
    pyspy_installed: bool
    ptrace: PtraceFacts
    gpu: GpuFiles
    # each training process with the probe, as watch's status line says it (`progress_line`): "rank 1
    # (pid 4242): step 1234 · backward · 3.2 steps/s (3 step(s) in 0.9 s)"
    status: list[str]
    processes: list[AttachedProcess]


def result_record(
    req: AttachRequest, tree: TreeObservation, act: TreeActivity, run_dir: Path
) -> AttachResult:
    """``result.json``."""
    by_pid = {a.pid: a for a in act.processes}
    processes: list[AttachedProcess] = []
    for ob in tree.processes:
        processes.append(
            {
                **ob.info.to_json(),
                **by_pid[ob.pid].to_json(),
                "signals_sent": len(ob.dump_notes),
                "dumps": ob.dump_notes,
                "stack_samples": len(ob.dumps),
                "pyspy_samples": len(ob.pyspy_samples),
                "pyspy": ob.pyspy,
                "gpu": ob.gpu,
                "files": _files(run_dir, ob.pid),
            }
        )
    status = [
        f"{by_pid[ob.pid].label()}: {progress_line(ob.beacons(), time.time())}"
        for ob in tree.processes
        if by_pid[ob.pid].role in TRAINING_ROLES and ob.beacons()
    ]
    return {
        "command": "attach",
        "pid": req.pid,
        "state": act.state,
        "hang_kind": act.hang_kind,
        "reason": act.reason,
        "focus_pid": act.focus_pid,
        "minority_ranks": list(act.minority_ranks),
        "stack_diff": act.stack_diff,
        "pyspy_advice": tree.pyspy_advice,
        "no_verdict": NO_VERDICT.format(s=tree.duration_s),
        "started_at": _iso(tree.started),
        "observed_s": round(tree.duration_s, 3),
        "samples": max((len(ob.samples) for ob in tree.processes), default=0),
        "samples_asked": req.samples,
        "interval_s": req.interval_s,
        "children": req.children,
        "signal": req.send_signal,
        "pyspy_installed": tree.pyspy_installed,
        "ptrace": tree.ptrace,
        "gpu": _gpu_files(run_dir, tree),
        "status": status,
        "processes": processes,
    }


def _gpu_files(run_dir: Path, tree: TreeObservation) -> GpuFiles:
    snapshot = tree.gpu_snapshot
    if not snapshot.get("available"):
        return GpuFiles(available=False, why=snapshot.get("why"))
    artifacts.write_json(run_dir / artifacts.GPU, {**snapshot, "processes_of_tree": tree.gpu_usage})
    text, why = gpu.nvidia_smi()
    if text is not None:
        artifacts.write_text(run_dir / artifacts.NVIDIA_SMI, text)
    return GpuFiles(available=True, file=artifacts.GPU, nvidia_smi=artifacts.NVIDIA_SMI if text else why)


def _short(cmdline: list[str], width: int = 60) -> str:
    text = shlex.join(cmdline) if cmdline else "?"
    return text if len(text) <= width else text[: width - 3] + "..."


def _stacks_cell(p: AttachedProcess) -> str:
    """Where the process's stacks came from: faulthandler dumps, py-spy, or none."""
    parts = [f"{p['stack_samples']} dump(s)"] if p["stack_samples"] else []
    if p.get("pyspy_samples"):
        parts.append(f"{p['pyspy_samples']} py-spy sample(s)")
    if (p.get("pyspy") or {}).get("taken"):
        parts.append("py-spy --native")
    return " + ".join(parts) or "none"


def _advice(record: AttachResult) -> list[str]:
    """The notes a user acts on, once for the tree: what to run for the stacks py-spy could not take."""
    return [record["pyspy_advice"]] if record.get("pyspy_advice") else []


def summary_markdown(record: AttachResult) -> str:
    lines = [
        f"# nsa-diag attach {record['pid']}",
        "",
        f"**{record['state']}**" + (f" ({record['hang_kind']})" if record["hang_kind"] else ""),
        "",
        record["reason"],
        "",
        f"_{record['no_verdict']}_",
        "",
        "| pid | role | rank | command | state | kind | CPU % | where | stacks | SIGUSR1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in record["processes"]:
        cells = [
            p["pid"], p["role"], p["rank"] if p["rank"] is not None else "",
            _short(p["cmdline"]).replace("|", "\\|"),
            p["state"], p["kind"] or "", p["cpu_percent"] if p["cpu_percent"] is not None else "?",
            p["location"] or "", _stacks_cell(p), p["sigusr1"],
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", *(f"- {note}" for note in _advice(record))]
    return "\n".join(lines) + "\n"


def render_attach(record: AttachResult, run_dir: Path, console: Console | None = None) -> None:
    """The short console summary (rich)."""
    from rich.markup import escape
    from rich.table import Table

    console = console or render.stdout_console()
    colour = {"progressing": "green", "stalled": "red", "gone": "red"}.get(record["state"], "yellow")
    kind = f" ({record['hang_kind']})" if record["hang_kind"] else ""
    console.print(f"[bold {colour}]{record['state']}{kind}[/] {escape(record['reason'])}")
    for line in record.get("status", []):
        console.print(f"[dim]status:[/] {escape(line)}")
    table = Table(show_edge=False, pad_edge=False)
    for column in ("pid", "role", "rank", "command", "state", "kind", "CPU %", "GPU %", "where", "stacks"):
        table.add_column(column)
    for p in record["processes"]:
        table.add_row(
            str(p["pid"]), p["role"], "" if p["rank"] is None else str(p["rank"]),
            escape(_short(p["cmdline"], 48)),
            p["state"], p["kind"] or "-", "?" if p["cpu_percent"] is None else f"{p['cpu_percent']:.0f}",
            "-" if p["gpu_percent"] is None else f"{p['gpu_percent']:.0f}", escape(p["location"] or "-"),
            _stacks_cell(p),
        )  # fmt: skip
    console.print(table)
    for note in _advice(record):
        console.print(f"[dim]note:[/] {escape(note)}")
    console.print(f"[dim]{escape(NO_VERDICT.format(s=record['observed_s']))}[/]")
    console.print(f"evidence: {escape(str(run_dir))}")


def _interrupted(req: AttachRequest, run_dir: Path, exc: KeyboardInterrupt) -> int:
    """result.json of an attach that nsa-diag's own interrupt cut short (nothing of the job was touched
    but the SIGUSR1 dumps already asked for)."""
    name = getattr(exc, "signal_name", "SIGINT")
    artifacts.write_json(
        run_dir / artifacts.RESULT,
        {
            "command": "attach", "pid": req.pid, "state": "interrupted", "hang_kind": None,
            "reason": f"interrupted by {name} while the evidence was taken; PID {req.pid} was left running",
        },
    )  # fmt: skip
    render.stderr_console().print(f"nsa-diag: interrupted by {name}; PID {req.pid} was left as it was")
    return EXIT_ABORTED


def _shows_work(tree: TreeObservation) -> bool:
    """Whether the rounds so far settle it: the tree progressed (or ended)."""
    return judge_tree(tree).state in ("progressing", "gone")


def run_attach(req: AttachRequest, *, json_output: bool = False) -> int:
    """Check, observe, judge and write; the exit code (0 progressing; 1 stalled, unclear, paused or gone;
    130 interrupted).
    Everything is checked before the run folder exists; once it does, result.json is always written."""
    from nsa_diag.evidence.env import collect_env

    req.check()
    interrupts.check()
    run_dir = artifacts.new_run_dir("attach", req.out, req.tag)
    lock = artifacts.lock_run_dir(run_dir)
    try:
        try:
            artifacts.write_json(run_dir / artifacts.ENV, collect_env())
        except OSError as exc:
            artifacts.remove_run_dir(run_dir)
            raise UsageError(f"{run_dir}: cannot write the run's files: {exc.strerror or exc}") from None
        watched = req.interval_s * (req.rounds - 1)
        how = f"for {watched:g} s" if req.samples else f"for up to {watched:g} s (less once it shows work)"
        render.stderr_console().print(f"nsa-diag attach: watching PID {req.pid} {how}")
        tree = observe_tree(
            req.pid, run_dir, rounds=req.rounds, interval_s=req.interval_s,
            children=req.children, send_signal=req.send_signal,
            until=None if req.samples else _shows_work,
        )  # fmt: skip
        act = judge_tree(tree)
        record = artifacts.scrub_data(result_record(req, tree, act, run_dir))  # the console's too
        artifacts.write_json(run_dir / artifacts.RESULT, record)
        artifacts.write_text(run_dir / SUMMARY_MD, summary_markdown(record))
    except KeyboardInterrupt as exc:
        return _interrupted(req, run_dir, exc)
    finally:
        lock.release()
    if json_output:
        render.print_json(record)
    else:
        render_attach(record, run_dir)
    return 0 if act.state == "progressing" else 1
