"""The `nsa-diag` command line: the Typer app, its commands, and `main()` with the exit-code contract.

Exit codes: 0 success; 1 some case did not pass; 2 a usage or configuration error (one line on stderr,
no traceback); 3 an internal error of the toolkit. `--debug` adds the traceback. Commands import torch
inside their functions, so `nsa-diag --help` never loads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Annotated, Any, NoReturn, TextIO

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

from nsa_diag import __version__, artifacts, interrupts, redact, render
from nsa_diag._cli_utils import DebugOpt
from nsa_diag.commands.attach import attach
from nsa_diag.commands.backend import backend
from nsa_diag.commands.branch import branch
from nsa_diag.commands.compare import compare
from nsa_diag.commands.ddp import ddp
from nsa_diag.commands.env import env
from nsa_diag.commands.fr import fr
from nsa_diag.commands.gc_bisect import gc_bisect
from nsa_diag.commands.matrix import matrix
from nsa_diag.commands.report import report
from nsa_diag.commands.run import run
from nsa_diag.commands.scale import scale
from nsa_diag.commands.schema import schema
from nsa_diag.commands.selftest import selftest
from nsa_diag.commands.verify import verify
from nsa_diag.commands.watch import watch
from nsa_diag.errors import EXIT_ABORTED, EXIT_INTERNAL, UsageError, describe_error, error_object

# Typer renders help as Markdown: single newlines join, blank lines separate paragraphs.
HELP = """\
Diagnostics for Native Sparse Attention (NSA) training.

It finds out, with evidence, whether a job is hung or only slow and where (phase, step, layer, branch,
stack samples), which branch or backend reproduces a failure, and whether the gradients match the
reference. Each case runs a few real training steps of the NSA model of `nsa_core` (or of your own,
`--model`) in a fresh worker process under a watchdog; every run leaves a folder with the verdicts,
the evidence and a `replay.sh` per case.

Verdicts: pass, hang, slow, oom, crash, error, nonfinite, grad-missing, mismatch, unchecked (a check
that could not run: never a pass), skipped.

Exit codes: 0 every case passed, 1 some case did not, 2 usage or configuration error, 3 internal error
(`--debug` shows its traceback), 130 interrupted.

