"""ChunkManager: module accesses turned into chunks on the device, and moments.

``access`` brings the chunks a module's parameters compute on to the device (through
:class:`Residency`, packing parameters on first use), sets them to COMPUTE and binds their
``.data``; ``release`` hands them back in a HOLD state. Everything else has its own owner:
packing and layouts (:class:`ParamStore`), ``.data`` binding (:class:`ParamBinder`),
gradients (:class:`GradStore`), which copy parameters compute on and when it is dropped (the
:class:`ParamGatherer` seam), optimizer-state homes (:mod:`chunkmem.optimizer_states`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chunkmem.binding import ParamBinder
from chunkmem.chunk import Chunk, TensorSlot
from chunkmem.grads import GradStore
from chunkmem.params import ParamStore
from chunkmem.residency import Residency
from chunkmem.sharding import ParamGatherer
from chunkmem.states import TensorState
from chunkmem.tracer import Moment, Phase


class ChunkManager:
    """Accesses and releases of parameters, at moments the tracer records."""

    def __init__(
        self,
        params: ParamStore,
        residency: Residency,
        binder: ParamBinder,
        gatherer: ParamGatherer,
        grads: GradStore,
    ) -> None:
        self.params = params
        self.residency = residency
        self.binder = binder
        self.gatherer = gatherer
        self.grads = grads
        self.tracer = residency.tracer
        self._grads_in: set[int] = set()  # slots whose gradient of this backward is stored
        # Post-backward releases that came before the parameter's gradient: slot -> count.
        self._released_at_grad: dict[int, int] = {}

    # ------------------------------------------------------------------ moments
    def enter_moment(self, moment: Moment) -> None:
        """A module's pre-forward / pre-backward or a step: the last moment's pins end."""
        self.residency.release_transient_pins()
        self.gatherer.moment_over()
        self.residency.room.enter_moment(moment)
        if moment.phase is not Phase.STEP:
            self.gatherer.before_access()

    def after_access(self) -> None:
        self.residency.room.after_access()
        self.gatherer.after_access()

    # ------------------------------------------------------------------ access / release
    def _slot_for_access(self, param: torch.nn.Parameter) -> TensorSlot:
        slot = self.params.slots.get(id(param))
        if slot is None:
            slot = self.params.pack(param, self.residency.compute)
        if slot.grad_in_param_slot:
            self.grads.repair(slot)
        return slot

    def access(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Put ``params`` in COMPUTE with their chunks on the device and ``.data`` bound."""
        slots = []
        known = self.params.slots
        for param in params:
            slot = known.get(id(param))
            if slot is None or slot.grad_in_param_slot:
                slot = self._slot_for_access(param)
            slots.append(slot)
        kind = self.params.compute_kind
        self.grads.reducer.before_compute(slots)
        self.residency.room.ensure_on_device(
            list(dict.fromkeys(s.layout.chunks[kind] for s in slots))
        )
        for slot in slots:
            slot.users += 1
            if slot.state is not TensorState.COMPUTE:
                slot.set_state(TensorState.COMPUTE)
            if not slot.bound:
                self.binder.bind(slot, self.params.compute_chunk(slot))

    def waits_for_gradient(self, slot: TensorSlot) -> bool:
        """Whether ``slot``'s post-backward release waits for its gradient (see release)."""
        return id(slot) in self._released_at_grad

    def begin_backward(self) -> None:
        self._grads_in.clear()
        self._released_at_grad.clear()

    def store_gradient(self, param: torch.nn.Parameter) -> None:
        """Autograd finished ``param``'s gradient: store it, and carry out a post-backward
        release that waited for it."""
        self.grads.store(param)
        slot = self.params.slots.get(id(param))
        if slot is None:
            return
        self._grads_in.add(id(slot))
        for _ in range(self._released_at_grad.pop(id(slot), 0)):
            self.release([param], TensorState.HOLD_AFTER_BWD)

    def release(self, params: Sequence[torch.nn.Parameter], state: TensorState) -> None:
        """One user of each of ``params`` is done; the last one moves it to ``state``.

        [Note: a release waits for the gradient] A module's post-backward fires once the
        autograd nodes reading its inputs have run; the node that accumulates a weight's
        gradient may run later, and it needs the parameter bound, shape and all. A release
        of a trainable parameter whose gradient of this backward has not arrived waits for it
        (or for the end of backward): released at once, its gathered copy could go first and
        autograd found an unbound parameter (ZeRO-3 with activation checkpointing, GPT 6x32:
        'The size of tensor a (0) must match the size of tensor b (128)')."""
        released: dict[int, list[TensorSlot]] = {}
        known = self.params.slots
        for param in params:
            slot = known[id(param)]
            if slot.users == 0:
                continue
            if (
                state is TensorState.HOLD_AFTER_BWD
                and param.requires_grad
                and self.grads.accepting
                and id(slot) not in self._grads_in
            ):
                self._released_at_grad[id(slot)] = self._released_at_grad.get(id(slot), 0) + 1
                continue
            slot.users -= 1
            if slot.users == 0:
                slot.set_state(state)
                released.setdefault(slot.layout.index, []).append(slot)
        for slots in released.values():
            self.gatherer.released(slots[0].layout, slots, state)
        if released:
            self.residency.room.after_release()

    def release_all(self, state: TensorState) -> None:
        """End of backward: whatever is still in COMPUTE goes to ``state``."""
        self.residency.release_transient_pins()
        self._released_at_grad.clear()
        for slot in self.params.slots.values():
            if slot.state is TensorState.COMPUTE:
                slot.users = 0
                slot.set_state(state)
        self.gatherer.moment_over()
        self.gatherer.backward_over()

    def reset_states(self) -> None:
        """End of a cycle (or an aborted one): every packed tensor back to HOLD."""
        self.residency.release_transient_pins()
        self._released_at_grad.clear()
        for slot in self.params.slots.values():
            slot.users = 0
            if slot.state is not TensorState.HOLD:
                if slot.state is TensorState.COMPUTE:
                    slot.set_state(TensorState.HOLD_AFTER_BWD)
                slot.set_state(TensorState.HOLD)

    def materialize(self, param: torch.nn.Parameter) -> None:
        """On-demand access outside module hooks; pinned until the next moment."""
        chunk = self.params.compute_chunk(self._slot_for_access(param))
        self.residency.room.ensure_on_device([chunk])
        self.residency.pin_until_next_moment(chunk)

    def unpack_view(self, chunk: Chunk, storage_offset: int) -> torch.Tensor:
        """The payload of a parameter chunk a saved tensor aliases, on the device and pinned
        until the next moment (repairing the slot first if it holds a gradient)."""
        slot = self.params.slot_at(chunk, storage_offset)
        if slot.grad_in_param_slot:
            self.grads.repair(slot)
        if not chunk.on_device:
            self.residency.room.ensure_on_device([chunk])
        self.residency.ready(chunk)
        self.residency.pin_until_next_moment(chunk)
        assert chunk.payload is not None
        return chunk.payload
