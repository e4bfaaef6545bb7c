"""Multi-node `nsa-diag ddp`, simulated on one host: one `nsa-diag ddp --nnodes 2 --node-rank R` process per
node (gloo, a loopback rendezvous, one rank each), both writing into the same --out, as two hosts with a
shared file system would. What needs two real hosts (NCCL across a network, a shared file system's
locking, a host name that resolves to another machine) is not tried here.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from diag_cli import cli_env

from nsa_diag import artifacts
from nsa_diag.analysis.compare import compare_runs
from nsa_diag.app import run_cli
from nsa_diag.launchers.torchrun import torchrun_argv
from nsa_diag.report import build_report
from nsa_diag.runfolder import load_run
from nsa_diag.spec import CaseSpec, DdpSpec

RANK_FILES = (
    "progress.jsonl",
    "stdout.log",
    "stderr.log",
    "stacks.txt",
    "worker_result.json",
    "rank_result.json",
)
WILDCARD = ("0.0.0.0", "::")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(out: Path, port: int, node: int, *extra: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "nsa_diag", "ddp", "--nnodes", "2", "--node-rank", str(node),
            "--nproc", "1", "--backend", "gloo", "--device", "cpu", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--out", str(out), "--json", *extra]  # fmt: skip
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=cli_env(),
    )


def _listening(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses a process and its descendants listen on, now."""
    found = set()
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return found
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((conn.laddr.ip, conn.laddr.port))
        except psutil.Error:
            continue
    return found


def _run_nodes(out: Path, *extra: str, timeout: float = 180) -> tuple[list[tuple[int, str, str]], set]:
    """Both nodes to their end (node 1 a moment after node 0); each one's exit code, stdout and stderr, and
    every address node 0's processes listened on meanwhile (the rendezvous store is node 0's agent)."""
    port = _free_port()
    nodes = [_node(out, port, 0, *extra)]
    time.sleep(0.5)
    nodes.append(_node(out, port, 1, *extra))
    listened: set[tuple[str, int]] = set()
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
            listened |= {(ip, p, node) for node, proc in enumerate(nodes) for ip, p in _listening(proc.pid)}
            time.sleep(0.3)
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
    ends = [(p.wait(), *p.communicate()) for p in nodes]
    return ends, {(ip, p, node, port) for ip, p, node in listened}


def _one_run_folder(out: Path) -> Path:
    (run_dir,) = out.glob("ddp-*")  # one folder for both nodes
    return run_dir


def _left_behind(run_dir: Path) -> list[str]:
    named = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if (
            str(run_dir) in " ".join(proc.info["cmdline"] or ())
            and proc.info["status"] != psutil.STATUS_ZOMBIE
        ):
            named.append(f"{proc.pid} {' '.join(proc.info['cmdline'])[:120]}")
    return named


# --- two simulated nodes --------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_nodes_pass_into_one_run_folder_with_the_store_on_the_endpoint_only(tmp_path: Path) -> None:
    ends, listened = _run_nodes(tmp_path, "--name", "ok", "--stall", "30")
    for node, (code, _, err) in enumerate(ends):
        assert code == 0, f"node {node}: {err}"
    run_dir = _one_run_folder(tmp_path)
    case = run_dir / "cases" / "ok"
    result = json.loads((case / "result.json").read_text())
    assert result["verdict"] == "pass", result["reason"]
    assert result["ddp"]["world_size"] == 2
    assert set(result["ddp"]["ranks"]) == {"0", "1"}
    assert set(result["ddp"]["nodes"]) == {"0", "1"}
    for rank in ("0", "1"):
        for name in RANK_FILES:
            assert (case / "ranks" / rank / name).exists(), f"ranks/{rank}/{name}"
    # node 1's own part: its spec, logs and its copy of the case's result; its env and summary
    assert json.loads((case / "nodes" / "1" / "result.json").read_text())["verdict"] == "pass"
    assert json.loads((case / "nodes" / "1" / "spec.json").read_text())["ddp"]["node_rank"] == 1
    assert json.loads((case / "spec.json").read_text())["ddp"]["node_rank"] == 0
    for name in ("env.json", "nodes/0/env.json", "nodes/1/env.json", "summary.json", "nodes/1/summary.json"):
        assert (run_dir / name).exists(), name
    assert not list(run_dir.glob(".nsa-diag.node*.lock")), "each node's lock goes with it"
    assert json.loads(ends[1][1])["cases"][0]["verdict"] == "pass"  # node 1 ends with the case's verdict
    # The rendezvous store (node 0's agent, on the endpoint's port) listens on 127.0.0.1 only, and no
    # process of either node listens on every address.
    (port,) = {p for *_, p in listened}
    store = {ip for ip, p, node, _ in listened if p == port}
    assert store == {"127.0.0.1"}, listened
    assert not [x for x in listened if x[0] in WILDCARD], listened
    assert not _left_behind(run_dir)
    # report and compare see each node's env.json (the markdown without the plots: they take seconds)
    run = load_run(run_dir)
    assert set(run.nodes) == {"0", "1"}
    assert set(compare_runs(run.compared(), run.compared())["nodes"]) == {"0", "1"}
    report = build_report(run, {})
    nodes = report[report.index("### Nodes") :]
    assert "| 0 | " in nodes, nodes
    assert "| 1 | " in nodes, nodes


