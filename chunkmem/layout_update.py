"""One layout's optimizer update, prepared: it owns the chunks' pins and workspaces until
``finish`` releases them on every path (see [Note: an update in three parts] in
``chunkmem.optimizer``; :mod:`chunkmem.update_builder` prepares it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot
from chunkmem.pieces import Piece
from chunkmem.sharding import Waitable
from chunkmem.update_kernels import fp32_norms

if TYPE_CHECKING:
    from chunkmem.update_builder import KernelCalls, UpdateBuilder


class LayoutUpdate:
    """One layout's update, prepared and finished on the engine's thread; ``run`` may be
    called on any thread (see [Note: an update in three parts])."""

    def __init__(
        self,
        builder: UpdateBuilder,
        layout: ChunkLayout,
        slots: list[TensorSlot],
        stack: contextlib.ExitStack,
        build: Callable[[bool], KernelCalls],
        after: list[Callable[[], None]],
        reads: list[Waitable],
        chunks: dict[ChunkKind, Chunk],
        pieces: list[Piece],
        steps: list[torch.Tensor],
        measure_grad_norms: bool = False,
    ) -> None:
        self.layout = layout
        self.slot_ids = {id(slot) for slot in slots}
        # What each slot's gradient held when the update was prepared: a contribution added
        # after that is one the update never reads (see ``grown_since_read``).
        self._read = [(slot, slot.grad_contributions) for slot in slots]
        self.chunks = chunks  # pinned on the work tier until ``finish``
        self.pieces = pieces
        self.steps = steps  # the step counts this update advances as its run starts
        self.steps_advanced = False
        # Run on the update's thread once its reads are in, before the kernels (a speculative
        # update copies what it will overwrite: offload/speculation.py).
        self.before_run: list[Callable[[], None]] = []
        # Run when the step takes an update begun early (a speculative one's new states, written
        # out of place, take their chunks' place).
        self.on_stand: list[Callable[[], None]] = []
        self.pending: Future | None = None  # the run, when another thread does it
        self.finished = False
        # An early update measures the gradients it is about to consume, for the step's
        # global-norm check, on the thread that runs it rather than in backward (a GPU's on
        # the GPU as it is prepared, as the step would: ``Staged.norms``).
        self.measure_grad_norms = measure_grad_norms
        self.grad_norms: list[torch.Tensor] = []  # fp32 per piece, in the pieces' order
        self._builder = builder
        self._stack = stack
        self._build = build  # the kernel calls (measuring the norms or not), built by ``run``
        self._after = after
        self._reads = reads

    def run(self) -> None:
        # Advanced here, not when prepared: on the thread that runs the kernels, which are the
        # only readers until the update finishes (one op fewer on the engine's thread).
        torch._foreach_add_(self.steps, 1)
        self.steps_advanced = True
        for read in self._reads:
            read.wait()
        for hook in self.before_run:
            hook()
        built = self._build(self.measure_grad_norms)
        if self.measure_grad_norms and built.grads and built.norms is None:
            if built.staged_norms is not None:  # measured where they lay; the buffer is
                self.grad_norms = list(built.staged_norms.clone().unbind())  # released later
            else:
                self.grad_norms = fp32_norms(built.grads, self._builder.host_threads)
        self._builder.run_calls(built.calls)
        if built.norms is not None:  # measured by the calls, as they read the gradients
            self.grad_norms = built.measured_norms()

    def grown_since_read(self) -> list[TensorSlot]:
        """The slots whose gradient got another contribution after this update was prepared
        (begun early, it read the gradient as it was then)."""
        return [slot for slot, count in self._read if slot.grad_contributions != count]

    def wait(self) -> None:
        """Until a run on another thread is done; raises what it raised."""
        if self.pending is not None:
            self.pending.result()

    def stand(self) -> None:
        """The step takes this update, run and finished (see :attr:`on_stand`)."""
        assert self.finished
        for hook in self.on_stand:
            hook()

    def finish(self, completed: bool = True) -> None:
        """After a completed run, copy new values where they live; release the chunks
        (writing states back to their home); rebind the parameters."""
        if self.finished:
            return
        self.finished = True
        if completed:
            for after in self._after:
                after()
        self._stack.close()
        if completed:
            for slot in self.layout.slots:
                if id(slot) in self.slot_ids:
                    slot.grad_in_param_slot = False
            self._builder.manager.binder.bind_layout(self.layout)
