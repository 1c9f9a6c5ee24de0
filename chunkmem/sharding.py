"""The sharding seams: what the core asks about parameters and gradients across ranks.

The core never asks which ZeRO stage runs. It asks three objects questions:

- :class:`Sharding`: which span of each layout this rank owns (its parameters, its optimizer
  states) and the two small collectives the step needs (reading values; the norm, with the
  reducer's presence votes).
- :class:`ParamGatherer`: which chunk kind parameters compute on, how that chunk gets its
  content, what to prefetch, when a copy is dropped, and what to do after a layout's update.
- :class:`GradReducer`: where a parameter's gradient is for the update, and what happens as
  gradients become final (nothing, or a reduce-scatter), before the step, and on a cancel.

Each base class is the world-of-one implementation (every method the identity or a no-op).
``zero/`` subclasses them for stages 1-3 (``zero.strategy``), and ZeRO++'s qwZ, hpZ and qgZ
are further subclasses; a :class:`Strategy` bundles the three for ``chunkmem.initialize``.

Every layout's capacity is a multiple of the world size, and rank ``r`` owns elements
``[r * capacity / n, (r + 1) * capacity / n)`` of every layout (its shard).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot
from chunkmem.states import TensorState

if TYPE_CHECKING:
    from chunkmem.params import ParamStore
    from chunkmem.residency import Residency

Span = tuple[int, int]  # (start, numel) of a layout's elements


class Waitable(Protocol):
    def wait(self) -> None: ...

    def is_completed(self) -> bool:
        """True once ``wait`` would return without blocking."""
        ...


class Done:
    """A collective that was the identity: already complete."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


# Names the layout of the collectives launched in its block (``Sharding.about``).
Subject = Callable[[int], contextlib.AbstractContextManager[None]]


def no_subject(_layout: int) -> contextlib.AbstractContextManager[None]:
    """A world of one: its collectives name nothing."""
    return contextlib.nullcontext()


