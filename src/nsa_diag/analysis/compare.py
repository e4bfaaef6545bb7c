"""Two runs side by side (`nsa-diag compare A B`): environment, verdict changes, memory and time ratios.

Pure functions over plain records (`ComparedRun`, `ComparedCase`: what `nsa_diag.runfolder.load_run` read of
each run folder, `RunFolder.compared`); no processes, no files. Cases are matched by name. A case got
*worse* when it was ok in A (passed, or met its expectation: selftest, a matrix case with `expect`) and is
not ok in B; *better* the other way round; *changed* when both failed, in different ways; *not comparable*
when either side was skipped, is unchecked (its check did not run) or has no result (e.g. B ran where there
is no GPU, or was killed). Ratios are B/A: peak memory (only when both measured the same thing: CUDA max
allocated, or peak RSS), step time (the last step, warm) and tokens/s.

A ratio is given only where the two numbers measure the same thing, else it is *not comparable* and says
why (`not_comparable`): cases of different shapes (a spec field in `WORK_FIELDS` or a model override
differs, or they ran on different devices) do different work, so neither memory nor time compare; the
timings of a case of one step are its warm-up's (Triton compiles, the allocator settles: tokens/s over
steps 2.. does not exist), so step time and tokens/s do not compare (memory does: step 1 holds the peak).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

from pydantic import JsonValue

from nsa_diag.redact import is_secret_name

SAME = "same"
WORSE = "worse"
BETTER = "better"
CHANGED = "changed"
NOT_COMPARABLE = "not comparable"
CHANGES = (WORSE, BETTER, CHANGED, NOT_COMPARABLE, SAME)

_SPEC_IGNORED = {"name"}  # the case's folder name, already matched
# spec.json fields that change the work a case does (besides every model override, ``overrides.*``): the
# model and its shape, the tokens, the precision and device, a correctness check instead of steps, ranks,
# a job's command, faults that sleep or allocate, a reference check that runs a second model.
WORK_FIELDS = (
    "preset", "model", "layers_attr", "seq_len", "batch", "dtype", "device", "check", "ddp", "command",
    "inject", "reference_check",
)  # fmt: skip
RATIOS = ("peak_memory", "step_time", "tokens_per_s")
Fact = str | int | float | bool | None  # one fact of an environment, as compared


@dataclass(frozen=True)
class ComparedCase:
    """One case of a run as compare reads it: its name, its summary row and its spec."""

    name: str
    entry: Mapping[str, Any]  # a `CaseEntry` as JSON, or a stand-in when the case has no result
    spec: Mapping[str, Any] | None = None  # its spec.json; None when there is none


@dataclass(frozen=True)
class ComparedRun:
    """One run as compare reads it (from a run folder: `nsa_diag.runfolder.RunFolder.compared`)."""

    run_dir: str
    command: str
    cases: Sequence[ComparedCase]
    env: Mapping[str, Any] | None = None  # env.json; None when there is none
    nodes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # each node's env.json (multi-node)
    notes: Sequence[str] = ()  # what could not be read


class FactDifference(TypedDict):
    fact: str
    a: Fact
    b: Fact
    differs: bool


class VariableDifference(TypedDict):
    name: str
    a: str | None
    b: str | None


class EnvDifferences(TypedDict):
    """Two environments side by side (`env_differences`)."""

    a_recorded: bool
    b_recorded: bool
    facts: list[FactDifference]
    env_vars: list[VariableDifference]


class SpecDifference(TypedDict):
    """A field of spec.json (a model override as ``overrides.<field>``) that differs, both values."""

    field: str
    a: JsonValue
    b: JsonValue


class CaseSide(TypedDict):
    """One run's side of a case compared: its summary row's verdict, place, reason and numbers."""

    verdict: str | None
    hang_kind: str | None
    ok: bool | None
    where: str | None
    reason: str | None
    peak_memory_bytes: int | None
    peak_memory_kind: str | None
    step_s: float | None
    timed_steps: int | None
    tokens_per_s: float | None
    device: str | None


class CaseComparison(TypedDict):
    """A case in both runs: both sides, how its outcome moved, the ratios B/A (None where they do not
    compare like with like, and why) and the spec fields that differ."""

    name: str
    a: CaseSide
    b: CaseSide
    change: str
    ratios: dict[str, float | None]
    not_comparable: dict[str, str]
    spec_differences: list[SpecDifference]


class RunSide(TypedDict):
    run_dir: str
    command: str
    cases: int
    notes: list[str]


class RunComparison(TypedDict):
    """`compare A B` as JSON (``--json``): the runs, their environments (per node too), every case in
    both, the cases in one only, the counts per change and the cases that got worse; ``exit_code``."""

    a: RunSide
    b: RunSide
    environment: EnvDifferences
    nodes: dict[str, EnvDifferences]
    cases: list[CaseComparison]
    only_in_a: list[str]
    only_in_b: list[str]
    counts: dict[str, int]
    worse: list[str]
    exit_code: int


def env_facts(env: Mapping[str, Any] | None) -> dict[str, Fact]:
    """The facts of an env.json a diagnosis turns on, flat and labelled: versions (torch, CUDA, cuDNN,
    NCCL, Triton, driver), GPUs, the machine and the git revision. A missing fact is None, or why."""
    env = env or {}
    torch = env.get("torch") or {}
    nvml = env.get("nvml") or {}
    git = env.get("git") or {}
    cpu = env.get("cpu_memory") or {}
    python = env.get("python") or {}
    platform = env.get("platform") or {}
    system = env.get("system") or {}
    triton = env.get("triton") or {}
    torch_gpus = [f"{d.get('name')} (sm {d.get('capability')})" for d in torch.get("devices") or []]
    nvml_gpus = [str(g.get("name")) for g in nvml.get("gpus") or []]
    memory = cpu.get("memory_total_bytes")
    return {
        "nsa-diag": env.get("nsa_diag_version"),
        "python": python.get("version"),
        "python executable": python.get("executable"),
        "platform": platform.get("platform"),
        "host": platform.get("hostname"),
        "OS": system.get("os"),
        "libc": system.get("libc"),
        "gcc": system.get("gcc"),
        "CPU model": system.get("cpu_model"),
        "CPUs usable": cpu.get("cpu_count_usable"),
        "memory": f"{memory / 2**30:.1f} GiB" if isinstance(memory, int) else None,
        "torch": torch.get("version") or torch.get("why"),
        "torch git": torch.get("git_version"),
        "torch threads": torch.get("num_threads"),
        "CUDA (torch build)": torch.get("cuda_build"),
        "CUDA available": torch.get("cuda_available"),
        "cuDNN": torch.get("cudnn_version"),
        "NCCL": torch.get("nccl_version"),
        "Triton": triton.get("version") or triton.get("why"),
        "NVIDIA driver": nvml.get("driver_version") or (None if nvml.get("available") else nvml.get("why")),
        "CUDA driver": nvml.get("cuda_driver_version"),
        "GPUs": ", ".join(torch_gpus or nvml_gpus) or "none",
        "git revision": git.get("revision") or git.get("why"),
        "git dirty": git.get("dirty"),
    }


def env_differences(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> EnvDifferences:
    """Every fact of `env_facts` with both values and whether they differ, and the recorded environment
    variables (NSA_*, PYTORCH_*, ...) that are set on one side only or differ."""
    fa, fb = env_facts(a), env_facts(b)
    facts = [FactDifference(fact=k, a=fa[k], b=fb[k], differs=fa[k] != fb[k]) for k in fa]
    va, vb = (a or {}).get("env_vars") or {}, (b or {}).get("env_vars") or {}
    variables = [
        VariableDifference(name=name, a=va.get(name), b=vb.get(name))
        for name in sorted(set(va) | set(vb))
        if va.get(name) != vb.get(name) and not is_secret_name(name)  # an older env.json may hold one
    ]
    return EnvDifferences(a_recorded=a is not None, b_recorded=b is not None, facts=facts, env_vars=variables)


def _flat(spec: Mapping[str, JsonValue] | None) -> dict[str, JsonValue]:
    spec = spec or {}
    flat = {k: v for k, v in spec.items() if k != "overrides" and k not in _SPEC_IGNORED}
    flat.update({f"overrides.{k}": v for k, v in (spec.get("overrides") or {}).items()})
    return flat


def spec_differences(
    a: Mapping[str, JsonValue] | None, b: Mapping[str, JsonValue] | None
) -> list[SpecDifference]:
    """Fields of two spec.json that differ (model overrides as `overrides.<field>`); none when either is
    missing."""
    if a is None or b is None:
        return []
    fa, fb = _flat(a), _flat(b)
    return [
        SpecDifference(field=k, a=fa.get(k), b=fb.get(k))
        for k in sorted(set(fa) | set(fb))
        if fa.get(k) != fb.get(k)
    ]


def verdict_change(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """How a case's outcome moved from A to B (see the module docstring)."""
    va, vb = a.get("verdict"), b.get("verdict")
    if va == vb and a.get("hang_kind") == b.get("hang_kind"):
        return SAME
    if va is None or vb is None or {va, vb} & {"skipped", "unchecked", "not run"}:
        return NOT_COMPARABLE
    ok_a, ok_b = bool(a.get("ok")), bool(b.get("ok"))
    if ok_a and not ok_b:
        return WORSE
    if ok_b and not ok_a:
        return BETTER
    return CHANGED


