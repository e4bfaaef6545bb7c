"""JUnit XML of a run's case results, for CI systems (`--junit FILE` on every case command and `matrix`).

One ``<testsuite>`` named after the command (or matrix), one ``<testcase>`` per case result:

- verdict ``pass``: an empty test case (ok);
- ``skipped``: ``<skipped message=reason>`` (e.g. no GPU here);
- anything else (hang, slow, oom, crash, error, nonfinite, grad-missing, mismatch, unchecked): ``<failure
  type=verdict message=reason>`` whose body says where the worker was, the hang kind, why it was judged
  a hang, and the result's exit code or signal.

``unchecked`` (the case ran, the check it was asked for did not: a reference that would not fit) is a
failure, not ``<skipped>``: CI systems count skipped tests as green, and the run exits 1 for it; the XML
must not read as passing where the exit code does not. ``<skipped>`` stays for a case that could not
start here at all (no GPU), which is the same on every run of that machine.

Where a case is judged against an expectation (`selftest`'s injected faults, a matrix case's ``expect``),
`ok` maps its name to the judgement and `expected` to what was expected ("hang / python-deadlock"): an
expected failure is then a passing test case whose ``<system-out>`` says what was expected and what the case
ended as, and a missed expectation a ``<failure type="unexpected-...">``.

`junit_xml` only builds the text; `write_junit` writes it through `artifacts.write_text` (atomic).
"""

from __future__ import annotations

import re
import socket
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path

from nsa_diag.spec import CaseResult

# XML 1.0 allows neither most control characters nor lone surrogates, which worker output may carry.
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _clean(text: object) -> str:
    return _INVALID_XML.sub("?", str(text))


def _failure_body(result: CaseResult) -> str:
    lines = [f"verdict: {result.verdict}", f"reason: {result.reason}"]
    nonfinite = result.nonfinite
    if nonfinite is not None and nonfinite.module:
        lines.append(f"first non-finite: {nonfinite.module} ({nonfinite.where or '?'})")
    if result.where is not None and result.where.phase != "done":  # done: the worker finished its run
        lines.append(f"where: {result.where.describe()}")
    if result.hang_kind is not None:
        lines.append(f"hang_kind: {result.hang_kind}")
    if result.stall_reason:
        lines.append(f"stall: {result.stall_reason}")
    if result.exit_code is not None:
        lines.append(f"exit_code: {result.exit_code}")
    if result.signal:
        lines.append(f"signal: {result.signal}")
    if result.steps_done:
        lines.append(f"steps_done: {result.steps_done}")
    if result.device:
        lines.append(f"device: {result.device}")
    return "\n".join(lines) + "\n"


def _outcome(result: CaseResult, ok: Mapping[str, bool]) -> str:
    """ "ok", "skipped", "failure" (an unexpected verdict) or "unexpected" (an expected verdict missed)."""
    judged = ok.get(result.name)
    if result.verdict == "skipped" and judged is not False:
        return "skipped"
    if judged is None:  # unchecked included: a failure (see the module docstring)
        return "ok" if result.verdict == "pass" else "failure"
    if judged:
        return "ok"
    return "failure" if result.verdict != "pass" else "unexpected"


def junit_xml(
    suite: str,
    results: Sequence[CaseResult],
    *,
    elapsed_s: float | None = None,
    ok: Mapping[str, bool] | None = None,
    expected: Mapping[str, str] | None = None,
) -> str:
    """The JUnit XML text of `results` as the test suite `suite`.

    `elapsed_s` is the wall time of the whole run; None: the sum of the cases' times. `ok`: by case name,
    whether a case met its expectation, for cases judged against one (default: ok means verdict pass);
    `expected`: by case name, what it was expected to end as.
    """
    ok, expected = ok or {}, expected or {}
    outcomes = {r.name: _outcome(r, ok) for r in results}
    failures = sum(1 for o in outcomes.values() if o in ("failure", "unexpected"))
    skipped = sum(1 for o in outcomes.values() if o == "skipped")
    total = sum(r.elapsed_s for r in results) if elapsed_s is None else elapsed_s
    root = ET.Element("testsuites", name="nsa-diag", tests=str(len(results)), failures=str(failures))
    root.set("errors", "0")
    root.set("time", f"{total:.3f}")
    node = ET.SubElement(
        root,
        "testsuite",
        name=_clean(suite),
        tests=str(len(results)),
        failures=str(failures),
        errors="0",
        skipped=str(skipped),
        time=f"{total:.3f}",
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
        hostname=_clean(socket.gethostname()),
    )
    for result in results:
        name, seconds = _clean(result.name), f"{result.elapsed_s:.3f}"
        case = ET.SubElement(node, "testcase", name=name, classname=_clean(suite), time=seconds)
        outcome = outcomes[result.name]
        if outcome == "ok":
            if result.verdict != "pass":  # an expected failure
                said = f"expected {expected.get(result.name, result.verdict)}; got"
                ET.SubElement(case, "system-out").text = _clean(f"{said}:\n{_failure_body(result)}")
            continue
        if outcome == "skipped":
            ET.SubElement(case, "skipped", message=_clean(result.reason))
            continue
        kind = result.verdict if outcome == "failure" else f"unexpected-{result.verdict}"
        failure = ET.SubElement(case, "failure", type=kind, message=_clean(result.reason))
        failure.text = _clean(_failure_body(result))
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(
    path: Path,
    suite: str,
    results: Sequence[CaseResult],
    *,
    elapsed_s: float | None = None,
    ok: Mapping[str, bool] | None = None,
    expected: Mapping[str, str] | None = None,
) -> Path:
    """Write `junit_xml(suite, results, ...)` to `path` (atomically; parent folders are created)."""
    from nsa_diag import artifacts

    text = junit_xml(suite, results, elapsed_s=elapsed_s, ok=ok, expected=expected)
    return artifacts.write_text(Path(path), text)
