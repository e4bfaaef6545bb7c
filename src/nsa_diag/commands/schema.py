"""`nsa-diag schema`: the JSON schema of a case (spec.json) or of a result (result.json)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from nsa_diag._cli_utils import DebugOpt


class SchemaName(str, Enum):
    spec = "spec"
    result = "result"


def schema(
    name: Annotated[
        SchemaName, typer.Argument(help="spec: a case, as in spec.json; result: result.json.")
    ] = SchemaName.spec,
    debug: DebugOpt = False,
) -> None:
    """Print the JSON schema of a case spec (spec.json, and the cases of matrix files) or of a result.

    Every field with its type, default and meaning; unknown fields are rejected.

    Examples:

        nsa-diag schema
        nsa-diag schema result > result.schema.json
    """
    from nsa_diag.render import print_json
    from nsa_diag.spec import CaseResult, CaseSpec

    model = CaseSpec if name is SchemaName.spec else CaseResult
    print_json(model.model_json_schema())
    raise typer.Exit(0)
