"""Binding ``param.data`` to its view in a device chunk, and unbinding it when the chunk goes.

A parameter whose compute chunk is not on the device has an empty placeholder as ``.data``,
so an access the engine did not arrange fails loudly (a shape error) instead of reading stale
or freed memory. The binder is the residency's listener: it hears every compute chunk that
arrives on or leaves the device.
"""

from __future__ import annotations

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot


class ParamBinder:
    """Keeps every parameter's ``.data`` equal to its device view, or a placeholder."""

    def __init__(self, compute_kind: ChunkKind, compute_dtype: torch.dtype, device: torch.device):
        self.compute_kind = compute_kind
        self.compute_dtype = compute_dtype
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=device)

    def bind(self, slot: TensorSlot, chunk: Chunk) -> None:
        slot.param.data = chunk.view(slot)
        slot.bound = True

    def unbind(self, slot: TensorSlot) -> None:
        slot.param.data = self._placeholder
        slot.bound = False

    def chunk_arrived(self, chunk: Chunk) -> None:
        """Bind the parameters that compute on ``chunk`` (not those whose slot holds a
        gradient: their value is the master's, restored before any use)."""
        if chunk.kind is self.compute_kind:
            for slot in chunk.layout.slots:
                if not slot.grad_in_param_slot and not slot.bound:
                    self.bind(slot, chunk)

    def chunk_leaving(self, chunk: Chunk) -> None:
        if chunk.kind is self.compute_kind:
            for slot in chunk.layout.slots:
                self.unbind(slot)

    def bind_layout(self, layout: ChunkLayout) -> None:
        """Rebind a layout's parameters after its slots were rewritten on the device."""
        chunk = layout.chunks.get(self.compute_kind)
        if chunk is not None and chunk.on_device:
            self.chunk_arrived(chunk)
