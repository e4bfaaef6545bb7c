"""The toolkit's exceptions and the one table that turns any exception into an exit code and a message.

Exit codes (DESIGN.md): 2 for a usage or configuration error, 3 for an internal error of the toolkit.
`nsa_core` reports a broken contract (a bad shape, an invalid config) as `ValueError`; raised there it is
the user's configuration that is wrong, so it maps to 2. A `ValueError` from anywhere else is a bug of the
toolkit and maps to 3 like every other unexpected exception.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import typer

EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_ABORTED = 130  # as for Ctrl-C, which Typer turns into exit code 130 itself


class NsaDiagError(Exception):
    """Base of the toolkit's own errors."""


class UsageError(NsaDiagError):
    """The command line asks for something that cannot be done, e.g. a bad combination of options."""


class ConfigError(UsageError):
    """A model, case or matrix configuration is invalid."""


class InternalError(NsaDiagError):
    """An invariant of the toolkit broke: a bug to report."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _raised_in_nsa_core(exc: BaseException) -> bool:
    """Whether the innermost frame that raised `exc` belongs to the `nsa_core` package."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")).partition(".")[0] == "nsa_core"


def _is_validation_error(exc: BaseException) -> bool:
    from pydantic import ValidationError  # only on the error path: keeps `--help` fast

    return isinstance(exc, ValidationError)


def _validation_message(exc: BaseException) -> str:
    """One line per invalid field: `field.path: what is wrong`."""
    lines = [f"invalid {getattr(exc, 'title', 'input')}:"]
    for err in exc.errors():  # type: ignore[attr-defined]
        where = ".".join(str(part) for part in err["loc"]) or "(root)"
        lines.append(f"  {where}: {_one_line(err['msg'])}")
    return "\n".join(lines)


def _cli_message(exc: BaseException) -> str:
    message = exc.format_message()  # type: ignore[attr-defined]
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return _one_line(message).rstrip(".") + hint


@dataclass(frozen=True)
class ErrorMapping:
    """One row of the table: which exceptions it matches, their exit code and how to say what happened."""

    matches: Callable[[BaseException], bool]
    exit_code: int
    message: Callable[[BaseException], str]


def _of_type(*types: type[BaseException]) -> Callable[[BaseException], bool]:
    return lambda exc: isinstance(exc, types)


# First match wins. Every message is one line, except pydantic's: one line per invalid field.
ERROR_MAPPINGS: tuple[ErrorMapping, ...] = (
    # Typer's parsing errors: unknown option, missing or malformed value.
    ErrorMapping(_of_type(typer.TyperException), EXIT_USAGE, _cli_message),
    ErrorMapping(_of_type(typer.Abort), EXIT_ABORTED, lambda e: "aborted"),
    ErrorMapping(_of_type(ConfigError), EXIT_USAGE, lambda e: f"invalid configuration: {_one_line(str(e))}"),
    ErrorMapping(_of_type(UsageError), EXIT_USAGE, lambda e: _one_line(str(e))),
    ErrorMapping(_is_validation_error, EXIT_USAGE, _validation_message),
    ErrorMapping(
        lambda e: isinstance(e, ValueError) and _raised_in_nsa_core(e),
        EXIT_USAGE,
        lambda e: f"invalid configuration: {_one_line(str(e))}",
    ),
    ErrorMapping(_of_type(NsaDiagError), EXIT_INTERNAL, lambda e: f"internal error: {_one_line(str(e))}"),
    ErrorMapping(
        _of_type(BaseException),
        EXIT_INTERNAL,
        lambda e: _one_line(f"internal error: {type(e).__name__}: {e}".removesuffix(": ")),
    ),
)


def describe_error(exc: BaseException) -> tuple[int, str]:
    """The exit code and the message for `exc`, from the first row of `ERROR_MAPPINGS` that matches."""
    for mapping in ERROR_MAPPINGS:
        if mapping.matches(exc):
            return mapping.exit_code, mapping.message(exc)
    raise AssertionError("the last row of ERROR_MAPPINGS matches every exception")
