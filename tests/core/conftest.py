"""Fixtures for the nsa_core tests: a fixed seed per test and a per-test time limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# The tests run many small float64 ops: one intra-op thread is as fast, and does not collapse when another
# process shares the two cores of a CI machine (spinning OpenMP workers slowed the suite tenfold there).
torch.set_num_threads(1)

TEST_TIMEOUT_S = 120  # a hung backend fails its own test instead of stalling the suite
HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
