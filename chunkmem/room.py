"""Room on the device: which chunks leave to make it, and which come in ahead of use.

The residency (:mod:`chunkmem.residency`) keeps the payloads and moves them; this decides what
moves when, by the placement policy (:mod:`chunkmem.placement`) and the trace: it evicts for
an allocation, a fetch or a scratch buffer, sends chunks up from a full tier, brings a moment's
chunks to the device by the placement plan, prefetches, and is the valve for non-model memory
pressure. It marks the moments and accesses of the trace it reads, and ranks victims by that
trace (Belady) or by the last access it saw (LRU, and while a trace is recorded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from chunkmem.chunk import Chunk
from chunkmem.errors import OutOfMemoryError
from chunkmem.placement import Placement, plan_moment
from chunkmem.tiers import StorageTier
from chunkmem.tracer import Moment

if TYPE_CHECKING:
    from chunkmem.residency import Residency

RoomLimit = Literal["budget", "capacity"]


class Room:
    """Eviction, fetching and prefetching for the chunks of one residency
    (``residency.room``)."""

    def __init__(self, residency: Residency, placement: Placement) -> None:
        self._residency = residency
        self.placement = placement
        self._last_access: dict[int, int] = {}
        self._tick = 0

    @staticmethod
    def evictable(chunk: Chunk) -> bool:
        """Whether placement may evict ``chunk``. Derived chunks (a ZeRO-3 gathered copy) are
        dropped only by their owner, by a rule every rank applies alike: a local eviction
        would make this rank gather again alone, and a collective needs every rank."""
        return not chunk.kind.derived and chunk.movable()

    def _rank(self) -> Callable[[Iterable[int]], list[int]]:
        return self.placement.rank(self._residency.tracer, lambda c: self._last_access.get(c, -1))

    def _chunk_budget(self, moments_ahead: int = 0) -> int:
        residency = self._residency
        return self.placement.chunk_budget(
            residency.tracer, residency.static_device_bytes(), moments_ahead=moments_ahead
        )

    def _limit(self, within: RoomLimit) -> int:
        """The bytes dynamic chunks may hold on the device (see :meth:`make_room`)."""
        return self._chunk_budget() if within == "budget" else self.placement.capacity

    # ------------------------------------------------------------------ evicting
    def evict_for(self, nbytes: int, limit: int, protect: set[int], reason: str) -> None:
        """Evict movable dynamic chunks until ``nbytes`` more fit under ``limit`` and capacity
        (counting draining payloads as free: who needs the room waits for them)."""
        residency = self._residency
        used = residency.resident_bytes
        if used + nbytes <= limit and self._fits_once_drained(nbytes):
            return
        candidates = [
            c.id for c in residency.resident.values() if c.id not in protect and self.evictable(c)
        ]
        for victim_id in self._rank()(candidates):
            if used + nbytes <= limit and self._fits_once_drained(nbytes):
                return
            victim = residency.chunks[victim_id]
            residency.move(victim, residency.tiers.spill, reason)
            used -= victim.nbytes

    def _fits_once_drained(self, nbytes: int) -> bool:
        available = self._residency.ledger.device.available
        return available is None or nbytes <= available + self._residency.drains.nbytes

    def make_room(
        self, nbytes: int, protect: set[int], reason: str, within: RoomLimit = "budget"
    ) -> None:
        """Evict until ``nbytes`` more fit on the device.

        within="budget" keeps the traced non-model peak of this moment free (while recording,
        the budget is zero: only the current moment's chunks stay). within="capacity" evicts
        only what the device cannot hold beside them: for the optimizer step, where no
        untraced activations appear, and for optimizer-state homes, whose choice already
        counted every dynamic chunk and the non-model peak. The zero recording budget would
        push out chunks that those allow for, onto a host that may not hold them.
        """
        residency = self._residency
        ledger = residency.ledger
        residency.drains.reap()
        self.evict_for(nbytes, self._limit(within), protect, reason)
        device = residency.compute.name
        residency.drains.settle(until=lambda: ledger.would_fit(device, nbytes))
        if not ledger.would_fit(device, nbytes):
            raise OutOfMemoryError(
                device,
                nbytes,
                max(0, ledger.device.available or 0),
                f"Nothing more can be evicted at moment {ledger.moment_label!r}: "
                f"{ledger.describe(device)}. The chunks in use at one moment plus the "
                f"non-model memory exceed the device capacity; raise device.capacity, use a "
                f"smaller chunk.size, or lower the batch size / sequence length.",
            )

    def make_tier_room(
        self, tier: StorageTier, nbytes: int, protect: set[int], within: RoomLimit = "budget"
    ) -> None:
        """A limited tier is full: send its dynamic chunks needed soonest on the device up
        early, while the device has room for them (``within`` as for :meth:`make_room`)."""
        residency = self._residency
        ledger, tracer = residency.ledger, residency.tracer
        if ledger.would_fit(tier.name, nbytes):
            return
        on_tier = [
            c
            for c in residency.chunks.values()
            if c.tier is tier and c.kind.dynamic and c.id not in protect and c.movable()
        ]
        if tracer.replaying:
            on_tier.sort(key=lambda c: tracer.next_device_use(c.id))
        budget = self._limit(within)
        used = residency.resident_bytes
        for chunk in on_tier:
            if ledger.would_fit(tier.name, nbytes):
                return
            if used + chunk.nbytes <= budget and ledger.would_fit(
                residency.compute.name, chunk.nbytes
            ):
                residency.move(chunk, residency.compute, f"{tier.name} pressure")
                used += chunk.nbytes

    # ------------------------------------------------------------------ fetching
    def fetch(self, chunk: Chunk, protect: set[int], reason: str) -> None:
        """Bring one chunk to the device: move it, allocate it, or (derived) have the
        materializer of its kind make it."""
        if chunk.on_device:
            return
        residency = self._residency
        self.make_room(chunk.nbytes, protect, reason)
        if chunk.kind.derived:
            residency.materializers[chunk.kind].materialize(chunk, wait=True)
        elif chunk.tier is None:
            # Gradient chunks are written before they are read (the reduction zeroes what no
            # gradient wrote, see zero.reduce); a gradient shard is allocated only to receive
            # its first reduce-scatter, which writes all of it.
            residency.allocate_payload(
                chunk, residency.compute, zeroed=not chunk.kind.written_before_read
            )
        else:
            residency.move(chunk, residency.compute, reason)

    def touch(self, chunk: Chunk, on_device: bool = True) -> None:
        self._tick += 1
        self._last_access[chunk.id] = self._tick
        self._residency.tracer.on_access(chunk.id, on_device)

    def ensure_on_device(self, chunks: Sequence[Chunk]) -> None:
        """Bring ``chunks`` to the device, evicting by the placement plan."""
        residency = self._residency
        if all(chunk.on_device for chunk in chunks):
            for chunk in chunks:
                residency.ready(chunk)
                self.touch(chunk)
            return
        residency.drains.reap()
        protect = {c.id for c in chunks}
        plan = plan_moment(
            set(residency.resident),
            {c.id: True for c in chunks},
            lambda cid: residency.chunks[cid].nbytes,
            self._chunk_budget(),
            lambda cid: self.evictable(residency.chunks[cid]),
            self._rank(),
        )
        for chunk_id in plan.to_host:
            residency.move(residency.chunks[chunk_id], residency.tiers.spill, "evict")
        for chunk_id in plan.to_device:
            self.fetch(residency.chunks[chunk_id], protect, "fetch")
        for chunk in chunks:
            residency.ready(chunk)
            self.touch(chunk)

    # ------------------------------------------------------------------ moments
    def enter_moment(self, moment: Moment) -> None:
        """A module's pre-forward / pre-backward or a step: sample, then let go of pins."""
        residency = self._residency
        residency.release_transient_pins()
        residency.nonmodel.trace_peak()  # the peak of the moment that ends here
        residency.drains.reap()
        nonmodel = residency.device.meter.current(residency.nonmodel.accounted_device_bytes())
        index = residency.tracer.on_moment(moment, nonmodel)
        residency.ledger.set_nonmodel(nonmodel)
        residency.ledger.sample_moment(index, moment.name)
        residency.nonmodel.restart_peak()

    def after_access(self) -> None:
        """Once a moment's chunks are in: keep within the budget, then prefetch."""
        residency = self._residency
        residency.drains.reap()
        all_resident = residency.all_dynamic_resident
        lowest = self.placement.lowest_budget(residency.tracer, residency.static_device_bytes())
        if all_resident and lowest is not None and residency.resident_bytes <= lowest:
            return  # everything is in and fits at every moment of the trace
        self.evict_for(0, self._chunk_budget(), protect=set(), reason="evict")
        if all_resident:
            return
        reserved = self._still_coming_bytes()
        for ahead, chunk_id in self.placement.prefetch_targets(residency.tracer):
            chunk = residency.chunks.get(chunk_id)
            if chunk is None or chunk.tier is None or chunk.on_device or not chunk.movable():
                continue  # on the device already, nothing to copy (gathered, freed), in use
            if not self.room_ahead(chunk.nbytes, ahead, reserved):
                break
            residency.move(chunk, residency.compute, "prefetch")

    def _still_coming_bytes(self) -> int:
        """Bytes of the chunks the current moment still brings in (gradient chunks written by
        backward, chunks not fetched yet)."""
        chunks = self._residency.chunks
        return sum(
            chunks[c].nbytes
            for c, on_device in self._residency.tracer.current_accesses().items()
            if on_device and c in chunks and not chunks[c].on_device
        )

    def room_ahead(self, nbytes: int, moments_ahead: int, reserved: int | None = None) -> bool:
        """Whether ``nbytes`` more fit on the device without evicting anything, under the
        budget from now until ``moments_ahead`` moments on, beside what the current moment
        still brings in (``reserved``, computed when not given): a prefetch must not be what
        they evict."""
        if reserved is None:
            reserved = self._still_coming_bytes()
        residency = self._residency
        window_budget = self._chunk_budget(moments_ahead)
        needed = reserved + nbytes
        return residency.resident_bytes + needed <= window_budget and residency.ledger.would_fit(
            residency.compute.name, needed
        )

    def after_release(self) -> None:
        """Chunks of the current moment were released: keep room for the non-model bytes the
        trace saw after that point (the loss after the last layer's forward), evicting now
        rather than after those bytes exist."""
        residency = self._residency
        residency.tracer.on_release()
        residency.drains.reap()
        budget = self.placement.release_budget(residency.tracer, residency.static_device_bytes())
        if residency.resident_bytes > budget:
            self.evict_for(0, budget, protect=set(), reason="evict")

    # ------------------------------------------------------------------ non-model bytes
    def on_nonmodel_growth(self) -> None:
        """Non-model bytes grew: evict chunks no moment uses until they fit beside the rest,
        then account them. Evicting first keeps the ledger's device peak within the capacity
        (the pressure valve: while a trace is recorded, activations not seen yet meet chunks
        the recording budget kept; see ``Placement.recording_budget``)."""
        residency = self._residency
        tracked, drains, ledger = residency.nonmodel, residency.drains, residency.ledger
        drains.reap()
        nonmodel = residency.device.meter.current(tracked.accounted_device_bytes())
        capacity = ledger.device.capacity
        if capacity is None or tracked.accounted_device_bytes() + nonmodel <= capacity:
            tracked.account(nonmodel)  # nothing moved since the read
            return

        def fits() -> bool:
            return tracked.accounted_device_bytes() + nonmodel <= capacity

        resident = [c.id for c in residency.resident.values() if self.evictable(c)]
        for victim_id in self._rank()(resident):
            residency.move(residency.chunks[victim_id], residency.tiers.spill, "pressure")
            if tracked.accounted_device_bytes() - drains.nbytes + nonmodel <= capacity:
                break
        drains.settle(until=fits)
        tracked.account()
        if fits():
            return
        device = residency.compute.name
        raise OutOfMemoryError(
            device,
            ledger.device.used,
            ledger.device.capacity or 0,
            f"Non-model memory ({nonmodel:,} bytes: activations saved for backward and "
            f"gradients in flight) at moment {ledger.moment_label!r} does not fit beside "
            f"the chunks in use ({ledger.describe(device)}). Raise device.capacity, "
            f"lower the batch size or sequence length, use activation checkpointing, or a "
            f"smaller chunk.size.",
        )
