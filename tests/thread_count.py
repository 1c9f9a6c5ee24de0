"""The torch thread count of every test process: the parent's and every child's are the same.

[Note: the thread count is part of every comparison] Matrix products and reductions split
their work by the number of threads, and on some CPUs two runs that differ only in it give
different bits (an AMD EPYC with AVX2: a checkpoint test whose child trained with torch's
default of 2 threads against a reference at 1). So every test that compares numbers across
processes runs both sides at this count: ``CHUNKMEM_TEST_THREADS`` (default 1, the fast
choice for small models on a shared 2-core machine). The conftest sets it for the test
process, ``run_ranks`` for every rank, and :func:`child_env` for every child process.
``make test-threads`` runs the engine-level tests at 2, which catches the next hidden
assumption of one thread (docs/reproducibility.md).
"""

from __future__ import annotations

import os
from pathlib import Path

THREADS_ENV = "CHUNKMEM_TEST_THREADS"
ROOT = Path(__file__).resolve().parent.parent


def threads_per_process() -> int:
    """Torch intra-op threads for each test process (``CHUNKMEM_TEST_THREADS``, default 1)."""
    value = os.environ.get(THREADS_ENV, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {value!r}")
    return int(value)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: this process's, with the test thread count
    (``OMP_NUM_THREADS`` sets torch's default in the child) and the repository importable."""
    threads = str(threads_per_process())
    return {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        THREADS_ENV: threads,
        "PYTHONPATH": str(ROOT),
        **extra,
    }