@pytest.mark.slow
def test_skip_collective_on_node_1_is_a_collective_hang_with_rank_1_the_minority(tmp_path: Path) -> None:
    ends, _ = _run_nodes(tmp_path, "--name", "skip", "--stall", "5", "--inject", "skip-collective:rank=1")
    for node, (code, _, err) in enumerate(ends):
        assert code == 1, f"node {node}: {err}"  # the same verdict's code on every node
    run_dir = _one_run_folder(tmp_path)
    case = run_dir / "cases" / "skip"
    result = json.loads((case / "result.json").read_text())
    assert result["verdict"] == "hang", result["reason"]
    assert result["hang_kind"] == "collective"
    assert result["ddp"]["minority_ranks"] == [1]
    assert "minority rank 1" in result["reason"]
    assert {n["outcome"] for n in result["ddp"]["nodes"].values()} == {"stalled"}
    assert sorted(p.name for p in (case / "ranks").iterdir() if p.is_dir()) == ["0", "1"]
    for rank in ("0", "1"):
        assert (case / "ranks" / rank / "stacks.txt").read_text().strip(), f"rank {rank} sampled"
    node1 = json.loads((case / "nodes" / "1" / "result.json").read_text())
    assert (node1["verdict"], node1["ddp"]["minority_ranks"]) == ("hang", [1])
    assert not _left_behind(run_dir)


@pytest.mark.slow
def test_sigint_to_node_0_alone_is_not_said_of_node_1(tmp_path: Path) -> None:
    """Ctrl-C on node 0 stops its ranks, and node 1's rank loses its peer. Node 1 ends with the case's
    result (node 0's), but says that node 0 was interrupted, not itself, and what became of its ranks."""
    port = _free_port()
    extra = ("--name", "slow", "--steps", "40", "--inject", "slow:seconds=0.5", "--stall", "30")
    nodes = [_node(tmp_path, port, 0, *extra)]
    time.sleep(0.5)
    nodes.append(_node(tmp_path, port, 1, *extra))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list(
            tmp_path.glob("ddp-*/cases/slow/ranks/1/progress.jsonl")
        ):
            assert all(p.poll() is None for p in nodes), [p.communicate() for p in nodes]
            time.sleep(0.3)
        time.sleep(2.0)  # both ranks in their steps
        nodes[0].send_signal(signal.SIGINT)
        ends = [(p.wait(timeout=120), *p.communicate()) for p in nodes]
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
    assert ends[0][0] == 130, ends[0][2]
    node1 = json.loads(ends[1][1])["cases"][0]
    case = _one_run_folder(tmp_path) / "cases" / "slow"
    assert json.loads((case / "result.json").read_text())["reason"].startswith("interrupted by SIGINT")
    assert not node1["reason"].startswith("interrupted"), node1["reason"]
    assert node1["reason"].startswith("node 0 was interrupted by SIGINT"), node1["reason"]
    assert "node 1's ranks: " in node1["reason"]
    assert not _left_behind(_one_run_folder(tmp_path))


