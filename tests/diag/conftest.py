"""tests/diag on sys.path (pytest runs with --import-mode=importlib, which does not add it), so the test
modules share `diag_cli` and the planted models can be imported by name. In-process CLI calls print for a
200-column terminal, as the subprocess ones (`diag_cli.cli_env`) do, whatever pytest's runner sets up."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["COLUMNS"] = "200"
