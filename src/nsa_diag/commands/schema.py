"""`nsa-diag schema`: the JSON schema of a case (spec.json), a result (result.json) or a matrix file."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from nsa_diag._cli_utils import DebugOpt


class SchemaName(str, Enum):
    spec = "spec"
    result = "result"
    matrix = "matrix"


def schema(
    name: Annotated[
        SchemaName,
        typer.Argument(
            help="spec: a case, as in spec.json; result: result.json; matrix: a matrix file "
            "(src/nsa_diag/matrices/schema.json)."
        ),
    ] = SchemaName.spec,
    debug: DebugOpt = False,
) -> None:
    """Print the JSON schema of a case spec (spec.json), of a result, or of a matrix file.

    Every field with its type, default and meaning; unknown fields are rejected.

    Examples:

        nsa-diag schema
        nsa-diag schema result > result.schema.json
        nsa-diag schema matrix > src/nsa_diag/matrices/schema.json
    """
    from nsa_diag.render import print_json
    from nsa_diag.spec import CaseResult, CaseSpec

    if name is SchemaName.matrix:
        from nsa_diag.matrix import matrix_json_schema

        print_json(matrix_json_schema())
        raise typer.Exit(0)
    model = CaseSpec if name is SchemaName.spec else CaseResult
    print_json(model.model_json_schema())
    raise typer.Exit(0)
