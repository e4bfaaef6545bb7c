"""`nsa-diag fr`: the flight recorder dumps of real 2-rank gloo jobs (recorded/fr, `record.py` there), the
analysis (`nsa_diag.analysis.flight`), the command's run folder and exit codes, and files that are not
dumps. ddp's use of the same analysis is tested with its hang in test_ddp.py (slow)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nsa_diag.analysis.flight import analyse
from nsa_diag.app import run_cli
from nsa_diag.evidence.flight import read_dumps

RECORDED = Path(__file__).parent / "recorded" / "fr"


def _analysis(case: str, world_size: int | None = None):
    return analyse(read_dumps(RECORDED / case), world_size)


def test_a_rank_that_skipped_the_collective_is_the_culprit() -> None:
    a = _analysis("skipped")
    assert a.culprits == [1]
    assert not a.suspects
    default = a.groups[0]
    assert (default.desc, default.never_entered, default.frontier.seq) == ("default_pg", [1], 4)
    assert default.last_entered["1"].seq == 3
    assert default.frontier.op == "all_reduce"
    assert default.frontier.sizes == [[4096]]
    assert default.frontier.site == "train_step (fr_job.py:17)"  # the user's frame, not torch's wrappers
    assert "rank 1 never entered #4 all_reduce [[4096]] Float that rank 0 entered" in a.findings[0]
    assert a.groups[1].desc == "stats"
    assert not a.groups[1].culprits
    assert "give --world-size" in a.findings[-1]  # gloo's dumps do not list the group's ranks


def test_the_call_site_is_the_users_frame_past_torch_and_the_watch_probe() -> None:
    """Under watch the probe wraps torch.distributed's collectives: its wrapper is not the user's call
    site (two ranks' different branches would look alike at it); nsa-diag's own workers' frames are."""
    from nsa_diag.analysis.flight import _user_frame

    torch_frame = {"name": "all_reduce", "filename": "/v/site-packages/torch/distributed/c10d.py", "line": 9}
    probe = {"name": "collective", "filename": "/src/nsa_diag/probe/runtime.py", "line": 676}
    user = {"name": "main", "filename": "/home/u/train.py", "line": 28}
    worker = {"name": "_mean_loss", "filename": "/src/nsa_diag/worker/ddp.py", "line": 370}
    assert _user_frame([torch_frame, probe, user]) == "main (train.py:28)"
    assert _user_frame([torch_frame, worker, user]) == "_mean_loss (ddp.py:370)"
    assert _user_frame([torch_frame]) == "all_reduce (c10d.py:9)"  # nothing else: the innermost


def test_a_rank_that_called_another_collective_is_the_culprit() -> None:
    a = _analysis("mismatch", world_size=2)
    assert a.culprits == [1]
    default = a.groups[0]
    assert {r: (c.op, c.sizes) for r, c in default.desync.items()} == {
        "0": ("all_reduce", [[4096]]), "1": ("broadcast", [[16]])
    }  # fmt: skip
    # one rank on each side: the one that called from a new place (a rank-dependent branch) is blamed
    assert "rank 1 called it from a place it had not called this group's collectives from before" in (
        default.finding
    )


def test_a_three_rank_desync_blames_the_minority() -> None:
    dumps = read_dumps(RECORDED / "mismatch")
    a = analyse({0: dumps[0], 1: dumps[1], 2: dumps[0]}, 3)
    assert a.culprits == [1]
    assert "rank 1 left the call the other ranks made (the minority)" in a.groups[0].finding


def test_a_rank_without_a_dump_is_the_likely_culprit_where_the_others_agree() -> None:
    a = _analysis("missing", world_size=2)
    assert (a.ranks, a.missing, a.culprits) == ([0], [1], [1])
    assert "rank 1 wrote no dump while the ranks that did agree" in a.findings[-1]
    assert _analysis("missing").missing == []  # without the job's size nothing can be missing


def test_dumps_that_agree_name_no_culprit(tmp_path: Path) -> None:
    """The skipped job's dumps cut before its fourth all-reduce, as JSON (the recorder's other format)."""
    for rank, dump in read_dumps(RECORDED / "skipped").items():
        dump["entries"] = [e for e in dump["entries"] if e["collective_seq_id"] <= 3]
        (tmp_path / f"nccl_trace_rank_{rank}").write_text(json.dumps(dump))
    a = analyse(read_dumps(tmp_path), 2)
    assert not a.culprits
    assert not a.suspects
    assert a.groups[0].finding.startswith("group 0 (default_pg): ranks 0, 1 all at #3 all_reduce")


def test_fr_writes_a_run_folder_and_exits_1_on_a_culprit(tmp_path: Path, capsys) -> None:
    code = run_cli(["fr", str(RECORDED / "mismatch"), "--world-size", "2", "--out", str(tmp_path), "--json"])
    assert code == 1
    printed = json.loads(capsys.readouterr().out)
    (run_dir,) = tmp_path.glob("*-fr")
    assert json.loads((run_dir / "result.json").read_text()) == printed
    assert printed["analysis"]["culprits"] == [1]
    assert set(printed["files"]) == {"0", "1"}
    summary = (run_dir / "summary.md").read_text()
    assert "**culprit: rank 1**" in summary
    assert "| 1 | #4 broadcast [[16]] Float | main (fr_job.py:32) |" in summary


def test_fr_refuses_what_is_not_a_dump_folder(tmp_path: Path, capsys) -> None:
    marker = tmp_path / "ran"
    hostile = tmp_path / "dumps"
    hostile.mkdir()

    class Run:  # a pickle that would run a command when loaded
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (hostile / "nccl_trace_rank_0").write_bytes(pickle.dumps(Run()))
    out = tmp_path / "runs"
    cases = [
        ([str(hostile)], "not a flight recorder dump (names posix.system"),
        ([str(tmp_path / "nowhere")], "not a folder"),
        ([str(RECORDED)], "no dump files"),
        ([str(RECORDED / "skipped"), "--prefix", "nccl_"], "no dump files starting with 'nccl_'"),
        (
            [str(RECORDED / "skipped"), "--world-size", "1"],
            "--world-size 1: the folder has dumps of rank(s) [1]",
        ),
    ]
    for args, message in cases:
        assert run_cli(["fr", *args, "--out", str(out)]) == 2, args
        err = capsys.readouterr().err
        assert message in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not marker.exists()  # never unpickled into a call
    assert not out.exists()  # nothing half-written
    for content, message in (
        (b"step 3 loss 2.1\n", "neither a pickle nor JSON: it begins b'step 3 loss 2.1\\n'"),  # a log
        (b"", "the file is empty"),
    ):
        (hostile / "nccl_trace_rank_0").write_bytes(content)
        assert run_cli(["fr", str(hostile), "--out", str(out)]) == 2
        assert f"not a flight recorder dump ({message})" in capsys.readouterr().err
    shutil.copy(RECORDED / "skipped" / "gloo_trace_rank_1", hostile / "other_rank_0")
    assert run_cli(["fr", str(hostile), "--out", str(out)]) == 2
    assert "two files for rank 0" in capsys.readouterr().err


@pytest.mark.slow
def test_fr_on_dumps_a_live_job_just_wrote(tmp_path: Path) -> None:
    """`record.py`'s job, run again: rank 1 stuck in its data while rank 0 waits in the all-reduce."""
    env = {**os.environ, "FR_CASE": "skipped", "TORCH_FR_BUFFER_SIZE": "2000"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0"]
    subprocess.run([*torchrun, str(RECORDED / "fr_job.py"), str(tmp_path)], env=env, timeout=120, check=False)
    a = analyse(read_dumps(tmp_path), 2)
    assert a.culprits == [1]
    assert a.groups[0].never_entered == [1]
