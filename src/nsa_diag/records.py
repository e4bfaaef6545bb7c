"""The records that pass between the worker, the launchers, the executor and the readers of run folders,
declared once: what stopping a job took (`StopReport`), and the parts of ``result.json`` and of the
worker's ``worker_result.json`` that were dicts.

Each is a `Record`: a pydantic model whose JSON is the dict it replaced, key for key. A field is written
when it was given (to the constructor, by assignment, or by the file read back), also as null; a field
never given is left out, as the key was. So a ``result.json`` written before these records existed reads
into them and is written back equal (`tests/diag/test_records.py`).

A record also reads like that JSON (``stop["exit_code"]``, ``"survivors" in stop``, ``stop.get("pid")``),
as `nsa_diag.summary`'s records do, so that tests and scripts written against the files read it unchanged;
code reads its fields.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer


class Record(BaseModel):
    """A JSON object with declared keys: only the fields given are written (module docstring)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_serializer(mode="wrap")
    def _given_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {key: value for key, value in data.items() if key in self.model_fields_set}

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.model_fields_set

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        """The field ``key`` where it was given, else ``default`` (dict.get)."""
        return getattr(self, key) if key in self else default


class StopReport(Record):
    """What stopping a job took (``evidence.stop`` of result.json): the signals sent, its exit status and
    what survived (nothing should). ``{"started": false}`` alone when nothing was started. Each way of
    stopping writes its own fields: a worker's process group (sigterm, sigkill, unreaped, exit_code,
    survivors), torchrun and its ranks (also rank_pids), a watched command's tree (also signalled) or the
    pids `watch --keep-alive` left running (kept_alive, exit_code); one rank's part of a ddp stop holds its
    exit_code and pid. The executor adds the pids it swept by the case's marker afterwards (swept)."""

    started: bool = True  # False: nothing was started, so nothing was stopped
    sigterm: bool = False
    sigkill: bool = False
    signalled: list[int] = []  # a watched command: the pids SIGTERM went to besides its process group
    unreaped: int | None = None  # the pid that was not reaped within 5 s of the SIGKILL
    exit_code: int | None = None
    rank_pids: list[int] = []  # torchrun: the ranks' pids, signalled with torchrun's session
    survivors: list[int] = []  # pids still alive after the SIGKILL
    kept_alive: list[int] = []  # watch --keep-alive: the pids left running on purpose
    swept: list[int] = []  # pids of the case found by its marker after the stop (left its session)
    pid: int | None = None  # one rank's part of a ddp stop: that rank's pid
