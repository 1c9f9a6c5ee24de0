"""ZeRO gradient reduction: each layout's gradient chunk reduce-scattered into this rank's shard.

Stage 1 reduces every layout before the step; stages 2-3 reduce a layout as soon as every
one of its slots has its gradient, from the first cycle on, overlapping backward, with at most
``MAX_REDUCTIONS_IN_FLIGHT`` running and completed oldest first, so each whole gradient chunk is
freed as backward goes. Every rank reduces the trainable layouts in one order (last packed
first, the order backward finishes them), so collectives always match across ranks; see
[Note: reductions when ranks take different paths].

[Note: reductions when ranks take different paths]
A rank's data may decide which parameters get a gradient (a branch, an expert no token was
routed to), so what one rank's backward reaches another's may not. Every rank still issues
the same reductions in the same order, because the decisions use only what all ranks know:
- In backward a rank reduces the longest run, in reduction order, of layouts whose every slot
  has its gradient here; at the end of backward it reduces the rest in that order. A rank
  that is missing a gradient only reduces later, never other layouts.
- A layout with a parameter that no rank gave a gradient in the last step (the step's
  all-reduce of presence votes says so on every rank alike: a pooler a loss never reaches)
  would stop that run on every rank, every step: it is left out of the run and reduced after
  all the others, at the end of backward.
- So a gradient cannot arrive after its layout was reduced (a rank waits for every slot),
  unless one parameter takes two gradients in one backward (reentrant checkpointing); its
  layout is reduced again and added, which matches across ranks where every rank's backward
  does the same (it does for a model whose structure does not depend on its data).

A reduction in flight is a :class:`Reduction`: it owns the pins on its two chunks and its
scratch buffer, and ``complete`` and ``cancel`` release them through one path, whatever
waiting raises.

How the bytes travel is a :class:`GradientReduction`: :class:`ExactReduceScatter`, or ZeRO++
qgZ's hierarchical quantized all-to-all (``zero.quantized_reduce``). Another compressor
(1-bit with error feedback, top-k, PowerSGD) is one more class with a ``launch`` method, given
to :class:`ReduceScatterGrads` by ``zero.strategy``; nothing else changes (docs/zeropp.md).
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol, runtime_checkable

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot
from chunkmem.costs import DeviceBytes, ReducerCosts, Traffic
from chunkmem.params import ParamStore
from chunkmem.residency import Residency
from chunkmem.sharding import (
    ClippingSchedule,
    GradReducer,
    ReducerState,
    Sharding,
    VarianceSchedule,
    Waitable,
)
from zero.comm import Communicator
from zero.comm_ledger import collective_traffic
from zero.kinds import GRAD_SHARD
from zero.topology import Topology
from zero.wire import BytesPool, PooledBytes

# Reduce-scatters running at once during backward: enough to overlap the next layouts'
# gradients with communication, few enough that whole gradient chunks are freed as backward
# goes (each completed reduction keeps only this rank's shard).
MAX_REDUCTIONS_IN_FLIGHT = 2


class GradientReduction(Protocol):
    """Turns every rank's whole gradient chunk of a layout into this rank's summed shard.

    ``launch(layout, full, shard)`` starts it; after the returned ``wait``, ``shard`` (rank
    ``r``'s ``n`` elements) holds the sum over ranks of their ``full[r*n : (r+1)*n]``, exactly
    for a reduce-scatter and approximately for a compressor. The contract:

    - Every rank launches the same layouts in the same order (``ReduceScatterGrads`` sees to
      it), and waits for them in launch order; ``is_completed`` must not block.
    - ``full`` may be read until ``wait`` returns and must not be kept; ``shard`` is written
      only by then. Anything else the reduction uses (scratch, wire buffers) it owns and
      releases in ``wait``, also when waiting raises: a cancel waits too.
    - ``layout`` names the layout, for compressors with state per layout (an error-feedback
      residual, PowerSGD's factors), which they keep themselves; ``layout.slots`` gives
      each parameter's offset and shape.
    - It sums; the update divides by the world size.
    """

    def launch(self, layout: ChunkLayout, full: torch.Tensor, shard: torch.Tensor) -> Waitable: ...


@runtime_checkable
class Staged(Protocol):
    """A reduction in several collectives, one after another (qgZ's two all-to-alls,
    PowerSGD's two all-reduces): ``advance`` issues the next one, waiting for the one before
    where it must. :class:`ReduceScatterGrads` calls it once the next reduction has launched,
    a point every rank reaches in launch order, so the later collective overlaps the rest of
    backward instead of starting when the reduction is waited for (on gloo, whose works
    complete only in ``wait``, a poll never advances one). Idempotent; ``wait`` advances
    whatever is left."""

    def advance(self) -> None: ...


class ExactReduceScatter:
    """The plain reduce-scatter on the world group, recorded under ``phase``."""

    def __init__(self, comm: Communicator, phase: str) -> None:
        self.comm = comm
        self.phase = phase

    def launch(self, layout: ChunkLayout, full: torch.Tensor, shard: torch.Tensor) -> Waitable:
        with self.comm.serving(self.phase):
            return self.comm.reduce_scatter(full, shard, async_op=True)


class GradientReductionCosts(Protocol):
    """The cost model of a :class:`GradientReduction`: the traffic of reducing ``layout``'s
    gradient chunk, the bytes of wire buffer it asks the pool for while in flight (0: none),
    and the state it keeps from its first reduction of the layout on, by ledger kind (a
    compressor's residual)."""

    def traffic(self, layout: ChunkLayout) -> list[Traffic]: ...

    def buffer_bytes(self, layout: ChunkLayout) -> int: ...

    def state_bytes(self, layout: ChunkLayout) -> dict[str, int]: ...


class ExactReduceScatterCosts:
    """:class:`ExactReduceScatter`'s costs: one reduce-scatter on the world."""

    def __init__(self, topology: Topology, itemsize: int, phase: str) -> None:
        self.topology = topology
        self.itemsize = itemsize
        self.phase = phase

    def traffic(self, layout: ChunkLayout) -> list[Traffic]:
        topology = self.topology
        return [
            collective_traffic(
                "reduce_scatter",
                layout.capacity,
                self.itemsize,
                topology,
                topology.world,
                self.phase,
            )
        ]

    def buffer_bytes(self, layout: ChunkLayout) -> int:
        return 0

    def state_bytes(self, layout: ChunkLayout) -> dict[str, int]:
        return {}


class Reduction:
    """One launched reduce-scatter of a layout's gradient chunk, and what it holds."""

    def __init__(
        self,
        layout: ChunkLayout,
        residency: Residency,
        reduction: GradientReduction,
        adds_to_shard: bool,
    ) -> None:
        """Launch; both chunks are on the device. ``adds_to_shard``: the shard holds an
        earlier reduction, and these (late) gradients are reduced apart and added to it."""
        chunks = layout.chunks
        self.layout = layout
        self.grad: Chunk = chunks[ChunkKind.GRAD]
        self.shard: Chunk = chunks[GRAD_SHARD]
        self._residency = residency
        self._late: torch.Tensor | None = None
        self.grad.pin()
        self.shard.pin()
        try:
            if adds_to_shard:
                self._late = residency.workspaces.allocate(
                    self.shard.numel, self.shard.dtype, residency.compute, set()
                )
            target = self.shard.payload if self._late is None else self._late
            self._handle = reduction.launch(layout, self.grad.payload, target)
        except BaseException:
            self._release()
            raise

    def is_completed(self) -> bool:
        return self._handle.is_completed()

    def advance(self) -> None:
        """Issue the reduction's next collective, if it has one (:class:`Staged`)."""
        if isinstance(self._handle, Staged):
            self._handle.advance()

    def complete(self) -> None:
        """Wait, fold late gradients in, and free the whole gradient chunk."""
        try:
            self._handle.wait()
            if self._late is not None:
                self.shard.payload.add_(self._late)
        finally:
            self._release()
        self._residency.free_payload(self.grad)  # reduced: this rank keeps only its shard

    def cancel(self) -> None:
        """Wait for the collective (peers are in it too), then drop what it held."""
        try:
            self._handle.wait()
        finally:
            self._release()

    def _release(self) -> None:
        self.grad.unpin()
        self.shard.unpin()
        if self._late is not None:
            late, self._late = self._late, None
            self._residency.workspaces.free(late, self._residency.compute)


class ReduceScatterGrads(GradReducer):
    """Reduce gradients into per-rank shards by ``reduction``; ``overlap`` launches them in
    backward. Gradients are reduced only in the last micro-batch of an accumulation window."""

    def __init__(
        self,
        params: ParamStore,
        residency: Residency,
        sharding: Sharding,
        reduction: GradientReduction,
        overlap: bool,
        state: ReducerState | None = None,
        variance: VarianceSchedule | None = None,
        clipping: ClippingSchedule | None = None,
    ) -> None:
        super().__init__(state, variance, clipping)
        self.params = params
        self.residency = residency
        self.sharding = sharding
        self.reduction = reduction
        self.overlap = overlap
        self._launched: set[int] = set()  # layouts reduced in this accumulation window
        self._in_flight: dict[int, Reduction] = {}  # launch order
        # Layouts with a parameter no rank gave a gradient in the last step: reduced last.
        self._idle: set[int] = set()

    def grad_source(self, slot: TensorSlot) -> Chunk:
        return slot.layout.chunks[GRAD_SHARD]

    def transient_kinds(self) -> frozenset[ChunkKind]:
        return frozenset({ChunkKind.GRAD}) if self.overlap else frozenset()

    def _order(self) -> list[ChunkLayout]:
        return list(reversed(self.params.trainable_layouts()))

    # ------------------------------------------------------------------ backward
    def before_write(self, layout: ChunkLayout) -> None:
        """A late gradient: let the reduction read the chunk undisturbed, then a fresh one
        (and an update begun on the reduced shard finishes reading it first)."""
        if layout.index in self._in_flight:
            self._complete(layout.index)
        super().before_write(layout)

    def stored(self, slot: TensorSlot) -> None:
        """Launch reduce-scatters for the longest run, in reduction order, of layouts whose
        every gradient is in, idle ones left out (the overlap with backward; see [Note:
        reductions when ranks take different paths])."""
        if not (self.overlap and self._final_micro_batch):
            return
        arrived = self._arrived
        arrived.add(slot)
        for layout in self._order():
            if layout.index in self._launched or layout.index in self._idle:
                continue
            if not arrived.all_in(layout):
                return
            self._launch(layout)
            self._retire(keep=MAX_REDUCTIONS_IN_FLIGHT)

    def finish_backward(self) -> None:
        if self.overlap and self._final_micro_batch:
            self._reduce_remaining()

    def before_step(self) -> None:
        if not self.overlap:
            self._reduce_remaining()

    # ------------------------------------------------------------------ the window
    def _launch(self, layout: ChunkLayout) -> None:
        chunks = layout.chunks
        grad = chunks[ChunkKind.GRAD]
        shard = chunks.get(GRAD_SHARD)
        if shard is None:
            span = self.sharding.shard(layout)
            shard = self.residency.new_chunk(layout, GRAD_SHARD, grad.dtype, None, span)
        adds_to_shard = shard.tier is not None
        self.residency.room.ensure_on_device([grad, shard])
        _zero_unwritten(grad)
        older = list(self._in_flight.values())
        with self.sharding.about(layout.index):
            self._in_flight[layout.index] = Reduction(
                layout, self.residency, self.reduction, adds_to_shard
            )
        for slot in layout.slots:
            slot.grad_reduced = slot.grad_contributions
        self._launched.add(layout.index)
        for reduction in older:  # launch order, after this launch, on every rank
            reduction.advance()

    def _complete(self, index: int) -> None:
        reduction = self._in_flight.pop(index)
        reduction.complete()
        if self._final_micro_batch:
            self._announce_final(reduction.layout)

    def _retire(self, keep: int) -> None:
        """Complete reductions in launch order while the oldest is done or more than ``keep``
        are running (``keep=0``: wait for all).

        Launch order is the same on every rank and only the oldest is ever waited for, so a
        rank blocked here waits on a ring its peers have launched and will finish.
        """
        while self._in_flight:
            index, oldest = next(iter(self._in_flight.items()))
            if len(self._in_flight) <= keep and not oldest.is_completed():
                return
            self._complete(index)

    def _reduce_remaining(self) -> None:
        """Reduce every trainable layout not reduced yet, in reduction order, the idle ones
        last, then wait.

        All of them, with gradients or not, on every rank: a rank that skipped a layout its
        peers reduce would leave them waiting. Gradients that arrived after their layout was
        reduced are reduced again and added. At most ``MAX_REDUCTIONS_IN_FLIGHT`` run at once,
        as in backward, so the scratch of reductions that need some (qgZ's wire buffers) stays
        a few layouts' worth.
        """
        order = self._order()
        idle = [layout for layout in order if layout.index in self._idle]
        for layout in [*(lo for lo in order if lo.index not in self._idle), *idle]:
            grad = layout.chunks.get(ChunkKind.GRAD)
            launched, in_flight = layout.index in self._launched, layout.index in self._in_flight
            late = launched and not in_flight and grad is not None and grad.tier is not None
            if not launched or late:
                if grad is None:
                    self.residency.new_chunk(
                        layout, ChunkKind.GRAD, self.params.compute_dtype, None
                    )
                self._launch(layout)
                self._retire(keep=MAX_REDUCTIONS_IN_FLIGHT)
        for reduction in list(self._in_flight.values()):
            reduction.advance()  # the last ones' next collectives together, then wait
        self._retire(keep=0)

    # ------------------------------------------------------------------ the step
    def presence_votes(self) -> torch.Tensor:
        slots = self.params.slots.values()
        return torch.tensor([float(s.has_grad) for s in slots], dtype=torch.float64)

    def agree_presence(self, votes: torch.Tensor) -> None:
        idle = set()
        for slot, count in zip(self.params.slots.values(), votes.tolist(), strict=True):
            if count and not slot.grad_contributions:
                slot.grad_contributions = 1  # its shard holds the other ranks' gradients
            if not count and slot.layout.trainable:
                idle.add(slot.layout.index)
        self._idle = idle  # for the next backward, alike on every rank

    # ------------------------------------------------------------------ endings
    def cancel(self) -> None:
        """Wait for every reduction in flight, oldest first, and release each one's pins;
        the first error is raised after all are released."""
        error: BaseException | None = None
        while self._in_flight:
            reduction = self._in_flight.pop(next(iter(self._in_flight)))
            try:
                reduction.cancel()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest
                error = error or exc
        self._launched.clear()
        if error is not None:
            raise error

    def clear(self) -> None:
        self._launched.clear()


def _zero_unwritten(grad: Chunk) -> None:
    """Gradient chunks are allocated without zeroing: before they are summed across ranks,
    zero the slots no gradient wrote since the last reduction, and the padding."""
    layout = grad.layout
    for slot in layout.slots:
        if slot.grad_contributions == slot.grad_reduced:
            grad.span(slot, 0, slot.numel).zero_()
    grad.payload[layout.used :].zero_()


class ReduceScatterGradsCosts(ReducerCosts):
    """:class:`ReduceScatterGrads`' costs: this rank's shard of every trainable layout, the
    reduction's traffic and wire buffer (from the pool the gatherer shares) per layout, in
    backward when ``overlap``, and the step's agreement on which parameters got gradients
    (one vote per parameter, riding on the norm's all-reduce)."""

    reduces = True
    max_in_flight = MAX_REDUCTIONS_IN_FLIGHT

    def __init__(
        self,
        topology: Topology,
        reduction: GradientReductionCosts,
        pool: BytesPool,
        overlap: bool,
    ) -> None:
        self.topology = topology
        self.reduction = reduction
        self.pool = pool
        self.in_backward = self.transient = overlap
        self._in_flight: dict[int, PooledBytes] = {}
        self._with_state: set[int] = set()
        self._state: Counter[str] = Counter()

    def shard_elements(self, capacity: int) -> int:
        return capacity // self.topology.world_size

    def launch(self, layout: ChunkLayout, device: DeviceBytes, label: str) -> list[Traffic]:
        if layout.index not in self._with_state:
            self._with_state.add(layout.index)
            for kind, nbytes in self.reduction.state_bytes(layout).items():
                device.add(kind, nbytes, label)
                self._state[kind] += nbytes
        wire = self.reduction.buffer_bytes(layout)
        if wire:
            self._in_flight[layout.index] = self.pool.take(wire, device, label)
        return self.reduction.traffic(layout)

    def held_state(self) -> dict[str, int]:
        return dict(self._state)

    def complete(self, layout: ChunkLayout, device: DeviceBytes, label: str) -> None:
        buffer = self._in_flight.pop(layout.index, None)
        if buffer is not None:
            self.pool.give(buffer, device, label)

    def presence_votes(self, num_params: int) -> int:
        return num_params
