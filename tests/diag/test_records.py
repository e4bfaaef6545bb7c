"""The typed records (`nsa_diag.records`) write the JSON of the dicts they replaced, key for key."""

from __future__ import annotations

import json

import pytest

from nsa_diag.records import StopReport


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
