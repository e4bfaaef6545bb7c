"""What a case is and what came of it: `CaseSpec`, `Injection`, `WorkerReport` and `CaseResult` (pydantic,
extra="forbid").

A `CaseSpec` is everything a worker needs to run one case; it is written to ``spec.json`` and hashed, so a
finished case can be recognised. A `WorkerReport` is the worker's own account (``worker_result.json``),
written by the worker and read back by the executor. A `CaseResult` is written to ``result.json`` for
every case, whatever happened to the worker. `nsa-diag schema` prints the JSON schema of `CaseSpec`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

Verdict = Literal[
    "pass", "hang", "slow", "oom", "crash", "error", "nonfinite", "grad-missing", "mismatch", "skipped"
]
HangKind = Literal["python-deadlock", "python-busy", "gil-held", "cuda-kernel", "collective", "unknown"]
InjectKind = Literal[
    "deadlock", "busy", "slow", "nan", "oom", "segfault", "abort", "exit",
    "unused-param", "skip-collective", "gil-hog", "gpu-spin",
]  # fmt: skip
Phase = Literal["forward", "backward", "recompute"]
PRESET_NAMES = ("tiny", "small", "m7c-125m")
OverrideValue = int | float | str | bool | None


class Injection(BaseModel):
    """One fault to inject: ``KIND[:key=value,...]`` with keys layer, phase, step, rank, seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: InjectKind
    layer: int = Field(0, ge=0, description="block index the fault is attached to")
    phase: Phase = Field("backward", description="recompute: only when a checkpointed layer re-runs forward")
    step: int = Field(1, ge=1, description="training step (1-based) in which the fault fires")
    rank: int | None = Field(None, ge=0, description="ddp rank; None: every rank")
    seconds: float = Field(1.0, gt=0, description="delay per call for `slow`")

    @classmethod
    def parse(cls, text: str) -> Injection:
        """``"deadlock:layer=1,phase=backward"`` -> `Injection`; ValueError naming the bad part."""
        kind, _, rest = text.strip().partition(":")
        fields: dict[str, Any] = {"kind": kind}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--inject {text!r}: {item!r} must be key=value")
            fields[key.strip()] = value.strip()
        return cls.model_validate(fields)

    def __str__(self) -> str:
        defaults = Injection(kind=self.kind)
        keys = [
            k
            for k in ("layer", "phase", "step", "rank", "seconds")
            if getattr(self, k) != getattr(defaults, k)
        ]
        return self.kind + (":" + ",".join(f"{k}={getattr(self, k)}" for k in keys) if keys else "")


class DdpSpec(BaseModel):
    """How `nsa-diag ddp` runs a case on several ranks through torchrun (`nsa_diag.launchers.torchrun`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nproc: int = Field(2, ge=1, description="ranks per node (torchrun --nproc-per-node)")
    backend: Literal["gloo", "nccl"] = "gloo"
    static_graph: bool = Field(False, description="DistributedDataParallel(static_graph=True)")
    find_unused: bool = Field(False, description="DistributedDataParallel(find_unused_parameters=True)")
    bucket_mb: float | None = Field(None, gt=0, description="bucket_cap_mb; None: DDP's default (25)")
    trace_buckets: bool = Field(False, description="record bucket sizes and dtypes per rank for step 1")
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT; None: 127.0.0.1 and a free port")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @model_validator(mode="after")
    def _node_rank_in_range(self) -> DdpSpec:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank}: must be below nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint HOST:PORT (the same on every node)")
        return self


class CaseSpec(BaseModel):
    """One case: the model, the batch, the run options and the faults to inject."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("case", pattern=r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$", description="case id (folder name)")
    preset: Literal["tiny", "small", "m7c-125m"] = "tiny"
    overrides: dict[str, OverrideValue] = Field(
        default_factory=dict, description="flat nsa_core.preset overrides: layers, dim, sel_backend, gc, ..."
    )
    model: str | None = Field(
        None, description="user model factory 'pkg.module:factory', factory(spec) -> Module"
    )
    seq_len: int = Field(128, ge=1)
    batch: int = Field(2, ge=1)
    steps: int = Field(1, ge=1)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate")
    timeout: float = Field(300.0, gt=0, description="seconds for the whole case; past it with progress: slow")
    stall: float | Literal["auto"] = Field(
        "auto",
        description="seconds without progress that make a hang; auto: from the first step's duration "
        "(nsa_diag.watchdog.stall_limit)",
    )
    inject: tuple[Injection, ...] = ()
    anomaly: bool = False
    launch_blocking: bool = False
    profile: bool = False
    memory_snapshot: bool = False
    alloc_conf: str | None = Field(None, description="PYTORCH_CUDA_ALLOC_CONF for the worker")
    reference_check: bool = Field(False, description="compare loss and gradients with the reference backends")
    tolerance: float | None = Field(
        None, gt=0, description="relative error above which reference_check is a mismatch; None: by dtype"
    )
    check: Literal["backends", "causality", "prefill", "gc"] | None = Field(
        None, description="run this correctness property (nsa-diag verify) instead of training steps"
    )
    # Issue 6: set, the case runs on several ranks through torchrun (nsa_diag.launchers.torchrun).
    ddp: DdpSpec | None = Field(None, description="nsa-diag ddp: ranks, backend and DDP options")

    @property
    def parity_tolerance(self) -> float:
        """Relative-error limit of `reference_check`: given, or by dtype (fp32 1e-4, fp16 1e-2, bf16 5e-2)."""
        return self.tolerance or {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}[self.dtype]

    @field_validator("stall")
    @classmethod
    def _positive_stall(cls, value: float | str) -> float | str:
        if value != "auto" and not value > 0:  # type: ignore[operator]
            raise ValueError(f"stall {value}: must be more than 0 seconds, or auto")
        return value

    @field_validator("overrides")
    @classmethod
    def _known_overrides(cls, value: dict[str, OverrideValue]) -> dict[str, OverrideValue]:
        from nsa_core.config import _MODEL_FIELDS, _NSA_FIELDS

        unknown = sorted(set(value) - _MODEL_FIELDS - _NSA_FIELDS)
        if unknown:
            raise ValueError(f"unknown model field(s) {', '.join(unknown)}")
        return value

    @model_validator(mode="after")
    def _valid_model(self) -> CaseSpec:
        if self.model is None:
            self.nsa_config()  # raises ValueError with the field and the fix
        elif ":" not in self.model:
            raise ValueError(f"model={self.model!r} must be 'pkg.module:factory'")
        return self

    def nsa_config(self) -> Any:
        """The `nsa_core.ModelConfig` of this case (preset plus overrides)."""
        import nsa_core

        return nsa_core.preset(self.preset, **self.overrides)

    def with_overrides(self, **overrides: OverrideValue) -> CaseSpec:
        """A copy with more model overrides (validated)."""
        return CaseSpec.model_validate({**self.model_dump(), "overrides": {**self.overrides, **overrides}})

    def spec_hash(self) -> str:
        """Stable hash of what the case computes (the name excluded), to find finished cases again."""
        # A single-process case hashes as before the ddp field existed (finished cases stay recognised).
        data = self.model_dump(mode="json", exclude={"name"} | ({"ddp"} if self.ddp is None else set()))
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class Where(BaseModel):
    """A location in a training step, as the progress beacon last reported it."""

    model_config = ConfigDict(extra="forbid")

    phase: str | None = None  # setup | forward | backward | recompute | optimizer | step | check | done
    step: int | None = None
    layer: int | None = None
    branch: str | None = None
    module: str | None = None
    event: str | None = None  # begin | end

    def describe(self) -> str:
        """``"layer 1 backward (branch sel) step 1"``-style text."""
        parts = []
        if self.layer is not None:
            parts.append(f"layer {self.layer}")
        if self.phase:
            parts.append(self.phase)
        if self.branch:
            parts.append(f"(branch {self.branch})")
        if self.module and self.layer is None:
            parts.append(f"in {self.module}")
        if self.step is not None:
            parts.append(f"step {self.step}")
        return " ".join(parts) or "unknown"


