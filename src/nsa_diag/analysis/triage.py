"""`--triage`: why a case ran out of memory: fragmentation, capacity, or memory outside PyTorch.

On CUDA the case is run again twice with the caching allocator configured otherwise
(``PYTORCH_CUDA_ALLOC_CONF``, combined with the case's own ``alloc_conf``): ``expandable_segments:True``
(segments grow in place instead of new ones being cut, so free pieces are not stranded) and
``max_split_size_mb:128`` (large cached blocks are not split, so small requests do not fragment them).
The numbers at the failure come from the out-of-memory message PyTorch raised in the worker (kept in the
case's ``worker_result.json``): the request, the device total and free (the driver's view, as NVML's "used"
is total minus free), what PyTorch had allocated and what it held reserved but unallocated. Then:

- **fragmentation**: a rerun with an allocator setting passes, or the memory PyTorch held reserved but
  unallocated at the failure would have covered the request;
- **outside-pytorch**: the device's used memory minus PyTorch's reserved memory (CUDA context, NCCL and
  cuBLAS workspaces, other processes) is a large share of the device (`OUTSIDE_SHARE`);
- **capacity**: the reruns fail too and the request plus what was allocated is near the total
  (`CAPACITY_SHARE`), or the request alone is more than the device has;
- **undetermined**: none of these holds, or the numbers are missing; the record says what is known.

On the CPU there is no caching allocator to configure: nothing is rerun (the record says so) and the
classification uses the request in the CPU allocator's message against the machine's memory.

Pure: the message, the device's total and the reruns come from the caller (`nsa_diag.session.followups`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from nsa_diag.records import PeakMemory
from nsa_diag.spec import CaseResult, CaseSpec
from nsa_diag.summary import OomFigures, OomRerun, TriageRecord

OUTSIDE_SHARE = 0.10  # memory outside PyTorch above this share of the device: the cause
CAPACITY_SHARE = 0.90  # request + allocated above this share of the device: it does not fit
MAX_SPLIT_MB = 128
VARIANTS: tuple[tuple[str, str, str], ...] = (
    # (folder name, allocator key, value)
    ("expandable-segments", "expandable_segments", "True"),
    (f"max-split-{MAX_SPLIT_MB}mb", "max_split_size_mb", str(MAX_SPLIT_MB)),
)
_UNITS = {
    "bytes": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50, "eib": 2**60,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip
_SIZE = r"([0-9][0-9.,]*)\s*(bytes|[KMGTPE]i?B|B)"
_CUDA_PATTERNS = {
    "requested_bytes": re.compile(r"Tried to allocate " + _SIZE, re.I),
    "total_bytes": re.compile(r"total capacity of " + _SIZE, re.I),
    "free_bytes": re.compile(r"of which " + _SIZE + r" is free", re.I),
    "process_bytes": re.compile(r"this process has " + _SIZE + r" memory in use", re.I),
    "allocated_bytes": re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch", re.I),
    "reserved_unallocated_bytes": re.compile(_SIZE + r" is reserved by PyTorch but unallocated", re.I),
}
# A request beyond what the allocator can even express ("Tried to allocate more than 1EB memory."): a bound.
_CUDA_HUGE_REQUEST = re.compile(r"Tried to allocate more than ([0-9.]+)\s*([KMGTPE])B", re.I)
_OTHER_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use", re.I)
_CPU_REQUEST = re.compile(r"tried to allocate (\d+) bytes", re.I)


def parse_size(number: str, unit: str) -> int:
    """``("1.50", "GiB")`` -> bytes."""
    return int(float(number.replace(",", "")) * _UNITS[unit.lower()])


def parse_oom_message(message: str) -> OomFigures:
    """The numbers of an out-of-memory message: CUDA's caching allocator or the CPU allocator.

    Keys present only when the message has them: requested_bytes (``requested_is_lower_bound`` for CUDA's
    "more than 1EB"), total_bytes, free_bytes, process_bytes, allocated_bytes, reserved_unallocated_bytes,
    other_processes ({pid: bytes}); ``source`` is
    ``cuda-caching-allocator``, ``cpu-allocator`` or ``unknown``.
    """
    facts = OomFigures()
    if "CUDA out of memory" in message or "Tried to allocate" in message:
        facts.source = "cuda-caching-allocator"
        for key, pattern in _CUDA_PATTERNS.items():
            match = pattern.search(message)
            if match:
                setattr(facts, key, parse_size(match.group(1), match.group(2)))
        huge = _CUDA_HUGE_REQUEST.search(message)
        if huge and facts.requested_bytes is None:
            facts.requested_bytes = parse_size(huge.group(1), huge.group(2) + "iB")
            facts.requested_is_lower_bound = True
        others = {
            int(m.group(1)): parse_size(m.group(2), m.group(3)) for m in _OTHER_PROCESS.finditer(message)
        }
        if others:
            facts.other_processes = others
    elif (match := _CPU_REQUEST.search(message)) is not None:
        facts.source = "cpu-allocator"
        facts.requested_bytes = int(match.group(1))
    else:
        facts.source = "unknown"
    return facts


def combine_alloc_conf(existing: str | None, key: str, value: str) -> str | None:
    """`existing` PYTORCH_CUDA_ALLOC_CONF with ``key:value`` set (replacing the key's own value); None when
    `existing` already sets exactly that, so a rerun would change nothing."""
    items: list[tuple[str, str]] = []
    for part in (existing or "").split(","):
        k, sep, v = part.strip().partition(":")
        if k:
            items.append((k.strip(), v.strip() if sep else ""))
    if (key, value) in items:
        return None
    items = [(k, v) for k, v in items if k != key] + [(key, value)]
    return ",".join(f"{k}:{v}" for k, v in items)


def variant_specs(spec: CaseSpec) -> list[tuple[str, str, CaseSpec | None]]:
    """(name, alloc_conf, spec) per allocator variant; spec None when the case already runs with it."""
    variants = []
    for name, key, value in VARIANTS:
        conf = combine_alloc_conf(spec.alloc_conf, key, value)
        new = None if conf is None else CaseSpec.model_validate({**spec.model_dump(), "alloc_conf": conf})
        variants.append((name, conf or str(spec.alloc_conf), new))
    return variants


def _share(part: int | None, whole: int | None) -> float | None:
    return part / whole if part is not None and whole else None


def measure(facts: OomFigures, result: CaseResult) -> OomFigures:
    """The memory figures at the failure, derived from the message's facts and the case's metrics."""
    peak = result.metrics.peak_memory or PeakMemory()
    allocated, unallocated = facts.allocated_bytes, facts.reserved_unallocated_bytes
    reserved = allocated + unallocated if allocated is not None and unallocated is not None else None
    total, free = facts.total_bytes, facts.free_bytes
    used = total - free if total is not None and free is not None else None
    return OomFigures(
        requested_bytes=facts.requested_bytes,
        total_bytes=total,
        free_bytes=free,
        requested_is_lower_bound=bool(facts.requested_is_lower_bound),
        allocated_bytes=allocated,
        reserved_unallocated_bytes=unallocated,
        reserved_bytes=reserved,
        max_allocated_bytes=peak.cuda_max_allocated_bytes,
        max_reserved_bytes=peak.cuda_max_reserved_bytes,
        peak_rss_bytes=peak.cpu_peak_rss_bytes,
        device_used_bytes=used,
        outside_pytorch_bytes=used - reserved if used is not None and reserved else None,
        other_processes=facts.other_processes,
    )


def classify_oom(
    device: str,
    m: OomFigures,
    reruns: Sequence[OomRerun | Mapping[str, str | None]] = (),
) -> tuple[str, str]:
    """(class, why) from the figures at the failure `m` (`measure`) and the reruns' outcomes (records, or
    their JSON)."""
    passed = [r for r in reruns if r.get("verdict") == "pass"]
    if passed:
        names = " and ".join(str(r.get("alloc_conf")) for r in passed)
        return (
            "fragmentation",
            f"passes with PYTORCH_CUDA_ALLOC_CONF={names}: the allocator's layout, not the total",
        )
    req, total = m.requested_bytes, m.total_bytes
    if req is not None and total and req > total:
        where = "this machine's memory" if device == "cpu" else "the device's total"
        req_text = f"more than {_gib(req)}" if m.requested_is_lower_bound else _gib(req)
        return "capacity", f"the request alone ({req_text}) is more than {where} ({_gib(total)})"
    unalloc = m.reserved_unallocated_bytes
    if req is not None and unalloc is not None and unalloc >= req:
        return "fragmentation", (
            f"PyTorch held {_gib(unalloc)} reserved but unallocated, enough for the {_gib(req)} request, "
            "but not in one piece"
        )
    outside = m.outside_pytorch_bytes
    share = _share(outside, total)
    if share is not None and share >= OUTSIDE_SHARE:
        return "outside-pytorch", (
            f"{_gib(outside)} ({share:.0%} of the device) was in use outside PyTorch's reserved memory "
            "(device used minus reserved: CUDA context, other libraries, other processes)"
        )
    allocated = m.allocated_bytes
    if allocated is None and device == "cpu":
        allocated = m.peak_rss_bytes
    near = _share((req or 0) + (allocated or 0), total) if req is not None else None
    all_failed = bool(reruns) and all(r.get("verdict") == "oom" for r in reruns)
    if near is not None and near >= CAPACITY_SHARE:
        tail = "; the allocator settings fail too" if all_failed else ""
        return "capacity", f"request + allocated is {near:.0%} of the total{tail}"
    if all_failed:
        return "capacity", "fails with every allocator setting tried" + (
            f" (request + allocated {near:.0%} of the total)" if near is not None else ""
        )
    return "undetermined", "the figures at the failure point to no cause" + (
        "" if req is not None else " (the out-of-memory message gave no numbers)"
    )


def _gib(value: int | None) -> str:
    """Bytes as text in the largest binary unit that keeps the number at 1 or more (MiB at least)."""
    if value is None:
        return "?"
    for unit, size in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value / 2**20:.1f} MiB"


def triage_oom(
    spec: CaseSpec,
    result: CaseResult,
    message: str,
    run_trial: Callable[[CaseSpec], CaseResult],
    *,
    device_total: Callable[[bool], int | None] = lambda on_cuda: None,
    say: Callable[[str], None] = lambda text: None,
) -> TriageRecord:
    """Triage the oom case (`spec`, `result`, the worker's out-of-memory `message`): reruns on CUDA,
    then the class.

    `run_trial` runs a variant (named after it) wherever the caller keeps triage runs. `device_total(on_cuda)`
    is the memory of the device when the message does not say it (the machine's for the CPU). An interrupt
    ends the reruns; the class then comes from what ran (``interrupted`` true).
    """
    facts = parse_oom_message(message)
    on_cuda = (result.device or "").startswith("cuda") or facts.source == "cuda-caching-allocator"
    figures = measure(facts, result)
    reruns: list[OomRerun] = []
    note = None
    interrupted = False
    if not on_cuda:
        note = (
            "CPU: PYTORCH_CUDA_ALLOC_CONF configures CUDA's caching allocator and has no effect here, so "
            "nothing was rerun; classified from the CPU allocator's request against this machine's memory"
        )
        if figures.total_bytes is None:
            figures.total_bytes = device_total(False)
    else:
        if figures.total_bytes is None:  # e.g. "Tried to allocate more than 1EB memory."
            figures.total_bytes = device_total(True)
        for name, conf, variant in variant_specs(spec):
            if variant is None:
                reruns.append(
                    OomRerun(
                        name=name,
                        alloc_conf=conf,
                        verdict=None,
                        reason="the case already runs with this setting",
                    )
                )
                continue
            say(f"  rerun with PYTORCH_CUDA_ALLOC_CONF={conf} ...")
            try:
                rerun = run_trial(CaseSpec.model_validate({**variant.model_dump(), "name": name}))
            except KeyboardInterrupt:
                interrupted = True
                break
            reruns.append(
                OomRerun(
                    name=name, alloc_conf=conf, verdict=rerun.verdict, reason=rerun.reason,
                    peak_memory=rerun.metrics.peak_memory,
                )
            )  # fmt: skip
            say(f"  PYTORCH_CUDA_ALLOC_CONF={conf}: {rerun.verdict}")
    ran = [r for r in reruns if r.verdict is not None]
    kind, why = classify_oom("cuda" if on_cuda else "cpu", figures, ran)
    return TriageRecord.model_validate(
        {
            "case": spec.name,
            "device": result.device,
            "class": kind,
            "why": why,
            "figures": figures,
            "message": " ".join(message.split())[:600],
            "reruns": reruns,
            "note": note,
            "interrupted": interrupted,
        }
    )
