"""Operators' outputs counted while they live: the simulated device's view of temporaries.

[Note: temporaries on the simulated device] CUDA's allocator sees every tensor an operator
makes; the saved-tensor and gradient hooks see only what autograd keeps and the gradients
being stored. The rest lives between those samples: a layer's output before the next layer
saves it, the logits' gradient, each operator's output in backward, a recomputed block's
intermediates. Measured against torch's CPU allocator on GPT 8x256 with checkpointing at
batch 16, the hooks alone missed 16% of the peak.

So :class:`OutputCounting`, a dispatch mode the engine enters around each forward and
backward, counts every storage an operator creates there (an output that shares no storage
with its inputs: views, in-place operators and copies into a chunk make none) from the
moment it exists to the moment it dies, once per storage, through a finalizer on the
storage. Storages the engine makes for the ledger's own accounts (chunk payloads,
workspaces) are made in :func:`uncounted` blocks, as the CUDA meter subtracts them from the
allocator's figure; so are a collective transport's own buffers. The meta-device trace of ``chunkmem estimate`` counts with the same
mode, so the estimate and the run agree on what non-model memory is.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveStorages:
    """Bytes of the storages handed to :meth:`track`, each counted once until it dies.

    ``on_change(delta)`` hears every change, from the thread that made or freed the storage.
    """

    def __init__(self, on_change: Callable[[int], None]) -> None:
        self._on_change = on_change
        self._live: dict[int, int] = {}  # storage identity -> nbytes

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        return storage._cdata in self._live

    @property
    def live_bytes(self) -> int:
        return sum(self._live.values())

    def track(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        if nbytes == 0 or key in self._live:
            return
        self._live[key] = nbytes
        finalizer = weakref.finalize(storage, self._died, key)
        finalizer.atexit = False
        self._on_change(nbytes)

    def _died(self, key: int) -> None:
        nbytes = self._live.pop(key, 0)
        if nbytes:
            self._on_change(-nbytes)


class _Uncounted(threading.local):
    depth = 0


_UNCOUNTED = _Uncounted()


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Storages made in the block, on this thread, are not temporaries: the caller accounts
    for them (a chunk payload, a workspace: the ledger's) or they are a transport's own
    buffers (a gloo ring's receive segment, the in-process world's copies), which CUDA's
    allocator does not see either (NCCL allocates its buffers apart)."""
    _UNCOUNTED.depth += 1
    try:
        yield
    finally:
        _UNCOUNTED.depth -= 1


class OutputCounting(TorchDispatchMode):
    """Tracks, in ``storages``, each storage an operator creates while the mode is on, outside
    :func:`uncounted` blocks."""

    def __init__(self, storages: LiveStorages) -> None:
        super().__init__()
        self.storages = storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if _UNCOUNTED.depth or _returns_aliases(func):
            return out
        if isinstance(out, torch.Tensor):
            self._track(out)
        else:
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.layout is torch.strided:
            self.storages.track(tensor.untyped_storage())


_ALIASING: dict[Any, bool] = {}


def _returns_aliases(func: Any) -> bool:
    """Whether the operator returns views of its inputs or writes into them (its schema says
    so): its outputs are storages that exist already. Every other operator's are new."""
    aliasing = _ALIASING.get(func)
    if aliasing is None:
        aliasing = any(r.alias_info is not None for r in func._schema.returns)
        _ALIASING[func] = aliasing
    return aliasing
