"""Speculative host updates, rolled back exactly: the step overlapped with backward under
gradient clipping, fp16 loss scaling and ``nonfinite: skip``.

[Note: speculate, then commit or roll back] Those three need every gradient before any update:
the clipping coefficient is the global norm's, an fp16 overflow skips the step, a non-finite
gradient skips it. Nearly every large-model recipe clips at 1.0, and the norm rarely exceeds
it once training has settled (SuperOffload reports clipping firing on 0.12% of BLOOM's steps),
so a group's host update starts as soon as its gradients are final, assuming the step will
neither clip (coefficient 1), overflow nor meet a non-finite value. When the norm is known:

- the assumption held: the updates stand (commit) and the step does the rest;
- it did not: every speculated group is restored to what it was before its update (states,
  step counts, 16-bit values, and gradients where they shared the parameter slot) and the
  step runs serially with the real coefficient, or is skipped.

Adam's update is not invertible in floating point, so undoing means keeping the inputs: a
speculated update first copies what it will overwrite into host buffers (:class:`Snapshot`):
the fp32 masters (fp32 training: the parameters) and both moments of the elements it updates,
and the 16-bit slots that hold gradients. Where the states live in host memory their copy is
taken ahead, when the forward starts ([Note: copies taken ahead]); otherwise on the update's
thread once the states are in host memory. Cost per element: 12 bytes of host memory in
bf16/fp16 with fp32 states (8 with bf16 moments, +2 where a gradient sits in the parameter
slot), in buffers kept per group from the first step that speculates to the engine's end (a
standing reservation, which the ledger and ``chunkmem estimate`` count as held throughout:
allocated afresh each step, every page was faulted in again, 27 ms for a 38 MB group on the
2-core machine against 9 ms into kept buffers); bandwidth: one extra read and write of those
bytes per speculated group, and on a rollback one more copy back before the serial update.
``offload.speculation_bytes`` bounds the buffers: a group whose copy does not fit waits for
the norm and is updated by the step. The results equal the serial step's bit for bit in every
case: a commit keeps exactly the serial step's arithmetic (coefficient 1), a rollback restores
every bit and then runs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot
from chunkmem.layout_update import LayoutUpdate, Piece, spans
from chunkmem.residency import Residency
from chunkmem.staging import Staging

SPECULATION = "speculation"  # the ledger's (and the report's) name for the copies' bytes


class Snapshot:
    """What one speculated group's update overwrites, copied before it runs: the states
    (ahead of the update, while the forward runs, where they live in host memory; otherwise
    on the update's thread before its kernels) and the 16-bit slots that hold gradients
    (before the kernels: backward writes them)."""

    def __init__(
        self, layout: ChunkLayout, pieces: list[Piece], residency: Residency, buffers: dict
    ) -> None:
        self.layout = layout
        self.pieces = pieces
        self.update: LayoutUpdate | None = None  # attached once prepared
        self.ahead: Future | None = None  # the states' copy, when taken ahead
        self.grad_slots: list[TensorSlot] = []  # known when the update is attached
        self._residency = residency
        self._buffers = buffers  # dtype -> host tensor
        self._filled: dict[torch.dtype, int] = {}
        self._saved: list[tuple[ChunkKind, list[Piece], torch.Tensor]] = []

    @staticmethod
    def state_targets(
        layout: ChunkLayout, pieces: list[Piece]
    ) -> list[tuple[ChunkKind, list[Piece]]]:
        """(chunk kind, pieces) of the values and moments the update overwrites."""
        value = ChunkKind.MASTER if ChunkKind.MASTER in layout.chunks else ChunkKind.PARAM
        return [(value, pieces), (ChunkKind.EXP_AVG, pieces), (ChunkKind.EXP_AVG_SQ, pieces)]

    @staticmethod
    def slot_targets(
        layout: ChunkLayout, pieces: list[Piece]
    ) -> list[tuple[ChunkKind, list[Piece]]]:
        """The 16-bit slots holding gradients that rounding the masters overwrites."""
        in_slot = [p for p in pieces if p[0].grad_in_param_slot]
        if ChunkKind.MASTER not in layout.chunks or not in_slot:
            return []
        return [(ChunkKind.PARAM, in_slot)]

    @staticmethod
    def bytes_per_element(
        masters: bool, state_itemsize: int, grad_in_param_slot: bool, compute_itemsize: int
    ) -> int:
        """Bytes of copy per element updated: the value (fp32 master, or the fp32 parameter),
        both moments, and the 16-bit slot where it holds the gradient."""
        value = 4
        return (
            value + 2 * state_itemsize + (compute_itemsize if masters and grad_in_param_slot else 0)
        )

    @staticmethod
    def elements(layout: ChunkLayout, pieces: list[Piece]) -> dict[torch.dtype, int]:
        """Elements of each dtype the copy needs: the 16-bit slots counted for every piece
        where the layout has masters and no gradient chunk (its gradients sit in the slots,
        which a copy taken ahead cannot know yet)."""
        targets = Snapshot.state_targets(layout, pieces)
        chunks = layout.chunks
        if ChunkKind.MASTER in chunks and ChunkKind.GRAD not in chunks:
            targets.append((ChunkKind.PARAM, pieces))
        else:
            targets.extend(Snapshot.slot_targets(layout, pieces))
        needed: dict[torch.dtype, int] = {}
        for kind, kind_pieces in targets:
            dtype = chunks[kind].dtype
            needed[dtype] = needed.get(dtype, 0) + sum(hi - lo for _s, lo, hi in kind_pieces)
        return needed

    def attach(self, update: LayoutUpdate) -> None:
        """``update`` (prepared from these pieces) takes the copy when it runs."""
        self.update = update
        self.grad_slots = [s for s, _lo, _hi in self.pieces if s.grad_in_param_slot]
        update.before_run.append(self.take)

    @staticmethod
    def ahead_kinds(layout: ChunkLayout) -> frozenset[ChunkKind]:
        """The states a copy taken ahead holds: those in host memory while the forward runs,
        every one with fp32 masters, the moments in fp32 training (its parameter chunk, the
        value, is on the device then and is copied with the update)."""
        if ChunkKind.MASTER in layout.chunks:
            return frozenset((ChunkKind.MASTER, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ))
        return frozenset((ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ))

    def take_states(self) -> None:
        """Copy the states of :meth:`ahead_kinds` from their chunks in host memory (on the
        update's thread, ahead of the update: nothing writes them until it runs)."""
        ahead = self.ahead_kinds(self.layout)
        targets = self.state_targets(self.layout, self.pieces)
        self._copy([t for t in targets if t[0] in ahead], self.layout.chunks)

    def take(self) -> None:
        """Copy what the update will overwrite and was not taken ahead (on the update's
        thread, before its kernels)."""
        assert self.update is not None
        targets = self.state_targets(self.layout, self.pieces)
        if self.ahead is not None:
            self.ahead.result()  # ran before this on the same thread: raises what it raised
            ahead = self.ahead_kinds(self.layout)
            targets = [t for t in targets if t[0] not in ahead]
        self._copy(targets, self.update.chunks)
        self._copy(self.slot_targets(self.layout, self.pieces), self.update.chunks)

    def _copy(
        self, targets: list[tuple[ChunkKind, list[Piece]]], chunks: dict[ChunkKind, Chunk]
    ) -> None:
        for kind, pieces in targets:
            chunk = chunks[kind]
            views = spans(chunk, pieces)
            size = sum(v.numel() for v in views)
            start = self._filled.get(chunk.dtype, 0)
            buffer = self._buffers[chunk.dtype][start : start + size]
            self._filled[chunk.dtype] = start + size
            torch._foreach_copy_(list(torch.split(buffer, [v.numel() for v in views])), views)
            self._saved.append((kind, pieces, buffer))

    def restore(self, staging: Staging) -> None:
        """Write every copied element back where its chunk lives now (its home after the
        update finished), take the step counts back, and give the 16-bit values their old
        bits: the rounded masters, or the gradient the slot held."""
        assert self.update is not None
        layout = self.layout
        for kind, pieces, buffer in self._saved:
            chunk = layout.chunks[kind]
            with staging.borrowed(chunk, write=True, reason="rollback"):
                views = spans(chunk, pieces)
                torch._foreach_copy_(views, list(torch.split(buffer, [v.numel() for v in views])))
        torch._foreach_sub_(self.update.steps, 1)
        master = layout.chunks.get(ChunkKind.MASTER)
        if master is not None:
            in_slot = {id(s) for s in self.grad_slots}
            values = [p for p in self.pieces if id(p[0]) not in in_slot]
            param = layout.chunks[ChunkKind.PARAM]
            with staging.borrowed(master, write=False, reason="rollback") as masters:
                self._residency.ready(param)
                for slot, lo, hi in values:
                    begin = slot.offset + lo - master.start
                    param.span(slot, lo, hi).copy_(masters[begin : begin + hi - lo])
        for slot in self.grad_slots:
            slot.grad_in_param_slot = True
            self.update.slot_ids.discard(id(slot))


def held_bytes(group_bytes: list[int], budget_bytes: int | None) -> int:
    """The copies held at once when the groups of ``group_bytes`` (bytes of copy each, in the
    order their gradients become final) are speculated: each that fits the budget beside those
    before it, as :meth:`Speculation.reserve` takes them (``chunkmem estimate`` counts them
    with this)."""
    held = 0
    for nbytes in group_bytes:
        if _within(budget_bytes, held, nbytes):
            held += nbytes
    return held


def _within(budget_bytes: int | None, held: int, nbytes: int) -> bool:
    return budget_bytes is None or held + nbytes <= budget_bytes


class Speculation:
    """The snapshots of one step's speculated groups, in buffers kept per group across steps
    within ``budget_bytes`` (None: as much as the host budget has room for); counts the steps
    committed and rolled back.

    [Note: copies taken ahead] A group's states do not change between the step that last
    updated them and its next update, so where they live in host memory their copy is taken
    as soon as the next forward starts (:meth:`take_ahead`, queued on the update thread in the
    order the groups became final): the host, idle until backward's first gradients are final
    (on a GPU machine, for the whole forward), copies then, and the update only copies the
    16-bit slots that backward filled with gradients (and, in fp32 training, the parameters:
    their chunk is on the device until the update). A copy taken ahead for pieces that differ
    from the update's, or whose update does not start early, is dropped once it has run.
    """

    def __init__(self, residency: Residency, budget_bytes: int | None) -> None:
        self.residency = residency
        self.staging = Staging(residency)
        self.budget_bytes = budget_bytes
        self.held_bytes = 0  # of every kept buffer
        self.commits = 0
        self.rollbacks = 0
        self.used_ahead = 0  # copies taken ahead that an update used, over the run
        self.dropped_ahead = 0  # and that none did (their pieces differed, or no early start)
        self._snapshots: list[Snapshot] = []  # of this step's speculated updates
        self._ahead: dict[int, Snapshot] = {}  # layout index -> states copied ahead
        self._kept: dict[int, dict[torch.dtype, torch.Tensor]] = {}  # layout index -> buffers

    @property
    def active(self) -> bool:
        """Whether updates of this step were taken speculatively."""
        return bool(self._snapshots)

    def take_ahead(
        self, layout: ChunkLayout, pieces: list[Piece], submit: Callable[..., Future]
    ) -> None:
        """Start copying the states the update of ``pieces`` will overwrite that live in host
        memory (:meth:`Snapshot.ahead_kinds`) through ``submit``, the update thread's queue."""
        if layout.index in self._ahead:
            return
        snapshot = self._snapshot(layout, pieces)
        if snapshot is not None:
            snapshot.ahead = submit(snapshot.take_states)
            self._ahead[layout.index] = snapshot

    def reserve(self, layout: ChunkLayout, pieces: list[Piece]) -> Snapshot | None:
        """The snapshot that makes the update of ``pieces`` undoable (attach the prepared
        update to it); None, with nothing taken, when its copy does not fit the budget or the
        host."""
        ahead = self._ahead.pop(layout.index, None)
        if ahead is not None:
            if _same_pieces(ahead.pieces, pieces):
                self.used_ahead += 1
                self._snapshots.append(ahead)
                return ahead
            self._wait_dropped(ahead)  # it writes the buffers reused below
        snapshot = self._snapshot(layout, pieces)
        if snapshot is not None:
            self._snapshots.append(snapshot)
        return snapshot

    def _snapshot(self, layout: ChunkLayout, pieces: list[Piece]) -> Snapshot | None:
        needed = Snapshot.elements(layout, pieces)
        kept = self._kept.get(layout.index)
        if kept is None or any(
            dtype not in kept or kept[dtype].numel() < numel for dtype, numel in needed.items()
        ):
            kept = self._keep(layout.index, needed)
            if kept is None:
                return None
        buffers = {dtype: kept[dtype][:numel] for dtype, numel in needed.items()}
        return Snapshot(layout, pieces, self.residency, buffers)

    def _keep(
        self, index: int, needed: dict[torch.dtype, int]
    ) -> dict[torch.dtype, torch.Tensor] | None:
        """New buffers for layout ``index`` (in place of any it had), held until the end."""
        self._drop(index)
        total = sum(dtype.itemsize * n for dtype, n in needed.items())
        spill = self.residency.tiers.spill
        if not _within(self.budget_bytes, self.held_bytes, total):
            return None
        if not self.residency.ledger.would_fit(spill.name, total):
            return None
        kept = {}
        for dtype, numel in needed.items():
            kept[dtype] = self.residency.workspaces.allocate(
                numel, dtype, spill, set(), within="capacity", kind=SPECULATION
            )
            self.held_bytes += kept[dtype].numel() * dtype.itemsize
        self._kept[index] = kept
        return kept

    def _drop(self, index: int) -> None:
        spill = self.residency.tiers.spill
        for buffer in self._kept.pop(index, {}).values():
            self.held_bytes -= buffer.numel() * buffer.element_size()
            self.residency.workspaces.free(buffer, spill, kind=SPECULATION)

    def commit(self) -> None:
        """The assumption held (or nothing was speculated): the speculated updates stand."""
        self._drop_ahead()
        if self._snapshots:
            self.commits += 1
        self._snapshots = []

    def roll_back(self) -> list[Snapshot]:
        """The assumption failed: restore every speculated group (their runs are over and
        finished); returns their snapshots, restored."""
        self._drop_ahead()
        snapshots, self._snapshots = self._snapshots, []
        try:
            for snapshot in reversed(snapshots):
                if snapshot.update is not None:
                    snapshot.restore(self.staging)
        finally:
            self.rollbacks += 1
        return snapshots

    def cancel(self) -> None:
        """An aborted cycle: the copies are dropped (the abort undoes or stops by itself); the
        buffers stay for the next step."""
        self._drop_ahead()
        self._snapshots = []

    def _drop_ahead(self) -> None:
        """Copies taken ahead for updates that did not start early: over before anything
        writes the states they read or the buffers they fill."""
        ahead, self._ahead = self._ahead, {}
        for snapshot in ahead.values():
            self._wait_dropped(snapshot)

    def _wait_dropped(self, snapshot: Snapshot) -> None:
        """Wait for a copy taken ahead that no update uses: a failure does not matter
        (nothing will be restored from it)."""
        assert snapshot.ahead is not None
        self.dropped_ahead += 1
        with contextlib.suppress(Exception):
            snapshot.ahead.result()


def _same_pieces(a: list[Piece], b: list[Piece]) -> bool:
    return [(id(s), lo, hi) for s, lo, hi in a] == [(id(s), lo, hi) for s, lo, hi in b]
