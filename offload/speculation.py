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

Adam's update is not invertible in floating point, so undoing means keeping the inputs. Where
a group's states live in host memory its update is taken out of place: the kernel reads the
chunks' fp32 values and moments and writes the new ones into *shadows*, buffers laid out like
those chunks' payloads (``kernels/csrc/host_optim_cpu.cpp``, [Note: updates out of place]). A
commit swaps each shadow with its chunk's payload when the step takes the update, and the old
payload is the group's shadow at its next update; a rollback leaves the chunks as they are.
What an update still overwrites in place is copied before its kernels (:class:`Snapshot`): the
parameters of fp32 training (their chunk comes from the device for the update) and every state
of a group homed on NVMe (staged: written back to its home as the update finishes). The
gradients it overwrites, the 16-bit slots that hold them (the new parameters are rounded into
them) and fp32 gradients the kernel leaves divided by the world size where they lie (as
torch's fused kernel does), are saved by the kernel as it reads them (``grads_saved``).

Cost, bf16/fp16 with fp32 states homed on the host: 12 bytes of host memory per element of
the group's state chunks (8 with bf16 moments), whole chunks, padding included, kept
per group from the first step that speculates to the engine's end (a standing reservation,
which the ledger and ``chunkmem estimate`` count as held throughout), plus 2 bytes per
element whose gradient sits in its parameter slot. Bandwidth: the update reads one buffer and
writes another (streamed: about the bytes it moves in place; through the cache on machines
where that measures faster, ``kernels/row_stores.py``), copies into the
shadow only what it does not update (parameters without a gradient; padding once per shadow),
and stores the 16-bit gradients it overwrites from the lanes that load them (2 bytes written);
a rollback writes back those gradients and rounds the masters again. The states of a group homed on
NVMe are copied instead (12 bytes per element updated, read and written once more, and once
more on a rollback). ``offload.speculation_bytes`` bounds what is kept: a group that does not
fit waits for the norm and is updated by the step. The results equal the serial step's bit for
bit in every case: a commit keeps exactly the serial step's arithmetic (coefficient 1), a
rollback restores every bit and then runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout
from chunkmem.layout_update import LayoutUpdate
from chunkmem.pieces import Piece, owned_pieces, spans
from chunkmem.residency import Residency
from chunkmem.staging import Staging
from chunkmem.tiers import StorageTier
from offload.undo_plan import Plan, not_updated

SPECULATION = "speculation"  # the ledger's (and the report's) name for the kept buffers' bytes


@dataclass
class Kept:
    """One group's buffers, kept across steps: a shadow for each state updated out of place
    (by chunk kind: after a commit, the payload it replaced) and copy buffers by dtype."""

    shadows: dict[ChunkKind, torch.Tensor] = field(default_factory=dict)
    copies: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    # By kind: the two buffers (data pointers) known to hold the same padding, the elements
    # no update writes (see Snapshot.take).
    same_padding: dict[ChunkKind, frozenset[int]] = field(default_factory=dict)


