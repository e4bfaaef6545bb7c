"""From command-line options to `CaseSpec`s: one case (`run`), per branch, per backend, per fault kind.

Everything a command line can get wrong is found here, before a run folder exists: a bad `--inject`, an
impossible geometry, `--device cuda` without a GPU, a `--model` that cannot be imported, a fault that could
never fire. Each raises `UsageError` or `ConfigError` with one line naming the option and the fix (exit 2).

`CaseOptions` (what a command receives), `build_spec` (options -> spec) and `replay_argv(spec, out)` (spec ->
the `nsa-diag run|ddp|verify|watch` command line that reproduces it, for every replay.sh) are derived from
the case options' declarations: the `Opt` of each `CaseSpec` and `DdpSpec` field, `spec.MODEL_OPTIONS` and
`options.SESSION_OPTIONS`. At the end, the same for `nsa-diag ddp` (issue 6): its options checked, the
`DdpSpec` (`build_ddp_spec`), its replay flags.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from nsa_diag.devices import cuda_available
from nsa_diag.errors import ConfigError, UsageError
from nsa_diag.options import (
    CHECK_OMITS,
    FROM_FIELD,
    GROUPS,
    MODEL,
    NSA,
    SESSION_OPTIONS,
    Branch,
    CmpBackend,
    Opt,
    SelBackend,
    WinBackend,
)
from nsa_diag.spec import (
    MIN_STALL_S,
    MODEL_OPTIONS,
    MODEL_REF,
    PENDING_ENDPOINT,
    CaseSpec,
    CommandSpec,
    DdpSpec,
    Injection,
    ModelFacts,
    OverrideValue,
    endpoint_problem,
)

if TYPE_CHECKING:
    from nsa_diag.slurm import NodesJob

_TAG_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_TAG_CHARS = 64  # the run folder's name is the tag and 30 characters more; a file name is 255 at most

BACKENDS: dict[str, tuple[str, ...]] = {
    "sel": tuple(b.value for b in SelBackend),
    "cmp": tuple(b.value for b in CmpBackend),
    "win": tuple(b.value for b in WinBackend),
}
TRITON = "triton"
BACKEND_FIELDS = {"sel": "sel_backend", "cmp": "cmp_backend", "win": "win_backend"}
BRANCH_CASES = ("cmp", "sel", "win", "all")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _validation_line(exc: ValidationError) -> str:
    """A pydantic error as one line: `field: message; field: message`."""
    parts = []
    for err in exc.errors():
        msg = _one_line(err["msg"]).removeprefix("Value error, ")
        where = ".".join(str(part) for part in err["loc"])
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def parse_injection(text: str) -> Injection:
    """`--inject` text -> `Injection`, or a `UsageError` naming the bad part."""
    try:
        return Injection.parse(text)
    except ValidationError as exc:
        raise UsageError(f"--inject {text!r}: {_validation_line(exc)}") from None
    except ValueError as exc:
        raise UsageError(_one_line(str(exc))) from None


def parse_stall(value: float | str | None) -> float | str:
    """`--stall` -> seconds (at least `MIN_STALL_S`, finite) or "auto"; a `UsageError` otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return "auto"
    try:
        seconds = float(value)
    except ValueError:
        raise UsageError(f"--stall {value}: give auto or a number of seconds") from None
    if not MIN_STALL_S <= seconds < math.inf:
        raise UsageError(f"--stall {value}: give at least {MIN_STALL_S:g} seconds (finite), or auto")
    return seconds


def default_seq_len(cfg: Any) -> int:
    """2·n_sel·l': twice the tokens selection may pick, so selection is sparse; and at least 2·window."""
    nsa = cfg.nsa
    return max(2 * nsa.n_sel * nsa.sel_block_len, 2 * nsa.window)


# --- the case options, from their declarations ------------------------------------------------------------


def _field_options(model: type[BaseModel]) -> dict[str, Opt]:
    """`model` field -> its `Opt`, with the command-line default filled in from the field."""
    found: dict[str, Opt] = {}
    for field, info in model.model_fields.items():
        opts = [item for item in info.metadata if isinstance(item, Opt)]
        if not opts:
            continue
        (opt,) = opts
        assert opt.name == field, f"{model.__name__}.{field}: its option {opt.flag} must be named after it"
        if opt.default is FROM_FIELD:
            default = info.get_default(call_default_factory=True)
            is_enum = isinstance(opt.type, type) and issubclass(opt.type, Enum)
            opt = opt.with_default(opt.type(default) if is_enum and default is not None else default)
        found[field] = opt
    return found


