"""ZeRO parameter gathers: the two ways a layout's parameters become whole again.

- :class:`GatherUpdatedShards` (stages 1-2): every rank keeps whole parameter chunks and
  updates only its shard; after each layout's update the shards are all-gathered in place,
  asynchronously, overlapping the next layouts' updates, in one ring or in two levels across
  nodes (``zero.two_level_gather``).
- :class:`GatherForCompute` (stage 3): a rank keeps only its shard; each use all-gathers the
  layout into a gathered copy, owned by the layout's :class:`zero.layout_life.LayoutLife`,
  prefetched one traced moment ahead, and resharded by a rule every rank applies alike (the
  trace says whether the phase needs it again). How the bytes
  travel is a :class:`WeightGather`: :class:`ExactAllGather`, or ZeRO++ qwZ's quantized one
  (``zero.quantized_gather``); ZeRO++ hpZ is a subclass (``zero.hierarchical_gather``).

An all-gather in flight belongs to the chunk it fills (``chunk.arriving``): whoever reads the
chunk waits for it first (``Residency.ready``), and ``cancel`` waits for all of them, so no
rank leaves a collective half-issued behind an exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot
from chunkmem.costs import DeviceBytes, GathererCosts, Traffic
from chunkmem.residency import Residency
from chunkmem.sharding import ParamGatherer, Sharding, Subject, Waitable, no_subject
from chunkmem.states import TensorState
from chunkmem.tracer import Phase
from zero.comm import Communicator, Group
from zero.comm_ledger import collective_traffic
from zero.in_flight import Chained, InIssueOrder
from zero.kinds import GATHERED
from zero.layout_life import GatherState, LayoutLife
from zero.topology import Topology
from zero.wire import BytesPool, PooledBytes

AllGather = Callable[[torch.Tensor, torch.Tensor, bool], Waitable]


class WeightGather(Protocol):
    """How a stage-3 gather moves bytes: every rank's ``shard`` into ``full`` (rank ``i``'s at
    ``full[i*n:(i+1)*n]``), recorded under ``phase``, the phase of the moment the gathered copy
    serves. With ``async_op`` False it returns once ``full`` holds the result."""

    def start(
        self, shard: torch.Tensor, full: torch.Tensor, *, phase: str, async_op: bool
    ) -> Waitable: ...


class ExactAllGather:
    """The values as they are, in one all-gather on ``group`` (default: the world)."""

    def __init__(self, comm: Communicator, group: Group | None = None) -> None:
        self.comm = comm
        self.group = group

    def start(
        self, shard: torch.Tensor, full: torch.Tensor, *, phase: str, async_op: bool
    ) -> Waitable:
        with self.comm.serving(phase):
            return self.comm.all_gather(shard, full, group=self.group, async_op=async_op)


class WeightGatherCosts(Protocol):
    """The cost model of a :class:`WeightGather`: a gather of a layout of ``capacity``
    elements (its collectives), and the bytes of wire buffer it asks the pool for while in
    flight (0: none)."""

    def traffic(self, capacity: int, phase: str) -> list[Traffic]: ...

    def buffer_bytes(self, capacity: int) -> int: ...


class ExactAllGatherCosts:
    """:class:`ExactAllGather`'s costs: one all-gather of the values on each rank's group
    (``group_of``), in place."""

    def __init__(
        self, topology: Topology, itemsize: int, group_of: Callable[[int], range] | None = None
    ) -> None:
        self.topology = topology
        self.itemsize = itemsize
        self.group_of = group_of or topology.world

    def traffic(self, capacity: int, phase: str) -> list[Traffic]:
        return [
            collective_traffic(
                "all_gather", capacity, self.itemsize, self.topology, self.group_of, phase
            )
        ]

    def buffer_bytes(self, capacity: int) -> int:
        return 0


class GatherUpdatedShards(ParamGatherer):
    """Stages 1-2: all-gather each layout's updated shard into its whole parameter chunk.

    ``carry_over_step`` (``zero.overlap_step_gather``): the step issues every gather but
    waits for none; each stays the chunk's ``arriving``, which the next forward's access
    waits for (``Residency.ready``), so the last layouts' gathers overlap the first layouts'
    forward. The carried chunks are not pinned: whatever moves or writes a chunk waits for
    its gather first. ``settle`` waits for the rest; the engine calls it before backward
    and before anything reads the whole model, so no gather outlives the next forward.
    """

    def __init__(
        self,
        residency: Residency,
        sharding: Sharding,
        all_gather: AllGather,
        carry_over_step: bool = False,
    ) -> None:
        self.residency = residency
        self.sharding = sharding
        self._all_gather = all_gather
        self.carry_over_step = carry_over_step
        self._gathering: list[Chunk] = []  # pinned until they arrived
        self._carried: list[Chunk] = []  # issued by the last step, waited for by their reader

    def after_update(self, layout: ChunkLayout) -> None:
        param = layout.chunks[ChunkKind.PARAM]
        self.residency.room.ensure_on_device([param])
        if self._gathering:
            # A gather in two levels issues its second when the next starts (every rank
            # updates the layouts in one order): it overlaps this one's first.
            previous = self._gathering[-1].arriving
            if isinstance(previous, Chained):
                previous.advance()
        start, numel = self.sharding.shard(layout)
        param.pin()
        self._gathering.append(param)
        # In place: this rank's shard is already in its slot of the chunk.
        with self.sharding.about(layout.index):
            shard = param.payload[start : start + numel]
            param.arriving = self._all_gather(shard, param.payload, True)

    def finish_step(self) -> None:
        """Wait for every gather the step launched; or (``carry_over_step``) issue the last
        one's second level, so that every rank has issued all of them at this point of its
        program, and leave them to their readers, in issue order (:class:`InIssueOrder`).
        All are unpinned whatever raises."""
        gathering, self._gathering = self._gathering, []
        try:
            if not self.carry_over_step:
                _await_all(self.residency, gathering)
                return
            self._carried = gathering  # cancel's to wait for, should issuing fail
            last = gathering[-1].arriving if gathering else None
            if isinstance(last, Chained):
                last.advance()
            order = InIssueOrder([chunk.arriving for chunk in gathering])  # type: ignore[misc]
            for index, chunk in enumerate(gathering):
                chunk.arriving = order.through(index)
        finally:
            _unpin(gathering)

    def settle(self) -> None:
        """Wait for the gathers the last step carried over that no reader waited for yet."""
        carried, self._carried = self._carried, []
        _await_all(self.residency, carried)

    def cancel(self) -> None:
        """Wait for every gather in flight, this step's and the last one's."""
        gathering, self._gathering = self._gathering, []
        try:
            _await_all(self.residency, gathering)
        finally:
            _unpin(gathering)
            self.settle()


def _unpin(chunks: list[Chunk]) -> None:
    for chunk in chunks:
        chunk.unpin()


class GatherUpdatedShardsCosts(GathererCosts):
    """:class:`GatherUpdatedShards`' costs: an in-place all-gather after each update (one ring,
    or :mod:`zero.two_level_gather`'s), no buffer."""

    def __init__(self, weights: WeightGatherCosts) -> None:
        self.weights = weights

    def after_update(self, capacity: int) -> list[Traffic]:
        return self.weights.traffic(capacity, Phase.STEP.value)


