"""Scratch buffers beside the chunks (a 16-bit gradient cast to fp32, a late reduce-scatter's
target, wire buffers, speculation's copies): room is made for them as for a chunk, the ledger
counts them under their kind, and on the device the non-model peak is read around them so
they never count as activations. Whoever allocates one frees it (``scoped`` on any exit)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from chunkmem.ledger import WORKSPACE
from chunkmem.tiers import StorageTier

if TYPE_CHECKING:
    from chunkmem.residency import Residency
    from chunkmem.room import RoomLimit


class Workspaces:
    """The residency's scratch buffers (``residency.workspaces``)."""

    def __init__(self, residency: Residency) -> None:
        self._residency = residency

    def allocate(
        self,
        numel: int,
        dtype: torch.dtype,
        tier: StorageTier,
        protect: set[int],
        within: RoomLimit = "budget",
        kind: str = WORKSPACE,
    ) -> torch.Tensor:
        """A scratch buffer on ``tier``; ``within`` as for :meth:`Room.make_room`; ``kind`` is what
        the ledger and the report call its bytes."""
        nbytes = numel * dtype.itemsize
        if tier.compute:
            self._residency.room.make_room(nbytes, protect, "workspace", within)
            self._residency.nonmodel.trace_peak()
        else:
            self._residency.room.make_tier_room(tier, nbytes, protect, within)
        self._residency.ledger.allocate(tier.name, kind, nbytes, f"a {kind}", kind)
        buffer = tier.allocate(numel, dtype)
        if tier.compute:
            self._residency.nonmodel.restart_peak()
        return buffer

    def free(self, buffer: torch.Tensor, tier: StorageTier, kind: str = WORKSPACE) -> None:
        """Until the caller drops ``buffer`` the allocator still holds it, so the peak is not
        restarted here: until the next change it may read high by the workspace, never low."""
        if tier.compute:
            self._residency.nonmodel.trace_peak()
        self._residency.ledger.free(tier.name, kind, buffer.numel() * buffer.element_size(), kind)
        tier.free(buffer)

    @contextlib.contextmanager
    def scoped(
        self,
        numel: int,
        dtype: torch.dtype,
        tier: StorageTier,
        protect: set[int],
        within: RoomLimit = "budget",
    ) -> Iterator[torch.Tensor]:
        """A scratch buffer for the block, freed on any exit."""
        buffer = self.allocate(numel, dtype, tier, protect, within)
        try:
            yield buffer
        finally:
            self.free(buffer, tier)
