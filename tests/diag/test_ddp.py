"""`nsa-diag ddp` on the CPU: 2 ranks through real torchrun on gloo, the tiny preset, and no process left.

The process tests run real torchrun jobs (a few seconds each); the rest checks the pure pieces (cross-rank
stack diff, pre-flight verdict, torchrun's failure summary) on recorded input; DDP's error explanations are
tested in test_ddp_errors.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from nsa_diag.analysis.ranks import collective_state, cross_rank_diff, left_a_collective, rank_exit_codes
from nsa_diag.app import run_cli
from nsa_diag.evidence.stacks import parse_faulthandler
from nsa_diag.executor import run_case
from nsa_diag.spec import CaseResult, CaseSpec, DdpSpec, Injection
from nsa_diag.worker.ddp import preflight_verdict

RANK_FILES = ("progress.jsonl", "stdout.log", "stderr.log", "stacks.txt", "worker_result.json")


def _spec(name: str, *inject: str, stall: float = 30.0, **ddp: object) -> CaseSpec:
    return CaseSpec(
        name=name,
        device="cpu",
        stall=stall,
        timeout=120,
        inject=tuple(Injection.parse(text) for text in inject),
        ddp=DdpSpec(nproc=2, backend="gloo", **ddp),  # type: ignore[arg-type]
    )


def _left_behind(case_dir: Path) -> list[str]:
    """Processes of the case still alive: our children, or anything whose command line names the case."""
    mine = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    named = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        if str(case_dir) in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            named.append(proc)
    return [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in {*mine, *named}]


# --- real torchrun jobs ------------------------------------------------------------------------------


# make test-slow (two gloo ranks: ~10 s of CPU): make test keeps two real torchrun jobs through the same
# launcher, ranks and pre-flight (test_unused_param_..., test_skip_collective_...), and `nsa-diag ddp`
# from the shell in test_processes (loopback only, killed with nsa-diag)
@pytest.mark.slow
def test_pass_on_two_gloo_ranks_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(["ddp", "--nproc", "2", "--backend", "gloo", "--device", "cpu", "--stall", "30",
                    "--trace-buckets", "--out", str(tmp_path), "--name", "ok", "--json"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    (case_dir,) = tmp_path.glob("*-ddp/cases/ok")
    result = json.loads((case_dir / "result.json").read_text())
    assert result["verdict"] == "pass", result["reason"]
    ddp = result["ddp"]
    assert ddp["world_size"] == 2
    assert {r["verdict"] for r in ddp["ranks"].values()} == {"pass"}
    assert ddp["preflight"]["verdict"] == "static-graph-safe"
    assert ddp["params_in_sync"] is True
    assert set(ddp["buckets"]) == {"0", "1"}
    assert ddp["buckets"]["0"]["traced"][0]["dtype"] == "torch.float32"
    for rank in ("0", "1"):
        for name in RANK_FILES:
            assert (case_dir / "ranks" / rank / name).exists(), f"ranks/{rank}/{name}"
        assert not (case_dir / "ranks" / rank / "beacon.bin").exists()  # internal: gone when the case ends
    replay = (case_dir / "replay.sh").read_text()
    assert " ddp " in replay
    assert "--nproc 2" in replay
    assert not _left_behind(case_dir)


def test_unused_param_is_grad_missing_naming_parameter_and_ranks(tmp_path: Path) -> None:
    result = run_case(_spec("unused", "unused-param:layer=1"), tmp_path / "unused")
    assert result.verdict == "grad-missing", result.reason
    param = "blocks.1.attn.kv_win.weight"
    assert param in result.reason
    assert "ranks 0, 1" in result.reason
    assert result.missing_grads == [param]
    assert result.ddp is not None
    assert result.ddp["missing_grads"] == {"0": [param], "1": [param]}
    assert result.ddp["grad_arrival_missing"]["1"] == {"1": [param]}  # the hook saw no gradient arrive
    assert result.ddp["preflight"]["verdict"] == "find-unused-needed"
    assert not _left_behind(tmp_path / "unused")


@pytest.mark.slow
def test_unused_param_on_one_rank_names_that_rank(tmp_path: Path) -> None:
    result = run_case(_spec("unused1", "unused-param:layer=1,rank=1", stall=5.0), tmp_path / "unused1")
    assert result.ddp is not None
    assert result.ddp["preflight"]["verdict"] == "ranks-disagree"
    assert result.ddp["preflight"]["unused"] == {"0": [], "1": ["blocks.1.attn.kv_win.weight"]}
    assert result.ddp["ranks"]["1"]["missing_grads"] == ["blocks.1.attn.kv_win.weight"]
    assert not _left_behind(tmp_path / "unused1")


@pytest.mark.slow  # two gloo ranks for five steps; the analysis's own cases are test_stragglers.py
def test_a_rank_slower_every_step_is_named_a_straggler_and_the_job_passes(tmp_path: Path) -> None:
    """Rank 1 sleeps 0.3 s in layer 0's forward every step (a slow data path, a throttled GPU): rank 0
    waits for it in backward's all-reduce, so both take as long a step; rank 1 is named, in forward, and
    the job still passes."""
    spec = _spec("straggler", "slow:layer=0,phase=forward,rank=1,seconds=0.3").model_copy(update={"steps": 5})
    result = run_case(spec, tmp_path / "straggler")
    assert result.verdict == "pass", result.reason
    assert result.ddp is not None
    stragglers = result.ddp["stragglers"]
    assert stragglers["steps"] == [2, 3, 4, 5]
    (slow,) = stragglers["slow"]
    assert (slow["rank"], slow["phase"]) == (1, "forward")
    assert slow["ratio"] >= 1.25
    assert slow["extra_s"] == pytest.approx(0.3, abs=0.15)
    assert "straggler rank 1: " in result.reason
    assert "the other ranks' median step, in forward" in result.reason
    assert not _left_behind(tmp_path / "straggler")


def test_skip_collective_is_a_collective_hang_with_rank_1_the_minority(tmp_path: Path) -> None:
    case_dir = tmp_path / "skip"
    result = run_case(_spec("skip", "skip-collective:rank=1", stall=3.0), case_dir)
    assert result.verdict == "hang", result.reason
    assert result.hang_kind == "collective"
    assert result.ddp is not None
    assert result.ddp["minority_ranks"] == [1]
    assert "minority rank 1" in result.reason
    assert "_hash_check" in result.ddp["first_divergent_frame"]["1"]["frame"]
    assert {r["hang_kind"] for r in result.ddp["ranks"].values()} == {"collective"}
    # gloo's flight recorder, dumped by each rank's heartbeat at the hang, read as `nsa-diag fr` reads it:
    # rank 1 skipped the loss all-reduce of the default group and waits in the side group's hash check,
    # which rank 0 never reached
    recorder = json.loads((case_dir / "result.json").read_text())["ddp"]["flight_recorder"]
    assert set(recorder["files"]) == {"0", "1"}
    analysis = recorder["analysis"]
    assert analysis["suspects"] == [0, 1]
    assert "rank 1 never entered #5 all_reduce" in analysis["groups"][0]["finding"]
    assert "flight recorder: ranks 0, 1 each wait in a collective another never entered" in result.reason
    for rank in ("0", "1"):  # every rank was sampled before any was stopped
        assert (case_dir / "ranks" / rank / "stacks.txt").read_text().count("=== stack sample") == 2
    assert result.evidence["stop"]["sigterm"] is True
    assert "survivors" not in result.evidence["stop"]
    assert not _left_behind(case_dir)


@pytest.mark.slow
def test_reentrant_checkpointing_with_find_unused_is_explained(tmp_path: Path) -> None:
    spec = _spec("reentrant", find_unused=True).with_overrides(gc="all", gc_reentrant=True)
    result = run_case(spec, tmp_path / "reentrant")
    assert result.verdict == "error", result.reason
    assert result.ddp is not None
    explained = result.ddp["ddp_error"]["0"]
    assert explained["kind"] == "marked-ready-twice"
    assert explained["params"]
    assert explained["params"][0].startswith("blocks.")
    assert "marked ready twice" in result.reason
    assert "use_reentrant=False" in result.reason
    assert not _left_behind(tmp_path / "reentrant")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(["--nproc", "0"], "--nproc 0", id="nproc-0"),
        pytest.param(["--backend", "nccl"], "--backend nccl", id="nccl-without-gpu"),
        pytest.param(["--backend", "mpi"], "--backend 'mpi'", id="unknown-backend"),
        pytest.param(["--nnodes", "2"], "--rdzv-endpoint", id="nodes-without-endpoint"),
        pytest.param(["--inject", "skip-collective:rank=2"], "rank=2", id="rank-out-of-range"),
        pytest.param(["--nproc", "1", "--inject", "skip-collective"], "several ranks", id="skip-on-one-rank"),
    ],
)
def test_bad_flags_exit_2_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    if "nccl" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    code = run_cli(["ddp", "--device", "cpu", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert says in err, err
    assert not any(tmp_path.iterdir()), "no run folder for a bad command line"


# --- pure pieces ---------------------------------------------------------------------------------------


def _stack(*frames: tuple[str, int, str]) -> str:
    lines = ["Current thread 0x00007f (most recent call first):"]
    lines += [f'  File "{file}", line {line} in {func}' for file, line, func in frames]
    return "\n".join(lines) + "\n"


_OUTER = [("/x/nsa_diag/worker/train.py", 160, "run"), ("/x/nsa_diag/worker/ddp.py", 400, "<module>")]
_IN_ALL_REDUCE = [
    ("/x/torch/distributed/distributed_c10d.py", 3252, "all_reduce"),
    ("/x/nsa_diag/worker/ddp.py", 331, "_mean_loss"),
    ("/x/nsa_diag/worker/ddp.py", 300, "_step"),
    *_OUTER,
]
_IN_HASH = [
    ("/x/torch/distributed/distributed_c10d.py", 4287, "all_gather"),
    ("/x/nsa_diag/worker/ddp.py", 347, "_hash_check"),
    ("/x/nsa_diag/worker/ddp.py", 301, "_step"),
    *_OUTER,
]


def _threads(**stacks: list[tuple[str, int, str]]) -> dict[int, object]:
    return {int(rank[1:]): parse_faulthandler(_stack(*frames))[0] for rank, frames in stacks.items()}


def test_cross_rank_diff_majority_by_cluster_size() -> None:
    threads = _threads(r0=_IN_ALL_REDUCE, r1=_IN_ALL_REDUCE, r2=_IN_HASH, r3=_IN_ALL_REDUCE)
    diff = cross_rank_diff(threads, {})
    assert diff["minority_ranks"] == [2]
    assert diff["first_divergent_frame"]["2"] == {
        "frame": "ddp.py:347 in _hash_check",
        "majority_frame": "ddp.py:331 in _mean_loss",
    }


def test_cross_rank_diff_tie_broken_by_the_collective_sequence() -> None:
    progress = {
        0: ['{"event": "begin", "collective": "all_reduce", "group": "train", "n": 1, "phase": "check"}'],
        1: ['{"event": "inject", "kind": "skip-collective", "step": 1}',
            '{"event": "begin", "collective": "all_gather_object", "group": "nsa-diag", "phase": "check"}'],
    }  # fmt: skip
    collectives = {rank: collective_state(lines) for rank, lines in progress.items()}
    assert collectives[0]["waiting"]["n"] == 1
    assert collectives[1]["entered"] == {}
    diff = cross_rank_diff(_threads(r0=_IN_ALL_REDUCE, r1=_IN_HASH), collectives)
    assert diff["minority_ranks"] == [1]
    assert "never entered" in diff["basis"]


def test_cross_rank_diff_same_place_names_no_minority() -> None:
    diff = cross_rank_diff(_threads(r0=_IN_ALL_REDUCE, r1=_IN_ALL_REDUCE), {})
    assert diff["minority_ranks"] == []
    assert diff["basis"] == "every rank is at the same frame"


def test_preflight_verdicts() -> None:
    assert preflight_verdict({0: [], 1: []})["verdict"] == "static-graph-safe"
    assert preflight_verdict({0: ["a"], 1: ["a"]})["verdict"] == "find-unused-needed"
    assert preflight_verdict({0: [], 1: ["a"]})["verdict"] == "ranks-disagree"


def test_rank_exit_codes_from_torchrun_summary() -> None:
    summary = """
