"""Whether this machine could have a GPU for torch, answered without importing torch.

Importing torch costs seconds of CPU; nsa-diag's own process (the command line, the watchdog) needs it
only to ask torch about a GPU. Without a GPU device node, neither CUDA (``/dev/nvidia0``...) nor ROCm
(``/dev/kfd``) has a device to find, so the answer is known: no.
"""

from __future__ import annotations

import sys
from pathlib import Path


def gpu_device_nodes() -> list[str]:
    """The device nodes of an NVIDIA or AMD GPU on this machine (empty: torch can find no GPU)."""
    nodes = sorted(str(path) for path in Path("/dev").glob("nvidia[0-9]*"))
    return nodes + (["/dev/kfd"] if Path("/dev/kfd").exists() else [])


def worth_asking_torch() -> bool:
    """Whether to import torch to ask about GPUs: it is imported already, or a GPU could answer."""
    return "torch" in sys.modules or bool(gpu_device_nodes())


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch where no GPU device node exists."""
    if not worth_asking_torch():
        return False
    import torch

    return bool(torch.cuda.is_available())
