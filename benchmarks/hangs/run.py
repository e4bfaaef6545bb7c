"""The hang benchmark: users' training jobs that hang, fail or stay healthy, each under ``nsa-diag watch``
with its DEFAULT options, scored against its truth in ``manifest.yaml``.

Each scenario in ``scenarios/`` is a script written as users write them (it imports nothing of ours) that
prints one line starting with ``FAULT:`` when its fault begins (healthy ones print none). For every
scenario this runs ``nsa-diag watch --out DIR -- CMD`` in the scenarios' folder (``python SCRIPT`` or
``torchrun --standalone --nproc-per-node 2 SCRIPT``), stamps the FAULT line as it streams through, reads
the case's result.json and scores:

    verdict   result.json's verdict is the truth's (hang, pass, error, ...)
    kind      the hang kind is the truth's (where the truth names one)
    culprit   the verdict's text (reason and stall reason: what the person is told) names the culprit: the
              truth's regular expression (a thread's name, "DataLoader worker", "rank 1", a parameter)
    line      the verdict's text names the user's line (``script.py:N``; for a cycle of two threads, both
              lines: ``line`` and ``other_line``)
    seconds   from the FAULT line to the verdict: result.json written (the job's evidence taken and the
              job stopped; an upper bound of when the verdict was known)

A healthy scenario whose verdict is not ``pass`` is a false alarm. The summary gives the share of scenarios
with the right verdict and culprit (verdict, kind and culprit all right), the share with the right line
(of those whose truth has one), the median and the longest time from the fault to the verdict, and the
false alarms: the bars of issue 48 (>= 95%, >= 90%, median <= 60 s, none over 120 s, no false alarm).

    python benchmarks/hangs/run.py                       # the CPU set, one at a time
    python benchmarks/hangs/run.py --jobs 3              # three at a time (a 2-core machine: timings suffer)
    python benchmarks/hangs/run.py --only lock-order poll-file --json out.json
    python benchmarks/hangs/run.py --set gpu             # the GPU rows (one GPU; two-GPU rows need two)
    python benchmarks/hangs/run.py --slow                # with the long run (100,000 steps, > 300 s)
    python benchmarks/hangs/run.py --check               # exit 1 when a bar is missed
    python benchmarks/hangs/run.py --watch-args='--stall 30'   # not the defaults: say so when reporting

Run folders go to ``--out`` (default: a new temporary folder, kept and printed). A scenario that gives no
verdict within ``--limit`` seconds is stopped (nsa-diag gets SIGTERM, then its process group SIGKILL) and
scored as "no verdict".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE / "scenarios"
MANIFEST = HERE / "manifest.yaml"
FAULT_MARK = "FAULT:"
LAUNCHES = ("python", "torchrun2")
SETS = ("cpu", "gpu", "gpu2")
GPUS_NEEDED = {"cpu": 0, "gpu": 1, "gpu2": 2}
VERDICTS = (
    "pass",
    "hang",
    "slow",
    "oom",
    "crash",
    "error",
    "nonfinite",
    "grad-missing",
    "mismatch",
    "skipped",
)
# Issue 48's bars over the hang scenarios, with default options.
BAR_RIGHT = 0.95
BAR_LINE = 0.90
BAR_MEDIAN_S = 60.0
BAR_MAX_S = 120.0


class ManifestError(Exception):
    """The manifest is not what this runner reads: one line, exit 2."""


@dataclass(frozen=True)
class Truth:
    verdict: str
    kinds: tuple[str, ...] = ()  # the hang kinds a person who knows the job would accept; (): any
    culprit: str | None = None  # a regular expression, case-insensitive, over the verdict's text
    lines: tuple[str, ...] = ()  # "script.py:N": the culprit's line, then (a cycle) the other side's


@dataclass(frozen=True)
class Scenario:
    name: str
    script: str
    launch: str
    args: tuple[str, ...]
    set: str
    slow: bool
    fault: str
    truth: Truth

    def argv(self, python: str) -> list[str]:
        if self.launch == "torchrun2":
            torchrun = str(Path(python).parent / "torchrun")
            if not os.path.exists(torchrun):
                torchrun = shutil.which("torchrun") or "torchrun"
            return [torchrun, "--standalone", "--nproc-per-node", "2", self.script, *self.args]
        return [python, self.script, *self.args]


def _listed(value: object) -> list[str]:
    """A manifest value that is one string, a list of them, or null."""
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def load_manifest(path: Path = MANIFEST) -> list[Scenario]:
    """The scenarios of the manifest, checked: known launches, sets and verdicts, scripts that exist."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ManifestError(f"{path}: cannot read it: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("scenarios"), list):
        raise ManifestError(f"{path}: expected a mapping with a list `scenarios`")
    out: list[Scenario] = []
    for i, entry in enumerate(data["scenarios"]):
        where = f"{path.name}: scenario {i + 1}"
        if not isinstance(entry, dict) or not isinstance(entry.get("truth"), dict):
            raise ManifestError(f"{where}: expected a mapping with `truth`")
        name = str(entry.get("name", ""))
        truth = entry["truth"]
        scenario = Scenario(
            name=name,
            script=str(entry.get("script", "")),
            launch=str(entry.get("launch", "python")),
            args=tuple(str(a) for a in entry.get("args") or ()),
            set=str(entry.get("set", "cpu")),
            slow=bool(entry.get("slow", False)),
            fault=str(entry.get("fault", "")),
            truth=Truth(
                verdict=str(truth.get("verdict", "")),
                kinds=tuple(_listed(truth.get("kind"))),
                culprit=truth.get("culprit"),
                lines=tuple(_listed(truth.get("line")) + _listed(truth.get("other_line"))),
            ),
        )
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
            raise ManifestError(f"{where}: name {name!r}: use lower-case words joined by -")
        if name in {s.name for s in out}:
            raise ManifestError(f"{where}: name {name!r} appears twice")
        if scenario.launch not in LAUNCHES:
            raise ManifestError(f"{where} ({name}): launch {scenario.launch!r}: one of {', '.join(LAUNCHES)}")
        if scenario.set not in SETS:
            raise ManifestError(f"{where} ({name}): set {scenario.set!r}: one of {', '.join(SETS)}")
        if scenario.truth.verdict not in VERDICTS:
            raise ManifestError(f"{where} ({name}): verdict {scenario.truth.verdict!r} is not a verdict")
        if not (SCENARIOS / scenario.script).is_file():
            raise ManifestError(f"{where} ({name}): no script scenarios/{scenario.script}")
        if scenario.truth.culprit is not None:
            try:
                re.compile(scenario.truth.culprit)
            except re.error as e:
                raise ManifestError(f"{where} ({name}): culprit is not a regular expression: {e}") from None
        out.append(scenario)
    return out