class Snapshot:
    """One speculated group's update made undoable: the shadows its new states go to (they
    take their chunks' place when the step takes the update: :meth:`stand`) and copies of what
    it overwrites in place, taken on the update's thread before its kernels (written back by
    :meth:`restore`)."""

    def __init__(
        self,
        layout: ChunkLayout,
        pieces: list[Piece],
        residency: Residency,
        kept: Kept,
        plan: Plan,
    ) -> None:
        self.layout = layout
        self.pieces = pieces
        self.update: LayoutUpdate | None = None  # attached once prepared
        self.grad_slots = [s for s, _lo, _hi in pieces if s.grad_in_param_slot]
        self._residency = residency
        self._kept = kept
        self._plan = plan
        # Each target with its part of the copy buffer of its dtype (``Plan.saved``), filled
        # once ``take`` ran (the gradients' by the kernels right after it).
        self._saved = plan.saved(kept.copies)
        self._taken = False

    @property
    def shadows(self) -> dict[ChunkKind, torch.Tensor]:
        """Where the update writes the new values of these kinds (the rest: in place)."""
        return self._kept.shadows

    @staticmethod
    def shadowed_kinds(layout: ChunkLayout, home: StorageTier) -> frozenset[ChunkKind]:
        """The states updated out of place: those whose home is host memory (a home on NVMe
        is staged and written back as the update finishes), the fp32 masters and both
        moments, or in fp32 training the moments (the parameter chunk comes from the device
        for the update)."""
        if home.compute or not home.addressable:
            return frozenset()
        kinds = {ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ}
        if ChunkKind.MASTER in layout.chunks:
            kinds.add(ChunkKind.MASTER)
        return frozenset(kinds)

    @staticmethod
    def bytes_per_element(
        masters: bool,
        state_itemsize: int,
        grad_in_param_slot: bool,
        compute_itemsize: int,
        on_host: bool,
        divided_grads: bool = False,
    ) -> tuple[int, int]:
        """(bytes of shadow per element of a state chunk, bytes of copy per element updated)
        for a group whose states are homed in host memory (``on_host``) or on NVMe, whose
        fp32 gradients the kernel divides where they lie (``divided_grads``) or not."""
        value = 4  # the fp32 master, or the fp32 parameter
        slot = compute_itemsize if masters and grad_in_param_slot else 0
        grads = 4 if divided_grads else 0
        if not on_host:
            return 0, value + 2 * state_itemsize + slot + grads
        if masters:
            return value + 2 * state_itemsize, slot + grads
        return 2 * state_itemsize, value + grads

    def attach(self, update: LayoutUpdate) -> None:
        """``update`` (prepared from these pieces, writing to :attr:`shadows`) takes the
        copies when it runs, and makes the shadows the states when the step takes it."""
        self.update = update
        update.before_run.append(self.take)
        update.on_stand.append(self.stand)

    @property
    def saves_grads(self) -> bool:
        """Whether the update overwrites or divides gradients, which its kernel then saves
        (:meth:`grad_saves`)."""
        return self._plan.saves_grads

    def grad_saves(self) -> list[torch.Tensor | None]:
        """For each piece, where the update's kernel saves the gradient it reads, as it reads
        it (None for a gradient the update neither overwrites nor divides). Saving in the
        kernel's pass writes 2 bytes per 16-bit element where a copy before it would read the
        gradient too, and read it again from memory. Called on the update's thread, as its
        kernel calls are built; only where :attr:`saves_grads`."""
        return self._plan.grad_saves()

    def take(self) -> None:
        """On the update's thread before its kernels (its reads are in): copy what it
        overwrites in place (the gradients it reads: its kernel saves them, see
        :meth:`grad_saves`), and into each shadow the elements it does not update."""
        assert self.update is not None
        chunks = self.update.chunks
        for target, buffer in self._saved:
            if not target.grads:
                views = spans(chunks[target.kind], target.pieces)
                torch._foreach_copy_(list(torch.split(buffer, [v.numel() for v in views])), views)
        for kind, shadow in self.shadows.items():
            chunk = chunks[kind]
            payload = chunk.payload
            assert payload is not None
            pair = frozenset((payload.data_ptr(), shadow.data_ptr()))
            if self._kept.same_padding.get(kind) != pair:
                # Padding is written by no update: once copied, a payload and its shadow keep
                # it equal as they swap (30 MB a step in benchmarks.offload_overlap, whose tail
                # chunk is two-thirds padding).
                every_slot = owned_pieces(self.layout, (chunk.start, chunk.numel), False)
                for lo, hi in not_updated(chunk, every_slot):
                    shadow[lo:hi].copy_(payload[lo:hi])
                self._kept.same_padding[kind] = pair
            idle = self._plan.idle(chunk)
            if idle:
                torch._foreach_copy_(spans(chunk, idle, shadow), spans(chunk, idle))
        self._taken = True

    def stand(self) -> None:
        """The step takes the update: each shadow takes its chunk's place, and the payload it
        replaced is the shadow of the group's next update."""
        for kind, shadow in list(self.shadows.items()):
            chunk = self.layout.chunks[kind]
            self.shadows[kind] = self._residency.swap_payload(chunk, shadow)

    def restore(self, staging: Staging) -> None:
        """Write every copied element back where its chunk lives now (its home after the
        update finished), take the step counts back (where its run advanced them), and give
        the 16-bit values their old bits: the rounded masters, or the gradient the slot held.
        The shadows are left as they are: the chunks they stand for were only read. An update
        whose run failed before its kernels overwrote nothing: its copies, never filled, are
        not written back."""
        assert self.update is not None
        layout = self.layout
        for (kind, pieces, _grads), buffer in self._saved if self._taken else ():
            chunk = layout.chunks[kind]
            with staging.borrowed(chunk, write=True, reason="rollback"):
                views = spans(chunk, pieces)
                torch._foreach_copy_(views, list(torch.split(buffer, [v.numel() for v in views])))
        if self.update.steps_advanced:
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
    """The buffers held at once when the groups of ``group_bytes`` (bytes each, in the order
    their gradients become final) are speculated: each that fits the budget beside those
    before it, as :meth:`Speculation.reserve` keeps them (``chunkmem estimate`` counts them
    with this)."""
    held = 0
    for nbytes in group_bytes:
        if _within(budget_bytes, held, nbytes):
            held += nbytes
    return held


def _within(budget_bytes: int | None, held: int, nbytes: int) -> bool:
    return budget_bytes is None or held + nbytes <= budget_bytes


