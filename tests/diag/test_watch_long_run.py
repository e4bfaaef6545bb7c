"""`nsa-diag watch` left on a whole run (issue 48): no time box by default, and nothing grows without bound.

The hang benchmark's long run (benchmarks/hangs/scenarios/long_run.py: 100,000 fast optimizer steps of a
tiny model, a log line every 1,000, longer than the old 300 s box) under `watch` with its defaults: it runs
to its end and passes; the run folder stays small (the probe's step records are capped, the logs too) and
the watcher's memory does not grow with the steps (its RSS sampled every few seconds from /proc). Slow:
five to eight minutes on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from diag_cli import cli_env

SCENARIOS = Path(__file__).resolve().parents[2] / "benchmarks" / "hangs" / "scenarios"
FOLDER_MAX_BYTES = 8 << 20  # progress records and logs of 100,000 steps
RSS_GROWTH_MAX = 32 << 20  # the watcher's RSS from its first minute to its end


def _tree_rss(proc: psutil.Process) -> int:
    """RSS of nsa-diag's own processes (the watcher and its log and guard helpers), not the job's."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            if p.pid == proc.pid or "nsa_diag" in " ".join(p.cmdline()):
                total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_healthy_job_longer_than_the_old_time_box_runs_to_its_end_with_bounded_records(
    tmp_path: Path,
) -> None:
    out = tmp_path / "runs"
    argv = [sys.executable, "-m", "nsa_diag", "watch", "--out", str(out), "--", sys.executable, "long_run.py"]
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=SCENARIOS, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    watcher = psutil.Process(proc.pid)
    samples: list[tuple[float, int]] = []
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            samples.append((time.monotonic() - started, _tree_rss(watcher)))
        time.sleep(5)
    _, err = proc.communicate()
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, err[-3000:]
    assert elapsed > 300, f"the run took {elapsed:.0f} s: not longer than the old 300 s time box"
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    result = json.loads((run / "cases" / "watch" / "result.json").read_text())
    assert result["verdict"] == "pass", result["reason"]
    assert result["timeout_s"] is None
    assert result["steps_done"] == 100_000, result
    size = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
    assert size <= FOLDER_MAX_BYTES, f"run folder {size / 2**20:.1f} MiB"
    after_a_minute = [rss for t, rss in samples if t >= 60]
    assert after_a_minute, samples
    growth = max(after_a_minute) - after_a_minute[0]
    assert growth <= RSS_GROWTH_MAX, (
        f"the watcher's RSS grew {growth / 2**20:.1f} MiB after its first minute "
        f"({after_a_minute[0] / 2**20:.0f} -> {max(after_a_minute) / 2**20:.0f} MiB)"
    )
    print(
        f"long run: {elapsed:.0f} s, folder {size / 2**20:.2f} MiB, watcher RSS "
        f"{after_a_minute[0] / 2**20:.0f} -> {max(after_a_minute) / 2**20:.0f} MiB (max), "
        f"{os.cpu_count()} cores"
    )
