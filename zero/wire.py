"""Byte buffers for quantized collectives: the wire format of qwZ and qgZ, and a pool to reuse.

A quantized tensor travels as one flat ``uint8`` buffer: its levels (``data``), padded to a
multiple of 4 bytes so that the fp32 scales that follow can be viewed as ``float32`` in place
(at most 3 bytes of padding are sent). :func:`packed_nbytes` says how long that is, :func:`packed_view` builds the
:class:`kernels.QuantizedTensor` whose parts are views of such a buffer: the kernels write and
read it through ``out=`` and no byte is copied to assemble a message.

[Note: a pool, not an allocation per collective] Every quantized gather and reduction needs a
few buffers while it is in flight. Allocating them per collective costs first-touch page faults
that can exceed the kernels' own time on the host, so :class:`WireBuffers` keeps the buffers it
allocated and hands them out again. They are workspaces in the ledger for as long as the pool
holds them (every byte the process holds is in the ledger), and there are never more than the
most collectives in flight at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from chunkmem.costs import DeviceBytes
from chunkmem.ledger import WORKSPACE
from chunkmem.residency import Residency
from kernels import QuantizedTensor
from kernels.quantized import data_nbytes, num_groups

Buffer = TypeVar("Buffer")
ALIGN = 64  # bytes: buffers carved from a pooled one start on a cache line
SCALES_ALIGN = 4  # bytes: where the scales start in the wire format


def aligned(nbytes: int, alignment: int = ALIGN) -> int:
    return -(-nbytes // alignment) * alignment


def carve(buffer: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Consecutive 64-byte-aligned pieces of ``buffer`` of the given byte sizes."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(buffer[start : start + size])
        start += aligned(size)
    return pieces


def packed_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of a symmetric quantized tensor of ``numel`` elements in the wire format."""
    return aligned(data_nbytes(numel, bits), SCALES_ALIGN) + 4 * num_groups(numel, group_size)


def packed_view(
    buffer: torch.Tensor, numel: int, bits: int, group_size: int, dtype: torch.dtype
) -> QuantizedTensor:
    """The symmetric quantized tensor stored at the start of ``buffer`` (uint8, starting at a
    multiple of 4 bytes); ``dtype`` is the dtype its values came from."""
    nbytes = data_nbytes(numel, bits)
    start = aligned(nbytes, SCALES_ALIGN)
    groups = num_groups(numel, group_size)
    return QuantizedTensor(
        data=buffer[:nbytes],
        scales=buffer[start : start + 4 * groups].view(torch.float32),
        offsets=None,
        numel=numel,
        bits=bits,
        group_size=group_size,
        symmetric=True,
        dtype=dtype,
    )


def wire_parts(q: QuantizedTensor) -> list[torch.Tensor]:
    """``q``'s data and scales as uint8 buffers, the way a collective sends them."""
    return [q.data, q.scales.view(torch.uint8)]


class BufferPool(Generic[Buffer]):
    """Which buffer to hand out and which to keep (see the note on the pool), apart from what a
    buffer is: :class:`WireBuffers` pools device tensors, and the cost model of the strategies
    (``zero.strategy``) replays the same policy with sizes alone.

    At most ``keep_idle`` buffers wait for reuse; one given back beyond that is freed, so a burst
    of collectives in flight (the first cycle's reductions) leaves nothing behind.
    """

    def __init__(
        self,
        allocate: Callable[[int], Buffer],
        free: Callable[[Buffer], None],
        size: Callable[[Buffer], int],
        keep_idle: int = 4,
    ) -> None:
        self._allocate = allocate
        self._free_buffer = free
        self._size = size
        self._keep_idle = keep_idle
        self._free: list[Buffer] = []
        self._held = 0

    @property
    def held_bytes(self) -> int:
        """Bytes the pool holds, in use or not."""
        return self._held

    def take(self, nbytes: int) -> Buffer:
        """A buffer of at least ``nbytes`` (the smallest free one that fits, or a new one of
        ``aligned(nbytes)``); give it back with :meth:`give`."""
        fitting = [b for b in self._free if self._size(b) >= nbytes]
        if fitting:
            buffer = min(fitting, key=self._size)
            self._free = [b for b in self._free if b is not buffer]
            return buffer
        buffer = self._allocate(aligned(nbytes))
        self._held += self._size(buffer)
        return buffer

    def give(self, buffer: Buffer) -> None:
        if len(self._free) < self._keep_idle:
            self._free.append(buffer)
            return
        smallest = min([*self._free, buffer], key=self._size)
        if smallest is not buffer:
            self._free = [b for b in self._free if b is not smallest] + [buffer]
        self._held -= self._size(smallest)
        self._free_buffer(smallest)


class WireBuffers(BufferPool[torch.Tensor]):
    """Reusable uint8 buffers on the compute device, accounted as workspaces (see the note)."""

    def __init__(self, residency: Residency, keep_idle: int = 4) -> None:
        self.residency = residency
        super().__init__(
            lambda nbytes: residency.workspaces.allocate(
                nbytes, torch.uint8, residency.compute, set()
            ),
            lambda buffer: residency.workspaces.free(buffer, residency.compute),
            torch.Tensor.numel,
            keep_idle,
        )


class PooledBytes:
    """A buffer of :class:`BytesPool`: its size alone."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class BytesPool:
    """:class:`BufferPool`'s policy over sizes alone, for the cost models (``zero.strategy``):
    what it allocates and frees goes to the device bytes of the estimated run as workspace."""

    KIND = WORKSPACE

    def __init__(self, keep_idle: int = 4) -> None:
        self._device: DeviceBytes | None = None
        self._label = ""
        self._pool: BufferPool[PooledBytes] = BufferPool(
            self._allocate, self._free, lambda buffer: buffer.nbytes, keep_idle
        )

    @property
    def held_bytes(self) -> int:
        return self._pool.held_bytes

    def take(self, nbytes: int, device: DeviceBytes, label: str) -> PooledBytes:
        self._device, self._label = device, label
        return self._pool.take(nbytes)

    def give(self, buffer: PooledBytes, device: DeviceBytes, label: str) -> None:
        self._device, self._label = device, label
        self._pool.give(buffer)

    def _allocate(self, nbytes: int) -> PooledBytes:
        assert self._device is not None
        self._device.add(self.KIND, nbytes, self._label)
        return PooledBytes(nbytes)

    def _free(self, buffer: PooledBytes) -> None:
        assert self._device is not None
        self._device.add(self.KIND, -buffer.nbytes, self._label)
