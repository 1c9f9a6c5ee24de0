"""The quantization spec as readable torch code: the ground truth the CPU and CUDA libraries
must match bit for bit (docs/kernels.md states the same spec in prose).

Every step is one fp32 tensor operation, rounded to nearest-even, in the order written here:

Group statistics (a group is `group_size` consecutive elements; the last may be short):
    a NaN or +-Inf anywhere in a group makes the group non-finite (below).
Symmetric, b bits, qmax = 2^(b-1) - 1 (127 or 7):
    scale = max(absmax / qmax, 2^-126); inv = 1 / scale
    level = rne(x * inv) (provably in [-qmax, qmax]); value = level * scale
Asymmetric, b bits, L = 2^b - 1 (255 or 15):
    step = max((max - min) / L, 2^-126); offset = min + 0; inv = 1 / step
    level = rne((x - offset) * inv) (provably in [0, L]); value = level * step + offset
    (a step that overflows to Inf makes the group non-finite; `+ 0` turns -0 into +0)
Non-finite group: scale (and offset) = NaN, every level 0, so every value dequantizes to NaN.
Reduction: acc = value(inputs[0]); acc = acc + value(inputs[k]) for k = 1, 2, ... in order.

[Note: torch pitfalls] torch may compute `tensor / python_scalar` as a multiplication by the
reciprocal (always on CUDA), which rounds differently; this file divides by a tensor. `a * b + c`
stays two rounded operations in eager mode. `torch.round` rounds half to even.
"""

from __future__ import annotations

import torch

from kernels.quantized import QuantizedTensor, num_groups, slice_numel

MIN_STEP = 2.0**-126


def _divide(a: torch.Tensor, divisor: int) -> torch.Tensor:
    """a / divisor, correctly rounded (see the note on torch pitfalls above)."""
    return a / torch.full_like(a, float(divisor))


def _encode(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 levels -> bytes: int8 as one (two's complement) byte, int4 as nibble pairs."""
    if bits == 8:
        return levels.to(torch.int8).view(torch.uint8)
    nibbles = levels & 0xF
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    return (nibbles[0::2] | (nibbles[1::2] << 4)).to(torch.uint8)


def _decode(data: torch.Tensor, numel: int, bits: int, symmetric: bool) -> torch.Tensor:
    """Bytes -> int32 levels."""
    if bits == 8:
        return (data.view(torch.int8) if symmetric else data).to(torch.int32)
    fields = data.to(torch.int32)
    nibbles = torch.stack([fields & 0xF, fields >> 4], dim=1).flatten()[:numel]
    return (nibbles ^ 8) - 8 if symmetric else nibbles


def quantize_fp32(
    x: torch.Tensor, *, bits: int, group_size: int, symmetric: bool, dtype: torch.dtype
) -> QuantizedTensor:
    """Quantize a flat fp32 tensor; `dtype` is recorded as the values' original dtype."""
    n, device = x.numel(), x.device
    groups = num_groups(n, group_size)
    if n == 0:
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return QuantizedTensor(
            torch.empty(0, dtype=torch.uint8, device=device),
            empty,
            None if symmetric else empty.clone(),
            0,
            bits,
            group_size,
            symmetric,
            dtype,
        )
    # Pad the short last group with copies of its last element: no statistic changes.
    pad = groups * group_size - n
    xg = torch.cat([x, x[-1:].expand(pad)]).view(groups, group_size)
    finite = torch.isfinite(xg).all(dim=1)
    if symmetric:
        scale = _divide(xg.abs().amax(dim=1), 2 ** (bits - 1) - 1).clamp_min(MIN_STEP)
        offset = torch.zeros_like(scale)
        t = xg * torch.reciprocal(scale)[:, None]
    else:
        lo, hi = xg.amin(dim=1), xg.amax(dim=1)
        step = _divide(hi - lo, 2**bits - 1)
        finite &= torch.isfinite(step)
        scale = step.clamp_min(MIN_STEP)
        offset = lo + 0.0
        t = (xg - offset[:, None]) * torch.reciprocal(scale)[:, None]
    levels = t.round()
    levels = torch.where(finite[:, None], levels, torch.zeros_like(levels))
    nan = torch.full_like(scale, float("nan"))
    return QuantizedTensor(
        data=_encode(levels.flatten()[:n].to(torch.int32), bits),
        scales=torch.where(finite, scale, nan),
        offsets=None if symmetric else torch.where(finite, offset, nan),
        numel=n,
        bits=bits,
        group_size=group_size,
        symmetric=symmetric,
        dtype=dtype,
    )


def dequantize_fp32(q: QuantizedTensor) -> torch.Tensor:
    """The fp32 values a QuantizedTensor encodes."""
    if q.numel == 0:
        return torch.empty(0, dtype=torch.float32, device=q.device)
    levels = _decode(q.data, q.numel, q.bits, q.symmetric).to(torch.float32)
    pad = q.num_groups * q.group_size - q.numel
    levels = torch.cat([levels, levels.new_zeros(pad)]).view(q.num_groups, q.group_size)
    values = levels * q.scales[:, None]
    if q.offsets is not None:
        values = values + q.offsets[:, None]
    return values.flatten()[: q.numel]


def quantize(x: torch.Tensor, *, bits: int, group_size: int, symmetric: bool) -> QuantizedTensor:
    return quantize_fp32(
        x.reshape(-1).to(torch.float32),
        bits=bits,
        group_size=group_size,
        symmetric=symmetric,
        dtype=x.dtype,
    )


def dequantize(q: QuantizedTensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return dequantize_fp32(q).to(out_dtype or q.dtype)


def swizzled_quantize(
    x: torch.Tensor,
    *,
    nodes: int,
    devices_per_node: int,
    bits: int,
    group_size: int,
    symmetric: bool,
) -> QuantizedTensor:
    """Zero-pad x to world = nodes * devices_per_node slices of slice_numel(...) elements
    (slice j belongs to rank j = node * devices_per_node + local), put the slices in the order
    (local, node) and quantize: the slices for local rank l come as one block, node by node.
    """
    world = nodes * devices_per_node
    s = slice_numel(x.numel(), world, group_size)
    padded = torch.zeros(world * s, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x.reshape(-1)
    order = [
        node * devices_per_node + local
        for local in range(devices_per_node)
        for node in range(nodes)
    ]
    swizzled = padded.view(world, s)[order].flatten()
    return quantize_fp32(
        swizzled, bits=bits, group_size=group_size, symmetric=symmetric, dtype=x.dtype
    )


def _sum_fp32(inputs: list[QuantizedTensor]) -> torch.Tensor:
    acc = dequantize_fp32(inputs[0])
    for q in inputs[1:]:
        acc = acc + dequantize_fp32(q)
    return acc


def dequant_reduce_requant(inputs: list[QuantizedTensor]) -> QuantizedTensor:
    first = inputs[0]
    return quantize_fp32(
        _sum_fp32(inputs),
        bits=first.bits,
        group_size=first.group_size,
        symmetric=first.symmetric,
        dtype=first.dtype,
    )


def dequant_reduce(
    inputs: list[QuantizedTensor], *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return _sum_fp32(inputs).to(out_dtype)