def _ratio(b: Any, a: Any) -> float | None:
    if isinstance(a, int | float) and isinstance(b, int | float) and a > 0:
        return b / a
    return None


def ratios(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, float | None]:
    """B/A of peak memory (same measure on both sides only), step time and tokens/s."""
    same_measure = a.get("peak_memory_kind") == b.get("peak_memory_kind")
    return {
        "peak_memory": _ratio(b.get("peak_memory_bytes"), a.get("peak_memory_bytes"))
        if same_measure
        else None,
        "step_time": _ratio(b.get("step_s"), a.get("step_s")),
        "tokens_per_s": _ratio(b.get("tokens_per_s"), a.get("tokens_per_s")),
    }


def _value(value: Any) -> str:
    return "-" if value is None else str(value)


def not_comparable(
    a: Mapping[str, Any], b: Mapping[str, Any], differences: Sequence[Mapping[str, Any]]
) -> dict[str, str]:
    """Per ratio (`RATIOS`) that must not be given, why: different shapes (every ratio), or timings of
    warm-up only (step time and tokens/s). Empty when every ratio compares like with like."""
    shape = [
        f"{d['field']} {_value(d['a'])} -> {_value(d['b'])}"
        for d in differences
        if d["field"] in WORK_FIELDS or d["field"].startswith("overrides.")
    ]
    if a.get("device") and b.get("device") and a["device"] != b["device"]:
        shape.append(f"ran on {a['device']} -> {b['device']}")
    if shape:
        why = "different shapes: " + ", ".join(shape)
        return dict.fromkeys(RATIOS, why)
    warm_up = [side for side, s in (("A", a), ("B", b)) if s.get("timed_steps") == 0]
    if warm_up:
        # step 1 compiles kernels and settles the allocator: its time is no measure of the model's
        why = f"warm-up only: one step in {' and '.join(warm_up)} (timing steps 2.. needs --steps 2+)"
        return {"step_time": why, "tokens_per_s": why}
    return {}


