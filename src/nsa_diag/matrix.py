"""Matrix files: YAML lists of cases for `nsa-diag matrix`, validated and expanded into `CaseSpec`s.

A matrix file (the shipped ones: ``nsa_diag/matrices/*.yaml``; JSON schema in
``nsa_diag/matrices/schema.json``, ``nsa-diag schema matrix``):

    name: cpu-smoke                 # default: the file's stem
    defaults: {preset: tiny, seq_len: 32, batch: 1, device: cpu, stall: 10}
    axes:                           # every combination, over the defaults, is a case
      force_branch: [cmp, sel, win, all]
    cases:                          # each entry on top of the defaults
      - name: deadlock
        inject: ["deadlock:layer=1"]
        stall: 5
        expect: {verdict: hang, hang_kind: python-deadlock}
        tags: [fault]
      - name: sel                   # an entry with its own axes: every combination, over the entry
        force_branch: sel
        axes: {sel_backend: [masked, gather, packed]}

Keys are the `CaseSpec` fields (preset, seq_len, batch, steps, dtype, device, stall, timeout, inject as
``"KIND:k=v"`` strings, alloc_conf, reference_check, check, ...) and the flat model fields that
`nsa_core.preset` takes (layers, dim, sel_backend, gc, force_branch, ...), which become
`CaseSpec.overrides`; ``force_branch: all`` (or null) computes every branch. Matrix-only keys: ``name``,
``tags`` (added to the defaults' tags), ``requires: cuda`` (on a machine without CUDA the case is
``skipped``; ``device: cuda`` implies it) and ``expect: {verdict, hang_kind}`` (the case is ok when it
ends so, e.g. an injected fault that must be detected). An entry's key replaces the default's, an axis
value replaces both; an explicit ``null`` sets the field to null. Case names are given, or made from the
axis values (``branch=sel-S=128``), unique and folder-safe. A top-level ``slurm:`` section
(`nsa_diag.slurm.SlurmSettings`: partition, account, gpus_per_node, time, nodes, options) says how
``--executor slurm`` submits the cases; the command's Slurm options override it.

Everything that can be wrong with a file is found here, before anything runs: YAML syntax, duplicate
and unknown keys, wrong types, impossible geometry (`nsa_core`), faults that could never fire.
`MatrixFileError` carries one ``file:line: where: what`` line per problem.
"""

from __future__ import annotations

import difflib
import itertools
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypedDict

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    create_model,
)

from nsa_diag.cases import (
    MAX_TAG_CHARS,
    Expectation,
    check_model_factory,
    check_spec,
    default_seq_len,
    with_device_backends,
)
from nsa_diag.errors import ProblemsError, UsageError
from nsa_diag.options import CmpBackend, Prefill, SelBackend, WinBackend, literal_of
from nsa_diag.slurm import SlurmSettings
from nsa_diag.spec import CaseSpec, HangKind, Injection, Verdict

MAX_CASES = 2000
# Limits on what a file may ask of the loader before any of it is validated: a matrix file is a few KiB,
# nested a handful of levels; a "billion laughs" file of 549 bytes expands to 10^9 nodes through its
# aliases, and PyYAML's composer recurses once per level (5,000 levels: RecursionError).
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 100_000  # after alias expansion; 2000 cases of ~30 keys each stay well below
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$"  # CaseSpec.name: a folder name
_NAME_TEMPLATE = r"^[A-Za-z0-9{][A-Za-z0-9._=+{}-]*$"  # ... or a template of axis values: "sel-{sel_backend}"
_TAG = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"  # no comma: `--only a,b` separates tags with commas
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9._=+-]+")
# A name template's fields: "{sel_backend}" and nothing more (str.format would also read "{a.b}", "{a[0]}")
_TEMPLATE_FIELD = re.compile(r"\{([^{}]*)\}")

# CaseSpec fields a matrix sets by their own name (`name` is the matrix's; `overrides` are flat keys).
# `ddp` (several ranks through torchrun) is not a matrix key: `nsa-diag matrix` runs single-process cases;
# nor is `command` (a user's own command is `nsa-diag watch`'s).
SPEC_KEYS = tuple(k for k in CaseSpec.model_fields if k not in ("name", "overrides", "ddp", "command"))


