"""The vocabulary of case options: how one is declared, the choices they take, and the groups `--help` shows.

A case option is declared once, next to what it sets:

- an option that sets a `CaseSpec` field is an `Opt` in that field's `Annotated` metadata (`nsa_diag.spec`);
- an option that becomes a model override (`CaseSpec.overrides`) is a `ModelOpt` in `spec.MODEL_OPTIONS`;
- an option of `nsa-diag ddp` (`CaseSpec.ddp`) is an `Opt` in a `DdpSpec` field's metadata;
- an option of the run itself (where its folder goes, the follow-ups) is an `Opt` in `SESSION_OPTIONS` here.

From those declarations come the Typer options (`_cli_utils.case_options`), the `CaseOptions` value a command
receives, `build_spec`'s mapping and `replay_argv` (`nsa_diag.cases`). `GROUPS` lists every option once, in
the help panel and the order `--help` shows it; a command names the groups it takes.

Adding an option: declare it where it lands and name it in its group; then use it in the worker. E.g.

    warmup: Annotated[int, Opt("--warmup", int, "Steps before timing starts.", min=0)] = Field(0, ge=0)

on `CaseSpec`, and "warmup" in `TRAINING`: `--warmup` appears in every command that takes TRAINING,
`build_spec` sets `spec.warmup`, and replay lines give it when it is not 0. An option that needs more than
an Enum's value to become the spec's (`--stall`, `--inject`) also has a parser in `cases._PARSERS`.
(`tests/diag/test_options.py` fails on an option without a group, or a field without a declaration.)

Choices are `str` Enums, listed here once; `CaseSpec` validates the same values as `Literal`s made from them
(`literal_of`), and `tests/diag/test_commands.py` checks them against `nsa_core`. Stdlib only, so that
`nsa-diag --help` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, Literal


class Preset(str, Enum):
    """`nsa_core.PRESETS`."""

    tiny = "tiny"
    small = "small"
    m7c_125m = "m7c-125m"


class Dtype(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class CompileBackend(str, Enum):
    """`torch.compile` backends: inductor (what users train with), aot_eager and eager (fast, for tests)."""

    inductor = "inductor"
    aot_eager = "aot_eager"
    eager = "eager"


class Branch(str, Enum):
    """`all` computes every branch; the others force one (`force_branch`)."""

    all = "all"
    cmp = "cmp"
    sel = "sel"
    win = "win"


class SelBackend(str, Enum):
    """`nsa_core.SEL_BACKENDS` + `nsa_core.TRITON_BACKENDS` (Triton: CUDA, or TRITON_INTERPRET=1)."""

    reference = "reference"
    masked = "masked"
    gather = "gather"
    packed = "packed"
    triton = "triton"


class CmpBackend(str, Enum):
    """`nsa_core.CMP_BACKENDS` + `nsa_core.TRITON_BACKENDS`."""

    reference = "reference"
    masked = "masked"
    triton = "triton"


class WinBackend(str, Enum):
    """`nsa_core.WIN_BACKENDS` + `nsa_core.TRITON_BACKENDS`."""

    reference = "reference"
    masked = "masked"
    chunked = "chunked"
    triton = "triton"


class Prefill(str, Enum):
    """`nsa_core.PREFILL_MODES`."""

    batched = "batched"
    sequential = "sequential"


class JobExecutor(str, Enum):
    """Where the cases' jobs run: here (threads, each case in its own worker), or as Slurm jobs through
    submitit (`nsa_diag.slurm`)."""

    local = "local"
    slurm = "slurm"


class SubmititCluster(str, Enum):
    """Which submitit executor `--executor slurm` submits through: Slurm, or submitit's local executor (a
    process per job on this machine, through the same submission path)."""

    slurm = "slurm"
    local = "local"


class FaultKind(str, Enum):
    """What `--inject KIND` can inject (`nsa_diag.worker.inject`)."""

    deadlock = "deadlock"
    busy = "busy"
    slow = "slow"
    nan = "nan"
    oom = "oom"
    segfault = "segfault"
    abort = "abort"
    exit = "exit"
    unused_param = "unused-param"
    skip_collective = "skip-collective"
    gil_hog = "gil-hog"
    gpu_spin = "gpu-spin"


def values_of(enum: type[Enum]) -> tuple[str, ...]:
    """The values of a str Enum, in order: ``("tiny", "small", "m7c-125m")``."""
    return tuple(member.value for member in enum)


def literal_of(enum: type[Enum]) -> Any:
    """``Literal["tiny", "small", ...]`` of a str Enum's values, for a pydantic field (same JSON schema)."""
    return Literal[values_of(enum)]  # type: ignore[valid-type]


FROM_FIELD: Any = object()  # `Opt.default`: the command-line default is the field's own (as an Enum member)


