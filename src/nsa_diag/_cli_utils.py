"""Option aliases shared by the commands, so every command spells and documents them the same way."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print JSON to stdout instead of tables, for scripts."),
]

# `main()` reads --debug from the raw arguments before Typer parses them, so that it also applies to
# errors raised while parsing; commands declare it so that it is accepted after the command name too.
DebugOpt = Annotated[
    bool,
    typer.Option("--debug", help="On an error, show the full traceback, not only the one-line message."),
]
