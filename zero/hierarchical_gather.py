"""ZeRO++ hpZ: a secondary shard of every gathered layout, kept inside the node.

When a gathered copy is dropped, each rank first keeps its part of it for its hpZ group of
``h`` consecutive ranks (a divisor of the node size): elements ``[i*c/h, (i+1)*c/h)`` of the
layout's capacity ``c`` for group rank ``i``, in a chunk of kind ``zero.kinds.HPZ_SECONDARY``. The next gather of
that layout, normally the backward one, all-gathers those parts inside the group: it never
crosses nodes, and it reproduces the forward's gathered copy bit for bit (it is a copy of the
same bytes, so with qwZ it holds what the forward's dequantization produced). The secondaries
are dropped at the end of every cycle: the step changes the parameters they copy.

Memory: ``c/h`` elements of the compute dtype per layout per rank from the forward until the
step (16-bit parameters / h in bf16), on top of the primary shard's ``c/n``. They are a chunk
kind of their own, so the ledger and the report show them apart, and placement may move them
to the host like any other dynamic chunk.

[Note: when the secondary is used] Whenever it exists, whatever the phase: the parameters do
not change between steps, so the forwards of later micro-batches of an accumulation window
gather inside the node too. Every rank creates and drops its secondaries at the same points
(when the gathered copy is dropped, by the rule every rank applies alike; at the end of a
cycle), so every rank picks the same group for every gather.

[Note: the secondary is rewritten at every drop] A gathered copy can change after it was
filled: parameters are packed on first use, so in the first forward a layout's later
parameters are written into its gathered copy after the earlier ones were gathered (from the
secondary, if one was kept). A secondary kept once and never rewritten would then miss them,
and the backward would compute on zeros where those parameters are. So every drop copies this
rank's part again (``c/h`` elements, ``1/h`` of what the gather wrote), and
``tests/test_zeropp.py`` checks that hpZ alone trains bit for bit like plain stage 3.
"""

from __future__ import annotations

from chunkmem.chunk import Chunk, ChunkLayout
from chunkmem.costs import DeviceBytes, Traffic
from chunkmem.residency import Residency
from chunkmem.sharding import Subject, Waitable, no_subject
from chunkmem.tracer import Phase
from zero.comm import Group
from zero.gather import (
    ExactAllGather,
    ExactAllGatherCosts,
    GatherForCompute,
    GatherForComputeCosts,
    WeightGather,
    WeightGatherCosts,
)
from zero.in_flight import Then
from zero.kinds import GATHERED, HPZ_SECONDARY
from zero.wire import BytesPool


class HierarchicalGather(GatherForCompute):
    """Stage 3 with hpZ: primary gathers by ``weights``, later ones from the secondaries."""

    def __init__(
        self,
        residency: Residency,
        weights: WeightGather,
        secondary: ExactAllGather,
        about: Subject = no_subject,
    ) -> None:
        super().__init__(residency, weights, about)
        self.secondary = secondary
        group: Group = secondary.group
        self.group_rank = group.rank
        self.group_size = group.size

    def _launch(self, chunk: Chunk, phase: Phase, async_op: bool) -> Waitable:
        secondary = chunk.layout.chunks.get(HPZ_SECONDARY)
        if secondary is None or secondary.tier is None:
            return super()._launch(chunk, phase, async_op)
        self.residency.room.ensure_on_device([secondary])
        secondary.pin()  # read by the gather until it completes
        try:
            with self._about(chunk.layout.index):
                handle = self.secondary.start(
                    secondary.payload, chunk.payload, phase=phase.value, async_op=True
                )
        except BaseException:
            secondary.unpin()
            raise
        arrival = Then(handle, release=secondary.unpin)
        if not async_op:
            arrival.wait()
        return arrival

    def _before_drop(self, gathered: Chunk) -> None:
        """Keep this rank's part of the gathered copy (see the note on rewriting)."""
        layout = gathered.layout
        residency = self.residency
        secondary = layout.chunks.get(HPZ_SECONDARY)
        if secondary is None:
            numel = layout.capacity // self.group_size
            secondary = residency.new_chunk(
                layout,
                HPZ_SECONDARY,
                gathered.dtype,
                None,
                (self.group_rank * numel, numel),
            )
        residency.ready(gathered)
        if secondary.tier is None:
            residency.room.make_room(secondary.nbytes, {gathered.id}, "hpz secondary")
            residency.allocate_payload(secondary, residency.compute, zeroed=False)
        with residency.pinned([secondary]):
            start = secondary.start
            secondary.payload.copy_(gathered.payload[start : start + secondary.numel])

    def _before_carry(self, layout: ChunkLayout) -> None:
        """The layout's secondary copies old values: its next gather is a primary one."""
        secondary = layout.chunks.get(HPZ_SECONDARY)
        if secondary is not None and secondary.tier is not None:
            self.residency.free_payload(secondary)

    def end_cycle(self) -> None:
        """The step changed the parameters: the secondaries copy old values."""
        super().end_cycle()
        for chunk in list(self.residency.chunks.values()):
            if chunk.kind is HPZ_SECONDARY:
                self.residency.free_payload(chunk)


class HierarchicalGatherCosts(GatherForComputeCosts):
    """:class:`HierarchicalGather`'s costs: a layout gathered again in a cycle is gathered
    from the secondaries, inside the hpZ group (``secondary``), and each drop keeps ``c/h``
    elements of the compute dtype until the step."""

    def __init__(
        self,
        weights: WeightGatherCosts,
        secondary: ExactAllGatherCosts,
        partition_size: int,
        pool: BytesPool,
        itemsize: int,
    ) -> None:
        super().__init__(weights, pool, itemsize)
        self.secondary = secondary
        self.partition_size = partition_size
        self._kept: dict[int, int] = {}  # layout -> secondary bytes

    def gather(self, layout: int, capacity: int, device: DeviceBytes, label: str) -> list[Traffic]:
        if layout not in self._kept:
            return super().gather(layout, capacity, device, label)
        device.add(GATHERED.value, capacity * self.itemsize, label)
        return self.secondary.traffic(capacity, label.partition(":")[0])

    def carry(self, layout: int, capacity: int, device: DeviceBytes, label: str) -> list[Traffic]:
        """The layout's secondary (old values) goes first; the gather is a primary one."""
        kept = self._kept.pop(layout, 0)
        device.add(HPZ_SECONDARY.value, -kept, label)
        return super().carry(layout, capacity, device, label)

    def dropped(self, layout: int, capacity: int, device: DeviceBytes, label: str) -> None:
        if layout not in self._kept:
            nbytes = capacity // self.partition_size * self.itemsize
            self._kept[layout] = nbytes
            device.add(HPZ_SECONDARY.value, nbytes, label)
        super().dropped(layout, capacity, device, label)

    def end_cycle(self, device: DeviceBytes, label: str) -> None:
        kept, self._kept = self._kept, {}
        device.add(HPZ_SECONDARY.value, -sum(kept.values()), label)
