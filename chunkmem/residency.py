"""Residency: where each chunk's payload is, and the mechanics of moving it.

It carries out what its room (:mod:`chunkmem.room`, ``residency.room``) decides: allocate and
free payloads, move them between tiers (:mod:`chunkmem.tiers`) with exact accounting in the
ledger, reading the non-model peak around every change of device bytes, and keep the indexes
room-making reads (the dynamic chunks on the device, the bytes placement cannot move). It
knows chunks, not parameters; the parameter binder hears about chunks arriving on or leaving
the device through a :class:`ResidencyListener`, and a chunk of a derived kind (a ZeRO-3
gathered copy) is made by the :class:`Materializer` registered for its kind; residency never
names such a kind.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout
from chunkmem.devices import ComputeDevice
from chunkmem.drains import Drains
from chunkmem.ledger import Ledger
from chunkmem.nonmodel import NonModelBytes
from chunkmem.placement import Placement
from chunkmem.room import Room
from chunkmem.tiers import StorageTier, TierSet
from chunkmem.tracer import Tracer
from chunkmem.workspaces import Workspaces


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
    """Payload lifecycle and moves for every chunk of one process."""

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
        self._transient_pins: list[Chunk] = []
        self.drains = Drains(ledger, self.compute, device)
        self.nonmodel = NonModelBytes(device, ledger, tracer)
        self.workspaces = Workspaces(self)
        self.room = Room(self, placement)

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
                self.room.make_room(chunk.nbytes, protect=set(), reason="allocate")
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

    def swap_payload(self, chunk: Chunk, replacement: torch.Tensor) -> torch.Tensor:
        """Make ``replacement`` (a buffer of the chunk's tier, laid out like its payload and
        already accounted by its owner) the chunk's payload; returns the payload it replaced,
        which the caller now owns. The ledger's bytes do not change: only which buffer is
        which (a speculative update taken out of place: offload/speculation.py)."""
        payload, tier = chunk.payload, chunk.tier
        if payload is None or tier is None or tier.compute:
            raise ValueError(f"{chunk!r} has no host payload to swap (tier {tier})")
        if replacement.numel() != payload.numel() or replacement.dtype != payload.dtype:
            raise ValueError(
                f"{chunk!r} holds {payload.numel()} {payload.dtype} elements; its replacement "
                f"holds {replacement.numel()} {replacement.dtype}"
            )
        self.ready(chunk)
        self._set_payload(chunk, replacement, tier, free_old=False)
        return payload

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
            self.room.make_tier_room(dst, chunk.nbytes, protect={chunk.id})
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

    # ------------------------------------------------------------------ device bytes
    @property
    def resident(self) -> Mapping[int, Chunk]:
        """The dynamic chunks on the device, by id: what room-making may evict."""
        return self._resident

    @property
    def resident_bytes(self) -> int:
        return self._resident_bytes

    @property
    def all_dynamic_resident(self) -> bool:
        """Whether every dynamic chunk that has a payload has it on the device."""
        return len(self._resident) == self._dynamic_with_payload

    def static_device_bytes(self) -> int:
        """Device bytes placement cannot move: optimizer states homed there, workspaces."""
        return self.ledger.device.workspace_bytes + self._static_bytes

    def settle_drains(self) -> None:
        """Wait for every copy off the device (the engine's close: nothing may still be copying
        when the device and the host buffers are released)."""
        self.drains.settle()

    # ------------------------------------------------------------------ pins
    def pin_until_next_moment(self, chunk: Chunk) -> None:
        """Hold a chunk an unpacked saved tensor or an unhooked use reads, until the moment
        ends (the residency owns these pins; every moment boundary and reset releases them)."""
        chunk.pin()
        self._transient_pins.append(chunk)

    def release_transient_pins(self) -> None:
        pins, self._transient_pins = self._transient_pins, []
        for chunk in pins:
            chunk.unpin()