SPEC_OPTIONS = _field_options(CaseSpec)  # the options that set a CaseSpec field of the same name
DDP_OPTIONS = _field_options(DdpSpec)  # nsa-diag ddp's: each sets the DdpSpec field of the same name
# Every case option by name: those of CaseSpec fields, the model overrides, the run's own, nsa-diag ddp's.
CASE_OPTIONS: dict[str, Opt] = {
    opt.name: opt for opt in (*SPEC_OPTIONS.values(), *MODEL_OPTIONS, *SESSION_OPTIONS, *DDP_OPTIONS.values())
}
assert len(CASE_OPTIONS) == len(SPEC_OPTIONS) + len(MODEL_OPTIONS) + len(SESSION_OPTIONS) + len(
    DDP_OPTIONS
), "an option twice"
assert sorted(CASE_OPTIONS) == sorted(n for g in GROUPS for n in g.names), "options.GROUPS: each option once"


class _CaseOptionsBase:
    def replace(self, **changes: Any) -> Any:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def _option_type(opt: Opt) -> Any:
    return opt.type if opt.default is not None else opt.type | None


CaseOptions: Any = dataclasses.make_dataclass(
    "CaseOptions",
    [(name, _option_type(opt), dataclasses.field(default=opt.default)) for name, opt in CASE_OPTIONS.items()],
    bases=(_CaseOptionsBase,),
    frozen=True,
)
CaseOptions.__module__ = __name__
CaseOptions.__doc__ = """The case options of one command line, as parsed: one attribute per declared option
(`CASE_OPTIONS`), Enum members for choices, None for "the preset's value"; `replace(**changes)` copies."""


def preset_overrides(options: CaseOptions) -> dict[str, OverrideValue]:
    """The model overrides the options name, in `MODEL_OPTIONS` order; one at its default names none."""
    overrides: dict[str, OverrideValue] = {}
    for opt in MODEL_OPTIONS:
        value = getattr(options, opt.name)
        if value != opt.default:
            overrides[opt.override] = opt.from_command_line(value)
    return overrides


def model_config(preset: str, overrides: Mapping[str, OverrideValue]) -> Any:
    import nsa_core

    try:
        return nsa_core.preset(preset, **overrides)
    except ValueError as exc:
        raise ConfigError(_one_line(str(exc))) from None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def with_device_backends(overrides: dict[str, OverrideValue], on_cuda: bool) -> dict[str, OverrideValue]:
    """On CUDA a case runs the Triton kernels for every branch whose backend it does not name (issue 7);
    elsewhere, and without the triton package, the preset's backends. Named in the overrides, so the
    case's `spec.json`, hash and estimate say what ran."""
    if not on_cuda or not triton_available():
        return overrides
    return {**{field: TRITON for field in BACKEND_FIELDS.values() if field not in overrides}, **overrides}


def _parse_injections(texts: Iterable[str]) -> tuple[Injection, ...]:
    return tuple(parse_injection(text) for text in texts)


# Spec values that are more than the command line's value (an Enum's value, a tuple of a repeated option):
# these parsers raise `UsageError` naming the option.
_PARSERS: dict[str, Callable[[Any], Any]] = {"stall": parse_stall, "inject": _parse_injections}


def build_spec(
    options: CaseOptions,
    *,
    name: str | None = None,
    overrides: Mapping[str, OverrideValue] | None = None,
    **fields: Any,
) -> CaseSpec:
    """The `CaseSpec` of `options` (named `name`, default `options.name`), with extra model `overrides` and
    `CaseSpec` `fields` on top.

    On CUDA the branches whose backend is not named run Triton (`with_device_backends`). An unset
    `--seq-len` is `default_seq_len`. An invalid geometry or value raises `ConfigError` in one line.
    """
    all_overrides = {**preset_overrides(options), **(overrides or {})}
    if options.model is None:
        all_overrides = with_device_backends(all_overrides, uses_cuda(options))
    # A --model's checkpointed range is checked against its own layers, in its pre-flight
    checked = (
        all_overrides if options.model is None else {k: v for k, v in all_overrides.items() if k != "gc"}
    )
    cfg = model_config(options.preset.value, checked)
    values: dict[str, Any] = {}
    for field, opt in SPEC_OPTIONS.items():
        value = getattr(options, field)
        values[field] = _PARSERS[field](value) if field in _PARSERS else opt.from_command_line(value)
    values["overrides"] = all_overrides
    values["seq_len"] = values["seq_len"] or default_seq_len(cfg)
    if name is not None:
        values["name"] = name
    values.update(fields)
    spec = validate_spec(values)
    check_spec(spec)
    return spec


def validate_spec(values: Mapping[str, Any]) -> CaseSpec:
    """`values` as a `CaseSpec`, or a `ConfigError` in one line (`field: message; ...`)."""
    try:
        return CaseSpec.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(_validation_line(exc)) from None