class WorkerException(BaseModel):
    """The exception that ended a worker's run."""

    model_config = ConfigDict(extra="forbid")

    type: str
    message: str
    traceback: str


class WorkerReport(BaseModel):
    """What the worker reports of its run (``worker_result.json``), built in one place
    (`nsa_diag.worker.outcome.worker_report`) and read back typed by the executor and `classify`.

    A worker that is killed, or ends by a signal or ``os._exit``, leaves none: the executor then judges it
    by its exit status, its stacks and its beacon.
    """

    model_config = ConfigDict(extra="forbid")

    # ok, or the verdict the worker found itself: oom | nonfinite | grad-missing | mismatch | error | skipped
    # (a plain str: `classify` reports a status it does not know rather than dropping the report)
    status: str
    reason: str = ""
    exception: WorkerException | None = None
    device: str | None = None
    steps_done: int = 0
    metrics: dict[str, Any] = Field(default_factory=dict)  # phase times, tokens/s, losses, grad norm, memory
    missing_grads: list[str] = Field(default_factory=list)
    nonfinite: dict[str, Any] | None = None  # {"where": "loss"|"grad", "module": "blocks.1", ...}
    parity: dict[str, Any] | None = None  # reference_check / verify: relative errors and bounds
    # One rank of `nsa-diag ddp`: pre-flight, gradient arrival, parameter hashes, buckets, collectives,
    # DDP's own error (nsa_diag.worker.ddp). Absent from the JSON of a single worker.
    ddp: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_ddp(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.ddp is None:
            data.pop("ddp", None)
        return data


class CaseResult(BaseModel):
    """What came of a case; ``result.json``."""

    model_config = ConfigDict(extra="forbid")

    name: str
    spec_hash: str
    verdict: Verdict
    reason: str = Field(description="one line saying why this verdict")
    hang_kind: HangKind | None = None
    where: Where | None = None
    elapsed_s: float = 0.0
    stall_limit_s: float | None = None
    stall_reason: str | None = None  # a hang: why it is one (the classifier's evidence)
    stall_limit_reason: str | None = None  # how stall_limit_s came about (--stall N, or auto's measurement)
    timeout_s: float | None = None
    device: str | None = None
    exit_code: int | None = None
    signal: str | None = None
    steps_done: int = 0
    metrics: dict[str, Any] = Field(default_factory=dict)  # phase times, tokens/s, losses, grad norm, memory
    rate: dict[str, Any] | None = None  # slow: progress rate and the estimated time it would need
    missing_grads: list[str] = Field(default_factory=list)
    nonfinite: dict[str, Any] | None = None  # {"where": "loss"|"grad", "module": "blocks.1", ...}
    parity: dict[str, Any] | None = None  # reference_check: relative errors of loss and gradients
    evidence: dict[str, Any] = Field(default_factory=dict)  # cpu%, heartbeat, gpu util, file names
    # nsa-diag ddp (issue 6): per-rank verdicts, missing gradients per rank, minority ranks, first divergent
    # frame, pre-flight, parameter hashes, buckets (nsa_diag.analysis.ranks.aggregate)
    ddp: dict[str, Any] | None = None
    files: list[str] = Field(default_factory=list)  # artifact files of the case folder

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"