@dataclass
class Outcome:
    """One scenario's run and its score."""

    name: str
    set: str
    expected: str
    verdict: str | None = None  # None: no result.json (no verdict within the limit)
    kind: str | None = None
    text: str = ""  # the verdict's text: reason and stall reason
    verdict_ok: bool = False
    kind_ok: bool = False
    culprit_ok: bool = False
    line_ok: bool | None = None  # None: the truth names no line
    fault_s: float | None = None  # the FAULT line, seconds after nsa-diag started
    verdict_s: float | None = None  # result.json written, seconds after nsa-diag started
    exit_s: float | None = None  # nsa-diag's exit, seconds after its start
    exit_code: int | None = None
    stopped_at_limit: bool = False
    not_run: str | None = None  # why it could not run here (a GPU row without the GPUs): never a pass
    run_dir: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def to_verdict_s(self) -> float | None:
        """Seconds from the fault to the verdict."""
        if self.fault_s is None or self.verdict_s is None:
            return None
        return self.verdict_s - self.fault_s

    @property
    def right(self) -> bool:
        """Verdict, kind and culprit right."""
        return self.verdict_ok and self.kind_ok and self.culprit_ok

    @property
    def false_alarm(self) -> bool:
        return self.expected == "pass" and self.verdict != "pass"


