"""The package's import structure (DESIGN.md): nsa_diag in layers, each importing only the layers below it.

Every import counts, at module level and inside functions (an import inside a function still couples the
two modules; it only hides a cycle). Imports under ``if TYPE_CHECKING:`` are left out: they exist for type
hints alone and never run. Three rules:

- no import cycle between modules of nsa_diag;
- no private name (``_x``) taken from another module;
- no module imports a module of a higher layer (`LAYERS`, lowest first).

And three about what crosses a boundary, type hints included (a type taken from above is a dependency too):

- nothing below the face (the CLI: `_cli_utils`, commands, app) imports it;
- the probe, which a user's process loads, imports only the wire format (`nsa_diag.beacon`, `nsa_diag.wire`)
  and the standard library (and `nsa_diag.redact`, standard library only itself; torch and nsa_core only
  inside functions, once the job has imported them);
- analysis takes plain records: it imports neither the readers of run folders nor evidence modules.

nsa_core never imports nsa_diag.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Lowest first; a module belongs to the layer of the longest prefix that names it or a package above it.
# A new module is placed here, or the test says so.
LAYERS: tuple[tuple[str, ...], ...] = (
    # the vocabulary: specs and results, option declarations, file names and atomic writes (the logs: their
    # cap), which values
    # are secrets, errors, the shipped matrices, Slurm settings (a matrix file's `slurm:` section) and
    # submitit's executor; the wire format (beacon), parsed stacks and the one stop routine; the records
    # that pass between the layers
    ("nsa_diag.errors", "nsa_diag.options", "nsa_diag.records", "nsa_diag.spec", "nsa_diag.summary",
     "nsa_diag.artifacts",
     "nsa_diag.logcap",
     "nsa_diag.redact",
     "nsa_diag.cases", "nsa_diag.matrix", "nsa_diag.matrices", "nsa_diag.beacon", "nsa_diag.wire",
     "nsa_diag.stackframes", "nsa_diag.devices",
     "nsa_diag.interrupts", "nsa_diag.stopping", "nsa_diag.guard", "nsa_diag.probe", "nsa_diag.slurm"),
    # pure analysis and evidence taking
    ("nsa_diag.analysis", "nsa_diag.evidence"),
    # one case's judgement (watchdog, classify, results) and the child-process side (worker)
    ("nsa_diag.watchdog", "nsa_diag.classify", "nsa_diag.results", "nsa_diag.worker", "nsa_diag.activity"),
    ("nsa_diag.launchers",),
    ("nsa_diag.executor", "nsa_diag.node"),
    # presentation: tables, reports, plots, JUnit, run folders read back
    ("nsa_diag.render", "nsa_diag.plots", "nsa_diag.junit", "nsa_diag.runfolder", "nsa_diag.report"),
    ("nsa_diag.session",),
    ("nsa_diag._cli_utils", "nsa_diag.commands"),
    ("nsa_diag.app", "nsa_diag.__main__", "nsa_diag.demo"),
)  # fmt: skip


def _modules(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / package).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


def _imports(
    module: str, path: Path, known: set[str], type_checking: bool = False
) -> Iterator[tuple[str, str | None]]:
    """(imported module, name taken from it or None) for every import of ``module``; with
    ``type_checking``, those under ``if TYPE_CHECKING:`` too."""
    tree = ast.parse(path.read_text())
    skipped = set() if type_checking else _type_checking_only(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub, None) if sub in known else (base, alias.name)


def _graph(package: str, type_checking: bool = False) -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules(package)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for module, path in modules.items():
        for target, name in _imports(module, path, set(modules), type_checking):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if not target or target == module or module.startswith(target + "."):
                continue
            edges[module].add(target)
            if name and name.startswith("_") and not name.startswith("__"):
                private.append(f"{module} imports {target}.{name}")
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str) -> int | None:
    """The rank in `LAYERS` of the longest prefix naming ``module``; None where none does."""
    matches = [
        (len(prefix), rank)
        for rank, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1] if matches else None


# nsa_diag's import graph, parsed when a test first asks for it, not at collection (every pytest-xdist
# process collects this module, ~1.8 s of CPU each; one runs its tests): the edges, the private names
# that cross a module, and the edges with the imports for type hints alone (`_hinted`).
MODULES = sorted(_modules("nsa_diag"))


@functools.cache
def _nsa_diag_graph(type_checking: bool) -> tuple[dict[str, set[str]], list[str]]:
    return _graph("nsa_diag", type_checking=type_checking)


def _edges() -> dict[str, set[str]]:
    return _nsa_diag_graph(False)[0]


def _private() -> list[str]:
    return _nsa_diag_graph(False)[1]


def _hinted() -> dict[str, set[str]]:
    return _nsa_diag_graph(True)[0]


CLI = ("nsa_diag._cli_utils", "nsa_diag.commands", "nsa_diag.app", "nsa_diag.__main__", "nsa_diag.demo")
WIRE = ("nsa_diag.beacon", "nsa_diag.wire")
# What else the probe may import of nsa_diag: which values are secrets (standard library only itself).
PROBE_ALSO = ("nsa_diag.redact",)
PROBE_LATE = ("torch", "nsa_core")  # inside functions only: the job imported them, the probe follows
RUN_FOLDER_READERS = ("nsa_diag.runfolder", "nsa_diag.report", "nsa_diag.results", "nsa_diag.artifacts")


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _top_level_imports(path: Path) -> Iterator[tuple[str, bool]]:
    """(imported module, whether the import runs at import time: not inside a function) for every import
    of the file, those for type hints alone left out."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    in_function = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            yield name, id(node) not in in_function


