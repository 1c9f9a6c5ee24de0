"""The public quantization ops: check arguments, pick a backend, run it.

[Note: backend selection] Tensors on a CUDA device run on the CUDA library, tensors on the CPU
on the native CPU library; each library is built (or found in the build cache) on first use.
When a library cannot be had (no compiler, a failed build, no GPU driver) the ops run the torch
reference instead and warn once per process with the reason. `CHUNKMEM_KERNELS_BACKEND=reference`
forces the reference without a warning; the `backend=` argument of every op forces one backend
and raises, instead of falling back, when it is unavailable. All backends compute identical bits.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from kernels import reference
from kernels._build import BuildError
from kernels._cuda import load_cuda
from kernels._native import NativeKernels, load_cpu
from kernels.quantized import (
    QuantizedTensor,
    check_float_tensor,
    check_format,
    check_out_dtype,
    check_same_layout,
    slice_numel,
)

Backend = Literal["reference", "cpu", "cuda"]
BACKEND_ENV = "CHUNKMEM_KERNELS_BACKEND"


@dataclass(frozen=True)
class BackendChoice:
    """The backend the ops use for a device and why (e.g. the library path, or the build error)."""

    name: Backend
    reason: str


_lock = threading.Lock()
_libraries: dict[str, NativeKernels | BuildError] = {}
_warned: set[str] = set()


def _library(kind: str) -> NativeKernels:
    """The loaded native library of `kind`; a failure is remembered and raised again."""
    with _lock:
        if kind not in _libraries:
            try:
                _libraries[kind] = load_cpu() if kind == "cpu" else load_cuda()
            except BuildError as e:
                _libraries[kind] = e
        lib = _libraries[kind]
    if isinstance(lib, BuildError):
        raise lib
    return lib


def _forced_reference() -> bool:
    value = os.environ.get(BACKEND_ENV, "auto")
    if value not in ("auto", "reference", ""):
        raise ValueError(f"{BACKEND_ENV}={value!r}; use 'reference' or 'auto' (or leave it unset)")
    return value == "reference"


def backend_for(device: torch.device | str = "cpu") -> BackendChoice:
    """Which backend the ops pick for tensors on `device`, and why. Builds the library on the
    first call, like the first op would."""
    device = torch.device(device)
    if _forced_reference():
        return BackendChoice("reference", f"{BACKEND_ENV}=reference")
    if device.type not in ("cpu", "cuda"):
        return BackendChoice("reference", f"no native library for device type {device.type!r}")
    try:
        lib = _library(device.type)
    except BuildError as e:
        return BackendChoice("reference", f"the native {device.type} library is unavailable: {e}")
    return BackendChoice(device.type, f"native library {lib.path}")


def _kernels_for(device: torch.device, backend: Backend | None) -> NativeKernels | None:
    """The native kernels to run on `device`, or None for the reference."""
    if backend is None:
        choice = backend_for(device)
        if choice.name != "reference":
            return _library(choice.name)
        if not _forced_reference() and device.type not in _warned:
            _warned.add(device.type)
            warnings.warn(
                f"chunkmem.kernels runs the slow torch reference for {device.type} tensors "
                f"because {choice.reason}. Set {BACKEND_ENV}=reference to choose it knowingly.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    if backend == "reference":
        return None
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"backend must be 'reference', 'cpu', 'cuda' or None, got {backend!r}")
    if device.type != backend:
        raise ValueError(
            f"backend={backend!r} cannot run tensors on {device}; move them or pass backend=None"
        )
    try:
        return _library(backend)
    except BuildError as e:
        raise RuntimeError(f"backend={backend!r} is unavailable: {e}") from e


def quantize(
    x: torch.Tensor, *, bits: int, group_size: int, symmetric: bool, backend: Backend | None = None
) -> QuantizedTensor:
    """Quantize the elements of contiguous `x` (read flat) in groups of `group_size`."""
    check_float_tensor("x", x)
    check_format(bits, group_size)
    kernels = _kernels_for(x.device, backend)
    if kernels is None:
        return reference.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric)
    return kernels.quantize(x, bits, group_size, bool(symmetric))


def dequantize(
    q: QuantizedTensor, *, out_dtype: torch.dtype | None = None, backend: Backend | None = None
) -> torch.Tensor:
    """The values `q` encodes, as a flat tensor of `out_dtype` (default: q.dtype)."""
    return dequant_reduce([q], out_dtype=out_dtype or q.dtype, backend=backend)


def swizzled_quantize(
    x: torch.Tensor,
    *,
    nodes: int,
    devices_per_node: int,
    bits: int,
    group_size: int,
    symmetric: bool,
    backend: Backend | None = None,
) -> QuantizedTensor:
    """Quantize x for the hierarchical reduce-scatter of qgZ (docs/kernels.md, "Swizzle").

    x is zero-padded to nodes * devices_per_node slices of `slice_numel(x.numel(), world,
    group_size)` elements (slice j for rank j = node * devices_per_node + local) and the slices
    are stored in the order (local, node), so an intra-node all_to_all_single with equal splits
    hands local rank l the slices of ranks l, devices_per_node + l, ... (one per node).
    """
    check_float_tensor("x", x)
    check_format(bits, group_size)
    for name, value in (("nodes", nodes), ("devices_per_node", devices_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    kernels = _kernels_for(x.device, backend)
    if kernels is None:
        return reference.swizzled_quantize(
            x,
            nodes=nodes,
            devices_per_node=devices_per_node,
            bits=bits,
            group_size=group_size,
            symmetric=symmetric,
        )
    s = slice_numel(x.numel(), nodes * devices_per_node, group_size)
    return kernels.swizzled_quantize(
        x, nodes, devices_per_node, s, bits, group_size, bool(symmetric)
    )


def dequant_reduce_requant(
    inputs: list[QuantizedTensor], *, backend: Backend | None = None
) -> QuantizedTensor:
    """Dequantize inputs of one layout, sum them in fp32 in list order, and quantize the sum in
    the same layout (the intra-node step of qgZ)."""
    check_same_layout("dequant_reduce_requant", inputs)
    kernels = _kernels_for(inputs[0].device, backend)
    if kernels is None:
        return reference.dequant_reduce_requant(inputs)
    return kernels.dequant_reduce_requant(list(inputs))


def dequant_reduce(
    inputs: list[QuantizedTensor],
    *,
    out_dtype: torch.dtype = torch.float32,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Dequantize inputs of one layout and sum them in fp32 in list order, as `out_dtype`
    (the last step of qgZ)."""
    check_same_layout("dequant_reduce", inputs)
    check_out_dtype(out_dtype)
    kernels = _kernels_for(inputs[0].device, backend)
    if kernels is None:
        return reference.dequant_reduce(inputs, out_dtype=out_dtype)
    return kernels.dequant_reduce(list(inputs), out_dtype)