Start with `nsa-diag branch` (four cases on the tiny CPU default, seconds) or
`nsa-diag run --inject deadlock:layer=1 --stall 5`. `scale` fits memory and time growth, `verify` checks
the correctness properties, `gc-bisect` finds the checkpointed layer range behind a failure, `ddp` runs the
case on several ranks through torchrun. `matrix NAME` runs a shipped matrix of cases (`matrix --list`;
or a file of yours), `report DIR` writes a run folder up as `report.md` with plots, `compare A B` diffs
two run folders. `attach PID` says what a job of yours that is already running is doing, without
stopping it.
"""


def _flags_without_metavar(params: list[Any]) -> list[Any]:
    """A flag takes no value: Typer (0.29) still shows its type, `<bool>`, in the help's type column; an
    empty metavar shows nothing there (also for Typer's own `--help` and completion flags)."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class _Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_without_metavar(super().get_params(ctx))


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_without_metavar(super().get_params(ctx))


app = typer.Typer(
    cls=_Group,
    name="nsa-diag",
    help=HELP,
    no_args_is_help=True,
    add_completion=True,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"nsa-diag {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: DebugOpt = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    pass


app.command("run", cls=_Command)(run)
app.command("branch", cls=_Command)(branch)
app.command("backend", cls=_Command)(backend)
app.command("selftest", cls=_Command)(selftest)
app.command("scale", cls=_Command)(scale)
app.command("verify", cls=_Command)(verify)
app.command("gc-bisect", cls=_Command)(gc_bisect)
app.command("ddp", cls=_Command)(ddp)
app.command("matrix", cls=_Command)(matrix)
app.command("report", cls=_Command)(report)
app.command("compare", cls=_Command)(compare)
app.command("env", cls=_Command)(env)
app.command("watch", cls=_Command, context_settings={"allow_interspersed_args": False})(watch)
app.command("attach", cls=_Command)(attach)
app.command("fr", cls=_Command)(fr)
app.command("schema", cls=_Command)(schema)


def report_error(
    exc: BaseException, *, debug: bool, stream: TextIO | None = None, json_stream: TextIO | None = None
) -> int:
    """Print what went wrong to `stream` (stderr) and return the exit code from the error table.

    Without `debug` the report is the message alone: one line (pydantic: one line per invalid field).
    `json_stream` (stdout under ``--json``) also gets the error as one JSON object (`error_object`). Known
    secrets are withheld in both (`artifacts.scrub`); ``--debug``'s traceback is shown as it is.
    """
    stream = stream or sys.stderr
    code, message = describe_error(exc)
    # a secret is withheld here as in the files (a --model factory's error that repeats HF_TOKEN's value)
    message = artifacts.scrub(message)
    if json_stream is not None:
        with contextlib.suppress(BrokenPipeError):  # the reader has gone: the exit code still says it
            print(json.dumps(artifacts.scrub_data(error_object(exc))), file=json_stream, flush=True)
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=stream)
    elif code == EXIT_INTERNAL:
        message += " (run again with --debug for the traceback)"
    print(f"nsa-diag: {message}", file=stream)
    return code


def _options(args: Sequence[str]) -> Sequence[str]:
    """The arguments before ``--`` (what follows is watch's command, not nsa-diag's)."""
    return args[: args.index("--")] if "--" in args else args


def _wants_debug(args: Sequence[str]) -> bool:
    return "--debug" in _options(args)


def _wants_json(args: Sequence[str]) -> bool:
    return "--json" in _options(args)


def _check_working_directory(args: Sequence[str]) -> None:
    """Every command runs in the working directory (a relative --out, a --model module, replay.sh's
    ``cd``): one removed under us (``cd d && rmdir ../d``) is said at once, before torch loads (its MKL
    dies on it: "Intel oneMKL FATAL ERROR"). Help and the version need none."""
    if {"-h", "--help", "--version"} & set(_options(args)):
        return
    try:
        os.getcwd()
    except FileNotFoundError:
        raise UsageError(
            "the working directory no longer exists (it was removed); cd into one that does and run again"
        ) from None


def run_cli(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on `argv` (default: the process arguments) and return the exit code.

    An error is one line on stderr (the error table, `nsa_diag.errors`); with ``--json`` also one JSON
    object on stdout, so that a script gets JSON whatever happened."""
    args = list(sys.argv[1:] if argv is None else argv) or ["--help"]
    # no file written will hold a secret of this environment or of the command line (watch's job's own)
    artifacts.withhold(redact.env_secret_values(os.environ) | redact.argv_secret_values([args]))
    json_stream = sys.stdout if _wants_json(args) else None
    try:
        _check_working_directory(args)
        result = app(args=args, prog_name="nsa-diag", standalone_mode=False)
    except Exception as exc:
        signum = interrupts.received()
        if signum is not None:  # an interrupt broke something mid-way (e.g. an import it cut short)
            name = signal.Signals(signum).name
            message = f"interrupted by {name} ({type(exc).__name__}: {exc})"
            if json_stream is not None:
                found = {"error": message, "exit_code": EXIT_ABORTED, "kind": "interrupted"}
                print(json.dumps(found), file=json_stream, flush=True)
            print(f"nsa-diag: {message}", file=sys.stderr)
            return EXIT_ABORTED
        return report_error(exc, debug=_wants_debug(args), json_stream=json_stream)
    return result if isinstance(result, int) else 0


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The CLI's entry point (`nsa_diag.__main__`, which installs the signal handlers before importing
    this module; installing them again here covers a caller that imports `main` directly)."""
    interrupts.install()
    code = run_cli(argv)
    try:  # what is still buffered for a reader that has gone must not turn the exit code into 120
        sys.stdout.flush()
    except BrokenPipeError:
        render.discard_closed_stream(sys.stdout)
    sys.exit(code)