def check_spec(spec: CaseSpec) -> None:
    """Combinations a `CaseSpec` allows but that could never run as meant; `UsageError` in one line."""
    if spec.seq_len < 2:
        raise UsageError(f"--seq-len {spec.seq_len}: the next-token loss needs at least 2 tokens")
    check_triton(spec)
    world = spec.ddp.world_size if spec.ddp is not None else 1  # issue 6: ranks of `nsa-diag ddp`
    for inj in spec.inject:
        if inj.kind == "skip-collective" and world < 2:
            raise UsageError(
                f"--inject {inj}: skip-collective needs several ranks; it applies only under `nsa-diag ddp` "
                "with --nproc 2 or more"
            )
        if inj.rank is not None and inj.rank >= world:
            if spec.ddp is None:
                raise UsageError(f"--inject {inj}: rank={inj.rank}, but this case runs one process (rank 0)")
            raise UsageError(f"--inject {inj}: rank={inj.rank}, but the ranks are 0..{world - 1}")
        if inj.step > spec.steps:
            raise UsageError(f"--inject {inj}: step={inj.step} never comes with --steps {spec.steps}")
        if spec.model is not None:  # its layers are known from its pre-flight (check_model_facts)
            continue
        cfg = spec.nsa_config()
        if inj.layer >= cfg.layers:
            raise UsageError(
                f"--inject {inj}: layer={inj.layer}, but the model's layers are 0..{cfg.layers - 1}"
            )
        if inj.phase == "recompute" and inj.layer not in cfg.gc_layers:
            raise UsageError(
                f"--inject {inj}: phase=recompute fires only when layer {inj.layer} is checkpointed; "
                f"add --gc all or --gc A:B covering it"
            )


def check_triton(spec: CaseSpec) -> None:
    """A `triton` backend needs the triton package, and CUDA unless Triton's interpreter is on."""
    named = [
        f"--{branch} triton"
        for branch, field in BACKEND_FIELDS.items()
        if spec.overrides.get(field) == TRITON
    ]
    if not named:
        return
    if not triton_available():
        raise UsageError(
            f"{named[0]}: the triton package is not installed (it comes with CUDA builds of torch)"
        )
    if not runs_on_cuda(spec.device) and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError(
            f"{named[0]}: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 to run them slowly "
            "in Triton's CPU interpreter); pick another backend here"
        )


def check_output(out: Path | None, tag: str | None) -> None:
    """`--out` must be a folder (or not exist yet) and `--tag` usable in a folder name."""
    if tag is not None and not _TAG_PATTERN.match(tag):
        raise UsageError(f"--tag {tag!r}: use letters, digits, '.', '_' and '-' (it names a folder)")
    if tag is not None and len(tag) > MAX_TAG_CHARS:
        raise UsageError(
            f"--tag {tag[:20]}...: {len(tag)} characters; at most {MAX_TAG_CHARS} (it names a folder)"
        )
    if out is not None and out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder")


def check_options(options: CaseOptions) -> None:
    """What can be checked before any case is built: values, the tag, the device, the model factory."""
    parse_stall(options.stall)
    if options.timeout is not None and not 0 < options.timeout < math.inf:
        raise UsageError(f"--timeout {options.timeout:g}: must be more than 0 seconds, and finite")
    if not 0 < options.lr < math.inf:
        raise UsageError(f"--lr {options.lr}: the learning rate must be > 0, and finite")
    check_output(options.out, options.tag)
    if options.device.value == "cuda" and not cuda_available():
        raise UsageError("--device cuda: torch sees no CUDA device here; use --device cpu or auto")
    if options.memory_snapshot and not uses_cuda(options):
        raise UsageError(
            "--memory-snapshot: the snapshot is of the CUDA allocator, and this case runs on the CPU "
            f"(--device {options.device.value}); leave the option out, or run on a GPU"
        )
    if options.model is not None:
        check_model_factory(options.model)


def runs_on_cuda(device: str) -> bool:
    """Whether a case with ``device`` (cpu, cuda, auto) runs on CUDA: auto resolves as in the worker."""
    return device == "cuda" or (device == "auto" and cuda_available())


def uses_cuda(options: CaseOptions) -> bool:
    """Whether the worker will run on CUDA (`--device auto` resolves as in the worker)."""
    return runs_on_cuda(options.device.value)


