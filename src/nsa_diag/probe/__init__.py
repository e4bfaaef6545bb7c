"""The light probe: what nsa-diag puts into a process of a user's job to report its progress (stdlib and
torch only), and the small public API a user may call to mark steps, phases and losses.

``nsa-diag watch -- CMD`` gives every Python process of the job the probe at start-up, with no change to
the user's code: the job's environment has ``NSA_DIAG_PROBE_DIR=<folder>`` and `SITE_DIR` (this package's
``site/``, holding a ``sitecustomize`` that chains to the user's own) on its ``PYTHONPATH``. Each probed
process then writes into ``<folder>/pid-<pid>/`` (`nsa_diag.probe.runtime`): ``probe.json``, the progress
beacon ``beacon.bin`` (`nsa_diag.beacon`, heartbeat thread ticking) and, on SIGUSR1, faulthandler's
dump of every thread into ``stacks.txt``. Once the job imports torch, hooks on the model's blocks and a
global optimizer-step hook report "step 5, backward, layers.7" (`nsa_diag.probe.hooks`).

The public API, for a user who wants more than the hooks see; every call is a no-op outside ``watch``::

    import nsa_diag.probe as probe

    probe.total_steps(1000)  # the ETA of a slow job
    for i, batch in enumerate(loader, start=1):
        probe.step(i)  # steps as the job counts them (else: optimizer steps)
        ...
        probe.loss(loss)  # a non-finite loss makes the verdict nonfinite
    probe.phase("eval")

Importing this module imports nothing heavy (the standard library and the beacon); `hooks` imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nsa_diag.probe import runtime
from nsa_diag.wire import BRANCHES_ENV, PROBE_DIR_ENV

# The folder holding the probe's sitecustomize: put it on a job's PYTHONPATH with NSA_DIAG_PROBE_DIR set.
SITE_DIR = str(Path(__file__).resolve().parent / "site")

__all__ = ["BRANCHES_ENV", "PROBE_DIR_ENV", "SITE_DIR", "active", "loss", "phase", "step", "total_steps"]


def active() -> bool:
    """Whether this process runs under the probe (``nsa-diag watch``)."""
    return runtime.current() is not None


def step(number: int) -> None:
    """Step ``number`` (as the job counts them) begins; the one before it ended. From the first call on,
    optimizer steps no longer advance the probe's step counter."""
    probe = runtime.current()
    if probe is not None:
        probe.sink.explicit_step(int(number))


def phase(name: str) -> None:
    """The job enters phase ``name`` ("eval", "checkpoint", "data", ...): progress reads "in eval"."""
    probe = runtime.current()
    if probe is not None:
        probe.sink.user_phase(str(name))


def loss(value: Any) -> None:
    """The step's loss (a float or a one-element tensor: its ``.item()`` is taken, which waits for the
    GPU). A non-finite value is recorded with its step (``nonfinite.json``): the verdict is nonfinite."""
    probe = runtime.current()
    if probe is not None:
        probe.record_loss(value)


def total_steps(n: int) -> None:
    """How many steps the job will run: a slow job's verdict then gives its ETA."""
    probe = runtime.current()
    if probe is not None:
        probe.set_total_steps(int(n))
