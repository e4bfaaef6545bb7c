"""Output for people and for scripts: Rich tables on stdout, JSON on stdout, diagnostics on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nsa_diag.evidence.env import ENV_VAR_PREFIXES

if TYPE_CHECKING:
    from rich.console import Console

_SECTION_TITLES = {
    "python": "Python",
    "platform": "Platform",
    "cpu_memory": "CPU and memory",
    "torch": "torch",
    "triton": "Triton",
    "nvml": "NVIDIA driver (NVML)",
    "git": "git",
}


def stdout_console() -> Console:
    from rich.console import Console

    return Console()


def stderr_console() -> Console:
    from rich.console import Console

    return Console(stderr=True)


def print_json(data: Any) -> None:
    """`data` as indented JSON on stdout (no Rich: machines read this)."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _format_value(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and key.endswith("_bytes"):
        return f"{value / 2**30:.1f} GiB"
    return str(value)


def _rows(section: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, value in section.items():
        if isinstance(value, list):  # devices: one row each
            if not value:
                rows.append((key, "none"))
            for item in value:
                fields = ", ".join(f"{k}={_format_value(k, v)}" for k, v in item.items() if k != "index")
                rows.append((f"{key}[{item.get('index', '?')}]", fields))
        else:
            rows.append((key, _format_value(key, value)))
    return rows


def render_env(snapshot: Mapping[str, Any], console: Console | None = None) -> None:
    """The environment snapshot as two tables: the facts, then the recorded environment variables."""
    from rich.table import Table

    console = console or stdout_console()
    facts = Table(title=f"nsa-diag {snapshot['nsa_diag_version']} environment", title_justify="left")
    facts.add_column("section", style="bold")
    facts.add_column("fact")
    facts.add_column("value", overflow="fold")
    for section, title in _SECTION_TITLES.items():
        for index, (key, value) in enumerate(_rows(snapshot[section])):
            facts.add_row(title if index == 0 else "", key, value)
        facts.add_section()
    facts.add_row("collected at", "", snapshot["collected_at"])
    console.print(facts)

    env_vars = snapshot["env_vars"]
    prefixes = ", ".join(f"{prefix}*" for prefix in ENV_VAR_PREFIXES)
    variables = Table(
        title="environment variables",
        title_justify="left",
        caption=f"only {prefixes} are recorded",
        caption_justify="left",
    )
    variables.add_column("name", style="bold")
    variables.add_column("value", overflow="fold")
    for name, value in env_vars.items():
        variables.add_row(name, value)
    if not env_vars:
        variables.add_row("(none set)", "")
    console.print(variables)