def check_model_factory(target: str) -> None:
    """`pkg.module:factory` must name a module the worker can import and a name its source binds.

    Nothing of the user's code runs here, not even a package's ``__init__``: a dry run, or a command
    refused for another reason, must execute none of it. The module is looked up as the worker imports it
    (the working directory first, `nsa_diag.worker.train.load_factory`), and its source is parsed, not
    run; the worker then checks that the factory is callable.
    """
    module_name, _, attr = target.partition(":")
    if not MODEL_REF.match(target):
        raise UsageError(
            f"--model {target!r}: expected 'pkg.module:factory' (a module path, a colon, a function's name)"
        )
    loaded = sys.modules.get(module_name)  # imported here already (os.path, torch.nn): looking runs nothing
    if loaded is not None:
        if not hasattr(loaded, attr):
            raise UsageError(f"--model {target}: module {module_name} has no attribute {attr!r}")
        return
    source = _module_source(target, module_name)
    if source is None:
        return  # compiled, built in or a namespace package: the worker finds out
    try:
        tree = ast.parse(Path(source).read_bytes(), filename=source)
    except (OSError, SyntaxError, ValueError) as exc:
        raise UsageError(f"--model {target}: cannot read {source}: {_one_line(str(exc))}") from None
    names = _bound_names(tree)
    if attr not in names and "*" not in names and "__getattr__" not in names:
        raise UsageError(f"--model {target}: module {module_name} has no attribute {attr!r}")


def _module_source(target: str, module_name: str) -> str | None:
    """The source file of `module_name` (None: it has none), found without importing any of its packages."""
    from importlib.machinery import PathFinder

    parts = module_name.split(".")
    found = PathFinder.find_spec(parts[0], [os.getcwd(), *sys.path])
    if found is None:  # an installed package's own finder (editable installs), or a built-in module
        found = importlib.util.find_spec(parts[0])  # a top-level name: nothing is imported to find it
    for depth in range(1, len(parts)):
        if found is None or not found.submodule_search_locations:  # not a package: no module in it
            found = None
            break
        found = PathFinder.find_spec(".".join(parts[: depth + 1]), list(found.submodule_search_locations))
    if found is None:
        raise UsageError(f"--model {target}: cannot import {module_name}: no such module")
    origin = found.origin
    return origin if found.has_location and origin and origin.endswith(".py") else None


def _bound_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (in if/try/with blocks too); "*" for a star import."""
    names: set[str] = set()
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)  # not its body: that binds the function's or class's own names
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)
        else:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            pending.extend(ast.iter_child_nodes(node))
    return names


def parse_backend_list(branch: str, text: str | None) -> tuple[str, ...]:
    """`--sel masked,gather` -> ("masked", "gather"); every name checked against the branch's backends."""
    if text is None:
        return ()
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    valid = BACKENDS[branch]
    bad = [name for name in names if name not in valid]
    if bad or not names:
        raise UsageError(
            f"--{branch} {text!r}: {', '.join(bad) or 'empty list'} not a {branch} backend; "
            f"choose from {', '.join(valid)}"
        )
    return names


def branch_specs(options: CaseOptions) -> list[CaseSpec]:
    """One case per branch computing only that branch (force_branch), then every branch (`all`)."""
    return [
        build_spec(options.replace(branch=Branch(name)), name=name)
        for name in BRANCH_CASES  # Branch.all sets no force_branch
    ]


def backend_specs(options: CaseOptions, lists: dict[str, Sequence[str]]) -> list[CaseSpec]:
    """One case per backend of each branch in `lists`, computing that branch alone, with `reference_check`.

    A branch not in `lists` runs every backend but the reference (which would be compared with itself)
    when no list is given at all.
    """
    if not any(lists.values()):  # the reference would be compared with itself; Triton only where it runs
        skip = {"reference"} | (set() if uses_cuda(options) and triton_available() else {TRITON})
        lists = {branch: tuple(b for b in names if b not in skip) for branch, names in BACKENDS.items()}
    specs = []
    for branch, backends in lists.items():
        for backend in backends:
            specs.append(
                build_spec(
                    options.replace(branch=Branch(branch)),
                    name=f"{branch}-{backend}",
                    overrides={f"{branch}_backend": backend},
                    reference_check=True,
                )
            )
    return specs


@dataclass(frozen=True)
class Expectation:
    """What `selftest` expects of one injected fault."""

    kind: str
    verdict: str
    hang_kind: str | None = None

    def met_by(self, verdict: str, hang_kind: str | None) -> bool:
        return verdict == self.verdict and (self.hang_kind is None or hang_kind == self.hang_kind)

    def describe(self) -> str:
        return self.verdict + (f" / {self.hang_kind}" if self.hang_kind else "")


SELFTEST_EXPECTATIONS = (
    Expectation("deadlock", "hang", "python-deadlock"),
    Expectation("busy", "hang", "python-busy"),
    Expectation("slow", "slow"),
    Expectation("nan", "nonfinite"),
    Expectation("oom", "oom"),
    Expectation("segfault", "crash"),
    Expectation("abort", "crash"),
    Expectation("exit", "crash"),
    Expectation("unused-param", "grad-missing"),
    Expectation("gil-hog", "hang", "gil-held"),
    Expectation("gpu-spin", "hang", "cuda-kernel"),
)
SELFTEST_KINDS = tuple(e.kind for e in SELFTEST_EXPECTATIONS)
SLOW_SECONDS = 1.0


