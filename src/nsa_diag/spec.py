"""What a case is and what came of it: `CaseSpec`, `Injection`, `WorkerReport` and `CaseResult` (pydantic,
extra="forbid").

A `CaseSpec` is everything a worker needs to run one case; it is written to ``spec.json`` and hashed, so a
finished case can be recognised. A `WorkerReport` is the worker's own account (``worker_result.json``),
written by the worker and read back by the executor. A `CaseResult` is written to ``result.json`` for
every case, whatever happened to the worker. `nsa-diag schema` prints the JSON schema of `CaseSpec`.

Each `CaseSpec` field also declares its case option (an `Opt` in its `Annotated` metadata, or `NotAnOption`),
and `MODEL_OPTIONS` declares the options that become `overrides`: the command line, `build_spec` and
`replay_argv` are derived from these declarations (`nsa_diag.options`). The metadata changes neither
`model_dump` nor the JSON schema.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from nsa_diag.options import (
    Branch,
    CmpBackend,
    CompileBackend,
    Device,
    Dtype,
    FaultKind,
    ModelOpt,
    NotAnOption,
    Opt,
    Prefill,
    Preset,
    SelBackend,
    WinBackend,
    literal_of,
)
from nsa_diag.records import CaseEvidence, DdpResult, Metrics, NonFinite, Parity, RankDdp, Rate

# `unchecked`: the case ran, but a check it was asked to make (a reference check, a correctness property)
# could not run (the reference does not fit, nothing to compare): never a pass, counted apart.
Verdict = Literal[
    "pass",
    "hang",
    "slow",
    "oom",
    "crash",
    "error",
    "nonfinite",
    "grad-missing",
    "mismatch",
    "unchecked",
    "skipped",
]
HangKind = Literal["python-deadlock", "python-busy", "gil-held", "cuda-kernel", "collective", "unknown"]
# an exception whose message has one of these says memory ran out (verdict oom): CUDA's caching allocator
# ("CUDA out of memory"), and torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory")
OOM_MESSAGES = ("out of memory", "can't allocate memory")
InjectKind = literal_of(FaultKind)
Phase = Literal["forward", "backward", "recompute"]
PresetName = literal_of(Preset)
DtypeName = literal_of(Dtype)
DeviceName = literal_of(Device)
CompileName = literal_of(CompileBackend)
OverrideValue = int | float | str | bool | None
# `--model`: a module path, a colon and the factory's name in that module; what the worker imports
MIN_STALL_S = 0.5  # below it a healthy worker, between two beacon writes, already looks stalled
# The worker seeds its batches with seed·1_000_003 + step (nsa_diag.worker.train): that must stay within
# torch.manual_seed's 64 bits.
MAX_SEED = 2**32 - 1
# A case's folder name; the follow-ups add suffixes (-r1000, minimize/ steps) within a file name's 255
MAX_NAME_CHARS = 128
MODEL_REF = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
ATTR_PATH = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$"
# `--model`'s contract, in `run --help` and the README (`nsa_diag.worker.contract` holds the model to it)
MODEL_HELP = (
    "Your own model: factory(spec) -> nn.Module (or factory()), mapping ids [B, S] to logits [B, S, V] "
    "returned as a tensor, a tuple/list (first element) or an object's .logits (Hugging Face). "
    "V: model.vocab_size, model.config.vocab_size, get_input_embeddings(), get_output_embeddings() or "
    "the only nn.Embedding, else --vocab, else the last module's out_features. Layers: model.layers, "
    "model.model.layers, transformer.h, encoder.layer or blocks, else the longest nn.ModuleList of "
    "same-type blocks up to 3 attributes down (else --layers-attr). Model options reach it only through "
    "the spec it reads; NSA options, backend and --reference-check only through the nsa_core "
    "NSAAttention modules it holds."
)


class Injection(BaseModel):
    """One fault to inject: ``KIND[:key=value,...]`` with keys layer, phase, step, rank, seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: InjectKind
    layer: int = Field(0, ge=0, description="block index the fault is attached to")
    phase: Phase = Field("backward", description="recompute: only when a checkpointed layer re-runs forward")
    step: int = Field(1, ge=1, description="training step (1-based) in which the fault fires")
    rank: int | None = Field(None, ge=0, description="ddp rank; None: every rank")
    seconds: float = Field(1.0, gt=0, allow_inf_nan=False, description="delay per call for `slow`")

    @classmethod
    def parse(cls, text: str) -> Injection:
        """``"deadlock:layer=1,phase=backward"`` -> `Injection`; ValueError naming the bad part."""
        kind, _, rest = text.strip().partition(":")
        fields: dict[str, str] = {"kind": kind}
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


