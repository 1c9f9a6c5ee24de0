"""Residency: where each chunk's payload is, and the mechanics of moving it.

It carries out what :mod:`chunkmem.placement` decides: allocate and free payloads, move them
between tiers (:mod:`chunkmem.tiers`) with exact accounting in the ledger, make room by
evicting, prefetch, and keep the device's non-model bytes in the ledger and the trace. It
knows chunks, not parameters; the parameter binder hears about chunks arriving on or leaving
the device through a :class:`ResidencyListener`, and a chunk of a derived kind (a ZeRO-3
gathered copy) is made by the :class:`Materializer` registered for its kind; residency never
names such a kind.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal, Protocol

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout
from chunkmem.devices import ComputeDevice
from chunkmem.drains import Drains
from chunkmem.errors import OutOfMemoryError
from chunkmem.ledger import Ledger
from chunkmem.nonmodel import NonModelBytes
from chunkmem.placement import Placement, plan_moment
from chunkmem.tiers import StorageTier, TierSet
from chunkmem.tracer import Moment, Tracer
from chunkmem.workspaces import Workspaces

RoomLimit = Literal["budget", "capacity"]


class ResidencyListener(Protocol):
    def chunk_arrived(self, chunk: Chunk) -> None:
        """``chunk`` has a device payload now (bind the parameters that compute on it)."""

    def chunk_leaving(self, chunk: Chunk) -> None:
        """``chunk``'s device payload is about to go (unbind its parameters)."""


class Materializer(Protocol):
    def materialize(self, chunk: Chunk, wait: bool) -> None:
        """Give derived ``chunk`` (room for it made) a device payload with its content:
        complete when ``wait``, else arriving (``chunk.arriving`` is what readers wait for)."""