@pytest.mark.slow  # 10-14 s; the bad-input tests of multi-node stay in make test
def test_node_0_alone_listens_on_the_endpoint_only_and_says_node_1_never_joined(tmp_path: Path) -> None:
    """The short sibling of the two-node runs: node 0's store waits for node 1 (--rdzv-timeout 5), listening
    on 127.0.0.1 only, then the case is an error naming the rendezvous and the node that never came."""
    port = _free_port()
    node0 = _node(tmp_path, port, 0, "--name", "alone", "--rdzv-timeout", "5")
    listened: set[tuple[str, int]] = set()
    while node0.poll() is None:
        listened |= _listening(node0.pid)
        time.sleep(0.2)
    _, err = node0.communicate()
    assert node0.returncode == 1, err
    assert {ip for ip, p in listened if p == port} == {"127.0.0.1"}, listened
    assert not [x for x in listened if x[0] in WILDCARD], listened
    result = json.loads((_one_run_folder(tmp_path) / "cases" / "alone" / "result.json").read_text())
    assert result["verdict"] == "error"
    assert f"rendezvous at 127.0.0.1:{port} did not complete within 5 s" in result["reason"]
    assert "1/2 clients joined" in result["reason"]  # torchrun's own word
    assert result["ddp"]["ranks"]["1"]["reason"] == "node 1 never reported"


