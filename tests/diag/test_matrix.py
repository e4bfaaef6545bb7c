"""Matrix files and `nsa-diag matrix`: expansion, field-by-field errors, resume, --jobs, --junit.

Loading, expansion and the resume plan are tested in-process on small files written here. The end-to-end
tests run real workers on the tiny CPU model: the shipped cpu-smoke matrix with two jobs at a time and
JUnit, and a matrix interrupted by SIGINT and resumed (finished cases are not run again).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from nsa_diag import artifacts
from nsa_diag.app import run_cli
from nsa_diag.cases import cuda_available
from nsa_diag.errors import EXIT_ABORTED, EXIT_USAGE, UsageError
from nsa_diag.junit import junit_xml
from nsa_diag.matrix import (
    AXIS_KEYS,
    MODEL_KEYS,
    MatrixFileError,
    load_matrix,
    matrix_json_schema,
)
from nsa_diag.session.matrix import (
    expectations,
    finished,
    gpu_slots,
    junit_results,
    make_plan,
)
from nsa_diag.spec import CaseResult, CaseSpec

ROOT = Path(__file__).resolve().parents[2]
MATRICES = ROOT / "src/nsa_diag/matrices"
SRC = ROOT / "src"
CLI_TIMEOUT_S = 300


def write(tmp_path: Path, text: str, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def nsa_diag(*args: str, **kwargs: object) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "COLUMNS": "200",
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "nsa_diag", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        **kwargs,  # type: ignore[arg-type]
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    return proc.returncode, out, err


# --- expansion ----------------------------------------------------------------------------------------------


def test_axes_expand_as_a_product_over_the_defaults_and_entries_on_top(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        defaults: {preset: tiny, layers: 3, batch: 1, device: cpu, tags: [cpu], alloc_conf: "x:1"}
        axes:
          force_branch: [cmp, all]
          seq_len: [32, 64]
        cases:
          - name: hang
            inject: ["deadlock:layer=2"]
            stall: 5
            alloc_conf: null
            expect: {verdict: hang, hang_kind: python-deadlock}
            tags: [fault]
          - name: "sel-{sel_backend}"
            force_branch: sel
            axes: {sel_backend: [masked, packed]}
          - {gc: all, steps: 2}
          - {requires: cuda}
        """,
    )
    m = load_matrix(path)
    names = [c.name for c in m.cases]
    assert names == [
        "branch=cmp-S=32", "branch=cmp-S=64", "branch=all-S=32", "branch=all-S=64",
        "hang", "sel-masked", "sel-packed", "steps=2-gc=all", "case",
    ]  # fmt: skip
    by = {c.name: c for c in m.cases}
    first = by["branch=cmp-S=32"]
    assert first.axes == {"force_branch": "cmp", "seq_len": 32}
    assert first.origin == "axes"
    assert first.spec.overrides == {"layers": 3, "force_branch": "cmp"}
    assert first.spec.seq_len == 32
    assert first.spec.alloc_conf == "x:1"
    assert first.tags == ("cpu",)
    assert by["branch=all-S=64"].spec.overrides["force_branch"] is None  # all: every branch
    hang = by["hang"]
    assert hang.axes == {}
    assert hang.origin == "cases[0]"
    assert hang.tags == ("cpu", "fault")
    assert [str(i) for i in hang.spec.inject] == ["deadlock:layer=2"]
    assert hang.spec.stall == 5
    assert hang.spec.alloc_conf is None  # an explicit null replaces the default
    assert hang.expect is not None
    assert hang.expect.describe() == "hang / python-deadlock"
    assert hang.spec.seq_len == 128  # not set anywhere: the preset's default, as on the command line
    assert by["sel-packed"].spec.overrides == {"layers": 3, "force_branch": "sel", "sel_backend": "packed"}
    assert by["steps=2-gc=all"].spec.steps == 2
    assert by["case"].requires == "cuda"
    assert by["case"].needs_cuda()
    assert m.axes == {
        "force_branch": ["cmp", "all"],
        "seq_len": [32, 64],
        "sel_backend": ["masked", "packed"],
    }
    data = m.to_json()
    assert data["name"] == "m"
    assert data["axes"] == m.axes
    assert data["cases"][0] == {
        "name": "branch=cmp-S=32",
        "tags": ["cpu"],
        "spec_hash": first.spec.spec_hash(),
        "axes": {"force_branch": "cmp", "seq_len": 32},
        "requires": None,
        "expect": None,
    }


