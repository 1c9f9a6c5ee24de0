"""Tensors autograd saves for backward: parameter views as tokens, the rest counted.

A saved tensor that aliases a parameter chunk on the device is stored as a token (chunk,
offset, size, stride) and rebuilt from the chunk on unpack: holding the tensor would keep
evicted device memory alive and make every eviction a lie. Every other saved tensor is
counted once per storage as non-model memory while it lives; this is the simulated device's
measurement (CUDA uses the allocator's numbers).
"""

from __future__ import annotations

import itertools
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
    """Holds the tensors saved for backward, counted once per storage while they live.

    [Note: saved tensors are held here, not in the graph] The object autograd keeps for a
    saved tensor is a small key; the tensor itself lives in this registry. If the graph held
    the tensor, a saved *output* would close a cycle (graph node -> saved tensor -> its
    ``grad_fn`` -> the node) through autograd's C++ objects, which Python's collector cannot
    see: a forward whose loss is dropped, or that raises, would keep its activations alive and
    counted forever. Here backward frees each entry as it consumes it, and :meth:`release_all`
    (after a failed or discarded forward) drops whatever is left, which frees the graph too.
    """

    def __init__(self, meter: NonModelMeter, residency: Residency) -> None:
        self._meter = meter
        self._residency = residency
        # data_ptr of a storage -> [references, nbytes, the tensors saved on it by key]
        self._storages: dict[int, list] = {}
        self._tensors: dict[int, torch.Tensor] = {}
        self._keys = itertools.count()

    def hold(self, tensor: torch.Tensor) -> _SavedActivation:
        storage = tensor.untyped_storage()
        # An operator's output the meter counts already while it lives: held, not recounted.
        nbytes = 0 if self._meter.counts(tensor) else storage.nbytes()
        storage_key = storage.data_ptr()
        key = next(self._keys)
        self._tensors[key] = tensor
        entry = self._storages.get(storage_key)
        if entry is not None:
            entry[0] += 1
            return _SavedActivation(key, storage_key, self)
        self._storages[storage_key] = [1, nbytes]
        self._meter.add(nbytes)
        # Built before the capacity check: if that raises, the holder's __del__ undoes the count.
        holder = _SavedActivation(key, storage_key, self)
        self._residency.room.on_nonmodel_growth()
        return holder

    def tensor(self, key: int) -> torch.Tensor:
        tensor = self._tensors.get(key)
        if tensor is None:
            raise RuntimeError(
                "a tensor saved for backward was released with its forward (engine.discard(), "
                "or an aborted cycle); run a new forward before calling backward"
            )
        return tensor

    def drop(self, key: int, storage_key: int) -> None:
        if self._tensors.pop(key, None) is None:
            return  # released with its forward already
        entry = self._storages[storage_key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[storage_key]
            self._meter.remove(entry[1])
            self._residency.nonmodel.account()  # never raises: it runs while graphs are freed

    @property
    def held_bytes(self) -> int:
        return sum(entry[1] for entry in self._storages.values())

    def release_all(self) -> None:
        """Drop every saved tensor still held (their graph will never run backward)."""
        tensors, self._tensors = self._tensors, {}
        for entry in self._storages.values():
            self._meter.remove(entry[1])
        self._storages.clear()
        self._residency.nonmodel.account()
        del tensors  # the graphs they closed cycles with go now


class _SavedActivation:
    __slots__ = ("_key", "_storage_key", "_counter")

    def __init__(self, key: int, storage_key: int, counter: ActivationCounter) -> None:
        self._key = key
        self._storage_key = storage_key
        self._counter = counter

    @property
    def tensor(self) -> torch.Tensor:
        return self._counter.tensor(self._key)

    def __del__(self) -> None:
        self._counter.drop(self._key, self._storage_key)


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
