"""One layout's life under ZeRO-3: sharded, gathering, gathered, releasing.

A rank keeps only its shard of every layout; a module computes on the layout's gathered copy
(a chunk of kind ``zero.kinds.GATHERED``). :class:`LayoutLife` is the one owner of that copy,
as FSDP2's ``FSDPParamGroup`` owns a group's unsharded parameters: ``unshard`` allocates it
and launches the all-gather (for a use now, or ahead of one: a prefetch goes the same way),
``wait`` completes it, ``reshard`` drops it. Residency reaches it only through the
materializer of the kind (``Residency.materializers``) and never names the kind.

The state is read off the copy itself (whether it has a payload, whether a gather is still
arriving) plus one flag for a copy that a reader pinned when its release came, so it can
never disagree with what the chunk holds; every transition is checked.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from chunkmem.chunk import Chunk, ChunkLayout
from chunkmem.residency import Residency
from chunkmem.sharding import Waitable
from chunkmem.tracer import Phase
from zero.kinds import GATHERED


class GatherState(enum.Enum):
    """Where a layout's parameters are, as a stage-3 rank sees them.

    SHARDED: only this rank's shard exists (and an hpZ secondary, if one is kept); no device
    memory is held for the whole layout.
    GATHERING: the gathered copy is allocated and an all-gather into it is in flight; the
    copy's ``arriving`` is the collective, which every reader waits for.
    GATHERED: the whole layout is on the device; parameters computing on it are bound to it.
    RELEASING: the drop rule let the copy go while a reader (an unpacked saved tensor) had it
    pinned for the rest of the moment; it goes when the moment ends, unless it is used again.
    """

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
    RELEASING = "releasing"


_LEGAL = {
    GatherState.SHARDED: {GatherState.GATHERING, GatherState.GATHERED},
    GatherState.GATHERING: {GatherState.GATHERED, GatherState.SHARDED},
    GatherState.GATHERED: {GatherState.SHARDED, GatherState.RELEASING},
    GatherState.RELEASING: {GatherState.SHARDED, GatherState.GATHERED},
}

# How the bytes of a gather travel (the gatherer's choice: every rank's shard, or an hpZ
# secondary inside the node): launch into ``chunk`` for a moment of ``phase``.
Launch = Callable[[Chunk, Phase, bool], Waitable]
# What happens to a copy's content before it is dropped (hpZ keeps a part of it).
BeforeDrop = Callable[[Chunk], None]


class LayoutLife:
    """The gathered copy of one layout, from allocation to drop."""

    def __init__(
        self, layout: ChunkLayout, residency: Residency, launch: Launch, before_drop: BeforeDrop
    ) -> None:
        self.layout = layout
        self.chunk = layout.chunks[GATHERED]
        self._residency = residency
        self._launch = launch
        self._before_drop = before_drop
        self._releasing = False

    @property
    def state(self) -> GatherState:
        chunk = self.chunk
        if chunk.payload is None:
            return GatherState.SHARDED
        if chunk.arriving is not None:
            return GatherState.GATHERING
        return GatherState.RELEASING if self._releasing else GatherState.GATHERED

    def _check(self, new: GatherState) -> None:
        old = self.state
        if new not in _LEGAL[old]:
            raise AssertionError(
                f"layout {self.layout.index}: illegal gather transition {old.value} -> {new.value}"
            )

    def unshard(self, phase: Phase, async_op: bool) -> None:
        """SHARDED -> GATHERING (``async_op``) or GATHERED. The caller made room for it."""
        self._check(GatherState.GATHERING if async_op else GatherState.GATHERED)
        residency = self._residency
        residency.allocate_payload(self.chunk, residency.compute, zeroed=False)
        try:
            handle = self._launch(self.chunk, phase, async_op)
        except BaseException:
            residency.free_payload(self.chunk)
            raise
        if async_op:
            self.chunk.arriving = handle
        assert residency.listener is not None
        residency.listener.chunk_arrived(self.chunk)

    def wait(self) -> None:
        """GATHERING -> GATHERED (a no-op in any other state)."""
        if self.state is GatherState.GATHERING:
            self._residency.ready(self.chunk)

    def defer(self) -> None:
        """GATHERED -> RELEASING: the drop rule let it go, but a reader has it pinned."""
        self._check(GatherState.RELEASING)
        self._releasing = True

    def keep(self) -> None:
        """RELEASING -> GATHERED: the moment ended (or the rule keeps it after all)."""
        if self.state is GatherState.RELEASING:
            self._releasing = False

    def reshard(self) -> None:
        """GATHERED or RELEASING -> SHARDED: what hpZ keeps of it is kept, the rest goes."""
        if self.chunk.pins:
            raise AssertionError(f"layout {self.layout.index}: resharding a pinned gathered copy")
        self._check(GatherState.SHARDED)
        self._before_drop(self.chunk)
        self._releasing = False
        self._residency.free_payload(self.chunk)

    def drop(self) -> None:
        """Any state -> SHARDED, the content dead (the step changed the parameters, or an
        abort): a gather in flight is waited for first, the peers being in it too."""
        try:
            self._residency.ready(self.chunk)
        finally:
            self.chunk.arriving = None
            self._releasing = False
            self._residency.free_payload(self.chunk)