class Residency:
    """Payload lifecycle and placement mechanics for every chunk of one process."""

    def __init__(
        self,
        device: ComputeDevice,
        tiers: TierSet,
        ledger: Ledger,
        tracer: Tracer,
        placement: Placement,
    ) -> None:
        self.device = device
        self.tiers = tiers
        self.ledger = ledger
        self.tracer = tracer
        self.placement = placement
        self.listener: ResidencyListener | None = None
        # Kind -> who makes chunks of that derived kind (registered by the sharding strategy).
        self.materializers: dict[ChunkKind, Materializer] = {}
        self.compute = tiers.compute
        self.chunks: dict[int, Chunk] = {}
        self._ids = itertools.count()
        self._device_storage: dict[int, Chunk] = {}  # data_ptr of a device payload -> chunk
        self._resident: dict[int, Chunk] = {}  # dynamic chunks on the device
        self._resident_bytes = 0
        self._static_bytes = 0  # optimizer-state chunks on the device
        self._dynamic_with_payload = 0
        self._last_access: dict[int, int] = {}
        self._tick = 0
        self._transient_pins: list[Chunk] = []
        self.drains = Drains(ledger, self.compute, device)
        self.nonmodel = NonModelBytes(device, ledger, tracer)
        self.workspaces = Workspaces(self)

    # ------------------------------------------------------------------ payloads
    def new_chunk(
        self,
        layout: ChunkLayout,
        kind: ChunkKind,
        dtype: torch.dtype,
        tier: StorageTier | None,
        span: tuple[int, int] | None = None,
    ) -> Chunk:
        """A chunk of ``layout`` (whole, or ``span`` = (start, numel)); allocated on ``tier``."""
        start, numel = span if span is not None else (0, layout.capacity)
        chunk = Chunk(next(self._ids), layout, kind, dtype, start, numel)
        self.chunks[chunk.id] = chunk
        layout.chunks[kind] = chunk
        if tier is not None:
            if tier.compute and kind.dynamic:
                self.make_room(chunk.nbytes, protect=set(), reason="allocate")
            self.allocate_payload(chunk, tier)
        return chunk

    def allocate_payload(self, chunk: Chunk, tier: StorageTier, zeroed: bool = True) -> None:
        """Give a chunk without payload one on ``tier``; no bytes move. ``zeroed=False`` for
        a payload the caller overwrites entirely (a gather or reduce-scatter target).

        A non-addressable tier's payloads are written only by copies: the chunk starts on the
        spill tier and moves there (``zeroed`` is then implied)."""
        if not tier.addressable:
            self.allocate_payload(chunk, self.tiers.spill)
            self.move(chunk, tier, "allocate")
            return
        what = f"a {chunk.kind.value} chunk"
        if tier.compute:
            self.nonmodel.trace_peak()
        self.ledger.allocate(tier.name, chunk.kind.value, chunk.nbytes, what, f"chunk {chunk.id}")
        payload = tier.allocate(chunk.numel, chunk.dtype)
        self._set_payload(chunk, payload.zero_() if zeroed else payload, tier)
        if tier.compute:
            self.nonmodel.restart_peak()

    def free_payload(self, chunk: Chunk) -> None:
        """Drop a chunk's payload: its content is dead (gradients after the step, a gathered
        copy after use), so nothing is copied anywhere."""
        if chunk.tier is None or chunk.payload is None:
            return
        self.ready(chunk)
        on_device = chunk.tier.compute
        if on_device:
            self.nonmodel.trace_peak()
            if self.listener is not None:
                self.listener.chunk_leaving(chunk)
        self.ledger.free(chunk.tier.name, chunk.kind.value, chunk.nbytes, f"chunk {chunk.id}")
        self._set_payload(chunk, None, None)
        if on_device:
            self.nonmodel.restart_peak()
        self.tracer.on_free(chunk.id)

    def drop_chunk(self, chunk: Chunk) -> None:
        """Free the chunk's payload and forget the chunk (a placement that was undone)."""
        self.free_payload(chunk)
        del self.chunks[chunk.id]
        if chunk.layout.chunks.get(chunk.kind) is chunk:
            del chunk.layout.chunks[chunk.kind]

    def _set_payload(
        self,
        chunk: Chunk,
        payload: torch.Tensor | None,
        tier: StorageTier | None,
        free_old: bool = True,
    ) -> None:
        """The one place a payload changes: keeps the device indexes in step. The old payload
        goes back to its tier unless ``free_old`` is False (the drains free it later)."""
        dynamic = chunk.kind.dynamic
        if dynamic:
            self._dynamic_with_payload += (payload is not None) - (chunk.payload is not None)
        old, old_tier = chunk.payload, chunk.tier
        if old_tier is not None and old_tier.compute:
            del self._device_storage[old.untyped_storage().data_ptr()]
            if dynamic:
                del self._resident[chunk.id]
                self._resident_bytes -= chunk.nbytes
            else:
                self._static_bytes -= chunk.nbytes
        chunk.payload, chunk.tier = payload, tier
        if old is not None and free_old:
            old_tier.free(old)
        if tier is not None and tier.compute:
            self._device_storage[payload.untyped_storage().data_ptr()] = chunk
            if dynamic:
                self._resident[chunk.id] = chunk
                self._resident_bytes += chunk.nbytes
            else:
                self._static_bytes += chunk.nbytes

    def chunk_of_storage(self, tensor: torch.Tensor) -> Chunk | None:
        """The device chunk whose payload ``tensor`` aliases, if any."""
        return self._device_storage.get(tensor.untyped_storage().data_ptr())

    def ready(self, chunk: Chunk) -> None:
        """Wait for an async copy or collective into the chunk's payload, if one is in flight."""
        if chunk.arriving is not None:
            arriving, chunk.arriving = chunk.arriving, None
            arriving.wait()  # type: ignore[attr-defined]
        if chunk.pending_event is not None:
            event, chunk.pending_event = chunk.pending_event, None
            chunk.tier.wait(event)  # type: ignore[union-attr]

    def contents(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's content as a tensor: its payload, ready; or, on a non-addressable tier,
        a copy read into host memory (the chunk stays where it is)."""
        self.ready(chunk)
        tier = chunk.tier
        assert tier is not None and chunk.payload is not None, f"{chunk!r} has no payload"
        if tier.addressable:
            return chunk.payload
        copy = torch.empty(chunk.numel, dtype=chunk.dtype)
        tier.copy_out(chunk.payload, copy).wait()
        return copy

    @contextlib.contextmanager
    def pinned(self, chunks: Iterable[Chunk], wait: bool = True) -> Iterator[None]:
        """Hold ``chunks`` where they are (ready to read, unless ``wait`` is False: then the
        reader waits for ``chunk.arriving`` itself) for the block, released on any exit."""
        held = list(chunks)
        if wait:
            for chunk in held:
                self.ready(chunk)
        for chunk in held:
            chunk.pin()
        try:
            yield
        finally:
            for chunk in held:
                chunk.unpin()

    # ------------------------------------------------------------------ moving
    def move(
        self, chunk: Chunk, dst: StorageTier, reason: str, reader_copies: bool = False
    ) -> None:
        """Copy the chunk's payload to ``dst`` and free the old one.

        ``reader_copies``: the chunk's next reader waits for a copy off the device itself,
        possibly on another thread (:class:`chunkmem.tiers.TierCopy`), so a copy the caller's thread would
        make is left to that wait (chunkmem/devices.py, [Note: copies a reader runs]); the old
        payload drains until it ran.

        A non-addressable tier exchanges payloads with the spill tier only (see
        :mod:`chunkmem.tiers`): a move between it and any other tier is two moves through the
        spill tier. A copy that fails to start leaves the chunk where it was.
        """
        src = chunk.tier
        if src is dst:
            return
        assert src is not None and chunk.payload is not None
        spill = self.tiers.spill
        if not (src.addressable and dst.addressable) and spill not in (src, dst):
            self.move(chunk, spill, reason)
            self.move(chunk, dst, reason)
            return
        if not chunk.movable():
            raise AssertionError(f"{chunk!r} is in use and cannot move ({reason})")
        if not dst.compute:
            self.make_tier_room(dst, chunk.nbytes, protect={chunk.id})
        device_bytes_change = src.compute or dst.compute
        if device_bytes_change:
            self.nonmodel.trace_peak()
        owner = f"chunk {chunk.id}"
        self.ledger.allocate(
            dst.name, chunk.kind.value, chunk.nbytes, f"moving {chunk!r} to {dst.name}", owner
        )
        try:
            self.ready(chunk)
            if src.addressable:
                payload, event = dst.copy_in(chunk.payload, reader_copies and src.compute)
                arriving = None
            else:  # read into a new payload of the spill tier
                payload, event = dst.allocate(chunk.numel, chunk.dtype), None
                arriving = src.copy_out(chunk.payload, payload)
        except BaseException:
            self.ledger.free(dst.name, chunk.kind.value, chunk.nbytes, owner)
            raise
        if src.compute and self.listener is not None:
            self.listener.chunk_leaving(chunk)
        draining = src.compute and event is not None  # the copy still reads the payload
        if draining:
            self.drains.hold(chunk.payload, event, chunk.kind.value, owner)
        else:
            self.ledger.free(src.name, chunk.kind.value, chunk.nbytes, owner)
        self._set_payload(chunk, payload, dst, free_old=not draining)
        if device_bytes_change:
            self.nonmodel.restart_peak()
        chunk.pending_event = event
        chunk.arriving = arriving
        self.ledger.record_move(
            chunk.id, chunk.kind.value, src.name, dst.name, chunk.nbytes, reason
        )
        if dst.compute and self.listener is not None:
            self.listener.chunk_arrived(chunk)

    def transfer(
        self, chunk: Chunk, src: StorageTier, dst: StorageTier, nbytes: int, reason: str
    ) -> None:
        """Account part of ``chunk`` copied between tiers without moving the chunk (the step's
        streamed gradients and values)."""
        if src is dst:
            return
        self.ledger.record_move(chunk.id, chunk.kind.value, src.name, dst.name, nbytes, reason)
        if src.compute or dst.compute:
            self.tracer.on_stream(nbytes, to_device=dst.compute)

    # ------------------------------------------------------------------ room
    def static_device_bytes(self) -> int:
        """Device bytes placement cannot move: optimizer states homed there, workspaces."""
        return self.ledger.device.workspace_bytes + self._static_bytes

    @staticmethod
    def evictable(chunk: Chunk) -> bool:
        """Whether placement may evict ``chunk``. Derived chunks (a ZeRO-3 gathered copy) are
        dropped only by their owner, by a rule every rank applies alike: a local eviction
        would make this rank gather again alone, and a collective needs every rank."""
        return not chunk.kind.derived and chunk.movable()

    def _rank(self) -> Callable[[Iterable[int]], list[int]]:
        return self.placement.rank(self.tracer, lambda c: self._last_access.get(c, -1))

    def evict_for(self, nbytes: int, limit: int, protect: set[int], reason: str) -> None:
        """Evict movable dynamic chunks until ``nbytes`` more fit under ``limit`` and capacity
        (counting draining payloads as free: who needs the room waits for them)."""
        used = self._resident_bytes
        if used + nbytes <= limit and self._fits_once_drained(nbytes):
            return
        candidates = [
            c.id for c in self._resident.values() if c.id not in protect and self.evictable(c)
        ]
        for victim_id in self._rank()(candidates):
            if used + nbytes <= limit and self._fits_once_drained(nbytes):
                return
            victim = self.chunks[victim_id]
            self.move(victim, self.tiers.spill, reason)
            used -= victim.nbytes

    def _fits_once_drained(self, nbytes: int) -> bool:
        available = self.ledger.device.available
        return available is None or nbytes <= available + self.drains.nbytes

    def settle_drains(self) -> None:
        """Wait for every copy off the device (the engine's close: nothing may still be copying
        when the device and the host buffers are released)."""
        self.drains.settle()

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
        self.drains.reap()
        limit = (
            self.placement.chunk_budget(self.tracer, self.static_device_bytes())
            if within == "budget"
            else self.placement.capacity
        )
        self.evict_for(nbytes, limit, protect, reason)
        device = self.compute.name
        self.drains.settle(until=lambda: self.ledger.would_fit(device, nbytes))
        if not self.ledger.would_fit(device, nbytes):
            raise OutOfMemoryError(
                device,
                nbytes,
                max(0, self.ledger.device.available or 0),
                f"Nothing more can be evicted at moment {self.ledger.moment_label!r}: "
                f"{self.ledger.describe(device)}. The chunks in use at one moment plus the "
                f"non-model memory exceed the device capacity; raise device.capacity, use a "
                f"smaller chunk.size, or lower the batch size / sequence length.",
            )

    def make_tier_room(
        self, tier: StorageTier, nbytes: int, protect: set[int], within: RoomLimit = "budget"
    ) -> None:
        """A limited tier is full: send its dynamic chunks needed soonest on the device up
        early, while the device has room for them (``within`` as for :meth:`make_room`)."""
        if self.ledger.would_fit(tier.name, nbytes):
            return
        on_tier = [
            c
            for c in self.chunks.values()
            if c.tier is tier and c.kind.dynamic and c.id not in protect and c.movable()
        ]
        if self.tracer.replaying:
            on_tier.sort(key=lambda c: self.tracer.next_device_use(c.id))
        budget = (
            self.placement.chunk_budget(self.tracer, self.static_device_bytes())
            if within == "budget"
            else self.placement.capacity
        )
        used = self._resident_bytes
        for chunk in on_tier:
            if self.ledger.would_fit(tier.name, nbytes):
                return
            if used + chunk.nbytes <= budget and self.ledger.would_fit(
                self.compute.name, chunk.nbytes
            ):
                self.move(chunk, self.compute, f"{tier.name} pressure")
                used += chunk.nbytes

    def fetch(self, chunk: Chunk, protect: set[int], reason: str) -> None:
        """Bring one chunk to the device: move it, allocate it, or (derived) have the
        materializer of its kind make it."""
        if chunk.on_device:
            return
        self.make_room(chunk.nbytes, protect, reason)
        if chunk.kind.derived:
            self.materializers[chunk.kind].materialize(chunk, wait=True)
        elif chunk.tier is None:
            # Gradient chunks are written before they are read (the reduction zeroes what no
            # gradient wrote, see zero.reduce); a gradient shard is allocated only to receive
            # its first reduce-scatter, which writes all of it.
            self.allocate_payload(chunk, self.compute, zeroed=not chunk.kind.written_before_read)
        else:
            self.move(chunk, self.compute, reason)

    def touch(self, chunk: Chunk, on_device: bool = True) -> None:
        self._tick += 1
        self._last_access[chunk.id] = self._tick
        self.tracer.on_access(chunk.id, on_device)

    def ensure_on_device(self, chunks: Sequence[Chunk]) -> None:
        """Bring ``chunks`` to the device, evicting by the placement plan."""
        if all(chunk.on_device for chunk in chunks):
            for chunk in chunks:
                self.ready(chunk)
                self.touch(chunk)
            return
        self.drains.reap()
        protect = {c.id for c in chunks}
        budget = self.placement.chunk_budget(self.tracer, self.static_device_bytes())
        plan = plan_moment(
            set(self._resident),
            {c.id: True for c in chunks},
            lambda cid: self.chunks[cid].nbytes,
            budget,
            lambda cid: self.evictable(self.chunks[cid]),
            self._rank(),
        )
        for chunk_id in plan.to_host:
            self.move(self.chunks[chunk_id], self.tiers.spill, "evict")
        for chunk_id in plan.to_device:
            self.fetch(self.chunks[chunk_id], protect, "fetch")
        for chunk in chunks:
            self.ready(chunk)
            self.touch(chunk)

    def pin_until_next_moment(self, chunk: Chunk) -> None:
        """Hold a chunk an unpacked saved tensor or an unhooked use reads, until the moment
        ends (the residency owns these pins; every moment boundary and reset releases them)."""
        chunk.pin()
        self._transient_pins.append(chunk)

    def release_transient_pins(self) -> None:
        pins, self._transient_pins = self._transient_pins, []
        for chunk in pins:
            chunk.unpin()

    # ------------------------------------------------------------------ moments
    def enter_moment(self, moment: Moment) -> None:
        """A module's pre-forward / pre-backward or a step: sample, then let go of pins."""
        self.release_transient_pins()
        self.nonmodel.trace_peak()  # the peak of the moment that ends here
        self.drains.reap()
        nonmodel = self.device.meter.current(self.nonmodel.accounted_device_bytes())
        index = self.tracer.on_moment(moment, nonmodel)
        self.ledger.set_nonmodel(nonmodel)
        self.ledger.sample_moment(index, moment.name)
        self.nonmodel.restart_peak()

    def after_access(self) -> None:
        """Once a moment's chunks are in: keep within the budget, then prefetch."""
        self.drains.reap()
        all_resident = len(self._resident) == self._dynamic_with_payload
        lowest = self.placement.lowest_budget(self.tracer, self.static_device_bytes())
        if all_resident and lowest is not None and self._resident_bytes <= lowest:
            return  # everything is in and fits at every moment of the trace
        budget = self.placement.chunk_budget(self.tracer, self.static_device_bytes())
        self.evict_for(0, budget, protect=set(), reason="evict")
        if all_resident:
            return
        reserved = self._still_coming_bytes()
        for ahead, chunk_id in self.placement.prefetch_targets(self.tracer):
            chunk = self.chunks.get(chunk_id)
            if chunk is None or chunk.tier is None or chunk.on_device or not chunk.movable():
                continue  # on the device already, nothing to copy (gathered, freed), in use
            if not self.room_ahead(chunk.nbytes, ahead, reserved):
                break
            self.move(chunk, self.compute, "prefetch")

    def _still_coming_bytes(self) -> int:
        """Bytes of the chunks the current moment still brings in (gradient chunks written by
        backward, chunks not fetched yet)."""
        return sum(
            self.chunks[c].nbytes
            for c, on_device in self.tracer.current_accesses().items()
            if on_device and c in self.chunks and not self.chunks[c].on_device
        )

    def room_ahead(self, nbytes: int, moments_ahead: int, reserved: int | None = None) -> bool:
        """Whether ``nbytes`` more fit on the device without evicting anything, under the
        budget from now until ``moments_ahead`` moments on, beside what the current moment
        still brings in (``reserved``, computed when not given): a prefetch must not be what
        they evict."""
        if reserved is None:
            reserved = self._still_coming_bytes()
        window_budget = self.placement.chunk_budget(
            self.tracer, self.static_device_bytes(), moments_ahead=moments_ahead
        )
        needed = reserved + nbytes
        return self._resident_bytes + needed <= window_budget and self.ledger.would_fit(
            self.compute.name, needed
        )

    def after_release(self) -> None:
        """Chunks of the current moment were released: keep room for the non-model bytes the
        trace saw after that point (the loss after the last layer's forward), evicting now
        rather than after those bytes exist."""
        self.tracer.on_release()
        self.drains.reap()
        budget = self.placement.release_budget(self.tracer, self.static_device_bytes())
        if self._resident_bytes > budget:
            self.evict_for(0, budget, protect=set(), reason="evict")

    # ------------------------------------------------------------------ non-model bytes
    def on_nonmodel_growth(self) -> None:
        """Non-model bytes grew: evict chunks no moment uses until they fit beside the rest,
        then account them. Evicting first keeps the ledger's device peak within the capacity
        (the pressure valve: while a trace is recorded, activations not seen yet meet chunks
        the recording budget kept; see ``Placement.recording_budget``)."""
        self.drains.reap()
        nonmodel = self.device.meter.current(self.nonmodel.accounted_device_bytes())
        capacity = self.ledger.device.capacity
        if capacity is None or self.nonmodel.accounted_device_bytes() + nonmodel <= capacity:
            self.nonmodel.account(nonmodel)  # nothing moved since the read
            return

        def fits() -> bool:
            return self.nonmodel.accounted_device_bytes() + nonmodel <= capacity

        resident = [c.id for c in self._resident.values() if self.evictable(c)]
        for victim_id in self._rank()(resident):
            self.move(self.chunks[victim_id], self.tiers.spill, "pressure")
            if self.nonmodel.accounted_device_bytes() - self.drains.nbytes + nonmodel <= capacity:
                break
        self.drains.settle(until=fits)
        self.nonmodel.account()
        if fits():
            return
        device = self.compute.name
        raise OutOfMemoryError(
            device,
            self.ledger.device.used,
            self.ledger.device.capacity or 0,
            f"Non-model memory ({nonmodel:,} bytes: activations saved for backward and "
            f"gradients in flight) at moment {self.ledger.moment_label!r} does not fit beside "
            f"the chunks in use ({self.ledger.describe(device)}). Raise device.capacity, "
            f"lower the batch size or sequence length, use activation checkpointing, or a "
            f"smaller chunk.size.",
        )