def _injection_text(text: str) -> str:
    """An ``inject`` item: ``"KIND[:key=value,...]"``, checked as `--inject` checks it."""
    try:
        Injection.parse(text)
    except ValidationError as exc:
        parts = [
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else e["msg"] for e in exc.errors()
        ]
        raise ValueError(f"{text!r}: {'; '.join(parts)}") from None
    return text


InjectText = Annotated[str, AfterValidator(_injection_text)]
BranchChoice = Literal["cmp", "sel", "win", "all"]

# The flat `nsa_core.preset` overrides: type and meaning (the values are checked again by nsa_core).
MODEL_KEYS: dict[str, tuple[Any, str]] = {
    "vocab": (PositiveInt, "vocabulary size"),
    "dim": (PositiveInt, "model width"),
    "layers": (PositiveInt, "transformer blocks"),
    "heads": (PositiveInt, "query heads"),
    "kv_heads": (PositiveInt, "key/value heads (GQA groups); divides heads"),
    "head_dim": (PositiveInt, "dimension per head (even, for RoPE)"),
    "mlp_hidden": (PositiveInt | None, "SwiGLU hidden size; null: 8/3 dim"),
    "rope_theta": (PositiveFloat, "RoPE base"),
    "norm_eps": (PositiveFloat, "RMSNorm epsilon"),
    "prefill": (literal_of(Prefill), "how model(tokens) runs"),
    "gc": (str, "gradient checkpointing: none, all, or A:B (layers A..B-1)"),
    "gc_reentrant": (bool, "reentrant checkpointing"),
    "block_len": (PositiveInt, "compression block length l"),
    "block_stride": (PositiveInt, "compression stride d (divides l and l')"),
    "sel_block_len": (PositiveInt, "selection block length l'"),
    "n_sel": (PositiveInt, "selected blocks per query, forced ones included"),
    "n_init": (NonNegativeInt, "initial blocks always selected"),
    "n_local": (PositiveInt, "local blocks always selected"),
    "window": (PositiveInt, "sliding window w"),
    "sel_backend": (
        literal_of(SelBackend),
        "selection backend (a device: cuda case runs triton unless named)",
    ),
    "cmp_backend": (literal_of(CmpBackend), "compression backend"),
    "win_backend": (literal_of(WinBackend), "sliding-window backend"),
    "force_branch": (BranchChoice | None, "compute only this branch; all (or null): every branch"),
    "fused": (bool, "the three branches on triton as one op (default true); false composes them"),
}
AXIS_KEYS = (*SPEC_KEYS, *MODEL_KEYS)
AxisKey = Literal[AXIS_KEYS]  # type: ignore[valid-type]
# Short labels of generated case names: `branch=sel-S=128`.
_NAME_LABELS = {
    "seq_len": "S",
    "layers": "L",
    "batch": "B",
    "force_branch": "branch",
    "sel_backend": "sel",
    "cmp_backend": "cmp",
    "win_backend": "win",
    "alloc_conf": "alloc",
}


def _spec_field(name: str) -> tuple[Any, Any]:
    info = CaseSpec.model_fields[name]
    annotation: Any = tuple[InjectText, ...] if name == "inject" else info.annotation
    if info.metadata:
        annotation = Annotated[(annotation, *info.metadata)]
    description = info.description or {"inject": "faults to inject: 'KIND[:key=value,...]' strings"}.get(name)
    return annotation | None, Field(None, description=description)


class _CaseFieldsBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tags: tuple[Annotated[str, Field(pattern=_TAG)], ...] = Field(
        (), description="labels for `--only TAG`; an entry's tags add to the defaults' tags"
    )
    requires: Literal["cuda"] | None = Field(
        None, description="cuda: skipped (with the reason) where torch sees no CUDA device"
    )


CaseFields = create_model(  # type: ignore[call-overload]
    "CaseFields",
    __base__=_CaseFieldsBase,
    __doc__="Fields of a case: CaseSpec fields and flat model overrides; unset ones come from below.",
    **{name: _spec_field(name) for name in SPEC_KEYS},
    **{name: (kind | None, Field(None, description=text)) for name, (kind, text) in MODEL_KEYS.items()},
)

Axes = dict[AxisKey, Annotated[list[Any], Field(min_length=1)]]  # type: ignore[valid-type]