def test_cuda_cases_run_triton_where_no_backend_is_named(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        defaults: {preset: tiny, device: cuda}
        cases:
          - {name: plain}
          - {name: masked, sel_backend: masked}
          - {name: cpu, device: cpu}
        """,
    )
    by = {c.name: c for c in load_matrix(path).cases}
    assert by["plain"].spec.overrides == {
        "sel_backend": "triton",
        "cmp_backend": "triton",
        "win_backend": "triton",
    }
    assert by["masked"].spec.overrides == {
        "sel_backend": "masked",
        "cmp_backend": "triton",
        "win_backend": "triton",
    }
    assert by["cpu"].spec.overrides == {}


def test_generated_names_are_folder_safe_unique_and_stable(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        defaults: {seq_len: 32}
        axes:
          alloc_conf: ["expandable_segments:True,max_split_size_mb:64", "expandable_segments:True"]
        cases:
          - {batch: 1}
          - {batch: 1}
          - name: B=1
            steps: 1
        """,
    )
    names = [c.name for c in load_matrix(path).cases]
    assert names == [
        "alloc=expandable_segments_True_max_split_size_mb_64",
        "alloc=expandable_segments_True",
        "B=1.2",  # the given name B=1 keeps its name; generated ones that repeat a name get a suffix
        "B=1.3",
        "B=1",
    ]
    assert names == [c.name for c in load_matrix(path).cases]
    for name in names:
        CaseSpec(name=name)  # the case-name pattern (a folder name)


def test_the_keys_are_the_case_fields_and_the_model_fields() -> None:
    from nsa_core.config import _MODEL_FIELDS, _NSA_FIELDS

    assert set(MODEL_KEYS) == _MODEL_FIELDS | _NSA_FIELDS
    assert set(AXIS_KEYS) == (set(CaseSpec.model_fields) - {"name", "overrides", "ddp", "command"}) | set(
        MODEL_KEYS
    )


# --- a bad file: every problem, field by field, with its line ----------------------------------------------


