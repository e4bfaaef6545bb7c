"""Option aliases shared by the commands, so every command spells and documents them the same way.

The case commands (`run`, `branch`, `backend`, `selftest`, ...) share some forty options. Rather than repeat
them in every signature, `case_command` adds them to a command function, which receives them collected in
one `CaseOptions` value; a command can leave some out (`omit`) or change their defaults (`defaults`).
The follow-up options (`--repeat`, `--minimize`, `--triage`, `--junit`) are
case options too: a command hands its `CaseOptions` to `nsa_diag.session.run_session(options=...)`, which
honours them; a command that cannot honour one leaves it out with `omit`.
Choices are `str` Enums. Nothing here imports torch, pydantic or `nsa_core` (whose package imports torch),
so `nsa-diag --help` stays instant; `tests/diag/test_commands.py` checks the choices against `nsa_core`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection, Mapping
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print the summary as JSON to stdout instead of tables, for scripts."),
]

# `main()` reads --debug from the raw arguments before Typer parses them, so that it also applies to
# errors raised while parsing; commands declare it so that it is accepted after the command name too.
DebugOpt = Annotated[
    bool,
    typer.Option("--debug", help="On an error, show the full traceback, not only the one-line message."),
]


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


# Help panels group the many case options in `--help`.
_MODEL = "Model (default: the preset's value)"
_NSA = "NSA geometry and backends (default: the preset's value)"
_BATCH = "Training steps"
_WATCH = "Watchdog"
_CHECKS = "Faults and checks"
_EVIDENCE = "Extra evidence"
_OUTPUT = "Output"
_FOLLOW_UP = "Repeat, minimize, triage"

DEFAULT_STALL = "auto"  # cases.parse_stall turns the text into seconds or "auto"
DEFAULT_TIMEOUT_S = 300.0
MAX_REPEAT = 1000


def _opt(*names: str, panel: str, help: str, **kwargs: Any) -> Any:
    kwargs.setdefault("show_default", True)
    return typer.Option(*names, rich_help_panel=panel, help=help, **kwargs)


@dataclasses.dataclass(frozen=True)
class CaseOptions:
    """The shared case options of one command line, as parsed (None: the preset's value)."""

    preset: Preset = Preset.tiny
    layers: int | None = None
    dim: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    vocab: int | None = None
    mlp_hidden: int | None = None
    block_len: int | None = None
    block_stride: int | None = None
    sel_block_len: int | None = None
    n_sel: int | None = None
    n_init: int | None = None
    n_local: int | None = None
    window: int | None = None
    branch: Branch = Branch.all
    sel: SelBackend | None = None
    cmp: CmpBackend | None = None
    win: WinBackend | None = None
    prefill: Prefill | None = None
    gc: str | None = None
    gc_reentrant: bool = False
    seq_len: int | None = None
    batch: int = 2
    steps: int = 1
    dtype: Dtype = Dtype.fp32
    device: Device = Device.auto
    seed: int = 0
    lr: float = 1e-3
    stall: float | str | None = DEFAULT_STALL  # "auto" or seconds (text as given on the command line)
    timeout: float = DEFAULT_TIMEOUT_S
    inject: tuple[str, ...] = ()
    model: str | None = None
    reference_check: bool = False
    tolerance: float | None = None
    anomaly: bool = False
    launch_blocking: bool = False
    profile: bool = False
    memory_snapshot: bool = False
    alloc_conf: str | None = None
    repeat: int = 1
    minimize: bool = False
    triage: bool = False
    out: Path = Path("nsa-diag-runs")
    tag: str | None = None
    junit: Path | None = None

    def replace(self, **changes: Any) -> CaseOptions:
        return dataclasses.replace(self, **changes)


def _int(name: str, panel: str, help: str, minimum: int = 1) -> Any:
    return Annotated[int | None, _opt(name, panel=panel, help=help, min=minimum, show_default=False)]


def _choice(enum: type[Enum], name: str, panel: str, help: str) -> Any:
    return Annotated[enum | None, _opt(name, panel=panel, help=help, show_default=False)]


def _text(name: str, panel: str, help: str, metavar: str | None = None) -> Any:
    return Annotated[str | None, _opt(name, panel=panel, help=help, metavar=metavar, show_default=False)]


def _flag(name: str, panel: str, help: str) -> Any:
    return Annotated[bool, _opt(name, panel=panel, help=help)]


_SEQ_LEN_HELP = (
    "Sequence length S. Default: 2·n_sel·l' of the model, at least 2·window (tiny 128, small 512, "
    "m7c-125m 2048), so that selection is sparse and S exceeds the window."
)
_INJECT_HELP = (
    "Fault to inject (repeatable): deadlock, busy, slow, nan, oom, segfault, abort, exit, unused-param, "
    "gil-hog, gpu-spin. Keys: layer (default 0), phase (backward|forward|recompute, default backward), "
    "step (default 1), seconds (slow). E.g. deadlock:layer=1,phase=backward."
)

# name -> Annotated type, in the order `--help` lists them. Defaults come from `CaseOptions`.
CASE_OPTION_TYPES: dict[str, Any] = {
    "preset": Annotated[Preset, _opt("--preset", panel=_MODEL, help="Model preset.")],
    "layers": _int("--layers", _MODEL, "Transformer blocks."),
    "dim": _int("--dim", _MODEL, "Model width."),
    "heads": _int("--heads", _MODEL, "Query heads."),
    "kv_heads": _int("--kv-heads", _MODEL, "Key/value heads (GQA groups); must divide --heads."),
    "head_dim": _int("--head-dim", _MODEL, "Dimension per head (even, for RoPE)."),
    "vocab": _int("--vocab", _MODEL, "Vocabulary size (the logits, and so memory, grow with it)."),
    "mlp_hidden": _int("--mlp-hidden", _MODEL, "SwiGLU hidden size."),
    "block_len": _int("--block-len", _NSA, "Compression block length l."),
    "block_stride": _int("--block-stride", _NSA, "Compression stride d (divides l and l')."),
    "sel_block_len": _int("--sel-block-len", _NSA, "Selection block length l'."),
    "n_sel": _int("--n-sel", _NSA, "Selected blocks per query, forced ones included."),
    "n_init": _int("--n-init", _NSA, "Initial blocks always selected.", minimum=0),
    "n_local": _int("--n-local", _NSA, "Local blocks always selected."),
    "window": _int("--window", _NSA, "Sliding window w."),
    "branch": Annotated[
        Branch, _opt("--branch", panel=_NSA, help="Compute only this branch (force_branch); all: every one.")
    ],
    "sel": _choice(SelBackend, "--sel", _NSA, "Selection backend (on CUDA: triton unless named)."),
    "cmp": _choice(CmpBackend, "--cmp", _NSA, "Compression backend (on CUDA: triton unless named)."),
    "win": _choice(WinBackend, "--win", _NSA, "Sliding-window backend (on CUDA: triton unless named)."),
    "prefill": _choice(
        Prefill, "--prefill", _NSA, "How model(tokens) runs: batched, or token by token through the cache."
    ),
    "gc": _text("--gc", _NSA, "Gradient checkpointing: none, all, or layers A..B-1.", metavar="none|all|A:B"),
    "gc_reentrant": _flag("--gc-reentrant", _NSA, "Reentrant checkpointing (use_reentrant=True)."),
    "seq_len": _int("--seq-len", _BATCH, _SEQ_LEN_HELP),
    "batch": Annotated[int, _opt("--batch", panel=_BATCH, help="Batch size B.", min=1)],
    "steps": Annotated[
        int, _opt("--steps", panel=_BATCH, help="Training steps (forward, backward, AdamW step).", min=1)
    ],
    "dtype": Annotated[
        Dtype, _opt("--dtype", panel=_BATCH, help="Autocast dtype (fp32 master weights; fp16: GradScaler).")
    ],
    "device": Annotated[Device, _opt("--device", panel=_BATCH, help="auto: CUDA when available, else CPU.")],
    "seed": Annotated[int, _opt("--seed", panel=_BATCH, help="Seed of the weights and the random tokens.")],
    "lr": Annotated[float, _opt("--lr", panel=_BATCH, help="AdamW learning rate.")],
    "stall": Annotated[
        str,
        _opt(
            "--stall",
            panel=_WATCH,
            metavar="auto|SECONDS",
            help="No progress for this long: hang. auto: 120 s until step 1 ends, then 3x its duration, "
            "at least 10 s.",
        ),
    ],
    "timeout": Annotated[
        float,
        _opt(
            "--timeout",
            panel=_WATCH,
            metavar="SECONDS",
            help="The case ran longer than this while progress continued: slow (with rate and ETA).",
        ),
    ],
    "inject": Annotated[
        list[str],
        _opt("--inject", panel=_CHECKS, metavar="KIND[:k=v,...]", help=_INJECT_HELP, show_default=False),
    ],
    "model": _text(
        "--model",
        _CHECKS,
        "Your own model: factory(spec) -> nn.Module mapping ids [B, S] to logits [B, S, V].",
        metavar="PKG.MODULE:FACTORY",
    ),
    "reference_check": _flag(
        "--reference-check",
        _CHECKS,
        "Compare loss and gradients at step 1 with the reference backends: mismatch beyond --tolerance.",
    ),
    "tolerance": Annotated[
        float | None,
        _opt(
            "--tolerance",
            panel=_CHECKS,
            help="Relative-error limit of --reference-check; by dtype: fp32 1e-4, fp16 1e-2, bf16 5e-2.",
            show_default=False,
        ),
    ],
    "anomaly": _flag("--anomaly", _CHECKS, "torch.autograd.set_detect_anomaly(True) in the worker."),
    "launch_blocking": _flag("--launch-blocking", _EVIDENCE, "CUDA_LAUNCH_BLOCKING=1 in the worker."),
    "profile": _flag("--profile", _EVIDENCE, "torch.profiler: Chrome trace (trace.json), memory timeline."),
    "memory_snapshot": _flag(
        "--memory-snapshot", _EVIDENCE, "CUDA memory snapshot (memory_snapshot.pickle) for memory_viz."
    ),
    "alloc_conf": _text(
        "--alloc-conf",
        _EVIDENCE,
        "PYTORCH_CUDA_ALLOC_CONF for the worker, e.g. expandable_segments:True.",
        metavar="CONF",
    ),
    "repeat": Annotated[
        int,
        _opt(
            "--repeat",
            panel=_FOLLOW_UP,
            metavar="N",
            min=1,
            max=MAX_REPEAT,
            help="Run every case N times (as cases CASE-r1 ... CASE-rN): verdict counts, hang probability "
            "with a 95% interval, time-to-hang spread; a failure not in every run is reported as transient.",
        ),
    ],
    "minimize": _flag(
        "--minimize",
        _FOLLOW_UP,
        "For each failing case, shrink layers, sequence length, batch, steps and the active branches while "
        "the verdict holds (real runs under minimize/); print the smallest reproducing command.",
    ),
    "triage": _flag(
        "--triage",
        _FOLLOW_UP,
        "For each oom case, rerun with expandable_segments:True and with max_split_size_mb:128 (CUDA) and "
        "classify: fragmentation, capacity, or memory outside PyTorch.",
    ),
    "out": Annotated[
        Path, _opt("--out", panel=_OUTPUT, help="Folder that receives the run folder.", file_okay=False)
    ],
    "tag": _text("--tag", _OUTPUT, "Suffix of the run folder's name (letters, digits, . _ -)."),
    "junit": Annotated[
        Path | None,
        _opt(
            "--junit",
            panel=_OUTPUT,
            metavar="FILE",
            dir_okay=False,
            show_default=False,
            help="Also write the case results as JUnit XML to FILE, for CI systems.",
        ),
    ],
}

_FIELDS = {field.name: field for field in dataclasses.fields(CaseOptions)}
assert set(CASE_OPTION_TYPES) == set(_FIELDS), "CASE_OPTION_TYPES and CaseOptions must name the same options"

F = TypeVar("F", bound=Callable[..., Any])


def _default(name: str) -> Any:
    return _FIELDS[name].default


def case_command(
    *, omit: Collection[str] = (), defaults: Mapping[str, Any] | None = None
) -> Callable[[F], Callable[..., Any]]:
    """Give a command the shared case options.

    The decorated function takes a `CaseOptions` as its first parameter, then its own options. The
    returned function has a signature Typer can read: every shared option not in `omit`, then the
    command's own options, with `defaults` replacing `CaseOptions`' defaults (an omitted option keeps its
    default, or the one given here).
    """
    defaults = dict(defaults or {})
    unknown = (set(omit) | set(defaults)) - set(_FIELDS)
    assert not unknown, f"unknown case options {sorted(unknown)}"

    def decorate(fn: F) -> Callable[..., Any]:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]
        shared = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults.get(name, _default(name)),
                annotation=annotation,
            )
            for name, annotation in CASE_OPTION_TYPES.items()
            if name not in omit
        ]
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        fixed = {name: defaults.get(name, _default(name)) for name in omit}

        def command(**kwargs: Any) -> Any:
            values = {**fixed, **{p.name: kwargs.pop(p.name) for p in shared}}
            values["inject"] = tuple(values["inject"] or ())
            return fn(CaseOptions(**values), **kwargs)

        parameters = shared + own  # `--help` lists panels in order of first appearance: the model first
        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        command.__name__ = fn.__name__
        command.__qualname__ = fn.__qualname__
        command.__doc__ = fn.__doc__
        command.__module__ = fn.__module__
        return command

    return decorate