def parse_choice_list(option: str, text: str | None, choices: tuple[str, ...], what: str) -> tuple[str, ...]:
    """`--option a,b` -> the names, de-duplicated and checked against ``choices``; None: all of them."""
    if text is None:
        return choices
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    bad = [name for name in names if name not in choices]
    if bad or not names:
        raise UsageError(
            f"{option} {text!r}: {', '.join(bad) or 'empty list'} not a {what}; "
            f"choose from {', '.join(choices)}"
        )
    return names


def parse_kinds(text: str | None) -> tuple[str, ...]:
    """`--kinds deadlock,nan` -> the kinds, checked; None: every kind."""
    return parse_choice_list("--kinds", text, SELFTEST_KINDS, "selftest kind")


def selftest_specs(
    options: CaseOptions, kinds: Iterable[str], *, cuda: bool, layers: int | None = None
) -> list[tuple[CaseSpec, Expectation]]:
    """One case per fault kind, injected in the backward of the last layer at step 1.

    `slow` sleeps `SLOW_SECONDS` per step in a case whose timeout is twice the stall and whose steps
    would take four times that timeout, so the watchdog must call it slow, not hung. `gpu-spin` needs CUDA
    (the command leaves it out, or refuses it, without). ``layers``: a ``--model``'s (its pre-flight's).
    """
    layer = (layers or model_config(options.preset.value, preset_overrides(options)).layers) - 1
    expectations = {e.kind: e for e in SELFTEST_EXPECTATIONS}
    cases = []
    for kind in kinds:
        expected = expectations[kind]
        fields: dict[str, float] = {}
        inject = f"{kind}:layer={layer},phase=backward,step=1"
        if kind == "slow":
            stall = parse_stall(options.stall)
            if stall == "auto":
                raise UsageError("selftest --stall auto: the slow case is sized by the stall; give seconds")
            seconds = min(SLOW_SECONDS, float(stall) / 3)
            timeout = 2 * float(stall)
            inject += f",seconds={seconds:g}"
            fields = {"timeout": timeout, "steps": max(options.steps, math.ceil(4 * timeout / seconds))}
        spec = build_spec(options.replace(inject=(inject,)), name=kind, **fields)
        cases.append((spec, expected))
    return cases


_OVERRIDE_FLAGS = {opt.override: opt.flag for opt in MODEL_OPTIONS}
_NSA_DIAG = (sys.executable, "-m", "nsa_diag")  # how a replay line starts nsa-diag: this interpreter


def _replay_order() -> tuple[str, ...]:
    """The `CaseSpec` options a replay line gives after its head, in the order replay lines have always had:
    single values, repeated options, flags, then values unset by default; each kind in `--help` order."""
    head = ("name", "preset", "model")

    def kind(field: str) -> int:
        value = CaseSpec.model_fields[field].default  # not CaseSpec(): its validator imports nsa_core
        return 3 if value is None else 2 if isinstance(value, bool) else 1 if isinstance(value, tuple) else 0

    in_help = [name for group in GROUPS for name in group.names if name in SPEC_OPTIONS and name not in head]
    return tuple(sorted(in_help, key=kind))


_REPLAY_ORDER = _replay_order()


def _replay_option(spec: CaseSpec, field: str) -> list[str]:
    """`field`'s option as `nsa-diag run` takes it; none if its `Opt.replay` is "changed" and it is not."""
    opt, value = SPEC_OPTIONS[field], getattr(spec, field)
    if opt.replay == "changed" and value == CaseSpec.model_fields[field].default:
        return []
    if isinstance(value, bool):
        return [opt.flag] if value else []
    if isinstance(value, tuple):
        return [part for item in value for part in (opt.flag, str(item))]
    return [] if value is None else [opt.flag, str(value)]


def replay_argv(spec: CaseSpec, out: Path) -> list[str]:
    """The command line that reproduces `spec`, its run folder under `out` (``replay.sh``; the one place it
    is built): `nsa-diag run`, or `ddp`, or for a property `verify --only`, or for a user's own command
    `watch`.

    The head says which case and which model: name, preset, the overrides (in their order), `--model`;
    then the other options (`_REPLAY_ORDER`), `nsa-diag ddp`'s own, and `--out`. A `watch` line gives its
    options, then the command after ``--``.
    """
    out_flag = ["--out", str(Path(out).resolve())]
    if spec.command is not None:  # `nsa-diag watch`: the spec holds the options it takes, and the command
        return [*_NSA_DIAG, "watch", *_replay_option(spec, "name"), *out_flag, *_watch_flags(spec)]
    if spec.check is not None:  # a property of `nsa-diag verify`: its replay checks it again
        argv = [*_NSA_DIAG, "verify", "--only", spec.check]
        skip: tuple[str, ...] = ("name", *CHECK_OMITS)
    else:
        command = "ddp" if spec.ddp is not None else "run"
        argv = [*_NSA_DIAG, command, *_replay_option(spec, "name")]
        skip = ()
    argv += _replay_option(spec, "preset")
    for key, value in spec.overrides.items():
        flag = _OVERRIDE_FLAGS.get(key, "--" + key.replace("_", "-"))
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    argv += _replay_option(spec, "model")
    for field in _REPLAY_ORDER:
        if field not in skip:
            argv += _replay_option(spec, field)
    if spec.ddp is not None:  # issue 6
        argv += ddp_flags(spec.ddp)
    return argv + out_flag


