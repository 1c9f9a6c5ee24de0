"""ctypes bindings of the native kernel libraries (CPU and CUDA share one C ABI) and the loader
of the CPU library.

Both libraries export, with prefix `cmq_cpu_` or `cmq_cuda_`, the functions below; the CUDA ones
take a trailing `void* stream` and return an error whose text `cmq_cuda_last_error()` gives.
Every function returns 0 on success (codes in quant_math.h, `Status`).

    quantize(x, dtype, numel, bits, group_size, symmetric, q, scales, offsets)
    swizzled_quantize(x, dtype, numel, nodes, devices_per_node, slice_numel, bits, group_size,
                      symmetric, q, scales, offsets)
    dequant_reduce(q[], scales[], offsets[], count, numel, bits, group_size, symmetric,
                   out, out_dtype)
    dequant_reduce_requant(q[], scales[], offsets[], count, numel, bits, group_size, symmetric,
                           q_out, scales_out, offsets_out)
    onebit_compress(x, numel, block, codes, scales, residual)
    ternary_compress(x, numel, block, seed, codes, scales)
    decompress_sum(codes[], scales[], count, numel, block, ternary, out, out_dtype)
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from kernels._build import CSRC, BuildError, build, find_tool
from kernels.quantized import QuantizedTensor, data_nbytes, num_groups

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_STATUS = {1: "invalid argument", 2: "out of memory", 3: "CUDA error"}

# [Note: CPU flags] -ffp-contract=off: no FMA contraction (a*b+c must round twice, like torch).
# No -ffast-math: keeps denormals (no FTZ/DAZ), NaN semantics and operation order.
# -fno-trapping-math only lets g++ if-convert (and so vectorise) the selects in loops; it changes no
# result. -march=native is why the CPU model is part of the cache key.
CPU_FLAGS = [
    "-std=c++17",
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-Wall",
]

_i32, _i64, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_ptrs = ctypes.POINTER(ctypes.c_void_p)
_SIGNATURES = {
    "quantize": [_ptr, _i32, _i64, _i32, _i64, _i32, _ptr, _ptr, _ptr],
    "swizzled_quantize": [_ptr, _i32, _i64, _i64, _i64, _i64, _i32, _i64, _i32, _ptr, _ptr, _ptr],
    "dequant_reduce": [_ptrs, _ptrs, _ptrs, _i32, _i64, _i32, _i64, _i32, _ptr, _i32],
    "dequant_reduce_requant": [_ptrs, _ptrs, _ptrs, _i32, _i64, _i32, _i64, _i32, _ptr, _ptr, _ptr],
    "onebit_compress": [_ptr, _i64, _i64, _ptr, _ptr, _ptr],
    "ternary_compress": [_ptr, _i64, _i64, _i64, _ptr, _ptr],
    "decompress_sum": [_ptrs, _ptrs, _i32, _i64, _i64, _i32, _ptr, _i32],
    "block_sq_norms": [_ptr, _i64, _i64, _ptr],
}


def _addr(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def _addr_array(tensors: list[torch.Tensor | None]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[_addr(t) for t in tensors])


class NativeKernels:
    """The kernels of one loaded library, called with tensors. Each writes into `out` when it
    is given (checked by kernels.ops) and into a fresh buffer otherwise.

    `extra_args` supplies trailing arguments per call (the CUDA stream); `device_guard` makes
    the tensors' device current around a call (a CUDA launch goes to the current device, and
    the stream must belong to it); `last_error` the text of the library's last error, if it
    keeps one.
    """

    def __init__(
        self,
        lib: ctypes.CDLL,
        prefix: str,
        path: Path,
        extra_args: Callable[[torch.device], tuple] = lambda device: (),
        extra_argtypes: tuple = (),
        device_guard: Callable[[torch.device], AbstractContextManager] = lambda device: (
            contextlib.nullcontext()
        ),
        last_error: Callable[[], str] = lambda: "",
    ) -> None:
        self.path = path
        self._extra_args = extra_args
        self._device_guard = device_guard
        self._last_error = last_error
        self._fns = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, prefix + name)
            fn.argtypes = [*argtypes, *extra_argtypes]
            fn.restype = ctypes.c_int
            self._fns[name] = fn

    def _call(self, name: str, device: torch.device, *args) -> None:
        with self._device_guard(device):
            status = self._fns[name](*args, *self._extra_args(device))
        if status != 0:
            detail = self._last_error()
            raise RuntimeError(
                f"{self.path.name}: {name} failed with status {status} "
                f"({_STATUS.get(status, 'unknown')}){': ' + detail if detail else ''}"
            )

    def _empty_quantized(
        self,
        numel: int,
        bits: int,
        group_size: int,
        symmetric: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> QuantizedTensor:
        groups = num_groups(numel, group_size)
        return QuantizedTensor(
            data=torch.empty(data_nbytes(numel, bits), dtype=torch.uint8, device=device),
            scales=torch.empty(groups, dtype=torch.float32, device=device),
            offsets=None if symmetric else torch.empty(groups, dtype=torch.float32, device=device),
            numel=numel,
            bits=bits,
            group_size=group_size,
            symmetric=symmetric,
            dtype=dtype,
        )

    def quantize(
        self,
        x: torch.Tensor,
        bits: int,
        group_size: int,
        symmetric: bool,
        out: QuantizedTensor | None = None,
    ) -> QuantizedTensor:
        if out is None:
            out = self._empty_quantized(x.numel(), bits, group_size, symmetric, x.dtype, x.device)
        self._call(
            "quantize",
            x.device,
            _addr(x),
            DTYPE_CODES[x.dtype],
            x.numel(),
            bits,
            group_size,
            int(symmetric),
            _addr(out.data),
            _addr(out.scales),
            _addr(out.offsets),
        )
        return out

    def swizzled_quantize(
        self,
        x: torch.Tensor,
        nodes: int,
        devices_per_node: int,
        slice_numel: int,
        bits: int,
        group_size: int,
        symmetric: bool,
        out: QuantizedTensor | None = None,
    ) -> QuantizedTensor:
        if out is None:
            numel = nodes * devices_per_node * slice_numel
            out = self._empty_quantized(numel, bits, group_size, symmetric, x.dtype, x.device)
        self._call(
            "swizzled_quantize",
            x.device,
            _addr(x),
            DTYPE_CODES[x.dtype],
            x.numel(),
            nodes,
            devices_per_node,
            slice_numel,
            bits,
            group_size,
            int(symmetric),
            _addr(out.data),
            _addr(out.scales),
            _addr(out.offsets),
        )
        return out

    def _input_arrays(self, inputs: list[QuantizedTensor]) -> tuple:
        return (
            _addr_array([q.data for q in inputs]),
            _addr_array([q.scales for q in inputs]),
            _addr_array([q.offsets for q in inputs]),
            len(inputs),
        )

    def dequant_reduce(
        self,
        inputs: list[QuantizedTensor],
        out_dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        first = inputs[0]
        if out is None:
            out = torch.empty(first.numel, dtype=out_dtype, device=first.device)
        self._call(
            "dequant_reduce",
            first.device,
            *self._input_arrays(inputs),
            first.numel,
            first.bits,
            first.group_size,
            int(first.symmetric),
            _addr(out),
            DTYPE_CODES[out_dtype],
        )
        return out

    def dequant_reduce_requant(
        self, inputs: list[QuantizedTensor], out: QuantizedTensor | None = None
    ) -> QuantizedTensor:
        first = inputs[0]
        if out is None:
            out = self._empty_quantized(
                first.numel,
                first.bits,
                first.group_size,
                first.symmetric,
                first.dtype,
                first.device,
            )
        self._call(
            "dequant_reduce_requant",
            first.device,
            *self._input_arrays(inputs),
            first.numel,
            first.bits,
            first.group_size,
            int(first.symmetric),
            _addr(out.data),
            _addr(out.scales),
            _addr(out.offsets),
        )
        return out

    def onebit_compress(
        self,
        x: torch.Tensor,
        block: int,
        codes: torch.Tensor,
        scales: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> None:
        self._call(
            "onebit_compress",
            x.device,
            _addr(x),
            x.numel(),
            block,
            _addr(codes),
            _addr(scales),
            _addr(residual),
        )

    def ternary_compress(
        self, x: torch.Tensor, block: int, seed: int, codes: torch.Tensor, scales: torch.Tensor
    ) -> None:
        self._call(
            "ternary_compress",
            x.device,
            _addr(x),
            x.numel(),
            block,
            seed,
            _addr(codes),
            _addr(scales),
        )

    def block_sq_norms(self, x: torch.Tensor, block: int, norms: torch.Tensor) -> None:
        self._call("block_sq_norms", x.device, _addr(x), x.numel(), block, _addr(norms))

    def decompress_sum(
        self,
        codes: Sequence[torch.Tensor],
        scales: Sequence[torch.Tensor],
        block: int,
        ternary: bool,
        out: torch.Tensor,
    ) -> None:
        self._call(
            "decompress_sum",
            out.device,
            _addr_array(list(codes)),
            _addr_array(list(scales)),
            len(codes),
            out.numel(),
            block,
            int(ternary),
            _addr(out),
            DTYPE_CODES[out.dtype],
        )


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep))


def load_cpu(extra_flags: Sequence[str] = ()) -> NativeKernels:
    """Build (on a cache miss) and load the CPU library; BuildError says why it cannot.

    `extra_flags` follow CPU_FLAGS; the tests pass `-mno-avx2` to build the scalar-only library
    that CPUs without AVX2 get (quant_avx2.h).
    """
    lib, path = build_and_load_cpu(
        "chunkmem_quant_cpu", "quant_cpu.cpp", [*CPU_FLAGS, *extra_flags]
    )
    return NativeKernels(lib, "cmq_cpu_", path)


def build_and_load_cpu(name: str, source: str, flags: Sequence[str]) -> tuple[ctypes.CDLL, Path]:
    """lib<name>.so from CSRC/``source``, compiled with $CXX (g++) and ``flags`` for this CPU on a
    cache miss, loaded; BuildError says why it cannot be."""
    compiler = find_tool("CXX", "g++")
    path = build(name, compiler, CSRC / source, list(flags), _cpu_identity())
    try:
        return ctypes.CDLL(str(path)), path
    except OSError as e:
        raise BuildError(f"cannot load {path}: {e}") from e
