"""ZeRO++ qwZ: stage-3 parameter all-gathers that send block-quantized values.

Each rank quantizes its shard (symmetric, int8 or int4, one fp32 scale per block of
``block_size`` elements, the kernels' spec in docs/kernels.md) straight into its slot of a
wire buffer, all-gathers the wire buffers (levels plus scales: half or a quarter of the bytes of
a 16-bit gather, a quarter or an eighth of fp32's), and dequantizes every rank's slot straight
into the gathered chunk through the kernels' ``out=``: nothing is allocated or copied per
gather (the wire buffers come from a pool, ``zero.wire``).

[Note: every rank computes on the same values] A rank's own slot is dequantized from the same
bytes its peers receive, not copied from its exact shard: every rank then computes on
bit-identical parameters, one model, as with an exact gather. What stays full precision is what
the owner keeps: its parameter shard and its fp32 master, which the update reads and writes.
The quantization error is therefore never accumulated: each step quantizes the current exact
values afresh.

Error per element (docs/zeropp.md): with ``s = max(absmax(block) / Q, 2^-126)``, ``Q`` = 127
(int8) or 7 (int4), ``|x - x_hat| <= s (1/2 + 4uQ) + 2u max(|x|, |x_hat|)`` in fp32
(``u = 2^-24``), plus the rounding of ``x_hat`` to the compute dtype.
"""

from __future__ import annotations

import torch

import kernels
from chunkmem.costs import Traffic
from chunkmem.sharding import Waitable
from zero.comm import Communicator, Group
from zero.comm_ledger import collective_traffic
from zero.gather import Then
from zero.topology import Topology
from zero.wire import WireBuffers, packed_nbytes, packed_view


class QuantizedAllGather:
    """A :class:`zero.gather.WeightGather` that sends ``bits``-bit blocks plus scales."""

    def __init__(
        self,
        comm: Communicator,
        wire: WireBuffers,
        bits: int,
        block_size: int,
        group: Group | None = None,
    ) -> None:
        self.comm = comm
        self.wire = wire
        self.bits = bits
        self.block_size = block_size
        self.group = group or comm.world

    def piece_nbytes(self, numel: int) -> int:
        """Bytes one rank sends for a shard of ``numel`` elements (levels, scales, alignment)."""
        return packed_nbytes(numel, self.bits, self.block_size)

    def start(
        self, shard: torch.Tensor, full: torch.Tensor, *, phase: str, async_op: bool
    ) -> Waitable:
        group, n = self.group, shard.numel()
        piece = self.piece_nbytes(n)
        buffer = self.wire.take(group.size * piece)
        try:
            wire = buffer[: group.size * piece]
            mine = wire[group.rank * piece : (group.rank + 1) * piece]
            kernels.quantize(
                shard,
                bits=self.bits,
                group_size=self.block_size,
                symmetric=True,
                out=packed_view(mine, n, self.bits, self.block_size, shard.dtype),
            )
            with self.comm.serving(phase):
                handle = self.comm.all_gather(mine, wire, group=group, async_op=True)
        except BaseException:
            self.wire.give(buffer)
            raise

        def dequantize() -> None:
            for i in range(group.size):
                sent = packed_view(
                    wire[i * piece : (i + 1) * piece], n, self.bits, self.block_size, full.dtype
                )
                kernels.dequantize(sent, out=full[i * n : (i + 1) * n])

        arrival = Then(handle, finish=dequantize, release=lambda: self.wire.give(buffer))
        if not async_op:
            arrival.wait()
        return arrival


class QuantizedAllGatherCosts:
    """:class:`QuantizedAllGather`'s costs on the world: every rank's packed shard (levels,
    scales) in one uint8 all-gather, through a pooled wire buffer of all of them."""

    def __init__(self, topology: Topology, bits: int, block_size: int) -> None:
        self.topology = topology
        self.bits = bits
        self.block_size = block_size

    def _wire_nbytes(self, capacity: int) -> int:
        world = self.topology.world_size
        return world * packed_nbytes(capacity // world, self.bits, self.block_size)

    def traffic(self, capacity: int, phase: str) -> Traffic:
        return collective_traffic(
            "all_gather", self._wire_nbytes(capacity), 1, self.topology, self.topology.world, phase
        )

    def buffer_bytes(self, capacity: int) -> int:
        return self._wire_nbytes(capacity)
