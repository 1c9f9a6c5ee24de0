"""Which parameter lives where: registration, first-use packing, each layout's chunks.

Parameters are packed lazily, in the order they are first accessed, so packing order is
execution order without a separate tracing pass. Across ranks (ZeRO) every rank must pack
alike, and a first forward may take another path on each (a branch its data decides): there
a parameter's first use packs, in registration order, every parameter registered before it
that is not packed yet, so every rank packs in registration order whatever its forward
touches. A new layout gets its parameter chunk (this
rank's span of it), a compute chunk when that is another kind (a ZeRO-3 gathered copy), and an
fp32 master chunk for the span whose optimizer states this rank holds.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Iterable

import torch

from chunkmem.binding import ParamBinder
from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot
from chunkmem.packing import Packer
from chunkmem.residency import Residency
from chunkmem.sharding import Sharding
from chunkmem.sizing import ChunkSizes
from chunkmem.states import HOLD_STATES, TensorState
from chunkmem.tiers import StorageTier


class ParamStore:
    """The registry of parameters, their slots and layouts; packs on first use."""

    def __init__(
        self,
        residency: Residency,
        binder: ParamBinder,
        sharding: Sharding,
        compute_dtype: torch.dtype,
        chunk_sizes: ChunkSizes,
        keep_fp32_master: bool,
        master_tier: StorageTier,
    ) -> None:
        self.residency = residency
        self.binder = binder
        self.sharding = sharding
        self.compute_dtype = compute_dtype
        self.compute_kind = binder.compute_kind
        self.chunk_sizes = chunk_sizes
        self.keep_fp32_master = keep_fp32_master
        self.master_tier = master_tier  # where masters start, until the step homes them
        # Keyed by id(param): a Parameter's __hash__ is a Python call, and these are hot.
        self.slots: dict[int, TensorSlot] = {}
        # Registered, not packed, in registration order. Ordered so that taking the earliest
        # costs O(1) however many were taken before it (a plain dict's first key is found
        # by skipping every entry deleted ahead of it).
        self.pending: OrderedDict[int, tuple[str, torch.nn.Parameter]] = OrderedDict()
        self.layouts: list[ChunkLayout] = []
        layout_ids = itertools.count()
        self._packers = {
            trainable: Packer(
                chunk_sizes.size(trainable),
                trainable,
                lambda: next(layout_ids),
                sharding.world_size,
            )
            for trainable in (True, False)
        }
        self._slot_offsets: dict[int, list[int]] = {}
        # id(param) -> (dtype, device) it had before the engine took it over.
        self.original: dict[int, tuple[torch.dtype, torch.device]] = {}

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
            self.original[id(param)] = (param.dtype, param.device)

    @property
    def all_packed(self) -> bool:
        return not self.pending

    def is_managed(self, param: torch.Tensor) -> bool:
        return id(param) in self.slots or id(param) in self.pending

    def slot_of(self, param: torch.Tensor) -> TensorSlot | None:
        """The slot of a packed parameter (None if it is not packed or not managed)."""
        return self.slots.get(id(param))

    def name_of(self, param: torch.Tensor) -> str:
        slot = self.slots.get(id(param))
        if slot is not None:
            return slot.name
        pending = self.pending.get(id(param))
        return pending[0] if pending is not None else "<unmanaged>"

    def num_parameters(self) -> int:
        """Elements of every managed parameter, packed or not (tied ones once)."""
        packed = sum(slot.numel for slot in self.slots.values())
        return packed + sum(param.numel() for _name, param in self.pending.values())

    def trainable_layouts(self) -> list[ChunkLayout]:
        return [layout for layout in self.layouts if layout.trainable]

    def compute_chunk(self, slot: TensorSlot) -> Chunk:
        return slot.layout.chunks[self.compute_kind]

    def slot_at(self, chunk: Chunk, storage_offset: int) -> TensorSlot:
        """The slot of ``chunk``'s layout that element ``storage_offset`` belongs to."""
        offsets = self._slot_offsets[chunk.layout.index]
        return chunk.layout.slots[bisect.bisect_right(offsets, storage_offset) - 1]

    def states_hold(self) -> bool:
        return all(slot.state in HOLD_STATES for slot in self.slots.values())

    # ------------------------------------------------------------------ packing
    def pack_remaining(self, tier: StorageTier) -> None:
        """Pack parameters that no forward touched (in registration order)."""
        for _name, param in list(self.pending.values()):
            self.pack(param, tier)

    def pack(self, param: torch.nn.Parameter, tier: StorageTier) -> TensorSlot:
        """Give ``param`` its slot, copy its value into the chunks and bind it; across ranks,
        those registered before it first (see the module's docstring)."""
        if self.sharding.world_size > 1:
            while self.pending and next(iter(self.pending)) != id(param):
                _name, earlier = next(iter(self.pending.values()))
                self._pack_one(earlier, tier)
        return self._pack_one(param, tier)

    def _pack_one(self, param: torch.nn.Parameter, tier: StorageTier) -> TensorSlot:
        name, _param = self.pending.pop(id(param))
        original = param.detach()
        slot, layout, created = self._packers[param.requires_grad].place(name, param)
        self.slots[id(param)] = slot
        if created:
            self._create_layout_chunks(layout, tier)
        chunks = layout.chunks
        compute = chunks[self.compute_kind]
        residency = self.residency
        if compute.payload is None:  # a gathered copy dropped since the last slot was added
            residency.room.ensure_on_device([compute])
        residency.ready(compute)
        compute.view(slot).copy_(original)
        for kind in (ChunkKind.PARAM, ChunkKind.MASTER):
            if kind in chunks and chunks[kind] is not compute:
                self._copy_owned_part(chunks[kind], slot, original)
        self._slot_offsets.setdefault(layout.index, []).append(slot.offset)  # slots only grow
        slot.set_state(TensorState.HOLD)
        if compute.on_device:
            self.binder.bind(slot, compute)
        else:
            self.binder.unbind(slot)
        return slot

    def _create_layout_chunks(self, layout: ChunkLayout, tier: StorageTier) -> None:
        self.layouts.append(layout)
        residency = self.residency
        if self.compute_kind is not ChunkKind.PARAM:
            # All ranks hold the same original values, so the first compute copy is built
            # locally; the persistent parameter chunk is this rank's span.
            residency.new_chunk(layout, self.compute_kind, self.compute_dtype, residency.compute)
        param_span = self.sharding.param_span(layout)
        residency.new_chunk(layout, ChunkKind.PARAM, self.compute_dtype, tier, param_span)
        if layout.trainable and self.keep_fp32_master:
            span = self.sharding.state_span(layout)
            residency.new_chunk(layout, ChunkKind.MASTER, torch.float32, self.master_tier, span)

    def _copy_owned_part(self, chunk: Chunk, slot: TensorSlot, original: torch.Tensor) -> None:
        """Copy the part of ``original`` that falls in ``chunk``'s span."""
        lo = max(0, chunk.start - slot.offset)
        hi = min(slot.numel, chunk.start + chunk.numel - slot.offset)
        if lo < hi:
            self.residency.ready(chunk)
            chunk.span(slot, lo, hi).copy_(original.reshape(-1)[lo:hi])

    # ------------------------------------------------------------------ reading values
    def layout_values(self, layout: ChunkLayout) -> torch.Tensor:
        """The layout's current values as one CPU tensor (fp32 masters when there are any).

        Under ZeRO this gathers the shards: every rank must call it.
        """
        chunks = layout.chunks
        source = chunks.get(ChunkKind.MASTER) or chunks[ChunkKind.PARAM]
        values = self.residency.contents(source)
        if any(s.grad_in_param_slot for s in layout.slots) and source.kind is ChunkKind.PARAM:
            raise RuntimeError(
                "parameters hold their gradients until the optimizer step; read values between steps"
            )
        if source.is_whole:
            return values.to("cpu", copy=True)
        # The collective runs on the compute device (NCCL takes only GPU tensors).
        device = self.residency.device.torch_device
        payload = values.to(device)
        full = torch.empty(layout.capacity, dtype=source.dtype, device=device)
        self.sharding.all_gather(payload, full)
        return full.cpu()

    def parameter_values(self) -> dict[int, torch.Tensor]:
        """Each packed parameter's current value on the CPU (as :meth:`layout_values`), in its
        shape and keyed as ``slots``. The values are views of one tensor per layout, so a
        caller that keeps one copies it. Under ZeRO every rank must call it."""
        values = {layout.index: self.layout_values(layout) for layout in self.layouts}
        return {
            key: values[slot.layout.index][slot.offset : slot.offset + slot.numel].view(slot.shape)
            for key, slot in self.slots.items()
        }
