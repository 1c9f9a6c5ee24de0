"""The optimizer step overlapped with backward: a chunk group's host update starts as soon as
its gradients are final, on a host thread, while backward goes on with earlier layers.

The gradient reducer (:class:`chunkmem.sharding.GradReducer`) says when a layout's gradients
are final: when every gradient the previous cycle gave it has arrived (one process), or when
its reduce-scatter completed (ZeRO-2/3; ZeRO-1 reduces before the step, so its updates start
then). :class:`OverlappedStep` then asks the optimizer to prepare that layout's update on the
engine's thread and runs the kernels on its own thread; ``engine.step()`` finishes those and
updates the rest (layouts homed on the device, gradients that came late) in order. The
results are those of the serial step bit for bit: each layout's update reads and writes only
its own chunks, and the kernels' results do not depend on when or on which thread they run.

[Note: what makes an update speculative] Global-norm clipping, fp16's overflow check and
``nonfinite: skip`` need every gradient before any update. With any of them the early updates
are speculative (``offload/speculation.py``): each writes its new states out of place, and
when the norm is known they stand or are undone exactly and the step runs serially. With none
of them (and the default ``nonfinite: raise``) an early update is final: a non-finite gradient
found after updates began stops the engine, and ``engine.discard()`` after such a backward
refuses and asks for ``engine.step()``.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from chunkmem.chunk import ChunkLayout
from chunkmem.config import Config, speculative_reasons
from chunkmem.optimizer import ChunkOptimizer
from chunkmem.sharding import GradReducer
from offload.speculation import Speculation

_log = logging.getLogger("chunkmem.offload")


class OverlappedStep:
    """Starts each layout's host update when its gradients are final (a GradientsListener).

    Layouts are prefetched from a home that is not addressable (NVMe) in the order their
    gradients became final in the previous cycle: the next one's states are read while this
    one updates.
    """

    def __init__(self, optimizer: ChunkOptimizer, reducer: GradReducer) -> None:
        self.optimizer = optimizer
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="chunkmem-host-step")
        self._order: list[int] = []  # layout indices, as they became final last cycle
        self._now: list[int] = []
        self._waiting: list[ChunkLayout] = []  # final, but a unit still holds a chunk
        self._final_micro_batch = True  # whether this backward's gradients are the update's
        self._trainable: dict[int, ChunkLayout] | None = None  # by index, for this cycle
        self.started = 0  # updates started early, over the run
        reducer.listener = self

    def begin(self, final_micro_batch: bool) -> None:
        """A backward starts. What still waited when the last one ended was the step's to
        update; in a micro-batch that is not the window's last nothing starts early (its
        gradients are not final)."""
        self._waiting = []
        self._final_micro_batch = final_micro_batch
        if not final_micro_batch:
            return
        if self._now:
            self._order = self._now
        self._now = []
        self._trainable = None

    def final(self, layout: ChunkLayout) -> None:
        self._now.append(layout.index)
        self._waiting.append(layout)
        self._start_waiting()

    def writing(self, layout: ChunkLayout) -> None:
        self.optimizer.wait_early(layout)
        if self._final_micro_batch:
            self._start_waiting()

    def computing(self, layout: ChunkLayout) -> None:
        """A unit computes on ``layout`` after its update began (a recomputation the previous
        cycle did not show): the update finishes first, releasing the chunks it holds. The
        gradient that recomputation adds is then refused at the end of backward
        (``ChunkOptimizer.check_early_reads``)."""
        self.optimizer.finish_early(layout)

    def _start_waiting(self) -> None:
        """Start what can start: an fp32 update moves the parameter chunk to the host, which
        waits until the unit computing on it releases it (the next gradient's event)."""
        optimizer = self.optimizer
        optimizer.retire_early()
        if not self._waiting or optimizer.states.homes is None:
            return
        waiting, self._waiting = self._waiting, []
        for layout in waiting:
            if not optimizer.states.can_update_now(layout) or not self._staging_room(layout):
                self._waiting.append(layout)
            elif optimizer.start_early(layout, self._executor.submit):
                self.started += 1
                upcoming = self._next_after(layout.index)
                if upcoming is not None:
                    optimizer.states.prefetch(upcoming)

    def _staging_room(self, layout: ChunkLayout) -> bool:
        """States homed on NVMe are read into host memory for an update: one such update in
        flight at a time, beside the next one's read ahead, so that host memory holds two
        groups' states read in, as in the serial step (and as ``chunkmem estimate`` counts),
        however far the host thread lags behind backward."""
        states = self.optimizer.states
        if states.home(layout).addressable:
            return True
        return not any(
            not update.finished and not states.home(update.layout).addressable
            for update in self.optimizer.launched.values()
        )

    def _next_after(self, index: int) -> ChunkLayout | None:
        """The layout whose gradients were final after ``index``'s last cycle, if it is not
        final yet in this one."""
        order = self._order
        if index not in order:
            return None
        position = order.index(index) + 1
        if position >= len(order) or order[position] in self._now:
            return None
        upcoming = self._layouts([order[position]])
        return upcoming[0] if upcoming else None

    def _layouts(self, indices: list[int]) -> list[ChunkLayout]:
        """The trainable layouts of ``indices``, in that order."""
        if self._trainable is None:
            layouts = self.optimizer.params.trainable_layouts()
            self._trainable = {layout.index: layout for layout in layouts}
        by_index = self._trainable
        return [by_index[i] for i in indices if i in by_index]


def attach(
    config: Config, optimizer: ChunkOptimizer, reducer: GradReducer
) -> OverlappedStep | None:
    """The overlapped step for an engine whose config asks for it; speculative where the
    config needs every gradient before an update (one logged line says why)."""
    if not config.offload.overlap:
        return None
    reasons = speculative_reasons(config)
    if reasons:
        optimizer.speculation = Speculation(optimizer.residency, config.offload.speculation_bytes)
        _log.info(
            "offload.overlap: host updates start in backward speculatively and are undone "
            "exactly when the assumption fails (%s)",
            "; ".join(reasons),
        )
    return OverlappedStep(optimizer, reducer)