Failures:
[1]:
  time      : 2026-01-01_00:00:00
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -11 (pid: 4242)
  error_file: <N/A>
"""
    assert rank_exit_codes(summary) == {1: -11}


@pytest.mark.slow
def test_fsdp2_passes_with_the_gradients_ddp_gets_and_claims_no_hash_check(tmp_path: Path) -> None:
    fsdp = run_case(_spec("fsdp", fsdp=True), tmp_path / "fsdp")
    ddp = run_case(_spec("ddp"), tmp_path / "ddp")
    assert fsdp.verdict == "pass", fsdp.reason
    assert fsdp.metrics["grad_norm"] == pytest.approx(ddp.metrics["grad_norm"], rel=1e-5)  # sharded norm
    assert fsdp.ddp.get("params_in_sync") is None  # not checked: never reported as in sync
    assert ddp.ddp["params_in_sync"] is True
    assert "fsdp: every block and the model fully_shard" in json.dumps(fsdp.model_dump(mode="json"))
    assert not _left_behind(tmp_path)


_CLOSED = "RuntimeError at check in all_reduce#1.loss step 1: [pair.cc:553] Connection closed by peer [::1]:1"


def test_a_wait_ended_by_a_peer_that_left_names_the_rank_that_never_entered() -> None:
    """Rank 0 fails in the loss all-reduce because rank 1's socket closed; rank 1 skipped that all-reduce and
    exited 0: rank 1 is the cause. An error that is not a lost peer, or ranks that all entered, name none."""
    progress = {
        0: ['{"event": "begin", "collective": "all_reduce", "group": "train", "n": 1, "phase": "check"}'],
        1: ['{"event": "inject", "kind": "skip-collective", "step": 1}'],
    }
    collectives = {rank: collective_state(lines) for rank, lines in progress.items()}
    per_rank = {
        0: CaseResult(name="r0", spec_hash="x", verdict="error", reason=_CLOSED, exit_code=1, steps_done=1),
        1: CaseResult(name="r1", spec_hash="x", verdict="pass", reason="done", exit_code=0, steps_done=1),
    }
    lost = left_a_collective(per_rank, collectives)
    assert lost is not None
    assert (lost.culprits, lost.victims) == ([1], [0])
    assert lost.describe(per_rank) == (
        "rank 1 never entered all_reduce #1 of the train group, which rank 0 waited in: rank 1 skipped it at "
        "step 1 and exited 0 after 1 step(s), and the wait ended with the peer gone"
    )
    other = {**per_rank, 0: per_rank[0].model_copy(update={"reason": "RuntimeError: shapes differ"})}
    assert left_a_collective(other, collectives) is None
    both_in = {**collectives, 1: collective_state(progress[0])}
    assert left_a_collective(per_rank, both_in) is None


@pytest.mark.slow
def test_fsdp2_rank_that_skips_a_collective_and_exits_is_named(tmp_path: Path) -> None:
    """Under FSDP2 (no parameter hash check after the step) rank 1 skips the loss all-reduce, finishes and
    exits; rank 0's all-reduce ends with gloo's "Connection closed by peer". The case names rank 1."""
    result = run_case(_spec("fsdp-skip", "skip-collective:rank=1", stall=10.0, fsdp=True), tmp_path / "c")
    assert result.verdict == "error", result.reason
    assert result.ddp is not None
    assert result.ddp["minority_ranks"] == [1]
    assert result.reason.startswith("rank 1 never entered all_reduce #1 of the train group"), result.reason
    assert result.evidence.rank_of_verdict == 1
    assert not _left_behind(tmp_path)


def test_fsdp_refuses_ddp_only_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert run_cli(["ddp", "--fsdp", "--bucket-mb", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--fsdp shards with FSDP2, not DDP: --bucket-mb is DDP's option" in err
    assert not any(tmp_path.iterdir())
