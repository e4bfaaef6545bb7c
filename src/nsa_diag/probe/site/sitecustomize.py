"""nsa-diag's probe, loaded by Python's ``site`` at start-up from this folder on the job's PYTHONPATH.

With ``NSA_DIAG_PROBE_DIR`` set it starts `nsa_diag.probe.runtime` (stdlib only; torch hooks once the job
imports torch), then runs the ``sitecustomize`` the job would have run without us (the next one on
``sys.path``), so a job's own start-up code still runs, after the probe. Any failure of the probe is
reported on stderr in one line and the job goes on without it.
"""

import importlib
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _start_probe() -> None:
    if not os.environ.get("NSA_DIAG_PROBE_DIR"):
        return
    try:
        if importlib.util.find_spec("nsa_diag") is None:  # another interpreter: nsa_diag from this checkout
            sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))
        from nsa_diag.probe import runtime

        runtime.start()
    except Exception as exc:  # the job runs without the probe rather than not at all
        print(f"nsa-diag probe: not started: {type(exc).__name__}: {exc}", file=sys.stderr)


def _chain() -> None:
    """Import the next ``sitecustomize`` on sys.path (the user's), as Python would have without us."""
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    try:
        importlib.import_module("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved + [p for p in sys.path if p not in saved]


_start_probe()
_chain()
