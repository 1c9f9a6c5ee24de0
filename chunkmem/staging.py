"""Borrowing chunks from a tier that is not addressable: the one owner of staging.

A chunk homed on the NVMe tier (``offload/nvme.py``) is a file, not a tensor: to read or write
it, it is staged into the spill tier (host memory) and, once written, sent back. The optimizer's
update, checkpoints and speculative updates all need that, and so does reading ahead of a
use and writing back behind one. They borrow through :class:`Staging` instead of each
branching on the tier: a chunk on an addressable tier is simply lent as it is.

The mechanism (moving a payload between a non-addressable tier and the spill tier, reading a
copy) is the residency's (``chunkmem.residency``); this module decides when to use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from chunkmem.chunk import Chunk
from chunkmem.residency import Residency
from chunkmem.tiers import StorageTier


class Staging:
    """Lends chunks of any tier as host tensors; reads ahead and writes back staged ones."""

    def __init__(self, residency: Residency) -> None:
        self.residency = residency
        self.spill = residency.tiers.spill

    def work_tier(self, home: StorageTier) -> StorageTier:
        """Where a chunk homed on ``home`` is read and written: ``home``, or host memory."""
        return home if home.addressable else self.spill

    def staged(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` sits in host memory away from a home that is not addressable."""
        return chunk.tier is self.spill

    def stage(self, chunk: Chunk, reason: str) -> None:
        """Bring a chunk homed on a non-addressable tier into host memory (asynchronous:
        readers wait through the residency); a no-op on an addressable tier."""
        if chunk.tier is not None and not chunk.tier.addressable:
            self.residency.move(chunk, self.spill, reason)

    def read_ahead(self, chunk: Chunk, reason: str) -> bool:
        """Stage ``chunk`` if the host has room now without evicting anything; whether it
        was (or needed nothing)."""
        if chunk.tier is None or chunk.tier.addressable:
            return True
        if not chunk.movable() or not self.residency.ledger.would_fit(
            self.spill.name, chunk.nbytes
        ):
            return False
        self.stage(chunk, reason)
        return True

    def write_back(self, chunk: Chunk, home: StorageTier, reason: str, wait: bool) -> None:
        """Send a staged chunk home (``wait``: until its write is done, so that a failed write
        raises here)."""
        if home.addressable:
            return
        self.residency.move(chunk, home, reason)
        if wait:
            self.residency.ready(chunk)

    @contextlib.contextmanager
    def borrowed(self, chunk: Chunk, write: bool, reason: str) -> Iterator[torch.Tensor]:
        """``chunk``'s content as a host-addressable tensor for the block. With ``write``,
        a staged chunk goes back home after the block (on a normal exit only: a half write is
        not sent home); without, a non-addressable chunk is read as a copy and stays home."""
        residency = self.residency
        home = chunk.tier
        assert home is not None and chunk.payload is not None, f"{chunk!r} has no payload"
        if home.addressable:
            residency.ready(chunk)
            yield chunk.payload
            return
        if not write:
            yield residency.contents(chunk)
            return
        self.stage(chunk, reason)
        residency.ready(chunk)
        with residency.pinned([chunk]):
            yield chunk.payload
        self.write_back(chunk, home, reason, wait=True)