class GatherForCompute(ParamGatherer):
    """Stage 3: parameters compute on a gathered copy of every rank's shard, each owned by
    its layout's :class:`zero.layout_life.LayoutLife`. The gatherer is the materializer of
    the gathered kind (residency asks it for a copy a moment needs) and decides, by rules
    every rank applies alike, when to gather ahead (prefetch) and when to reshard."""

    compute_kind = GATHERED

    def __init__(
        self, residency: Residency, weights: WeightGather, about: Subject = no_subject
    ) -> None:
        self.residency = residency
        self._about = about  # names the layout in each gather's identity
        self.tracer = residency.tracer
        self.weights = weights
        self._lives: dict[int, LayoutLife] = {}
        self._releasing: dict[int, LayoutLife] = {}  # pinned when released; see at moment end
        # Layout -> its slots recomputed in this backward whose own backward has not run yet
        # (see [Note: one gather per unit per backward]).
        self._awaiting_backward: dict[int, tuple[LayoutLife, set[int]]] = {}
        # Layouts gathered in this step after their update, for the next cycle's first moment
        # (see [Note: gathering ahead across the step]).
        self._carried: set[int] = set()
        residency.materializers[GATHERED] = self

    def life(self, layout: ChunkLayout) -> LayoutLife:
        life = self._lives.get(layout.index)
        if life is None:
            life = self._lives[layout.index] = LayoutLife(
                layout, self.residency, self._launch, self._before_drop
            )
        return life

    def transient_kinds(self) -> frozenset[ChunkKind]:
        return frozenset({GATHERED})

    # ------------------------------------------------------------------ how bytes travel
    def _launch(self, chunk: Chunk, phase: Phase, async_op: bool) -> Waitable:
        """Launch the gather of every rank's shard into ``chunk`` (for a moment of ``phase``)."""
        shard = chunk.layout.chunks[ChunkKind.PARAM]
        self.residency.room.ensure_on_device([shard])
        with self._about(chunk.layout.index):
            return self.weights.start(
                shard.payload, chunk.payload, phase=phase.value, async_op=async_op
            )

    def _before_drop(self, gathered: Chunk) -> None:
        """What a gathered copy leaves behind when it goes (nothing; hpZ keeps a part)."""

    def _phase_now(self) -> Phase:
        tracer = self.tracer
        moments = tracer.observed.moments
        return moments[-1].phase if tracer.index >= 0 and moments else Phase.FORWARD

    # ------------------------------------------------------------------ unshard
    def materialize(self, chunk: Chunk, wait: bool) -> None:
        """A moment needs ``chunk`` (residency made room for it)."""
        self.life(chunk.layout).unshard(self._phase_now(), async_op=not wait)

    def _next_gathers(self) -> list[tuple[Chunk, Phase]]:
        """The gathered copies the next traced moment computes on that are not on the device
        (gathered nor arriving), with that moment's phase."""
        residency = self.residency
        replay = self.tracer.replay
        assert replay is not None
        wanted = []
        for index, accessed in self.tracer.upcoming(1):
            phase = replay.moments[index % len(replay)].phase
            for chunk_id, on_device in accessed.items():
                chunk = residency.chunks.get(chunk_id)
                if (
                    chunk is not None
                    and chunk.kind is GATHERED
                    and on_device
                    and not chunk.on_device
                ):
                    wanted.append((chunk, phase))
        return wanted

    def before_access(self) -> None:
        """[Note: the next gather before this one's wait] Gathering the next moment's copy
        after this moment's copy arrived leaves the link idle while this rank finishes the
        arrival (qwZ dequantizes, two levels issue their second all-gather) and starts the
        next: ~40% of a qwZ gather's time at 2 nodes x 2 (benchmarks/zeropp). Issued before
        the wait instead, it queues behind this moment's gather and the link stays busy; at
        the same peak, since the two copies coexist during this moment anyway. Only where it
        fits without evicting beside what this moment still brings in (else
        :meth:`after_access` makes room for it, as always), and only when every copy this
        moment computes on is already gathered or arriving: its gather is then issued
        already, so whichever rank gathers ahead here and whichever after its wait, every
        rank issues the same gathers in one order. Not across the cycle's end (the step
        changes the shards)."""
        tracer = self.tracer
        if not tracer.replaying or tracer.replay is None:
            return
        if tracer.index + 1 >= len(tracer.replay):
            return
        residency = self.residency
        for chunk_id, on_device in tracer.current_accesses().items():
            chunk = residency.chunks.get(chunk_id)
            if chunk is not None and chunk.kind is GATHERED and on_device and not chunk.on_device:
                return
        for chunk, phase in self._next_gathers():
            if not residency.room.room_ahead(chunk.nbytes, 1):
                return
            self.life(chunk.layout).unshard(phase, async_op=True)

    def after_access(self) -> None:
        """Start gathering the layouts the next traced moment needs, so the all-gather
        overlaps this moment's compute. Driven by the trace alone, so every rank issues the
        same gathers in the same order."""
        if not self.tracer.replaying:
            return
        for chunk, phase in self._next_gathers():
            self.residency.room.make_room(chunk.nbytes, {chunk.id}, "prefetch")
            self.life(chunk.layout).unshard(phase, async_op=True)

    # ------------------------------------------------------------------ reshard
    def released(self, layout: ChunkLayout, slots: list[TensorSlot], state: TensorState) -> None:
        """[Note: one gather per unit per backward] Activation checkpointing recomputes a
        unit's forward in backward, right before the unit's own backward needs the same
        parameters: a copy released by a forward in backward stays until the backward of
        every slot it recomputed has run (their post-backward release), or backward ends.
        Dropped after the recomputation, it was gathered a third time (GPT 4x128 on 2 ranks:
        1.35x the bytes of two gathers per step; FSDP2 keeps its group unsharded from the
        recomputation through its backward the same way)."""
        life = self.life(layout)
        if state is TensorState.HOLD_AFTER_FWD and self._phase_now() is Phase.BACKWARD:
            _, awaiting = self._awaiting_backward.setdefault(layout.index, (life, set()))
            awaiting.update(map(id, slots))
            return
        entry = self._awaiting_backward.get(layout.index)
        if entry is not None:
            entry[1].difference_update(map(id, slots))
            if entry[1]:
                return
            del self._awaiting_backward[layout.index]
        self._release(life)

    def backward_over(self) -> None:
        awaiting, self._awaiting_backward = self._awaiting_backward, {}
        for life, _slots in awaiting.values():
            self._release(life)

    def _release(self, life: LayoutLife) -> None:
        """Reshard a gathered copy once no one uses it and it is not needed again in this
        phase (the trace says when): the other ranks' shards are gathered again next phase.
        A copy pinned for the rest of the moment is looked at again when the moment ends."""
        if life.state is GatherState.SHARDED:
            return
        gathered = life.chunk
        if not gathered.movable():
            if gathered.pins and life.state is GatherState.GATHERED:
                life.defer()
                self._releasing[life.layout.index] = life
            return
        if self.tracer.replaying and self.tracer.needed_again_this_phase(gathered.id):
            return
        self.residency.ready(gathered)
        life.reshard()

    def moment_over(self) -> None:
        releasing, self._releasing = list(self._releasing.values()), {}
        for life in releasing:
            life.keep()
            self._release(life)

    # ------------------------------------------------------------------ across the step
    def after_update(self, layout: ChunkLayout) -> None:
        """[Note: gathering ahead across the step] The next cycle's first moment has nothing
        before it to hide its gather behind: its copy was gathered when the forward began,
        with the link idle through the step. Once the step has updated a layout that moment
        computes on, its gather starts right away, overlapping the rest of the step and
        whatever the training loop does before the next forward (loading the next batch);
        the copy is kept by ``end_cycle``, the only copy built from the new values. Every
        rank updates the layouts in one order and decides by the trace alone, so all issue
        it alike. It costs one gathered copy (and qwZ's wire buffer) from that update until
        the first moment, which the estimate counts; a load of a checkpoint drops it with
        the rest (``end_cycle`` keeps only what this step gathered)."""
        if layout.index not in self._first_moment_layouts():
            return
        life = self.life(layout)
        if life.state is not GatherState.SHARDED:
            life.drop()  # built from the old values
        self._before_carry(layout)
        chunk = life.chunk
        self.residency.room.make_room(chunk.nbytes, {chunk.id}, "prefetch", within="capacity")
        life.unshard(Phase.FORWARD, async_op=True)
        self._carried.add(layout.index)

    def _first_moment_layouts(self) -> set[int]:
        """The layouts whose gathered copies the trace's first moment computes on."""
        tracer = self.tracer
        if not tracer.replaying or tracer.replay is None or not len(tracer.replay):
            return set()
        chunks = self.residency.chunks
        return {
            chunks[chunk_id].layout.index
            for chunk_id, on_device in tracer.replay.accesses[0].items()
            if on_device and chunk_id in chunks and chunks[chunk_id].kind is GATHERED
        }

    def _before_carry(self, layout: ChunkLayout) -> None:
        """What must go before ``layout`` is gathered from its updated shards (hpZ: its
        secondary, which holds the old values)."""

    def end_cycle(self) -> None:
        """Gathered copies are stale once the shards are updated, but for those this step
        gathered after the update."""
        carried, self._carried = self._carried, set()
        self._releasing.clear()
        self._awaiting_backward.clear()
        # Every gathered copy, also those packing built before any life knew the layout.
        for chunk in list(self.residency.chunks.values()):
            stale = chunk.kind is GATHERED and chunk.layout.index not in carried
            if stale and chunk.payload is not None:
                self.life(chunk.layout).drop()

    def cancel(self) -> None:
        """Wait for every gather in flight (the peers issued them too), then drop every
        gathered copy: the next cycle gathers afresh."""
        self._carried.clear()  # an aborted step may have updated it alone
        in_flight = [
            life.chunk for life in self._lives.values() if life.state is GatherState.GATHERING
        ]
        try:
            _await_all(self.residency, in_flight)
        finally:
            self.end_cycle()


