"""The quantized-tensor container and the argument checks every backend shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_format(bits: int, group_size: int) -> None:
    """Raise ValueError unless (bits, group_size) name a layout the kernels support."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if bits == 4 and group_size % 2:
        raise ValueError(
            f"group_size must be even for bits=4 (two values share a byte and every group "
            f"starts on a byte), got {group_size}"
        )


def check_float_tensor(name: str, x: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless x is a contiguous fp32/bf16/fp16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; the kernels read torch.float32, torch.bfloat16 or "
            f"torch.float16 (convert with {name}.to(torch.float32))"
        )
    if not x.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(x.shape)}, stride {x.stride()}); "
            f"pass {name}.contiguous()"
        )


def check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {out_dtype}"
        )


def check_out_tensor(
    out: torch.Tensor, *, numel: int, out_dtype: torch.dtype | None, device: torch.device
) -> torch.dtype:
    """Raise unless `out` can receive `numel` values of `out_dtype` (None: any float dtype) on
    `device` in place; returns the dtype the op writes (out's)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"out has dtype {out.dtype}; the kernels write torch.float32, torch.bfloat16 or "
            f"torch.float16"
        )
    if out_dtype is not None and out.dtype != out_dtype:
        raise TypeError(f"out has dtype {out.dtype} but out_dtype={out_dtype}; pass one of them")
    if out.numel() != numel:
        raise ValueError(f"out holds {out.numel()} elements but the result has {numel}")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but the inputs are on {device}")
    if not out.is_contiguous():
        raise ValueError(
            f"out is not contiguous (shape {tuple(out.shape)}, stride {out.stride()}); the "
            f"kernels write a flat buffer"
        )
    return out.dtype


def check_out_quantized(
    out: QuantizedTensor,
    *,
    numel: int,
    bits: int,
    group_size: int,
    symmetric: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Raise unless `out` is a QuantizedTensor of exactly the layout the op produces, on
    `device`. (Its parts' dtypes, sizes and contiguity were checked when it was built.)"""
    if not isinstance(out, QuantizedTensor):
        raise TypeError(f"out must be a QuantizedTensor, got {type(out).__name__}")
    want = dict(numel=numel, bits=bits, group_size=group_size, symmetric=symmetric, dtype=dtype)
    for field, value in want.items():
        if getattr(out, field) != value:
            raise ValueError(
                f"out.{field}={getattr(out, field)!r} but the result has {field}={value!r}; "
                f"build out with the layout of the result"
            )
    if out.device != device:
        raise ValueError(f"out is on {out.device} but the inputs are on {device}")
    for name, t in (("data", out.data), ("scales", out.scales), ("offsets", out.offsets)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"out.{name} is not contiguous")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def check_no_overlap(
    outs: dict[str, torch.Tensor | None], inputs: dict[str, torch.Tensor | None]
) -> None:
    """Raise if an output buffer shares memory with an input or another output: the kernels
    read and write in parallel, so an overlap would corrupt the result."""
    spans = [(name, _byte_span(t)) for name, t in inputs.items() if t is not None and t.numel()]
    for out_name, t in outs.items():
        if t is None or not t.numel():
            continue
        lo, hi = _byte_span(t)
        for name, (a, b) in spans:
            if lo < b and a < hi:
                raise ValueError(
                    f"{out_name} shares memory with {name}; the kernels do not run in place, "
                    f"pass a separate buffer"
                )
        spans.append((out_name, (lo, hi)))


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def data_nbytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def slice_numel(numel: int, world_size: int, group_size: int) -> int:
    """Elements per rank in the swizzled (qgZ) layout: ceil(numel / world_size) rounded up to
    a multiple of group_size, so that every slice holds whole groups. Rank j owns elements
    [j * slice_numel, (j + 1) * slice_numel) of the input zero-padded to world_size slices."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    per_rank = -(-numel // world_size)
    return -(-per_rank // group_size) * group_size


@dataclass(frozen=True)
class QuantizedTensor:
    """A flat tensor quantized block-wise: the wire format of qwZ and qgZ.

    `data` holds the levels as bytes (uint8): for bits=8 one byte per element (two's
    complement when symmetric), for bits=4 two elements per byte, element 2k in the low
    nibble of byte k. `scales` holds one fp32 step per group of `group_size` elements (the
    last group may be short), `offsets` the fp32 value of level 0 per group for asymmetric
    quantization and None for symmetric. `dtype` is the dtype the values came from and the
    default dtype of `dequantize`. docs/kernels.md has the full spec.
    """

    data: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    numel: int
    bits: int
    group_size: int
    symmetric: bool
    dtype: torch.dtype

    def __post_init__(self) -> None:
        check_format(self.bits, self.group_size)
        check_out_dtype(self.dtype)
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")
        if self.symmetric != (self.offsets is None):
            want = "None" if self.symmetric else "a float32 tensor"
            raise ValueError(f"offsets must be {want} when symmetric={self.symmetric}")
        groups = num_groups(self.numel, self.group_size)
        expected = [
            ("data", self.data, torch.uint8, data_nbytes(self.numel, self.bits)),
            ("scales", self.scales, torch.float32, groups),
        ]
        if self.offsets is not None:
            expected.append(("offsets", self.offsets, torch.float32, groups))
        for name, t, dtype, n in expected:
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1:
                got = (
                    f"{t.dtype} with shape {tuple(t.shape)}"
                    if isinstance(t, torch.Tensor)
                    else type(t).__name__
                )
                raise TypeError(f"QuantizedTensor.{name} must be a 1-D {dtype} tensor, got {got}")
            if t.numel() != n:
                raise ValueError(
                    f"QuantizedTensor.{name} holds {t.numel()} values, but numel={self.numel}, "
                    f"bits={self.bits}, group_size={self.group_size} need {n}"
                )
            if not t.is_contiguous():
                raise ValueError(f"QuantizedTensor.{name} is not contiguous")
            if t.device != self.data.device:
                raise ValueError(
                    f"QuantizedTensor.{name} is on {t.device} but data is on {self.data.device}"
                )

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def num_groups(self) -> int:
        return num_groups(self.numel, self.group_size)

    def split(self, parts: int) -> list[QuantizedTensor]:
        """Views of `parts` equal consecutive pieces, e.g. the blocks of an all-to-all.

        Each piece must hold whole groups: numel must be a multiple of parts * group_size.
        """
        if parts < 1 or self.numel % (parts * self.group_size):
            raise ValueError(
                f"cannot split numel={self.numel} into {parts} pieces of whole groups of "
                f"{self.group_size}; numel must be a multiple of parts * group_size"
            )
        numel = self.numel // parts
        nbytes, groups = data_nbytes(numel, self.bits), numel // self.group_size
        return [
            QuantizedTensor(
                data=self.data[i * nbytes : (i + 1) * nbytes],
                scales=self.scales[i * groups : (i + 1) * groups],
                offsets=None
                if self.offsets is None
                else self.offsets[i * groups : (i + 1) * groups],
                numel=numel,
                bits=self.bits,
                group_size=self.group_size,
                symmetric=self.symmetric,
                dtype=self.dtype,
            )
            for i in range(parts)
        ]


def check_same_layout(name: str, inputs: list[QuantizedTensor]) -> None:
    """Raise unless `inputs` is a non-empty list of QuantizedTensors of one layout and device."""
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise ValueError(f"{name} needs a non-empty list of QuantizedTensor, got {inputs!r}")
    first = inputs[0]
    for i, q in enumerate(inputs):
        if not isinstance(q, QuantizedTensor):
            raise TypeError(f"{name}: inputs[{i}] is a {type(q).__name__}, not a QuantizedTensor")
        for field in ("numel", "bits", "group_size", "symmetric"):
            if getattr(q, field) != getattr(first, field):
                raise ValueError(
                    f"{name}: inputs[{i}].{field}={getattr(q, field)!r} but "
                    f"inputs[0].{field}={getattr(first, field)!r}; all inputs must share one layout"
                )
        if q.device != first.device:
            raise ValueError(
                f"{name}: inputs[{i}] is on {q.device} but inputs[0] is on {first.device}"
            )