def test_a_bad_file_lists_every_problem_with_its_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        defaults: {preset: tiny, seq_len: 32}
        axes:
          seq_len: [32, 0]
          bogus: [1]
        cases:
          - name: a
            heads: 3
          - name: a
            inject: ["deadlock:layer=5"]
          - {seq_len: -1, dtype: fp8, batchh: 2}
          - {inject: [bogus]}
          - name: b
            expect: {verdict: hung}
          - {layers: 2, gc: "2:1"}
          - name: "t-{nope}"
            axes: {batch: [1, 2]}
        """,
    )
    with pytest.raises(MatrixFileError) as info:
        load_matrix(path)
    problems = info.value.problems
    expected = [
        f"{path}:3: axes.seq_len[1]: Input should be greater than or equal to 1",
        f"{path}:4: axes.bogus: not a case field, so not an axis",
        f"{path}:6: cases[0]: heads=3 must be divisible by kv_heads=2",
        f"{path}:8: cases[1].name: 'a' is already the name of cases[0]",
        f"{path}:9: cases[1].inject: --inject deadlock:layer=5: layer=5, but the model's layers are 0..1",
        f"{path}:10: cases[2].seq_len: Input should be greater than or equal to 1",
        f"{path}:10: cases[2].dtype: Input should be 'fp32', 'bf16' or 'fp16'",
        f"{path}:10: cases[2].batchh: unknown key (did you mean 'batch'?)",
        f"{path}:11: cases[3].inject[0]: 'bogus': kind: Input should be 'deadlock'",
        f"{path}:13: cases[4].expect.verdict: Input should be 'pass'",
        f"{path}:14: cases[5]: gc='2:1' needs 0 <= A < B <= layers=2",
        f"{path}:15: cases[6].name: template 't-{{nope}}': {{nope}} is not an axis of this entry",
    ]
    assert len(problems) == len(expected), "\n".join(problems)
    for line, start in zip(problems, expected, strict=True):
        assert line.startswith(start), f"{line!r} does not start with {start!r}"


@pytest.mark.parametrize(
    "text, says",
    [
        pytest.param("cases: [{seq_len: 32}\n", "m.yaml:2:1: YAML error: expected ',' or ']'", id="yaml"),
        pytest.param(
            "cases:\n  - {seq_len: 32, seq_len: 64}\n", "m.yaml:2: cases[0].seq_len: duplicate key", id="dup"
        ),
        pytest.param("- 1\n", "a matrix file is a mapping", id="not-a-mapping"),
        pytest.param("name: x\n", "no cases: give axes and/or cases", id="empty"),
        pytest.param(
            "defaults: {stall: -1}\ncases: [{}]\n", "m.yaml:1: defaults.stall: stall -1", id="stall"
        ),
        pytest.param(
            "defaults: {devices: cpu}\n",
            "m.yaml:1: defaults.devices: unknown key (did you mean 'device'",
            id="key",
        ),
        pytest.param(
            "axes: {seq_len: []}\n", "axes.seq_len: List should have at least 1 item", id="empty-axis"
        ),
        pytest.param(
            "cases: [{model: 'no_such_pkg:build'}]\n", "cases[0].model: --model no_such_pkg:build", id="model"
        ),
        pytest.param(
            "cases:\n  - name: t-{sel_backend}\n    axes: {sel_backend: [masked], batch: [1, 2]}\n",
            "the template gives several cases the name 't-masked'",
            id="template-collision",
        ),
    ],
)
def test_bad_files(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(MatrixFileError) as info:
        load_matrix(write(tmp_path, text))
    assert any(says in line for line in info.value.problems), info.value.problems


def test_a_bad_file_from_the_shell_is_exit_2_before_any_folder(tmp_path: Path) -> None:
    path = write(tmp_path, "defaults: {seq_len: 0}\ncases:\n  - {dtype: fp8}\n")
    out = tmp_path / "runs"
    code, stdout, stderr = finish(nsa_diag("matrix", str(path), "--out", str(out)))
    assert code == EXIT_USAGE
    assert stdout == ""
    assert stderr.splitlines() == [
        f"nsa-diag: invalid matrix file {path} (2 problem(s)):",
        f"  {path}:1: defaults.seq_len: Input should be greater than or equal to 1",
        f"  {path}:3: cases[0].dtype: Input should be 'fp32', 'bf16' or 'fp16'",
    ]
    assert not out.exists()
    assert run_cli(["matrix", str(tmp_path / "missing.yaml"), "--out", str(out)]) == EXIT_USAGE
    assert not out.exists()


def _billion_laughs() -> str:
    """549 bytes of YAML whose aliases expand to 10^9 strings."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in itertools.pairwise("abcdefghi"):
        lines.append(f"{name}: &{name} [{','.join([f'*{prev}'] * 10)}]")
    return "\n".join(lines) + "\n"


def _nested(levels: int) -> str:
    return "cases: " + "[" * levels + "]" * levels + "\n"