# The process group a ddp case trains in: the worker names its collectives by it, the cross-rank diff
# reads them.
TRAIN_GROUP = "train"


_ENDPOINT = re.compile(r"^(?P<host>[A-Za-z0-9_.:\[\]-]+):(?P<port>\d{1,5})$")


def endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with a rendezvous endpoint ``HOST:PORT`` (port 1..65535); None when nothing."""
    match = _ENDPOINT.match(endpoint)
    if match is None:
        return f"{endpoint!r}: expected HOST:PORT"
    if not 1 <= int(match["port"]) <= 65535:
        return f"{endpoint!r}: port {int(match['port'])} is not in 1..65535"
    return None


# A multi-node case: how long the nodes wait for each other by default (node 0 for the others to join its
# rendezvous, the others for node 0 to listen): Slurm starts a job's tasks within seconds of each other,
# but a node's Python and torch import can take a minute on a loaded shared file system.
RDZV_TIMEOUT_S = 120.0
# The endpoint of a case submitted with ``nsa-diag ddp --executor slurm`` until its node 0 chooses one
# (`nsa_diag.session.nodes.node_job`): a spec of several nodes names one, and this one is never dialled.
PENDING_ENDPOINT = "chosen-by-node-0:1"


class DdpSpec(BaseModel):
    """How `nsa-diag ddp` runs a case on several ranks through torchrun (`nsa_diag.launchers.torchrun`)."""

    # Each field's `Opt` is its `nsa-diag ddp` option (`options.DDP` lists them): `cases.build_ddp_spec`
    # checks them, resolves --backend auto and builds the spec's `ddp`; `cases.ddp_flags` writes them back
    # for replay lines. (The docstring is the JSON schema's description: `nsa-diag schema`.)

    model_config = ConfigDict(extra="forbid", frozen=True)

    nproc: Annotated[int, Opt("--nproc", int, "Ranks per node.")] = Field(
        2, ge=1, description="ranks per node (torchrun --nproc-per-node)"
    )
    backend: Annotated[
        Literal["gloo", "nccl"],
        Opt(
            "--backend",
            str,
            "Process-group backend; auto: nccl when the ranks run on CUDA, else gloo.",
            "auto",
            metavar="auto|gloo|nccl",
        ),
    ] = "gloo"
    static_graph: Annotated[bool, Opt("--static-graph", bool, "DDP static_graph=True.")] = Field(
        False, description="DistributedDataParallel(static_graph=True)"
    )
    find_unused: Annotated[bool, Opt("--find-unused", bool, "DDP find_unused_parameters=True.")] = Field(
        False, description="DistributedDataParallel(find_unused_parameters=True)"
    )
    bucket_mb: Annotated[
        float | None, Opt("--bucket-mb", float, "DDP bucket_cap_mb (default 25).", min=0.001)
    ] = Field(None, gt=0, description="bucket_cap_mb; None: DDP's default (25)")
    trace_buckets: Annotated[
        bool, Opt("--trace-buckets", bool, "Record bucket sizes and dtypes per rank for step 1.")
    ] = Field(False, description="record bucket sizes and dtypes per rank for step 1")
    fsdp: Annotated[
        bool,
        Opt(
            "--fsdp",
            bool,
            "FSDP2 instead of DDP: fully_shard every block, then the model (no DDP options; the "
            "parameter hash check does not run: each element lives on one rank).",
        ),
    ] = Field(False, description="torch.distributed.fsdp.fully_shard the blocks and the model instead of DDP")
    # What counts as a straggler (`nsa_diag.analysis.stragglers`): read from the ranks' step times after
    # the run, it changes nothing the case computes.
    straggler_ratio: Annotated[
        float,
        Opt(
            "--straggler-ratio",
            float,
            "Name a rank whose own step time is this many times the other ranks' median in most steps "
            "(the verdict stays the ranks').",
            min=1.0,
            metavar="RATIO",
        ),
    ] = Field(1.25, ge=1.0, allow_inf_nan=False, description="own step time over the others' median")
    nnodes: Annotated[int, Opt("--nnodes", int, "Nodes (run the command on each).")] = Field(1, ge=1)
    node_rank: Annotated[int, Opt("--node-rank", int, "This node's index, 0..nnodes-1.")] = Field(0, ge=0)
    rdzv_endpoint: Annotated[
        str | None,
        Opt(
            "--rdzv-endpoint",
            str,
            "Rendezvous endpoint (several nodes); default 127.0.0.1 and a free port.",
            metavar="HOST:PORT",
        ),
    ] = Field(None, description="HOST:PORT; None: 127.0.0.1 and a free port")
    # How long the nodes wait for each other: node 0's store for the others to join, a node for node 0's
    # store to listen, node 0 for the other nodes' rank results. Not part of what the case computes.
    rdzv_timeout: Annotated[
        float | None,
        Opt(
            "--rdzv-timeout",
            float,
            "Several nodes: how long the nodes wait for each other (node 0 for the others to join, "
            "the others for node 0 to listen, node 0 for their results); default 120.",
            metavar="SECONDS",
        ),
    ] = Field(None, gt=0, description="seconds; None: RDZV_TIMEOUT_S")
    # A multi-node case's id (rendezvous id and run folder name); None: derived alike on every node
    # (`CaseSpec.run_id`). Not part of what the case computes.
    run_id: Annotated[
        str | None,
        Opt(
            "--run-id",
            str,
            "Several nodes: the rendezvous id and run folder `<out>/ddp-<ID>`, the same on every node "
            "(default: the case name and a hash of its options, alike on every node).",
            metavar="ID",
        ),
    ] = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$", max_length=100)

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_and_port(cls, value: str | None) -> str | None:
        problem = None if value is None else endpoint_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def wait_s(self) -> float:
        """How long the nodes of a multi-node case wait for each other (``rdzv_timeout``)."""
        return self.rdzv_timeout if self.rdzv_timeout is not None else RDZV_TIMEOUT_S

    @model_validator(mode="after")
    def _node_rank_in_range(self) -> DdpSpec:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank}: must be below nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint HOST:PORT (the same on every node)")
        ddp_only = [flag for flag, given in (("--static-graph", self.static_graph),
                    ("--find-unused", self.find_unused), ("--bucket-mb", self.bucket_mb is not None),
                    ("--trace-buckets", self.trace_buckets)) if given]  # fmt: skip
        if self.fsdp and ddp_only:
            raise ValueError(f"--fsdp shards with FSDP2, not DDP: {', '.join(ddp_only)} is DDP's option")
        return self


class CommandSpec(BaseModel):
    """A user's own command under `nsa-diag watch` (`nsa_diag.launchers.command`): what runs, where, with
    which environment, and what watch does after the evidence of a stall."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    argv: tuple[str, ...] = Field(min_length=1, description="the command and its arguments, as given")
    cwd: str = Field(description="the directory it runs in (where nsa-diag watch was started)")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="the job's environment as env.json records it (NSA_, TORCH_, NCCL_, CUDA_, ... names; "
        "secret values withheld); the job gets the whole environment",
    )
    keep_alive: bool = Field(
        False, description="after a stall's or timeout's evidence, leave the job running"
    )
    total_steps: int | None = Field(
        None, ge=1, description="steps the job will run, for a slow job's ETA (the job may say it itself)"
    )
    # `--straggler-ratio`, declared on `DdpSpec.straggler_ratio` (watch takes that option): read from the
    # ranks' step times after the run, it changes nothing the job computes
    straggler_ratio: float = Field(
        DdpSpec.model_fields["straggler_ratio"].default,
        ge=1.0,
        allow_inf_nan=False,
        description="a rank's own step time over the other ranks' median that names it a straggler",
    )


