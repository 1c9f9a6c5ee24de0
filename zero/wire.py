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

import torch

from chunkmem.residency import Residency
from kernels import QuantizedTensor
from kernels.quantized import data_nbytes, num_groups

ALIGN = 64  # bytes: buffers carved from a pooled one start on a cache line
SCALES_ALIGN = 4  # bytes: where the scales start in the wire format


def aligned(nbytes: int, alignment: int = ALIGN) -> int:
    return -(-nbytes // alignment) * alignment


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


class WireBuffers:
    """Reusable uint8 buffers on the compute device, accounted as workspaces (see the note).

    At most ``keep_idle`` buffers wait for reuse; one given back beyond that is freed, so a burst
    of collectives in flight (the first cycle's reductions) leaves nothing behind.
    """

    def __init__(self, residency: Residency, keep_idle: int = 4) -> None:
        self._residency = residency
        self._keep_idle = keep_idle
        self._free: list[torch.Tensor] = []
        self._held = 0

    @property
    def held_bytes(self) -> int:
        """Bytes the pool holds, in use or not."""
        return self._held

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (the smallest free one that fits, or a new one);
        give it back with :meth:`give`."""
        fitting = [b for b in self._free if b.numel() >= nbytes]
        if fitting:
            buffer = min(fitting, key=torch.Tensor.numel)
            self._free = [b for b in self._free if b is not buffer]
            return buffer
        residency = self._residency
        buffer = residency.allocate_workspace(
            aligned(nbytes), torch.uint8, residency.compute, set()
        )
        self._held += buffer.numel()
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        if len(self._free) < self._keep_idle:
            self._free.append(buffer)
            return
        smallest = min([*self._free, buffer], key=torch.Tensor.numel)
        if smallest is not buffer:
            self._free = [b for b in self._free if b is not smallest] + [buffer]
        self._held -= smallest.numel()
        self._residency.free_workspace(smallest, self._residency.compute)
