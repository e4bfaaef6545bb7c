"""`report` and `compare` on run folders that are not what nsa-diag writes: a copied, hand-edited or hostile
folder. Every file read back is a regular file of a bounded size, JSON of a bounded depth; anything else is
skipped with one line saying so, never a traceback, a MemoryError or a hang (issue 27, item 9).

Each case is a real file system object (a FIFO, a link to /dev/zero, JSON nested 200,000 deep) in a small
folder made here, read by `nsa-diag` in a subprocess with its address space capped, so that an unbounded
read fails fast instead of eating the machine's memory.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from diag_cli import cli_env

from nsa_diag import artifacts

ADDRESS_SPACE = 3 * 2**30  # nsa-diag's imports fit; reading /dev/zero to its end does not


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def nsa_diag(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nsa_diag", *map(str, args)],
        capture_output=True,
        text=True,
        env=cli_env(OPENBLAS_NUM_THREADS="1", MPLBACKEND="Agg"),
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        preexec_fn=_capped,
        check=False,
    )


def _folder(tmp_path: Path) -> Path:
    """A run folder of two cases: ``hung`` (a result.json: a hang, so its stacks are read) and ``killed``
    (a spec.json only: nsa-diag was killed, so its progress.jsonl is read)."""
    run = tmp_path / "20260101-120000-run"
    hung, killed = run / "cases" / "hung", run / "cases" / "killed"
    hung.mkdir(parents=True)
    killed.mkdir(parents=True)
    result = {"name": "hung", "spec_hash": "0" * 16, "verdict": "hang", "reason": "stuck"}
    (hung / artifacts.RESULT).write_text(json.dumps(result))
    (killed / artifacts.SPEC).write_text(json.dumps({"name": "killed"}))
    return run


def _deep(path: Path) -> None:
    path.write_text("[" * 200_000 + "]" * 200_000)


def _to_dev_zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


HOSTILE: list[tuple[str, str, Callable[[Path], None], str]] = [
    ("deep-result", "cases/hung/result.json", _deep, "nested deeper than 64: skipped"),
    ("deep-summary", "summary.json", _deep, "nested deeper than 64: skipped"),
    ("pyspy-dev-zero", "cases/hung/pyspy.txt", _to_dev_zero, "not a regular file: skipped"),
    ("stacks-fifo", "cases/hung/stacks.txt", _fifo, "not a regular file: skipped"),
    ("progress-dev-zero", "cases/killed/progress.jsonl", _to_dev_zero, "not a regular file: skipped"),
    ("progress-fifo", "cases/killed/progress.jsonl", _fifo, "not a regular file: skipped"),
    ("env-fifo", "env.json", _fifo, "not a regular file: skipped"),
]


@pytest.mark.parametrize(("file", "make", "says"), [pytest.param(*h[1:], id=h[0]) for h in HOSTILE])
def test_report_and_compare_skip_a_hostile_file_in_one_line(
    tmp_path: Path, file: str, make: Callable[[Path], None], says: str
) -> None:
    run = _folder(tmp_path)
    make(run / file)
    done = nsa_diag("report", run)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if says in line]
    assert line == f"note: {run / file}: {says}"
    assert f"{run / file}: {says}" in (run / "report.md").read_text()
    done = nsa_diag("compare", run, run)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert f"{run / file}: {says}" in done.stdout


def test_a_folder_whose_only_file_is_a_fifo_is_not_a_run_folder(tmp_path: Path) -> None:
    run = tmp_path / "20260101-120000-run"
    run.mkdir()
    os.mkfifo(run / "summary.json")
    for args in (["report", run], ["compare", run, run]):
        done = nsa_diag(*args)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "not an nsa-diag run folder" in done.stderr


def test_compare_out_that_cannot_be_written_is_one_line_and_exit_2(tmp_path: Path) -> None:
    run = _folder(tmp_path)
    done = nsa_diag("compare", run, run, "--out", "/proc/self/x.md")
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("nsa-diag: --out /proc/self/x.md: cannot be written"), line


@pytest.mark.parametrize(
    ("data", "deeper"),
    [
        pytest.param(b"[" * 64 + b"]" * 64, False, id="64-deep"),
        pytest.param(b"[" * 65 + b"]" * 65, True, id="65-deep"),
        pytest.param(
            b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}',
            False,
            id="in-a-string",
        ),
        pytest.param(b"[" * 200_000, True, id="unclosed"),
        pytest.param(b"[1, 2", False, id="malformed-shallow"),
    ],
)
def test_json_depth(data: bytes, deeper: bool) -> None:
    assert artifacts.json_depth_exceeds(data) is deeper
