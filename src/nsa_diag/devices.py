"""Whether this machine could have a GPU for torch, answered without importing torch.

Importing torch costs seconds of CPU; nsa-diag's own process (the command line, the watchdog) needs it
only to ask torch about a GPU. Without a GPU device node, neither CUDA (``/dev/nvidia0``..., WSL2's
``/dev/dxg``, Jetson's ``/dev/nvhost-ctrl-gpu``) nor ROCm (``/dev/kfd``) has a device to find, so the
answer is known: no.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NVIDIA GPUs (/dev/nvidia0...), WSL2's GPU (/dev/dxg), Jetson's (/dev/nvhost-ctrl-gpu), AMD's (/dev/kfd)
_SINGLE_NODES = ("/dev/dxg", "/dev/nvhost-ctrl-gpu", "/dev/kfd")


def gpu_device_nodes() -> list[str]:
    """The device nodes of a GPU on this machine (empty: torch can find no GPU)."""
    nodes = sorted(str(path) for path in Path("/dev").glob("nvidia[0-9]*"))
    return nodes + [node for node in _SINGLE_NODES if Path(node).exists()]


def worth_asking_torch() -> bool:
    """Whether to import torch to ask about GPUs: it is imported already, or a GPU could answer."""
    return "torch" in sys.modules or bool(gpu_device_nodes())


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch where no GPU device node exists."""
    if not worth_asking_torch():
        return False
    import torch

    return bool(torch.cuda.is_available())