def _watch_flags(spec: CaseSpec) -> list[str]:
    """`nsa-diag watch`'s options of ``spec`` (its watchdog, the job's own, the probe's detail), then
    ``--`` and the user's command."""
    cmd = spec.command
    assert cmd is not None
    argv = ["--stall", str(spec.stall)]
    argv += ["--timeout", f"{spec.timeout:g}"] if spec.timeout is not None else []
    argv += ["--keep-alive"] * cmd.keep_alive
    argv += ["--total-steps", str(cmd.total_steps)] if cmd.total_steps else []
    if cmd.straggler_ratio != CommandSpec.model_fields["straggler_ratio"].default:
        argv += ["--straggler-ratio", f"{cmd.straggler_ratio:g}"]
    argv += _replay_option(spec, "branch_marks")
    return [*argv, "--", *cmd.argv]


# --- nsa-diag ddp (issue 6): the ddp options checked, and the specs they make ------------------------------

DDP_BACKENDS = ("auto", "gloo", "nccl")


def ddp_flags(ds: DdpSpec) -> list[str]:
    """The `nsa-diag ddp` flags that reproduce ``ds``, for replay lines."""
    argv = ["--nproc", str(ds.nproc), "--backend", ds.backend]
    argv += ["--static-graph"] * ds.static_graph + ["--find-unused"] * ds.find_unused
    argv += ["--trace-buckets"] * ds.trace_buckets + ["--fsdp"] * ds.fsdp
    if ds.bucket_mb is not None:
        argv += ["--bucket-mb", f"{ds.bucket_mb:g}"]
    if ds.straggler_ratio != DdpSpec.model_fields["straggler_ratio"].default:
        argv += ["--straggler-ratio", f"{ds.straggler_ratio:g}"]
    if ds.nnodes > 1 or ds.rdzv_endpoint:
        argv += ["--nnodes", str(ds.nnodes), "--node-rank", str(ds.node_rank)]
        argv += ["--rdzv-endpoint", ds.rdzv_endpoint] if ds.rdzv_endpoint else []
    if ds.rdzv_timeout is not None:
        argv += ["--rdzv-timeout", f"{ds.rdzv_timeout:g}"]
    if ds.run_id is not None:
        argv += ["--run-id", ds.run_id]
    return argv


def resolve_backend(backend: str, device: str) -> str:
    """auto: nccl when the ranks run on CUDA (device cuda, or auto with a GPU), else gloo."""
    if backend != "auto":
        return backend
    return "nccl" if runs_on_cuda(device) else "gloo"


def check_nodes_options(options: CaseOptions) -> None:
    """The options of a multi-node case that can be wrong before its rendezvous is checked, as one
    `UsageError` line."""
    nnodes, run_id, rdzv_timeout = options.nnodes, options.run_id, options.rdzv_timeout
    if nnodes <= 1:
        for flag, value in (("--run-id", run_id), ("--rdzv-timeout", rdzv_timeout)):
            if value is not None:
                raise UsageError(f"{flag}: only for several nodes (--nnodes 2 or more)")
        return
    if rdzv_timeout is not None and rdzv_timeout <= 0:
        raise UsageError(f"--rdzv-timeout {rdzv_timeout:g}: give a number of seconds above 0")
    if run_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,99}", run_id):
        raise UsageError(
            f"--run-id {run_id!r}: letters, digits and . _ = + - (at most 100), first a letter or digit"
        )
    follow_ups = (
        ("--repeat", options.repeat > 1),
        ("--minimize", options.minimize),
        ("--triage", options.triage),
    )
    for flag, given in follow_ups:
        if given:
            raise UsageError(f"{flag}: not with --nnodes {nnodes}; its follow-up runs are one node's")


