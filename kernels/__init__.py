"""Native kernels on flat buffers, the bottom layer of chunkmem (it imports nothing else of it).

- Block-wise int8/int4 quantization for qwZ and qgZ: one spec (docs/kernels.md), three
  implementations that agree bit for bit: the torch reference (kernels.reference, the ground
  truth), a native CPU library and a CUDA library.
- `kernels.host_optim`: Adam/AdamW and SGD steps on host buffers, bit-identical to torch's fused
  CPU kernels, with a one-pass mixed-precision step (docs/host_optim.md).
- `kernels.checksum`: CRC32C of host buffers with the SSE4.2 instruction, the NVMe tier's block
  checksum (docs/offload.md).
"""

from kernels import host_optim
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
    "host_optim",
    "quantize",
    "slice_numel",
    "swizzled_quantize",
]
