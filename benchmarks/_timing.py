"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def median_seconds(
    fns: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median wall-clock seconds of each callable over `repeats` runs.

    The callables run round-robin (a, b, c, a, b, c, ...), after `warmup` untimed rounds, so a
    change in machine load during the measurement hits all of them alike. Results are dropped
    as soon as each call returns, so no call pays for freeing another's output.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            result = fn()
            samples[name].append(time.perf_counter() - start)
            del result
    return {name: statistics.median(times) for name, times in samples.items()}
