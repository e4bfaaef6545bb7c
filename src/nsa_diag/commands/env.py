"""`nsa-diag env`: print the environment snapshot (`nsa_diag.evidence.env`) as tables or JSON."""

from __future__ import annotations

import typer

from nsa_diag._cli_utils import DebugOpt, JsonOpt


def env(json_output: JsonOpt = False, debug: DebugOpt = False) -> None:
    """Print the environment snapshot (software, GPUs, git revision, NSA/torch/CUDA variables).

    The facts a diagnosis depends on: Python, platform, torch, CUDA, cuDNN, NCCL,
    Triton, the NVIDIA driver and GPUs (through NVML), CPUs, memory, the git revision of the working
    directory, and every `NSA_*`, `TORCH_*`, `NCCL_*`, `CUDA_*`, `PYTORCH_*` and `TRITON_*` variable.
    No other variable is shown, so tokens and passwords stay out. A fact that cannot be had comes with
    the reason.

    Examples:

        nsa-diag env
        nsa-diag env --json > env.json
    """
    from nsa_diag.evidence.env import collect_env
    from nsa_diag.render import print_json, render_env

    snapshot = collect_env(torch_runtime=True)  # asked for: every fact, torch's view of the GPUs too
    if json_output:
        print_json(snapshot)
    else:
        render_env(snapshot)
    raise typer.Exit(0)