def line_named(text: str, line: str) -> bool:
    """Whether ``text`` names ``script.py:N`` (not ``script.py:N0``, not ``other_script.py:N``)."""
    return re.search(r"(?<![\w.])" + re.escape(line) + r"(?!\d)", text) is not None


def verdict_text(result: dict[str, Any]) -> str:
    """What nsa-diag tells the person about the verdict: its reason and its stall reason."""
    parts = [result.get("reason"), result.get("stall_reason")]
    return "\n".join(p for p in parts if isinstance(p, str))


def score(scenario: Scenario, outcome: Outcome, result: dict[str, Any] | None) -> None:
    truth = scenario.truth
    if result is None:
        outcome.notes.append("no result.json")
        return
    outcome.verdict = result.get("verdict")
    outcome.kind = result.get("hang_kind")
    outcome.text = verdict_text(result)
    outcome.verdict_ok = outcome.verdict == truth.verdict
    outcome.kind_ok = not truth.kinds or outcome.kind in truth.kinds
    if truth.culprit is None:
        outcome.culprit_ok = True
    else:
        outcome.culprit_ok = re.search(truth.culprit, outcome.text, re.IGNORECASE) is not None
    if truth.lines:
        outcome.line_ok = all(line_named(outcome.text, line) for line in truth.lines)