_SIDE_KEYS = (
    "verdict",
    "hang_kind",
    "ok",
    "where",
    "reason",
    "peak_memory_bytes",
    "peak_memory_kind",
    "step_s",
    "timed_steps",
    "tokens_per_s",
    "device",
)


def _side(case: ComparedCase) -> CaseSide:
    return cast(CaseSide, {k: case.entry.get(k) for k in _SIDE_KEYS})


def compare_cases(a_cases: Sequence[ComparedCase], b_cases: Sequence[ComparedCase]) -> list[CaseComparison]:
    """One record per case name in both runs, in A's order."""
    by_name = {case.name: case for case in b_cases}
    records: list[CaseComparison] = []
    for case_a in a_cases:
        case_b = by_name.get(case_a.name)
        if case_b is None:
            continue
        side_a, side_b = _side(case_a), _side(case_b)
        differences = spec_differences(case_a.spec, case_b.spec)
        apart = not_comparable(side_a, side_b, differences)
        given = ratios(side_a, side_b)
        records.append(
            CaseComparison(
                name=case_a.name,
                a=side_a,
                b=side_b,
                change=verdict_change(side_a, side_b),
                ratios={key: None if key in apart else value for key, value in given.items()},
                not_comparable=apart,
                spec_differences=differences,
            )
        )
    return records


def compare_runs(a: ComparedRun, b: ComparedRun) -> RunComparison:
    """The whole comparison, JSON-ready; ``exit_code`` 1 when a case got worse, else 0."""
    cases = compare_cases(a.cases, b.cases)
    names_a, names_b = [c.name for c in a.cases], [c.name for c in b.cases]
    counts = {change: sum(1 for c in cases if c["change"] == change) for change in CHANGES}
    worse = [c["name"] for c in cases if c["change"] == WORSE]
    return RunComparison(
        a=RunSide(run_dir=a.run_dir, command=a.command, cases=len(a.cases), notes=list(a.notes)),
        b=RunSide(run_dir=b.run_dir, command=b.command, cases=len(b.cases), notes=list(b.notes)),
        environment=env_differences(a.env, b.env),
        # multi-node runs: each node's environment against the same node's of the other run
        nodes={n: env_differences(a.nodes.get(n), b.nodes.get(n)) for n in sorted({*a.nodes, *b.nodes})},
        cases=cases,
        only_in_a=[n for n in names_a if n not in set(names_b)],
        only_in_b=[n for n in names_b if n not in set(names_a)],
        counts=counts,
        worse=worse,
        exit_code=1 if worse else 0,
    )
