"""Error feedback: each layout's residual, what compression left out of this rank's gradients
so far, added to its next ones (1-bit SGD, PowerSGD, DGC's accumulation). DGC's local
momentum (``DGC_VELOCITY``) is kept the same way, one more per-rank store of another kind.

A residual belongs to one rank: rank ``r``'s residual is the part of its own gradients that
did not reach the sum, so it covers the whole layout (every rank's slice of it) and cannot be
sharded like optimizer states; the sum over ranks of the residuals is what the reduced
gradients still owe. It lives in a chunk of kind ``EF_RESIDUAL`` (fp32), made zeroed on first
use, counted by the ledger and the report like any chunk, and placed like any dynamic chunk: on
the host while the device is short, fetched back for its reduction.
"""

from __future__ import annotations

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout
from chunkmem.residency import Residency
from zero.kinds import EF_RESIDUAL


class Residuals:
    """The per-rank fp32 chunks of ``kind`` (residuals by default) of one compressor; a
    reduction holds one from :meth:`acquire` to :meth:`release` (on the device, pinned)."""

    def __init__(self, residency: Residency, kind: ChunkKind = EF_RESIDUAL) -> None:
        self.residency = residency
        self.kind = kind
        # Whether a reduction changed a chunk of this store since the last step: what it
        # carries then holds part of the window's gradients, which a discard cannot take back.
        self.carried = False

    def carry(self, layout: ChunkLayout) -> Chunk:
        """:meth:`acquire` for a reduction, which changes what the chunk carries."""
        self.carried = True
        return self.acquire(layout)

    def acquire(self, layout: ChunkLayout) -> Chunk:
        chunk = layout.chunks.get(self.kind)
        if chunk is None:
            chunk = self.residency.new_chunk(
                layout, self.kind, torch.float32, self.residency.compute
            )
        self.residency.room.ensure_on_device([chunk])
        chunk.pin()
        return chunk

    @staticmethod
    def release(chunk: Chunk) -> None:
        chunk.unpin()
