"""`make wheel-check`: the built wheel installed into a fresh venv outside the repository, run from other
directories as a new user would (`scripts/wheel_check.sh`: branch, matrix --list, a shipped matrix by
name, a case's replay.sh). About 30 s on a 2-core CPU machine, offline: the venv reuses this Python's
dependencies, so torch is not installed again.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_makefile_target_runs_the_script() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "\nwheel-check:" in makefile
    assert "scripts/wheel_check.sh" in makefile


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="no setuptools to build with")
def test_the_installed_wheel_runs_branch_a_shipped_matrix_and_a_replay(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env |= {"PYTHON": sys.executable, "WHEEL_CHECK_DIR": str(tmp_path / "check")}
    before = {*ROOT.iterdir(), *(ROOT / "src").iterdir()}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts/wheel_check.sh")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert done.stdout.splitlines()[-1].startswith("wheel-check: ok")
    for step in ("build", "install", "branch", "matrix-list", "matrix", "replay"):
        assert f"=== {step}: " in done.stdout
    assert {*ROOT.iterdir(), *(ROOT / "src").iterdir()} == before  # built on a copy: no build/, no egg-info
