"""ZeRO parameter gathers: the two ways a layout's parameters become whole again.

- :class:`GatherUpdatedShards` (stages 1-2): every rank keeps whole parameter chunks and
  updates only its shard; after each layout's update the shards are all-gathered in place,
  asynchronously, overlapping the next layouts' updates.
- :class:`GatherForCompute` (stage 3): a rank keeps only its shard; each use all-gathers the
  layout into a ``GATHERED`` chunk, prefetched one traced moment ahead, and drops it by a rule
  every rank applies alike (the trace says whether the phase needs it again).

An all-gather in flight belongs to the chunk it fills (``chunk.arriving``): whoever reads the
chunk waits for it first (``Residency.ready``), and ``cancel`` waits for all of them, so no
rank leaves a collective half-issued behind an exception.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout
from chunkmem.residency import Residency
from chunkmem.sharding import ParamGatherer, Sharding, Waitable

AllGather = Callable[[torch.Tensor, torch.Tensor, bool], Waitable]


class GatherUpdatedShards(ParamGatherer):
    """Stages 1-2: all-gather each layout's updated shard into its whole parameter chunk."""

    def __init__(self, residency: Residency, sharding: Sharding, all_gather: AllGather) -> None:
        self.residency = residency
        self.sharding = sharding
        self._all_gather = all_gather
        self._gathering: list[Chunk] = []  # pinned until they arrived

    def after_update(self, layout: ChunkLayout) -> None:
        param = layout.chunks[ChunkKind.PARAM]
        self.residency.ensure_on_device([param])
        start, numel = self.sharding.shard(layout)
        param.pin()
        self._gathering.append(param)
        # In place: this rank's shard is already in its slot of the chunk.
        param.arriving = self._all_gather(param.payload[start : start + numel], param.payload, True)

    def finish_step(self) -> None:
        """Wait for every gather the step launched; all are unpinned whatever waiting raises."""
        gathering, self._gathering = self._gathering, []
        try:
            _await_all(self.residency, gathering)
        finally:
            for param in gathering:
                param.unpin()

    def cancel(self) -> None:
        self.finish_step()


class GatherForCompute(ParamGatherer):
    """Stage 3: parameters compute on a gathered copy of every rank's shard."""

    compute_kind = ChunkKind.GATHERED

    def __init__(self, residency: Residency, all_gather: AllGather) -> None:
        self.residency = residency
        self.tracer = residency.tracer
        self._all_gather = all_gather
        self._drop_later: dict[int, ChunkLayout] = {}  # pinned when released

    def transient_kinds(self) -> frozenset[ChunkKind]:
        return frozenset({ChunkKind.GATHERED})

    def _start(self, chunk: Chunk, async_op: bool) -> None:
        shard = chunk.layout.chunks[ChunkKind.PARAM]
        self.residency.ensure_on_device([shard])
        handle = self._all_gather(shard.payload, chunk.payload, async_op)
        if async_op:
            chunk.arriving = handle

    def fill(self, chunk: Chunk) -> None:
        self._start(chunk, async_op=False)

    def after_access(self) -> None:
        """Start gathering the layouts the next traced moment needs, so the all-gather
        overlaps this moment's compute. Driven by the trace alone, so every rank issues the
        same gathers in the same order."""
        if not self.tracer.replaying:
            return
        residency = self.residency
        for _index, accessed in self.tracer.upcoming(1):
            for chunk_id, on_device in accessed.items():
                chunk = residency.chunks.get(chunk_id)
                if chunk is None or chunk.kind is not ChunkKind.GATHERED or not on_device:
                    continue
                if chunk.on_device:
                    continue
                residency.make_room(chunk.nbytes, {chunk.id}, "prefetch")
                residency.allocate_payload(chunk, residency.compute, zeroed=False)
                self._start(chunk, async_op=True)
                residency.listener.chunk_arrived(chunk)  # type: ignore[union-attr]

    def released(self, layout: ChunkLayout) -> None:
        """Release a gathered copy once no one uses it and it is not needed again in this
        phase (the trace says when): the other ranks' shards are gathered again next phase.
        A copy pinned for the rest of the moment is looked at again when the moment ends."""
        gathered = layout.chunks[ChunkKind.GATHERED]
        if not gathered.on_device:
            return
        if not gathered.movable():
            if gathered.pins:
                self._drop_later[layout.index] = layout
            return
        if self.tracer.replaying and self.tracer.needed_again_this_phase(gathered.id):
            return
        self.residency.free_payload(gathered)

    def moment_over(self) -> None:
        layouts, self._drop_later = list(self._drop_later.values()), {}
        for layout in layouts:
            self.released(layout)

    def end_cycle(self) -> None:
        """Gathered copies are stale once the shards are updated."""
        self._drop_later.clear()
        for chunk in list(self.residency.chunks.values()):
            if chunk.kind is ChunkKind.GATHERED:
                self.residency.free_payload(chunk)

    def cancel(self) -> None:
        """Wait for every gather in flight (the peers issued them too), then drop every
        gathered copy: the next cycle gathers afresh."""
        in_flight = [
            c for c in self.residency.chunks.values() if c.kind is ChunkKind.GATHERED and c.arriving
        ]
        try:
            _await_all(self.residency, in_flight)
        finally:
            self.end_cycle()


def _await_all(residency: Residency, chunks: list[Chunk]) -> None:
    """Wait for every chunk's gather; whatever waiting raises, none is left marked arriving."""
    try:
        for chunk in chunks:
            residency.ready(chunk)
    finally:
        for chunk in chunks:
            chunk.arriving = None
