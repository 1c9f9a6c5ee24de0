"""What every compressed exchange in flight shares: one pooled wire buffer, taken at launch and
given back on every exit path, and one collective whose completion ``wait`` turns into the
shard (``_finish``)."""

from __future__ import annotations

import torch

from zero.comm import Handle
from zero.wire import WireBuffers


class PooledExchange:
    """Owns ``nbytes`` of ``wire`` from construction until :meth:`wait` (or a failed launch,
    which calls :meth:`_release`); a subclass sets ``_handle`` and implements ``_finish``."""

    _handle: Handle

    def __init__(self, wire: WireBuffers, nbytes: int) -> None:
        self._wire = wire
        self._buffer: torch.Tensor | None = wire.take(nbytes)

    def is_completed(self) -> bool:
        return self._buffer is None or self._handle.is_completed()

    def wait(self) -> None:
        if self._buffer is None:
            return
        try:
            self._handle.wait()
            self._finish()
        finally:
            self._release()

    def _finish(self) -> None:
        """Decode what arrived into the shard (the buffer is still held)."""
        raise NotImplementedError

    def _release(self) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            self._wire.give(buffer)
