"""`nsa-diag ddp`: one case on N ranks through torchrun, watched rank by rank; a cross-rank diff at a hang.

`run_ddp_case` is what `nsa_diag.runner.run_case` hands a case with ``spec.ddp`` to. It starts
``python -m torch.distributed.run ... -m nsa_diag.worker.ddp <case_dir>`` in a new session (rendezvous on
127.0.0.1 and a free port unless ``rdzv_endpoint`` is given); each rank works in ``ranks/<r>/`` (see
`nsa_diag.worker.ddp`). The watchdog reads every rank's beacon with the same stall and timeout rules as a
single worker (`nsa_diag.watchdog.decide`); when any rank stalls it takes the evidence of every live rank
(NCCL flight recorder through its debug pipe, memory, two faulthandler samples, /proc, py-spy) before it
stops any, then stops torchrun and every rank (torchrun starts each rank in a session of its own, so each
session is signalled), and checks that none is left.

Per rank the evidence is classified as a single worker's would be (`nsa_diag.runner._build_result`); the
case's result aggregates them: the verdict and the rank it comes from, missing gradients per rank and
their difference, the pre-flight verdict, parameter hashes, buckets, and at a hang the cross-rank stack
diff (`cross_rank_diff`): each rank's training-thread stack normalised and clustered; the ranks outside the
largest cluster are the minority (on a tie: the ranks that never entered the training-group collective
the others wait in, the flight recorder's rule); their first divergent frame; ``hang_kind`` collective
when ranks wait in collectives.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nsa_diag import artifacts
from nsa_diag.classify import focus_thread
from nsa_diag.evidence import procfs, stacks
from nsa_diag.spec import CaseResult, CaseSpec
from nsa_diag.watchdog import (
    GRACE_S,
    HangEvidence,
    Observation,
    WatchResult,
    compact,
    decide,
    gather_hang_evidence,
)
from nsa_diag.worker.beacon import BeaconState, read_beacon
from nsa_diag.worker.ddp import RANKS_DIR, TRAIN_GROUP, pg_timeout_s, rank_dir

LOOPBACK = "127.0.0.1"
FR_PREFIX = "nccl_trace_rank_"  # TORCH_NCCL_DEBUG_INFO_TEMP_FILE: torch appends the rank
PIPE_PREFIX = "nccl_pipe_rank_"  # TORCH_NCCL_DEBUG_INFO_PIPE_FILE: torch reads <prefix><rank>.pipe
FR_FILE = "nccl_flight_recorder.pickle"  # where each rank's dump ends up, in ranks/<r>/
FR_WAIT_S = 5.0
FR_BUFFER = 2000
# A verdict from several ranks: the case takes the first in this order (a crash explains the rest).
SEVERITY = (
    "crash",
    "error",
    "oom",
    "nonfinite",
    "grad-missing",
    "mismatch",
    "slow",
    "hang",
    "skipped",
    "pass",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def local_ranks(spec: CaseSpec) -> list[int]:
    assert spec.ddp is not None
    first = spec.ddp.node_rank * spec.ddp.nproc
    return list(range(first, first + spec.ddp.nproc))


def ddp_env(spec: CaseSpec, case_dir: Path) -> dict[str, str]:
    """Variables for torchrun and the ranks: the NCCL flight recorder on, dumped into the case folder on
    timeout and on demand through its pipe; NCCL's own timeouts longer than the watchdog's stall."""
    assert spec.ddp is not None
    ranks = Path(case_dir).resolve() / RANKS_DIR
    timeout = str(int(pg_timeout_s(spec)))
    env = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FR_BUFFER),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(ranks / FR_PREFIX),
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(ranks / PIPE_PREFIX),
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": timeout,
        "TORCH_NCCL_TRACE_CPP_STACK": "1",
    }
    if spec.ddp.rdzv_endpoint is None:  # one node: keep gloo's and NCCL's sockets on loopback too
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    return env


def torchrun_argv(spec: CaseSpec, case_dir: Path, port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run`` starting ``nsa_diag.worker.ddp`` on every local rank."""
    ds = spec.ddp
    assert ds is not None
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(ds.nnodes),
            "--nproc-per-node", str(ds.nproc), "--max-restarts", "0"]  # fmt: skip
    if ds.rdzv_endpoint is None:
        argv += ["--master-addr", LOOPBACK, "--master-port", str(port or free_port())]
    else:
        argv += ["--node-rank", str(ds.node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                 ds.rdzv_endpoint, "--rdzv-id", f"nsa-diag-{spec.spec_hash()}"]  # fmt: skip
    return [*argv, "-m", "nsa_diag.worker.ddp", str(Path(case_dir).resolve())]


# --- processes ----------------------------------------------------------------------------------------


class RankProcess:
    """A rank seen by pid (torchrun is its parent, not us): what `gather_hang_evidence` needs of a Popen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        stat = procfs.read_stat(self.pid)
        return None if stat is not None and stat["state"] != "Z" else 0


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _alive(pid: int) -> bool:
    stat = procfs.read_stat(pid)
    return stat is not None and stat["state"] != "Z"


def _signal_all(pids: Sequence[int], sessions: Sequence[int], sig: signal.Signals) -> list[int]:
    """``sig`` to every session (process group and members) and pid given; the live pids it reached."""
    hit = set()
    for session in sessions:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(session, sig)
        members = [p for p in procfs.session_pids(session) if _alive(p)]
        hit.update(members)
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
    for pid in pids:
        if _alive(pid):
            hit.add(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
    return sorted(hit)


def stop_everything(proc: subprocess.Popen[bytes], rank_pids: Sequence[int]) -> dict[str, Any]:
    """SIGTERM to torchrun's session and to every rank's session at once, a grace period, SIGKILL, reap;
    what it took and whatever survived (nothing should)."""
    pids = sorted({*rank_pids, *_descendants(proc.pid)})
    sessions = [proc.pid, *pids]  # ranks run in sessions of their own (torchrun's start_new_session)
    report: dict[str, Any] = {"sigterm": False, "sigkill": False, "rank_pids": list(rank_pids)}
    if proc.poll() is None or any(_alive(p) for p in pids):
        report["sigterm"] = True
        _signal_all(pids, sessions, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            proc.poll()
            if proc.returncode is not None and not any(_alive(p) for p in pids):
                break
            time.sleep(0.05)
    if proc.poll() is None or any(_alive(p) for p in pids):
        report["sigkill"] = True
        for _ in range(50):
            if not _signal_all(pids, sessions, signal.SIGKILL) and proc.poll() is not None:
                break
            time.sleep(0.05)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        report["unreaped"] = proc.pid
    report["exit_code"] = proc.returncode
    survivors = [p for p in pids if _alive(p)] + [p for p in procfs.session_pids(proc.pid) if _alive(p)]
    if survivors:
        report["survivors"] = sorted(set(survivors))
    return report


# --- watching ----------------------------------------------------------------------------------------


def _beacons(case_dir: Path, ranks: Sequence[int]) -> dict[int, BeaconState | None]:
    return {r: read_beacon(rank_dir(case_dir, r) / artifacts.BEACON) for r in ranks}


def watch_ranks(
    proc: subprocess.Popen[bytes],
    case_dir: Path,
    spec: CaseSpec,
    started: float,
    on_progress: Any = None,
    poll_s: float = 0.2,
) -> tuple[str, dict[int, WatchResult], int | None]:
    """Poll torchrun and every local rank's beacon until torchrun exits, a rank stalls or the timeout
    passes; the outcome, each rank's watch record, and the rank that decided it (None: torchrun exited)."""
    ranks = local_ranks(spec)
    histories = {r: [Observation(started, None)] for r in ranks}
    while True:
        code = proc.poll()
        now = time.time()
        for rank, state in _beacons(case_dir, ranks).items():
            histories[rank] = compact([*histories[rank], Observation(now, state)])
        if on_progress is not None:
            states = [h[-1].state for h in histories.values() if h[-1].state is not None]
            behind = min(states, key=lambda s: s.seq) if states else None
            on_progress(behind, now - started)
        if code is not None:
            return "exited", {r: WatchResult("exited", h, None, code) for r, h in histories.items()}, None
        decisions = {r: decide(h, now, spec) for r, h in histories.items()}
        stalled = [r for r, d in decisions.items() if d.status == "stalled"]
        # Before every rank reported, a rank that has not started is not a hang of the others.
        if stalled:
            first = max(stalled, key=lambda r: decisions[r].idle_s)
            return (
                "stalled",
                {r: WatchResult("stalled", h, decisions[r], None) for r, h in histories.items()},
                first,
            )
        if any(d.status == "timeout" for d in decisions.values()):
            first = next(r for r, d in decisions.items() if d.status == "timeout")
            return (
                "timeout",
                {r: WatchResult("timeout", h, decisions[r], None) for r, h in histories.items()},
                first,
            )
        time.sleep(poll_s)


def _rank_pids(case_dir: Path, ranks: Sequence[int], proc: subprocess.Popen[bytes]) -> dict[int, int]:
    pids = {r: s.pid for r, s in _beacons(case_dir, ranks).items() if s is not None and s.pid > 0}
    return {r: p for r, p in pids.items() if p in set(_descendants(proc.pid)) or _alive(p)}


def _flight_recorder_dump(case_dir: Path, spec: CaseSpec, pids: Mapping[int, int]) -> dict[str, Any]:
    """NCCL only: ask every rank's flight recorder for a dump through its debug pipe, wait for the files."""
    assert spec.ddp is not None
    if spec.ddp.backend != "nccl":
        return {"taken": False, "why": "gloo has no flight recorder (NCCL only)"}
    ranks_dir = Path(case_dir) / RANKS_DIR
    asked: dict[str, str] = {}
    for rank in pids:
        pipe = ranks_dir / f"{PIPE_PREFIX}{rank}.pipe"
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"1\n")
            os.close(fd)
            asked[str(rank)] = "asked through the debug pipe"
        except OSError as exc:
            asked[str(rank)] = f"no debug pipe ({exc.strerror}); the dump comes only on NCCL's own timeout"
    deadline = time.monotonic() + FR_WAIT_S
    while time.monotonic() < deadline and not all((ranks_dir / f"{FR_PREFIX}{r}").exists() for r in pids):
        time.sleep(0.1)
    time.sleep(0.3)  # a dump being written
    return {"asked": asked, "files": collect_flight_recorder(case_dir, pids)}


