"""Optimizer-state chunks: where each layout's states live, and the chunk set of its update.

After the first cycle each trainable layout's states (fp32 master, ``exp_avg``,
``exp_avg_sq``, over the span this rank holds) get a fixed home: the device while the traced
margin allows, else the spill tier (the host). Moving 12 bytes per parameter through the
device every step would cost far more than streaming 2 bytes of gradient down and 2 bytes
of value up, so homes do not change. The update of a layout runs at its home with every
chunk it touches pinned for the duration (:meth:`OptimizerStates.update_chunks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from chunkmem.chunk import DYNAMIC_KINDS, Chunk, ChunkKind, ChunkLayout
from chunkmem.params import ParamStore
from chunkmem.placement import optimizer_state_device_groups
from chunkmem.residency import Residency
from chunkmem.sharding import GradReducer, ParamGatherer, Sharding, Span
from chunkmem.tiers import StorageTier

_UPDATE_KINDS = (ChunkKind.PARAM, ChunkKind.GRAD, ChunkKind.GRAD_SHARD)


class OptimizerStates:
    """Homes of the optimizer-state chunks and the chunks each layout's update needs."""

    def __init__(
        self,
        params: ParamStore,
        residency: Residency,
        sharding: Sharding,
        gatherer: ParamGatherer,
        reducer: GradReducer,
        mode: str,
    ) -> None:
        self.params = params
        self.residency = residency
        self.sharding = sharding
        self.gatherer = gatherer
        self.reducer = reducer
        self.mode = mode
        self.homes: dict[int, StorageTier] | None = None  # layout index -> tier
        # Moments loaded from a checkpoint before the first step: place() starts from them.
        self._preloaded: dict[tuple[int, ChunkKind], torch.Tensor] = {}

    def state_span(self, layout: ChunkLayout) -> Span:
        """(start, numel) of the layout's elements whose optimizer states this rank holds."""
        return self.sharding.state_span(layout) or (0, layout.capacity)

    def place(self, peak_nonmodel: int) -> None:
        """Choose each trainable layout's home and allocate its state chunks.

        The device margin left beside the non-model peak and the dynamically placed chunks
        (parameters and gradients; chunks that exist only around their use count as two whole
        chunks in flight) takes whole groups in order; the rest stay on the spill tier.
        """
        layouts = self.params.trainable_layouts()
        per_element = 8 + (4 if self.params.keep_fp32_master else 0)
        transient = self.gatherer.transient_kinds() | self.reducer.transient_kinds()
        chunks = self.residency.chunks.values()
        dynamic = sum(c.nbytes for c in chunks if c.kind in DYNAMIC_KINDS - transient)
        if transient:
            largest = max(layout.capacity for layout in self.params.layouts)
            dynamic += 2 * largest * self.params.compute_dtype.itemsize
        on_device = optimizer_state_device_groups(
            self.residency.placement.capacity,
            peak_nonmodel,
            dynamic,
            [self.state_span(layout)[1] * per_element for layout in layouts],
            self.mode,
        )
        residency = self.residency
        self.homes = {}
        for position, layout in enumerate(layouts):
            home = residency.compute if position < on_device else residency.tiers.spill
            self.homes[layout.index] = home
            span = self.state_span(layout)
            master = layout.chunks.get(ChunkKind.MASTER)
            if master is not None and home.compute:
                residency.make_room(master.nbytes, set(), "optimizer home", "capacity")
                residency.move(master, home, "optimizer home")
            for kind in (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ):
                if home.compute:
                    residency.make_room(span[1] * 4, set(), "optimizer home", "capacity")
                else:  # parameters the recording cycle evicted may go back to a roomy device
                    residency.make_tier_room(home, span[1] * 4, set(), "capacity")
                chunk = residency.new_chunk(layout, kind, torch.float32, home, span)
                preloaded = self._preloaded.pop((layout.index, kind), None)
                if preloaded is not None:
                    chunk.payload.copy_(preloaded)  # type: ignore[union-attr]
                    residency.transfer(chunk, residency.tiers.spill, home, chunk.nbytes, "load")

    def state_values(self, layout: ChunkLayout, kind: ChunkKind) -> torch.Tensor | None:
        """The ``exp_avg``/``exp_avg_sq`` of ``layout`` over its state span, to read or write
        in place: the chunk's payload once placed, values loaded before the first step, or
        None (never stepped: zeros)."""
        chunk = layout.chunks.get(kind)
        if chunk is not None:
            self.residency.ready(chunk)
            return chunk.payload
        return self._preloaded.get((layout.index, kind))

    def preload(self, layout: ChunkLayout, kind: ChunkKind) -> torch.Tensor:
        """Host memory, zeroed, for ``layout``'s ``kind`` state before it has a chunk; the
        chunk starts from it when the first step places the states."""
        assert self.homes is None, "states are placed: write into their chunks"
        values = torch.zeros(self.state_span(layout)[1], dtype=torch.float32)
        self._preloaded[(layout.index, kind)] = values
        return values

    def home(self, layout: ChunkLayout) -> StorageTier:
        assert self.homes is not None, "optimizer states are placed at the first step"
        return self.homes[layout.index]

    @contextlib.contextmanager
    def update_chunks(self, layout: ChunkLayout) -> Iterator[dict[ChunkKind, Chunk]]:
        """A layout's chunks, ready at its home and pinned for the update.

        A device home needs the parameter and gradient chunks on the device. A host home with
        fp32 masters leaves them where they are: gradients stream to the host and updated
        16-bit values stream back, so a chunk on the device stays there for the next forward.
        fp32 training has no master: its parameter chunk is what the host updates, so it and
        the gradients come to the host.
        """
        home = self.home(layout)
        chunks = layout.chunks
        storage = [chunks[k] for k in _UPDATE_KINDS if k in chunks and chunks[k].tier is not None]
        residency = self.residency
        if home.compute:
            for chunk in storage:
                residency.touch(chunk)
            residency.ensure_on_device(storage)
        elif ChunkKind.MASTER not in chunks:
            for chunk in storage:
                residency.touch(chunk, on_device=False)
                residency.move(chunk, home, "step")
        present = {k: c for k, c in chunks.items() if c.tier is not None}
        with residency.pinned(present.values()):
            yield present
