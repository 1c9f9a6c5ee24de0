"""The compute device a chunk manager places chunks on: real CUDA or a simulated pool.

Both expose the same few mechanisms (allocate, copy in and out, wait, measure non-model
memory), so placement, eviction, prefetch and tracing run the same code on either.

[Note: simulated device] On machines without a GPU the "device" is host memory with a
capacity enforced by the ledger. Its non-model memory cannot be read from an allocator, so it
is the bytes of tensors autograd saves for backward plus gradients in flight, counted exactly
by the saved-tensor and gradient hooks, and with ``device.count_temporaries`` every operator
output of a forward and backward while it lives (chunkmem/temporaries.py); on CUDA the
allocator's own statistics include them.
"""

from __future__ import annotations

import abc
import threading
import warnings

import torch

from chunkmem.errors import CapacityError
from chunkmem.meters import CudaAllocatorMeter, NonModelMeter, OperatorOutputMeter
from chunkmem.temporaries import uncounted


class DeferredCopy:
    """A copy between two tensors in host memory left to whoever first waits for it, on any
    thread: the simulated device's stand-in for a copy engine's event.

    [Note: copies a reader runs] A GPU copies a chunk to the host on its copy engine while
    the host goes on; the simulated device's copies are ``copy_`` calls, work for the thread
    that issues them. Where the one reading the copy is another thread (an early host update,
    offload/overlap.py) the copy is its work: the engine's thread goes on with backward and
    the update's thread copies (without the GIL) before it reads, as it would wait for the
    copy engine's event on a GPU. Until then the source is held (chunkmem/drains.py), as a
    draining device payload is."""

    def __init__(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        self._destination = destination
        self._source: torch.Tensor | None = source
        self._lock = threading.Lock()

    def wait(self) -> None:
        with self._lock:
            if self._source is not None:
                self._destination.copy_(self._source)
                self._source = None  # the source may be freed once its drain is reaped

    def is_completed(self) -> bool:
        return self._source is None


class ComputeDevice(abc.ABC):
    """Allocation and copies for the tier operators run on."""

    kind: str
    torch_device: torch.device
    meter: NonModelMeter

    @abc.abstractmethod
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A device buffer (accounting is the caller's job, through the ledger)."""

    @abc.abstractmethod
    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer that device copies can use (pinned on CUDA)."""

    @abc.abstractmethod
    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """Start copying ``host`` to a new device buffer; returns it and an event to wait on."""

    @abc.abstractmethod
    def to_host(self, device_tensor: torch.Tensor, host: torch.Tensor) -> object | None:
        """Start copying ``device_tensor`` into ``host``; returns an event to wait on. The
        caller keeps ``device_tensor`` until the event completed (chunkmem/drains.py): its
        memory must not be reused while the copy still reads it."""

    def release(self, buffer: torch.Tensor) -> None:
        """``buffer`` (from ``empty`` or ``host_empty``) is no longer needed. CUDA's caching
        allocator reuses freed blocks by itself; the simulated device keeps them (below)."""
        return None

    @abc.abstractmethod
    def wait(self, event: object | None) -> None:
        """Make the compute stream wait for ``event`` (device side)."""

    @abc.abstractmethod
    def wait_host(self, event: object | None) -> None:
        """Block the host until ``event`` completed (before reading a host buffer)."""

    @abc.abstractmethod
    def completed(self, event: object | None) -> bool:
        """Whether ``event`` has completed, without blocking."""


class SimulatedDevice(ComputeDevice):
    """A capacity-limited pool in host memory; copies are synchronous, except those a caller
    leaves to its reader (:class:`DeferredCopy`).

    [Note: reusing buffers] Chunks come and go every step (gradients after the step, gathered
    copies after each phase); allocating each afresh from malloc pays page faults on every
    megabyte, which made ZeRO-2/3 steps ~40% slower here. A GPU's caching allocator reuses
    freed blocks; so does this device, keeping up to two released buffers per (size, dtype)
    that nothing else references any more (the storage's use count says so).
    """

    kind = "simulated"
    _KEEP_PER_SIZE = 2

    def __init__(self, count_temporaries: bool = False) -> None:
        self.torch_device = torch.device("cpu")
        self.meter = OperatorOutputMeter() if count_temporaries else NonModelMeter()
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        cached = self._free.get((numel, dtype))
        if cached:
            return cached.pop()
        with uncounted():
            return torch.empty(numel, dtype=dtype)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(numel, dtype)

    def release(self, buffer: torch.Tensor) -> None:
        if not _only_reference(buffer):
            return  # a view still reads it: let it go with its last user
        cached = self._free.setdefault((buffer.numel(), buffer.dtype), [])
        if len(cached) < self._KEEP_PER_SIZE:
            cached.append(buffer)

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        with uncounted():
            return host.clone(), None

    def to_host(self, device_tensor: torch.Tensor, host: torch.Tensor) -> object | None:
        host.copy_(device_tensor)
        return None

    def wait(self, event: object | None) -> None:
        return None

    def wait_host(self, event: object | None) -> None:
        if event is not None:
            event.wait()  # type: ignore[attr-defined] - a DeferredCopy

    def completed(self, event: object | None) -> bool:
        return event is None or event.is_completed()  # type: ignore[attr-defined]


class CudaDevice(ComputeDevice):
    """A CUDA device: pinned host buffers, copies on a side stream ordered by events."""

    kind = "cuda"

    def __init__(self, index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise CapacityError(
                "device.type is 'cuda' but torch sees no CUDA device; use device.type "
                "'simulated' (with device.capacity) on machines without a GPU"
            )
        if index is not None:
            torch.cuda.set_device(index)
        self.torch_device = torch.device("cuda", torch.cuda.current_device())
        self.copy_stream = torch.cuda.Stream(self.torch_device)
        self.meter = CudaAllocatorMeter(self.torch_device)
        _create_blas_workspaces(self.torch_device)

    def free_bytes(self) -> int:
        free, _total = torch.cuda.mem_get_info(self.torch_device)
        return free

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:  # pinned memory exhausted: pageable still works, slower
            warnings.warn(
                f"pinned host allocation failed ({exc}); using pageable memory", stacklevel=2
            )
            return torch.empty(numel, dtype=dtype)

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        # [Note: one pool for chunk memory] The buffer is allocated on the compute stream, like
        # every other chunk payload (``empty``). The caching allocator keeps a pool per stream
        # and never hands a block freed by one stream's allocation to another's: buffers
        # allocated on the copy stream would strand the memory of evicted chunks where new
        # gradient and gathered chunks (compute stream) cannot reuse it, growing the reserved
        # memory beyond the capacity. The copy stream waits for the compute stream first,
        # since the block may have been freed by compute work that is still queued.
        compute = torch.cuda.current_stream(self.torch_device)
        buffer = torch.empty(host.numel(), dtype=host.dtype, device=self.torch_device)
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            buffer.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        # Should the buffer be freed before the compute stream waited for the event, its block
        # must not be reused while the copy stream still writes it.
        buffer.record_stream(self.copy_stream)
        return buffer, event

    def to_host(self, device_tensor: torch.Tensor, host: torch.Tensor) -> object | None:
        compute = torch.cuda.current_stream(self.torch_device)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_stream(compute)
            host.copy_(device_tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        # No record_stream: with it the allocator would keep the block, counted as allocated,
        # until it next notices the event, so the meter would read the chunk's bytes as
        # non-model memory and the ledger could not say when they are free. The caller holds
        # device_tensor until the event completed instead (chunkmem/drains.py).
        return event

    def wait(self, event: object | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.torch_device).wait_event(event)  # type: ignore[arg-type]

    def wait_host(self, event: object | None) -> None:
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]

    def completed(self, event: object | None) -> bool:
        return event is None or bool(event.query())  # type: ignore[attr-defined]


def _create_blas_workspaces(device: torch.device) -> None:
    """Have torch create its cuBLAS and cuBLASLt workspaces now, before the engine's first
    sample of non-model memory.

    torch allocates them from the caching allocator at the first matrix product on a stream
    (32 MiB each on Hopper) and keeps them for the process. Made inside the first forward,
    64 MiB of non-model memory appeared between two samples of the recording iteration, where
    nothing had made room for it: make gpu-check on an H200 measured the device 24 MB over its
    capacity in that iteration. Made here, the first moment already counts them. A forward and
    backward of a small linear layer per training dtype reach every path (the backward runs on
    autograd's thread)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        weight = torch.ones(64, 64, dtype=dtype, device=device, requires_grad=True)
        bias = torch.zeros(64, dtype=dtype, device=device, requires_grad=True)
        inputs = torch.ones(64, 64, dtype=dtype, device=device, requires_grad=True)
        torch.nn.functional.linear(inputs, weight, bias).sum().backward()


def _only_reference(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is the only tensor on its storage (so reusing it is safe)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or buffer._base is not None:
        return False
    # One reference from ``buffer`` and one from the temporary storage object.
    return use_count(buffer.untyped_storage()._cdata) == 2


def make_device(
    kind: str, capacity: int | None, local_rank: int | None = None, count_temporaries: bool = False
) -> tuple[ComputeDevice, int]:
    """Build the configured device and resolve its capacity in bytes.

    ``local_rank`` picks the GPU of a data-parallel process (torchrun's LOCAL_RANK);
    ``count_temporaries`` gives the simulated device the meter of operators' outputs.
    """
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "simulated"
    if kind == "simulated":
        if capacity is None:
            raise CapacityError(
                "the simulated device needs a capacity: set device.capacity in the config "
                '(e.g. "512MiB"); it is the budget chunks and activations must fit in'
            )
        return SimulatedDevice(count_temporaries), capacity
    device = CudaDevice(local_rank)
    free = device.free_bytes()
    if capacity is None:
        capacity = int(free * 0.9)
    elif capacity > free:
        raise CapacityError(
            f"device.capacity is {capacity:,} bytes but {device.torch_device} has {free:,} "
            f"bytes free (other processes, or tensors this one made before initialize, hold "
            f"the rest); lower device.capacity, or leave it unset for 90% of the free memory"
        )
    return device, capacity
