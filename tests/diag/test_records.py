"""The typed records (`nsa_diag.records`) write the JSON of the dicts they replaced, key for key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nsa_diag import artifacts
from nsa_diag.records import StopReport
from nsa_diag.spec import CaseResult, WorkerReport


def test_a_record_writes_the_fields_given_also_null_and_no_other() -> None:
    stop = StopReport(sigterm=True, sigkill=False)
    stop.exit_code = None
    assert stop.model_dump(mode="json") == {"sigterm": True, "sigkill": False, "exit_code": None}
    assert StopReport(started=False).model_dump() == {"started": False}
    assert stop.survivors == []
    assert "survivors" not in stop


def test_a_record_reads_like_its_json() -> None:
    stop = StopReport.model_validate({"sigterm": True, "sigkill": True, "survivors": [12]})
    assert stop["survivors"] == [12]
    assert stop.get("exit_code", "absent") == "absent"
    with pytest.raises(KeyError):
        stop["pid"]
    assert json.loads(stop.model_dump_json()) == {"sigterm": True, "sigkill": True, "survivors": [12]}


def test_a_record_refuses_an_undeclared_key_and_a_wrong_type() -> None:
    with pytest.raises(ValueError, match="survivor"):
        StopReport.model_validate({"survivor": [1]})
    with pytest.raises(ValueError, match="exit_code"):
        StopReport(exit_code="nine")  # type: ignore[arg-type]


# result.json and worker_result.json files that nsa-diag wrote before these records existed (commit 0faa49e,
# on the CPU: run, verify, ddp and watch cases of every verdict they can reach there), paths shortened.
RECORDED = Path(__file__).parent / "recorded" / "results"


@pytest.mark.parametrize(
    "path", sorted(RECORDED.glob("*.result.json")), ids=lambda p: p.name.removesuffix(".result.json")
)
def test_a_result_json_of_before_the_records_reads_and_is_written_back_equal(
    path: Path, tmp_path: Path
) -> None:
    data = json.loads(path.read_text())
    result = CaseResult.model_validate(data)
    artifacts.write_json(tmp_path / "result.json", result)
    assert json.loads((tmp_path / "result.json").read_text()) == data


@pytest.mark.parametrize(
    "path", sorted(RECORDED.glob("*.worker.json")), ids=lambda p: p.name.removesuffix(".worker.json")
)
def test_a_worker_report_of_before_the_records_reads_and_is_written_back_equal(
    path: Path, tmp_path: Path
) -> None:
    data = json.loads(path.read_text())
    report = WorkerReport.model_validate(data)
    artifacts.write_json(tmp_path / "worker_result.json", report)
    assert json.loads((tmp_path / "worker_result.json").read_text()) == data


def test_the_recorded_results_hold_every_record() -> None:
    """The recorded files reach every record of a result (a record they never hold is not checked)."""
    results = [CaseResult.model_validate_json(p.read_text()) for p in RECORDED.glob("*.result.json")]
    assert any(r.parity is not None and r.parity.property for r in results)
    assert any(r.parity is not None and r.parity.loss_rel_err is not None for r in results)
    assert any(r.rate is not None for r in results)
    assert any(r.nonfinite is not None for r in results)
    assert any(r.ddp is not None and r.ddp.stack_diff is not None for r in results)
    assert any(r.evidence.processes for r in results)
    assert any(r.metrics.peak_memory is not None for r in results)
    assert any(r.ddp is not None and r.ddp.buckets for r in results)
    assert any(r.evidence.stop is not None and r.evidence.stop.kept_alive for r in results)
    assert any(r.evidence.rank_exceptions for r in results)
    assert any(r.evidence.outcome == "interrupted" for r in results)
    assert any(r.evidence.ranks for r in results)
