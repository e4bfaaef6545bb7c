"""Collection writes the test modules' assertion-rewritten bytecode even where PYTHONDONTWRITEBYTECODE is set.

pytest rewrites the asserts of every test module and conftest at import, and caches the result in
`__pycache__` unless `sys.dont_write_bytecode` is on; this project's machines set PYTHONDONTWRITEBYTECODE, so
each pytest-xdist process rewrote all of them again, ~3 s of CPU a process (the Makefile byte-compiles src
and tests for the same reason; pytest's rewritten files are its own, `*-pytest-*.pyc`). Only during
collection: the tests themselves, and every process they start, keep the environment's setting.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[None]:
    was = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = was