def check_ddp_options(options: CaseOptions, job: NodesJob | None = None) -> str:
    """Everything about the ddp options that can be wrong, as one `UsageError` line; the backend the ranks
    use (``auto`` resolved). ``job``: the ranks run on a Slurm job's nodes (``--executor slurm``), not
    here: auto is nccl when the job asks for GPUs (or ``--device cuda``), this machine's GPUs are not asked,
    and the endpoint is chosen on the nodes."""
    nproc, nnodes, node_rank = options.nproc, options.nnodes, options.node_rank
    backend, device, endpoint = options.backend, options.device.value, options.rdzv_endpoint
    here = job is None
    if job is not None and backend == "auto":
        backend = "nccl" if job.settings.gpus_per_node or device == "cuda" else "gloo"
    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: give 1 or more ranks per node")
    if nnodes < 1:
        raise UsageError(f"--nnodes {nnodes}: give 1 or more nodes")
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank {node_rank}: must be in 0..{nnodes - 1} with --nnodes {nnodes}")
    if nnodes > 1 and not endpoint and here:
        raise UsageError(f"--nnodes {nnodes}: give --rdzv-endpoint HOST:PORT, the same on every node")
    problem = None if endpoint is None else endpoint_problem(endpoint)
    if problem:
        raise UsageError(f"--rdzv-endpoint {problem}")
    if backend not in DDP_BACKENDS:
        raise UsageError(f"--backend {backend!r}: choose from {', '.join(DDP_BACKENDS)}")
    resolved = resolve_backend(backend, device)
    if resolved == "nccl" and here:
        if device == "cpu":
            raise UsageError("--backend nccl with --device cpu: NCCL needs CUDA tensors; use --backend gloo")
        if not cuda_available():
            raise UsageError("--backend nccl: torch sees no CUDA device here; use --backend gloo on the CPU")
        import torch  # here only: `nsa-diag --help` must not import torch

        gpus = torch.cuda.device_count()
        if nproc > gpus:
            raise UsageError(f"--nproc {nproc} with --backend nccl: only {gpus} GPU(s) here, one per rank")
    return resolved


def build_ddp_spec(
    options: CaseOptions, job: NodesJob | None = None, *, name: str | None = None, **fields: Any
) -> CaseSpec:
    """`build_spec` with ``spec.ddp`` from the ddp options, checked first (`check_ddp_options`); the ranks
    run on CUDA with nccl. ``job``: they run on its nodes, whose node 0 chooses the endpoint
    (`PENDING_ENDPOINT` until then)."""
    backend = check_ddp_options(options, job)
    ddp = {field: opt.from_command_line(getattr(options, field)) for field, opt in DDP_OPTIONS.items()}
    ddp["backend"] = backend
    if job is not None:
        ddp["rdzv_endpoint"] = PENDING_ENDPOINT
    device = "cuda" if backend == "nccl" else options.device.value
    return build_spec(options.replace(device=type(options.device)(device)), name=name, ddp=ddp, **fields)


def ddp_selftest_specs(
    options: CaseOptions, *, layers: int | None = None
) -> list[tuple[CaseSpec, Expectation]]:
    """`selftest --ddp`: skip-collective on rank 1 (hang, collective) and unused-param on every rank
    (grad-missing), each on the ranks of the ddp options (at least 2) of one node; ``layers``: a
    ``--model``'s."""
    options = options.replace(nproc=max(2, options.nproc))
    check_ddp_options(options)
    layer = (layers or model_config(options.preset.value, preset_overrides(options)).layers) - 1
    cases = [
        ("skip-collective:rank=1,step=1", Expectation("skip-collective", "hang", "collective")),
        (f"unused-param:layer={layer},step=1", Expectation("unused-param", "grad-missing")),
    ]
    return [
        (build_ddp_spec(options.replace(inject=(inject,)), name=f"ddp-{e.kind}"), e) for inject, e in cases
    ]


# --- a --model against what its pre-flight found (nsa_diag.launchers.preflight) -------------------------

_OPTIONS_BY_KEY = {opt.override: opt for opt in MODEL_OPTIONS}
_GC_KEYS = ("gc", "gc_reentrant")  # applied by nsa-diag to any model (nsa_diag.worker.contract)
_NSA_KEYS = tuple(
    CASE_OPTIONS[n].override for n in NSA.names if n not in _GC_KEYS
)  # window, sel_backend, ...
_SHAPE_KEYS = tuple(n for n in MODEL.names if n != "preset")  # layers, dim, heads, ...


def _flags(spec: CaseSpec, keys: Iterable[str]) -> str:
    return ", ".join(f"{_OPTIONS_BY_KEY[k].flag} {spec.overrides[k]}" for k in keys)