class Speculation:
    """The snapshots of one step's speculated groups, with buffers kept per group across steps
    within ``budget_bytes`` (None: as much as the host budget has room for); counts the steps
    committed and rolled back."""

    def __init__(self, residency: Residency, budget_bytes: int | None) -> None:
        self.residency = residency
        self.staging = Staging(residency)
        self.budget_bytes = budget_bytes
        self.held_bytes = 0  # of every kept buffer
        self.commits = 0
        self.rollbacks = 0
        self._snapshots: list[Snapshot] = []  # of this step's speculated updates
        self._kept: dict[int, Kept] = {}  # layout index -> its buffers
        self._plans: dict[int, Plan] = {}  # layout index -> its last plan

    @property
    def active(self) -> bool:
        """Whether updates of this step were taken speculatively."""
        return bool(self._snapshots)

    def reserve(
        self,
        layout: ChunkLayout,
        pieces: list[Piece],
        home: StorageTier,
        divided_grads: ChunkKind | None = None,
    ) -> Snapshot | None:
        """The snapshot that makes the update of ``pieces`` (states homed on ``home``; fp32
        gradients in ``divided_grads``' chunk that the kernel divides where they lie, if any)
        undoable: prepare the update to write to its :attr:`Snapshot.shadows`, then attach
        it. None, with nothing taken, when its buffers do not fit the budget or the host."""
        plan = self._plan(layout, pieces, home, divided_grads)
        kept = self._fit(
            layout.index, {kind: layout.chunks[kind] for kind in plan.shadowed}, plan.copies
        )
        if kept is None:
            return None
        snapshot = Snapshot(layout, pieces, self.residency, kept, plan)
        self._snapshots.append(snapshot)
        return snapshot

    def _plan(
        self,
        layout: ChunkLayout,
        pieces: list[Piece],
        home: StorageTier,
        divided_grads: ChunkKind | None,
    ) -> Plan:
        """Layout's plan for these pieces: the last one where they are the same."""
        key = Plan.key(pieces, home, divided_grads)
        known = self._plans.get(layout.index)
        if known is not None and known.key == key:
            return known
        spill = self.residency.tiers.spill
        shadowed = Snapshot.shadowed_kinds(layout, home) if home is spill else frozenset()
        plan = self._plans[layout.index] = Plan(layout, pieces, shadowed, divided_grads, key)
        return plan

    def _fit(
        self, index: int, shadows: dict[ChunkKind, Chunk], copies: dict[torch.dtype, int]
    ) -> Kept | None:
        """Layout ``index``'s kept buffers, made to serve ``shadows`` and ``copies``: what no
        longer fits is replaced, what does is kept (pieces vary from step to step, a layer
        without a gradient, and allocating afresh faults every page in again). None when
        the new buffers do not fit the budget or the host (the group waits for the norm)."""
        kept = self._kept.setdefault(index, Kept())
        if set(kept.shadows) != set(shadows) or any(
            kept.shadows[kind].numel() != chunk.numel for kind, chunk in shadows.items()
        ):
            self._free([kept.shadows.pop(kind) for kind in list(kept.shadows)])
            kept.same_padding.clear()
        grow = {
            dtype: numel
            for dtype, numel in copies.items()
            if dtype not in kept.copies or kept.copies[dtype].numel() < numel
        }
        self._free([kept.copies.pop(dtype) for dtype in grow if dtype in kept.copies])
        needed = [(c.numel, c.dtype) for k, c in shadows.items() if k not in kept.shadows]
        needed += [(numel, dtype) for dtype, numel in grow.items()]
        if not needed:
            return kept  # as it is: the usual step
        total = sum(numel * dtype.itemsize for numel, dtype in needed)
        if not _within(self.budget_bytes, self.held_bytes, total):
            return None
        if not self.residency.ledger.would_fit(self.residency.tiers.spill.name, total):
            return None
        for kind, chunk in shadows.items():
            if kind not in kept.shadows:
                kept.shadows[kind] = self._allocate(chunk.numel, chunk.dtype)
        for dtype, numel in grow.items():
            kept.copies[dtype] = self._allocate(numel, dtype)
        return kept

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self.residency.workspaces.allocate(
            numel, dtype, self.residency.tiers.spill, set(), within="capacity", kind=SPECULATION
        )
        self.held_bytes += numel * dtype.itemsize
        return buffer

    def _free(self, buffers: list[torch.Tensor]) -> None:
        spill = self.residency.tiers.spill
        for buffer in buffers:
            self.held_bytes -= buffer.numel() * buffer.element_size()
            self.residency.workspaces.free(buffer, spill, kind=SPECULATION)

    def commit(self) -> None:
        """The assumption held (or nothing was speculated): the speculated updates stand, each
        as the step takes it (:meth:`Snapshot.stand`)."""
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
        """An aborted cycle: the snapshots are dropped (the abort undoes or stops by itself);
        the buffers stay for the next step."""
        self._snapshots = []
