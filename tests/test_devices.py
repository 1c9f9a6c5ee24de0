"""The simulated device's buffer reuse (its stand-in for a caching allocator)."""

from __future__ import annotations

import torch

from chunkmem.devices import SimulatedDevice


def test_released_buffers_are_reused_only_when_nothing_else_reads_them() -> None:
    device = SimulatedDevice()
    first = device.empty(1024, torch.float32)
    pointer = first.data_ptr()
    device.release(first)
    del first
    again = device.empty(1024, torch.float32)
    assert again.data_ptr() == pointer, "an unreferenced buffer is handed out again"

    view = again[10:20]
    device.release(again)
    fresh = device.empty(1024, torch.float32)
    assert fresh.data_ptr() != view.data_ptr() - 10 * 4, "a buffer a view still reads is not"
    assert device.empty(1024, torch.bfloat16).dtype == torch.bfloat16  # keyed by dtype too


def test_at_most_two_buffers_per_size_are_kept() -> None:
    device = SimulatedDevice()
    buffers = [device.empty(64, torch.float32) for _ in range(4)]
    pointers = {b.data_ptr() for b in buffers}
    for buffer in buffers:
        device.release(buffer)
    del buffers, buffer
    kept = device._free[(64, torch.float32)]
    assert len(kept) == 2 and {b.data_ptr() for b in kept} <= pointers
