"""Loader of the CUDA library (kernels/csrc/quant_cuda.cu).

The library is built with nvcc on first use, for the current device's architecture, into the
build cache (kernels/_build.py), or taken ready-made from $CHUNKMEM_KERNELS_CUDA_LIB. Before it
is used, its CUDA major version must equal torch's and it must hold code for the device;
otherwise BuildError says which and what to do.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from kernels._build import CSRC, BuildError, build, find_tool
from kernels._native import NativeKernels

CUDA_LIB_ENV = "CHUNKMEM_KERNELS_CUDA_LIB"

# [Note: nvcc flags] The same bits as the CPU library and the reference: no FMA contraction,
# denormals kept, IEEE division; -ffp-contract=off for the host side of the same header.
NVCC_FLAGS = [
    "--std=c++17",
    "-O3",
    "-shared",
    "-Xcompiler",
    "-fPIC",
    "-Xcompiler",
    "-ffp-contract=off",
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
]


def _nvcc() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return find_tool("NVCC", "nvcc")


def check_library(lib: ctypes.CDLL, path: Path, torch_cuda: str | None) -> None:
    """BuildError unless `lib` is a chunkmem CUDA library for torch's CUDA major version that
    can run on the current device."""
    try:
        version = lib.cmq_cuda_runtime_version()
        probe, last_error = lib.cmq_cuda_probe, lib.cmq_cuda_last_error
    except AttributeError as e:
        raise BuildError(f"{path} is not a chunkmem CUDA kernel library ({e})") from e
    built = f"{version // 1000}.{version % 1000 // 10}"
    if torch_cuda is None:
        raise BuildError(f"torch {torch.__version__} is a CPU build; {path} needs CUDA {built}")
    if int(torch_cuda.split(".")[0]) != version // 1000:
        raise BuildError(
            f"{path} was built for CUDA {built} but torch uses CUDA {torch_cuda}; rebuild it with "
            f"an nvcc of CUDA {torch_cuda.split('.')[0]}.x (unset {CUDA_LIB_ENV} to build into the cache)"
        )
    last_error.restype = ctypes.c_char_p
    if probe() != 0:
        raise BuildError(
            f"{path} cannot run on this device: {last_error().decode()} (it is built for one "
            f"architecture; unset {CUDA_LIB_ENV} to build for this device)"
        )


def load_cuda() -> NativeKernels:
    """Build (on a cache miss), check and load the CUDA library; BuildError says why it cannot."""
    if not torch.cuda.is_available():
        raise BuildError(f"torch {torch.__version__} sees no CUDA device")
    explicit = os.environ.get(CUDA_LIB_ENV)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise BuildError(f"{CUDA_LIB_ENV}={explicit} names no file")
    else:
        major, minor = torch.cuda.get_device_capability()
        arch = f"-arch=sm_{major}{minor}"
        path = build("chunkmem_quant_cuda", _nvcc(), CSRC / "quant_cuda.cu", [*NVCC_FLAGS, arch])
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise BuildError(f"cannot load {path}: {e}") from e
    check_library(lib, path, torch.version.cuda)
    return NativeKernels(
        lib,
        "cmq_cuda_",
        path,
        extra_args=lambda device: (torch.cuda.current_stream(device).cuda_stream,),
        extra_argtypes=(ctypes.c_void_p,),
        device_guard=torch.cuda.device,
        last_error=lambda: lib.cmq_cuda_last_error().decode(),
    )
