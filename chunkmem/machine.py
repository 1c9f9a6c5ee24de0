"""What the machine has: host memory (psutil) and GPU memory and utilisation (NVML).

Read from the operating system and the NVIDIA driver, not from the engine: the defaults and
checks that use them (the host budget, the device capacity, ``chunkmem estimate``'s device
memory) and the numbers reports print beside the ledger's (the process's RSS, the GPU's used
memory) are measurements the engine does not make itself.

[Note: the default host budget] With ``host.capacity`` unset, chunks may use
``HOST_SHARE`` of the host memory available at initialize, divided among the ranks that share
the machine (``LOCAL_WORLD_SIZE``): past that the kernel would swap or kill the process, so
the ledger refuses first and names the bytes. A budget set above what is available is refused
before training starts: it could only be met by swapping.
"""

from __future__ import annotations

import functools
import os
import resource
import sys
from dataclasses import dataclass
from typing import Any

import psutil

# The share of available host memory the chunks of all ranks on one machine may use by
# default; the rest is the interpreter, torch, activations in host memory and the page cache.
HOST_SHARE = 0.8


def host_available_bytes() -> int:
    """Host memory available to new allocations without swapping (psutil's ``available``)."""
    return int(psutil.virtual_memory().available)


def ranks_on_this_machine() -> int:
    """How many ranks share this machine's memory (torchrun's ``LOCAL_WORLD_SIZE``, else 1)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return max(1, int(value)) if value.isdigit() else 1


def default_host_capacity() -> int:
    """This rank's share of the host memory available now (see the module note)."""
    return int(host_available_bytes() * HOST_SHARE) // ranks_on_this_machine()


def rss_bytes() -> int:
    """This process's resident set size now."""
    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """The highest resident set size this process has had: the kernel's high-water mark, or
    the current RSS where that is higher (the kernel folds per-thread counters in late)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    return max(int(peak_bytes), rss_bytes())


@dataclass(frozen=True)
class GpuMemory:
    """One GPU as the driver sees it (all processes on it, not only this one)."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    utilization_percent: int  # of the last sample period, as nvidia-smi shows it


@functools.cache
def _nvml() -> Any | None:
    """pynvml, initialized once per process (an init costs milliseconds; metrics ask every
    step); None without an NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU to report
        return None
    return pynvml


def gpu_memory(index: int = 0) -> GpuMemory | None:
    """GPU ``index`` from NVML, or None where there is no NVIDIA driver or no such GPU."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        utilization = nvml.nvmlDeviceGetUtilizationRates(handle)
        name = nvml.nvmlDeviceGetName(handle)
    except Exception:  # noqa: BLE001 - an index past the last GPU, a lost device
        return None
    return GpuMemory(
        index=index,
        name=name.decode() if isinstance(name, bytes) else str(name),
        total_bytes=int(memory.total),
        free_bytes=int(memory.free),
        used_bytes=int(memory.used),
        utilization_percent=int(utilization.gpu),
    )
