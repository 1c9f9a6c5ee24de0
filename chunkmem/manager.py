"""ChunkManager: which parameter lives where in which chunk, and what an access needs.

Parameters are packed lazily, in the order they are first accessed. ``access`` brings the
chunks the parameters compute on to the device (through :class:`Residency`) and binds each
parameter's ``.data`` to its view there. A parameter whose chunk is not on the device has an
empty placeholder as ``.data``, so an access the engine did not arrange fails loudly instead
of reading stale memory.

Under ZeRO (a :class:`Sharding` with stage >= 1) optimizer states cover only this rank's shard
of each layout, gradients are reduce-scattered into shard chunks, and at stage 3 the parameter
chunk itself is a shard that is all-gathered into a ``GATHERED`` chunk for compute.

[Note: gradients in the parameter slot] In bf16/fp16 training without gradient accumulation
(and without ZeRO) a gradient overwrites its parameter's 16-bit slot once autograd has
finished accumulating it (post-accumulate-grad hook): the fp32 master still holds the value,
and the step rewrites the slot from it. If anything touches the value again in the same
iteration (a parameter used again after its gradient was final, re-entrant checkpointing, a
``detach()``-ed use), the access notices, moves the gradient to a gradient chunk, restores the
value from the master exactly, and remembers that this parameter needs the gradient chunk from
then on. So reuse is an optimisation that can never change results.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from chunkmem.chunk import DYNAMIC_KINDS, Chunk, ChunkKind, ChunkLayout, TensorSlot, Tier
from chunkmem.packing import Packer
from chunkmem.placement import optimizer_state_device_groups
from chunkmem.residency import Residency
from chunkmem.sharding import Sharding, Waitable
from chunkmem.states import HOLD_STATES, TensorState
from chunkmem.tracer import Moment

# Stage 2/3 reduce-scatters running at once during backward: enough to overlap the next
# layouts' gradients with communication, few enough that whole gradient chunks are freed as
# backward goes (each completed reduction keeps only this rank's shard).
MAX_REDUCTIONS_IN_FLIGHT = 2


@dataclass(frozen=True)
class ParamToken:
    """A saved-for-backward tensor that aliases a parameter chunk, stored as geometry only.

    Holding the tensor itself would keep the chunk's device memory alive after eviction.
    """

    chunk: Chunk
    storage_offset: int
    size: torch.Size
    stride: tuple[int, ...]


class ChunkManager:
    """Registry of parameters in chunks; accesses, gradients and optimizer-state chunks."""

    def __init__(
        self,
        residency: Residency,
        compute_dtype: torch.dtype,
        chunk_size: int,
        keep_fp32_master: bool,
        grads_in_param_slot: bool,
        optimizer_states_mode: str,
        sharding: Sharding,
    ) -> None:
        self.residency = residency
        residency.listener = self
        self.device = residency.device
        self.ledger = residency.ledger
        self.tracer = residency.tracer
        self.placement = residency.placement
        self.compute_dtype = compute_dtype
        self.chunk_size = chunk_size
        self.keep_fp32_master = keep_fp32_master
        self.sharding = sharding
        self.grads_in_param_slot = grads_in_param_slot and not sharding.states_sharded
        self.optimizer_states_mode = optimizer_states_mode
        self.compute_kind = ChunkKind.GATHERED if sharding.params_sharded else ChunkKind.PARAM

        # Keyed by id(param): a Parameter's __hash__ is a Python call, and these are hot.
        self.slots: dict[int, TensorSlot] = {}
        self.pending: dict[int, tuple[str, torch.nn.Parameter]] = {}  # registered, not packed
        self.layouts: list[ChunkLayout] = []
        layout_ids = itertools.count()
        self._packers = {
            trainable: Packer(chunk_size, trainable, lambda: next(layout_ids), sharding.world_size)
            for trainable in (True, False)
        }
        self._slot_offsets: dict[int, list[int]] = {}
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._drop_later: dict[int, ChunkLayout] = {}  # gathered copies pinned when released
        self._gathering: list[Chunk] = []  # parameter chunks being all-gathered after the step
        self.optimizer_homes: dict[int, Tier] | None = None  # layout index -> tier
        self.repaired_grad_slots: list[str] = []
        # ZeRO gradient reduction within one backward.
        self._final_micro_batch = True
        self._stored: dict[int, set[int]] = {}  # layout -> slots that got a gradient
        self._expected: dict[int, set[int]] = {}  # learned from the previous cycle
        self._launched: set[int] = set()  # layouts reduce-scattered in this accumulation window
        self._in_flight: dict[int, tuple[ChunkLayout, Waitable, torch.Tensor | None]] = {}

    @property
    def chunks(self) -> dict[int, Chunk]:
        return self.residency.chunks

    # ------------------------------------------------------------------ registration
    def register(self, named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """Take charge of parameters (tied ones once, under their first name)."""
        for name, param in named_params:
            if id(param) in self.pending or id(param) in self.slots:
                continue
            if not param.dtype.is_floating_point:
                raise TypeError(
                    f"parameter {name!r} has dtype {param.dtype}; chunkmem manages floating-"
                    f"point parameters only (register integer state as a buffer instead)"
                )
            self.pending[id(param)] = (name, param)

    @property
    def all_packed(self) -> bool:
        return not self.pending

    def is_managed(self, param: torch.Tensor) -> bool:
        return id(param) in self.slots or id(param) in self.pending

    def slot_of(self, param: torch.Tensor) -> TensorSlot | None:
        """The slot of a packed parameter (None if it is not packed or not managed)."""
        return self.slots.get(id(param))

    def pack_remaining(self, tier: Tier) -> None:
        """Pack parameters that no forward touched (in registration order)."""
        for _name, param in list(self.pending.values()):
            self._pack(param, tier)

    def _pack(self, param: torch.nn.Parameter, tier: Tier) -> TensorSlot:
        name, _param = self.pending.pop(id(param))
        original = param.detach()
        slot, layout, created = self._packers[param.requires_grad].place(name, param)
        self.slots[id(param)] = slot
        if created:
            self._create_layout_chunks(layout, tier)
        chunks = layout.chunks
        compute = chunks[self.compute_kind]
        if compute.payload is None:  # a gathered copy dropped since the last slot was added
            self.residency.ensure_on_device([compute])
        self.residency.ready(compute)
        compute.view(slot).copy_(original)
        for kind in (ChunkKind.PARAM, ChunkKind.MASTER):
            if kind in chunks and chunks[kind] is not compute:
                self._copy_owned_part(chunks[kind], slot, original)
        self._slot_offsets[layout.index] = [s.offset for s in layout.slots]
        slot.set_state(TensorState.HOLD)
        if compute.tier is Tier.DEVICE:
            self._bind(slot, compute)
        else:
            self._unbind(slot)
        return slot

    def _create_layout_chunks(self, layout: ChunkLayout, tier: Tier) -> None:
        self.layouts.append(layout)
        shard = self.sharding.shard(layout)
        if self.sharding.params_sharded:
            # All ranks hold the same original values, so the first gathered copy is built
            # locally; the persistent parameter chunk is this rank's shard.
            self.residency.new_chunk(layout, ChunkKind.GATHERED, self.compute_dtype, Tier.DEVICE)
            self.residency.new_chunk(layout, ChunkKind.PARAM, self.compute_dtype, tier, shard)
        else:
            self.residency.new_chunk(layout, ChunkKind.PARAM, self.compute_dtype, tier)
        if layout.trainable and self.keep_fp32_master:
            span = shard if self.sharding.states_sharded else None
            self.residency.new_chunk(layout, ChunkKind.MASTER, torch.float32, Tier.HOST, span)

    def _copy_owned_part(self, chunk: Chunk, slot: TensorSlot, original: torch.Tensor) -> None:
        """Copy the part of ``original`` that falls in ``chunk``'s span."""
        lo = max(0, chunk.start - slot.offset)
        hi = min(slot.numel, chunk.start + chunk.numel - slot.offset)
        if lo < hi:
            self.residency.ready(chunk)
            chunk.span(slot, lo, hi).copy_(original.reshape(-1)[lo:hi])

    # ------------------------------------------------------------------ binding
    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.device.torch_device)
        return self._placeholders[dtype]

    def _bind(self, slot: TensorSlot, chunk: Chunk) -> None:
        slot.param.data = chunk.view(slot)
        slot.bound = True

    def _unbind(self, slot: TensorSlot) -> None:
        slot.param.data = self._placeholder(self.compute_dtype)
        slot.bound = False

    def chunk_arrived(self, chunk: Chunk) -> None:
        if chunk.kind is self.compute_kind:
            for slot in chunk.layout.slots:
                if not slot.grad_in_param_slot and not slot.bound:
                    self._bind(slot, chunk)

    def chunk_leaving(self, chunk: Chunk) -> None:
        if chunk.kind is self.compute_kind:
            for slot in chunk.layout.slots:
                self._unbind(slot)

    def fill_gathered(self, chunk: Chunk, protect: set[int], async_op: bool) -> None:
        """All-gather the layout's parameter shards into its gathered chunk."""
        shard = chunk.layout.chunks[ChunkKind.PARAM]
        self.residency.ensure_on_device([shard])
        handle = self.sharding.all_gather(shard.payload, chunk.payload, async_op=async_op)
        if async_op:
            chunk.arriving = handle

    def _prefetch_gathered(self) -> None:
        """ZeRO-3: start gathering the layouts the next traced moment needs, so the all-gather
        overlaps this moment's compute. Driven by the trace alone, so every rank issues the
        same gathers in the same order."""
        for _index, accessed in self.tracer.upcoming(1):
            for chunk_id, tier in accessed.items():
                chunk = self.chunks.get(chunk_id)
                if chunk is None or chunk.kind is not ChunkKind.GATHERED or tier is not Tier.DEVICE:
                    continue
                if chunk.tier is Tier.DEVICE:
                    continue
                self.residency.make_room(chunk.nbytes, {chunk.id}, "prefetch")
                self.residency.allocate_payload(chunk, Tier.DEVICE, zeroed=False)
                self.fill_gathered(chunk, {chunk.id}, async_op=True)
                self.chunk_arrived(chunk)

    def bind_layout(self, layout: ChunkLayout) -> None:
        """Rebind a layout's parameters after its slots were rewritten on the device."""
        chunk = layout.chunks.get(self.compute_kind)
        if chunk is not None and chunk.tier is Tier.DEVICE:
            self.chunk_arrived(chunk)

    # ------------------------------------------------------------------ moments
    def enter_moment(self, moment: Moment) -> None:
        if self._drop_later:  # the moment that pinned them is over (the trace still at it)
            self.residency.release_transient_pins()
            self._drop_deferred()
        self.residency.enter_moment(moment)

    def after_access(self) -> None:
        self.residency.after_access()
        if self.sharding.params_sharded and self.tracer.replaying:
            self._prefetch_gathered()

    # ------------------------------------------------------------------ access / release
    def _slot_for_access(self, param: torch.nn.Parameter) -> TensorSlot:
        slot = self.slots.get(id(param))
        if slot is None:
            slot = self._pack(param, Tier.DEVICE)
        if slot.grad_in_param_slot:
            self._repair_grad_slot(slot)
        return slot

    def compute_chunk(self, slot: TensorSlot) -> Chunk:
        return slot.layout.chunks[self.compute_kind]

    def access(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Put ``params`` in COMPUTE with their chunks on the device and ``.data`` bound."""
        slots = []
        for param in params:
            slot = self.slots.get(id(param))
            if slot is None or slot.grad_in_param_slot:
                slot = self._slot_for_access(param)
            slots.append(slot)
        kind = self.compute_kind
        self.residency.ensure_on_device(list(dict.fromkeys(s.layout.chunks[kind] for s in slots)))
        for slot in slots:
            slot.users += 1
            if slot.state is not TensorState.COMPUTE:
                slot.set_state(TensorState.COMPUTE)
            if not slot.bound:
                self._bind(slot, self.compute_chunk(slot))

    def release(self, params: Sequence[torch.nn.Parameter], state: TensorState) -> None:
        """One user of each of ``params`` is done; the last one moves it to ``state``."""
        layouts = {}
        for param in params:
            slot = self.slots[id(param)]
            if slot.users == 0:
                continue
            slot.users -= 1
            if slot.users == 0:
                slot.set_state(state)
                layouts[slot.layout.index] = slot.layout
        if self.sharding.params_sharded:
            for layout in layouts.values():
                self._maybe_drop_gathered(layout)

    def _maybe_drop_gathered(self, layout: ChunkLayout) -> None:
        """Release a gathered copy once no one uses it and it is not needed again in this
        phase (the trace says when): the other ranks' shards are gathered again next phase.
        A copy pinned for the rest of the moment is looked at again when the moment ends."""
        gathered = layout.chunks[ChunkKind.GATHERED]
        if gathered.tier is not Tier.DEVICE:
            return
        if not gathered.movable():
            if gathered.pins:
                self._drop_later[layout.index] = layout
            return
        if self.tracer.replaying and self.tracer.needed_again_this_phase(gathered.id):
            return
        self.residency.free_payload(gathered)

    def _drop_deferred(self) -> None:
        layouts, self._drop_later = list(self._drop_later.values()), {}
        for layout in layouts:
            self._maybe_drop_gathered(layout)

    def release_all(self, state: TensorState) -> None:
        """End of a phase: whatever is still in COMPUTE goes to ``state``."""
        self.residency.release_transient_pins()
        for slot in self.slots.values():
            if slot.state is TensorState.COMPUTE:
                slot.users = 0
                slot.set_state(state)
        if self._drop_later:
            self._drop_deferred()

    def reset_states(self) -> None:
        """End of a cycle (or an aborted one): every packed tensor back to HOLD."""
        self.residency.release_transient_pins()
        for slot in self.slots.values():
            slot.users = 0
            if slot.state is not TensorState.HOLD:
                if slot.state is TensorState.COMPUTE:
                    slot.set_state(TensorState.HOLD_AFTER_BWD)
                slot.set_state(TensorState.HOLD)

    def drop_gathered(self) -> None:
        """ZeRO-3: gathered copies are stale once the shards are updated."""
        for layout in self.layouts:
            gathered = layout.chunks.get(ChunkKind.GATHERED)
            if gathered is not None:
                self.residency.free_payload(gathered)

    def materialize(self, param: torch.nn.Parameter) -> None:
        """On-demand access outside module hooks; pinned until the next moment."""
        chunk = self.compute_chunk(self._slot_for_access(param))
        self.residency.ensure_on_device([chunk])
        self.residency.pin_until_next_moment(chunk)

    # ------------------------------------------------------------------ saved tensors
    def token_for(self, tensor: torch.Tensor) -> ParamToken | None:
        """A token if ``tensor`` aliases a parameter chunk on the device, else None."""
        if tensor.layout is not torch.strided or tensor.device != self.device.torch_device:
            return None
        chunk = self.residency.chunk_of_storage(tensor)
        if chunk is None or chunk.kind is not self.compute_kind:
            return None
        return ParamToken(chunk, tensor.storage_offset(), tensor.shape, tensor.stride())

    def unpack(self, token: ParamToken) -> torch.Tensor:
        chunk = token.chunk
        offsets = self._slot_offsets[chunk.layout.index]
        slot = chunk.layout.slots[bisect.bisect_right(offsets, token.storage_offset) - 1]
        if slot.grad_in_param_slot:
            self._repair_grad_slot(slot)
        if chunk.tier is not Tier.DEVICE:
            self.residency.ensure_on_device([chunk])
        self.residency.ready(chunk)
        self.residency.pin_until_next_moment(chunk)
        assert chunk.payload is not None
        return chunk.payload.as_strided(token.size, token.stride, token.storage_offset)

    # ------------------------------------------------------------------ gradients
    def begin_backward(self, final_micro_batch: bool) -> None:
        """ZeRO reduces gradients only in the last micro-batch of an accumulation window."""
        self._final_micro_batch = final_micro_batch
        self._stored = {}

    def _grad_home(self, slot: TensorSlot) -> Chunk:
        chunks = slot.layout.chunks
        if self.grads_in_param_slot and not slot.needs_grad_chunk:
            return chunks[ChunkKind.PARAM]
        grad = chunks.get(ChunkKind.GRAD)
        if grad is None:
            grad = self.residency.new_chunk(slot.layout, ChunkKind.GRAD, self.compute_dtype, None)
        return grad

    def store_grad(self, param: torch.nn.Parameter) -> None:
        """Move ``param.grad`` into its chunk (adding to earlier contributions) and free it.

        Runs once per parameter per backward, so it stays lean: the gradient in flight is
        counted as non-model memory while it exists, and nothing can evict the home chunk
        between fetching it and the copy.
        """
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        slot = self.slots[id(param)]
        if slot.layout.index in self._in_flight:  # a late gradient: let the reduction read
            self._complete(slot.layout)  # the chunk undisturbed, then start a fresh one
        residency = self.residency
        meter = self.device.meter
        nbytes = grad.nelement() * grad.element_size()
        meter.add(nbytes)
        try:
            residency.on_nonmodel_growth()
            home = self._grad_home(slot)
            if home.tier is Tier.DEVICE and home.pending_event is None:
                residency.touch(home)
            else:
                residency.ensure_on_device([home])
            view = home.view(slot)
            if slot.grad_contributions > slot.grad_reduced:
                view.add_(grad)
            else:
                view.copy_(grad)
            slot.grad_contributions += 1
            if home.kind is ChunkKind.PARAM and not slot.grad_in_param_slot:
                slot.grad_in_param_slot = True
                self._unbind(slot)
        finally:
            del grad
            meter.remove(nbytes)
            residency.account_nonmodel()
        if self.sharding.grads_sharded_in_backward and self._final_micro_batch:
            self._on_grad_stored(slot)

    def _repair_grad_slot(self, slot: TensorSlot) -> None:
        """The value of a parameter whose slot holds its gradient is needed: separate them."""
        chunks = slot.layout.chunks
        param_chunk = chunks[ChunkKind.PARAM]
        master = chunks[ChunkKind.MASTER]
        slot.needs_grad_chunk = True
        grad_chunk = self._grad_home(slot)
        self.residency.ensure_on_device([param_chunk, grad_chunk])
        self.residency.ready(master)
        grad_chunk.view(slot).copy_(param_chunk.view(slot))
        param_chunk.view(slot).copy_(master.view(slot))
        slot.grad_in_param_slot = False
        self._bind(slot, param_chunk)
        self.repaired_grad_slots.append(slot.name)

    def grad_source(self, slot: TensorSlot) -> Chunk:
        """The chunk holding ``slot``'s gradient for the update (for this rank's span)."""
        chunks = slot.layout.chunks
        if self.sharding.states_sharded:
            return chunks[ChunkKind.GRAD_SHARD]
        return chunks[ChunkKind.PARAM] if slot.grad_in_param_slot else chunks[ChunkKind.GRAD]

    def grad_views(self, slots: list[TensorSlot]) -> list[torch.Tensor]:
        """Whole-slot gradient views of one unsharded layout (a cached list when they agree)."""
        in_param_slot = [slot.grad_in_param_slot for slot in slots]
        if all(in_param_slot) or not any(in_param_slot):
            home = self.grad_source(slots[0])
            self.residency.ready(home)
            return home.views(slots)
        return [self.grad_source(slot).view(slot) for slot in slots]

    # ZeRO: reduce-scatter of gradients ------------------------------------------------
    def _reduction_order(self) -> list[ChunkLayout]:
        """Every rank reduces the trainable layouts in this one order (last packed first, the
        order backward finishes them), so collectives always match across ranks."""
        return list(reversed(self.trainable_layouts()))

    def _on_grad_stored(self, slot: TensorSlot) -> None:
        """Stage 2/3: launch reduce-scatters for the longest run, in reduction order, of
        layouts whose expected gradients are all in (the overlap with backward)."""
        stored = self._stored.setdefault(slot.layout.index, set())
        stored.add(id(slot))
        if not self._expected:
            return  # the first cycle learns what to expect; it reduces after backward
        for layout in self._reduction_order():
            if layout.index in self._launched:
                continue
            expected = self._expected.get(layout.index, set())
            if not expected <= self._stored.get(layout.index, set()):
                return
            self._reduce(layout, async_op=True)
            self._retire_reductions(keep=MAX_REDUCTIONS_IN_FLIGHT)

    def _retire_reductions(self, keep: int) -> None:
        """Complete reductions in launch order while the oldest is done or more than ``keep``
        are running: each frees its whole gradient chunk, so stage 2 holds a few gradient
        chunks during backward instead of all of them (``keep=0``: wait for all).

        Launch order is the same on every rank and only the oldest is ever waited for, so a
        rank blocked here waits on a ring its peers have launched and will finish.
        """
        while self._in_flight:
            layout, handle, _late = next(iter(self._in_flight.values()))
            if len(self._in_flight) <= keep and not handle.is_completed():
                return
            self._complete(layout)

    def _reduce(self, layout: ChunkLayout, async_op: bool) -> None:
        """Reduce-scatter the layout's gradient chunk into this rank's gradient shard."""
        chunks = layout.chunks
        grad = chunks[ChunkKind.GRAD]
        shard = chunks.get(ChunkKind.GRAD_SHARD)
        if shard is None:
            span = self.sharding.shard(layout)
            shard = self.residency.new_chunk(layout, ChunkKind.GRAD_SHARD, grad.dtype, None, span)
        self.residency.ensure_on_device([grad])
        self._zero_unwritten(grad)
        first = shard.tier is None
        self.residency.ensure_on_device([shard])
        target = shard.payload
        late = None
        if not first:  # gradients arrived after an earlier reduction: reduce them and add
            late = self.residency.allocate_workspace(shard.numel, shard.dtype, Tier.DEVICE, set())
            target = late
        grad.pins += 1
        shard.pins += 1
        handle = self.sharding.reduce_scatter(grad.payload, target, async_op)
        for slot in layout.slots:
            slot.grad_reduced = slot.grad_contributions
        self._launched.add(layout.index)
        self._in_flight[layout.index] = (layout, handle, late)
        if not async_op:
            self._complete(layout)

    @staticmethod
    def _zero_unwritten(grad: Chunk) -> None:
        """Gradient chunks are allocated without zeroing: before they are summed across
        ranks, zero the slots no gradient wrote since the last reduction, and the padding."""
        layout = grad.layout
        for slot in layout.slots:
            if slot.grad_contributions == slot.grad_reduced:
                grad.span(slot, 0, slot.numel).zero_()
        grad.payload[layout.used :].zero_()

    def _complete(self, layout: ChunkLayout) -> None:
        _layout, handle, late = self._in_flight.pop(layout.index)
        handle.wait()
        chunks = layout.chunks
        grad, shard = chunks[ChunkKind.GRAD], chunks[ChunkKind.GRAD_SHARD]
        grad.pins -= 1
        shard.pins -= 1
        if late is not None:
            shard.payload.add_(late)
            self.residency.free_workspace(late, Tier.DEVICE)
        self.residency.free_payload(grad)  # reduced: this rank keeps only its shard

    def finish_backward(self) -> None:
        """Stage 2/3: reduce what is left, wait for everything, learn what to expect."""
        if not (self.sharding.grads_sharded_in_backward and self._final_micro_batch):
            return
        self.reduce_remaining()
        self._expected = {index: set(stored) for index, stored in self._stored.items()}

    def reduce_remaining(self) -> None:
        """Reduce every trainable layout not reduced yet, in reduction order, then wait.

        All of them, with gradients or not, on every rank: a rank that skipped a layout its
        peers reduce would leave them waiting. Gradients that arrived after their layout was
        reduced are reduced again and added.
        """
        for layout in self._reduction_order():
            grad = layout.chunks.get(ChunkKind.GRAD)
            launched, in_flight = layout.index in self._launched, layout.index in self._in_flight
            late = launched and not in_flight and grad is not None and grad.tier is not None
            if not launched or late:
                if grad is None:
                    grad = self.residency.new_chunk(
                        layout, ChunkKind.GRAD, self.compute_dtype, None
                    )
                self._reduce(layout, async_op=True)
        self._retire_reductions(keep=0)

    def sync_grad_presence(self) -> None:
        """ZeRO: a parameter has a gradient if any rank produced one (as on the global batch)."""
        slots = list(self.slots.values())
        present = torch.tensor([float(s.has_grad) for s in slots], dtype=torch.float32)
        self.sharding.all_reduce_sum(present)
        for slot, count in zip(slots, present.tolist(), strict=True):
            if count and not slot.grad_contributions:
                slot.grad_contributions = 1  # its shard holds the other ranks' gradients

    def discard_grads(self) -> None:
        """Drop this cycle's gradients; slots that held one get their value from the master."""
        for index in list(self._in_flight):
            _layout, handle, late = self._in_flight.pop(index)
            handle.wait()
            if late is not None:
                self.residency.free_workspace(late, Tier.DEVICE)
        self._launched.clear()
        for slot in self.slots.values():
            if not slot.grad_in_param_slot:
                continue
            chunks = slot.layout.chunks
            param_chunk, master = chunks[ChunkKind.PARAM], chunks[ChunkKind.MASTER]
            self.residency.ready(param_chunk)
            self.residency.ready(master)
            param_chunk.view(slot).copy_(master.view(slot))
            self.residency.transfer(
                param_chunk, master.tier, param_chunk.tier, slot.numel * 2, "restore"
            )
            slot.grad_in_param_slot = False
            if param_chunk.tier is Tier.DEVICE:
                self._bind(slot, param_chunk)
        self.clear_grads()

    def clear_grads(self) -> None:
        """After the step every gradient is consumed: their chunks need no memory until the
        next backward writes them, and moving dead gradients would waste bandwidth."""
        for slot in self.slots.values():
            slot.grad_contributions = 0
            slot.grad_reduced = 0
            slot.grad_in_param_slot = False
        for chunk in list(self.chunks.values()):
            if chunk.kind is ChunkKind.GRAD or chunk.kind is ChunkKind.GRAD_SHARD:
                self.residency.free_payload(chunk)
        self._launched.clear()

    # ------------------------------------------------------------------ optimizer states
    def trainable_layouts(self) -> list[ChunkLayout]:
        return [layout for layout in self.layouts if layout.trainable]

    def state_span(self, layout: ChunkLayout) -> tuple[int, int]:
        """(start, numel) of the layout's elements whose optimizer states this rank holds."""
        if self.sharding.states_sharded:
            return self.sharding.shard(layout)
        return 0, layout.capacity

    def place_optimizer_states(self, peak_nonmodel: int) -> None:
        """Choose each trainable layout's optimizer-state home and allocate its chunks.

        The device margin left beside the non-model peak and the dynamically placed chunks
        (parameters and gradients; for ZeRO, the shards plus room for two whole chunks in
        flight) takes whole groups in order; the rest stay on the host.
        """
        layouts = self.trainable_layouts()
        per_element = 8 + (4 if self.keep_fp32_master else 0)
        transient = (
            (ChunkKind.GATHERED, ChunkKind.GRAD) if self.sharding.grads_sharded_in_backward else ()
        )
        dynamic = sum(
            c.nbytes
            for c in self.chunks.values()
            if c.kind in DYNAMIC_KINDS and c.kind not in transient
        )
        if transient:
            dynamic += (
                2 * max(layout.capacity for layout in self.layouts) * self.compute_dtype.itemsize
            )
        on_device = optimizer_state_device_groups(
            self.placement.capacity,
            peak_nonmodel,
            dynamic,
            [self.state_span(layout)[1] * per_element for layout in layouts],
            self.optimizer_states_mode,
        )
        self.optimizer_homes = {}
        for position, layout in enumerate(layouts):
            home = Tier.DEVICE if position < on_device else Tier.HOST
            self.optimizer_homes[layout.index] = home
            master = layout.chunks.get(ChunkKind.MASTER)
            if master is not None and home is Tier.DEVICE:
                self.residency.make_room(master.nbytes, set(), "optimizer home", "capacity")
                self.residency.move(master, Tier.DEVICE, "optimizer home")
            for kind in (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ):
                span = self.state_span(layout)
                if home is Tier.DEVICE:
                    self.residency.make_room(span[1] * 4, set(), "optimizer home", "capacity")
                self.residency.new_chunk(layout, kind, torch.float32, home, span)

    def step_chunks(self, layout: ChunkLayout) -> dict[ChunkKind, Chunk]:
        """Prepare a layout's chunks for its update at the optimizer home, and pin them all.

        A device home needs the parameter and gradient chunks on the device. A host home with
        fp32 masters leaves them where they are: gradients stream to the host and updated
        16-bit values stream back, so a chunk on the device stays there for the next forward.
        fp32 training has no master: its parameter chunk is what the host updates, so it and
        the gradients come to the host.
        """
        assert self.optimizer_homes is not None
        home = self.optimizer_homes[layout.index]
        chunks = layout.chunks
        storage = [
            chunks[k]
            for k in (ChunkKind.PARAM, ChunkKind.GRAD, ChunkKind.GRAD_SHARD)
            if k in chunks and chunks[k].tier is not None
        ]
        if home is Tier.DEVICE:
            for chunk in storage:
                self.residency.touch(chunk, home)
            self.residency.ensure_on_device(storage)
        elif ChunkKind.MASTER not in chunks:
            for chunk in storage:
                self.residency.touch(chunk, home)
                self.residency.move(chunk, Tier.HOST, "step")
        pinned = {k: c for k, c in chunks.items() if c.tier is not None}
        for chunk in pinned.values():
            self.residency.ready(chunk)
            chunk.pins += 1
        return pinned

    def unpin(self, chunks: Iterable[Chunk]) -> None:
        for chunk in chunks:
            chunk.pins -= 1

    def gather_updated_params(self, layout: ChunkLayout) -> None:
        """Stages 1-2: every rank updated its shard of the parameters; all-gather the rest.

        Asynchronous: the gather overlaps the next layouts' updates; the chunk is pinned and
        waits for it before anyone reads it (``Residency.ready``), and ``finish_step``
        completes what is left.
        """
        param = layout.chunks[ChunkKind.PARAM]
        self.residency.ensure_on_device([param])
        start, numel = self.sharding.shard(layout)
        # In place: this rank's shard is already in its slot of the chunk.
        param.pins += 1
        param.arriving = self.sharding.all_gather(
            param.payload[start : start + numel], param.payload, async_op=True
        )
        self._gathering.append(param)

    def finish_step(self) -> None:
        """Wait for the parameter gathers the step launched."""
        for param in self._gathering:
            self.residency.ready(param)
            param.pins -= 1
        self._gathering.clear()

    # ------------------------------------------------------------------ reading values
    def layout_values(self, layout: ChunkLayout) -> torch.Tensor:
        """The layout's current values as one CPU tensor (fp32 masters when there are any).

        Under ZeRO this gathers the shards: every rank must call it.
        """
        chunks = layout.chunks
        source = chunks.get(ChunkKind.MASTER) or chunks[ChunkKind.PARAM]
        self.residency.ready(source)
        if any(s.grad_in_param_slot for s in layout.slots) and source.kind is ChunkKind.PARAM:
            raise RuntimeError(
                "parameters hold their gradients until the optimizer step; read values between steps"
            )
        payload = source.payload.to(self.device.torch_device)
        if source.is_whole:
            return payload.to("cpu", copy=True)
        full = torch.empty(layout.capacity, dtype=source.dtype, device=self.device.torch_device)
        self.sharding.all_gather(payload, full)
        return full.cpu()

    def states_hold(self) -> bool:
        return all(slot.state in HOLD_STATES for slot in self.slots.values())
