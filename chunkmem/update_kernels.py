"""Which kernels a host update runs: the native host optimizer where its library builds,
torch's otherwise, and the gradient norms measured the same way by the step and by an early
update."""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from kernels import host_optim
from kernels._build import BuildError

_log = logging.getLogger("chunkmem")


@functools.cache
def native_host_optimizer() -> ModuleType | None:
    """:mod:`kernels.host_optim` once its library is built and loaded, else None: the reason
    is logged once, and host updates run torch's fused kernel."""
    try:
        host_optim.load_library()
    except BuildError as error:
        _log.warning(
            "the native host optimizer cannot be used (%s): optimizer states on the host are "
            "updated with torch's fused kernel, and bf16/fp16 steps there take three passes "
            "over memory instead of one",
            error,
        )
        return None
    return host_optim


def fp32_norms(tensors: list[torch.Tensor], host_threads: int | None) -> list[torch.Tensor]:
    """The fp32 L2 norm of each gradient, on the CPU: the native kernel's where they are 16-bit
    host tensors of one dtype (torch's bf16 norm runs at a third of memory speed), torch's
    otherwise (fp32 keeps ``clip_grad_norm_``'s bits; a device; no library). Both the step and
    an early update measure with this, so they get the same bits."""
    if not tensors:
        return []
    # One copy (and wait) for a device's, not one a tensor.
    return list(stacked_fp32_norms(tensors, host_threads).cpu().unbind())


def stacked_fp32_norms(tensors: list[torch.Tensor], host_threads: int | None) -> torch.Tensor:
    """:func:`fp32_norms`' values, the same bits, in one fp32 tensor where ``tensors`` lie: a
    device's are not waited for (an early update copies them down with its gradients)."""
    kernels = native_host_optimizer()
    if kernels is not None and measured_natively(tensors):
        out = torch.empty(len(tensors), dtype=torch.float32)
        kernels.norms(tensors, host_threads, out=out)
        return out
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))


def measured_natively(tensors: list[torch.Tensor]) -> bool:
    """Whether :func:`fp32_norms` measures ``tensors`` with the native kernel where its library
    is built (16-bit host tensors of one dtype): then the native update reading them can
    measure them in its own pass (``grad_norms``), with the same bits."""
    return (
        bool(tensors)
        and tensors[0].dtype in (torch.bfloat16, torch.float16)
        and all(t.is_cpu and t.dtype == tensors[0].dtype for t in tensors)
    )
