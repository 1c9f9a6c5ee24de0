"""Device payloads that an asynchronous copy off the device still reads.

[Note: draining payloads] A chunk evicted on CUDA is copied to the host on the side stream;
the engine moves on at once, and the chunk's device payload must stay allocated until the copy
has read it. Until then the device holds those bytes: counting them free lets placement fill
the device beyond its capacity (the allocator meter, which sees them still allocated, would
call them non-model memory). So the residency hands each such payload to :class:`Drains`,
which keeps the tensor, unfreed, and charges its bytes to the ledger as ``draining``; it
frees both (the tier's ``free``: the simulated device's buffer cache must not hand it out
either) only once the copy's event completed: polled at every moment and before room is made,
waited for, oldest first, only when room is needed now. The simulated device copies
synchronously and never drains, except a copy left to its reader (chunkmem/devices.py,
[Note: copies a reader runs]), which drains until the reader ran it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chunkmem.devices import ComputeDevice
from chunkmem.ledger import DRAINING, Ledger
from chunkmem.tiers import StorageTier


@dataclass(frozen=True)
class Drain:
    payload: torch.Tensor
    event: object
    nbytes: int
    owner: str


class Drains:
    """The owner of draining device payloads (see the note above), oldest first."""

    def __init__(self, ledger: Ledger, tier: StorageTier, device: ComputeDevice) -> None:
        self._ledger = ledger
        self._tier = tier
        self._device = device
        self._queue: deque[Drain] = deque()
        self.nbytes = 0
        self.waits = 0  # drains the host blocked on (room was needed before the copy ended)

    def __len__(self) -> int:
        return len(self._queue)

    def hold(self, payload: torch.Tensor, event: object, kind: str, owner: str) -> None:
        """``payload`` (a chunk's, of ``kind``) is being copied off the device until
        ``event``: keep it and its bytes on the device until then."""
        nbytes = payload.numel() * payload.element_size()
        self._ledger.hand_over(self._tier.name, kind, DRAINING, nbytes, owner)
        self._queue.append(Drain(payload, event, nbytes, owner))
        self.nbytes += nbytes

    def reap(self) -> None:
        """Let go of the payloads whose copies completed (without blocking)."""
        while self._queue and self._device.completed(self._queue[0].event):
            self._release(self._queue.popleft())

    def settle(self, until: Callable[[], bool] = lambda: False) -> None:
        """Wait for drains, oldest first, until ``until()`` holds or none is left."""
        self.reap()
        while self._queue and not until():
            drain = self._queue.popleft()
            self._device.wait_host(drain.event)
            self.waits += 1
            self._release(drain)

    def _release(self, drain: Drain) -> None:
        self._ledger.free(self._tier.name, DRAINING, drain.nbytes, drain.owner)
        self.nbytes -= drain.nbytes
        self._tier.free(drain.payload)
