"""README's CLI examples, run as written: the commands of the ```sh blocks of its "## CLI" section.

Each runs in process (the CLI's own `run_cli`, as `nsa-diag` would) in one folder for all of them, so the
run folders go to its `nsa-diag-runs/` as the README says; the example files the README assumes are
written there (`train.py`: a plain training loop; `my-cases.yaml`: one case of the tiny default), and a
placeholder run folder (`<run>`, `<A>`, `<B>`) is one an earlier example made. Which examples are skipped
and why is `SKIPPED` (and `_needs_here`); the long ones run in `make test-slow` (`SLOW`). A new example
runs by default; one with a placeholder this file does not know fails until it is given one.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from nsa_diag.app import run_cli

HERE = Path(__file__).resolve().parent
README = HERE.parents[1] / "README.md"
RUNS = "nsa-diag-runs"

SKIPPED = {
    "nsa-diag selftest": "long: a case per fault kind, several waiting out a stall (a minute or more here)",
    "nsa-diag matrix cpu-smoke": "long: about a minute (test_matrix.py runs the shipped cpu-smoke matrix)",
    "nsa-diag attach 12345": "needs the PID of a running job of yours (test_attach.py starts real jobs)",
}
SLOW = {  # 20 s to minutes each here: a stall waited out, four cases, three against the reference, torchrun
    "nsa-diag run --inject deadlock:layer=1 --stall 5",
    "nsa-diag branch",
    "nsa-diag backend --sel masked,gather,packed",
    "nsa-diag ddp --nproc 2",
    # the same command on the same script (jobs/plain_loop.py) as test_watch.py's test_plain_loop_passes,
    # which checks more of it: two torch imports and a training loop, ~6 s of CPU
    "nsa-diag watch -- python train.py",
}
# The run folder each placeholder stands for: the one this example made.
PLACEHOLDERS = {"<run>": "nsa-diag run", "<A>": "nsa-diag run", "<B>": "nsa-diag matrix my-cases.yaml"}
EXIT_CODES = {"nsa-diag run --inject deadlock:layer=1 --stall 5": 1}  # a hang; every other example: 0
MY_CASES = """\
# the README's matrix file of your own: the tiny default's case, as `nsa-diag run` runs it
cases:
  - {name: case}
"""


def cli_examples(readme: str) -> list[str]:
    """The commands of the ```sh blocks between "## CLI" and the next "## " heading, comments left out."""
    section = readme.split("\n## CLI\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    lines = [line.split(" #", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _needs_here(example: str) -> str | None:
    """Why `example` cannot run on this machine (a GPU, a cluster), or None."""
    if "--device cuda" in example or "--backend nccl" in example:
        return "needs a GPU"
    if "--executor slurm" in example:
        return "needs a Slurm cluster"
    return None


def _param(example: str) -> object:
    marks = [pytest.mark.slow] if example in SLOW else []
    why = SKIPPED.get(example) or _needs_here(example)
    if why:
        marks.append(pytest.mark.skip(reason=why))
    return pytest.param(example, marks=marks, id=example.removeprefix("nsa-diag ") or "nsa-diag")


EXAMPLES = cli_examples(README.read_text())


def test_the_readme_has_its_cli_examples() -> None:
    assert "nsa-diag run" in EXAMPLES
    assert len(EXAMPLES) >= 15, EXAMPLES
    assert not set(SKIPPED) - set(EXAMPLES), "SKIPPED names an example the README no longer has"
    assert not SLOW - set(EXAMPLES), "SLOW names an example the README no longer has"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the examples run: the files they name, and the run folders they make (`made`)."""
    folder = tmp_path_factory.mktemp("readme")
    shutil.copy(HERE / "jobs" / "plain_loop.py", folder / "train.py")
    (folder / "my-cases.yaml").write_text(MY_CASES)
    return folder


made: dict[str, Path] = {}  # example -> the run folder it made


def _run(
    example: str, home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> str:
    """Run `example` in `home` (first the examples that make its placeholders' run folders); its stdout.
    `python` is this interpreter (the one with torch)."""
    line = example
    for placeholder, maker in PLACEHOLDERS.items():
        if placeholder not in line:
            continue
        if maker not in made:
            _run(maker, home, capsys, monkeypatch)
        line = line.replace(placeholder, made[maker].name)
    unknown = re.findall(r"<[^<>]+>", line)
    assert not unknown, f"give {unknown} a run folder in PLACEHOLDERS"
    argv = shlex.split(line)
    assert argv[0] == "nsa-diag", example
    if "--" in argv:
        job = argv.index("--") + 1
        argv[job:] = [sys.executable if arg == "python" else arg for arg in argv[job:]]
    monkeypatch.chdir(home)
    before = set((home / RUNS).iterdir()) if (home / RUNS).is_dir() else set()
    code = run_cli(argv[1:])
    out, err = capsys.readouterr()
    assert code == EXIT_CODES.get(example, 0), f"{example}: exit {code}\n{err[-3000:]}"
    assert "Traceback" not in err
    assert "internal error" not in err
    new = set((home / RUNS).iterdir()) - before if (home / RUNS).is_dir() else set()
    if new:
        (made[example],) = new
    return out


@pytest.mark.parametrize("example", [_param(example) for example in EXAMPLES])
def test_a_readme_example_runs_as_written(
    example: str, home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if example in made:  # already run, as an earlier example's placeholder
        return
    out = _run(example, home, capsys, monkeypatch)
    assert out.strip(), f"{example}: printed nothing"
    if example == "nsa-diag report nsa-diag-runs/<run>":
        assert (made["nsa-diag run"] / "report.md").is_file()
    if example in ("nsa-diag run", "nsa-diag watch -- python train.py", "nsa-diag matrix my-cases.yaml"):
        assert "1 pass (all ok)" in out, out