def collect_flight_recorder(case_dir: Path, ranks: Sequence[int] | Mapping[int, int]) -> dict[str, str]:
    """Move ``ranks/nccl_trace_rank_<r>`` (torch's dump, on demand or on timeout) into ``ranks/<r>/``."""
    found = {}
    for rank in ranks:
        src = Path(case_dir) / RANKS_DIR / f"{FR_PREFIX}{rank}"
        if src.exists():
            dest = rank_dir(case_dir, rank) / FR_FILE
            artifacts.write_bytes(dest, src.read_bytes())
            src.unlink(missing_ok=True)
            found[str(rank)] = f"{RANKS_DIR}/{rank}/{FR_FILE}"
    return found


def _gather_all(
    case_dir: Path, spec: CaseSpec, watched: Mapping[int, WatchResult], pids: Mapping[int, int]
) -> dict[int, HangEvidence]:
    """Every live rank's evidence, in parallel threads (each samples its own pid), before any kill."""
    out: dict[int, HangEvidence] = {}

    def one(rank: int) -> None:
        last = next((o.state for o in reversed(watched[rank].history) if o.state is not None), None)
        out[rank] = gather_hang_evidence(RankProcess(pids[rank]), rank_dir(case_dir, rank), spec, last)  # type: ignore[arg-type]

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in pids if _alive(pids[r])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


