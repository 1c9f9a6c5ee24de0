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

[Note: the two-level weight gather] One all-gather over the world is a ring, and a ring
crosses each node boundary with ``W - 1`` of the ``W`` pieces: on ``N`` nodes of ``D`` ranks a
node takes in ``W - 1`` pieces where it needs the ``(N - 1) D`` its peers hold, 3 where 2 do on
2 nodes x 2, 15 where 8 do on 2 nodes x 8 (the ratio goes to 1 as ``N`` grows). With
:class:`TwoLevelPieces` the pieces travel in two all-gathers instead: among the ranks of one
local rank across nodes (each takes the ``N - 1`` pieces of its class, the only cross-node
bytes), then inside the node (each takes the other classes' ``N`` pieces each). The wire buffer
is then ordered class by class, not rank by rank; dequantizing writes each piece to its
rank's slot of the gathered chunk anyway, so the order costs nothing here (an exact gather
would need a permuting copy of the whole layout). The second all-gather is issued when the
gather is waited for, a point every rank reaches in one order (the trace's), never when a
poll happens to see the first done; its groups carry nothing else, so no other collective's
order can interleave with them.

Error per element (docs/zeropp.md): with ``s = max(absmax(block) / Q, 2^-126)``, ``Q`` = 127
(int8) or 7 (int4), ``|x - x_hat| <= s (1/2 + 4uQ) + 2u max(|x|, |x_hat|)`` in fp32
(``u = 2^-24``), plus the rounding of ``x_hat`` to the compute dtype.
"""

from __future__ import annotations

from typing import Protocol

import torch

import kernels
from chunkmem.costs import Traffic
from chunkmem.sharding import Waitable
from zero.comm import Communicator, Group, Handle
from zero.comm_ledger import collective_traffic
from zero.in_flight import Chained, Then
from zero.topology import Topology
from zero.wire import WireBuffers, packed_nbytes, packed_view


class PieceGather(Protocol):
    """How every rank's piece of a wire buffer reaches every rank: which slot holds which
    rank's piece, and the collectives that fill the buffer."""

    def slot_of(self, rank: int) -> int:
        """The slot of the wire buffer that holds group rank ``rank``'s piece."""

    def start(self, wire: torch.Tensor, piece: int, phase: str) -> Waitable:
        """Fill ``wire`` (this rank's piece already in its slot) with every rank's piece."""


class FlatPieces:
    """One all-gather on ``group``: rank ``i``'s piece in slot ``i``."""

    def __init__(self, comm: Communicator, group: Group) -> None:
        self.comm = comm
        self.group = group

    def slot_of(self, rank: int) -> int:
        return rank

    def start(self, wire: torch.Tensor, piece: int, phase: str) -> Waitable:
        mine = wire[self.group.rank * piece : (self.group.rank + 1) * piece]
        with self.comm.serving(phase):
            return self.comm.all_gather(mine, wire, group=self.group, async_op=True)


class TwoLevelPieces:
    """Across nodes within a local rank's class, then inside the node (see [Note: the
    two-level weight gather]). ``inter`` holds the world ranks of this rank's local rank, one
    per node; ``intra`` this rank's node; slot ``l * N + j`` holds node ``j``'s local rank
    ``l``."""

    def __init__(self, comm: Communicator, topology: Topology, inter: Group, intra: Group) -> None:
        self.comm = comm
        self.topology = topology
        self.inter = inter
        self.intra = intra

    def slot_of(self, rank: int) -> int:
        topology = self.topology
        return topology.local_rank(rank) * topology.nodes + topology.node_of(rank)

    def start(self, wire: torch.Tensor, piece: int, phase: str) -> Waitable:
        nodes, local = self.topology.nodes, self.intra.rank
        block = wire[local * nodes * piece : (local + 1) * nodes * piece]
        mine = block[self.inter.rank * piece : (self.inter.rank + 1) * piece]
        with self.comm.serving(phase):
            across = self.comm.all_gather(mine, block, group=self.inter, async_op=True)
        layout = self.comm.subject  # the second level names it wherever issued (see Chained)
        return Chained(across, lambda: self._inside(block, wire, phase, layout))

    def _inside(self, block: torch.Tensor, wire: torch.Tensor, phase: str, layout: int) -> Handle:
        with self.comm.serving(phase), self.comm.about(layout):
            return self.comm.all_gather(block, wire, group=self.intra, async_op=True)


class QuantizedAllGather:
    """A :class:`zero.gather.WeightGather` that sends ``bits``-bit blocks plus scales, in the
    collectives of ``pieces`` (default: one all-gather on the world)."""

    def __init__(
        self,
        comm: Communicator,
        wire: WireBuffers,
        bits: int,
        block_size: int,
        pieces: PieceGather | None = None,
    ) -> None:
        self.comm = comm
        self.wire = wire
        self.bits = bits
        self.block_size = block_size
        self.pieces = pieces or FlatPieces(comm, comm.world)
        self.world = comm.size

    def piece_nbytes(self, numel: int) -> int:
        """Bytes one rank sends for a shard of ``numel`` elements (levels, scales, alignment)."""
        return packed_nbytes(numel, self.bits, self.block_size)

    def start(
        self, shard: torch.Tensor, full: torch.Tensor, *, phase: str, async_op: bool
    ) -> Waitable:
        world, n, pieces = self.world, shard.numel(), self.pieces
        piece = self.piece_nbytes(n)
        buffer = self.wire.take(world * piece)
        try:
            wire = buffer[: world * piece]
            slot = pieces.slot_of(self.comm.rank)
            kernels.quantize(
                shard,
                bits=self.bits,
                group_size=self.block_size,
                symmetric=True,
                out=packed_view(wire[slot * piece : (slot + 1) * piece], n, self.bits,
                                self.block_size, shard.dtype),
            )  # fmt: skip
            handle = pieces.start(wire, piece, phase)
        except BaseException:
            self.wire.give(buffer)
            raise

        def dequantize() -> None:
            for rank in range(world):
                slot = pieces.slot_of(rank)
                sent = packed_view(
                    wire[slot * piece : (slot + 1) * piece], n, self.bits, self.block_size,
                    full.dtype,
                )  # fmt: skip
                kernels.dequantize(sent, out=full[rank * n : (rank + 1) * n])

        arrival = Then(handle, finish=dequantize, release=lambda: self.wire.give(buffer))
        if not async_op:
            arrival.wait()
        return arrival


class QuantizedAllGatherCosts:
    """:class:`QuantizedAllGather`'s costs: every rank's packed shard (levels, scales) through a
    pooled wire buffer of all of them, in one uint8 all-gather on the world, or with
    ``two_level`` in one across nodes and one inside the node."""

    def __init__(
        self, topology: Topology, bits: int, block_size: int, two_level: bool = False
    ) -> None:
        self.topology = topology
        self.bits = bits
        self.block_size = block_size
        self.two_level = two_level

    def _piece_nbytes(self, capacity: int) -> int:
        return packed_nbytes(capacity // self.topology.world_size, self.bits, self.block_size)

    def traffic(self, capacity: int, phase: str) -> list[Traffic]:
        topology, piece = self.topology, self._piece_nbytes(capacity)
        if not self.two_level:
            return [
                collective_traffic(
                    "all_gather", topology.world_size * piece, 1, topology, topology.world, phase
                )
            ]
        nodes = topology.nodes
        return [
            collective_traffic("all_gather", nodes * piece, 1, topology, topology.cross, phase),
            collective_traffic("all_gather", topology.world_size * piece, 1, topology,
                               topology.node, phase),
        ]  # fmt: skip

    def buffer_bytes(self, capacity: int) -> int:
        return self.topology.world_size * self._piece_nbytes(capacity)
