"""How the compute device's non-model bytes are measured: the hooks' counts, the simulated
device's operator outputs, or the CUDA allocator's figure less the ledger's bytes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

from chunkmem.temporaries import LiveStorages, OutputCounting


class NonModelMeter:
    """Current and peak non-model bytes on the device since the last ``reset_peak``.

    The hooks report every saved activation and in-flight gradient with ``add``/``remove``;
    the simulated device uses those counts as its measurement. ``accounted_bytes`` is what the
    ledger holds on the device (chunks and workspaces); a meter that measures all device
    memory subtracts it.
    """

    # Whether ``peak`` sees bytes that came and went between the hooks' samples (an
    # operator's output); the hooks' own counts are sampled as they change.
    measures_between_samples = False

    def __init__(self) -> None:
        self._counted = 0
        self._peak = 0

    def add(self, nbytes: int) -> None:
        self._counted += nbytes
        self._peak = max(self._peak, self._counted)

    def remove(self, nbytes: int) -> None:
        self._counted -= nbytes

    def current(self, accounted_bytes: int) -> int:
        return self._counted

    def peak(self, accounted_bytes: int) -> int:
        return self._peak

    def reset_peak(self, accounted_bytes: int) -> None:
        self._peak = self.current(accounted_bytes)

    def counts(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is counted already (so a hook must not add its bytes)."""
        return False

    def counting(self) -> AbstractContextManager[None]:
        """The region where operators run whose outputs this meter counts itself."""
        return contextlib.nullcontext()


class CudaAllocatorMeter(NonModelMeter):
    """Non-model bytes = bytes the CUDA caching allocator has allocated minus the ledger's
    chunks and workspaces (which the allocator holds too: counting them as non-model memory
    as well would count them twice).

    The engine asks at every saved tensor and gradient (about a thousand times a step on a
    12-layer GPT), so a read goes straight to the allocator's nested statistics for a device
    index resolved once: ``torch.cuda.memory_allocated`` flattens and sorts every statistic
    on each call, and even ``memory_stats_as_nested_dict`` spends half its time resolving the
    device. ``reset_peak`` resets the peaks of ``torch.cuda.max_memory_allocated`` too: the
    allocator keeps one peak per device.
    """

    measures_between_samples = True

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._device = device
        torch.cuda.init()  # the statistics below read an initialized allocator
        self._index = torch.cuda._utils._get_device_index(device, optional=True)

    def _allocated(self) -> dict[str, int]:
        return torch._C._cuda_memoryStats(self._index)["allocated_bytes"]["all"]

    def current(self, accounted_bytes: int) -> int:
        return max(0, self._allocated()["current"] - accounted_bytes)

    def peak(self, accounted_bytes: int) -> int:
        return max(0, self._allocated()["peak"] - accounted_bytes)

    def reset_peak(self, accounted_bytes: int) -> None:
        torch.cuda.reset_peak_memory_stats(self._device)


class OperatorOutputMeter(NonModelMeter):
    """The simulated device's meter with temporaries counted: the hooks' counts plus every
    storage an operator creates in a forward or backward, while it lives (a tensor the hooks
    count that is such an output is counted once). See [Note: temporaries on the simulated
    device] in chunkmem/temporaries.py."""

    measures_between_samples = True

    def __init__(self) -> None:
        super().__init__()
        self._outputs = LiveStorages(self._changed)
        self._mode: OutputCounting | None = None

    def _changed(self, delta: int) -> None:
        if delta > 0:
            self.add(delta)
        else:
            self.remove(-delta)

    def counts(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage() in self._outputs

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        if self._mode is not None:  # a forward inside a counted region counts already
            yield
            return
        self._mode = OutputCounting(self._outputs)
        try:
            with self._mode:
                yield
        finally:
            self._mode = None
