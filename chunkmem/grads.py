"""The gradient store: where each parameter's gradient goes when autograd has finished it.

A post-accumulate-grad hook hands every finished ``param.grad`` to :meth:`GradStore.store`,
which adds it into the parameter's gradient home and frees it. The reducer (a sharding seam)
hears when each gradient is in, and says where the update reads it.

[Note: gradients in the parameter slot] In bf16/fp16 training without gradient accumulation
(and without ZeRO) a gradient overwrites its parameter's 16-bit slot once autograd has
finished accumulating it: the fp32 master still holds the value, and the step rewrites the
slot from it. If anything touches the value again in the same iteration (a parameter used
again after its gradient was final, re-entrant checkpointing, a ``detach()``-ed use), the
access notices, moves the gradient to a gradient chunk, restores the value from the master
exactly, and remembers that this parameter needs the gradient chunk from then on. So reuse is
an optimisation that can never change results.
"""

from __future__ import annotations

import torch

from chunkmem.binding import ParamBinder
from chunkmem.chunk import Chunk, ChunkKind, TensorSlot
from chunkmem.errors import EngineUsageError
from chunkmem.params import ParamStore
from chunkmem.residency import Residency
from chunkmem.sharding import GradReducer


class GradStore:
    """Stores finished gradients in chunks; repairs parameter slots that held one."""

    def __init__(
        self,
        params: ParamStore,
        residency: Residency,
        binder: ParamBinder,
        reducer: GradReducer,
        grads_in_param_slot: bool,
    ) -> None:
        self.params = params
        self.residency = residency
        self.binder = binder
        self.reducer = reducer
        self.grads_in_param_slot = grads_in_param_slot
        self.repaired_grad_slots: list[str] = []
        self.accepting = False  # only engine.backward() produces gradients the engine takes
        self.stored_in_backward = 0  # gradients stored since engine.backward() began

    def home(self, slot: TensorSlot) -> Chunk:
        """The chunk ``slot``'s gradient is written to in backward (created on first use)."""
        chunks = slot.layout.chunks
        if self.grads_in_param_slot and not slot.needs_grad_chunk:
            return chunks[ChunkKind.PARAM]
        grad = chunks.get(ChunkKind.GRAD)
        if grad is None:
            grad = self.residency.new_chunk(
                slot.layout, ChunkKind.GRAD, self.params.compute_dtype, None
            )
        return grad

    def store(self, param: torch.nn.Parameter) -> None:
        """Move ``param.grad`` into its chunk (adding to earlier contributions) and free it.

        Runs once per gradient contribution (once per parameter per backward; twice for one
        a reentrant activation checkpoint also uses), so it stays lean: the gradient in flight is
        counted as non-model memory while it exists, and nothing can evict the home chunk
        between fetching it and the copy.
        """
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        if not self.accepting:
            raise EngineUsageError(
                f"a gradient of {self.params.name_of(param)!r} arrived outside "
                f"engine.backward() (a loss.backward() of a forward run around the engine?). "
                f"It was dropped, not added to the next update: run forwards as engine(...) "
                f"and backward as engine.backward(loss)"
            )
        slot = self.params.slots[id(param)]
        self.reducer.before_write(slot.layout)
        residency = self.residency
        meter = residency.device.meter
        counted = meter.counts(grad)  # an operator's output, while it lives
        nbytes = 0 if counted else grad.nelement() * grad.element_size()
        meter.add(nbytes)
        try:
            residency.room.on_nonmodel_growth()
            home = self.home(slot)
            if home.on_device and home.pending_event is None:
                residency.room.touch(home)
            else:
                residency.room.ensure_on_device([home])
            view = home.view(slot)
            if slot.grad_contributions > slot.grad_reduced:
                view.add_(grad)
            else:
                view.copy_(grad)
            slot.grad_contributions += 1
            self.stored_in_backward += 1
            if home.kind is ChunkKind.PARAM and not slot.grad_in_param_slot:
                slot.grad_in_param_slot = True
                self.binder.unbind(slot)
        finally:
            del grad
            meter.remove(nbytes)
            residency.nonmodel.account()
        self.reducer.stored(slot)

    def repair(self, slot: TensorSlot) -> None:
        """The value of a parameter whose slot holds its gradient is needed: separate them."""
        chunks = slot.layout.chunks
        param_chunk = chunks[ChunkKind.PARAM]
        master = chunks[ChunkKind.MASTER]
        slot.needs_grad_chunk = True
        grad_chunk = self.home(slot)
        self.residency.room.ensure_on_device([param_chunk, grad_chunk])
        grad_chunk.view(slot).copy_(param_chunk.view(slot))
        param_chunk.view(slot).copy_(self._master_value(master, slot))
        slot.grad_in_param_slot = False
        self.binder.bind(slot, param_chunk)
        self.repaired_grad_slots.append(slot.name)

    def _master_value(self, master: Chunk, slot: TensorSlot) -> torch.Tensor:
        """The slot's fp32 value in its master chunk, wherever that lives (read from a tier
        that is not addressable)."""
        values = self.residency.contents(master)
        begin = slot.offset - master.start
        return values[begin : begin + slot.numel].view(slot.shape)

    def views(self, slots: list[TensorSlot]) -> list[torch.Tensor]:
        """Whole-slot gradient views of one unsharded layout (a cached list when they agree)."""
        source = self.reducer.grad_source
        in_param_slot = [slot.grad_in_param_slot for slot in slots]
        if all(in_param_slot) or not any(in_param_slot):
            home = source(slots[0])
            self.residency.ready(home)
            return home.views(slots)
        return [source(slot).view(slot) for slot in slots]

    def discard(self) -> None:
        """An aborted cycle: cancel reductions in flight, give every slot that held a gradient
        its value back from the master, and drop the gradients. The reducer's cancel runs
        first and its pins are released even if it raises."""
        try:
            self.reducer.cancel()
        finally:
            self._restore_param_slots()
            self.clear()

    def _restore_param_slots(self) -> None:
        for slot in self.params.slots.values():
            if not slot.grad_in_param_slot:
                continue
            chunks = slot.layout.chunks
            param_chunk, master = chunks[ChunkKind.PARAM], chunks[ChunkKind.MASTER]
            self.residency.ready(param_chunk)
            param_chunk.view(slot).copy_(self._master_value(master, slot))
            self.residency.transfer(
                param_chunk, master.tier, param_chunk.tier, slot.numel * 2, "restore"
            )
            slot.grad_in_param_slot = False
            if param_chunk.on_device:
                self.binder.bind(slot, param_chunk)

    def clear(self) -> None:
        """After the step every gradient is consumed: their chunks need no memory until the
        next backward writes them, and moving dead gradients would waste bandwidth."""
        for slot in self.params.slots.values():
            slot.grad_contributions = 0
            slot.grad_reduced = 0
            slot.grad_in_param_slot = False
        for chunk in list(self.residency.chunks.values()):
            if chunk.kind.gradient:
                self.residency.free_payload(chunk)
        self.reducer.clear()
