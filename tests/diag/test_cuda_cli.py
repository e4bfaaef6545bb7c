"""On a CUDA device, through the command line as a user runs it (skipped without one): ``--profile``'s
``record_function`` ranges in ``trace.json`` (backward runs in autograd's device thread there, and the
branches run the Triton kernels), and backend parity of a ``--model`` through its NSAAttention modules.

On the GPU machine::

    PYTHONPATH=/tmp/site:$PWD/src python3 -m pytest -q -n 0 -m gpu tests/diag/test_cuda_cli.py
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from diag_cli import run_cli_json


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")]


def trace_ranges(path: Path) -> Counter[str]:
    """How often each user range (``record_function``) occurs in a Chrome trace."""
    events = json.loads(path.read_text())["traceEvents"]
    return Counter(e["name"] for e in events if e.get("cat") == "user_annotation")


def test_profile_trace_has_step_phase_layer_and_branch_ranges_on_cuda(tmp_path: Path) -> None:
    code, summary, stderr = run_cli_json(
        "run", "--device", "cuda", "--profile", "--gc", "0:1", "--steps", "2", "--seq-len", "256",
        "--out", str(tmp_path),
    )  # fmt: skip
    (case,) = summary["cases"]
    assert code == 0, (case["reason"], stderr)
    ranges = trace_ranges(Path(summary["run_dir"]) / case["dir"] / "trace.json")
    once_a_step = ["forward", "backward", "optimizer", "layer 0 forward", "layer 0 recompute",
                   "layer 0 backward", "layer 1 forward", "layer 1 backward"]  # fmt: skip
    once_a_step += [
        f"layer 1 {b} {phase}" for b in ("cmp", "sel", "win") for phase in ("forward", "backward")
    ]
    assert {k: ranges[k] for k in ("step 1", "step 2")} == {"step 1": 1, "step 2": 1}, ranges
    assert {name: ranges[name] for name in once_a_step} == dict.fromkeys(once_a_step, 2), ranges
    assert ranges["layer 1 recompute"] == 0  # --gc 0:1 checkpoints layer 0 alone


def test_backend_parity_of_a_user_model_on_cuda(tmp_path: Path) -> None:
    # every backend of every branch, Triton included, against the reference on the same GPU
    code, summary, stderr = run_cli_json(
        "backend", "--model", "diag_user_model:nsa_lm", "--device", "cuda", "--seq-len", "256",
        "--out", str(tmp_path), timeout=600,
    )  # fmt: skip
    assert code == 0, (stderr, [(c["name"], c["reason"]) for c in summary.get("cases", [])])
    names = {case["name"] for case in summary["cases"]}
    assert {"sel-triton", "cmp-triton", "win-triton"} <= names
    for case in summary["cases"]:
        assert case["parity"]["grad_rel_err_max"] <= case["parity"]["grad_bound"], case["name"]
