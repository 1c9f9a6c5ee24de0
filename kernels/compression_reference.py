"""The codes of the gradient compressors as readable torch code: the ground truth the CPU and
CUDA libraries match bit for bit (kernels/csrc/pack_math.h; docs/kernels.md, "Compression
codes").

Input: contiguous fp32, ``numel`` a multiple of ``block`` (a power of two, 32 to 4096).

1-bit (sign and scale, the code of 1-bit SGD with error feedback):
    scale = pairwise_sum(|x| over the block) / block, the mean magnitude: the scale s that
    minimises |x - s sign(x)|^2. The pairwise sum adds a[i] + a[i + h] for h = block/2, ..., 1
    (one fixed order, the same on every backend).
    level = -1 if x < 0 else +1 (a bit: 1 for -1), value = level * scale.
Ternary (TernGrad):
    scale = max |x| over the block (NaN if any element is NaN).
    u = uniform(seed, i) for the element's index i in x; level = sign(x) if u * scale < |x|
    else 0, so P(level != 0) = |x| / scale and E[value] = x: unbiased. Two bits per element:
    0 for 0, 1 for +1, 2 for -1. value = level * scale (a non-finite scale makes the whole
    block NaN, so the step sees it).
    uniform(seed, i) = (mix32((i mod 2^32) xor mix32(seed)) >> 8) * 2^-24, with mix32 the
    "lowbias32" integer hash: counter-based, so every backend draws the same numbers.
Block squared norms (Deep Gradient Compression's coarse-grained top-k):
    norm2 = pairwise_sum(x * x over the block), in the 1-bit scale's order (NaN if any element
    is NaN, +inf past fp32's range); the top-k picks blocks by it, so every backend must pick
    the same ones.
Sums: acc = value(inputs[0]); acc = acc + value(inputs[k]) for k = 1, 2, ... in fp32, then
rounded once to the output dtype.
Codes are packed little-endian: element i is bit i % 8 of byte i // 8 (1-bit), or bits
2 * (i % 4) .. 2 * (i % 4) + 1 of byte i // 4 (ternary).
"""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF
_TWO_POW_MINUS_24 = 2.0**-24


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2^32) (products wrap mod 2^64, whose
    low 32 bits are the uint32 product's)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def uniforms(seed: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 uniforms in [0, 1) of elements 0..numel-1 under ``seed``."""
    salt = int(mix32(torch.tensor([seed & _MASK], dtype=torch.int64))[0])
    index = torch.arange(numel, dtype=torch.int64, device=device) & _MASK
    hashed = mix32(index ^ salt) >> 8
    return hashed.to(torch.float32) * _TWO_POW_MINUS_24


def pairwise_block_sum(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per block of ``x`` (fp32), the sum in the spec's order."""
    a = x.view(-1, block)
    while a.shape[1] > 1:
        half = a.shape[1] // 2
        a = a[:, :half] + a[:, half:]
    return a[:, 0].contiguous()


def block_sq_norms(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per block of ``x`` (fp32), the pairwise sum of its squares."""
    return pairwise_block_sum(x * x, block)


def _pack(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (int64 in [0, 2^bits)) -> bytes, little-endian within each byte."""
    per_byte = 8 // bits
    codes = levels.view(-1, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.int64, device=levels.device) * bits
    return (codes << shifts).sum(dim=1).to(torch.uint8)


def _unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int64, device=data.device) * bits
    return ((data.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)


def onebit_compress(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, x - value): the 1-bit code of ``x`` and what it leaves out."""
    scales = pairwise_block_sum(x.abs(), block)
    scales = scales / torch.full_like(scales, float(block))
    negative = x.view(-1, block) < 0
    level = torch.where(negative, -1.0, 1.0).to(torch.float32)
    value = (level * scales[:, None]).reshape(-1)
    return _pack(negative.reshape(-1).to(torch.int64), 1), scales, x - value


def onebit_values(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    negative = _unpack(codes, 1).view(-1, block)
    level = torch.where(negative == 1, -1.0, 1.0).to(torch.float32)
    return (level * scales[:, None]).reshape(-1)


def ternary_compress(x: torch.Tensor, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales): TernGrad's stochastic ternary code of ``x`` under ``seed``."""
    magnitude = x.abs().view(-1, block)
    scales = magnitude.amax(dim=1)
    scales = torch.where(magnitude.isnan().any(dim=1), float("nan"), scales)
    u = uniforms(seed, x.numel(), x.device).view(-1, block)
    kept = (u * scales[:, None]) < magnitude
    codes = torch.where(kept, torch.where(x.view(-1, block) < 0, 2, 1), 0).to(torch.int64)
    return _pack(codes.reshape(-1), 2), scales


def ternary_values(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    code = _unpack(codes, 2).view(-1, block)
    level = torch.where(code == 1, 1.0, torch.where(code == 2, -1.0, 0.0)).to(torch.float32)
    return (level * scales[:, None]).reshape(-1)


def decompress_sum(values: list[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """The fp32 sum of decoded inputs in list order, rounded once to ``out_dtype``."""
    acc = values[0].clone()
    for value in values[1:]:
        acc = acc + value
    return acc.to(out_dtype)
