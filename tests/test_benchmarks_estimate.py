"""benchmarks/estimate's own measurement of the real allocator: the peak of live bytes it reads
from torch's profiler must be what was allocated (the key it feeds is only as good as this)."""

from __future__ import annotations

import torch

from benchmarks.estimate import allocator_peak, allocator_profiler

MIB = 1 << 20


def test_the_allocator_peak_is_the_most_bytes_live_at_once() -> None:
    profiler = allocator_profiler()
    with profiler:
        first = torch.empty(MIB, dtype=torch.uint8)
        second = torch.empty(3 * MIB, dtype=torch.uint8)
        del first, second  # 4 MiB were live together
        third = torch.empty(2 * MIB, dtype=torch.uint8)
        del third
    peak = allocator_peak(profiler)
    assert 4 * MIB <= peak < 4 * MIB + 64 * 1024, peak


def test_bytes_freed_before_more_are_allocated_do_not_add_up() -> None:
    profiler = allocator_profiler()
    with profiler:
        for _ in range(5):
            block = torch.empty(2 * MIB, dtype=torch.uint8)
            del block
    assert 2 * MIB <= allocator_peak(profiler) < 2 * MIB + 64 * 1024
