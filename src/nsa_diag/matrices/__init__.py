"""The matrix files shipped with nsa-diag (package data next to this file) and finding one by name.

``nsa-diag matrix cpu-smoke`` runs ``cpu-smoke.yaml`` of this folder, installed or not; a path to a file
of one's own still works (`resolve`). ``schema.json`` beside them is their JSON schema
(``nsa-diag schema matrix``), named by each file's ``yaml-language-server`` line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nsa_diag.errors import UsageError

# A regular folder in the source tree and in an installed wheel alike (pyproject.toml's package-data).
SHIPPED_DIR = Path(__file__).resolve().parent
SCHEMA = SHIPPED_DIR / "schema.json"


@dataclass(frozen=True)
class Shipped:
    """A shipped matrix: its name (the file's stem), its file and the one line of its ``description``."""

    name: str
    path: Path
    description: str


def shipped_paths() -> dict[str, Path]:
    """name -> file of every shipped matrix, by name."""
    return {path.stem: path for path in sorted(SHIPPED_DIR.glob("*.yaml"))}


def shipped() -> list[Shipped]:
    """Every shipped matrix with its description (read from the file alone: nothing is validated)."""
    import yaml

    found = []
    for name, path in shipped_paths().items():
        data = yaml.safe_load(path.read_text())
        text = data.get("description") if isinstance(data, dict) else None
        found.append(Shipped(name, path, " ".join(str(text or "").split())))
    return found


def resolve(name_or_path: str) -> Path:
    """The file `nsa-diag matrix NAME_OR_PATH` runs: a file that exists as given, else the shipped matrix of
    that name (``cpu-smoke`` or ``cpu-smoke.yaml``); `UsageError` naming the shipped ones otherwise."""
    given = Path(name_or_path)
    if given.exists():
        return given
    paths = shipped_paths()
    stem = given.name[: -len(given.suffix)] if given.suffix in (".yaml", ".yml") else given.name
    # matrices/cpu-smoke.yaml, the repository path of old, names the shipped file too
    if stem in paths and (len(given.parts) == 1 or given.parent.name == "matrices"):
        return paths[stem]
    raise UsageError(
        f"matrix {name_or_path}: no such file, and no shipped matrix of that name "
        f"(shipped: {', '.join(paths)}; `nsa-diag matrix --list` describes them)"
    )
