"""Where each moment sample falls among the ledger's allocation events."""

from __future__ import annotations

from collections.abc import Sequence

from chunkmem.ledger import AllocationEvent, MomentSample


def place_moments(events: Sequence[AllocationEvent], samples: Sequence[MomentSample]) -> list[int]:
    """``positions[k]``: how many of ``events`` happened before ``samples[k]``.

    Every sample records how many allocation events preceded it. The ledger keeps the first
    events and drops later ones, so the list stops at the first sample that lies beyond the
    recorded events: callers then draw only what the recorded events support.
    """
    positions = []
    for sample in samples:
        if sample.allocations_before > len(events):
            break
        positions.append(sample.allocations_before)
    return positions
