"""Tensors autograd saves for backward: parameter views as tokens, the rest counted.

A saved tensor that aliases a parameter chunk on the device is stored as a token (chunk,
offset, size, stride) and rebuilt from the chunk on unpack: holding the tensor would keep
evicted device memory alive and make every eviction a lie. Every other saved tensor is
counted once per storage as non-model memory while it lives; this is the simulated device's
measurement (CUDA uses the allocator's numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from chunkmem.chunk import Chunk
from chunkmem.devices import NonModelMeter
from chunkmem.manager import ChunkManager
from chunkmem.residency import Residency


@dataclass(frozen=True)
class ParamToken:
    """A saved-for-backward tensor that aliases a parameter chunk, stored as geometry only."""

    chunk: Chunk
    storage_offset: int
    size: torch.Size
    stride: tuple[int, ...]


class ActivationCounter:
    """Counts bytes of tensors saved for backward, once per storage, while they are alive."""

    def __init__(self, meter: NonModelMeter, residency: Residency) -> None:
        self._meter = meter
        self._residency = residency
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [references, nbytes]

    def hold(self, tensor: torch.Tensor) -> _SavedActivation:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        entry = self._storages.get(key)
        if entry is not None:
            entry[0] += 1
            return _SavedActivation(tensor, key, self)
        self._storages[key] = [1, nbytes]
        self._meter.add(nbytes)
        # Built before the capacity check: if that raises, the holder's __del__ undoes the count.
        holder = _SavedActivation(tensor, key, self)
        self._residency.on_nonmodel_growth()
        return holder

    def drop(self, key: int) -> None:
        entry = self._storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[key]
            self._meter.remove(entry[1])
            self._residency.account_nonmodel()  # never raises: it runs while graphs are freed


class _SavedActivation:
    __slots__ = ("tensor", "_key", "_counter")

    def __init__(self, tensor: torch.Tensor, key: int, counter: ActivationCounter) -> None:
        self.tensor = tensor
        self._key = key
        self._counter = counter

    def __del__(self) -> None:
        self._counter.drop(self._key)


def make_saved_tensor_hooks(manager: ChunkManager, counter: ActivationCounter, internal: Any):
    """The (pack, unpack) pair for ``torch.autograd.graph.saved_tensors_hooks``.

    ``internal`` is the context that marks chunkmem's own work (see ``chunkmem.hooks``).
    """
    residency = manager.residency
    compute_device = residency.device.torch_device
    compute_kind = manager.params.compute_kind

    def pack(tensor: torch.Tensor) -> Any:
        with internal:
            if tensor.device != compute_device or tensor.layout is not torch.strided:
                return tensor
            chunk = residency.chunk_of_storage(tensor)
            if chunk is not None and chunk.kind is compute_kind:
                return ParamToken(chunk, tensor.storage_offset(), tensor.shape, tensor.stride())
            if tensor.untyped_storage().nbytes() == 0:
                return tensor
            return counter.hold(tensor)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, ParamToken):
            with internal:
                payload = manager.unpack_view(packed.chunk, packed.storage_offset)
                return payload.as_strided(packed.size, packed.stride, packed.storage_offset)
        if isinstance(packed, _SavedActivation):
            return packed.tensor
        return packed

    return pack, unpack