def _find_result(out: Path) -> Path | None:
    found = sorted(out.glob("*/cases/*/result.json"))
    return found[-1] if found else None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """nsa-diag gets SIGTERM (it stops its job and writes the result); its group SIGKILL after 60 s."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_one(
    scenario: Scenario, nsa_diag: list[str], python: str, out_root: Path, limit_s: float,
    watch_args: list[str], echo: bool,
) -> Outcome:  # fmt: skip
    """Run one scenario under ``nsa-diag watch`` and score it."""
    out = out_root / scenario.name
    out.mkdir(parents=True, exist_ok=True)
    argv = [*nsa_diag, "watch", *watch_args, "--out", str(out), "--", *scenario.argv(python)]
    outcome = Outcome(scenario.name, scenario.set, scenario.truth.verdict)
    log = (out / "console.log").open("w", encoding="utf-8", errors="replace")
    start = time.monotonic()
    start_wall = time.time()
    proc = subprocess.Popen(
        argv, cwd=SCENARIOS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            now = time.monotonic() - start
            line = raw.decode(errors="replace")
            log.write(f"{now:8.2f} {line}")
            if FAULT_MARK in line and outcome.fault_s is None:
                outcome.fault_s = now
            if echo:
                sys.stdout.write(f"[{scenario.name} {now:6.1f}] {line}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        outcome.stopped_at_limit = True
        outcome.notes.append(f"no verdict within {limit_s:g} s: stopped")
        _stop(proc)
    outcome.exit_s = time.monotonic() - start
    outcome.exit_code = proc.returncode
    reader.join(10)
    log.close()
    path = _find_result(out)
    result = None
    if path is not None:
        outcome.run_dir = str(path.parent)
        outcome.verdict_s = path.stat().st_mtime - start_wall
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            outcome.notes.append(f"result.json unreadable: {e}")
    if outcome.stopped_at_limit:
        result = None  # what nsa-diag wrote when this runner stopped it is not its verdict
        outcome.verdict_s = None
    score(scenario, outcome, result)
    if scenario.truth.verdict != "pass" and outcome.fault_s is None:
        outcome.notes.append("no FAULT line seen")
    return outcome


@dataclass
class Summary:
    not_run: int  # scenarios that could not run here (left out of every share below)
    scenarios: int
    faults: int
    healthy: int
    right: int
    right_share: float
    lines: int
    lines_right: int
    line_share: float | None
    median_s: float | None
    max_s: float | None
    timed: int
    false_alarms: int
    bars: dict[str, bool]


def summarize(outcomes: list[Outcome]) -> Summary:
    skipped = [o for o in outcomes if o.not_run is not None]
    outcomes = [o for o in outcomes if o.not_run is None]
    faults = [o for o in outcomes if o.expected != "pass"]
    healthy = [o for o in outcomes if o.expected == "pass"]
    right = sum(o.right for o in outcomes)
    with_line = [o for o in outcomes if o.line_ok is not None]
    lines_right = sum(bool(o.line_ok) for o in with_line)
    times = [t for o in faults if (t := o.to_verdict_s) is not None]
    # a fault with no verdict (stopped at the limit, or no FAULT line) has no time: it fails the max bar
    untimed = len(faults) - len(times)
    median = statistics.median(times) if times else None
    longest = max(times) if times else None
    false_alarms = sum(o.false_alarm for o in healthy)
    n = len(outcomes)
    bars = {
        f"verdict and culprit right >= {BAR_RIGHT:.0%}": n > 0 and right / n >= BAR_RIGHT,
        f"line right >= {BAR_LINE:.0%}": not with_line or lines_right / len(with_line) >= BAR_LINE,
        f"median fault to verdict <= {BAR_MEDIAN_S:g} s": median is not None and median <= BAR_MEDIAN_S,
        f"none over {BAR_MAX_S:g} s": untimed == 0 and (longest is None or longest <= BAR_MAX_S),
        "no false alarm": false_alarms == 0,
    }
    return Summary(
        not_run=len(skipped), scenarios=n, faults=len(faults), healthy=len(healthy), right=right,
        right_share=round(right / n, 3) if n else 0.0, lines=len(with_line), lines_right=lines_right,
        line_share=round(lines_right / len(with_line), 3) if with_line else None,
        median_s=None if median is None else round(median, 1),
        max_s=None if longest is None else round(longest, 1), timed=len(times),
        false_alarms=false_alarms, bars=bars,
    )  # fmt: skip


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else ("ok" if ok else "NO")


def table(outcomes: list[Outcome]) -> str:
    marks = " ".join(f"{m:>2}" for m in ("v", "k", "c", "l"))
    head = f"{'scenario':<28} {'truth':<6} {'verdict':<8} {'kind':<16} {marks} {'s':>6}"
    rows = [head, "-" * len(head)]
    for o in outcomes:
        t = o.to_verdict_s
        if o.not_run is not None:
            rows.append(f"{o.name:<28} {o.expected:<6} not run: {o.not_run}")
            continue
        rows.append(
            f"{o.name:<28} {o.expected:<6} {o.verdict or '-':<8} {o.kind or '-':<16} "
            f"{_mark(o.verdict_ok):>2} {_mark(o.kind_ok):>2} {_mark(o.culprit_ok):>2} {_mark(o.line_ok):>2} "
            f"{'-' if t is None else f'{t:.0f}':>6}"
        )
    return "\n".join(rows)


def summary_text(s: Summary) -> str:
    line_share = "-" if s.line_share is None else f"{s.line_share:.0%}"
    lines = [
        f"{s.scenarios} scenarios ({s.faults} faults, {s.healthy} healthy): verdict and culprit right "
        f"{s.right}/{s.scenarios} ({s.right_share:.0%}), "
        f"line right {s.lines_right}/{s.lines} ({line_share}), "
        f"fault to verdict median {s.median_s} s, longest {s.max_s} s over {s.timed} timed, "
        f"false alarms {s.false_alarms}",
    ]
    if s.not_run:
        lines.append(f"  {s.not_run} scenario(s) not run here (not counted, never passed)")
    lines += [f"  {'met ' if ok else 'MISSED'} {bar}" for bar, ok in s.bars.items()]
    return "\n".join(lines)


def _git_rev() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def gpu_count(python: str) -> int:
    """The CUDA devices torch sees, asked of the Python that runs the scenarios (0 when it cannot say)."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