def _inject_help() -> str:
    """`--inject`'s help, listing the kinds, phases and key defaults from `FaultKind` and `Injection`."""
    fields = Injection.model_fields
    phase = fields["phase"].default
    phases = "|".join([phase, *(p for p in get_args(Phase) if p != phase)])
    return (
        f"Fault to inject (repeatable): {', '.join(k.value for k in FaultKind)}. Keys: layer (default "
        f"{fields['layer'].default}), phase ({phases}, default {phase}), step (default "
        f"{fields['step'].default}), seconds (slow). E.g. deadlock:layer=1,phase=backward."
    )


def _geometry(flag: str, help: str, minimum: int = 1) -> ModelOpt:
    return ModelOpt(flag, int, help, default=None, min=minimum)


# The case options that become model overrides (`CaseSpec.overrides`, flat `nsa_core.preset` fields), in
# the order they enter `overrides` (and so spec.json and replay.sh).
MODEL_OPTIONS = (
    _geometry("--layers", "Transformer blocks."),
    _geometry("--dim", "Model width."),
    _geometry("--heads", "Query heads."),
    _geometry("--kv-heads", "Key/value heads (GQA groups); must divide --heads."),
    _geometry("--head-dim", "Dimension per head (even, for RoPE)."),
    _geometry(
        "--vocab",
        "Vocabulary size (the logits, and so memory, grow with it). With --model: the model's vocabulary, "
        "where the model does not say it itself.",
    ),
    _geometry("--mlp-hidden", "SwiGLU hidden size."),
    _geometry("--block-len", "Compression block length l."),
    _geometry("--block-stride", "Compression stride d (divides l and l')."),
    _geometry("--sel-block-len", "Selection block length l'."),
    _geometry("--n-sel", "Selected blocks per query, forced ones included."),
    _geometry("--n-init", "Initial blocks always selected.", minimum=0),
    _geometry("--n-local", "Local blocks always selected."),
    _geometry("--window", "Sliding window w."),
    ModelOpt(
        "--sel", SelBackend, "Selection backend (on CUDA: triton unless named).", None, key="sel_backend"
    ),
    ModelOpt(
        "--cmp", CmpBackend, "Compression backend (on CUDA: triton unless named).", None, key="cmp_backend"
    ),
    ModelOpt(
        "--win", WinBackend, "Sliding-window backend (on CUDA: triton unless named).", None, key="win_backend"
    ),
    ModelOpt(
        "--branch",
        Branch,
        "Compute only this branch (force_branch); all: every one.",
        Branch.all,
        key="force_branch",
    ),
    ModelOpt(
        "--prefill", Prefill, "How model(tokens) runs: batched, or token by token through the cache.", None
    ),
    ModelOpt(
        "--gc", str, "Gradient checkpointing: none, all, or layers A..B-1.", None, metavar="none|all|A:B"
    ),
    ModelOpt("--gc-reentrant", bool, "Reentrant checkpointing (use_reentrant=True).", False),
)

