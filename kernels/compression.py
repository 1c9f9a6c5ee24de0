"""The gradient compressors' codes as ops: 1-bit sign and scale, TernGrad's stochastic ternary,
the fp32 sum of decoded inputs, and DGC's block top-k (zero/compression's wire formats).

The spec and ground truth is ``kernels.compression_reference``; the native CPU and CUDA
libraries (kernels/csrc/pack_math.h) compute the same bits. Backend selection is the
quantization ops' ([Note: backend selection] in kernels/ops.py). Every op writes into buffers
the caller owns (``codes``, ``scales``, ``out``), which must be contiguous, of the exact size
and on ``x``'s device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kernels import compression_reference as reference
from kernels.ops import Backend, _kernels_for

Code = Literal["onebit", "ternary"]
BITS: dict[Code, int] = {"onebit": 1, "ternary": 2}
MIN_BLOCK, MAX_BLOCK = 32, 4096


def check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int):
        raise ValueError(f"block must be an int, got {block!r}")
    if not MIN_BLOCK <= block <= MAX_BLOCK or block & (block - 1):
        raise ValueError(f"block must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {block}")


def code_nbytes(numel: int, code: Code) -> int:
    """Bytes of the codes of ``numel`` elements (a multiple of the block)."""
    return numel * BITS[code] // 8


def _check_buffer(name: str, t: torch.Tensor, dtype: torch.dtype, numel: int, device) -> None:
    if t.dtype != dtype or t.numel() != numel or not t.is_contiguous() or t.device != device:
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor of {numel} elements on {device}, got "
            f"{t.dtype} of {t.numel()} on {t.device} (contiguous: {t.is_contiguous()})"
        )


def _check_input(x: torch.Tensor, block: int) -> None:
    check_block(block)
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous float32 tensor, got {x.dtype}")
    if x.numel() % block:
        raise ValueError(f"x has {x.numel()} elements, not a multiple of the block {block}")


def onebit_compress(
    x: torch.Tensor,
    *,
    block: int,
    codes: torch.Tensor,
    scales: torch.Tensor,
    residual: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """Sign bits and per-block mean magnitude of ``x`` into ``codes`` and ``scales``; with
    ``residual`` (which may be ``x`` itself), also ``x`` minus its decoded value."""
    _check_input(x, block)
    _check_buffer("codes", codes, torch.uint8, code_nbytes(x.numel(), "onebit"), x.device)
    _check_buffer("scales", scales, torch.float32, x.numel() // block, x.device)
    if residual is not None:
        _check_buffer("residual", residual, torch.float32, x.numel(), x.device)
    kernels = _kernels_for(x.device, backend)
    if kernels is None:
        c, s, r = reference.onebit_compress(x, block)
        codes.copy_(c)
        scales.copy_(s)
        if residual is not None:
            residual.copy_(r)
        return
    kernels.onebit_compress(x, block, codes, scales, residual)


def ternary_compress(
    x: torch.Tensor,
    *,
    block: int,
    seed: int,
    codes: torch.Tensor,
    scales: torch.Tensor,
    backend: Backend | None = None,
) -> None:
    """TernGrad's unbiased ternary code of ``x`` under ``seed`` (0 <= seed < 2^32)."""
    _check_input(x, block)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2^32), got {seed!r}")
    _check_buffer("codes", codes, torch.uint8, code_nbytes(x.numel(), "ternary"), x.device)
    _check_buffer("scales", scales, torch.float32, x.numel() // block, x.device)
    kernels = _kernels_for(x.device, backend)
    if kernels is None:
        c, s = reference.ternary_compress(x, block, seed)
        codes.copy_(c)
        scales.copy_(s)
        return
    kernels.ternary_compress(x, block, seed, codes, scales)


def decompress_sum(
    codes: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    *,
    code: Code,
    block: int,
    out: torch.Tensor,
    backend: Backend | None = None,
) -> torch.Tensor:
    """The fp32 sum, in input order, of the values the inputs encode, rounded once into
    ``out`` (fp32, bf16 or fp16)."""
    check_block(block)
    if code not in BITS:
        raise ValueError(f"code must be 'onebit' or 'ternary', got {code!r}")
    if not codes or len(codes) != len(scales):
        raise ValueError(
            f"need as many codes as scales, at least one; got {len(codes)}, {len(scales)}"
        )
    numel = out.numel()
    if numel % block or out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out must be fp32/bf16/fp16 with a multiple of {block} elements")
    _check_buffer("out", out, out.dtype, numel, out.device)
    for k, (c, s) in enumerate(zip(codes, scales, strict=True)):
        _check_buffer(f"codes[{k}]", c, torch.uint8, code_nbytes(numel, code), out.device)
        _check_buffer(f"scales[{k}]", s, torch.float32, numel // block, out.device)
    kernels = _kernels_for(out.device, backend)
    if kernels is None:
        decode = reference.onebit_values if code == "onebit" else reference.ternary_values
        values = [decode(c, s, block) for c, s in zip(codes, scales, strict=True)]
        return out.copy_(reference.decompress_sum(values, out.dtype))
    kernels.decompress_sum(codes, scales, block, code == "ternary", out)
    return out


def block_sq_norms(
    x: torch.Tensor, *, block: int, out: torch.Tensor, backend: Backend | None = None
) -> torch.Tensor:
    """Each block's sum of squares into ``out`` (fp32, one per block): what DGC's top-k ranks
    blocks by, bit for bit on every backend (so every backend keeps the same blocks)."""
    _check_input(x, block)
    _check_buffer("out", out, torch.float32, x.numel() // block, x.device)
    kernels = _kernels_for(x.device, backend)
    if kernels is None:
        return out.copy_(reference.block_sq_norms(x, block))
    kernels.block_sq_norms(x, block, out)
    return out


def top_blocks(norms: torch.Tensor, count: int) -> torch.Tensor:
    """Per row of ``norms`` (slices x blocks), the indices of its ``count`` largest blocks in
    ascending order (int64). Ties keep the lower index and a NaN ranks above everything, so
    a non-finite gradient is sent (and the step sees it); a stable sort makes the choice the
    same on every backend."""
    if norms.dim() != 2 or not 1 <= count <= norms.shape[1]:
        raise ValueError(
            f"norms must be 2-D with at least {count} blocks per row, got {tuple(norms.shape)}"
        )
    ranked = torch.sort(norms, dim=1, descending=True, stable=True).indices[:, :count]
    return torch.sort(ranked, dim=1).values


def gather_blocks(x: torch.Tensor, index: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """``out[j, i]`` = block ``index[j, i]`` of row ``j`` of ``x`` (rows x blocks*block),
    converted to ``out``'s dtype (rounded to nearest-even)."""
    rows, count = index.shape
    blocks = x.view(rows, -1, block)
    out.view(rows, count, block).copy_(
        blocks.gather(1, index.unsqueeze(2).expand(rows, count, block))
    )


def add_blocks(
    values: torch.Tensor, index: torch.Tensor, block: int, out: torch.Tensor
) -> torch.Tensor:
    """``out`` (fp32, blocks*block) plus each of ``values`` (count x block) at its block of
    ``index`` (unique, count): one fp32 add per element, so a sum over senders in rank order
    is the same on every backend."""
    target = out.view(-1, block)
    target.index_add_(0, index, values.view(-1, block).to(torch.float32))
    return out