class Expect(BaseModel):
    """The outcome a case must have to count as ok (default: pass)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    verdict: Verdict
    hang_kind: HangKind | None = Field(None, description="for a hang: the kind it must have; null: any")


class CaseEntry(CaseFields):  # type: ignore[misc, valid-type]
    """One entry of `cases`: a case, or with `axes` every combination of their values over the entry."""

    name: Annotated[str, Field(pattern=_NAME_TEMPLATE)] | None = Field(
        None,
        description="case id (folder name); with axes, the prefix of the generated names, or a template "
        "of the axis values such as 'sel-{sel_backend}-S{seq_len}'",
    )
    expect: Expect | None = None
    axes: Axes = Field(default_factory=dict, description="key -> values: one case per combination")


class MatrixFile(BaseModel):
    """A matrix file: defaults, axes expanded as a product over the defaults, and listed cases."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="nsa-diag matrix file")

    name: Annotated[str, Field(pattern=_TAG, max_length=MAX_TAG_CHARS)] | None = Field(
        None, description="default: the file's stem (the run folder's tag)"
    )
    description: str | None = None
    defaults: CaseFields = Field(default_factory=CaseFields)  # type: ignore[valid-type]
    axes: Axes = Field(default_factory=dict, description="key -> values: one case per combination")
    cases: list[CaseEntry] = Field(default_factory=list)
    slurm: SlurmSettings | None = Field(
        None,
        description="how `--executor slurm` submits each case (the command's Slurm options override these)",
    )


def matrix_json_schema() -> dict[str, JsonValue]:
    """The JSON schema of matrix files (``nsa_diag/matrices/schema.json``)."""
    schema = MatrixFile.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


# --- errors with file lines -------------------------------------------------------------------------------


class MatrixFileError(ProblemsError):
    """A matrix file that cannot run: one ``file:line: where: what`` line per problem."""

    def __init__(self, path: Path | str, problems: Sequence[str]) -> None:
        self.path = str(path)
        super().__init__(f"matrix file {path}", problems)


Loc = tuple[str | int, ...]


