"""The CUDA library computes the reference's bits: tests/test_kernels_spec.py's bit-for-bit
checks, run with ``backend="cuda"`` on CUDA tensors against the reference on the CPU.

Each test names the CPU test it mirrors; ``_check_all_ops`` runs every op (quantize,
dequantize to fp32/bf16/fp16, dequant_reduce and dequant_reduce_requant of 3 and 5 inputs,
swizzled_quantize for three node layouts) and compares data, scales, offsets and outputs bit
for bit, NaN positions included.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels
from kernels import reference
from kernels._cuda import load_cuda
from tests.kernels_helpers import assert_same_bits, assert_same_quantized, quantized_on
from tests.test_kernels_spec import (
    DTYPES,
    FORMATS,
    SIZES,
    G,
    _check_16bit_conversions,
    _check_all_ops,
    _edge_cases,
    _ids,
    _random,
)

pytestmark = pytest.mark.cuda


def test_the_cuda_library_is_built_for_this_device() -> None:
    """Without it every test below would compare the reference with itself."""
    choice = kernels.backend_for("cuda")
    assert choice.name == "cuda", choice.reason
    library = load_cuda()
    major, minor = torch.cuda.get_device_capability()
    print(f"{library.path} for sm_{major}{minor} ({torch.cuda.get_device_name()})")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize("n", SIZES)
def test_cuda_matches_reference_bit_for_bit_on_random_data(n, fmt, dtype):
    """test_native_matches_reference_bit_for_bit_on_random_data: empty, one element, one group
    short, one group, one over, odd lengths."""
    _check_all_ops(_random(n, dtype), *fmt, backend="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
def test_cuda_matches_reference_bit_for_bit_on_edge_cases(fmt, dtype):
    """test_native_matches_reference_bit_for_bit_on_edge_cases: zeros, -0, an outlier per
    group, denormals, constant groups, values near the dtype's max (asymmetric: a range that
    overflows fp32, so NaN groups), positive-only groups."""
    for name, x in _edge_cases(dtype).items():
        try:
            _check_all_ops(x, *fmt, backend="cuda")
        except AssertionError as e:
            raise AssertionError(f"edge case {name}: {e}") from e


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
def test_cuda_matches_reference_on_nan_and_inf(fmt, dtype):
    """test_nan_and_inf_make_their_whole_group_nan, as bits: NaN, +Inf and -Inf in three groups
    make those groups NaN through every op and reduction exactly where the reference does."""
    x = _random(6 * G + 5, torch.float32)
    x[G + 3], x[2 * G + 5], x[3 * G], x[6 * G + 4] = (
        float("nan"), float("inf"), float("-inf"), float("nan"),
    )  # fmt: skip
    _check_all_ops(x.to(dtype), *fmt, backend="cuda")


@pytest.mark.parametrize("group_size", [1, 2, 7, 2048, 2050, 4096])
def test_cuda_matches_reference_for_other_group_sizes(group_size):
    """test_native_matches_reference_for_other_group_sizes, and groups past the 2,048 elements
    of a register tile (the kernels' element loops) or not a multiple of its 8 elements."""
    for bits in (4, 8) if group_size % 2 == 0 else (8,):
        for symmetric in (True, False):
            _check_all_ops(_random(5000, torch.float32, 3), bits, symmetric, group_size, "cuda")


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
def test_cuda_grid_stride_loops_match_reference(fmt):
    """test_parallel_path_matches_reference for the launchers: more groups than the 65,536
    blocks a launch uses and more elements than 65,536 blocks x 256 threads, so every kernel's
    grid-stride loop wraps; a short last group."""
    x = _random((1 << 24) + 37, torch.bfloat16, 5)
    _check_all_ops(x, *fmt, group_size=128, backend="cuda")


@pytest.mark.parametrize(
    "values, bits, group_size, symmetric",
    [
        ([0.0, -0.0, 1e-45, -3e-45, 5.0, 5.0], 8, 2, True),  # test_zero_scale_rule
        ([0.0, -0.0, 1e-45, -3e-45, 5.0, 5.0], 8, 2, False),
        ([-3e38, 3e38, 1.0, 2.0], 8, 2, False),  # test_asymmetric_range_overflow_is_...
        ([1.0, 2.0, -1.0, 7.0, -7.0, 0.0, 3.0], 4, 8, True),  # test_int4_nibble_order_...
    ],
)
def test_cuda_matches_reference_on_the_spec_examples(values, bits, group_size, symmetric):
    _check_all_ops(torch.tensor(values), bits, symmetric, group_size, "cuda")


@pytest.mark.parametrize("copies", [1, 32], ids=["one", "32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_16bit_conversions_match_torch_exhaustively(dtype, copies):
    """test_16bit_conversions_match_torch_exhaustively: every 16-bit pattern widens exactly,
    1M random fp32 values and every tie narrow like torch's .to() on the CPU."""
    _check_16bit_conversions(dtype, copies, backend="cuda")


def test_cuda_kernels_run_on_the_current_stream() -> None:
    """The launchers take torch's current stream: work queued before them on a side stream
    (here a long sleep, then the write of the input) finishes before they read."""
    x = _random(1 << 20, torch.float32, 8)
    expected = reference.quantize(x, bits=8, group_size=G, symmetric=True)
    source = x.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        written_late = source * 1.0
        q = kernels.quantize(written_late, bits=8, group_size=G, symmetric=True, backend="cuda")
        out = kernels.dequantize(q, backend="cuda")
    torch.cuda.synchronize()
    assert torch.equal(q.data.cpu(), expected.data)
    assert torch.equal(out.cpu(), reference.dequantize(expected))


def _shifted(t: torch.Tensor, by: int) -> torch.Tensor:
    """t's values on the GPU, starting ``by`` elements into their storage (unaligned)."""
    return torch.cat([torch.zeros(by, dtype=t.dtype), t]).to("cuda")[by:]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
def test_cuda_matches_reference_on_unaligned_storage(fmt, dtype):
    """The register tiles read and write 16, 8 or 4 bytes at once only at aligned addresses:
    inputs, levels and outputs that start a few elements into their storage take the element
    path and give the reference's bits."""
    bits, symmetric = fmt
    kw = dict(bits=bits, group_size=G, symmetric=symmetric)
    x = _random(3 * G + 24, dtype)
    q = kernels.quantize(_shifted(x, 3), **kw, backend="cuda")
    assert_same_quantized(q, reference.quantize(x, **kw), "quantize")
    sw = dict(nodes=2, devices_per_node=2, **kw)
    assert_same_quantized(
        kernels.swizzled_quantize(_shifted(x, 5), **sw, backend="cuda"),
        reference.swizzled_quantize(x, **sw),
        "swizzled_quantize",
    )
    shifted = dataclasses.replace(q, data=_shifted(q.data.cpu(), 4 if bits == 8 else 2))
    on_cpu = quantized_on(q, "cpu")
    assert_same_quantized(
        kernels.dequant_reduce_requant([shifted, q], backend="cuda"),
        reference.dequant_reduce_requant([on_cpu, on_cpu]),
        "dequant_reduce_requant",
    )
    out = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")[1:]
    assert_same_bits(
        kernels.dequant_reduce([shifted, q], out_dtype=dtype, backend="cuda", out=out),
        reference.dequant_reduce([on_cpu, on_cpu], out_dtype=dtype),
        "dequant_reduce",
    )
