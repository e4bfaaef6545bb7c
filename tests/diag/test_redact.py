"""No artifact records a secret passed on a command line: the rules (`nsa_diag.redact`), the files written
(`nsa_diag.artifacts`), replay.sh asking for the value, and `nsa-diag watch` on a job given ``--api-key``."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from diag_cli import cli_env, run_cli

from nsa_diag import artifacts
from nsa_diag.redact import WITHHELD, argv_secret_values, is_secret_option, redact_argv, secret_words

JOBS = Path(__file__).resolve().parent / "jobs"


@pytest.fixture(autouse=True)
def _no_withheld_values_left() -> Iterator[None]:
    yield
    artifacts._withheld.clear()  # the set is process-wide: each test starts from none


@pytest.mark.parametrize(
    ("option", "secret"),
    [
        ("--api-key", True), ("--hf_token", True), ("--password", True), ("-apikey", True),
        ("--wandb.key", True), ("--auth", True), ("--tokenizer", False), ("--max-tokens", False),
        ("--keep-alive", False), ("--monkey", False), ("--author", False), ("--", False), ("key", False),
    ],
)  # fmt: skip
def test_an_option_takes_a_secret_when_a_word_of_its_name_says_so(option: str, secret: bool) -> None:
    assert is_secret_option(option) is secret


def test_secret_words_of_a_command_line() -> None:
    argv = [
        "torchrun", "--nproc-per-node", "2", "train.py", "--api-key", "k-abcdef", "--token=t-123456",
        "--tokenizer", "gpt2", "--password", "--verbose", "HF_TOKEN=hf-xyz", "--lr", "3e-4",
    ]  # fmt: skip
    assert secret_words(argv) == {
        5: ("--api-key", "k-abcdef"),
        6: ("--token", "t-123456"),
        11: ("HF_TOKEN", "hf-xyz"),
    }  # "--password" followed by an option has no value here
    redacted = redact_argv(argv)
    assert redacted[5] == WITHHELD
    assert redacted[6] == f"--token={WITHHELD}"
    assert redacted[11] == f"HF_TOKEN={WITHHELD}"
    assert [redacted[i] for i in (8, 13)] == ["gpt2", "3e-4"]


def test_hydra_overrides_whose_last_key_part_names_a_secret_are_secret() -> None:
    argv = ["python", "train.py", "trainer.api_key=k-abcdef", "+db.password=pw1", "++a/b.hf_token=h-123456",
            "trainer.tokenizer=gpt2", "data.max_tokens=4096", "lr=3e-4"]  # fmt: skip
    assert secret_words(argv) == {
        2: ("trainer.api_key", "k-abcdef"),
        3: ("+db.password", "pw1"),
        4: ("++a/b.hf_token", "h-123456"),
    }
    assert redact_argv(argv)[2:6] == [
        f"trainer.api_key={WITHHELD}", f"+db.password={WITHHELD}", f"++a/b.hf_token={WITHHELD}",
        "trainer.tokenizer=gpt2",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("line", "secrets", "redacted"),
    [
        pytest.param(
            "python t.py --api-key k-abcdef --lr 3", {"k-abcdef"}, f"python t.py --api-key {WITHHELD} --lr 3",
            id="option-and-value",
        ),
        pytest.param(
            "cd /w && python t.py --token=t0k trainer.api_key=h-123456; echo done",
            {"t0k", "h-123456"},
            f"cd /w && python t.py --token={WITHHELD} trainer.api_key={WITHHELD}; echo done",
            id="equals-hydra-and-operators",
        ),
        pytest.param(
            "python t.py --password 'p w d1' --x", {"p w d1"}, f"python t.py --password '{WITHHELD}' --x",
            id="quoted-value",
        ),
        pytest.param(
            "HF_TOKEN=hf-abcdef python t.py", {"hf-abcdef"}, f"HF_TOKEN={WITHHELD} python t.py",
            id="assignment",
        ),
        pytest.param(
            "python t.py --api-key \"unbalanced", {"unbalanced"},
            f'python t.py --api-key "{WITHHELD}', id="unparsable-quotes",
        ),
        pytest.param(
            "exec bash -lc 'python t.py --api-key k-abcdef'", {"k-abcdef"},
            f"exec bash -lc 'python t.py --api-key {WITHHELD}'", id="shell-line-within",
        ),
        pytest.param("python t.py --token $HF_TOKEN", set(), None, id="variable-named"),
        pytest.param("python t.py --tokenizer gpt2 --max-tokens 5", set(), None, id="no-secret"),
    ],
)  # fmt: skip
def test_secrets_inside_a_shell_command_line_are_found_and_withheld(
    line: str, secrets: set[str], redacted: str | None
) -> None:
    """A command line in one word (``bash -c "..."``, ``sh -c``, a launcher's ``--cmd "..."``) is read as
    the shell reads it: its secret options, assignments and Hydra overrides are secrets too."""
    argv = ["bash", "-c", line, "--api-key"]
    assert argv_secret_values([argv]) == secrets
    assert redact_argv(argv) == ["bash", "-c", redacted or line, "--api-key"]


def test_files_written_withhold_the_values_they_are_told_of(tmp_path: Path) -> None:
    artifacts.withhold(["s3cr3t-value", "1234567", "abc"])  # a short one is not searched for
    artifacts.write_text(tmp_path / "a.txt", "Process 42: python train.py --key s3cr3t-value\n")
    record = {"n": 1234567, "x": ["s3cr3t-value"], "s3cr3t-value": "abc", "said": "key 1234567 of 11234567"}
    artifacts.write_json(tmp_path / "b.json", record)
    artifacts.append_text(tmp_path / "c.txt", "x s3cr3t-value y\n")
    for name in ("a.txt", "b.json", "c.txt"):
        assert "s3cr3t-value" not in (tmp_path / name).read_text()
    data = json.loads((tmp_path / "b.json").read_text())
    # digits: a whole number in text, never a JSON number (the file stays JSON) nor inside a longer number
    assert data == {"n": 1234567, "x": [WITHHELD], WITHHELD: "abc", "said": f"key {WITHHELD} of 11234567"}


def test_recorded_command_lines_withhold_their_secret_arguments_by_position(tmp_path: Path) -> None:
    # a value too short to search for is still withheld where a command line is recorded
    record = {
        "argv": ["train.py", "--password", "pw1"],
        "cmdline": "python train.py --token=t0k",
        "other": "pw1",
    }
    artifacts.write_json(tmp_path / "r.json", record)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["argv"] == ["train.py", "--password", WITHHELD]
    assert data["cmdline"] == f"python train.py --token={WITHHELD}"
    assert data["other"] == "pw1"


def test_replay_asks_for_a_secret_argument_and_runs_with_it(tmp_path: Path) -> None:
    argv = ["python3", "-c", "import sys; print(sys.argv[1:])", "--api-key", "k-abcdef", "--hf=tok-from-env"]
    artifacts.withhold(["tok-from-env"])
    os.environ["MY_HF_TOKEN"] = "tok-from-env"  # the value came from a secret variable: replay names it
    try:
        path = artifacts.write_replay(tmp_path / "replay.sh", argv, {"NSA_X": "1"})
    finally:
        del os.environ["MY_HF_TOKEN"]
    text = path.read_text()
    assert "k-abcdef" not in text
    assert "tok-from-env" not in text
    assert "NSA_DIAG_SECRET_1" in text
    assert "MY_HF_TOKEN" in text
    missing = subprocess.run(["bash", str(path)], capture_output=True, text=True, check=False)
    assert missing.returncode != 0
    assert "set NSA_DIAG_SECRET_1" in missing.stderr
    env = {**os.environ, "NSA_DIAG_SECRET_1": "k-abcdef", "MY_HF_TOKEN": "tok-from-env"}
    done = subprocess.run(["bash", str(path)], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.strip() == "['--api-key', 'k-abcdef', '--hf=tok-from-env']"


def test_replay_asks_for_a_short_secret_inside_a_shell_line_and_runs_with_it(tmp_path: Path) -> None:
    """A secret too short to search for (``pw1``) is found by its place in ``bash -c``'s line."""
    line = "python3 -c 'import sys; print(sys.argv[1:])' --password pw1 trainer.api_key='a b' --x"
    path = artifacts.write_replay(tmp_path / "replay.sh", ["bash", "-c", line])
    text = path.read_text()
    assert "pw1" not in text
    assert "a b" not in text
    env = {**os.environ, "NSA_DIAG_SECRET_1": "pw1", "NSA_DIAG_SECRET_2": "a b"}
    done = subprocess.run(["bash", str(path)], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.strip() == "['--password', 'pw1', 'trainer.api_key=a b', '--x']"


@pytest.mark.slow
def test_watch_records_no_secret_of_the_jobs_command_line(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    # --hub's value is a secret only as HF_TOKEN's value (the job was given `--hub $HF_TOKEN`)
    job = [sys.executable, "plain_loop.py", "--api-key", "k-0a1b2c3d", "--wandb_token=w-4e5f6a7b"]
    job += ["--hub", "hf-1c2d3e4f"]
    env = {"HF_TOKEN": "hf-1c2d3e4f"}
    proc = run_cli("watch", "--out", out, "--", *job, cwd=JOBS, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = out.iterdir()
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "probe.json" for p in written)
    for path in written:
        data = path.read_bytes()
        for value in (b"k-0a1b2c3d", b"w-4e5f6a7b", b"hf-1c2d3e4f"):
            assert value not in data, f"{path.relative_to(run_dir)} records {value!r}"
    replay = (run_dir / "cases" / "watch" / "replay.sh").read_text()
    assert "NSA_DIAG_SECRET_1" in replay
    assert "NSA_DIAG_SECRET_2" in replay
    assert '--hub "${HF_TOKEN:?' in replay


def test_watch_records_no_secret_of_a_shell_command_line_and_replay_passes_it_again(tmp_path: Path) -> None:
    """``watch -- bash -c "python t.py --api-key S trainer.api_key=H"``: neither S nor H in any file
    nsa-diag writes, nor on its console; replay.sh reads both from variables and runs the same command."""
    secret, hydra = "k-0a1b2c3d", "h-9f8e7d6c"
    (tmp_path / "t.py").write_text("import json, sys\njson.dump(sys.argv[1:], open('argv.json', 'w'))\n")
    line = f"{shlex.quote(sys.executable)} t.py --api-key {secret} trainer.api_key={hydra} --lr 3"
    out = tmp_path / "runs"
    proc = run_cli("watch", "--out", out, "--", "bash", "-c", line, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    sent = json.loads((tmp_path / "argv.json").read_text())
    assert sent == ["--api-key", secret, f"trainer.api_key={hydra}", "--lr", "3"]
    for value in (secret, hydra):
        assert value not in proc.stdout + proc.stderr
    (run_dir,) = out.iterdir()
    job_output = {"stdout.log", "stderr.log"}
    for path in (p for p in run_dir.rglob("*") if p.is_file() and p.name not in job_output):
        for value in (secret, hydra):
            assert value not in path.read_text(errors="replace"), f"{path.relative_to(run_dir)} records it"
    replay = run_dir / "cases" / "watch" / "replay.sh"
    (asking,) = [ln for ln in replay.read_text().splitlines() if ln.startswith("# Secret arguments")]
    variables = asking.split(": ", 1)[1].split()
    assert len(variables) == 2, asking
    (tmp_path / "argv.json").unlink()
    env = {**cli_env(), **dict(zip(variables, (secret, hydra), strict=True))}
    again = subprocess.run(["bash", str(replay)], capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "argv.json").read_text()) == sent


def test_an_all_digit_secret_that_the_jobs_traceback_repeats_is_withheld(tmp_path: Path) -> None:
    """``--api-key 98765432109``, repeated by the job's error: digits are a secret too, in every file
    and on the console; the job's own logs keep what it printed."""
    secret = "98765432109"
    (tmp_path / "e.py").write_text(
        "import sys\n"
        "key = sys.argv[sys.argv.index('--api-key') + 1]\n"
        "raise PermissionError(f'the hub refused api key {key}')\n"
    )
    out = tmp_path / "runs"
    proc = run_cli("watch", "--out", out, "--", sys.executable, "e.py", "--api-key", secret, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert secret not in proc.stdout
    (run_dir,) = out.iterdir()
    case = run_dir / "cases" / "watch"
    assert secret in (case / "stderr.log").read_text()  # the job's own output
    result = json.loads((case / "result.json").read_text())
    assert result["verdict"] == "error"
    assert f"the hub refused api key {WITHHELD}" in json.dumps(result)
    for path in (p for p in run_dir.rglob("*") if p.is_file() and p.name not in {"stdout.log", "stderr.log"}):
        assert secret not in path.read_text(errors="replace"), f"{path.relative_to(run_dir)} records it"


def test_a_pyspy_dump_heads_with_the_command_line_its_secrets_withheld() -> None:
    from nsa_diag.evidence.stacks import _redact_header, parse_pyspy

    recorded = (Path(__file__).parent / "recorded" / "deadlock.pyspy.txt").read_text()
    head, rest = recorded.split("\n", 1)
    text = head + " --token abc\n" + rest  # a value too short to search for: withheld by its position
    redacted = _redact_header(text)
    assert redacted.split("\n", 1)[0] == head + f" --token {WITHHELD}"
    assert parse_pyspy(redacted) == parse_pyspy(text)


def test_a_secret_variable_holding_a_path_does_not_blank_the_paths_under_it() -> None:
    from nsa_diag.redact import env_secret_values

    environ = {"KEY_DIR": "/work", "HF_TOKEN": "hf-abcdef", "TOKENIZERS_PARALLELISM": "false", "PATH": "/x"}
    assert env_secret_values(environ) == {"hf-abcdef"}
