"""One module per CLI command, each exporting a plain function that `nsa_diag.app` wires into Typer."""
