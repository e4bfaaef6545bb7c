"""What the parts of a worker share: the model it built, how a run ends, and the report that becomes.

`CaseFailed` ends a run with a status other than ok (raised anywhere inside it: the training loop, a
correctness check, a DDP rank). `Outcome` is the status and its details while the run is ending;
`worker_report` turns it and the run's measurements into the `WorkerReport` of ``worker_result.json``,
the one place that report is built. `TrainingRun` is what the correctness checks
(`nsa_diag.worker.checks`) use of a trainer, so they need not import the trainer that runs them.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from nsa_diag.records import Metrics, NonFinite, Parity, RankDdp
from nsa_diag.spec import CaseSpec, WorkerException, WorkerReport

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nsa_diag.worker.probes import Progress


class CaseFailed(Exception):
    """Ends the run with a status other than ok (raised inside the loop, turned into the report), with
    what was found (see `Outcome`)."""

    def __init__(
        self,
        status: str,
        reason: str,
        *,
        missing_grads: list[str] | None = None,
        nonfinite: NonFinite | None = None,
        parity: Parity | None = None,
    ) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason
        self.missing_grads, self.nonfinite, self.parity = list(missing_grads or []), nonfinite, parity


@dataclass
class Outcome:
    """How a run ended: ok, or the status the worker found and what it found with it."""

    status: str = "ok"
    reason: str = ""
    exception: WorkerException | None = None
    missing_grads: list[str] = field(default_factory=list)
    nonfinite: NonFinite | None = None
    parity: Parity | None = None

    @classmethod
    def failed(cls, failed: CaseFailed) -> Outcome:
        return cls(
            failed.status,
            failed.reason,
            missing_grads=failed.missing_grads,
            nonfinite=failed.nonfinite,
            parity=failed.parity,
        )


def exception_info(exc: BaseException) -> WorkerException:
    """The exception being handled, with its traceback (call inside the ``except`` block)."""
    return WorkerException(type=type(exc).__name__, message=str(exc), traceback=traceback.format_exc())


def worker_report(
    outcome: Outcome,
    *,
    device: str | None = None,
    steps_done: int = 0,
    metrics: Metrics | None = None,
    ddp: RankDdp | None = None,
) -> WorkerReport:
    """The worker's report of a run: how it ended (``outcome``) and what it measured."""
    return WorkerReport(
        status=outcome.status,
        reason=outcome.reason,
        exception=outcome.exception,
        device=device,
        steps_done=steps_done,
        metrics=metrics or Metrics(),
        missing_grads=list(outcome.missing_grads),
        nonfinite=outcome.nonfinite,
        parity=outcome.parity,
        ddp=ddp,
    )


@dataclass
class LoadedModel:
    """The model of a case and what the worker needs to know about it."""

    model: nn.Module
    prefix: str  # name of the layer list in named_modules() ("blocks" for TinyLM)
    blocks: nn.ModuleList
    vocab: int
    idle: list[str] = field(default_factory=list)  # parameters the configuration leaves without gradient
    cfg: Any = None  # the nsa_core.ModelConfig of the built-in model; None for a user model
    vocab_from: str = "cfg.vocab"  # where the vocabulary size came from (`nsa_diag.worker.contract.vocab_of`)


class TrainingRun(Protocol):
    """What a correctness check uses of the trainer that runs it (`nsa_diag.worker.train.Trainer`)."""

    spec: CaseSpec
    progress: Progress
    device: torch.device | None
    loaded: LoadedModel | None

    def batch(self, step: int) -> torch.Tensor:
        """``[B, S + 1]`` token ids of ``step``, the same whatever else changes."""
        ...
