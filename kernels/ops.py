"""The public quantization ops: check arguments, pick a backend, run it.

[Note: backend selection] Tensors on a CUDA device run on the CUDA library, tensors on the CPU
on the native CPU library; each library is built (or found in the build cache) on first use.
When a library cannot be had (no compiler, a failed build, no GPU driver) the ops run the torch
reference instead and warn once per process with the reason. `CHUNKMEM_KERNELS_BACKEND=reference`
forces the reference without a warning; the `backend=` argument of every op forces one backend
and raises, instead of falling back, when it is unavailable. All backends compute identical bits.

[Note: out=] Every op takes `out=`, a buffer the caller owns (a tensor, or a QuantizedTensor for
a quantized result), and writes the result there instead of allocating it: ZeRO++ dequantizes
straight into a reused chunk buffer, and a fresh output per call costs first-touch page faults
that can exceed the kernel's own time (docs/benchmarks.md). `out` must match the result exactly
(numel, dtype, layout, device), be contiguous and not overlap the inputs; the op returns `out`.
The native libraries allocate nothing on this path (the CPU library keeps only per-thread
scratch of one group for the sums of a fused reduction); the reference computes as usual and
copies the result into `out`.
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
    check_no_overlap,
    check_out_dtype,
    check_out_quantized,
    check_out_tensor,
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


def _parts(name: str, q: QuantizedTensor) -> dict[str, torch.Tensor | None]:
    return {f"{name}.data": q.data, f"{name}.scales": q.scales, f"{name}.offsets": q.offsets}


def _inputs_of(inputs: list[QuantizedTensor]) -> dict[str, torch.Tensor | None]:
    return {k: t for i, q in enumerate(inputs) for k, t in _parts(f"inputs[{i}]", q).items()}


def _copy_quantized(result: QuantizedTensor, out: QuantizedTensor) -> QuantizedTensor:
    for dst, src in zip(_parts("", out).values(), _parts("", result).values(), strict=True):
        if dst is not None:
            dst.copy_(src)
    return out


def quantize(
    x: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    symmetric: bool,
    backend: Backend | None = None,
    out: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """Quantize the elements of contiguous `x` (read flat) in groups of `group_size`, into
    `out` if given (a QuantizedTensor of the result's layout and x's dtype)."""
    check_float_tensor("x", x)
    check_format(bits, group_size)
    if out is not None:
        check_out_quantized(
            out,
            numel=x.numel(),
            bits=bits,
            group_size=group_size,
            symmetric=bool(symmetric),
            dtype=x.dtype,
            device=x.device,
        )
        check_no_overlap(_parts("out", out), {"x": x})
    kernels = _kernels_for(x.device, backend)
    if kernels is None:
        result = reference.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric)
        return result if out is None else _copy_quantized(result, out)
    return kernels.quantize(x, bits, group_size, bool(symmetric), out)


def dequantize(
    q: QuantizedTensor,
    *,
    out_dtype: torch.dtype | None = None,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The values `q` encodes, as a flat tensor of `out_dtype` (default: out's dtype if `out`
    is given, else q.dtype), written into `out` if given."""
    if out_dtype is None and out is None:
        out_dtype = q.dtype
    return dequant_reduce([q], out_dtype=out_dtype, backend=backend, out=out)


def swizzled_quantize(
    x: torch.Tensor,
    *,
    nodes: int,
    devices_per_node: int,
    bits: int,
    group_size: int,
    symmetric: bool,
    backend: Backend | None = None,
    out: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """Quantize x for the hierarchical reduce-scatter of qgZ (docs/kernels.md, "Swizzle").

    x is zero-padded to nodes * devices_per_node slices of `slice_numel(x.numel(), world,
    group_size)` elements (slice j for rank j = node * devices_per_node + local) and the slices
    are stored in the order (local, node), so an intra-node all_to_all_single with equal splits
    hands local rank l the slices of ranks l, devices_per_node + l, ... (one per node). `out`,
    if given, is a QuantizedTensor of the padded layout and x's dtype.
    """
    check_float_tensor("x", x)
    check_format(bits, group_size)
    for name, value in (("nodes", nodes), ("devices_per_node", devices_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    s = slice_numel(x.numel(), nodes * devices_per_node, group_size)
    if out is not None:
        check_out_quantized(
            out,
            numel=nodes * devices_per_node * s,
            bits=bits,
            group_size=group_size,
            symmetric=bool(symmetric),
            dtype=x.dtype,
            device=x.device,
        )
        check_no_overlap(_parts("out", out), {"x": x})
    kernels = _kernels_for(x.device, backend)
    if kernels is None:
        result = reference.swizzled_quantize(
            x,
            nodes=nodes,
            devices_per_node=devices_per_node,
            bits=bits,
            group_size=group_size,
            symmetric=symmetric,
        )
        return result if out is None else _copy_quantized(result, out)
    return kernels.swizzled_quantize(
        x, nodes, devices_per_node, s, bits, group_size, bool(symmetric), out
    )


def dequant_reduce_requant(
    inputs: list[QuantizedTensor],
    *,
    backend: Backend | None = None,
    out: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """Dequantize inputs of one layout, sum them in fp32 in list order, and quantize the sum in
    the same layout (the intra-node step of qgZ), into `out` if given."""
    check_same_layout("dequant_reduce_requant", inputs)
    first = inputs[0]
    if out is not None:
        check_out_quantized(
            out,
            numel=first.numel,
            bits=first.bits,
            group_size=first.group_size,
            symmetric=first.symmetric,
            dtype=first.dtype,
            device=first.device,
        )
        check_no_overlap(_parts("out", out), _inputs_of(inputs))
    kernels = _kernels_for(first.device, backend)
    if kernels is None:
        result = reference.dequant_reduce_requant(inputs)
        return result if out is None else _copy_quantized(result, out)
    return kernels.dequant_reduce_requant(list(inputs), out)


def dequant_reduce(
    inputs: list[QuantizedTensor],
    *,
    out_dtype: torch.dtype | None = None,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize inputs of one layout and sum them in fp32 in list order, as `out_dtype`
    (default: out's dtype if `out` is given, else fp32), written into `out` if given (the
    last step of qgZ)."""
    check_same_layout("dequant_reduce", inputs)
    first = inputs[0]
    if out_dtype is not None:
        check_out_dtype(out_dtype)
    if out is None:
        out_dtype = out_dtype or torch.float32
    else:
        out_dtype = check_out_tensor(
            out, numel=first.numel, out_dtype=out_dtype, device=first.device
        )
        check_no_overlap({"out": out}, _inputs_of(inputs))
    kernels = _kernels_for(first.device, backend)
    if kernels is None:
        result = reference.dequant_reduce(inputs, out_dtype=out_dtype)
        return result if out is None else out.copy_(result.view(out.shape))
    return kernels.dequant_reduce(list(inputs), out_dtype, out)