_SEQ_LEN_HELP = (
    "Sequence length S. Default: 2·n_sel·l' of the model, at least 2·window (tiny 128, small 512, "
    "m7c-125m 2048), so that selection is sparse and S exceeds the window."
)
_STALL_HELP = (
    "No progress and no work for this long: hang. auto: 120 s until a step (optimizer step to optimizer "
    "step) is measured, then 3x the longest, at least 10 s (a watched job: 60 s); "
    f"SECONDS: at least {MIN_STALL_S:g}."
)


class CaseSpec(BaseModel):
    """One case: the model, the batch, the run options and the faults to inject."""

    # Each field's `Opt` is its case option (`nsa_diag.options`); `overrides` are set by MODEL_OPTIONS.

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[
        str, Opt("--name", str, "Case id: the name of its folder under cases/.", replay="always")
    ] = Field(
        "case",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$",
        max_length=MAX_NAME_CHARS,
        description="case id (folder name)",
    )
    preset: Annotated[PresetName, Opt("--preset", Preset, "Model preset.", replay="always")] = "tiny"
    overrides: Annotated[dict[str, OverrideValue], NotAnOption("the options of MODEL_OPTIONS")] = Field(
        default_factory=dict, description="flat nsa_core.preset overrides: layers, dim, sel_backend, gc, ..."
    )
    model: Annotated[
        str | None,
        Opt(
            "--model",
            str,
            MODEL_HELP,
            metavar="PKG.MODULE:FACTORY",
        ),
    ] = Field(None, description="user model factory 'pkg.module:factory', factory(spec) -> Module")
    layers_attr: Annotated[
        str | None,
        Opt(
            "--layers-attr",
            str,
            "With --model: the attribute holding the model's layers (an nn.ModuleList), e.g. decoder.layers.",
            metavar="NAME",
        ),
    ] = Field(None, pattern=ATTR_PATH, description="--model: dotted attribute of the layer list")
    seq_len: Annotated[int, Opt("--seq-len", int, _SEQ_LEN_HELP, None, min=1, replay="always")] = Field(
        128, ge=1
    )
    batch: Annotated[int, Opt("--batch", int, "Batch size B.", min=1)] = Field(2, ge=1)
    steps: Annotated[
        int, Opt("--steps", int, "Training steps (forward, backward, AdamW step).", min=1, replay="always")
    ] = Field(1, ge=1)
    dtype: Annotated[
        DtypeName, Opt("--dtype", Dtype, "Autocast dtype (fp32 master weights; fp16: GradScaler).")
    ] = "fp32"
    device: Annotated[DeviceName, Opt("--device", Device, "auto: CUDA when available, else CPU.")] = "auto"
    seed: Annotated[
        int, Opt("--seed", int, "Seed of the weights and the random tokens.", min=0, max=MAX_SEED)
    ] = Field(0, ge=0, le=MAX_SEED)
    compile: Annotated[
        CompileName | None,
        Opt(
            "--compile",
            CompileBackend,
            "torch.compile the model with this backend (the training forward and backward; progress comes "
            "from the steps and the compiler, not from inside the compiled graph).",
            metavar="BACKEND",
        ),
    ] = Field(None, description="torch.compile backend of the training model; None: eager")
    lr: Annotated[float, Opt("--lr", float, "AdamW learning rate.")] = Field(
        1e-3, gt=0, allow_inf_nan=False, description="AdamW learning rate"
    )
    timeout: Annotated[
        float | None,
        Opt(
            "--timeout",
            float,
            "A time box: the case ran longer than this while progress continued: slow (with rate and "
            "ETA). `watch` has none unless given: it runs as long as the job does.",
            metavar="SECONDS",
            replay="always",
        ),
    ] = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds for the whole case; past it with progress: slow; None: no time box (watch)",
    )
    # The command line gives the text ("auto" or seconds); `nsa_diag.cases.parse_stall` reads it.
    stall: Annotated[
        float | Literal["auto"], Opt("--stall", str, _STALL_HELP, metavar="auto|SECONDS", replay="always")
    ] = Field(
        "auto",
        description="seconds without progress or work that make a hang; auto: from the steps measured "
        "so far (nsa_diag.watchdog.stall_limit)",
    )
    inject: Annotated[
        tuple[Injection, ...], Opt("--inject", list[str], _inject_help(), (), metavar="KIND[:k=v,...]")
    ] = ()
    anomaly: Annotated[
        bool, Opt("--anomaly", bool, "torch.autograd.set_detect_anomaly(True) in the worker.")
    ] = False
    launch_blocking: Annotated[
        bool, Opt("--launch-blocking", bool, "CUDA_LAUNCH_BLOCKING=1 in the worker.")
    ] = False
    profile: Annotated[
        bool, Opt("--profile", bool, "torch.profiler: Chrome trace (trace.json), memory timeline.")
    ] = False
    memory_snapshot: Annotated[
        bool, Opt("--memory-snapshot", bool, "CUDA memory snapshot (memory_snapshot.pickle) for memory_viz.")
    ] = False
    branch_marks: Annotated[
        bool,
        Opt(
            "--branch-marks",
            bool,
            "Progress names the NSA branch whose backward runs (a mark per branch and step; by default the "
            "blocks alone, which cost less).",
        ),
    ] = False
    alloc_conf: Annotated[
        str | None,
        Opt(
            "--alloc-conf",
            str,
            "PYTORCH_CUDA_ALLOC_CONF for the worker, e.g. expandable_segments:True.",
            metavar="CONF",
        ),
    ] = Field(None, description="PYTORCH_CUDA_ALLOC_CONF for the worker")
    reference_check: Annotated[
        bool,
        Opt(
            "--reference-check",
            bool,
            "Compare loss and gradients at step 1 with the reference backends: mismatch beyond --tolerance.",
        ),
    ] = Field(False, description="compare loss and gradients with the reference backends")
    tolerance: Annotated[
        float | None,
        Opt(
            "--tolerance",
            float,
            "Relative-error limit of --reference-check; by dtype: fp32 1e-4, fp16 1e-2, bf16 5e-2.",
        ),
    ] = Field(
        None, gt=0, description="relative error above which reference_check is a mismatch; None: by dtype"
    )
    check: Annotated[
        Literal["backends", "causality", "prefill", "gc"] | None,
        NotAnOption("nsa-diag verify: one case per property (--only)"),
    ] = Field(None, description="run this correctness property (nsa-diag verify) instead of training steps")
    # Issue 6: set, the case runs on several ranks through torchrun (nsa_diag.launchers.torchrun).
    ddp: Annotated[DdpSpec | None, NotAnOption("nsa-diag ddp: DdpSpec's fields declare its options")] = Field(
        None, description="nsa-diag ddp: ranks, backend and DDP options"
    )

    # Issue 17: set, the case is a user's own command (nsa-diag watch; nsa_diag.launchers.command).
    command: Annotated[CommandSpec | None, NotAnOption("nsa-diag watch: the command after --")] = Field(
        None, description="nsa-diag watch: the user's command, its directory and environment"
    )

    @property
    def parity_tolerance(self) -> float:
        """Relative-error limit of `reference_check`: given, or by dtype (fp32 1e-4, fp16 1e-2, bf16 5e-2)."""
        return self.tolerance or {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}[self.dtype]

    @field_validator("stall")
    @classmethod
    def _positive_stall(cls, value: float | str) -> float | str:
        if value != "auto" and not MIN_STALL_S <= value < math.inf:  # type: ignore[operator]
            raise ValueError(f"stall {value}: must be at least {MIN_STALL_S:g} seconds (and finite), or auto")
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
        elif not MODEL_REF.match(self.model):
            raise ValueError(f"model={self.model!r} must be 'pkg.module:factory' (a function's name)")
        if self.layers_attr is not None and self.model is None:
            raise ValueError("layers_attr: names the layers of a --model; the built-in model's are blocks")
        if self.timeout is None and self.command is None:
            raise ValueError("timeout: give seconds; only watch runs without a time box")
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
        # A single-process case hashes as before the ddp field existed (finished cases stay recognised);
        # so does a case without layers_attr.
        later = {field for field in ("ddp", "layers_attr", "command") if getattr(self, field) is None}
        # the probe's detail changes nothing the case computes
        exclude: dict[str, bool | dict[str, bool]] = {
            "name": True, "branch_marks": True, **dict.fromkeys(later, True)
        }  # fmt: skip
        if self.ddp is not None:  # how long nodes wait, what a straggler is: nothing the case computes
            exclude["ddp"] = {"rdzv_timeout": True, "run_id": True, "straggler_ratio": True}
        if self.command is not None:  # what a straggler is (and a spec.json written before the field)
            exclude["command"] = {"straggler_ratio": True}
        data = self.model_dump(mode="json", exclude=exclude)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def run_id(self) -> str:
        """The id every node of a multi-node case derives alike: the name and a hash of the spec without
        the node's own rank. It names the rendezvous and the shared run folder (`nsa-diag ddp --run-id`)."""
        assert self.ddp is not None
        if self.ddp.run_id is not None:
            return self.ddp.run_id
        data = self.model_dump(
            mode="json", exclude={"ddp": {"node_rank": True, "rdzv_timeout": True, "run_id": True}}
        )
        return f"{self.name}-{hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]}"


