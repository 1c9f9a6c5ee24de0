"""Shared fixtures: deterministic seeds and one thread per process (2-core CI machines)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
