"""Option aliases shared by the commands, and the one function that gives a command the case options.

A case option is declared once (`nsa_diag.options` says where); this module only turns declarations into
Typer options. A case command names the option groups it takes (`options.MODEL`, `options.NSA`, ...) in
`case_options(...)`, optionally leaving some options out (`omit`) or changing their defaults (`defaults`),
and receives them collected in one `CaseOptions` value. The follow-up options (`--repeat`, `--minimize`,
`--triage`, `--junit`) are case options too: a command hands them to its `nsa_diag.session.Session`
(`follow=check_follow_ups(options)`), which honours them; a command that cannot honour one leaves its group
out or omits it.

Choices are `str` Enums (`nsa_diag.options`). Nothing here imports torch or `nsa_core` (whose package
imports torch), so `nsa-diag --help` stays instant; `tests/diag/test_commands.py` checks the choices against
`nsa_core`.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any, TypeVar

import typer

from nsa_diag.cases import CASE_OPTIONS, CaseOptions
from nsa_diag.options import (
    Branch,
    CmpBackend,
    Device,
    Dtype,
    Group,
    JobExecutor,
    Opt,
    Prefill,
    Preset,
    SelBackend,
    SubmititCluster,
    WinBackend,
)

__all__ = [
    "Branch",
    "CaseOptions",
    "CmpBackend",
    "DebugOpt",
    "Device",
    "Dtype",
    "JobExecutor",
    "JsonOpt",
    "Prefill",
    "Preset",
    "SelBackend",
    "SubmititCluster",
    "WinBackend",
    "case_options",
]

JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print the summary as JSON to stdout instead of tables, for scripts."),
]

# `main()` reads --debug from the raw arguments before Typer parses them, so that it also applies to
# errors raised while parsing; commands declare it so that it is accepted after the command name too.
DebugOpt = Annotated[
    bool,
    typer.Option("--debug", help="On an error, show the full traceback, not only the one-line message."),
]

# Where jobs run, and the Slurm settings of `--executor slurm` (`nsa_diag.slurm.SlurmSettings`:
# `settings_from_options` turns these into one; a matrix file's `slurm:` section gives the same fields).
_CLUSTER = "Cluster (--executor slurm)"
ExecutorOpt = Annotated[
    JobExecutor,
    typer.Option(
        "--executor",
        rich_help_panel=_CLUSTER,
        help="local: here, --jobs at a time. slurm: each case a Slurm job through submitit "
        "(pip install 'nsa-diag[slurm]'), its folder in the run folder, which must be on a filesystem the "
        "nodes share.",
    ),
]
NodesExecutorOpt = Annotated[  # `nsa-diag ddp`: where the case's nodes run
    JobExecutor,
    typer.Option(
        "--executor",
        rich_help_panel=_CLUSTER,
        help="local: this node's part, here. slurm: one Slurm job of --nnodes nodes through submitit "
        "(pip install 'nsa-diag[slurm]'), one torchrun per node; node ranks and the endpoint are chosen "
        "on the nodes; --out must be on a file system they share.",
    ),
]
PartitionOpt = Annotated[
    str | None, typer.Option("--partition", rich_help_panel=_CLUSTER, help="Slurm partition (sbatch -p).")
]
AccountOpt = Annotated[
    str | None, typer.Option("--account", rich_help_panel=_CLUSTER, help="Slurm account (sbatch -A).")
]
GpusPerNodeOpt = Annotated[
    int | None,
    typer.Option("--gpus-per-node", min=0, rich_help_panel=_CLUSTER, help="GPUs each job asks for."),
]
TimeOpt = Annotated[
    str | None,
    typer.Option(
        "--time",
        metavar="LIMIT",
        rich_help_panel=_CLUSTER,
        help="Time limit of each job: MINUTES, HH:MM:SS or D-HH:MM:SS [default: the case's timeout + 5 min].",
    ),
]
SubmititClusterOpt = Annotated[
    SubmititCluster | None,
    typer.Option(
        "--submitit-cluster",
        rich_help_panel=_CLUSTER,
        help="slurm (default), or local: submitit's local executor runs each job as a process on this "
        "machine through the same submission path, to try a file and its slurm: section without a cluster.",
        show_default=False,
    ),
]
SlurmOptOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--slurm-opt",
        metavar="KEY=VALUE",
        rich_help_panel=_CLUSTER,
        help="Any other sbatch option, repeatable: --slurm-opt qos=high --slurm-opt constraint=h100.",
    ),
]

F = TypeVar("F", bound=Callable[..., Any])


def typer_annotation(opt: Opt, panel: str, default: Any = None) -> Any:
    """The `Annotated` type through which Typer reads `opt`, listed in the help panel `panel`; ``default``
    the command's own default where it replaces the declared one (`case_options`'s ``defaults``)."""
    declared = opt.default if default is None else default
    return Annotated[
        opt.type if declared is not None else opt.type | None,
        typer.Option(
            opt.flag,
            rich_help_panel=panel,
            help=opt.help,
            metavar=opt.metavar,
            min=opt.min,
            max=opt.max,
            show_default=declared is not None and declared != (),
            **dict(opt.typer),
        ),
    ]


def _is_repeated(opt: Opt) -> bool:
    return typing.get_origin(opt.type) is list


def case_options(
    *groups: Group, omit: Collection[str] = (), defaults: Mapping[str, Any] | None = None
) -> Callable[[F], Callable[..., Any]]:
    """Give a command the case options of `groups`, less `omit`, with `defaults` replacing declared defaults.

    The decorated function takes a `CaseOptions` as its first parameter, then its own options. Typer reads
    options from a signature, so this is where one is built (and the only place): the function returned
    has keyword parameters for the groups' options, in the groups' order, then the command's own. Options
    not taken keep their default (or the one in `defaults`) in the `CaseOptions` the command receives.
    """
    defaults = dict(defaults or {})
    taken = {name: group.title for group in groups for name in group.names if name not in omit}
    unknown = (set(omit) | set(defaults)) - set(CASE_OPTIONS)
    assert not unknown, f"unknown case options {sorted(unknown)}"

    def decorate(fn: F) -> Callable[..., Any]:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]
        shared = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults.get(name, CASE_OPTIONS[name].default),
                annotation=typer_annotation(
                    CASE_OPTIONS[name], panel, defaults.get(name, CASE_OPTIONS[name].default)
                ),
            )
            for name, panel in taken.items()
        ]
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        fixed = {
            name: defaults.get(name, opt.default) for name, opt in CASE_OPTIONS.items() if name not in taken
        }

        def command(**kwargs: Any) -> Any:
            values = {**fixed, **{p.name: kwargs.pop(p.name) for p in shared}}
            for name, opt in CASE_OPTIONS.items():
                if _is_repeated(opt):
                    values[name] = tuple(values[name] or ())
            return fn(CaseOptions(**values), **kwargs)

        parameters = shared + own  # `--help` lists panels in order of first appearance: the model first
        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        command.__name__ = fn.__name__
        command.__qualname__ = fn.__qualname__
        command.__doc__ = fn.__doc__
        command.__module__ = fn.__module__
        return command

    return decorate
