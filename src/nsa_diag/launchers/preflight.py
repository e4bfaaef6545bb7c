"""The pre-flight of a ``--model``: build the user's model in a child process before any case runs, and
refuse the options it cannot apply (`nsa_diag.cases.check_model_facts`), in one line with exit 2.

A ``--model`` module is the user's code: it is imported only here and in the worker, never in this process,
and only after everything else on the command line was accepted. The child is
``python -P -m nsa_diag.worker.preflight`` with the worker's environment, in this process's working
directory (from which the worker imports the module too); it writes one `ModelFacts` per spec.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from nsa_diag import artifacts
from nsa_diag.cases import check_model_facts
from nsa_diag.errors import ConfigError
from nsa_diag.launchers.base import python_env
from nsa_diag.spec import CaseSpec, ModelFacts

# Importing torch and the user's module, building the model and one short forward on the CPU: seconds for
# the models we tried (GPT-2 small from its config: 6 s on 2 cores); a factory that downloads weights takes
# longer, and the limit is generous.
PREFLIGHT_TIMEOUT_S = 600.0


def _key(spec: CaseSpec) -> str:
    """Specs that build the same model share one pre-flight (the name and the run options aside)."""
    return spec.model_dump_json(include={"model", "preset", "overrides", "layers_attr", "seed", "device"})


def model_facts(specs: Sequence[CaseSpec], timeout: float = PREFLIGHT_TIMEOUT_S) -> list[ModelFacts]:
    """Build each spec's model in one child process; the facts in order. ConfigError when it cannot say."""
    assert specs
    assert all(spec.model is not None for spec in specs)
    model = specs[0].model
    with tempfile.TemporaryDirectory(prefix="nsa-diag-preflight-") as tmp:
        paths = []
        for i, spec in enumerate(specs):
            paths.append(artifacts.write_text(Path(tmp) / f"spec{i}.json", spec.model_dump_json()))
        out = Path(tmp) / "facts.json"
        argv = [sys.executable, "-P", "-m", "nsa_diag.worker.preflight", str(out), *map(str, paths)]
        proc = subprocess.Popen(
            argv,
            env=python_env(specs[0]),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise ConfigError(
                f"--model {model}: building it and one forward took more than {timeout:g} s (pre-flight)"
            ) from None
        if not out.exists():
            last = next(
                (ln for ln in reversed(stderr.decode(errors="replace").splitlines()) if ln.strip()), ""
            )
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
