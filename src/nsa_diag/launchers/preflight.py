"""The pre-flight of a ``--model``: build the user's model in a child process before any case runs, and
refuse the options it cannot apply (`nsa_diag.cases.check_model_facts`), in one line with exit 2.

A ``--model`` module is the user's code: it is imported only here and in the worker, never in this process,
and only after everything else on the command line was accepted. The child is
``python -P -m nsa_diag.worker.preflight`` with the worker's environment, in this process's working
directory (from which the worker imports the module too); it writes one `ModelFacts` per spec.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from nsa_diag import artifacts
from nsa_diag.cases import check_model_facts
from nsa_diag.errors import ConfigError
from nsa_diag.guard import CASE_ENV, Guardian, sweep
from nsa_diag.launchers.base import python_env
from nsa_diag.spec import CaseSpec, ModelFacts
from nsa_diag.stopping import ProcessTree, stop_tree

# Importing torch and the user's module, building the model and one short forward on the CPU: seconds for
# the models we tried (GPT-2 small from its config: 6 s on 2 cores); a factory that downloads weights takes
# longer, and the limit is generous, but never longer than the case's own --timeout.
PREFLIGHT_TIMEOUT_S = 600.0


def _key(spec: CaseSpec) -> str:
    """Specs that build the same model share one pre-flight (the name and the run options aside)."""
    return spec.model_dump_json(include={"model", "preset", "overrides", "layers_attr", "seed", "device"})


def model_facts(specs: Sequence[CaseSpec], timeout: float | None = None) -> list[ModelFacts]:
    """Build each spec's model in one child process; the facts in order. ConfigError when it cannot say.

    The child is bounded by ``timeout`` (default: `PREFLIGHT_TIMEOUT_S`, or the cases' shortest
    ``--timeout`` when shorter), and nothing it started outlives it: it carries a marker of its own
    (`nsa_diag.guard`), swept when it ends, when nsa-diag is interrupted (then re-raised), and by its
    guardian when nsa-diag is killed. Its output goes to a file, not a pipe that a daemon it forked could
    hold open."""
    assert specs
    assert all(spec.model is not None for spec in specs)
    model = specs[0].model
    limit = (
        timeout
        if timeout is not None
        else min(PREFLIGHT_TIMEOUT_S, *(spec.timeout for spec in specs if spec.timeout is not None))
    )
    with tempfile.TemporaryDirectory(prefix="nsa-diag-preflight-") as tmp:
        paths = []
        for i, spec in enumerate(specs):
            paths.append(artifacts.write_text(Path(tmp) / f"spec{i}.json", spec.model_dump_json()))
        out, err_path = Path(tmp) / "facts.json", Path(tmp) / "stderr.log"
        argv = [sys.executable, "-P", "-m", "nsa_diag.worker.preflight", str(out), *map(str, paths)]
        marker = str(Path(tmp).resolve())
        guardian = Guardian(marker)
        try:
            with open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    argv,
                    env={**python_env(specs[0]), CASE_ENV: marker},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                )
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                raise ConfigError(
                    f"--model {model}: building it and one forward took more than {limit:g} s (pre-flight, "
                    "bounded by --timeout)"
                ) from None
            finally:
                stop_tree(ProcessTree([proc.pid]), proc, grace_s=0)  # its session: nothing to save
                sweep(marker)
        finally:
            guardian.release()
        if not out.exists():
            stderr = err_path.read_bytes()[-65536:].decode(errors="replace")
            last = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "")
            raise ConfigError(
                f"--model {model}: the pre-flight ended with exit code {proc.returncode}: {last}"
            )
        return [ModelFacts.model_validate(item) for item in json.loads(out.read_text())]


def check_user_model(specs: Sequence[CaseSpec], command: str | None = None) -> ModelFacts | None:
    """The pre-flight of the specs with a ``--model`` (one build per distinct model configuration), each
    checked against its facts; the first spec's facts, or None when no spec has a model. ``command``: the
    command whose own choices the specs carry (`nsa_diag.cases.check_model_facts`)."""
    with_model = {_key(spec): spec for spec in specs if spec.model is not None}
    if not with_model:
        return None
    found = dict(zip(with_model, model_facts(list(with_model.values())), strict=True))
    for spec in specs:
        if spec.model is not None:
            check_model_facts(spec, found[_key(spec)], command)
    return found[_key(next(s for s in specs if s.model is not None))]