class GatherForComputeCosts(GathererCosts):
    """:class:`GatherForCompute`'s costs: a gathered copy of the layout's capacity in the
    compute dtype from its gather until it is dropped, and the weights' traffic and wire
    buffer (from ``pool``, shared with the reducer as ``zero.strategy`` shares it) for each
    gather; the buffers of prefetched gathers go back when the next moment reads them."""

    gathers_for_compute = True
    transient = True

    def __init__(self, weights: WeightGatherCosts, pool: BytesPool, itemsize: int) -> None:
        self.weights = weights
        self.pool = pool
        self.itemsize = itemsize
        self._in_flight: list[PooledBytes] = []  # wire buffers of launched gathers

    def gather(self, layout: int, capacity: int, device: DeviceBytes, label: str) -> list[Traffic]:
        device.add(GATHERED.value, capacity * self.itemsize, label)
        wire = self.weights.buffer_bytes(capacity)
        if wire:
            self._in_flight.append(self.pool.take(wire, device, label))
        return self.weights.traffic(capacity, label.partition(":")[0])

    def arrived(self, device: DeviceBytes, label: str, keep: int = 0) -> None:
        count = len(self._in_flight) - keep
        done, self._in_flight = self._in_flight[:count], self._in_flight[count:]
        for buffer in done:
            self.pool.give(buffer, device, label)

    def in_flight(self) -> int:
        return len(self._in_flight)

    def carry(self, layout: int, capacity: int, device: DeviceBytes, label: str) -> list[Traffic]:
        return self.gather(layout, capacity, device, label)

    def dropped(self, layout: int, capacity: int, device: DeviceBytes, label: str) -> None:
        device.add(GATHERED.value, -capacity * self.itemsize, label)


def _await_all(residency: Residency, chunks: list[Chunk]) -> None:
    """Wait for every chunk's gather; whatever waiting raises, none is left marked arriving."""
    try:
        for chunk in chunks:
            residency.ready(chunk)
    finally:
        for chunk in chunks:
            chunk.arriving = None