# The files a reader could block on (a FIFO, /dev/zero) are read by nsa-diag in a subprocess, under its
# time limit; the others in this process (`run_cli`: the same refusal, without the ~3 s of CPU of a
# subprocess's start; test_a_bad_file_from_the_shell_is_exit_2_before_any_folder is the entry point's).
@pytest.mark.parametrize(
    "content, says, shell",
    [
        pytest.param(
            _billion_laughs(), "m.yaml:5: more than 100000 values once its aliases", False, id="laughs"
        ),
        pytest.param(_nested(5000), "m.yaml:1: nested deeper than 32 levels", False, id="nested"),
        pytest.param(
            "cases: &a [*a]\n",
            "m.yaml:1: alias *a is inside its own anchor",
            False,
            id="recursive",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "#" * (1 << 20) + "\n",
            "m.yaml: larger than 1024 KiB",
            False,
            id="large",
            marks=pytest.mark.slow,
        ),
        pytest.param(b"cases: [\xff]\n", "m.yaml: not UTF-8 text", False, id="binary"),
        pytest.param("/dev/zero", "/dev/zero: not a regular file", True, id="dev-zero"),
        pytest.param("fifo", "m.yaml: not a regular file", True, id="fifo"),
        pytest.param("folder", "m.yaml: not a regular file", False, id="folder"),
    ],
)
def test_files_beyond_the_limits_are_refused_in_one_line(
    tmp_path: Path, content: str | bytes, says: str, shell: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.yaml"
    if content == "/dev/zero":
        path = Path(content)
    elif content == "fifo":
        os.mkfifo(path)  # nothing writes to it: reading it would wait forever
    elif content == "folder":
        path.mkdir()
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    if shell:
        code, stdout, stderr = finish(nsa_diag("matrix", str(path), "--dry-run"))
    else:
        code = run_cli(["matrix", str(path), "--dry-run"])
        stdout, stderr = capsys.readouterr()
    assert (code, stdout) == (EXIT_USAGE, "")
    (line,) = stderr.splitlines()
    assert line.startswith("nsa-diag: matrix file ")
    assert says in line


def test_a_name_template_takes_axis_names_only(tmp_path: Path) -> None:
    path = write(tmp_path, "cases: [{name: 'x{sel_backend.nope}', axes: {sel_backend: [masked]}}]\n")
    with pytest.raises(MatrixFileError) as info:
        load_matrix(path)
    assert info.value.problems == [
        f"{path}:1: cases[0].name: template 'x{{sel_backend.nope}}': {{sel_backend.nope}} is not an axis "
        "of this entry"
    ]


# --- the shipped files -------------------------------------------------------------------------------------


def test_every_shipped_matrix_loads_and_the_schema_file_is_current() -> None:
    files = sorted(MATRICES.glob("*.yaml"))
    assert {f.stem for f in files} >= {"backward", "scaling", "production", "cpu-smoke", "gpu-smoke"}
    for path in files:
        m = load_matrix(path)
        assert m.name == path.stem
        assert m.cases
        assert len({c.name for c in m.cases}) == len(m.cases)
        if path.stem != "cpu-smoke":
            assert all(c.needs_cuda() for c in m.cases), path
    smoke = load_matrix(MATRICES / "cpu-smoke.yaml")
    assert all(c.spec.device == "cpu" for c in smoke.cases)
    assert {c.expect.verdict for c in smoke.cases if c.expect} == {"hang", "nonfinite"}
    production = load_matrix(MATRICES / "production.yaml")
    cfg = production.cases[0].spec.nsa_config()
    assert (cfg.layers, cfg.dim, production.cases[0].spec.seq_len) == (12, 768, 2048)
    on_disk = json.loads((MATRICES / "schema.json").read_text())
    assert on_disk == matrix_json_schema(), (
        "regenerate: nsa-diag schema matrix > src/nsa_diag/matrices/schema.json"
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_every_matrix_file_has_a_make_target() -> None:
    for path in MATRICES.glob("*.yaml"):
        done = subprocess.run(
            ["make", "-n", f"matrix-{path.stem}", "MATRIX_ARGS=--jobs 2"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert f"nsa-diag matrix {path.stem} --jobs 2" in done.stdout


def test_help_has_examples_and_loads_no_torch() -> None:
    code = "import sys; from nsa_diag.app import run_cli; run_cli(['matrix', '--help']); "
    code += "print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    assert "Examples" in done.stdout
    assert "nsa-diag matrix cpu-smoke" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_a_shipped_matrix_runs_by_name_and_a_path_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # no matrices/ folder here: the name finds the package's file
    for given in ("cpu-smoke", "cpu-smoke.yaml", "matrices/cpu-smoke.yaml", str(MATRICES / "cpu-smoke.yaml")):
        assert run_cli(["matrix", given, "--dry-run", "--json"]) == 0, given
        assert json.loads(capsys.readouterr().out)["name"] == "cpu-smoke"
    own = write(tmp_path, "defaults: {device: cpu}\ncases: [{name: a}]\n", name="cpu-smoke.yaml")
    assert run_cli(["matrix", own.name, "--dry-run", "--json"]) == 0  # a file that exists comes first
    assert [r["name"] for r in json.loads(capsys.readouterr().out)["cases"]] == ["a"]


def test_list_names_and_describes_each_shipped_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["matrix", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(p.stem for p in MATRICES.glob("*.yaml"))
    smoke = next(line for line in lines if line.startswith("cpu-smoke "))
    assert "two injected faults" in smoke
    assert run_cli(["matrix", "--list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {m["name"] for m in listed} >= {"cpu-smoke", "gpu-smoke", "backward"}
    assert all(m["description"] and "\n" not in m["description"] for m in listed)


def test_an_unknown_matrix_name_is_one_line_naming_the_shipped_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # in process (from a folder without that file): refused before any folder is made, so a subprocess
    # would add only its start-up (the entry point's: test_a_bad_file_from_the_shell_is_exit_2_...)
    monkeypatch.chdir(tmp_path)
    code = run_cli(["matrix", "cpu-smoek", "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    (line,) = err.strip().splitlines()
    assert line.startswith("nsa-diag: matrix cpu-smoek: no such file, and no shipped matrix of that name")
    assert "cpu-smoke" in line
    assert "backward" in line
    assert not (tmp_path / "runs").exists()
    assert run_cli(["matrix"]) == EXIT_USAGE
    assert run_cli(["matrix", "--list", "cpu-smoke"]) == EXIT_USAGE


def test_dry_run_lists_the_cases_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    assert (
        run_cli(["matrix", str(MATRICES / "cpu-smoke.yaml"), "--dry-run", "--json", "--out", str(out)]) == 0
    )
    rows = json.loads(capsys.readouterr().out)["cases"]
    assert [r["name"] for r in rows][:4] == ["cmp", "sel", "win", "all"]
    assert rows[-1]["replay"][:4] == ["nsa-diag", "run", "--name", "nan"]
    assert {r["status"] for r in rows} == {"run"}
    assert not out.exists()
    assert run_cli(["matrix", str(MATRICES / "cpu-smoke.yaml"), "--dry-run", "--only", "fault"]) == 0
    table = capsys.readouterr().out
    assert "deadlock" in table
    assert "nan" in table
    assert "gc-all" not in table


def test_a_memory_snapshot_on_the_cpu_is_named_on_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path, "defaults: {device: cpu}\ncases: [{name: snap, memory_snapshot: true}, {name: b}]\n"
    )
    assert run_cli(["matrix", str(path), "--dry-run"]) == 0
    (note,) = capsys.readouterr().err.splitlines()
    assert note == (
        "nsa-diag: note: case snap: memory_snapshot needs CUDA; it runs on the CPU and writes no "
        "memory_snapshot.pickle"
    )


def test_only_selects_by_tag_or_name() -> None:
    m = load_matrix(MATRICES / "cpu-smoke.yaml")
    assert [c.name for c in m.select(["fault"])] == ["deadlock", "nan"]
    assert [c.name for c in m.select(["gc", "cmp"])] == ["cmp", "gc-all"]
    assert len(m.select([])) == len(m.cases)
    with pytest.raises(UsageError, match="nope is neither a tag nor a case"):
        m.select(["nope"])


# --- resume, GPUs, JUnit (no workers) ----------------------------------------------------------------------


def _result(case_name: str, spec: CaseSpec, verdict: str = "pass", **evidence: str) -> CaseResult:
    return CaseResult(
        name=case_name, spec_hash=spec.spec_hash(), verdict=verdict, reason="r", evidence=evidence
    )  # type: ignore[arg-type]


def test_resume_plan_keeps_only_finished_cases_of_the_same_spec(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        defaults: {device: cpu, seq_len: 32}
        cases: [{name: a}, {name: b}, {name: c}, {name: d}, {name: e, requires: cuda}]
        """,
    )
    m = load_matrix(path)
    a, b, c, d, e = m.cases
    run_dir = tmp_path / "run"
    artifacts.write_json(run_dir / "cases/a/result.json", _result("a", a.spec, "hang"))  # finished
    artifacts.write_json(
        run_dir / "cases/b/result.json", _result("b", b.spec.model_copy(update={"batch": 3}))
    )
    artifacts.write_json(
        run_dir / "cases/c/result.json", _result("c", c.spec, "error", outcome="interrupted")
    )
    plan = make_plan(m.cases, resume_dir=run_dir, cuda=False)
    assert list(plan.done) == ["a"]
    assert plan.stale == ["b", "c"]  # the spec changed; interrupted
    assert plan.skip == {"e": "requires cuda: torch sees no CUDA device here"}
    assert [x.name for x in plan.to_run] == ["b", "c", "d"]
    assert [plan.status(x) for x in m.cases] == [
        "done (hang)", "rerun", "rerun", "run", "skip: requires cuda: torch sees no CUDA device here",
    ]  # fmt: skip
    assert not finished(_result("e", e.spec, "skipped"), e)  # skipped for want of a GPU: run it where one is
    # issue 26: a case whose check did not run (no memory for the reference) is checked again on --resume
    assert not finished(_result("a", a.spec, "unchecked"), a)
    table = expectations(plan)
    assert table is not None
    assert table["e"].verdict == "skipped"
    assert table["a"].verdict == "pass"
    assert expectations(make_plan(m.cases[:4], resume_dir=None, cuda=False)) is None


def test_gpu_slots_follow_cuda_visible_devices() -> None:
    assert gpu_slots(1, None) == []  # one GPU: the cases share it
    assert gpu_slots(4, None) == ["0", "1", "2", "3"]
    assert gpu_slots(2, "3, 5") == ["3", "5"]  # torch's 0 and 1 are the machine's 3 and 5
    assert gpu_slots(2, "GPU-aaaa,GPU-bbbb,GPU-cccc") == ["GPU-aaaa", "GPU-bbbb"]


def test_junit_judges_by_the_expectation() -> None:
    from nsa_diag.cases import Expectation

    spec = CaseSpec()
    results = [
        _result("hang", spec, "hang"),
        _result("missed", spec, "pass"),
        _result("crash", spec, "crash"),
        _result("gpu", spec, "skipped"),
        _result("plain", spec, "pass"),
    ]
    expected = {
        "hang": Expectation("hang", "hang"),
        "missed": Expectation("missed", "hang"),
        "crash": Expectation("crash", "hang"),
        "gpu": Expectation("gpu", "skipped"),
    }
    judged = {r.name: r for r in junit_results(results, expected)}
    assert judged["hang"] == results[0]  # met: kept as it ended; JUnit says what was expected
    assert judged["missed"].verdict == "error"
    assert judged["missed"].reason.startswith("expected hang, got pass")
    assert judged["crash"].verdict == "crash"
    assert judged["crash"].reason.startswith("expected hang, got crash")
    assert judged["gpu"].verdict == "skipped"
    assert judged["plain"].verdict == "pass"
    ok = {"hang": True, "missed": False, "crash": False, "gpu": True}  # RunSummary.judged
    text = {name: exp.describe() for name, exp in expected.items()}
    suite = ET.fromstring(junit_xml("matrix.m", list(judged.values()), ok=ok, expected=text))
    cases = {case.attrib["name"]: case for case in suite.iter("testcase")}
    assert cases["hang"].find("failure") is None
    assert (cases["hang"].findtext("system-out") or "").startswith("expected hang; got:\nverdict: hang\n")
    assert cases["missed"].find("failure").attrib["message"].startswith("expected hang, got pass")  # type: ignore[union-attr]
    assert cases["gpu"].find("skipped") is not None


# --- real runs ----------------------------------------------------------------------------------------------


def _intervals(run_dir: Path) -> list[tuple[float, float]]:
    spans = []
    for case_dir in (run_dir / "cases").iterdir():
        spans.append(((case_dir / "spec.json").stat().st_mtime, (case_dir / "result.json").stat().st_mtime))
    return spans


@pytest.mark.slow
def test_cpu_smoke_passes_two_at_a_time_with_junit(tmp_path: Path) -> None:
    out, junit = tmp_path / "runs", tmp_path / "reports" / "smoke.xml"
    code, stdout, stderr = finish(
        nsa_diag(
            "matrix",
            str(MATRICES / "cpu-smoke.yaml"),
            "--jobs",
            "2",
            "--junit",
            str(junit),
            "--out",
            str(out),
        )
    )
    assert code == 0, stdout + stderr
    (run_dir,) = out.iterdir()
    assert run_dir.name.endswith("-matrix-cpu-smoke")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"]
    assert summary["command"] == "matrix"
    assert summary["matrix"]["jobs"] == 2
    verdicts = {case["name"]: case["verdict"] for case in summary["cases"]}
    assert verdicts == {
        "cmp": "pass", "sel": "pass", "win": "pass", "all": "pass", "sel-gather-parity": "pass",
        "gc-all": "pass", "prefill-sequential": "pass", "deadlock": "hang", "nan": "nonfinite",
    }  # fmt: skip
    matrix_json = json.loads((run_dir / "matrix.json").read_text())
    assert matrix_json["name"] == "cpu-smoke"
    assert matrix_json["axes"] == {"force_branch": ["cmp", "sel", "win", "all"]}
    assert [c["name"] for c in matrix_json["cases"]] == list(verdicts)
    for case in matrix_json["cases"]:
        result = json.loads((run_dir / "cases" / case["name"] / "result.json").read_text())
        assert result["spec_hash"] == case["spec_hash"]
    assert (run_dir / "env.json").exists()
    assert (run_dir / "summary.md").exists()
    # two at a time: some cases overlapped
    spans = sorted(_intervals(run_dir))
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans)), spans
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    assert suite.get("name") == "matrix.cpu-smoke"
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("9", "0", "0")
    deadlock = next(case for case in suite.iter("testcase") if case.get("name") == "deadlock")
    assert (deadlock.findtext("system-out") or "").startswith("expected hang / python-deadlock; got:\n")
    assert "2 cases at a time" in stderr
    assert "all ok" in stdout


@pytest.mark.slow
def test_an_interrupted_matrix_resumes_without_rerunning_finished_cases(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        defaults: {preset: tiny, device: cpu, layers: 2, seq_len: 32, batch: 1, timeout: 120}
        cases:
          - name: a
          - name: b
            steps: 4
            inject: ["slow:seconds=1"]
          - name: c
          - name: gpu
            requires: cuda
            device: auto
        """,
        name="resume.yaml",
    )
    out = tmp_path / "runs"
    proc = nsa_diag("matrix", str(path), "--out", str(out))
    deadline = time.monotonic() + CLI_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        started_b = list(out.glob("*/cases/b/spec.json"))
        if started_b and list(out.glob("*/cases/a/result.json")):
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    code, _, stderr = finish(proc)
    assert code == EXIT_ABORTED, stderr
    (run_dir,) = out.iterdir()
    a_result = run_dir / "cases/a/result.json"
    a_mtime = a_result.stat().st_mtime_ns
    assert json.loads(a_result.read_text())["verdict"] == "pass"
    b = json.loads((run_dir / "cases/b/result.json").read_text())
    assert b["verdict"] == "error"
    assert b["evidence"]["outcome"] == "interrupted"
    assert not (run_dir / "cases/c").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"]
    assert "c" in summary["not_run"]

    code, stdout, stderr = finish(nsa_diag("matrix", str(path), "--resume", str(run_dir)))
    assert code == 0, stdout + stderr
    assert "1 case(s) already finished in this folder with the same spec: not rerun" in stderr
    assert a_result.stat().st_mtime_ns == a_mtime  # not run again
    summary = json.loads((run_dir / "summary.json").read_text())
    verdicts = {case["name"]: case["verdict"] for case in summary["cases"]}
    assert verdicts == {
        "a": "pass",
        "b": "pass",
        "c": "pass",
        "gpu": "pass" if cuda_available() else "skipped",
    }
    assert summary["matrix"]["not_rerun"] == ["a"]
    assert summary["ok"]
    # b ran again from an empty folder: one run's progress, not two
    setups = [
        line
        for line in (run_dir / "cases/b/progress.jsonl").read_text().splitlines()
        if '"torch imported"' in line
    ]
    assert len(setups) == 1
    assert not list(run_dir.glob("cases/*/.*.json.*")), "no half-written file"
