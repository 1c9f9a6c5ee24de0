"""Shared fixtures: deterministic seeds and the test thread count (one per process by default;
see ``tests/thread_count.py``), and the skip of tests marked ``cuda`` on machines without a
CUDA device."""

from __future__ import annotations

import pytest
import torch

from tests.thread_count import threads_per_process


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def test_thread_count():
    """Every test runs at the test thread count (default 1: small models on a shared 2-core
    machine run 10-50x faster than with threads fighting over the cores). Results may depend
    on it on some CPUs, so children and ranks run at the same count (tests/thread_count.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_process())
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