class Sharding:
    """A world of one: owns every layout whole; collectives are identities."""

    world_size = 1
    rank = 0

    def shard(self, layout: ChunkLayout) -> Span:
        """(start, numel) of this rank's equal part of ``layout``."""
        size = layout.capacity // self.world_size
        return self.rank * size, size

    def param_span(self, layout: ChunkLayout) -> Span | None:
        """The part of the layout's parameters this rank keeps between uses (None: all)."""
        return None

    def state_span(self, layout: ChunkLayout) -> Span | None:
        """The part whose optimizer states (and fp32 masters) this rank holds (None: all)."""
        return None

    def all_gather(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """Blocking: every rank's ``shard`` into ``full`` (reading sharded values)."""
        full.copy_(shard)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        return None

    def set_tag(self, iteration: int) -> None:
        """The iteration number collectives are recorded under (for per-step accounting)."""
        return None

    def begin_cycle(self, cycle: int) -> None:
        """A new forward/backward/step cycle starts (aborted ones count): every rank must be
        in the same one whenever they meet in a collective."""
        return None

    def gather_objects(self, obj: object) -> list[object]:
        """Every rank's small picklable ``obj``, in rank order (blocking; a barrier too)."""
        return [obj]

    def about(self, layout: int) -> contextlib.AbstractContextManager[None]:
        """Collectives launched in the block move ``layout`` (their identity says so)."""
        return no_subject(layout)

    def checkpoint_group(self) -> object | None:
        """The process group ``torch.distributed.checkpoint`` coordinates on (None: a world of
        one, which checkpoints without collectives). Every rank calls it at the same point."""
        return None


class ParamGatherer:
    """How a layout's parameters are whole on the device when a module computes on them.

    A world of one computes on the persistent parameter chunks: nothing to gather.
    """

    compute_kind: ChunkKind = ChunkKind.PARAM

    def fill(self, chunk: Chunk) -> None:
        """Give a freshly allocated compute chunk its content (blocking)."""
        raise AssertionError(f"{type(self).__name__} computes on persistent chunks: {chunk!r}")

    def before_access(self) -> None:
        """A moment of forward or backward began; its chunks come in next: start, where it
        costs no room, what the next moment needs, so it queues behind what this one waits
        for."""

    def after_access(self) -> None:
        """A moment's chunks are in: start what the next moments will need."""

    def released(self, layout: ChunkLayout, slots: list[TensorSlot], state: TensorState) -> None:
        """The last user of ``slots`` (parameters of ``layout``) released them into ``state``."""

    def backward_over(self) -> None:
        """Backward ended: copies kept for a backward that never came may go."""

    def moment_over(self) -> None:
        """The moment that pinned chunks ended: look again at copies kept for it."""

    def after_update(self, layout: ChunkLayout) -> None:
        """This rank updated its span of ``layout``: make the new values whole where needed."""

    def finish_step(self) -> None:
        """Wait for what ``after_update`` started; every rank calls it after the step."""

    def settle(self) -> None:
        """Wait for what the last step left in flight (``zero.overlap_step_gather``): before
        backward, and before anything reads or writes the whole model."""

    def end_cycle(self) -> None:
        """The parameters changed: copies built from the old values are stale."""

    def cancel(self) -> None:
        """An exception ended the cycle: finish or drop everything in flight, unpin it all."""

    def transient_kinds(self) -> frozenset[ChunkKind]:
        """Kinds whose payloads exist only around their use (not counted as resident)."""
        return frozenset()


class GradientsListener(Protocol):
    """Hears, in the last micro-batch's backward, when a layout's gradients are final."""

    def begin(self, final_micro_batch: bool) -> None:
        """A backward starts; the next update reads its gradients where it is the last
        micro-batch of its accumulation window."""

    def final(self, layout: ChunkLayout) -> None:
        """Every gradient of ``layout`` the previous cycle saw is in and, under ZeRO,
        reduce-scattered: the update may read this rank's span of it."""

    def writing(self, layout: ChunkLayout) -> None:
        """A gradient is about to be written into ``layout``'s gradient chunks."""

    def computing(self, layout: ChunkLayout) -> None:
        """A unit is about to compute on ``layout``'s parameters (in backward: a
        recomputation after the layout was final, when the previous cycle misled)."""


class ExpectedGradients:
    """How many gradient contributions each slot of each layout got in this backward. A layout
    is final once every one of its slots has one, in the first cycle; once a cycle has been
    seen, once every slot has as many as in the previous cycle (a parameter used inside a
    reentrant activation checkpoint and outside it gets two; a parameter a branch leaves out
    is not waited for; should the pattern change, a late gradient shows it and is reduced
    again and added). Slots that get none at all are settled at the end of backward."""

    def __init__(self) -> None:
        self._stored: dict[int, dict[int, int]] = {}  # layout -> slot -> contributions
        self._expected: dict[int, dict[int, int]] = {}  # learned from the previous cycle
        # Layout -> how many of its expected slots are still short of their count in this
        # backward: a layout's check is then one lookup, not a walk of its slots at every
        # gradient stored (backward's hooks run it on the engine's thread, 100 times a step
        # for a GPT of 8 blocks).
        self._short: dict[int, int] = {}

    @property
    def learned(self) -> bool:
        return bool(self._expected)

    def begin(self) -> None:
        self._stored = {}
        self._short = {index: len(counts) for index, counts in self._expected.items()}

    def add(self, slot: TensorSlot) -> None:
        index, key = slot.layout.index, id(slot)
        counts = self._stored.setdefault(index, {})
        count = counts[key] = counts.get(key, 0) + 1
        expected = self._expected.get(index)
        if expected is not None and expected.get(key) == count:  # counts rise one at a time
            self._short[index] -= 1

    def complete(self, layout: ChunkLayout) -> bool:
        if not self.learned:
            return len(self._stored.get(layout.index, ())) == len(layout.slots)
        return self._as_expected(layout)

    def all_in(self, layout: ChunkLayout) -> bool:
        """Every slot of ``layout`` got its gradient in this backward (as many contributions
        as in the previous cycle, once one has been seen)."""
        every_slot = len(self._stored.get(layout.index, ())) == len(layout.slots)
        return every_slot and self._as_expected(layout)

    def _as_expected(self, layout: ChunkLayout) -> bool:
        return self._short.get(layout.index, 0) == 0

    def learn(self) -> None:
        self._expected = {index: dict(counts) for index, counts in self._stored.items()}


class ReducerState(Protocol):
    """What a gradient reduction keeps from step to step (a compressor's error feedback),
    for checkpoints (chunkmem.checkpoint): a description for the manifest, the tensors this
    rank saves, and, on load, what this rank asks for and how it takes it back, also on
    another world size."""

    def describe(self) -> dict[str, Any]: ...

    def carries_window(self) -> bool:
        """Whether a reduction since the last step changed what is kept for the next steps
        (it then holds part of this window's gradients: a discarded window cannot be
        undone)."""
        ...

    def window_stepped(self) -> None:
        """The step took this window's gradients."""
        ...

    def saved(self) -> dict[str, torch.Tensor]: ...

    def requested(self, saved: dict[str, Any], saved_world: int) -> dict[str, torch.Tensor]: ...

    def restore(
        self, loaded: dict[str, torch.Tensor], saved: dict[str, Any], saved_world: int
    ) -> None: ...


class VarianceSchedule(Protocol):
    """When a reduction asks Adam to stop updating its second moment (1-bit Adam's second
    stage: compressed gradients would distort it)."""

    momentum_in_gradients: float | None
    """With DGC's momentum correction, the decay of the momentum the reduced gradients already
    are (the frozen update takes them as its first moment); None otherwise."""

    def steps_frozen(self) -> int | None:
        """How many steps, this one included, the update has kept the second moment (each
        parameter's bias correction is that of its own last exact step), or None while it
        updates as usual."""
        ...


class ClippingSchedule(Protocol):
    """When a reduction has clipped each rank's gradients itself (DGC's local clipping), so
    the engine must not clip the reduced ones again."""

    def clips_locally(self) -> bool: ...


class GradReducer:
    """How gradients become the ones this rank's update reads.

    A world of one updates from the gradients where backward wrote them. A ``listener``
    (``offload.overlap``) hears when each layout's gradients are final; ``state`` is what the
    reduction keeps across steps, if anything; ``variance``, when the update must freeze Adam's
    second moment; ``clipping``, when the reduction clipped the gradients itself.
    """

    def __init__(
        self,
        state: ReducerState | None = None,
        variance: VarianceSchedule | None = None,
        clipping: ClippingSchedule | None = None,
    ) -> None:
        self.state = state
        self.variance = variance
        self.clipping = clipping
        self.listener: GradientsListener | None = None
        self._final_micro_batch = True
        self._arrived = ExpectedGradients()
        self._announced: set[int] = set()

    def global_clipping(self, max_norm: float) -> float:
        """The norm the engine clips this step's reduced gradients to: ``max_norm``, or 0
        (none) when the reduction clipped each rank's gradients before reducing them."""
        if self.clipping is not None and self.clipping.clips_locally():
            return 0.0
        return max_norm

    def _announce_final(self, layout: ChunkLayout) -> None:
        if self.listener is not None and layout.index not in self._announced:
            self._announced.add(layout.index)
            self.listener.final(layout)

    def grad_source(self, slot: TensorSlot) -> Chunk:
        """The chunk holding ``slot``'s gradient for the update (for this rank's span)."""
        chunks = slot.layout.chunks
        return chunks[ChunkKind.PARAM] if slot.grad_in_param_slot else chunks[ChunkKind.GRAD]

    def begin_backward(self, final_micro_batch: bool) -> None:
        """A backward starts; the last micro-batch of an accumulation window is final."""
        self._final_micro_batch = final_micro_batch
        self._arrived.begin()
        self._announced = set()
        if self.listener is not None:
            self.listener.begin(final_micro_batch)

    def before_write(self, layout: ChunkLayout) -> None:
        """A gradient is about to be added to ``layout``'s gradient chunk."""
        if self.listener is not None:
            self.listener.writing(layout)

    def before_compute(self, slots: list[TensorSlot]) -> None:
        """A unit is about to compute on these parameters."""
        if self.listener is not None:
            for layout in dict.fromkeys(slot.layout for slot in slots):
                self.listener.computing(layout)

    def stored(self, slot: TensorSlot) -> None:
        """``slot``'s gradient of this backward is in its chunk."""
        if self.listener is None or not self._final_micro_batch:
            return
        arrived = self._arrived
        arrived.add(slot)
        if arrived.complete(slot.layout):
            self._announce_final(slot.layout)

    def finish_backward(self) -> None:
        """Backward ended normally."""
        if self.listener is not None and self._final_micro_batch:
            self._arrived.learn()

    def before_step(self) -> None:
        """Every gradient the update reads must be final now (every rank calls it)."""

    def presence_votes(self) -> torch.Tensor:
        """This rank's vote on which parameters have a gradient (fp64, one per parameter),
        summed over ranks in the step's one small all-reduce, with the per-parameter squared
        norms; empty where gradients stay on their rank (a world of one)."""
        return torch.zeros(0, dtype=torch.float64)

    def agree_presence(self, votes: torch.Tensor) -> None:
        """Every rank's :meth:`presence_votes`, summed: a parameter has a gradient if any rank
        gave one (Adam skips the others, as on the global batch)."""

    def cancel(self) -> None:
        """An exception ended the cycle: finish or drop everything in flight, unpin it all."""

    def clear(self) -> None:
        """The step consumed the gradients."""

    def transient_kinds(self) -> frozenset[ChunkKind]:
        """Kinds whose payloads exist only until they are reduced (not counted as resident)."""
        return frozenset()


class Strategy:
    """The three seams for one process; ``zero.strategy`` builds the distributed ones."""

    def __init__(self, sharding: Sharding | None = None) -> None:
        self.sharding = sharding or Sharding()

    def gatherer(self, residency: Residency) -> ParamGatherer:
        return ParamGatherer()

    def reducer(self, params: ParamStore, residency: Residency) -> GradReducer:
        return GradReducer()