class ModelFacts(BaseModel):
    """What the pre-flight of a ``--model`` found by building it and running one forward
    (`nsa_diag.worker.preflight`); the command refuses the options it cannot apply
    (`nsa_diag.cases.check_model_facts`). ``problem``: the contract broken, in one line."""

    model_config = ConfigDict(extra="forbid")

    model: str
    problem: str | None = None
    type: str | None = None  # the model's class
    layers_attr: str | None = None
    layers: int = 0
    vocab: int | None = None
    vocab_from: str | None = None  # BuiltModel.vocab_from
    output: str | None = None  # tensor | tuple | list | .logits
    self_checkpointing: bool = False  # an nsa_core.TinyLM: checkpoints its layers by its config's gc
    nsa_layers: list[int] = Field(default_factory=list)  # layers holding nsa_core NSAAttention modules
    nsa_values: dict[str, list[Any]] = Field(default_factory=dict)  # NSA field -> values in the model
    read_overrides: list[str] = Field(default_factory=list)  # overrides the factory read from the spec


# The process group's timeout: longer than any stall the watchdog waits for, so that a hung collective is
# still hung (not torn down by torch) when the watchdog takes its evidence.
PG_TIMEOUT_MARGIN_S = 600.0


def pg_timeout_s(spec: CaseSpec) -> float:
    """Seconds before torch gives up on a collective: the case's timeout and stall, plus a margin."""
    stall = 120.0 if spec.stall == "auto" else float(spec.stall)
    return max(spec.timeout or 0.0, stall) + PG_TIMEOUT_MARGIN_S


