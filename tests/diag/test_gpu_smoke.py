"""`make gpu-smoke` and its workflow: the parts that can be checked without a GPU.

The smoke itself runs on the GPU machine (closing notes); here: the workflow names the runner, the
triggers and the artifact, the Makefile target exists and runs the script, and without a GPU the script
says so in one line and exits 2, leaving no run folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_workflow_runs_make_gpu_smoke_on_a_gpu_runner_and_keeps_the_runs() -> None:
    workflow = yaml.safe_load((ROOT / ".github/workflows/gpu-smoke.yml").read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads the key `on` as True
    assert {"push", "schedule"} <= set(triggers)
    (job,) = workflow["jobs"].values()
    assert job["runs-on"] == ["self-hosted", "gpu"]
    runs = [step.get("run", "") for step in job["steps"]]
    assert any(run.startswith("make gpu-smoke") for run in runs)
    upload = next(step for step in job["steps"] if step.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()"
    assert upload["with"]["path"].rstrip("/") == job["env"]["GPU_SMOKE_OUT"]


def test_makefile_target_runs_the_script() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "\ngpu-smoke:" in makefile
    assert "scripts/gpu_smoke.sh" in makefile


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine may have a GPU")
def test_without_a_gpu_the_script_exits_2_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_smoke.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_SMOKE_OUT": str(out), "NSA_DIAG": "false"},
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "no GPU" in done.stderr
    assert not out.exists()
