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

Adam's update is not invertible in floating point, so undoing means keeping the inputs: before
a speculated update runs, on its own thread once its states are in host memory, it copies what
it will overwrite into a host buffer (:class:`Snapshot`): the fp32 masters (fp32 training: the
parameters) and both moments of the elements it updates, and the 16-bit slots that hold
gradients. Cost per element: 12 bytes of host memory in bf16/fp16 with fp32 states (8 with
bf16 moments, +2 where a gradient sits in the parameter slot), held from the update to the
step; bandwidth: one extra read and write of those bytes per speculated group (a host memcpy
on the update's thread), and on a rollback one more copy back before the serial update.
``offload.speculation_bytes`` bounds the buffers: a group whose copy does not fit waits for
the norm and is updated by the step. The buffers are kept from the first step that takes them
to the engine's end (a standing reservation of host memory, which the ledger and ``chunkmem
estimate`` count as held throughout): allocated afresh each step, every page of them faulted
in again on the update's thread, and that cost about three times the copy itself (27 ms for a
38 MB group on the 2-core machine, against 7 ms for the copy into kept buffers). The results equal the serial step's bit for bit in every
case: a commit keeps exactly the serial step's arithmetic (coefficient 1), a rollback restores
every bit and then runs it.
"""

from __future__ import annotations

import torch

from chunkmem.chunk import ChunkKind, ChunkLayout
from chunkmem.layout_update import LayoutUpdate, Piece, spans
from chunkmem.residency import Residency
from chunkmem.staging import Staging

SPECULATION = "speculation"  # the ledger's (and the report's) name for the copies' bytes


class Snapshot:
    """What one speculated group's update overwrites, copied before it runs."""

    def __init__(
        self, layout: ChunkLayout, pieces: list[Piece], residency: Residency, buffers: dict
    ) -> None:
        self.layout = layout
        self.pieces = pieces
        self.update: LayoutUpdate | None = None  # attached once prepared
        self._residency = residency
        self._buffers = buffers  # dtype -> host tensor
        self._saved: list[tuple[ChunkKind, list[Piece], torch.Tensor]] = []
        self.grad_slots = [s for s, _lo, _hi in pieces if s.grad_in_param_slot]

    @staticmethod
    def targets(layout: ChunkLayout, pieces: list[Piece]) -> list[tuple[ChunkKind, list[Piece]]]:
        """(chunk kind, pieces) whose elements the update overwrites."""
        chunks = layout.chunks
        value = ChunkKind.MASTER if ChunkKind.MASTER in chunks else ChunkKind.PARAM
        targets = [(value, pieces), (ChunkKind.EXP_AVG, pieces), (ChunkKind.EXP_AVG_SQ, pieces)]
        in_slot = [p for p in pieces if p[0].grad_in_param_slot]
        if value is ChunkKind.MASTER and in_slot:
            targets.append((ChunkKind.PARAM, in_slot))
        return targets

    @staticmethod
    def bytes_per_element(
        masters: bool, state_itemsize: int, grad_in_param_slot: bool, compute_itemsize: int
    ) -> int:
        """Bytes of copy per element updated: the value (fp32 master, or the fp32 parameter),
        both moments, and the 16-bit slot where it holds the gradient (:meth:`targets`)."""
        value = 4
        return (
            value + 2 * state_itemsize + (compute_itemsize if masters and grad_in_param_slot else 0)
        )

    @staticmethod
    def elements(layout: ChunkLayout, pieces: list[Piece]) -> dict[torch.dtype, int]:
        """Elements of each dtype the copy needs."""
        needed: dict[torch.dtype, int] = {}
        for kind, kind_pieces in Snapshot.targets(layout, pieces):
            dtype = layout.chunks[kind].dtype
            needed[dtype] = needed.get(dtype, 0) + sum(hi - lo for _s, lo, hi in kind_pieces)
        return needed

    def attach(self, update: LayoutUpdate) -> None:
        """``update`` (prepared from these pieces) takes the copy when it runs."""
        self.update = update
        update.before_run.append(self.take)

    def take(self) -> None:
        """Copy what the update will overwrite (on the update's thread, before its kernels)."""
        assert self.update is not None
        offsets: dict[torch.dtype, int] = {}
        for kind, pieces in self.targets(self.layout, self.pieces):
            chunk = self.update.chunks[kind]
            views = spans(chunk, pieces)
            size = sum(v.numel() for v in views)
            start = offsets.get(chunk.dtype, 0)
            buffer = self._buffers[chunk.dtype][start : start + size]
            offsets[chunk.dtype] = start + size
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
    committed and rolled back."""

    def __init__(self, residency: Residency, budget_bytes: int | None) -> None:
        self.residency = residency
        self.staging = Staging(residency)
        self.budget_bytes = budget_bytes
        self.held_bytes = 0  # of every kept buffer
        self.commits = 0
        self.rollbacks = 0
        self._snapshots: list[Snapshot] = []
        self._kept: dict[int, dict[torch.dtype, torch.Tensor]] = {}  # layout index -> buffers

    @property
    def active(self) -> bool:
        """Whether updates of this step were taken speculatively."""
        return bool(self._snapshots)

    def reserve(self, layout: ChunkLayout, pieces: list[Piece]) -> Snapshot | None:
        """The buffers that make the update of ``pieces`` undoable (attach the prepared update
        to it); None, with nothing taken, when they do not fit the budget or the host."""
        needed = Snapshot.elements(layout, pieces)
        kept = self._kept.get(layout.index)
        if kept is None or any(
            dtype not in kept or kept[dtype].numel() < numel for dtype, numel in needed.items()
        ):
            kept = self._keep(layout.index, needed)
            if kept is None:
                return None
        buffers = {dtype: kept[dtype][:numel] for dtype, numel in needed.items()}
        snapshot = Snapshot(layout, pieces, self.residency, buffers)
        self._snapshots.append(snapshot)
        return snapshot

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
            kept[dtype] = self.residency.allocate_workspace(
                numel, dtype, spill, set(), within="capacity", kind=SPECULATION
            )
            self.held_bytes += kept[dtype].numel() * dtype.itemsize
        self._kept[index] = kept
        return kept

    def _drop(self, index: int) -> None:
        spill = self.residency.tiers.spill
        for buffer in self._kept.pop(index, {}).values():
            self.held_bytes -= buffer.numel() * buffer.element_size()
            self.residency.free_workspace(buffer, spill, kind=SPECULATION)

    def commit(self) -> None:
        """The assumption held: the speculated updates stand."""
        if self._snapshots:
            self.commits += 1
        self._snapshots = []

    def roll_back(self) -> list[Snapshot]:
        """The assumption failed: restore every speculated group (their runs are over and
        finished); returns their snapshots, restored."""
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
        self._snapshots = []