def past_timeout(spec: CaseSpec, elapsed_s: float) -> bool:
    """Whether a case that ran ``elapsed_s`` seconds is past its time box (never, without one)."""
    return spec.timeout is not None and elapsed_s > spec.timeout


PRE_FLIGHT = "pre-flight"  # the phase of a ddp rank's pre-flight, and the prefix of its forward, backward


class BuiltModel(BaseModel):
    """What the worker found in the ``--model`` it built (result.json and summary.json ``model``): where
    its layers are and how many, its vocabulary size and where that came from
    (`nsa_diag.worker.contract`)."""

    model_config = ConfigDict(extra="forbid")

    type: str  # the model's class
    layers_attr: str  # --layers-attr, a known layout (layers, model.layers, ...) or the list found
    layers: int
    vocab: int
    vocab_from: str  # vocab_size | config.vocab_size | get_input_embeddings() | ... | --vocab

    def describe(self) -> str:
        """``"UserLM: layers net.layers (3), vocab 256 from embed (the only nn.Embedding)"``."""
        layers = f"layers {self.layers_attr} ({self.layers})"
        return f"{self.type}: {layers}, vocab {self.vocab} from {self.vocab_from}"


class Where(BaseModel):
    """A location in a training step, as the progress beacon last reported it."""

    model_config = ConfigDict(extra="forbid")

    # setup | forward | backward | recompute | optimizer | step | check | done | export, or the ddp rank's
    # pre-flight before step 1 (nsa_diag.worker.ddp): pre-flight, and its own forward, backward, recompute
    phase: str | None = None
    step: int | None = None
    layer: int | None = None
    branch: str | None = None
    module: str | None = None
    event: str | None = None  # begin | end

    def describe(self) -> str:
        """``"layer 1 backward (branch sel) step 1"``-style text; ``"pre-flight, layer 2 backward"`` in the
        pre-flight (which runs step 1's batch before step 1: no step is named)."""
        if self.phase is not None and self.phase.startswith(PRE_FLIGHT):
            within = self.phase[len(PRE_FLIGHT) :].strip() or None
            inside = self.model_copy(update={"phase": within, "step": None}).describe()
            return PRE_FLIGHT if inside == "unknown" else f"{PRE_FLIGHT}, {inside}"
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

    # ok, or the verdict the worker found itself: oom | nonfinite | grad-missing | mismatch | unchecked |
    # error | skipped
    # (a plain str: `classify` reports a status it does not know rather than dropping the report)
    status: str
    reason: str = ""
    exception: WorkerException | None = None
    device: str | None = None
    steps_done: int = 0
    metrics: Metrics = Field(default_factory=Metrics)  # phase times, tokens/s, losses, grad norm, memory
    missing_grads: list[str] = Field(default_factory=list)
    nonfinite: NonFinite | None = None  # where values first went non-finite
    parity: Parity | None = None  # reference_check / verify: relative errors and bounds
    # One rank of `nsa-diag ddp`: pre-flight, gradient arrival, parameter hashes, buckets, collectives,
    # DDP's own error (nsa_diag.worker.ddp). Absent from the JSON of a single worker.
    ddp: RankDdp | None = None

    @model_serializer(mode="wrap")
    def _without_absent_ddp(self, handler: SerializerFunctionWrapHandler) -> object:
        data = handler(self)
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
    metrics: Metrics = Field(default_factory=Metrics)  # phase times, tokens/s, losses, grad norm, memory
    rate: Rate | None = None  # slow: progress rate and the estimated time it would need
    missing_grads: list[str] = Field(default_factory=list)
    nonfinite: NonFinite | None = None  # where values first went non-finite
    parity: Parity | None = None  # reference_check / verify: relative errors and bounds
    evidence: CaseEvidence = Field(default_factory=CaseEvidence)  # how it ended, what was gathered
    # nsa-diag ddp (issue 6): per-rank verdicts, missing gradients per rank, minority ranks, first divergent
    # frame, pre-flight, parameter hashes, buckets (nsa_diag.analysis.ranks.aggregate)
    ddp: DdpResult | None = None
    model: BuiltModel | None = None  # a --model: its layers and vocabulary as the worker found them
    files: list[str] = Field(default_factory=list)  # artifact files of the case folder

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def stacks_file(self) -> str:
        """The ``stacks.txt`` of the process this verdict is about, relative to the case folder: the
        worker's own, a ddp rank's (``evidence.rank_of_verdict``) or, under ``watch``, the deciding
        process's (``evidence.stacks_file``: ``procs/pid-<pid>/stacks.txt``)."""
        if self.evidence.stacks_file:
            return self.evidence.stacks_file
        rank = self.evidence.rank_of_verdict
        return f"ranks/{rank}/stacks.txt" if rank is not None else "stacks.txt"
