"""ZeRO++ qgZ: the gradient reduce-scatter as a hierarchical all-to-all of quantized blocks.

One implementation of :class:`zero.reduce.GradientReduction`. For ``N`` nodes of ``D`` ranks
(``W = N * D``) and a layout whose shard is ``n`` elements:

1. **Swizzled quantize.** The whole gradient chunk is quantized (symmetric, int4 or int8, one
   fp32 scale per block of ``G``) in ``W`` slices of ``S = ceil(n / G) * G`` elements, slice
   ``j`` being rank ``j``'s shard zero-padded to whole blocks, ordered so that the slices for
   local rank ``l`` of every node come as one block (``kernels.swizzled_quantize``). When ``n``
   is not a multiple of ``G`` the shards are first copied into a padded staging buffer.
2. **Intra-node all-to-all**: local rank ``l`` receives, from each rank of its node, the ``N``
   slices of the ranks with local index ``l``.
3. **Fused dequantize-reduce-requantize**: their sum over the node, in fp32, quantized again
   (``kernels.dequant_reduce_requant``).
4. **Inter-node all-to-all** among the ranks with local index ``l``: node ``m`` gets its slice.
5. **Dequantize-reduce in fp32** of the ``N`` node sums, written into the shard in the
   gradient's dtype (``kernels.dequant_reduce``).

Cross-node bytes per rank: ``(N - 1)`` slices of ``S`` elements at ``bits`` bits plus their
scales; everything else stays inside the node. Every buffer is a view of one pooled wire buffer
(``zero.wire``) and every kernel writes through ``out=``.

The error bound (docs/zeropp.md, and the derivation in tests/test_kernels_qgz.py): each of the
``W`` inputs and each of the ``N`` node sums loses at most one quantization step bound
``s (1/2 + 4uQ)`` with its own block scale ``s``, plus ``2u|value|`` per quantization and
``(k - 1) u sum|terms|`` per fp32 sum of ``k`` terms, plus the final rounding to the gradient's
dtype.
"""

from __future__ import annotations

import torch

import kernels
from chunkmem.chunk import ChunkLayout
from chunkmem.costs import Traffic
from kernels.quantized import data_nbytes, num_groups
from zero.comm import Communicator, Handle
from zero.comm_ledger import collective_traffic
from zero.stage_guard import StageGuard
from zero.topology import NodeGroups, Topology
from zero.wire import WireBuffers, aligned, carve, packed_nbytes, packed_view, wire_parts


class HierarchicalQuantizedReduceScatter:
    """qgZ over the node groups; ``phase`` is what its collectives are recorded under."""

    def __init__(
        self,
        comm: Communicator,
        groups: NodeGroups,
        wire: WireBuffers,
        bits: int,
        block_size: int,
        phase: str,
    ) -> None:
        self.comm = comm
        self.groups = groups
        self.wire = wire
        self.bits = bits
        self.block_size = block_size
        self.phase = phase

    def slice_numel(self, shard_numel: int) -> int:
        """Elements per rank on the wire: the shard padded to whole blocks."""
        return kernels.slice_numel(shard_numel, 1, self.block_size)

    def launch(self, layout: ChunkLayout, full: torch.Tensor, shard: torch.Tensor) -> _QgzWork:
        return _QgzWork(self, full, shard)