# --- bad input: one line, exit 2, nothing written -------------------------------------------------------


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(["--nnodes", "2"], "--rdzv-endpoint HOST:PORT", id="no-endpoint"),
        pytest.param(
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29999"],
            "--node-rank 2: must be in 0..1",
            id="node-rank-out-of-range",
        ),
        pytest.param(
            ["--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29999"],
            "does not resolve",
            id="host-does-not-resolve",
        ),
        pytest.param(
            ["--nnodes", "2", "--rdzv-endpoint", "192.0.2.1:29999"],
            "not an address of this machine",
            id="node-0-elsewhere",
        ),
        pytest.param(
            [
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--rdzv-endpoint",
                "127.0.0.1:{closed}",
                "--rdzv-timeout",
                "1",
            ],
            "nothing listens there after 1 s",
            id="nothing-listens",
        ),
        pytest.param(["--rdzv-endpoint", "127.0.0.1:{taken}"], "cannot listen there", id="port-taken"),
        pytest.param(["--run-id", "x"], "--run-id: only for several nodes", id="run-id-one-node"),
        pytest.param(
            ["--executor", "slurm"], "--executor slurm: give --nnodes 2 or more", id="slurm-one-node"
        ),
        pytest.param(
            ["--executor", "slurm", "--nnodes", "2", "--rdzv-endpoint", "h:1"],
            "--rdzv-endpoint: not with --executor slurm",
            id="slurm-endpoint",
        ),
        pytest.param(["--executor", "slurm", "--nnodes", "2"], "no Slurm here", id="slurm-without-sbatch"),
        pytest.param(
            ["--partition", "gpu"], "--partition applies to --executor slurm", id="slurm-option-local"
        ),
        pytest.param(
            ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29999", "--repeat", "2"],
            "--repeat: not with --nnodes 2",
            id="repeat-across-nodes",
        ),
    ],
)
def test_bad_input_exits_2_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    with _listening_socket() as taken:
        closed = _free_port()
        argv = [a.format(taken=taken.getsockname()[1], closed=closed) for a in args]
        started = time.monotonic()
        code = run_cli(["ddp", "--device", "cpu", "--backend", "gloo", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert says in err, err
    assert time.monotonic() - started < 10, "the waits are bounded"
    assert not any(tmp_path.iterdir()), "no run folder for a bad command line"


def test_a_second_process_for_the_same_node_and_a_finished_run_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["ddp", "--device", "cpu", "--backend", "gloo", "--out", str(tmp_path), "--nnodes", "2",
            "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--run-id", "r1"]  # fmt: skip
    run_dir = tmp_path / "ddp-r1"
    run_dir.mkdir()
    lock = artifacts.lock_run_dir(run_dir, artifacts.node_lock(0))
    try:
        assert run_cli(argv) == 2
    finally:
        lock.release()
    err = capsys.readouterr().err.strip()
    assert ".nsa-diag.node0.lock is held by pid" in err, err
    artifacts.write_json(run_dir / "cases" / "ddp" / "result.json", {"verdict": "pass"})
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "this run has finished already" in err, err
    assert len(err.splitlines()) == 1, err


# --- ddp --executor slurm, through submitit's local executor ------------------------------------------


@pytest.mark.slow
def test_executor_slurm_runs_one_torchrun_per_node_through_submitit(tmp_path: Path) -> None:
    """submitit's local executor has one node, so the job's two tasks (one per node on Slurm) run here;
    the rest (node rank from the job environment, the endpoint node 0 publishes, each node's session) is
    the path a Slurm job takes."""
    argv = ["ddp", "--executor", "slurm", "--submitit-cluster", "local", "--nnodes", "2", "--nproc", "1",
            "--backend", "gloo", "--device", "cpu", "--stall", "30", "--name", "sl",
            "--out", str(tmp_path / "runs"), "--junit", str(tmp_path / "junit.xml")]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "nsa_diag", *argv],
        capture_output=True,
        text=True,
        env=cli_env(),
        stdin=subprocess.DEVNULL,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "sl: pass" in proc.stdout
    assert 'name="sl"' in (tmp_path / "junit.xml").read_text()  # node 0's
    run_dir = _one_run_folder(tmp_path / "runs")
    case = run_dir / "cases" / "sl"
    assert json.loads((case / "result.json").read_text())["ddp"]["world_size"] == 2
    node1 = json.loads((case / "nodes" / "1" / "spec.json").read_text())["ddp"]
    assert node1["node_rank"] == 1
    assert node1["rdzv_endpoint"].startswith("127.0.0.1:")  # node 0's, from the run folder
    assert len(list((run_dir / "slurm").glob("*_result.pkl"))) == 2  # one task per node
    assert not _left_behind(run_dir)


@pytest.mark.slow
def test_executor_slurm_interrupt_cancels_the_job_and_leaves_a_result(tmp_path: Path) -> None:
    argv = ["ddp", "--executor", "slurm", "--submitit-cluster", "local", "--nnodes", "2", "--nproc", "1",
            "--backend", "gloo", "--device", "cpu", "--stall", "120", "--name", "cc",
            "--inject", "skip-collective:rank=1", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "nsa_diag", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=cli_env(),
    )
    deadline = time.monotonic() + 180
    while not list(tmp_path.glob("ddp-*/cases/cc/ranks/1/progress.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "the job was cancelled" in err
    run_dir = _one_run_folder(tmp_path)
    result = json.loads((run_dir / "cases" / "cc" / "result.json").read_text())
    assert result["verdict"] == "error"
    assert "CANCELLED" in result["reason"] or "interrupted" in result["reason"], result["reason"]
    deadline = time.monotonic() + 15
    while _left_behind(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _left_behind(run_dir)


# --- what every node derives alike ----------------------------------------------------------------------


def _spec(node: int, **fields: object) -> CaseSpec:
    ddp = DdpSpec(nproc=1, nnodes=2, node_rank=node, rdzv_endpoint="10.0.0.1:29400")
    return CaseSpec(name="c", device="cpu", ddp=ddp, **fields)  # type: ignore[arg-type]


def test_run_id_is_alike_on_every_node_and_names_the_rendezvous(tmp_path: Path) -> None:
    assert _spec(0).run_id() == _spec(1).run_id()
    assert _spec(0).run_id() != _spec(0, steps=3).run_id()
    argv = torchrun_argv(_spec(1), tmp_path)
    at = argv.index("--rdzv-backend")
    assert argv[at + 1] == "static"  # the backend that keeps --node-rank
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--rdzv-id") + 1] == _spec(1).run_id()
    assert argv[argv.index("--rdzv-conf") + 1] == "timeout=120"