@dataclass(frozen=True)
class Opt:
    """One case option on the command line.

    `type` is what the command line parses: int, float, str, bool (a flag), Path, a str Enum (its choices),
    or ``list[str]`` (repeatable). `default` is the command-line default: `FROM_FIELD` takes the declared
    field's default; None means "unset" (the preset's value, or one `build_spec` derives). `replay` says
    when `replay_argv` writes the option: "always", or "changed" (when it differs from the field's default).
    """

    flag: str
    type: Any
    help: str
    default: Any = FROM_FIELD
    metavar: str | None = None
    min: float | None = None
    max: float | None = None
    replay: Literal["always", "changed"] = "changed"
    typer: tuple[tuple[str, Any], ...] = ()  # more `typer.Option` settings, e.g. (("file_okay", False),)

    @property
    def name(self) -> str:
        """The Python name: `--kv-heads` -> ``kv_heads`` (the `CaseOptions` attribute, the field's name)."""
        return self.flag.lstrip("-").replace("-", "_")

    def with_default(self, default: Any) -> Opt:
        return replace(self, default=default)

    def from_command_line(self, value: Any) -> Any:
        """The parsed command-line value as a spec value: an Enum's value; a repeated option as a tuple."""
        if isinstance(value, Enum):
            return value.value
        if isinstance(value, list | tuple):
            return tuple(value)
        return value


@dataclass(frozen=True)
class ModelOpt(Opt):
    """A case option that becomes the model override `key` (`CaseSpec.overrides`, `nsa_core.preset`).

    Its command-line default means "no override": the preset's value (`--branch all`: every branch).
    `key` defaults to the option's name (`--window` -> ``window``).
    """

    key: str = ""

    @property
    def override(self) -> str:
        return self.key or self.name


@dataclass(frozen=True)
class NotAnOption:
    """Marks a `CaseSpec` field that no shared case option sets, and says what sets it instead."""

    why: str


@dataclass(frozen=True)
class Group:
    """Case options that `--help` lists together in one panel, in this order."""

    title: str
    names: tuple[str, ...]


MAX_REPEAT = 1000

# Options of the run rather than of a case: not in `CaseSpec`, honoured by `nsa_diag.session`.
SESSION_OPTIONS = (
    Opt(
        "--repeat",
        int,
        "Run every case N times (as cases CASE-r1 ... CASE-rN): verdict counts, hang probability "
        "with a 95% interval, time-to-hang spread; a failure not in every run is reported as transient.",
        default=1,
        metavar="N",
        min=1,
        max=MAX_REPEAT,
    ),
    Opt(
        "--minimize",
        bool,
        "For each failing case, shrink layers, sequence length, batch, steps and the active branches while "
        "the verdict holds (real runs under minimize/); print the smallest reproducing command.",
        default=False,
    ),
    Opt(
        "--triage",
        bool,
        "For each oom case, rerun with expandable_segments:True and with max_split_size_mb:128 (CUDA) and "
        "classify: fragmentation, capacity, or memory outside PyTorch.",
        default=False,
    ),
    Opt(
        "--out",
        Path,
        "Folder that receives the run folder.",
        default=Path("nsa-diag-runs"),
        typer=(("file_okay", False),),
    ),
    Opt("--tag", str, "Suffix of the run folder's name (letters, digits, . _ -).", default=None),
    Opt(
        "--junit",
        Path,
        "Also write the case results as JUnit XML to FILE, for CI systems.",
        default=None,
        metavar="FILE",
        typer=(("dir_okay", False),),
    ),
)

_OUTPUT = "Output"

# Every case option once, by help panel, in the order `--help` lists them.
MODEL = Group(
    "Model (default: the preset's value)",
    ("preset", "layers", "dim", "heads", "kv_heads", "head_dim", "vocab", "mlp_hidden"),
)
NSA = Group(
    "NSA geometry and backends (default: the preset's value)",
    (
        "block_len", "block_stride", "sel_block_len", "n_sel", "n_init", "n_local", "window",
        "branch", "sel", "cmp", "win", "prefill", "gc", "gc_reentrant",
    ),
)  # fmt: skip
TRAINING = Group("Training steps", ("seq_len", "batch", "steps", "dtype", "device", "seed", "lr", "compile"))
WATCHDOG = Group("Watchdog", ("stall", "timeout"))
FAULTS = Group(
    "Faults and checks", ("inject", "model", "layers_attr", "reference_check", "tolerance", "anomaly")
)
EVIDENCE = Group(
    "Extra evidence", ("launch_blocking", "profile", "memory_snapshot", "alloc_conf", "branch_marks")
)
FOLLOW_UPS = Group("Repeat, minimize, triage", ("repeat", "minimize", "triage"))
OUTPUT = Group(_OUTPUT, ("out", "tag", "junit"))
CASE_NAME = Group(_OUTPUT, ("name",))  # the commands that run one named case: run, ddp
# `nsa-diag ddp`'s own (the fields of `spec.DdpSpec`)
DDP = Group(
    "DDP",
    (
        "nproc", "backend", "static_graph", "find_unused", "bucket_mb", "trace_buckets", "fsdp",
        "straggler_ratio",
        "nnodes", "node_rank", "rdzv_endpoint", "run_id", "rdzv_timeout",
    ),
)  # fmt: skip

GROUPS = (MODEL, NSA, TRAINING, WATCHDOG, FAULTS, EVIDENCE, FOLLOW_UPS, OUTPUT, CASE_NAME, DDP)
# `nsa-diag verify` checks a property, it does not train: the case options it does not take (its replay
# line omits them too).
CHECK_OMITS = ("inject", "steps", "reference_check", "profile", "memory_snapshot")
