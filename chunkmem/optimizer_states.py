"""Optimizer-state chunks: where each layout's states live, and the chunk set of its update.

After the first cycle each trainable layout's states (fp32 master and the update rule's
moments: Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``; over the span this
rank holds) get a fixed home: the device, the host, or a
tier offload names (NVMe), by the config's placement (``offload.optimizer`` and
``optimizer_ratio``) and the traced device margin. Moving 12 bytes per parameter through the
device every step would cost far more than streaming 2 bytes of gradient down and 2 bytes
of value up, so homes do not change. The update of a layout runs on its *work tier*: the
home, or the spill tier (host memory) for a home that is not addressable, whose states are
read in before the update and written back after it (:meth:`OptimizerStates.update_chunks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout
from chunkmem.params import ParamStore
from chunkmem.placement import offloaded_group_count, optimizer_state_device_groups
from chunkmem.residency import Residency
from chunkmem.sharding import GradReducer, ParamGatherer, Sharding, Span, Waitable
from chunkmem.staging import Staging
from chunkmem.tiers import StorageTier, TierCopy


class OptimizerStates:
    """Homes of the optimizer-state chunks and the chunks each layout's update needs.

    ``mode``: auto | device | host | nvme (``offload.optimizer``); ``offload_to`` is the tier
    host or nvme names, which takes the fraction ``ratio`` of the state elements (the other
    groups are placed as auto). ``offloaded_state_dtype`` is the moments' dtype there.
    """

    def __init__(
        self,
        params: ParamStore,
        residency: Residency,
        sharding: Sharding,
        gatherer: ParamGatherer,
        reducer: GradReducer,
        mode: str,
        offload_to: StorageTier | None = None,
        ratio: float = 1.0,
        offloaded_state_dtype: torch.dtype = torch.float32,
        moments: tuple[ChunkKind, ...] = (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ),
    ) -> None:
        self.params = params
        self.residency = residency
        self.sharding = sharding
        self.gatherer = gatherer
        self.reducer = reducer
        self.mode = mode
        self.offload_to = offload_to
        self.ratio = ratio
        self.offloaded_state_dtype = offloaded_state_dtype
        self.moments = moments  # the update rule's (``chunkmem.update_rules``)
        self.kinds = (ChunkKind.MASTER, *moments)  # every state chunk kind
        self.staging = Staging(residency)
        self.homes: dict[int, StorageTier] | None = None  # layout index -> tier
        # Moments loaded from a checkpoint before the first step: place() starts from them.
        self._preloaded: dict[tuple[int, ChunkKind], torch.Tensor] = {}

    def state_span(self, layout: ChunkLayout) -> Span:
        """(start, numel) of the layout's elements whose optimizer states this rank holds."""
        return self.sharding.state_span(layout) or (0, layout.capacity)

    def place(self, peak_nonmodel: int) -> None:
        """Choose each trainable layout's home and allocate its state chunks.

        The groups ``offload_to`` takes are the last ones; of the others, the device margin
        left beside the non-model peak and the dynamically placed chunks (parameters and
        gradients; chunks that exist only around their use count as two whole chunks in
        flight) takes whole groups in order, and the rest stay on the spill tier. A failure
        (no room on a tier) undoes the placement: the next step tries again.
        """
        layouts = self.params.trainable_layouts()
        elements = [self.state_span(layout)[1] for layout in layouts]
        offloaded = 0
        if self.offload_to is not None:
            offloaded = offloaded_group_count(elements, self.ratio)
        rest = len(layouts) - offloaded
        master_bytes = 4 if self.params.keep_fp32_master else 0
        transient = self.gatherer.transient_kinds() | self.reducer.transient_kinds()
        chunks = self.residency.chunks.values()
        dynamic = sum(c.nbytes for c in chunks if c.kind.dynamic and c.kind not in transient)
        if transient:
            largest = max(layout.capacity for layout in self.params.layouts)
            dynamic += 2 * largest * self.params.compute_dtype.itemsize
        on_device = optimizer_state_device_groups(
            self.residency.room.placement.capacity,
            peak_nonmodel,
            dynamic,
            [n * (4 * len(self.moments) + master_bytes) for n in elements[:rest]],
            "device" if self.mode == "device" else "auto",
        )
        residency = self.residency
        self.homes = {}
        try:
            for position, layout in enumerate(layouts):
                if position >= rest:
                    home = self.offload_to
                elif position < on_device:
                    home = residency.compute
                else:
                    home = residency.tiers.spill
                assert home is not None
                self.homes[layout.index] = home
                self._allocate_states(layout, home)
        except BaseException:
            self._undo_placement(layouts)
            raise
        self._preloaded.clear()

    def _allocate_states(self, layout: ChunkLayout, home: StorageTier) -> None:
        residency = self.residency
        span = self.state_span(layout)
        dtype = torch.float32 if home.compute else self.offloaded_state_dtype
        # A payload for a non-addressable home starts on the spill tier (see the residency).
        first = home if home.addressable else residency.tiers.spill
        master = layout.chunks.get(ChunkKind.MASTER)
        if master is not None and home is not master.tier:
            if home.compute:
                residency.room.make_room(master.nbytes, set(), "optimizer home", "capacity")
            residency.move(master, home, "optimizer home")
        for kind in self.moments:
            nbytes = span[1] * dtype.itemsize
            if home.compute:
                residency.room.make_room(nbytes, set(), "optimizer home", "capacity")
            else:  # parameters the recording cycle evicted may go back to a roomy device
                residency.room.make_tier_room(first, nbytes, set(), "capacity")
            chunk = residency.new_chunk(layout, kind, dtype, first, span)
            preloaded = self._preloaded.get((layout.index, kind))
            if preloaded is not None:
                chunk.payload.copy_(preloaded)  # type: ignore[union-attr]
                residency.transfer(chunk, residency.tiers.spill, first, chunk.nbytes, "load")
            residency.move(chunk, home, "allocate")  # a no-op unless home is not addressable

    def _undo_placement(self, layouts: list[ChunkLayout]) -> None:
        """After a failed placement: no moments, masters back on the spill tier."""
        residency = self.residency
        for layout in layouts:
            for kind in self.moments:
                chunk = layout.chunks.get(kind)
                if chunk is not None:
                    residency.drop_chunk(chunk)
            master = layout.chunks.get(ChunkKind.MASTER)
            if master is not None and master.tier is not residency.tiers.spill:
                residency.move(master, residency.tiers.spill, "optimizer home undone")
        self.homes = None

    def preloaded(self, layout: ChunkLayout, kind: ChunkKind) -> torch.Tensor | None:
        """``layout``'s ``kind`` moment loaded from a checkpoint before it has a chunk."""
        return self._preloaded.get((layout.index, kind))

    def preload(self, layout: ChunkLayout, kind: ChunkKind) -> torch.Tensor:
        """Host memory, zeroed, for ``layout``'s ``kind`` moment before it has a chunk (fp32,
        over the state span); the chunk starts from it when the first step places the
        states, wherever and in whichever dtype they go."""
        assert self.homes is None, "states are placed: write into their chunks"
        values = torch.zeros(self.state_span(layout)[1], dtype=torch.float32)
        self._preloaded[(layout.index, kind)] = values
        return values

    def home(self, layout: ChunkLayout) -> StorageTier:
        assert self.homes is not None, "optimizer states are placed at the first step"
        return self.homes[layout.index]

    def work_tier(self, layout: ChunkLayout) -> StorageTier:
        """Where the layout's update computes: its home, or host memory for a home that is
        not addressable (``chunkmem.staging``)."""
        return self.staging.work_tier(self.home(layout))

    def can_update_now(self, layout: ChunkLayout) -> bool:
        """Whether the chunks an update moves to its work tier may move now (in backward, a
        unit still computing holds its parameter chunk)."""
        chunks = layout.chunks
        if self.home(layout).compute or ChunkKind.MASTER in chunks:
            return True  # nothing moves
        work = self.work_tier(layout)
        return all(c.tier is work or c.movable() for c in _update_storage(chunks))

    def prefetch(self, layout: ChunkLayout) -> None:
        """Start reading the states of ``layout`` (needed next) from a home that is not
        addressable, as far as host memory has room without evicting anything."""
        for kind in self.kinds:
            chunk = layout.chunks.get(kind)
            if chunk is not None and not self.staging.read_ahead(chunk, "prefetch states"):
                return

    def flush(self) -> None:
        """Every state at its home when the step ends: states read ahead for an update that
        did not come (a layout without gradients) go back, and the writes to homes that are
        not addressable are waited for, so a write that failed raises in the step that made
        it."""
        assert self.homes is not None
        for layout in self.params.trainable_layouts():
            home = self.home(layout)
            for kind in self.kinds:
                chunk = layout.chunks.get(kind)
                if chunk is not None:
                    self.staging.write_back(chunk, home, "step", wait=True)

    @contextlib.contextmanager
    def update_chunks(
        self, layout: ChunkLayout, reads: list[Waitable] | None = None
    ) -> Iterator[dict[ChunkKind, Chunk]]:
        """A layout's chunks, ready on its work tier and pinned for the update.

        A device home needs the parameter and gradient chunks on the device. A host home with
        fp32 masters leaves them where they are: gradients stream to the host and updated
        16-bit values stream back, so a chunk on the device stays there for the next forward.
        fp32 training has no master: its parameter chunk is what the host updates, so it and
        the gradients come to the host. States whose home is not addressable are read into
        the spill tier first and written back on a normal exit. Given a ``reads`` list, the
        reads still in flight are appended to it instead of waited for (an update run on
        another thread waits for them there).
        """
        home = self.home(layout)
        work = self.work_tier(layout)
        chunks = layout.chunks
        storage = _update_storage(chunks)
        residency = self.residency
        if home.compute:
            for chunk in storage:
                residency.room.touch(chunk)
            residency.room.ensure_on_device(storage)
        elif ChunkKind.MASTER not in chunks:
            for chunk in storage:
                residency.room.touch(chunk, on_device=False)
                residency.move(chunk, work, "step", reader_copies=reads is not None)
        states = [chunks[k] for k in self.kinds if k in chunks]
        for chunk in states:
            self.staging.stage(chunk, "step")
        present = {k: c for k, c in chunks.items() if c.tier is not None}
        copies = {c: _copies_in_flight(c) for c in present.values()} if reads is not None else {}
        in_flight = [c for c, waits in copies.items() if waits]
        with (
            residency.pinned([c for c in present.values() if c not in in_flight]),
            residency.pinned(in_flight, wait=False),
        ):
            if reads is not None:
                reads.extend(w for c in in_flight for w in copies[c])
            yield present
        for chunk in states:
            self.staging.write_back(chunk, home, "step", wait=False)


def _copies_in_flight(chunk: Chunk) -> list[Waitable]:
    """What a reader of ``chunk`` on another thread waits for: a read from a home that is not
    addressable, a copy into its tier (off the device, on a copy engine or left to the reader)."""
    waits: list[Waitable] = []
    if chunk.arriving is not None:
        waits.append(chunk.arriving)  # type: ignore[arg-type]
    if chunk.pending_event is not None:
        assert chunk.tier is not None
        waits.append(TierCopy(chunk.tier, chunk.pending_event))
    return waits


def _update_storage(chunks: dict[ChunkKind, Chunk]) -> list[Chunk]:
    """What an update reads and writes besides its states: the parameter chunk and the
    gradient chunks (whole, or this rank's shard), those with a payload."""
    return [
        c for k, c in chunks.items() if (k is ChunkKind.PARAM or k.gradient) and c.tier is not None
    ]