def format_loc(loc: Iterable[str | int]) -> str:
    """``("cases", 2, "seq_len")`` -> ``cases[2].seq_len``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top)"


def _key_lines(text: str) -> tuple[dict[Loc, int], list[tuple[Loc, int, str]]]:
    """Line (1-based) of every key and list item of a YAML text; and its duplicate keys."""
    import yaml

    lines: dict[Loc, int] = {}
    duplicates: list[tuple[Loc, int, str]] = []

    def walk(node: Any, loc: Loc) -> None:
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in node.value:
                key = str(key_node.value)
                if key in seen:
                    duplicates.append(((*loc, key), key_node.start_mark.line + 1, key))
                seen.add(key)
                lines.setdefault((*loc, key), key_node.start_mark.line + 1)
                walk(value_node, (*loc, key))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[(*loc, i)] = item.start_mark.line + 1
                walk(item, (*loc, i))

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, ())
    return lines, duplicates


class _Problems:
    """Collects problems of one file, each with the line of the innermost known part of its location."""

    def __init__(self, path: Path, lines: Mapping[Loc, int]) -> None:
        self.path, self.lines = path, lines
        self.items: dict[tuple[str, str], list[str]] = {}  # (where, message) -> the cases it concerns
        self.order: dict[tuple[str, str], int] = {}  # -> its line, to list problems top to bottom

    def line(self, loc: Loc) -> int | None:
        for n in range(len(loc), 0, -1):
            if loc[:n] in self.lines:
                return self.lines[loc[:n]]
        return None

    def add(self, loc: Loc, message: str, case: str | None = None) -> None:
        line = self.line(loc)
        head = f"{self.path}:{line}" if line is not None else str(self.path)
        key = (f"{head}: {format_loc(loc)}", _one_line(message))
        self.order.setdefault(key, line or 0)
        cases = self.items.setdefault(key, [])
        if case is not None:
            cases.append(case)

    def lines_out(self) -> list[str]:
        out = []
        for where, message in sorted(self.items, key=self.order.__getitem__):
            cases = self.items[(where, message)]
            suffix = ""
            if len(cases) == 1:
                suffix = f" (case {cases[0]})"
            elif cases:
                suffix = f" ({len(cases)} cases: {', '.join(cases[:3])}{', ...' if len(cases) > 3 else ''})"
            out.append(f"{where}: {message}{suffix}")
        return out

    def raise_if_any(self) -> None:
        if self.items:
            raise MatrixFileError(self.path, self.lines_out())


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _did_you_mean(loc: Loc) -> str:
    """For an unknown key: the closest valid key at that level, if one is close."""
    parents = [part for part in loc[:-1] if isinstance(part, str)]
    if not parents:
        valid = MatrixFile.model_fields
    elif parents[-1] == "expect":
        valid = Expect.model_fields
    elif parents[-1] == "defaults":
        valid = CaseFields.model_fields
    elif parents[-1] == "slurm":
        valid = SlurmSettings.model_fields
    else:
        valid = CaseEntry.model_fields
    match = difflib.get_close_matches(str(loc[-1]), sorted(valid), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _add_validation_errors(problems: _Problems, exc: ValidationError) -> None:
    for err in exc.errors():
        loc: Loc = tuple(err["loc"])
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key" + _did_you_mean(loc)
        elif err["type"] == "literal_error" and loc[-1:] == ("[key]",):
            loc = loc[:-1]
            match = difflib.get_close_matches(str(loc[-1]), AXIS_KEYS, n=1)
            message = "not a case field, so not an axis" + (f" (did you mean {match[0]!r}?)" if match else "")
        problems.add(loc, message)


# --- expansion ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatrixCase:
    """One case of a matrix: its spec and what the matrix says about it."""

    spec: CaseSpec
    tags: tuple[str, ...] = ()
    axes: dict[str, Any] = field(default_factory=dict)  # the axis values that made it; {} for a listed case
    requires: str | None = None
    expect: Expectation | None = None
    origin: str = ""  # where in the file: "axes", "cases[3]"

    @property
    def name(self) -> str:
        return self.spec.name

    def needs_cuda(self) -> bool:
        return self.requires == "cuda" or self.spec.device == "cuda"


class ExpectJson(TypedDict):
    """What a case is expected to end as."""

    verdict: str
    hang_kind: str | None


class MatrixCaseJson(TypedDict):
    """One case of matrix.json: its tags, spec hash, the values of the axes that made it (the file's),
    what it needs and what it is expected to end as."""

    name: str
    tags: list[str]
    spec_hash: str
    axes: dict[str, Any]  # the user's values
    requires: str | None
    expect: ExpectJson | None


class MatrixJson(TypedDict):
    """matrix.json: the matrix file, its axes (the file's values), and its cases."""

    file: str
    name: str
    description: str | None
    axes: dict[str, list[Any]]  # the user's values
    cases: list[MatrixCaseJson]


@dataclass(frozen=True)
class Matrix:
    """A loaded matrix file: its cases in file order (top-level axes first, then the entries)."""

    path: Path
    name: str
    description: str | None
    axes: dict[str, list[Any]]  # every axis of the file (top level and entries), its values in order
    cases: list[MatrixCase]
    slurm: SlurmSettings | None = None  # the file's `slurm:` section

    def tags(self) -> list[str]:
        return sorted({tag for case in self.cases for tag in case.tags})

    def select(self, only: Sequence[str]) -> list[MatrixCase]:
        """The cases with one of the tags (or names) in `only`; all with none. `UsageError` for a tag or
        name that matches nothing."""
        if not only:
            return list(self.cases)
        known = set(self.tags()) | {case.name for case in self.cases}
        unknown = [item for item in only if item not in known]
        if unknown:
            raise UsageError(
                f"--only {','.join(only)}: {', '.join(unknown)} is neither a tag nor a case of {self.path}; "
                f"tags: {', '.join(self.tags()) or 'none'}"
            )
        wanted = set(only)
        return [case for case in self.cases if wanted & ({case.name, *case.tags})]

    def to_json(self, cases: Sequence[MatrixCase] | None = None) -> MatrixJson:
        """matrix.json: the file, the axes, and per case its tags, spec hash and axis values."""
        return MatrixJson(
            file=str(self.path),
            name=self.name,
            description=self.description,
            axes=self.axes,
            cases=[
                MatrixCaseJson(
                    name=case.name,
                    tags=list(case.tags),
                    spec_hash=case.spec.spec_hash(),
                    axes=case.axes,
                    requires=case.requires,
                    expect=(
                        ExpectJson(verdict=case.expect.verdict, hang_kind=case.expect.hang_kind)
                        if case.expect
                        else None
                    ),
                )
                for case in (self.cases if cases is None else cases)
            ],
        )


@dataclass
class _Draft:
    """A case before validation: its values and where each came from in the file."""

    values: dict[str, Any]
    origins: dict[str, Loc]
    tags: tuple[str, ...]
    axes: dict[str, Any]
    requires: str | None
    expect: Expect | None
    origin: Loc
    name: str = ""
    given_name: bool = False


def _set_fields(model: BaseModel, loc: Loc) -> tuple[dict[str, Any], dict[str, Loc]]:
    keys = [k for k in AXIS_KEYS if k in model.model_fields_set]  # a fixed order: names must be stable
    return {k: getattr(model, k) for k in keys}, {k: (*loc, k) for k in keys}


def _slug(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "+".join(_slug(v) for v in value) or "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = "none" if value is None else (f"{value:g}" if isinstance(value, float) else str(value))
    return _NOT_IN_NAME.sub("_", text).strip("_") or "_"


def _label(values: Mapping[str, Any]) -> str:
    return "-".join(f"{_NAME_LABELS.get(k, k)}={_slug(v)}" for k, v in values.items())


def _combinations(axes: Mapping[str, list[Any]]) -> int:
    count = 1
    for values in axes.values():
        count *= len(values)
    return count


def _points(axes: Mapping[str, list[Any]]) -> list[dict[str, tuple[int, Any]]]:
    """Every combination of the axes: key -> (index of the value, value), first axis slowest."""
    keys = list(axes)
    return [
        dict(zip(keys, combo, strict=True))
        for combo in itertools.product(*(list(enumerate(axes[k])) for k in keys))
    ]


def _check_axes(problems: _Problems, axes: Mapping[str, list[Any]], loc: Loc) -> bool:
    """Each axis value must be a valid value of its key."""
    ok = True
    for key, values in axes.items():
        for i, value in enumerate(values):
            try:
                CaseFields.model_validate({key: value})
            except ValidationError as exc:
                ok = False
                for err in exc.errors():
                    tail = tuple(err["loc"])[1:]
                    problems.add((*loc, key, i, *tail), str(err["msg"]).removeprefix("Value error, "))
    return ok


@dataclass
class _Parts:
    """The valid parts of a matrix file (all of them when it validated; else what can still be expanded)."""

    name: str | None
    description: str | None
    defaults: Any  # CaseFields
    slurm: SlurmSettings | None
    axes: dict[str, list[Any]]
    entries: list[tuple[int, CaseEntry]]  # with their index in `cases`


def _valid_parts(data: Mapping[str, Any]) -> _Parts | None:
    """After a failed validation: the defaults, axes and entries that are valid on their own, to find the
    problems of the expanded cases in the same pass. None when the defaults are invalid (every case is)."""
    try:
        defaults = CaseFields.model_validate(data.get("defaults") or {})
    except ValidationError:
        return None
    raw_axes = data.get("axes")
    axes = {
        key: values
        for key, values in (raw_axes.items() if isinstance(raw_axes, dict) else ())
        if key in AXIS_KEYS and isinstance(values, list) and values
    }
    entries = []
    raw = data.get("cases")
    for i, item in enumerate(raw if isinstance(raw, list) else []):
        try:
            entries.append((i, CaseEntry.model_validate(item)))
        except ValidationError:
            continue
    return _Parts(None, None, defaults, None, axes, entries)


def _drafts(doc: _Parts, problems: _Problems) -> list[_Draft]:
    base, base_origins = _set_fields(doc.defaults, ("defaults",))
    drafts: list[_Draft] = []

    def expand(
        values: dict[str, Any],
        origins: dict[str, Loc],
        axes: Mapping[str, list[Any]],
        axes_loc: Loc,
        entry: CaseEntry | None,
        origin: Loc,
    ) -> None:
        tags = tuple(dict.fromkeys((*doc.defaults.tags, *(entry.tags if entry else ()))))
        requires = (entry.requires if entry and entry.requires else None) or doc.defaults.requires
        points = _points(axes) if axes else [{}]
        for point in points:
            point_values = {k: v for k, (_, v) in point.items()}
            draft = _Draft(
                values={**values, **point_values},
                origins={**origins, **{k: (*axes_loc, k, i) for k, (i, _) in point.items()}},
                tags=tags,
                axes=point_values,
                requires=requires,
                expect=entry.expect if entry else None,
                origin=origin,
            )
            given = entry.name if entry else None
            if given is not None and "{" in given:
                unknown = [key for key in _TEMPLATE_FIELD.findall(given) if key not in point_values]
                if unknown:
                    problems.add(
                        (*origin, "name"),
                        f"template {given!r}: {{{unknown[0]}}} is not an axis of this entry",
                    )
                    continue
                draft.name = _TEMPLATE_FIELD.sub(lambda m, values=point_values: _slug(values[m[1]]), given)
                draft.given_name = True
            else:
                own = {k: v for k, v in values.items() if k in (entry.model_fields_set if entry else ())}
                label = _label(point_values) if point_values else (None if given else _label(own) or "case")
                draft.name = "-".join(part for part in (given, label) if part)
                draft.given_name = given is not None and not point_values
            drafts.append(draft)

    if doc.axes and _check_axes(problems, doc.axes, ("axes",)):
        expand(base, base_origins, doc.axes, ("axes",), None, ("axes",))
    for i, entry in doc.entries:
        values, origins = _set_fields(entry, ("cases", i))
        if entry.axes and not _check_axes(problems, entry.axes, ("cases", i, "axes")):
            continue
        expand(
            {**base, **values},
            {**base_origins, **origins},
            entry.axes,
            ("cases", i, "axes"),
            entry,
            ("cases", i),
        )
    return drafts


def _unique_names(drafts: list[_Draft], problems: _Problems) -> None:
    """Given names must be unique; a generated name that repeats one gets a suffix (.2, .3, ...)."""
    given: dict[str, Loc] = {}
    for draft in drafts:
        if draft.given_name:
            if draft.name in given:
                first = given[draft.name]
                problems.add(
                    (*draft.origin, "name"),
                    f"the template gives several cases the name {draft.name!r}; use every axis in it"
                    if first == draft.origin
                    else f"{draft.name!r} is already the name of {format_loc(first)}",
                )
            given.setdefault(draft.name, draft.origin)
    used = set(given)
    for draft in drafts:
        if draft.given_name:
            continue
        name, n = draft.name, 1
        while name in used:
            n += 1
            name = f"{draft.name}.{n}"
        draft.name = name
        used.add(name)


def _spec(draft: _Draft, problems: _Problems) -> CaseSpec | None:
    """The `CaseSpec` of a draft, or None after adding its problems."""
    import nsa_core

    values = dict(draft.values)
    overrides = {k: values.pop(k) for k in list(values) if k in MODEL_KEYS}
    if overrides.get("force_branch") == "all":
        overrides["force_branch"] = None
    preset = values.get("preset") or "tiny"
    try:
        cfg = nsa_core.preset(preset, **overrides)
    except ValueError as exc:
        problems.add(draft.origin, f"{exc}", draft.name)
        return None
    if values.get("seq_len") is None:
        values["seq_len"] = default_seq_len(cfg)
    if values.get("inject") is not None:
        values["inject"] = tuple(Injection.parse(text) for text in values["inject"])  # checked: CaseFields
    if values.get("model") is None:  # `device: cuda` runs the Triton kernels where no backend is named
        overrides = with_device_backends(overrides, values.get("device") == "cuda")
    try:
        spec = CaseSpec.model_validate({**values, "name": draft.name, "overrides": overrides})
    except ValidationError as exc:
        for err in exc.errors():
            key = str(err["loc"][0]) if err["loc"] else ""
            loc = draft.origins.get(key, draft.origin) + tuple(err["loc"])[1:]
            problems.add(loc, str(err["msg"]).removeprefix("Value error, "), draft.name)
        return None
    try:
        check_spec(spec)
        if spec.model is not None:
            check_model_factory(spec.model)
    except UsageError as exc:
        text = str(exc)
        key = next((k for k in ("inject", "seq_len", "model") if f"--{k.replace('_', '-')} " in text), "")
        problems.add(draft.origins.get(key, draft.origin), str(exc), draft.name)
        return None
    return spec


def _union_axes(drafts: Sequence[_Draft]) -> dict[str, list[Any]]:
    axes: dict[str, list[Any]] = {}
    for draft in drafts:
        for key, value in draft.axes.items():
            values = axes.setdefault(key, [])
            if value not in values:
                values.append(value)
    return axes


def _read_text(path: Path) -> str:
    """The text of a regular file of at most `MAX_FILE_BYTES` (not /dev/zero, not a FIFO); `UsageError`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO does not wait
    except FileNotFoundError:
        raise UsageError(f"matrix file {path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"matrix file {path}: cannot read it: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"matrix file {path}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise UsageError(f"matrix file {path}: cannot read it: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(
            f"matrix file {path}: larger than {MAX_FILE_BYTES // 1024} KiB, the most a matrix file holds"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"matrix file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _check_shape(path: Path, text: str) -> None:
    """Refuse a YAML text nested deeper than `MAX_DEPTH`, or that its aliases expand beyond `MAX_NODES`
    nodes, or that holds a recursive alias, from its event stream (nothing is built yet); `UsageError`."""
    import yaml

    depth = expanded = 0
    sizes: dict[str, int] = {}  # anchor -> nodes it stands for, once its node has ended
    open_nodes: list[tuple[str | None, int]] = []  # the collections being read: anchor, count at start
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1 if event.start_mark else 0
        if isinstance(event, yaml.AliasEvent):
            if any(anchor == event.anchor for anchor, _ in open_nodes):
                raise UsageError(f"matrix file {path}:{line}: alias *{event.anchor} is inside its own anchor")
            expanded += sizes.get(event.anchor or "", 1)  # an unknown anchor: the composer says so
        elif isinstance(event, yaml.CollectionStartEvent):
            expanded += 1
            depth += 1
            if depth > MAX_DEPTH:
                raise UsageError(f"matrix file {path}:{line}: nested deeper than {MAX_DEPTH} levels")
            open_nodes.append((event.anchor, expanded - 1))
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
            anchor, start = open_nodes.pop()
            if anchor is not None:
                sizes[anchor] = expanded - start
        elif isinstance(event, yaml.ScalarEvent):
            expanded += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        if expanded > MAX_NODES:
            raise UsageError(
                f"matrix file {path}:{line}: more than {MAX_NODES} values once its aliases are expanded"
            )


def load_matrix(path: Path | str) -> Matrix:
    """Read, validate and expand a matrix file; `MatrixFileError` listing every problem, `UsageError` for a
    file that cannot be read."""
    import yaml

    path = Path(path)
    text = _read_text(path)
    try:
        _check_shape(path, text)
        lines, duplicates = _key_lines(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise MatrixFileError(path, [f"{where}: YAML error: {_one_line(problem)}"]) from None
    problems = _Problems(path, lines)
    for loc, _, key in duplicates:
        problems.add(loc, f"duplicate key {key!r} (YAML keeps only the last one)")
    if not isinstance(data, dict):
        problems.add((), "a matrix file is a mapping with defaults, axes and/or cases")
        problems.raise_if_any()
    parts: _Parts | None
    try:
        doc = MatrixFile.model_validate(data)
        parts = _Parts(
            doc.name, doc.description, doc.defaults, doc.slurm, dict(doc.axes), list(enumerate(doc.cases))
        )
    except ValidationError as exc:
        _add_validation_errors(problems, exc)
        parts = _valid_parts(data)
        if parts is None:
            problems.raise_if_any()
    assert parts is not None
    if not parts.axes and not parts.entries and not problems.items:
        problems.add((), "no cases: give axes and/or cases")
    count = _combinations(parts.axes) if parts.axes else 0
    count += sum(_combinations(entry.axes) for _, entry in parts.entries)
    if count > MAX_CASES:
        problems.add((), f"{count} cases; a matrix holds at most {MAX_CASES}")
        problems.raise_if_any()

    drafts = _drafts(parts, problems)
    _unique_names(drafts, problems)
    cases = []
    for draft in drafts:
        spec = _spec(draft, problems)
        if spec is None:
            continue
        expect = (
            Expectation(spec.name, draft.expect.verdict, draft.expect.hang_kind) if draft.expect else None
        )
        requires = draft.requires or ("cuda" if spec.device == "cuda" else None)
        cases.append(MatrixCase(spec, draft.tags, draft.axes, requires, expect, format_loc(draft.origin)))
    problems.raise_if_any()
    return Matrix(path, parts.name or path.stem, parts.description, _union_axes(drafts), cases, parts.slurm)