def _default_nsa_diag(python: str) -> list[str]:
    beside = Path(python).parent / "nsa-diag"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("nsa-diag")
    return [found] if found else [python, "-m", "nsa_diag"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=(*SETS, "all"), default="cpu", help="which scenarios (default cpu)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these scenarios only")
    parser.add_argument("--slow", action="store_true", help="with the scenarios marked slow (the long run)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="scenarios at a time (default 1)")
    parser.add_argument("--limit", type=float, default=900.0, metavar="S", help="seconds a scenario may run")
    parser.add_argument("--out", type=Path, help="folder for the run folders (default: a new temporary one)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the outcomes and summary here")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs the scenarios")
    parser.add_argument("--nsa-diag", help="the nsa-diag command (default: beside --python, or on PATH)")
    parser.add_argument("--watch-args", default="", help="options for watch (default none: its defaults)")
    parser.add_argument("--check", action="store_true", help="exit 1 when one of issue 48's bars is missed")
    parser.add_argument("--echo", action="store_true", help="stream every scenario's console here")
    parser.add_argument("--list", action="store_true", help="list the scenarios and their truth, run none")
    args = parser.parse_args(argv)
    if args.jobs < 1 or not 0 < args.limit < 1e6:
        parser.error("--jobs must be at least 1 and --limit a positive number of seconds")
    try:
        scenarios = load_manifest()
    except ManifestError as e:
        print(f"hangs: {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in scenarios})
        if unknown:
            print(f"hangs: no scenario {', '.join(unknown)} (see --list)", file=sys.stderr)
            return 2
        chosen = [s for s in scenarios if s.name in args.only]
    else:
        chosen = [
            s for s in scenarios if (args.set == "all" or s.set == args.set) and (args.slow or not s.slow)
        ]
    if args.list:
        for s in chosen:
            t = s.truth
            kinds, lines = "|".join(t.kinds) or "-", " ".join(t.lines) or "-"
            print(f"{s.name:<28} {s.set:<4} {t.verdict:<6} {kinds:<28} {lines:<40} {s.fault}")
        return 0
    if not chosen:
        print("hangs: no scenario chosen", file=sys.stderr)
        return 2
    nsa_diag = shlex.split(args.nsa_diag) if args.nsa_diag else _default_nsa_diag(args.python)
    # absolute: each scenario runs in the scenarios' folder, and its run folder is found from here
    out_root = (args.out or Path(tempfile.mkdtemp(prefix="nsa-hangs-"))).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    watch_args = shlex.split(args.watch_args)
    print(f"{len(chosen)} scenarios, {args.jobs} at a time, run folders under {out_root}", flush=True)
    started = time.time()
    by_name: dict[str, Outcome] = {}
    gpus = gpu_count(args.python) if any(GPUS_NEEDED[s.set] for s in chosen) else 0
    runnable = []
    for s in chosen:
        if GPUS_NEEDED[s.set] > gpus:
            why = f"needs {GPUS_NEEDED[s.set]} GPU(s), torch sees {gpus} here"
            by_name[s.name] = Outcome(s.name, s.set, s.truth.verdict, not_run=why)
            print(f"  {s.name}: not run ({why})", flush=True)
        else:
            runnable.append(s)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            pool.submit(run_one, s, nsa_diag, args.python, out_root, args.limit, watch_args, args.echo): s
            for s in runnable
        }
        for future in concurrent.futures.as_completed(futures):
            o = future.result()
            by_name[o.name] = o
            t = o.to_verdict_s
            took = "" if t is None else f", {t:.0f} s after the fault"
            print(
                f"  {o.name}: {o.verdict or 'no verdict'}{took} ({'right' if o.right else 'wrong'})",
                flush=True,
            )
    outcomes = [by_name[s.name] for s in chosen]
    summary = summarize(outcomes)
    print()
    print(table(outcomes))
    print()
    print(summary_text(summary))
    for o in outcomes:
        if o.not_run is None and (not o.right or o.line_ok is False or o.notes):
            print(f"\n{o.name}: {'; '.join(o.notes) or o.verdict}\n  {o.text or '(no verdict text)'}")
    if args.json:
        record = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "git": _git_rev(),
            "watch_args": watch_args,
            "jobs": args.jobs,
            "wall_s": round(time.time() - started, 1),
            "summary": asdict(summary),
            "outcomes": [{**asdict(o), "to_verdict_s": o.to_verdict_s, "right": o.right} for o in outcomes],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    return 1 if args.check and not all(summary.bars.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