_EXITCODE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def rank_exit_codes(torchrun_stderr: str) -> dict[int, int]:
    """torchrun's failure summary (``rank : 1 (local_rank: 1)`` / ``exitcode : -11``) -> {rank: code}."""
    return {int(r): int(c) for r, c in _EXITCODE.findall(torchrun_stderr)}


# --- the cross-rank diff ------------------------------------------------------------------------------


def collective_state(progress_lines: Sequence[str]) -> dict[str, Any]:
    """From a rank's progress.jsonl: explicit collectives entered per group, and the one it waits in."""
    entered: dict[str, int] = {}
    waiting: dict[str, Any] | None = None
    skipped: list[int] = []
    for line in progress_lines:
        if '"collective"' not in line and '"skip-collective"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "skip-collective":
            skipped.append(rec.get("step"))
            continue
        group = rec.get("group")
        if rec.get("event") == "begin":
            if rec.get("n") is not None:
                entered[group] = max(entered.get(group, 0), int(rec["n"]))
            waiting = {
                "group": group,
                "op": rec.get("collective"),
                "n": rec.get("n"),
                "module": rec.get("module"),
            }
        elif rec.get("event") == "end":
            waiting = None
    return {"entered": entered, "waiting": waiting, "skipped_at_steps": skipped}


def _signature(thread: Any) -> tuple[tuple[str, str], ...]:
    """A stack without line numbers or paths, outermost frame first: equal for ranks at the same place."""
    return tuple((os.path.basename(f.file), f.func) for f in reversed(thread.python_frames))


