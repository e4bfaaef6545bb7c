"""--minimize and --triage: the search and the classification on made-up outcomes, then real runs.

The minimizer and the triage take the function that runs a trial as an argument, so their logic is tested
here with a stand-in that answers from the trial's spec. The real runs: an injected crash minimized on the
tiny CPU model, whose printed command is then run and must still fail the same way (about 30 s); and an
injected out-of-memory on the CPU, triaged without reruns (about 8 s).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
from diag_cli import run_cli

from nsa_diag._cli_utils import CaseOptions
from nsa_diag.analysis.minimize import (
    Minimizer,
    Target,
    candidate,
    layer_floor,
    minimize_case,
    reproduce_argv,
    shape,
)
from nsa_diag.analysis.triage import (
    classify_oom,
    combine_alloc_conf,
    measure,
    parse_oom_message,
    variant_specs,
)
from nsa_diag.cases import build_spec
from nsa_diag.session.followups import triage_case
from nsa_diag.spec import CaseResult, CaseSpec

CLI_TIMEOUT_S = 300
GIB = 2**30


def nsa_diag(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=cwd, timeout=CLI_TIMEOUT_S)


def _result(spec: CaseSpec, verdict: str, hang_kind: str | None = None, **fields: object) -> CaseResult:
    return CaseResult(name=spec.name, spec_hash=spec.spec_hash(), verdict=verdict, reason=verdict,
                      hang_kind=hang_kind, **fields)  # type: ignore[arg-type]  # fmt: skip


# --- minimize: the search --------------------------------------------------------------------------------


def _fails_when(spec: CaseSpec) -> CaseResult:
    """Stand-in trial: NaN when there are 2+ layers, S >= 20, and the selection branch runs."""
    s = shape(spec)
    bad = s["layers"] >= 2 and s["seq_len"] >= 20 and s["branch"] in ("all", "sel")
    return _result(spec, "nonfinite" if bad else "pass")


def test_minimizer_shrinks_each_dimension_and_keeps_injections_valid() -> None:
    start = build_spec(
        CaseOptions(layers=4, seq_len=128, batch=3, steps=2, inject=("nan:layer=2,step=1",)), name="case"
    )
    tried: list[CaseSpec] = []

    def run_trial(spec: CaseSpec) -> CaseResult:
        tried.append(spec)
        return _fails_when(spec)

    smallest = Minimizer(start, Target("nonfinite"), run_trial).run()
    end = shape(smallest)
    assert end["layers"] == 3  # the injection sits on layer 2: never fewer than 3 layers
    assert 20 <= end["seq_len"] <= 20 + 128 // 8  # bisected to within an eighth of the start
    assert (end["batch"], end["steps"], end["branch"]) == (1, 1, "sel")  # cmp alone passes; sel reproduces
    assert all(shape(spec)["layers"] >= 3 for spec in tried)
    assert all(str(spec.inject[0]) == "nan:layer=2" for spec in tried)
    assert len({spec.name for spec in tried}) == len(tried)  # one folder per trial


def test_minimizer_limits_and_floors() -> None:
    spec = build_spec(CaseOptions(layers=4, gc="0:3", seq_len=64), name="case")
    assert layer_floor(spec) == 3  # the checkpointed range 0:3 needs 3 layers
    injected = build_spec(CaseOptions(layers=3, inject=("deadlock:layer=2",), stall=5), name="case")
    assert "layers are 0..0" in str(candidate(injected, "t", layers=1))
    assert isinstance(candidate(injected, "t", layers=3, seq_len=8), CaseSpec)

    runs: list[str] = []
    limited = Minimizer(
        spec, Target("hang", "python-deadlock"), lambda s: runs.append(s.name) or _result(s, "pass")
    )
    limited.max_trials = 2
    assert limited.run() is spec  # nothing reproduced: the start stands
    assert len(runs) == 2
    assert limited.stopped == "stopped after 2 trials (the limit)"

    other_kind = _result(spec, "hang", "python-busy")
    assert not Target("hang", "python-deadlock").met_by(other_kind)
    assert Target.of(_result(spec, "crash")).describe() == "crash"


def test_minimize_case_record_and_interrupt() -> None:
    start = build_spec(CaseOptions(layers=3, seq_len=64, batch=2), name="case")
    calls = 0

    def run_trial(spec: CaseSpec) -> CaseResult:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return _fails_when(spec)

    record = minimize_case(start, _result(start, "nonfinite"), run_trial, name="case-min")
    assert record["interrupted"]
    assert record["stopped"] == "interrupted"
    assert record["runs"] == 3
    assert record["trials"][-1]["reason"] == "interrupted while it ran"
    assert record["smallest"]["layers"] == 2  # found before the interrupt
    assert record["command"].startswith("nsa-diag run --name case-min --preset tiny --layers 2 ")
    assert shlex.split(record["command"]) == record["argv"]


def test_reproduce_argv_for_runs_and_verify_properties() -> None:
    spec = build_spec(CaseOptions(layers=3, seq_len=32, inject=("nan:layer=1",)), name="x")
    argv = reproduce_argv(spec)
    assert argv[:4] == ["nsa-diag", "run", "--name", "x"]
    assert "--out" not in argv
    assert argv[argv.index("--inject") + 1] == "nan:layer=1"
    check = build_spec(CaseOptions(seq_len=83, batch=1), name="gc", check="gc", stall=120.0)
    argv = reproduce_argv(check, Path("/tmp/r"))
    assert argv[:4] == ["nsa-diag", "verify", "--only", "gc"]
    assert "--name" not in argv
    assert "--steps" not in argv
    assert argv[-2:] == ["--out", "/tmp/r"]


# --- triage: the classification ---------------------------------------------------------------------------

CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "1.06 GiB is free. Process 4242 has 12.00 GiB memory in use. Including non-PyTorch memory, this process "
    "has 66.10 GiB memory in use. Of the allocated memory 60.30 GiB is allocated by PyTorch, and 5.29 GiB is "
    "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)


def test_parse_cuda_and_cpu_oom_messages() -> None:
    facts = parse_oom_message(CUDA_OOM)
    assert facts["source"] == "cuda-caching-allocator"
    assert facts["requested_bytes"] == 2 * GIB
    assert facts["total_bytes"] == int(79.19 * GIB)
    assert facts["free_bytes"] == int(1.06 * GIB)
    assert facts["allocated_bytes"] == int(60.30 * GIB)
    assert facts["reserved_unallocated_bytes"] == int(5.29 * GIB)
    assert facts["other_processes"] == {4242: 12 * GIB}
    cpu = parse_oom_message("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes.")
    assert cpu == {"source": "cpu-allocator", "requested_bytes": 4096}
    assert parse_oom_message("something else") == {"source": "unknown"}


def test_an_inexpressible_cuda_request_is_capacity_against_the_nvml_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11 on an H100 says only "Tried to allocate more than 1EB memory." (seen with --inject oom)."""
    import nsa_diag.evidence.gpu as gpu

    message = "CUDA out of memory. Tried to allocate more than 1EB memory."
    facts = parse_oom_message(message)
    assert facts["requested_bytes"] == 2**60
    assert facts["requested_is_lower_bound"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(
        gpu, "nvml_snapshot", lambda: {"gpus": [{"index": 0, "memory_total_bytes": 80 * GIB}]}
    )
    (tmp_path / "worker_result.json").write_text(json.dumps({"exception": {"message": message}}))
    spec = build_spec(CaseOptions(inject=("oom",)), name="oom")
    record = triage_case(spec, _result(spec, "oom", device="cuda:0"), tmp_path, lambda t: _result(t, "oom"))
    assert record["class"] == "capacity"
    assert (
        record["why"] == "the request alone (more than 1.00 EiB) is more than the device's total (80.00 GiB)"
    )
    assert [r["verdict"] for r in record["reruns"]] == ["oom", "oom"]


def _figures(req: float, free: float, alloc: float, unalloc: float) -> dict[str, object]:
    """The figures at the failure of a CUDA out-of-memory message on an 80 GiB card (sizes in GiB)."""
    message = (
        f"CUDA out of memory. Tried to allocate {req:.2f} GiB. GPU 0 has a total capacity of 80.00 GiB of "
        f"which {free:.2f} GiB is free. Of the allocated memory {alloc:.2f} GiB is allocated by PyTorch, and "
        f"{unalloc:.2f} GiB is reserved by PyTorch but unallocated."
    )
    return measure(parse_oom_message(message), _result(build_spec(CaseOptions(), name="c"), "oom"))


PASSES = [{"verdict": "pass", "alloc_conf": "expandable_segments:True"}]
FAILS = [{"verdict": "oom", "alloc_conf": "expandable_segments:True"}]


@pytest.mark.parametrize(
    ("figures", "reruns", "expected"),
    [
        pytest.param((2, 1, 70, 1), PASSES, "fragmentation", id="passes-with-setting"),
        pytest.param((2, 1, 70, 6), [], "fragmentation", id="reserved-unallocated"),
        pytest.param((2, 1, 55, 1), [], "outside-pytorch", id="outside"),
        pytest.param((6, 1, 73, 1), FAILS, "capacity", id="near-total"),
        pytest.param((100, 10, 1, 0), [], "capacity", id="request-over-total"),
    ],
)
def test_classify_oom(figures: tuple[float, ...], reruns: list[dict[str, str]], expected: str) -> None:
    kind, why = classify_oom("cuda", _figures(*figures), reruns)
    assert kind == expected, why


def test_classify_oom_without_numbers() -> None:
    spec = build_spec(CaseOptions(), name="c")
    figures = measure(parse_oom_message("out of memory somewhere"), _result(spec, "oom"))
    kind, why = classify_oom("cuda", figures, [])
    assert kind == "undetermined"
    assert "gave no numbers" in why
    kind, _ = classify_oom("cuda", figures, FAILS)
    assert kind == "capacity"  # every allocator setting fails too


def test_alloc_conf_variants() -> None:
    assert combine_alloc_conf(None, "expandable_segments", "True") == "expandable_segments:True"
    assert combine_alloc_conf("max_split_size_mb:512", "max_split_size_mb", "128") == "max_split_size_mb:128"
    assert combine_alloc_conf("garbage_collection_threshold:0.6", "max_split_size_mb", "128") == (
        "garbage_collection_threshold:0.6,max_split_size_mb:128"
    )
    assert combine_alloc_conf("expandable_segments:True", "expandable_segments", "True") is None
    spec = build_spec(CaseOptions(alloc_conf="expandable_segments:True"), name="c")
    (expandable, split) = variant_specs(spec)
    assert expandable[2] is None  # already set: nothing to rerun
    assert split[2] is not None
    assert split[2].alloc_conf == "expandable_segments:True,max_split_size_mb:128"


def test_triage_case_cuda_path_with_reruns(tmp_path: Path) -> None:
    spec = build_spec(CaseOptions(alloc_conf="garbage_collection_threshold:0.6"), name="big")
    (tmp_path / "worker_result.json").write_text(json.dumps({"exception": {"message": CUDA_OOM}}))
    oom = _result(spec, "oom", device="cuda:0")
    seen: list[CaseSpec] = []

    def run_trial(trial: CaseSpec) -> CaseResult:
        seen.append(trial)
        return _result(trial, "pass" if "expandable_segments:True" in str(trial.alloc_conf) else "oom")

    record = triage_case(spec, oom, tmp_path, run_trial)
    assert [t.name for t in seen] == ["expandable-segments", "max-split-128mb"]
    assert seen[0].alloc_conf == "garbage_collection_threshold:0.6,expandable_segments:True"
    assert record["class"] == "fragmentation"
    assert "expandable_segments:True" in record["why"]
    assert [r["verdict"] for r in record["reruns"]] == ["pass", "oom"]
    assert record["figures"]["outside_pytorch_bytes"] == pytest.approx(
        (79.19 - 1.06 - 60.30 - 5.29) * GIB, rel=1e-3
    )


# --- real runs --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_minimize_an_injected_crash_prints_a_smaller_command_that_still_fails(tmp_path: Path) -> None:
    proc = nsa_diag(
        "run", "--layers", "3", "--seq-len", "16", "--batch", "2", "--inject", "exit:layer=1",
        "--stall", "60", "--minimize", "--out", str(tmp_path / "runs"), "--json",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["cases"][0]["verdict"] == "crash"
    (record,) = summary["minimize"]
    assert record["target"] == "crash"
    assert record["reduced"]
    assert record["start"] == {"layers": 3, "seq_len": 16, "batch": 2, "steps": 1, "branch": "all"}
    # the fault fires whatever the shape: each dimension drops to its floor at the first try
    assert record["smallest"] == {"layers": 2, "seq_len": 2, "batch": 1, "steps": 1, "branch": "cmp"}
    assert record["runs"] == 4
    assert "smallest reproducing command: nsa-diag run" in proc.stderr
    run_dir = Path(summary["run_dir"])
    for trial in record["trials"]:
        if trial["ran"]:
            assert (run_dir / "minimize" / "case" / trial["name"] / "result.json").is_file()
    assert (run_dir / "minimize" / "case" / "reproduce.sh").is_file()
    assert "## Minimized" in (run_dir / "summary.md").read_text()

    argv = shlex.split(record["command"])
    assert argv[0] == "nsa-diag"
    again = nsa_diag(*argv[1:], "--out", str(tmp_path / "again"), "--json", cwd=tmp_path)
    assert again.returncode == 1, again.stderr
    (case,) = json.loads(again.stdout)["cases"]
    assert case["verdict"] == "crash"


def test_triage_an_injected_oom_on_the_cpu(tmp_path: Path) -> None:
    junit = tmp_path / "j.xml"
    proc = nsa_diag(
        "run", "--inject", "oom", "--device", "cpu", "--seq-len", "16", "--batch", "1", "--triage",
        "--junit", str(junit),
        "--out", str(tmp_path / "runs"), "--json",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["cases"][0]["verdict"] == "oom"
    (record,) = summary["triage"]
    assert record["class"] == "capacity"  # 4 EiB: more than any machine has
    assert record["reruns"] == []
    assert "no effect here" in record["note"]
    assert record["figures"]["requested_bytes"] == 1 << 62
    assert not (Path(summary["run_dir"]) / "triage").exists()  # nothing was rerun
    assert 'failure type="oom"' in junit.read_text()
