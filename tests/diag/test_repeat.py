"""--repeat and --junit: the statistics of repeated runs, the JUnit XML, and real repeated runs.

The arithmetic (Wilson interval, per-case status, hang timing) is tested on hand-made entries; the
command-line test repeats a real case whose user model hangs in its second build only, so one run of three
hangs: a transient failure with a hang probability of 1/3 (about 21 s on the CPU).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from diag_cli import run_cli

from nsa_diag._cli_utils import CaseOptions
from nsa_diag.analysis.repeat import case_repeats, expand, repeat_name, wilson_interval
from nsa_diag.cases import build_spec
from nsa_diag.junit import junit_xml, write_junit
from nsa_diag.session.followups import hang_timing
from nsa_diag.spec import CaseResult, Where

CLI_TIMEOUT_S = 240


def nsa_diag(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=cwd, timeout=CLI_TIMEOUT_S)


# --- statistics ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [
        pytest.param(0, 3, 0.0, 0.5615, id="0of3"),
        pytest.param(1, 3, 0.0615, 0.7923, id="1of3"),
        pytest.param(3, 3, 0.4385, 1.0, id="3of3"),
        pytest.param(5, 10, 0.2366, 0.7634, id="5of10"),
        pytest.param(0, 0, 0.0, 1.0, id="none"),
    ],
)
def test_wilson_interval(k: int, n: int, low: float, high: float) -> None:
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(low, abs=1e-4)
    assert hi == pytest.approx(high, abs=1e-4)


def test_expand_names_repeats_with_one_spec_hash() -> None:
    specs = [build_spec(CaseOptions(seq_len=32), name="a"), build_spec(CaseOptions(seq_len=64), name="b")]
    runs, base = expand(specs, 3)
    assert [r.name for r in runs] == ["a-r1", "a-r2", "a-r3", "b-r1", "b-r2", "b-r3"]
    assert base == {repeat_name(s, i): s for s in ("a", "b") for i in (1, 2, 3)}
    assert {r.spec_hash() for r in runs[:3]} == {specs[0].spec_hash()}
    same, names = expand(specs, 1)
    assert same == specs
    assert names == {"a": "a", "b": "b"}
    with pytest.raises(ValueError, match="at least 1"):
        expand(specs, 0)


def _entry(
    name: str, verdict: str, ok: bool | None = None, hang_kind: str | None = None
) -> dict[str, object]:
    return {
        "name": name,
        "verdict": verdict,
        "ok": verdict == "pass" if ok is None else ok,
        "hang_kind": hang_kind,
        "reason": f"{verdict} reason",
        "elapsed_s": 2.0,
    }


def test_case_repeats_status_counts_and_hang_probability() -> None:
    entries = [
        _entry("c-r1", "pass"),
        _entry("c-r2", "hang", hang_kind="python-deadlock"),
        _entry("c-r3", "pass"),
    ]
    timings = {"c-r2": {"onset_s": 1.5, "detected_s": 6.5, "step": 2}}
    rep = case_repeats("c", entries, 3, timings)
    assert rep["status"] == "transient"
    assert not rep["ok"]
    assert rep["counts"] == {"pass": 2, "hang": 1}
    assert rep["hang_kinds"] == {"python-deadlock": 1}
    assert rep["hang"]["count"] == 1
    assert rep["hang"]["probability"] == pytest.approx(1 / 3, abs=1e-4)
    assert rep["hang"]["ci95"] == [pytest.approx(0.0615, abs=1e-4), pytest.approx(0.7923, abs=1e-4)]
    assert rep["time_to_hang_s"] == {"min": 6.5, "median": 6.5, "max": 6.5, "n": 1}
    assert rep["hang_steps"] == [2]
    assert rep["failing_runs"] == ["c-r2"]

    assert case_repeats("c", [_entry("c-r1", "pass")] * 2, 2)["status"] == "pass"
    assert case_repeats("c", [_entry("c-r1", "pass")] * 2, 3)["ok"] is False  # a run is missing
    failed = case_repeats("c", [_entry("c-r1", "nonfinite"), _entry("c-r2", "crash")], 2)
    assert failed["status"] == "fail"
    assert failed["counts"] == {"nonfinite": 1, "crash": 1}
    # selftest: an expected hang is ok; ok decides the status, the verdicts are counted as they are
    expected = case_repeats("deadlock", [_entry("d-r1", "hang", ok=True)] * 2, 2)
    assert expected["status"] == "pass"
    assert expected["hang"]["probability"] == 1.0


def test_hang_timing_from_progress(tmp_path: Path) -> None:
    records = [
        {"seq": 1, "t": 100.0, "phase": "setup", "event": "begin"},
        {"seq": 5, "t": 103.0, "phase": "backward", "step": 1, "layer": 1, "event": "begin"},
        {"seq": 5, "t": 103.5, "step": 1, "event": "inject-fired"},  # a note: not progress
    ]
    text = "\n".join(json.dumps(r) for r in records) + '\n{"seq": 6, "t": 1'  # a killed worker's half line
    (tmp_path / "progress.jsonl").write_text(text)
    assert hang_timing(tmp_path, 5.0, step=1) == {"onset_s": 3.0, "detected_s": 8.0, "step": 1}
    assert hang_timing(tmp_path / "missing", 5.0) is None


# --- JUnit ---------------------------------------------------------------------------------------------


def test_junit_xml_verdicts() -> None:
    results = [
        CaseResult(name="ok", spec_hash="h", verdict="pass", reason="1 step(s) done", elapsed_s=1.25),
        CaseResult(
            name="stuck",
            spec_hash="h",
            verdict="hang",
            reason="no progress for 5 s <lock> & \x01",
            hang_kind="python-deadlock",
            where=Where(phase="backward", step=1, layer=1),
            elapsed_s=9.5,
        ),
        CaseResult(name="gpu", spec_hash="h", verdict="skipped", reason="gpu-spin needs CUDA"),
        CaseResult(
            name="nan", spec_hash="h", verdict="nonfinite", reason="NaN", nonfinite={"module": "blocks.0"}
        ),
    ]
    root = ET.fromstring(junit_xml("branch", results, elapsed_s=12.0))
    suite = root.find("testsuite")
    assert suite is not None
    assert suite.attrib | {"timestamp": "", "hostname": ""} == {
        "name": "branch", "tests": "4", "failures": "2", "errors": "0", "skipped": "1", "time": "12.000",
        "timestamp": "", "hostname": "",
    }  # fmt: skip
    cases = {case.attrib["name"]: case for case in suite.iter("testcase")}
    assert cases["ok"].attrib == {"name": "ok", "classname": "branch", "time": "1.250"}
    assert not list(cases["ok"])
    failure = cases["stuck"].find("failure")
    assert failure is not None
    assert failure.attrib["type"] == "hang"
    assert failure.attrib["message"] == "no progress for 5 s <lock> & ?"  # escaped, control char replaced
    assert "where: layer 1 backward step 1" in (failure.text or "")
    assert "hang_kind: python-deadlock" in (failure.text or "")
    skipped = cases["gpu"].find("skipped")
    assert skipped is not None
    assert skipped.attrib["message"] == "gpu-spin needs CUDA"
    nan = cases["nan"].find("failure")
    assert nan is not None
    assert nan.attrib["type"] == "nonfinite"
    assert "blocks.0" in (nan.text or "")


def test_junit_xml_with_expectations() -> None:
    results = [
        CaseResult(name="nan", spec_hash="h", verdict="nonfinite", reason="NaN in blocks.1"),
        CaseResult(name="deadlock", spec_hash="h", verdict="pass", reason="1 step(s) done"),
        CaseResult(name="gpu-spin", spec_hash="h", verdict="skipped", reason="gpu-spin needs CUDA"),
    ]
    ok = {"nan": True, "deadlock": False, "gpu-spin": True}  # selftest: the deadlock went undetected
    expected = {"nan": "nonfinite", "deadlock": "hang / python-deadlock", "gpu-spin": "skipped"}
    suite = ET.fromstring(junit_xml("selftest", results, ok=ok, expected=expected)).find("testsuite")
    assert suite is not None
    assert (suite.attrib["failures"], suite.attrib["skipped"]) == ("1", "1")
    cases = {case.attrib["name"]: case for case in suite.iter("testcase")}
    assert cases["nan"].find("failure") is None
    assert (cases["nan"].findtext("system-out") or "").startswith(
        "expected nonfinite; got:\nverdict: nonfinite"
    )
    missed = cases["deadlock"].find("failure")
    assert missed is not None
    assert missed.attrib["type"] == "unexpected-pass"
    assert cases["gpu-spin"].find("skipped") is not None


def test_write_junit_creates_folders(tmp_path: Path) -> None:
    path = write_junit(tmp_path / "ci" / "out.xml", "run", [])
    root = ET.parse(path).getroot()
    assert root.find("testsuite").attrib["tests"] == "0"  # type: ignore[union-attr]


# --- real runs -------------------------------------------------------------------------------------------

FLAKY_MODEL = '''
"""A user model whose third build hangs in the forward of its layer 1 (a lock taken twice): nsa-diag's
pre-flight builds it once, then each of the three runs."""
import threading
from pathlib import Path

import torch
from torch import nn

COUNT = Path(__file__).with_name("builds.txt")


class Block(nn.Module):
    def __init__(self, hang: bool) -> None:
        super().__init__()
        self.ff = nn.Linear(16, 16)
        self.hang = hang

    def forward(self, x):
        if self.hang:
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()
        return x + self.ff(x)


class FlakyLM(nn.Module):
    def __init__(self, hang: bool) -> None:
        super().__init__()
        self.vocab_size = 32
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList([Block(False), Block(hang)])
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(spec):
    n = int(COUNT.read_text()) + 1 if COUNT.exists() else 1
    COUNT.write_text(str(n))
    return FlakyLM(hang=n == 3)
'''


@pytest.mark.slow
def test_repeat_reports_a_transient_hang(tmp_path: Path) -> None:
    (tmp_path / "flaky_model.py").write_text(textwrap.dedent(FLAKY_MODEL))
    junit = tmp_path / "ci" / "junit.xml"
    proc = nsa_diag(
        "run", "--model", "flaky_model:build", "--seq-len", "16", "--batch", "1", "--stall", "4",
        "--repeat", "3", "--junit", str(junit), "--out", str(tmp_path / "runs"), "--json",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    summary = json.loads(proc.stdout)
    assert [c["name"] for c in summary["cases"]] == ["case-r1", "case-r2", "case-r3"]
    assert [c["verdict"] for c in summary["cases"]] == ["pass", "hang", "pass"]
    run_dir = Path(summary["run_dir"])
    assert all((run_dir / "cases" / f"case-r{i}" / "result.json").is_file() for i in (1, 2, 3))

    repeats = summary["repeats"]
    assert repeats["repeat"] == 3
    assert repeats["transient"] == ["case"]
    (rep,) = repeats["cases"]
    assert rep["status"] == "transient"
    assert rep["counts"] == {"pass": 2, "hang": 1}
    assert rep["hang"]["probability"] == pytest.approx(1 / 3, abs=1e-3)
    assert rep["hang"]["ci95"][0] == pytest.approx(0.0615, abs=1e-3)
    assert rep["hang_kinds"] == {"python-deadlock": 1}
    assert rep["hang_steps"] == [1]
    tth = rep["time_to_hang_s"]
    assert tth["n"] == 1
    assert 4.0 <= tth["min"] < 60.0

    md = (run_dir / "summary.md").read_text()
    assert "## Repeats (3 runs per case)" in md
    assert "transient" in md
    root = ET.parse(junit).getroot()
    cases = list(root.iter("testcase"))
    assert [c.attrib["name"] for c in cases] == ["case-r1", "case-r2", "case-r3"]
    assert [f.attrib["type"] for f in root.iter("failure")] == ["hang"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["run", "--repeat", "0"], "--repeat", id="repeat-0"),
        pytest.param(["run", "--junit", "."], "junit", id="junit-folder"),
        pytest.param(
            ["gc-bisect", "--gc", "all", "--repeat", "2"], "No such option: --repeat", id="gc-bisect"
        ),
        pytest.param(["scale", "--seq-lens", "32", "--repeat", "2"], "No such option: --repeat", id="scale"),
    ],
)
def test_bad_follow_up_options(tmp_path: Path, args: list[str], message: str) -> None:
    proc = nsa_diag(*args, "--out", str(tmp_path / "runs"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert message in lines[0]
    assert not (tmp_path / "runs").exists()
