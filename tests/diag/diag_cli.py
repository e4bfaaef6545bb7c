"""Running `nsa-diag` as a user would, in a subprocess: the one helper the CLI tests share.

The child gets this checkout's `src` (and, for the planted models, `tests/diag`) on PYTHONPATH, a wide
terminal (so tables are not wrapped), no stdin, and a time limit; it never raises on a non-zero exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

    from nsa_diag.spec import CaseSpec, ModelFacts

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SRC = ROOT / "src"


def cli_env(*, planted: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess; `planted` puts tests/diag on the path (diag_planted etc.)."""
    paths = [str(SRC), *([str(HERE)] if planted else []), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "COLUMNS": "200", "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}


def run_cli(
    *args: str | Path,
    cwd: Path | None = None,
    timeout: float = 240,
    planted: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python -m nsa_diag ARGS` to completion: return code, stdout, stderr; `env` adds variables."""
    return subprocess.run(
        [sys.executable, "-m", "nsa_diag", *map(str, args)],
        capture_output=True,
        text=True,
        env=cli_env(planted=planted, **(env or {})),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )


def run_cli_json(*args: str, timeout: float = 240) -> tuple[int, dict[str, Any], str]:
    """`run_cli` with `--json` from the repository root, planted models importable: code, summary, stderr."""
    proc = run_cli(*args, "--json", cwd=ROOT, timeout=timeout, planted=True)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {}, proc.stderr


def preflight_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``--model``'s pre-flight (`nsa_diag.launchers.preflight.model_facts`) built in this process, not in
    its child: the same facts (`nsa_diag.worker.preflight.model_facts`, through their JSON), without the
    child's torch import (~3 s of CPU), for the tests of what a command does with them. The child itself:
    test_user_model's test_a_model_refusal_from_the_command_line, test_processes' daemon of a factory."""
    from nsa_diag.launchers import preflight
    from nsa_diag.spec import ModelFacts
    from nsa_diag.worker.preflight import model_facts

    def in_process(specs: Sequence[CaseSpec], timeout: float | None = None) -> list[ModelFacts]:
        return [ModelFacts.model_validate_json(model_facts(spec).model_dump_json()) for spec in specs]

    monkeypatch.setattr(preflight, "model_facts", in_process)