def check_model_facts(spec: CaseSpec, facts: ModelFacts, command: str | None = None) -> None:
    """Refuse, in one line, a ``--model`` that broke the contract and every option the model it builds would
    not take: NSA options, backend parity (``--reference-check``, ``verify``'s backends property) without
    nsa_core NSAAttention modules holding their values, model options the factory never reads (or whose
    value the model does not have), a fault on a layer it lacks or a recompute fault on a layer ``--gc``
    does not cover, a correctness property that rebuilds an nsa_core.TinyLM from its config. ``--vocab``
    is also the user's answer to what the vocabulary is (`nsa_diag.worker.contract.vocab_of`): taken
    unless the model declares another.

    ``command``: the command (``branch``, ``backend``, ``scale --per-branch``) that forced each case's
    branch or asked for the reference check itself; a refusal names it, not a flag the user never gave."""
    name = f"--model {spec.model}"
    if facts.problem:
        raise ConfigError(f"{name}: {facts.problem}")
    holds_nsa = bool(facts.nsa_layers) or facts.self_checkpointing
    if spec.check is not None:
        _check_property(spec, facts, holds_nsa)
    if spec.reference_check and not holds_nsa:
        asked = command if command is not None else "--reference-check"
        raise UsageError(
            f"{asked} with {name}: the check runs the model's nsa_core NSAAttention modules on the reference "
            f"backends, and {facts.type} holds none: there is nothing to compare"
        )
    if command is not None and "force_branch" in spec.overrides and not holds_nsa:
        raise UsageError(
            f"{command} with {name}: it runs each NSA branch alone through nsa_core's NSAAttention modules, "
            f"and {facts.type} holds none: there is no branch to run alone (nsa-diag run --model "
            f"{spec.model} runs the model whole)"
        )
    given = [key for key in spec.overrides if key not in _GC_KEYS]
    nsa = [k for k in given if k in _NSA_KEYS]
    if nsa and not holds_nsa:
        raise UsageError(
            f"{_flags(spec, nsa)}: set nsa_core's NSA attention, and {name} ({facts.type}) holds no "
            "NSAAttention module: they would change nothing; leave them out"
        )
    for key in given:
        value, found = spec.overrides[key], facts.nsa_values.get(key)
        if found is not None and found != [value]:
            shown = ", ".join(map(str, found))
            raise UsageError(
                f"{_flags(spec, [key])}: {name} built {key}={shown} from the spec; build it from "
                "spec.nsa_config() (or read spec.overrides) so that the option applies"
            )
        if found is None and key in _SHAPE_KEYS:
            actual = {"layers": facts.layers, "vocab": facts.vocab}.get(key)
            if actual is not None and actual != value:
                source = {"layers": facts.layers_attr, "vocab": facts.vocab_from}[key]
                raise UsageError(
                    f"{_flags(spec, [key])}: {name} built a model with {key} {actual} ({source})"
                )
            if key == "vocab":  # the user's answer to what the vocabulary is: used, or what the model says
                continue
            if key not in facts.read_overrides:
                raise UsageError(
                    f"{_flags(spec, [key])}: {name}'s factory never reads it (spec.overrides[{key!r}] or "
                    "spec.nsa_config()), so the model would run as built; leave it out"
                )
    gc = str(spec.overrides.get("gc", "none"))
    try:
        checkpointed = _gc_layers(gc, facts.layers)
    except ValueError as exc:
        raise UsageError(f"--gc {gc}: {name} has {facts.layers} layers: {_one_line(str(exc))}") from None
    for inj in spec.inject:
        if inj.layer >= facts.layers:
            raise UsageError(
                f"--inject {inj}: layer={inj.layer}, but {name}'s layers are 0..{facts.layers - 1} "
                f"({facts.layers_attr})"
            )
        if inj.phase == "recompute" and inj.layer not in checkpointed:
            raise UsageError(
                f"--inject {inj}: phase=recompute fires only when layer {inj.layer} is checkpointed; "
                f"add --gc all or --gc A:B covering it"
            )


def _check_property(spec: CaseSpec, facts: ModelFacts, holds_nsa: bool) -> None:
    """A ``verify`` property that cannot apply to the model (``spec.check``): the backends property needs
    nsa_core NSAAttention modules, the others an nsa_core.TinyLM to rebuild from its config. Said as the
    property's (``verify --only`` may not have been given), with the property that does apply, if any."""
    name = f"--model {spec.model}"
    if spec.check == "backends" and not holds_nsa:
        raise UsageError(
            f"verify with {name}: no property applies to {facts.type}: backends compares nsa_core "
            "NSAAttention modules on each backend, and it holds none; causality, prefill and gc rebuild the "
            "model from its nsa_core config, and it is no nsa_core.TinyLM"
        )
    if spec.check != "backends" and not facts.self_checkpointing:
        other = f"; verify --only backends {name} checks its NSAAttention modules" if holds_nsa else ""
        raise UsageError(
            f"verify's {spec.check} property with {name}: the property rebuilds the model from its nsa_core "
            f"config, which needs an nsa_core.TinyLM (or subclass), and {facts.type} is not one{other}"
        )


def _gc_layers(gc: str, layers: int) -> range:
    from nsa_core.config import parse_gc

    return parse_gc(gc, layers)
