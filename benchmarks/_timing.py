"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def sample_seconds(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    alternate: bool = False,
    every: Mapping[str, int] | None = None,
) -> dict[str, list[float | None]]:
    """Wall-clock seconds of each callable in each of `repeats` rounds, in round order.

    The callables run round-robin (a, b, c, a, b, c, ...), after `warmup` untimed rounds, so a
    change in machine load during the measurement hits all of them alike and the samples of one
    round can be compared pairwise; with `alternate`, every other round runs them in reverse
    order (a, b, c, c, b, a, ...), so none is always first after another. `every={name: k}`
    runs that callable only every k-th round (a slow one); its other samples are None. Results
    are dropped as soon as each call returns, so no call pays for freeing another's output.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    every = dict(every or {})
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float | None]] = {name: [] for name in fns}
    order = list(fns.items())
    for round_index in range(repeats):
        for name, fn in reversed(order) if alternate and round_index % 2 else order:
            if round_index % every.get(name, 1):
                samples[name].append(None)
                continue
            start = time.perf_counter()
            result = fn()
            samples[name].append(time.perf_counter() - start)
            del result
    return samples


def median_seconds(
    fns: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median wall-clock seconds of each callable over `repeats` round-robin runs
    (see sample_seconds)."""
    samples = sample_seconds(fns, repeats=repeats, warmup=warmup)
    return {name: statistics.median(times) for name, times in samples.items()}


def paired_ratios(numerator: list[float | None], denominator: list[float | None]) -> list[float]:
    """numerator[i] / denominator[i] for the rounds where both were sampled."""
    return [a / b for a, b in zip(numerator, denominator, strict=True) if a is not None and b]
