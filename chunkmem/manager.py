"""ChunkManager: which tensor lives in which chunk, where each chunk is, and moving it.

Parameters are packed lazily, in the order they are first accessed. ``access`` brings the
chunks of the given parameters to the device, evicting by the placement policy, and binds
each parameter's ``.data`` to its view in the chunk. A parameter whose chunk is not on the
device has an empty placeholder as ``.data``, so an access the engine did not arrange fails
loudly instead of reading stale memory.

[Note: gradients in the parameter slot] In bf16/fp16 training without gradient
accumulation a gradient overwrites its parameter's 16-bit slot once autograd has finished
accumulating it (post-accumulate-grad hook): the fp32 master still holds the value, and the
step rewrites the slot from it. If anything touches the value again in the same iteration
(a parameter used again after its gradient was final, re-entrant checkpointing, a
``detach()``-ed use), ``access`` notices, moves the gradient to a separate gradient chunk,
restores the value from the master exactly, and remembers that this parameter needs the
gradient chunk from then on. So reuse is an optimisation that can never change results.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot, Tier
from chunkmem.devices import ComputeDevice
from chunkmem.errors import OutOfMemoryError
from chunkmem.ledger import WORKSPACE, Ledger
from chunkmem.packing import Packer
from chunkmem.placement import Placement, optimizer_state_device_groups, plan_moment
from chunkmem.states import HOLD_STATES, TensorState
from chunkmem.tracer import Moment, Tracer

DYNAMIC_KINDS = (ChunkKind.PARAM, ChunkKind.GRAD)


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
    """Registry of tensors in chunks; residency of chunks on the device and host tiers."""

    def __init__(
        self,
        device: ComputeDevice,
        ledger: Ledger,
        tracer: Tracer,
        placement: Placement,
        compute_dtype: torch.dtype,
        chunk_size: int,
        keep_fp32_master: bool,
        grads_in_param_slot: bool,
        optimizer_states_mode: str,
    ) -> None:
        self.device = device
        self.ledger = ledger
        self.tracer = tracer
        self.placement = placement
        self.compute_dtype = compute_dtype
        self.chunk_size = chunk_size
        self.keep_fp32_master = keep_fp32_master
        self.grads_in_param_slot = grads_in_param_slot
        self.optimizer_states_mode = optimizer_states_mode

        # Keyed by id(param): a Parameter's __hash__ is a Python call, and these are hot.
        self.slots: dict[int, TensorSlot] = {}
        self.pending: dict[int, tuple[str, torch.nn.Parameter]] = {}  # registered, not packed
        self.layouts: list[ChunkLayout] = []
        self.chunks: dict[int, Chunk] = {}
        self._chunk_ids = itertools.count()
        self._layout_ids = itertools.count()
        self._packers = {
            trainable: Packer(chunk_size, trainable, lambda: next(self._layout_ids))
            for trainable in (True, False)
        }
        self._device_storage: dict[int, Chunk] = {}  # data_ptr of device payload -> chunk
        self._resident: dict[int, Chunk] = {}  # dynamic chunks on the device
        self._resident_bytes = 0
        self._static_bytes = 0  # optimizer-state chunks on the device
        self._dynamic_with_payload = 0
        self._slot_offsets: dict[int, list[int]] = {}
        self._last_access: dict[int, int] = {}
        self._tick = 0
        self._transient_pins: list[Chunk] = []
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self.optimizer_homes: dict[int, Tier] | None = None  # layout index -> tier
        self.repaired_grad_slots: list[str] = []

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

    def name_of(self, param: torch.nn.Parameter) -> str:
        slot = self.slots.get(id(param))
        return slot.name if slot else self.pending[id(param)][0]

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
        packer = self._packers[param.requires_grad]
        slot, layout, created = packer.place(name, param)
        self.slots[id(param)] = slot
        if created:
            self.layouts.append(layout)
            self._new_chunk(layout, ChunkKind.PARAM, self.compute_dtype, tier)
            if layout.trainable and self.keep_fp32_master:
                self._new_chunk(layout, ChunkKind.MASTER, torch.float32, Tier.HOST)
        chunks = layout.chunks
        param_chunk = chunks[ChunkKind.PARAM]
        self._ready(param_chunk)
        param_chunk.view(slot).copy_(original)
        if ChunkKind.MASTER in chunks:
            self._ready(chunks[ChunkKind.MASTER])
            chunks[ChunkKind.MASTER].view(slot).copy_(original)
        self._slot_offsets[layout.index] = [s.offset for s in layout.slots]
        slot.set_state(TensorState.HOLD)
        if param_chunk.tier is Tier.DEVICE:
            self._bind(slot, param_chunk)
        else:
            self._unbind(slot)
        return slot

    def _new_chunk(
        self, layout: ChunkLayout, kind: ChunkKind, dtype: torch.dtype, tier: Tier
    ) -> Chunk:
        chunk = Chunk(next(self._chunk_ids), layout, kind, dtype)
        self.chunks[chunk.id] = chunk
        layout.chunks[kind] = chunk
        if tier is Tier.DEVICE and kind in DYNAMIC_KINDS:
            self._make_room(chunk.nbytes, protect=set(), reason="allocate")
        self._allocate_payload(chunk, tier)
        return chunk

    def _allocate_payload(self, chunk: Chunk, tier: Tier) -> None:
        """Give a chunk without payload a zeroed one on ``tier``; no bytes move."""
        what = f"a {chunk.kind.value} chunk"
        self.ledger.allocate(tier.value, chunk.kind.value, chunk.nbytes, what, f"chunk {chunk.id}")
        if tier is Tier.DEVICE:
            payload = self.device.empty(chunk.numel, chunk.dtype).zero_()
        else:
            payload = self.device.host_empty(chunk.numel, chunk.dtype).zero_()
        self._set_payload(chunk, payload, tier)

    def _free_payload(self, chunk: Chunk) -> None:
        """Drop a chunk's payload: its content is dead (e.g. gradients after the step)."""
        if chunk.tier is None or chunk.payload is None:
            return
        self._ready(chunk)
        self.ledger.free(chunk.tier.value, chunk.kind.value, chunk.nbytes, f"chunk {chunk.id}")
        self._set_payload(chunk, None, None)
        self.tracer.on_free(chunk.id)

    def _set_payload(self, chunk: Chunk, payload: torch.Tensor | None, tier: Tier | None) -> None:
        """The one place a payload changes: keeps the device indexes in step."""
        if chunk.kind in DYNAMIC_KINDS:
            self._dynamic_with_payload += (payload is not None) - (chunk.payload is not None)
        if chunk.tier is Tier.DEVICE:
            del self._device_storage[chunk.payload.untyped_storage().data_ptr()]
            if chunk.kind in DYNAMIC_KINDS:
                del self._resident[chunk.id]
                self._resident_bytes -= chunk.nbytes
            else:
                self._static_bytes -= chunk.nbytes
        chunk.payload, chunk.tier = payload, tier
        if tier is Tier.DEVICE:
            self._device_storage[payload.untyped_storage().data_ptr()] = chunk
            if chunk.kind in DYNAMIC_KINDS:
                self._resident[chunk.id] = chunk
                self._resident_bytes += chunk.nbytes
            else:
                self._static_bytes += chunk.nbytes

    def free_grad_chunks(self) -> None:
        """After the step every gradient is consumed; their chunks need no memory until the
        next backward writes them, and moving dead gradients would waste bandwidth."""
        for layout in self.layouts:
            chunk = layout.chunks.get(ChunkKind.GRAD)
            if chunk is not None:
                self._free_payload(chunk)

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

    def bind_layout(self, layout: ChunkLayout) -> None:
        """Rebind a layout's parameters after its slots were rewritten on the device."""
        chunk = layout.chunks[ChunkKind.PARAM]
        if chunk.tier is Tier.DEVICE:
            self._bind_arrived(chunk)

    def _bind_arrived(self, chunk: Chunk) -> None:
        for slot in chunk.layout.slots:
            if not slot.grad_in_param_slot and not slot.bound:
                self._bind(slot, chunk)

    # ------------------------------------------------------------------ residency
    def _ready(self, chunk: Chunk) -> None:
        """Wait for an async copy into the chunk's payload, if one is in flight."""
        if chunk.pending_event is not None:
            if chunk.tier is Tier.DEVICE:
                self.device.wait(chunk.pending_event)
            else:
                self.device.wait_host(chunk.pending_event)
            chunk.pending_event = None

    def _move(self, chunk: Chunk, dst: Tier, reason: str) -> None:
        src = chunk.tier
        if src is dst:
            return
        assert src is not None and chunk.payload is not None
        if not chunk.movable():
            raise AssertionError(f"{chunk!r} is in use and cannot move ({reason})")
        if dst is Tier.HOST:
            self._make_host_room(chunk.nbytes, protect={chunk.id})
        self.ledger.allocate(
            dst.value,
            chunk.kind.value,
            chunk.nbytes,
            f"moving {chunk!r} to {dst.value}",
            f"chunk {chunk.id}",
        )
        if chunk.kind is ChunkKind.PARAM and src is Tier.DEVICE:
            for slot in chunk.layout.slots:
                self._unbind(slot)
        if dst is Tier.DEVICE:
            self._ready(chunk)
            payload, event = self.device.to_device(chunk.payload)
        else:
            payload = self.device.host_empty(chunk.numel, chunk.dtype)
            event = self.device.to_host(chunk.payload, payload)
        self.ledger.free(src.value, chunk.kind.value, chunk.nbytes, f"chunk {chunk.id}")
        self._set_payload(chunk, payload, dst)
        chunk.pending_event = event
        self.ledger.record_move(
            chunk.id, chunk.kind.value, src.value, dst.value, chunk.nbytes, reason
        )
        if chunk.kind is ChunkKind.PARAM and dst is Tier.DEVICE:
            self._bind_arrived(chunk)

    def _make_host_room(self, nbytes: int, protect: set[int]) -> None:
        """A limited host is full: send host chunks needed soonest on the device up early."""
        if self.ledger.would_fit("host", nbytes):
            return
        on_host = [
            c
            for c in self.chunks.values()
            if c.tier is Tier.HOST
            and c.kind in DYNAMIC_KINDS
            and c.id not in protect
            and c.movable()
        ]
        if self.tracer.replaying:
            on_host.sort(key=lambda c: self.tracer.next_device_use(c.id))
        budget = self.placement.chunk_budget(self.tracer, self.static_device_bytes())
        used = self._resident_bytes
        for chunk in on_host:
            if self.ledger.would_fit("host", nbytes):
                return
            if used + chunk.nbytes <= budget and self.ledger.would_fit("device", chunk.nbytes):
                self._move(chunk, Tier.DEVICE, "host pressure")
                used += chunk.nbytes

    def _dynamic_on_device(self) -> list[Chunk]:
        return list(self._resident.values())

    def static_device_bytes(self) -> int:
        """Device bytes placement cannot move: optimizer states homed there, workspaces."""
        return self.ledger.device.workspace_bytes + self._static_bytes

    def _rank(self) -> object:
        return self.placement.rank(self.tracer, lambda c: self._last_access.get(c, -1))

    def _evict_for(self, nbytes: int, limit: int, protect: set[int], reason: str) -> None:
        """Evict movable dynamic chunks until ``nbytes`` more fit under ``limit`` and capacity."""
        used = self._resident_bytes
        if used + nbytes <= limit and self.ledger.would_fit("device", nbytes):
            return
        candidates = [
            c.id for c in self._dynamic_on_device() if c.id not in protect and c.movable()
        ]
        for victim_id in self._rank()(candidates):  # type: ignore[operator]
            if used + nbytes <= limit and self.ledger.would_fit("device", nbytes):
                return
            victim = self.chunks[victim_id]
            self._move(victim, Tier.HOST, reason)
            used -= victim.nbytes

    def _make_room(self, nbytes: int, protect: set[int], reason: str) -> None:
        budget = self.placement.chunk_budget(self.tracer, self.static_device_bytes())
        self._evict_for(nbytes, budget, protect, reason)
        if not self.ledger.would_fit("device", nbytes):
            raise OutOfMemoryError(
                "device",
                nbytes,
                max(0, self.ledger.device.available or 0),
                f"Nothing more can be evicted at moment {self.ledger.moment_label!r}: "
                f"{self.ledger.describe('device')}. The chunks in use at one moment plus the "
                f"non-model memory exceed the device capacity; raise device.capacity, use a "
                f"smaller chunk.size, or lower the batch size / sequence length.",
            )

    def _fetch(self, chunk: Chunk, protect: set[int], reason: str) -> None:
        if chunk.tier is Tier.DEVICE:
            return
        self._make_room(chunk.nbytes, protect, reason)
        if chunk.tier is None:
            self._allocate_payload(chunk, Tier.DEVICE)
        else:
            self._move(chunk, Tier.DEVICE, reason)

    def _touch(self, chunk: Chunk, tier: Tier = Tier.DEVICE) -> None:
        self._tick += 1
        self._last_access[chunk.id] = self._tick
        self.tracer.on_access(chunk.id, tier)

    def ensure_on_device(self, chunks: Sequence[Chunk]) -> None:
        """Bring ``chunks`` to the device, evicting by the placement plan."""
        if all(chunk.tier is Tier.DEVICE for chunk in chunks):
            for chunk in chunks:
                self._ready(chunk)
                self._touch(chunk)
            return
        protect = {c.id for c in chunks}
        budget = self.placement.chunk_budget(self.tracer, self.static_device_bytes())
        resident = {c.id for c in self._dynamic_on_device()}
        plan = plan_moment(
            resident,
            {c.id: Tier.DEVICE for c in chunks},
            lambda cid: self.chunks[cid].nbytes,
            budget,
            lambda cid: self.chunks[cid].movable(),
            self._rank(),  # type: ignore[arg-type]
        )
        for chunk_id in plan.to_host:
            self._move(self.chunks[chunk_id], Tier.HOST, "evict")
        for chunk_id in plan.to_device:
            self._fetch(self.chunks[chunk_id], protect, "fetch")
        for chunk in chunks:
            self._ready(chunk)
            self._touch(chunk)

    # ------------------------------------------------------------------ moments
    def enter_moment(self, moment: Moment) -> None:
        """A module's pre-forward / pre-backward or a step: sample, then let go of pins."""
        self._release_transient_pins()
        chunk_bytes = self.ledger.device.model_bytes
        nonmodel = self.device.meter.current(chunk_bytes)
        index = self.tracer.on_moment(moment, nonmodel)
        self.ledger.set_nonmodel(nonmodel)
        self.ledger.sample_moment(index, moment.name)
        self.device.meter.reset_peak(chunk_bytes)

    def after_access(self) -> None:
        """Once a moment's chunks are in: keep within the budget, then prefetch."""
        all_resident = len(self._resident) == self._dynamic_with_payload
        lowest = self.placement.lowest_budget(self.tracer, self.static_device_bytes())
        if all_resident and lowest is not None and self._resident_bytes <= lowest:
            return  # everything is in and fits at every moment of the trace
        budget = self.placement.chunk_budget(self.tracer, self.static_device_bytes())
        self._evict_for(0, budget, protect=set(), reason="evict")
        if all_resident:
            return
        for ahead, chunk_id in self.placement.prefetch_targets(self.tracer):
            chunk = self.chunks.get(chunk_id)
            if chunk is None or chunk.tier is Tier.DEVICE or chunk.tier is None:
                continue
            window_budget = self.placement.chunk_budget(
                self.tracer, self.static_device_bytes(), moments_ahead=ahead
            )
            if self._resident_bytes + chunk.nbytes > window_budget or not self.ledger.would_fit(
                "device", chunk.nbytes
            ):
                break
            self._move(chunk, Tier.DEVICE, "prefetch")

    def account_nonmodel(self) -> int:
        """Record the device's current non-model bytes in the ledger and the trace."""
        nonmodel = self.device.meter.current(self.ledger.device.model_bytes)
        self.ledger.set_nonmodel(nonmodel)
        self.tracer.on_nonmodel(nonmodel)
        return nonmodel

    def on_nonmodel_growth(self) -> None:
        """Non-model bytes grew: account them and evict chunks if the device is over capacity."""
        nonmodel = self.account_nonmodel()
        overflow = self.ledger.overflow("device")
        if not overflow:
            return
        resident = [c.id for c in self._dynamic_on_device() if c.movable()]
        for victim_id in self._rank()(resident):  # type: ignore[operator]
            self._move(self.chunks[victim_id], Tier.HOST, "pressure")
            if not self.ledger.overflow("device"):
                return
        raise OutOfMemoryError(
            "device",
            self.ledger.device.used,
            self.ledger.device.capacity or 0,
            f"Non-model memory ({nonmodel:,} bytes: activations saved for backward and "
            f"gradients in flight) at moment {self.ledger.moment_label!r} does not fit beside "
            f"the chunks in use ({self.ledger.describe('device')}). Raise device.capacity, "
            f"lower the batch size or sequence length, use activation checkpointing, or a "
            f"smaller chunk.size.",
        )

    # ------------------------------------------------------------------ access / release
    def _slot_for_access(self, param: torch.nn.Parameter) -> TensorSlot:
        slot = self.slots.get(id(param))
        if slot is None:
            slot = self._pack(param, Tier.DEVICE)
        if slot.grad_in_param_slot:
            self._repair_grad_slot(slot)
        return slot

    @staticmethod
    def param_chunk(slot: TensorSlot) -> Chunk:
        return slot.layout.chunks[ChunkKind.PARAM]

    def access(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Put ``params`` in COMPUTE with their chunks on the device and ``.data`` bound."""
        slots = []
        for param in params:
            slot = self.slots.get(id(param))
            if slot is None or slot.grad_in_param_slot:
                slot = self._slot_for_access(param)
            slots.append(slot)
        chunks = list(dict.fromkeys(slot.layout.chunks[ChunkKind.PARAM] for slot in slots))
        self.ensure_on_device(chunks)
        for slot in slots:
            slot.users += 1
            if slot.state is not TensorState.COMPUTE:
                slot.set_state(TensorState.COMPUTE)
            if not slot.bound:
                self._bind(slot, self.param_chunk(slot))

    def release(self, params: Sequence[torch.nn.Parameter], state: TensorState) -> None:
        """One user of each of ``params`` is done; the last one moves it to ``state``."""
        for param in params:
            slot = self.slots[id(param)]
            if slot.users == 0:
                continue
            slot.users -= 1
            if slot.users == 0:
                slot.set_state(state)

    def release_all(self, state: TensorState) -> None:
        """End of a phase: whatever is still in COMPUTE goes to ``state``."""
        self._release_transient_pins()
        for slot in self.slots.values():
            if slot.state is TensorState.COMPUTE:
                slot.users = 0
                slot.set_state(state)

    def reset_states(self) -> None:
        """End of a cycle (or an aborted one): every packed tensor back to HOLD."""
        self._release_transient_pins()
        for slot in self.slots.values():
            slot.users = 0
            if slot.state is not TensorState.HOLD:
                if slot.state is TensorState.COMPUTE:
                    slot.set_state(TensorState.HOLD_AFTER_BWD)
                slot.set_state(TensorState.HOLD)

    def materialize(self, param: torch.nn.Parameter) -> None:
        """On-demand access outside module hooks; pinned until the next moment."""
        slot = self._slot_for_access(param)
        chunk = self.param_chunk(slot)
        self.ensure_on_device([chunk])
        chunk.pins += 1
        self._transient_pins.append(chunk)

    def _release_transient_pins(self) -> None:
        for chunk in self._transient_pins:
            chunk.pins -= 1
        self._transient_pins.clear()

    # ------------------------------------------------------------------ saved tensors
    def token_for(self, tensor: torch.Tensor) -> ParamToken | None:
        """A token if ``tensor`` aliases a parameter chunk on the device, else None."""
        if tensor.layout is not torch.strided or tensor.device != self.device.torch_device:
            return None
        chunk = self._device_storage.get(tensor.untyped_storage().data_ptr())
        if chunk is None:
            return None
        return ParamToken(chunk, tensor.storage_offset(), tensor.shape, tensor.stride())

    def unpack(self, token: ParamToken) -> torch.Tensor:
        chunk = token.chunk
        offsets = self._slot_offsets[chunk.layout.index]
        slot = chunk.layout.slots[bisect.bisect_right(offsets, token.storage_offset) - 1]
        if slot.grad_in_param_slot:
            self._repair_grad_slot(slot)
        if chunk.tier is not Tier.DEVICE:
            self.ensure_on_device([chunk])
        self._ready(chunk)
        chunk.pins += 1
        self._transient_pins.append(chunk)
        assert chunk.payload is not None
        return chunk.payload.as_strided(token.size, token.stride, token.storage_offset)

    # ------------------------------------------------------------------ gradients
    def _grad_home(self, slot: TensorSlot) -> Chunk:
        layout = slot.layout
        chunks = layout.chunks
        if self.grads_in_param_slot and not slot.needs_grad_chunk:
            return chunks[ChunkKind.PARAM]
        if ChunkKind.GRAD not in chunks:
            self._new_chunk(layout, ChunkKind.GRAD, self.compute_dtype, Tier.DEVICE)
        return chunks[ChunkKind.GRAD]

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
        meter = self.device.meter
        nbytes = grad.nelement() * grad.element_size()
        meter.add(nbytes)
        try:
            self.on_nonmodel_growth()
            home = self._grad_home(slot)
            if home.tier is Tier.DEVICE and home.pending_event is None:
                self._touch(home)
            else:
                self.ensure_on_device([home])
            view = home.view(slot)
            if slot.grad_contributions:
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
            self.account_nonmodel()

    def _repair_grad_slot(self, slot: TensorSlot) -> None:
        """The value of a parameter whose slot holds its gradient is needed: separate them."""
        chunks = slot.layout.chunks
        param_chunk = chunks[ChunkKind.PARAM]
        master = chunks[ChunkKind.MASTER]
        slot.needs_grad_chunk = True
        grad_chunk = self._grad_home(slot)
        self.ensure_on_device([param_chunk, grad_chunk])
        self._ready(master)
        grad_chunk.view(slot).copy_(param_chunk.view(slot))
        param_chunk.view(slot).copy_(master.view(slot))
        slot.grad_in_param_slot = False
        self._bind(slot, param_chunk)
        self.repaired_grad_slots.append(slot.name)

    def grad_view(self, slot: TensorSlot) -> torch.Tensor:
        """Where ``slot``'s gradient is now (device or host)."""
        chunks = slot.layout.chunks
        home = chunks[ChunkKind.PARAM] if slot.grad_in_param_slot else chunks[ChunkKind.GRAD]
        self._ready(home)
        return home.view(slot)

    def grad_views(self, slots: list[TensorSlot]) -> list[torch.Tensor]:
        """``grad_view`` of each slot of one layout, without a call per slot when they agree."""
        in_param_slot = [slot.grad_in_param_slot for slot in slots]
        if all(in_param_slot) or not any(in_param_slot):
            chunks = slots[0].layout.chunks
            home = chunks[ChunkKind.PARAM] if in_param_slot[0] else chunks[ChunkKind.GRAD]
            self._ready(home)
            return home.views(slots)
        return [self.grad_view(slot) for slot in slots]

    def discard_grads(self) -> None:
        """Drop this cycle's gradients; slots that held one get their value from the master."""
        for slot in self.slots.values():
            if not slot.grad_in_param_slot:
                continue
            chunks = slot.layout.chunks
            param_chunk, master = chunks[ChunkKind.PARAM], chunks[ChunkKind.MASTER]
            self._ready(param_chunk)
            self._ready(master)
            param_chunk.view(slot).copy_(master.view(slot))
            if param_chunk.tier is not master.tier:
                self.ledger.record_move(
                    master.id,
                    master.kind.value,
                    master.tier.value,
                    param_chunk.tier.value,
                    slot.numel * master.dtype.itemsize,
                    "restore",
                )
            slot.grad_in_param_slot = False
            if param_chunk.tier is Tier.DEVICE:
                self._bind(slot, param_chunk)
        self.clear_grads()

    def clear_grads(self) -> None:
        for slot in self.slots.values():
            slot.grad_contributions = 0
            slot.grad_in_param_slot = False

    # ------------------------------------------------------------------ optimizer states
    def trainable_layouts(self) -> list[ChunkLayout]:
        return [layout for layout in self.layouts if layout.trainable]

    def place_optimizer_states(self, peak_nonmodel: int) -> None:
        """Choose each trainable layout's optimizer-state home and allocate its chunks."""
        layouts = self.trainable_layouts()
        per_element = 8 + (4 if self.keep_fp32_master else 0)
        dynamic = sum(c.nbytes for c in self.chunks.values() if c.kind in DYNAMIC_KINDS)
        on_device = optimizer_state_device_groups(
            self.placement.capacity,
            peak_nonmodel,
            dynamic,
            [layout.capacity * per_element for layout in layouts],
            self.optimizer_states_mode,
        )
        self.optimizer_homes = {}
        for position, layout in enumerate(layouts):
            home = Tier.DEVICE if position < on_device else Tier.HOST
            self.optimizer_homes[layout.index] = home
            chunks = layout.chunks
            if ChunkKind.MASTER in chunks and home is Tier.DEVICE:
                self._make_room(chunks[ChunkKind.MASTER].nbytes, set(), "optimizer home")
                self._move(chunks[ChunkKind.MASTER], Tier.DEVICE, "optimizer home")
            for kind in (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ):
                self._new_optimizer_chunk(layout, kind, home)

    def _new_optimizer_chunk(self, layout: ChunkLayout, kind: ChunkKind, home: Tier) -> None:
        if home is Tier.DEVICE:
            size = layout.capacity * torch.float32.itemsize
            self._make_room(size, set(), "optimizer home")
        self._new_chunk(layout, kind, torch.float32, home)

    def step_chunks(self, layout: ChunkLayout) -> dict[ChunkKind, Chunk]:
        """Prepare a layout's chunks for its update at the optimizer home, and pin them all.

        A device home needs the parameter and gradient chunks on the device. A host home with
        fp32 masters leaves them where they are: gradients stream to the host and updated
        16-bit values stream back (:meth:`transfer`), so a chunk on the device stays there for
        the next forward. fp32 training has no master: its parameter chunk is what the host
        updates, so it and the gradients come to the host.
        """
        assert self.optimizer_homes is not None
        home = self.optimizer_homes[layout.index]
        chunks = layout.chunks
        dynamic = [chunks[k] for k in DYNAMIC_KINDS if k in chunks]
        if home is Tier.DEVICE:
            for chunk in dynamic:
                self._touch(chunk, home)
            self.ensure_on_device(dynamic)
        elif ChunkKind.MASTER not in chunks:
            for chunk in dynamic:
                self._touch(chunk, home)
                self._move(chunk, Tier.HOST, "step")
        for chunk in chunks.values():
            self._ready(chunk)
            chunk.pins += 1
        return chunks

    def transfer(self, chunk: Chunk, src: Tier, dst: Tier, nbytes: int, reason: str) -> None:
        """Account part of ``chunk`` copied between tiers without moving the chunk (the step's
        streamed gradients and values)."""
        if src is dst:
            return
        self.ledger.record_move(chunk.id, chunk.kind.value, src.value, dst.value, nbytes, reason)
        self.tracer.on_stream(nbytes, dst)

    def unpin(self, chunks: Iterable[Chunk]) -> None:
        for chunk in chunks:
            chunk.pins -= 1

    def allocate_workspace(
        self, numel: int, dtype: torch.dtype, tier: Tier, protect: set[int]
    ) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if tier is Tier.DEVICE:
            self._make_room(nbytes, protect, "workspace")
            self.ledger.allocate("device", WORKSPACE, nbytes, "a step workspace", WORKSPACE)
            return self.device.empty(numel, dtype)
        self._make_host_room(nbytes, protect)
        self.ledger.allocate("host", WORKSPACE, nbytes, "a step workspace", WORKSPACE)
        return self.device.host_empty(numel, dtype)

    def free_workspace(self, buffer: torch.Tensor, tier: Tier) -> None:
        self.ledger.free(tier.value, WORKSPACE, buffer.numel() * buffer.element_size(), WORKSPACE)

    # ------------------------------------------------------------------ reading values
    def values(self, slot: TensorSlot, prefer_master: bool = True) -> torch.Tensor:
        """A CPU copy of a parameter's current value (fp32 master when there is one)."""
        chunks = slot.layout.chunks
        source = chunks.get(ChunkKind.MASTER) if prefer_master else None
        if source is None:
            source = chunks[ChunkKind.PARAM]
            if slot.grad_in_param_slot:
                raise RuntimeError(
                    f"{slot.name!r} holds its gradient until the optimizer step; read values "
                    f"between steps"
                )
        self._ready(source)
        return source.view(slot).detach().to("cpu", copy=True)

    def states_hold(self) -> bool:
        return all(slot.state in HOLD_STATES for slot in self.slots.values())