def cross_rank_diff(
    threads: Mapping[int, Any], collectives: Mapping[int, Mapping[str, Any]]
) -> dict[str, Any]:
    """Cluster the ranks' training-thread stacks; name the minority ranks and their first divergent frame.

    Largest cluster = majority. On a tie (two ranks, two places) the minority is the ranks that never
    entered the training-group collective another rank waits in (they are the ones waited for); failing
    that, the ranks that wait in no collective at all.
    """
    sigs = {r: _signature(t) for r, t in threads.items() if t is not None}
    clusters: dict[tuple[tuple[str, str], ...], list[int]] = {}
    for rank, sig in sorted(sigs.items()):
        clusters.setdefault(sig, []).append(rank)
    groups = sorted(clusters.values(), key=lambda ranks: (-len(ranks), ranks))
    out: dict[str, Any] = {
        "clusters": [
            {
                "ranks": ranks,
                "top": threads[ranks[0]].python_frames[0].short()
                if threads[ranks[0]].python_frames
                else None,
            }
            for ranks in groups
        ],
        "minority_ranks": [],
        "basis": "",
    }
    if len(groups) <= 1:
        out["basis"] = "every rank is at the same frame" if groups else "no stack sample of any rank"
        return out
    majority: list[int] = []
    if len(groups[0]) > len(groups[1]):
        majority = groups[0]
        out["basis"] = f"stack clusters: {_who(majority)} share one stack"
    else:
        waits = [
            (r, c["waiting"]) for r, c in collectives.items()
            if c.get("waiting") and c["waiting"].get("group") == TRAIN_GROUP and c["waiting"].get("n")
        ]  # fmt: skip
        if waits:
            n = max(w["n"] for _, w in waits)
            behind = [r for r in sigs if collectives.get(r, {}).get("entered", {}).get(TRAIN_GROUP, 0) < n]
            if behind and len(behind) < len(sigs):
                majority = [r for r in sigs if r not in behind]
                op = next(w["op"] for _, w in waits if w["n"] == n)
                out["basis"] = (
                    f"collective sequence: {_who(majority)} wait(s) in {op} #{n} of the training group, "
                    f"which {_who(behind)} never entered"
                )
        if not majority:
            in_collective = [
                r
                for r, t in threads.items()
                if t is not None and (_in_torch_distributed(t) or collectives.get(r, {}).get("waiting"))
            ]
            if in_collective and len(in_collective) < len(sigs):
                majority = in_collective
                out["basis"] = f"{_who(majority)} wait(s) in a collective, the others do not"
    if not majority:
        out["basis"] = "the ranks split evenly with nothing to tell the odd ones out"
        return out
    minority = sorted(r for r in sigs if r not in majority)
    out["minority_ranks"] = minority
    out["majority_ranks"] = sorted(majority)
    ref = threads[majority[0]]
    out["first_divergent_frame"] = {str(r): _first_divergence(threads[r], ref) for r in minority}
    return out


def _in_torch_distributed(thread: Any) -> bool:
    return any("torch/distributed/" in f.file.replace("\\", "/") for f in thread.python_frames)


