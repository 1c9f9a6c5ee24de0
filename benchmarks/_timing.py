"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def sample_seconds(
    fns: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    warmup: int = 1,
    every: Mapping[str, int] | None = None,
) -> dict[str, list[float | None]]:
    """Wall-clock seconds of each callable in each of `rounds` rounds.

    Each round runs every callable once, in turn, alternating the order from round to round
    (a, b, c, then c, b, a), so that a change in machine load and any cost one call leaves to
    the next hit all of them alike and the samples of one round can be compared pairwise.
    `every={name: k}` runs that callable only every k-th round (a slow one); its other samples
    are None. `warmup` untimed rounds run first. Results are dropped as soon as each call
    returns, so no call pays for freeing another's output.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    every = dict(every or {})
    names = list(fns)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float | None]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            if r % every.get(name, 1):
                samples[name].append(None)
                continue
            start = time.perf_counter()
            result = fns[name]()
            samples[name].append(time.perf_counter() - start)
            del result
    return samples


def median_seconds(
    fns: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median wall-clock seconds of each callable over `repeats` rounds of `sample_seconds`."""
    samples = sample_seconds(fns, rounds=repeats, warmup=warmup)
    return {name: statistics.median(times) for name, times in samples.items()}


def paired_ratios(numerator: list[float | None], denominator: list[float | None]) -> list[float]:
    """numerator[i] / denominator[i] for the rounds where both were sampled."""
    return [a / b for a, b in zip(numerator, denominator, strict=True) if a is not None and b]
