"""tests/diag on sys.path (pytest runs with --import-mode=importlib, which does not add it), so the test
modules share `diag_cli` and the planted models can be imported by name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