def _first_divergence(thread: Any, ref: Any) -> dict[str, str | None]:
    mine, theirs = list(reversed(thread.python_frames)), list(reversed(ref.python_frames))
    for i, frame in enumerate(mine):
        other = theirs[i] if i < len(theirs) else None
        if other is None or (os.path.basename(frame.file), frame.func) != (
            os.path.basename(other.file),
            other.func,
        ):
            return {"frame": frame.short(), "majority_frame": other.short() if other else None}
    return {"frame": mine[-1].short() if mine else None, "majority_frame": None}


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _who(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0, 2``."""
    return f"rank {_ranks(ranks)}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"


# --- the result ---------------------------------------------------------------------------------------


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _worker(case_dir: Path, rank: int) -> dict[str, Any]:
    try:
        data = artifacts.read_json(rank_dir(case_dir, rank) / artifacts.WORKER_RESULT)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _last_thread(case_dir: Path, rank: int) -> Any:
    text = rank_dir(case_dir, rank) / artifacts.STACKS
    samples, _ = stacks.split_samples(text.read_text(errors="replace")) if text.exists() else ([], None)
    for sample in reversed(samples):
        thread = focus_thread(stacks.parse_faulthandler(sample))
        if thread is not None:
            return thread
    return None


def aggregate(
    spec: CaseSpec,
    case_dir: Path,
    outcome: str,
    per_rank: Mapping[int, CaseResult],
    decider: int | None,
    stop: dict[str, Any],
    elapsed: float,
    notes: dict[str, Any],
) -> CaseResult:
    """The case's result from the ranks' results (see the module docstring)."""
    ds = spec.ddp
    assert ds is not None
    ranks = sorted(per_rank)
    workers = {r: _worker(case_dir, r) for r in ranks}
    reports = {r: workers[r].get("ddp") or {} for r in ranks}
    missing = {str(r): per_rank[r].missing_grads for r in ranks if per_rank[r].missing_grads}
    arrival = {
        str(r): {
            step: info["missing"]
            for step, info in (reports[r].get("grad_arrival") or {}).items()
            if info["missing"]
        }
        for r in ranks
    }
    arrival = {r: v for r, v in arrival.items() if v}
    ddp: dict[str, Any] = {
        "nproc": ds.nproc, "nnodes": ds.nnodes, "node_rank": ds.node_rank, "world_size": ds.world_size,
        "backend": ds.backend, "static_graph": ds.static_graph, "find_unused": ds.find_unused,
        "bucket_mb": ds.bucket_mb,
        "ranks": {
            str(r): {"verdict": per_rank[r].verdict, "reason": per_rank[r].reason,
                     "hang_kind": per_rank[r].hang_kind,
                     "where": per_rank[r].where.describe() if per_rank[r].where else None,
                     "steps_done": per_rank[r].steps_done, "exit_code": per_rank[r].exit_code,
                     "missing_grads": per_rank[r].missing_grads}
            for r in ranks
        },
        "missing_grads": missing,
        "grad_arrival_missing": arrival,
    }  # fmt: skip
    if missing:
        every = set.intersection(*(set(v) for v in missing.values())) if len(missing) == len(ranks) else set()
        ddp["missing_grads_diff"] = {r: sorted(set(v) - every) for r, v in missing.items() if set(v) - every}
        ddp["missing_grads_on_every_rank"] = sorted(every)
    preflight = next((reports[r]["preflight"] for r in ranks if reports[r].get("preflight")), None)
    if preflight:
        ddp["preflight"] = preflight
    hashes = next((reports[r]["param_hash"] for r in ranks if reports[r].get("param_hash")), None)
    if hashes:
        ddp["param_hash"] = hashes
        ddp["params_in_sync"] = all(len(set(h)) == 1 for h in hashes.values())
    buckets = {str(r): reports[r]["buckets"] for r in ranks if reports[r].get("buckets")}
    if buckets:
        ddp["buckets"] = buckets
    errors = {str(r): reports[r]["ddp_error"] for r in ranks if reports[r].get("ddp_error")}
    if errors:
        ddp["ddp_error"] = errors
    ddp.update(notes)

    hang_kind = None
    if outcome == "stalled":
        threads = {r: _last_thread(case_dir, r) for r in ranks}
        collectives = {
            r: collective_state(_read_lines(rank_dir(case_dir, r) / artifacts.PROGRESS)) for r in ranks
        }
        diff = cross_rank_diff(threads, collectives)
        diff["collectives"] = {str(r): c for r, c in collectives.items()}
        ddp["stack_diff"] = diff
        ddp["minority_ranks"] = diff["minority_ranks"]
        ddp["first_divergent_frame"] = diff.get("first_divergent_frame")
        waiting = {r for r, c in collectives.items() if c.get("waiting")}
        for r in waiting:  # NCCL waits show as a device sync in the stack; the progress record says which
            if per_rank[r].hang_kind not in (None, "collective"):
                ddp["ranks"][str(r)]["hang_kind_from_stacks"] = per_rank[r].hang_kind
                ddp["ranks"][str(r)]["hang_kind"] = "collective"
        kinds = {r: ddp["ranks"][str(r)]["hang_kind"] for r in ranks}
        verdict, hang_kind, reason, source = _hang(per_rank, kinds, diff, decider)
    else:
        verdict, reason, source = _worst(per_rank, outcome)
    src = per_rank[source]
    return CaseResult(
        name=spec.name,
        spec_hash=spec.spec_hash(),
        verdict=verdict,  # type: ignore[arg-type]
        reason=reason,
        hang_kind=hang_kind,  # type: ignore[arg-type]
        where=src.where,
        elapsed_s=round(elapsed, 3),
        stall_limit_s=src.stall_limit_s,
        stall_reason=reason.partition("; ")[2] or None if verdict == "hang" else None,
        stall_limit_reason=src.stall_limit_reason,
        timeout_s=spec.timeout,
        device=per_rank[ranks[0]].device,
        exit_code=stop.get("exit_code"),
        signal=src.signal,
        steps_done=min(per_rank[r].steps_done for r in ranks),
        metrics=per_rank[ranks[0]].metrics,
        rate=src.rate,
        missing_grads=sorted({n for v in missing.values() for n in v}),
        nonfinite=src.nonfinite,
        parity=src.parity,
        evidence={
            "outcome": outcome,
            "stop": stop,
            "rank_of_verdict": source,
            "ranks": {str(r): per_rank[r].evidence for r in ranks},
        },
        ddp=ddp,
    )


def _worst(per_rank: Mapping[int, CaseResult], outcome: str) -> tuple[str, str, int]:
    """The most severe verdict over the ranks, the ranks that share it, and its reason."""

    # A rank stopped by torchrun (SIGTERM) because another failed is a consequence, not the cause.
    def key(r: int) -> tuple[int, int]:
        res = per_rank[r]
        consequence = int(res.verdict == "crash" and res.signal == "SIGTERM")
        return consequence, SEVERITY.index(res.verdict) if res.verdict in SEVERITY else 0

    source = min(per_rank, key=key)
    verdict = per_rank[source].verdict
    same = [r for r in sorted(per_rank) if per_rank[r].verdict == verdict]
    if verdict == "pass":
        reason = f"{len(per_rank)} rank(s) passed: {per_rank[source].reason}"
    else:
        reason = f"{_who(same)}: {per_rank[source].reason}"
        if verdict == "grad-missing" and len(same) > 1:
            differ = {r: per_rank[r].missing_grads for r in same}
            if len({tuple(v) for v in differ.values()}) > 1:
                reason += "; per rank: " + "; ".join(
                    f"rank {r}: {', '.join(v[:3])}" for r, v in differ.items()
                )
    return verdict, reason, source


def _hang(
    per_rank: Mapping[int, CaseResult],
    kinds: Mapping[int, str | None],
    diff: Mapping[str, Any],
    decider: int | None,
) -> tuple[str, str | None, str, int]:
    minority = list(diff.get("minority_ranks") or [])
    minority_kinds = {kinds.get(r) for r in minority} - {None, "collective", "unknown"}
    if minority_kinds:
        kind = sorted(minority_kinds)[0]  # the odd rank's own hang (a deadlock) explains the others' wait
    elif any(k == "collective" for k in kinds.values()):
        kind = "collective"
    else:
        kind = next((k for k in kinds.values() if k), "unknown")
    source = minority[0] if minority else (decider if decider is not None else min(per_rank))
    stalled = per_rank[decider if decider is not None else source]
    idle = stalled.reason.partition(" at ")[0] if stalled.reason.startswith("no progress") else "no progress"
    parts = [f"{idle} on rank {decider if decider is not None else source}"]
    majority = diff.get("majority_ranks") or []
    if majority:
        ref = per_rank[majority[0]]
        parts.append(f"{_who(majority)} at {ref.where.describe() if ref.where else 'an unknown place'}")
    if minority:
        div = (diff.get("first_divergent_frame") or {}).get(str(minority[0])) or {}
        src = per_rank[minority[0]]
        text = f"minority {_who(minority)} at {src.where.describe() if src.where else 'an unknown place'}"
        if div.get("frame"):
            text += f", first divergent frame {div['frame']}"
            if div.get("majority_frame"):
                text += f" (the others: {div['majority_frame']})"
        parts.append(text)
    parts.append(diff.get("basis") or "")
    why = per_rank[source].reason.partition("; ")[2]
    if why:
        parts.append(f"rank {source}: {why}")
    return "hang", kind, "; ".join(p for p in parts if p), source


# --- the entry point ----------------------------------------------------------------------------------


def run_ddp_case(
    spec: CaseSpec,
    case_dir: Path,
    *,
    replay_argv: Sequence[str] | None = None,
    on_progress: Any = None,
    extra_env: Mapping[str, str] | None = None,
) -> CaseResult:
    """Run ``spec`` (with ``spec.ddp``) through torchrun in ``case_dir``; the aggregated result, always.
    ``extra_env``: variables for this run only, not in ``replay.sh`` (as `nsa_diag.runner.run_case`).

    Raises `nsa_diag.runner.Interrupted` on SIGINT/SIGTERM, after every process of the case is gone."""
    from nsa_diag.runner import _build_result, _child_env, _error_result, _finish, _InterruptGuard

    case_dir = Path(case_dir)
    (case_dir / RANKS_DIR).mkdir(parents=True, exist_ok=True)
    started, t0 = time.time(), time.monotonic()
    proc: subprocess.Popen[bytes] | None = None
    pids: dict[int, int] = {}
    guard = _InterruptGuard()
    ranks = local_ranks(spec)
    with guard:
        try:
            artifacts.write_json(case_dir / artifacts.SPEC, spec)
            argv = torchrun_argv(spec, case_dir)
            env = ddp_env(spec, case_dir)
            from nsa_diag.runner import worker_env

            artifacts.write_replay(
                case_dir / artifacts.REPLAY, list(replay_argv or argv), {**worker_env(spec), **env}
            )
            with (
                guard.deferred(),
                artifacts.open_append(case_dir / artifacts.STDOUT, binary=True) as out,
                artifacts.open_append(case_dir / artifacts.STDERR, binary=True) as err,
            ):
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    env={**_child_env(spec), **env, **(extra_env or {})}, start_new_session=True,
                )  # fmt: skip
            outcome, watched, decider = watch_ranks(proc, case_dir, spec, started, on_progress)
            pids = _rank_pids(case_dir, ranks, proc)
            hangs: dict[int, HangEvidence] = {}
            notes: dict[str, Any] = {"torchrun": argv}
            if outcome != "exited":
                notes["flight_recorder"] = _flight_recorder_dump(case_dir, spec, pids)
                hangs = _gather_all(case_dir, spec, watched, pids)
            with guard.deferred():
                stop = stop_everything(proc, list(pids.values()))
            fr = collect_flight_recorder(case_dir, ranks)  # dumps written on NCCL's own timeout
            if fr:
                notes.setdefault("flight_recorder", {}).setdefault("files", {}).update(fr)
            codes = rank_exit_codes((case_dir / artifacts.STDERR).read_text(errors="replace"))
            per_rank: dict[int, CaseResult] = {}
            for rank in ranks:
                w = watched[rank]
                alive = rank in hangs
                if outcome != "exited" and not alive:  # this rank had already exited
                    w = WatchResult("exited", w.history, None, codes.get(rank, 0))
                code = codes.get(
                    rank, 0 if (rank_dir(case_dir, rank) / artifacts.WORKER_RESULT).exists() else None
                )
                rank_stop = {"exit_code": code if w.outcome == "exited" else None, "pid": pids.get(rank)}
                per_rank[rank] = _build_result(
                    spec, rank_dir(case_dir, rank), w, hangs.get(rank), rank_stop, time.monotonic() - t0
                )
            result = aggregate(spec, case_dir, outcome, per_rank, decider, stop, time.monotonic() - t0, notes)
            if stop.get("survivors"):
                result = result.model_copy(
                    update={"reason": result.reason + f"; processes left: {stop['survivors']}"}
                )
        except KeyboardInterrupt as exc:
            guard.close()
            stop = stop_everything(proc, list(pids.values())) if proc is not None else {"started": False}
            result = _error_result(
                spec,
                f"interrupted by {getattr(exc, 'signal_name', 'SIGINT')} after {time.monotonic() - t0:.1f} s",
                time.monotonic() - t0, {"outcome": "interrupted", "stop": stop},
            )  # fmt: skip
            _finish(case_dir, result)
            raise
        except Exception as exc:  # a bug of the toolkit: the case still gets its result, the ranks their end
            guard.close()
            stop = stop_everything(proc, list(pids.values())) if proc is not None else {"started": False}
            result = _error_result(
                spec,
                f"nsa-diag internal error while running the ddp case: {type(exc).__name__}: {exc}",
                time.monotonic() - t0,
                {"outcome": "internal-error", "traceback": traceback.format_exc(), "stop": stop},
            )
        with guard.deferred():
            return _finish(case_dir, result)


def ddp_flags(ds: Any) -> list[str]:
    """The `nsa-diag ddp` flags that reproduce ``ds`` (a `DdpSpec`), for replay lines."""
    argv = ["--nproc", str(ds.nproc), "--backend", ds.backend]
    argv += ["--static-graph"] * ds.static_graph + ["--find-unused"] * ds.find_unused
    argv += ["--trace-buckets"] * ds.trace_buckets
    if ds.bucket_mb is not None:
        argv += ["--bucket-mb", f"{ds.bucket_mb:g}"]
    if ds.nnodes > 1 or ds.rdzv_endpoint:
        argv += ["--nnodes", str(ds.nnodes), "--node-rank", str(ds.node_rank)]
        argv += ["--rdzv-endpoint", ds.rdzv_endpoint] if ds.rdzv_endpoint else []
    return argv


# --- from the command line ----------------------------------------------------------------------------

BACKENDS = ("auto", "gloo", "nccl")
_ENDPOINT = re.compile(r"^[A-Za-z0-9_.:\[\]-]+:\d{1,5}$")


def resolve_backend(backend: str, device: str) -> str:
    """auto: nccl when the ranks run on CUDA (device cuda, or auto with a GPU), else gloo."""
    if backend != "auto":
        return backend
    from nsa_diag.cases import runs_on_cuda

    return "nccl" if runs_on_cuda(device) else "gloo"


def check_ddp_options(
    *, nproc: int, backend: str, device: str, nnodes: int, node_rank: int, rdzv_endpoint: str | None
) -> str:
    """Everything about the ddp flags that can be wrong, as one `UsageError` line; the resolved backend."""
    from nsa_diag.cases import cuda_available
    from nsa_diag.errors import UsageError

    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: give 1 or more ranks per node")
    if nnodes < 1:
        raise UsageError(f"--nnodes {nnodes}: give 1 or more nodes")
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank {node_rank}: must be in 0..{nnodes - 1} with --nnodes {nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise UsageError(f"--nnodes {nnodes}: give --rdzv-endpoint HOST:PORT, the same on every node")
    if rdzv_endpoint is not None and not _ENDPOINT.match(rdzv_endpoint):
        raise UsageError(f"--rdzv-endpoint {rdzv_endpoint!r}: expected HOST:PORT")
    if backend not in BACKENDS:
        raise UsageError(f"--backend {backend!r}: choose from {', '.join(BACKENDS)}")
    resolved = resolve_backend(backend, device)
    if resolved == "nccl":
        if device == "cpu":
            raise UsageError("--backend nccl with --device cpu: NCCL needs CUDA tensors; use --backend gloo")
        if not cuda_available():
            raise UsageError("--backend nccl: torch sees no CUDA device here; use --backend gloo on the CPU")
        import torch

        gpus = torch.cuda.device_count()
        if nproc > gpus:
            raise UsageError(f"--nproc {nproc} with --backend nccl: only {gpus} GPU(s) here, one per rank")
    return resolved


def build_ddp_spec(options: Any, ddp: Mapping[str, Any], *, name: str, **fields: Any) -> CaseSpec:
    """`nsa_diag.cases.build_spec` with ``spec.ddp`` from the ddp flags (already checked)."""
    from pydantic import ValidationError

    from nsa_diag.cases import build_spec
    from nsa_diag.errors import ConfigError
    from nsa_diag.spec import DdpSpec

    try:
        ddp_spec = DdpSpec.model_validate(dict(ddp))
    except ValidationError as exc:
        raise ConfigError("; ".join(" ".join(str(e["msg"]).split()) for e in exc.errors())) from None
    device = "cuda" if ddp_spec.backend == "nccl" else options.device.value
    return build_spec(options.replace(device=type(options.device)(device)), name=name, ddp=ddp_spec, **fields)


def ddp_selftest_specs(options: Any, ddp: Mapping[str, Any]) -> list[tuple[CaseSpec, Any]]:
    """`selftest --ddp`: skip-collective on rank 1 (hang, collective) and unused-param on every rank
    (grad-missing), each on the ranks of ``ddp`` (at least 2)."""
    from nsa_diag.cases import Expectation, model_config, preset_overrides

    cfg = model_config(options.preset.value, preset_overrides(options))
    layer = cfg.layers - 1
    ddp = {**ddp, "nproc": max(2, int(ddp.get("nproc", 2)))}
    cases = [
        ("skip-collective:rank=1,step=1", Expectation("skip-collective", "hang", "collective")),
        (f"unused-param:layer={layer},step=1", Expectation("unused-param", "grad-missing")),
    ]
    return [
        (build_ddp_spec(options.replace(inject=(inject,)), ddp, name=f"ddp-{e.kind}"), e)
        for inject, e in cases
    ]