class _QgzWork:
    """One qgZ reduction in flight. Launching runs steps 1-2; steps 3-4 follow in ``advance``
    (when the next reduction launched), or earlier in ``is_completed`` once the intra-node
    exchange arrived, or in ``wait``, and step 5 in ``wait``: the inter-node exchange overlaps
    the rest of backward. Collectives on each node group are issued in launch order on every
    rank, which is all that ``all_to_all`` needs."""

    def __init__(
        self, owner: HierarchicalQuantizedReduceScatter, full: torch.Tensor, shard: torch.Tensor
    ) -> None:
        topology = owner.groups.topology
        self._owner = owner
        self._shard = shard
        bits, block, dtype = owner.bits, owner.block_size, full.dtype
        world, nodes, per_node = topology.world_size, topology.nodes, topology.node_size
        n = shard.numel()
        s = owner.slice_numel(n)
        self._n, self._s, self._nodes, self._per_node = n, s, nodes, per_node
        sizes = buffer_parts(topology, n, s, bits, block, dtype.itemsize)
        self._buffer = owner.wire.take(sum(aligned(size) for size in sizes))
        try:
            parts = carve(self._buffer, sizes)
            self._sent = packed_view(parts[1], world * s, bits, block, dtype)
            self._received = packed_view(parts[2], world * s, bits, block, dtype)
            self._partial = packed_view(parts[3], nodes * s, bits, block, dtype)
            self._sums = packed_view(parts[4], nodes * s, bits, block, dtype)
            self._result = parts[5].view(dtype)[:s] if s != n else shard
            source = full
            if s != n:
                source = parts[0].view(dtype)[: world * s]
                padded = source.view(world, s)
                padded[:, :n].copy_(full.view(world, n))
                padded[:, n:].zero_()
            kernels.swizzled_quantize(
                source,
                nodes=nodes,
                devices_per_node=per_node,
                bits=bits,
                group_size=block,
                symmetric=True,
                out=self._sent,
            )
            self._intra: Handle | None = self._exchange(self._sent, self._received, "intra")
        except BaseException:
            self._release()
            raise
        self._inter: Handle | None = None
        self._guard = StageGuard("a qgZ reduce-scatter")

    def _exchange(self, send, received, which: str) -> Handle:
        owner = self._owner
        group = owner.groups.intra if which == "intra" else owner.groups.inter
        with owner.comm.serving(owner.phase):
            return owner.comm.all_to_all(
                wire_parts(send), wire_parts(received), group=group, async_op=True
            )

    def _reduce_in_node(self) -> None:
        """Steps 3-4: the node's sum of this local rank's slices, then the inter-node exchange
        (once: a failure is kept for ``wait``)."""
        intra, self._intra = self._intra, None
        assert intra is not None
        with self._guard.stage("intra-node exchange and node sum"):
            intra.wait()
            kernels.dequant_reduce_requant(self._received.split(self._per_node), out=self._partial)
            self._inter = self._exchange(self._partial, self._sums, "inter")

    def advance(self) -> None:
        """Steps 3-4 now (:class:`zero.reduce.Staged`): the inter-node exchange overlaps
        what backward computes next."""
        if self._buffer is not None and self._intra is not None:
            self._reduce_in_node()

    def is_completed(self) -> bool:
        if self._buffer is None or (self._inter is None and self._intra is None):
            return True  # finished, or failed (``wait`` raises it)
        if self._intra is not None:
            if not self._intra.is_completed():
                return False
            self._reduce_in_node()
        assert self._inter is not None
        return self._inter.is_completed()

    def wait(self) -> None:
        """Finish steps 3-5 into the shard; the wire buffer goes back whatever happens."""
        if self._buffer is None:
            return
        try:
            if self._intra is not None:
                self._reduce_in_node()
            self._guard.check()
            assert self._inter is not None
            self._inter.wait()
            kernels.dequant_reduce(self._sums.split(self._nodes), out=self._result)
            if self._result is not self._shard:
                self._shard.copy_(self._result[: self._n])
        finally:
            self._release()

    def _release(self) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            self._owner.wire.give(buffer)


def buffer_parts(
    topology: Topology, n: int, s: int, bits: int, block: int, itemsize: int
) -> list[int]:
    """Byte sizes of one reduction's buffers, for a shard of ``n`` elements sent as slices of
    ``s``: the padded staging copy (when ``s != n``), the whole chunk quantized (sent and
    received), the node sums (sent and received), and the padded result (when ``s != n``)."""
    world, nodes = topology.world_size, topology.nodes
    whole, node_sums = packed_nbytes(world * s, bits, block), packed_nbytes(nodes * s, bits, block)
    staged = aligned(world * s * itemsize) if s != n else 0
    result = aligned(s * itemsize) if s != n else 0
    return [staged, whole, whole, node_sums, node_sums, result]


class HierarchicalQuantizedReduceScatterCosts:
    """:class:`HierarchicalQuantizedReduceScatter`'s costs: an all-to-all of the whole chunk
    quantized inside the node, one of the node sums across nodes (levels and scales, as
    ``wire_parts`` sends them), and one pooled buffer holding every part."""

    def __init__(
        self, topology: Topology, bits: int, block_size: int, itemsize: int, phase: str
    ) -> None:
        self.topology = topology
        self.bits = bits
        self.block_size = block_size
        self.itemsize = itemsize
        self.phase = phase

    def _slice(self, layout: ChunkLayout) -> tuple[int, int]:
        n = layout.capacity // self.topology.world_size
        return n, kernels.slice_numel(n, 1, self.block_size)

    def _sent_nbytes(self, numel: int) -> int:
        return data_nbytes(numel, self.bits) + 4 * num_groups(numel, self.block_size)

    def traffic(self, layout: ChunkLayout) -> list[Traffic]:
        topology = self.topology
        _n, s = self._slice(layout)
        intra = self._sent_nbytes(topology.world_size * s)
        inter = self._sent_nbytes(topology.nodes * s)
        return [
            collective_traffic("all_to_all", intra, 1, topology, topology.node, self.phase),
            collective_traffic("all_to_all", inter, 1, topology, topology.cross, self.phase),
        ]

    def buffer_bytes(self, layout: ChunkLayout) -> int:
        n, s = self._slice(layout)
        parts = buffer_parts(self.topology, n, s, self.bits, self.block_size, self.itemsize)
        return sum(aligned(size) for size in parts)

    def state_bytes(self, layout: ChunkLayout) -> dict[str, int]:
        return {}
