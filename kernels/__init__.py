"""Block-wise int8/int4 quantization kernels for qwZ and qgZ: pure functions on flat buffers.

One spec (docs/kernels.md), three implementations that agree bit for bit: the torch reference
(kernels.reference, the ground truth), a native CPU library and a CUDA library. This package is
the bottom layer of chunkmem and imports nothing else of it.
"""

from kernels.ops import (
    BACKEND_ENV,
    Backend,
    BackendChoice,
    backend_for,
    dequant_reduce,
    dequant_reduce_requant,
    dequantize,
    quantize,
    swizzled_quantize,
)
from kernels.quantized import QuantizedTensor, slice_numel

__all__ = [
    "BACKEND_ENV",
    "Backend",
    "BackendChoice",
    "QuantizedTensor",
    "backend_for",
    "dequant_reduce",
    "dequant_reduce_requant",
    "dequantize",
    "quantize",
    "slice_numel",
    "swizzled_quantize",
]
