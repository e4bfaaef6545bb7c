"""tests/diag on sys.path (pytest runs with --import-mode=importlib, which does not add it), so the test
modules share `diag_cli` and the planted models can be imported by name. In-process CLI calls print for a
200-column terminal, as the subprocess ones (`diag_cli.cli_env`) do, whatever pytest's runner sets up.

A background job of a non-interactive shell starts with SIGINT ignored, and its children inherit that;
nsa-diag keeps a signal that was ignored when it started ignored (as nohup asks for SIGHUP), so the tests
that interrupt it would see nothing happen. A Python handler here becomes the default action in every
child at exec: nsa-diag started by a test takes SIGINT, however pytest itself was started."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["COLUMNS"] = "200"
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