def test_no_import_cycle() -> None:
    assert _cycles(_edges()) == []


def test_no_private_name_crosses_a_module() -> None:
    assert _private() == []


def test_every_module_has_a_layer() -> None:
    assert [m for m in _edges() if m != "nsa_diag" and layer_of(m) is None] == []


@pytest.mark.parametrize("module", MODULES)
def test_imports_only_its_layer_or_below(module: str) -> None:
    rank = layer_of(module)
    if rank is None:
        return  # the package itself; test_every_module_has_a_layer names any other
    upward = [t for t in sorted(_edges()[module]) if (layer_of(t) or 0) > rank]
    assert upward == [], f"{module} (layer {rank}) imports higher layers: {upward}"


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    """The walk itself works: a planted cycle is found, and a planted upward import is."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert layer_of("nsa_diag.executor") > layer_of("nsa_diag.launchers.worker")
    assert _edges()["nsa_diag.session.core"] >= {"nsa_diag.executor"}


def test_nothing_below_the_face_imports_the_cli() -> None:
    """The CLI's types and helpers stay in the CLI: what the session needs of them lives below it."""
    face = min(layer_of(m) or 0 for m in _hinted() if _under(m, CLI))
    found = [
        f"{module} imports {target}"
        for module, targets in sorted(_hinted().items())
        if (layer_of(module) or 0) < face
        for target in sorted(targets)
        if _under(target, CLI)
    ]
    assert found == []


def test_the_probe_imports_only_the_wire_format_and_the_standard_library() -> None:
    """A user's process loads the probe: it must not pay for (or break on) pydantic, typer or our worker."""
    allowed = {"nsa_diag.probe", *WIRE, *PROBE_ALSO}
    found = [
        f"{module} imports {target}"
        for module, targets in sorted(_hinted().items())
        if _under(module, ("nsa_diag.probe",))
        for target in sorted(targets)
        if not _under(target, tuple(allowed))
    ]
    assert found == []
    for module, path in _modules("nsa_diag").items():
        if not _under(module, ("nsa_diag.probe", *WIRE, *PROBE_ALSO)):
            continue
        for name, at_import in _top_level_imports(path):
            top = name.partition(".")[0]
            if top in sys.stdlib_module_names or (top == "nsa_diag" and _under(name, tuple(allowed))):
                continue
            late = not at_import and _under(name, PROBE_LATE) and module.startswith("nsa_diag.probe")
            assert late, f"{module} imports {name}" + (" at import time" if _under(name, PROBE_LATE) else "")


def test_analysis_imports_neither_run_folder_readers_nor_evidence() -> None:
    """Analysis is pure: its callers read the files and take the evidence, and pass it plain records."""
    found = [
        f"{module} imports {target}"
        for module, targets in sorted(_hinted().items())
        if _under(module, ("nsa_diag.analysis",))
        for target in sorted(targets)
        if _under(target, ("nsa_diag.evidence", *RUN_FOLDER_READERS))
    ]
    assert found == []


def test_the_boundary_rules_see_what_they_forbid() -> None:
    """Imports for type hints alone count for the boundary rules; the probe's late torch import is seen."""
    assert (
        "nsa_diag.cases" in _hinted()["nsa_diag.session.followups"] - _edges()["nsa_diag.session.followups"]
    )
    assert dict(_top_level_imports(_modules("nsa_diag")["nsa_diag.probe.hooks"]))["nsa_core"] is False
    assert _under("nsa_diag.commands.run", CLI)
    assert not _under("nsa_diag.commandsx", CLI)


def test_nsa_core_never_imports_nsa_diag() -> None:
    edges, _ = _graph("nsa_core")
    imports = {
        target
        for module, path in _modules("nsa_core").items()
        for target, _name in _imports(module, path, set())
        if target.split(".")[0] == "nsa_diag"
    }
    assert edges
    assert imports == set()
