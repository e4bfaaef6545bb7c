"""The toolkit's exceptions and the one table that turns any exception into an exit code and a message.

Exit codes (DESIGN.md): 2 for a usage or configuration error, 3 for an internal error of the toolkit.
Each row also names the error's ``kind`` (usage, config, internal, aborted): with ``--json``, `main()`
prints `error_object` on stdout, so a script reads every outcome as JSON.
`nsa_core` reports a broken contract (a bad shape, an invalid config) as `ValueError`; raised there it is
the user's configuration that is wrong, so it maps to 2. A `ValueError` from anywhere else is a bug of the
toolkit and maps to 3 like every other unexpected exception.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict

import typer

EXIT_USAGE = 2
EXIT_INTERNAL = 3
# `watch`: the job hung (its evidence taken; stopped, or left running with --keep-alive). A scheduler or a
# retry loop tells it from a job that failed (exit code 1): a hang is worth a restart, a traceback is not.
EXIT_HANG = 4
EXIT_ABORTED = 130  # as for Ctrl-C, which Typer turns into exit code 130 itself


class NsaDiagError(Exception):
    """Base of the toolkit's own errors."""


class UsageError(NsaDiagError):
    """The command line asks for something that cannot be done, e.g. a bad combination of options."""


class ConfigError(UsageError):
    """A model, case or matrix configuration is invalid."""


class ProblemsError(ConfigError):
    """A configuration with several problems, said one per line under a headline (a matrix file:
    ``file:line: where: what``). ``what``: what is invalid, e.g. ``matrix file cases.yaml``."""

    def __init__(self, what: str, problems: Sequence[str]) -> None:
        self.what = what
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class DiskFullError(UsageError):
    """A file of the run folder could not be written: its file system is full (or over quota)."""


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


def _problems_message(exc: BaseException) -> str:
    assert isinstance(exc, ProblemsError)
    head = f"invalid {exc.what} ({len(exc.problems)} problem(s)):"
    return "\n".join([head, *(f"  {_one_line(problem)}" for problem in exc.problems)])


def _cli_message(exc: BaseException) -> str:
    message = exc.format_message()  # type: ignore[attr-defined]
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return _one_line(message).rstrip(".") + hint


@dataclass(frozen=True)
class ErrorMapping:
    """One row of the table: which exceptions it matches, their exit code, their kind (`error_object`'s
    ``kind``) and how to say what happened."""

    matches: Callable[[BaseException], bool]
    exit_code: int
    kind: str
    message: Callable[[BaseException], str]


def _of_type(*types: type[BaseException]) -> Callable[[BaseException], bool]:
    return lambda exc: isinstance(exc, types)


# First match wins. Every message is one line, except pydantic's (one line per invalid field) and a
# ProblemsError's (one line per problem).
ERROR_MAPPINGS: tuple[ErrorMapping, ...] = (
    # Typer's parsing errors: unknown option, missing or malformed value.
    ErrorMapping(_of_type(typer.TyperException), EXIT_USAGE, "usage", _cli_message),
    ErrorMapping(_of_type(typer.Abort), EXIT_ABORTED, "aborted", lambda e: "aborted"),
    ErrorMapping(_of_type(ProblemsError), EXIT_USAGE, "config", _problems_message),
    ErrorMapping(
        _of_type(ConfigError), EXIT_USAGE, "config", lambda e: f"invalid configuration: {_one_line(str(e))}"
    ),
    ErrorMapping(_of_type(UsageError), EXIT_USAGE, "usage", lambda e: _one_line(str(e))),
    ErrorMapping(_is_validation_error, EXIT_USAGE, "config", _validation_message),
    ErrorMapping(
        lambda e: isinstance(e, ValueError) and _raised_in_nsa_core(e),
        EXIT_USAGE,
        "config",
        lambda e: f"invalid configuration: {_one_line(str(e))}",
    ),
    ErrorMapping(
        _of_type(NsaDiagError), EXIT_INTERNAL, "internal", lambda e: f"internal error: {_one_line(str(e))}"
    ),
    ErrorMapping(
        _of_type(BaseException),
        EXIT_INTERNAL,
        "internal",
        lambda e: _one_line(f"internal error: {type(e).__name__}: {e}".removesuffix(": ")),
    ),
)


def _mapping(exc: BaseException) -> ErrorMapping:
    for mapping in ERROR_MAPPINGS:
        if mapping.matches(exc):
            return mapping
    raise AssertionError("the last row of ERROR_MAPPINGS matches every exception")


def describe_error(exc: BaseException) -> tuple[int, str]:
    """The exit code and the message for `exc`, from the first row of `ERROR_MAPPINGS` that matches."""
    mapping = _mapping(exc)
    return mapping.exit_code, mapping.message(exc)


class ErrorObject(TypedDict, total=False):
    """What ``--json`` prints on stdout for an error (`error_object`)."""

    error: str
    exit_code: int
    kind: str
    problems: list[str]


def error_object(exc: BaseException) -> ErrorObject:
    """What ``--json`` prints on stdout for `exc`: ``{"error": message, "exit_code": 2, "kind": "usage"}``
    (the message as on stderr, without ``nsa-diag: ``), with ``problems`` (one per line) where there are
    several."""
    mapping = _mapping(exc)
    found = ErrorObject(error=mapping.message(exc), exit_code=mapping.exit_code, kind=mapping.kind)
    if isinstance(exc, ProblemsError):
        found["problems"] = list(exc.problems)
    return found
