"""Shared fixtures: deterministic seeds and one thread per process (2-core CI machines), and
the skip of tests marked ``cuda`` on machines without a CUDA device."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: small models on a shared 2-core machine run 10-50x
    faster than with threads fighting over the cores (results do not depend on it: the engine
    and its reference run alike). Use with ``pytestmark = pytest.mark.usefixtures(...)``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
