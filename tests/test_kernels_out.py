"""`out=` on every kernel op: the same bits as the allocating path, written into the caller's
buffer and returned, on every backend available here; bad buffers are refused by name."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import QuantizedTensor
from kernels.quantized import data_nbytes, num_groups
from tests.kernels_helpers import assert_same_bits, assert_same_quantized

BACKENDS = ["reference", "cpu"]
FORMATS = [(8, True), (8, False), (4, True), (4, False)]
NUMEL, GROUP = 1000, 64  # a short last group, and int4's odd tail


def _x(dtype=torch.float32, numel=NUMEL, seed=0):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 3
    x[7] = float("nan")  # one non-finite group travels through every op
    return x.to(dtype)


def _empty_like(q: QuantizedTensor) -> QuantizedTensor:
    return _empty(q.numel, q.bits, q.group_size, q.symmetric, q.dtype)


def _empty(numel, bits, group_size, symmetric, dtype, device="cpu") -> QuantizedTensor:
    groups = num_groups(numel, group_size)
    # Filled with garbage, so that a byte the op forgot to write shows up.
    return QuantizedTensor(
        data=torch.full((data_nbytes(numel, bits),), 0xA5, dtype=torch.uint8, device=device),
        scales=torch.full((groups,), -7.0, device=device),
        offsets=None if symmetric else torch.full((groups,), -7.0, device=device),
        numel=numel,
        bits=bits,
        group_size=group_size,
        symmetric=symmetric,
        dtype=dtype,
    )


def _assert_is(result: QuantizedTensor | torch.Tensor, out) -> None:
    """The op returned the caller's buffers, not copies."""
    if isinstance(out, torch.Tensor):
        assert result is out
        return
    assert result.data.data_ptr() == out.data.data_ptr()
    assert result.scales.data_ptr() == out.scales.data_ptr()
    if out.offsets is not None:
        assert result.offsets.data_ptr() == out.offsets.data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits, symmetric", FORMATS)
def test_quantize_into_out_matches_allocating_path(backend, dtype, bits, symmetric):
    x = _x(dtype)
    kw = dict(bits=bits, group_size=GROUP, symmetric=symmetric, backend=backend)
    expected = kernels.quantize(x, **kw)
    out = _empty_like(expected)
    result = kernels.quantize(x, **kw, out=out)
    _assert_is(result, out)
    assert_same_quantized(out, expected, f"{backend} quantize")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits, symmetric", FORMATS)
def test_swizzled_quantize_into_out_matches_allocating_path(backend, bits, symmetric):
    x = _x(torch.bfloat16)
    kw = dict(nodes=2, devices_per_node=3, bits=bits, group_size=GROUP, symmetric=symmetric)
    expected = kernels.swizzled_quantize(x, **kw, backend=backend)
    out = _empty_like(expected)
    result = kernels.swizzled_quantize(x, **kw, backend=backend, out=out)
    _assert_is(result, out)
    assert_same_quantized(out, expected, f"{backend} swizzled_quantize")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits, symmetric", FORMATS)
def test_dequantize_into_out_matches_allocating_path(backend, out_dtype, bits, symmetric):
    q = kernels.quantize(_x(), bits=bits, group_size=GROUP, symmetric=symmetric)
    expected = kernels.dequantize(q, out_dtype=out_dtype, backend=backend)
    out = torch.full((NUMEL,), 123.0, dtype=out_dtype)
    result = kernels.dequantize(q, backend=backend, out=out)  # dtype taken from out
    _assert_is(result, out)
    assert_same_bits(out, expected, f"{backend} dequantize")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count", [1, 2, 3, 5])  # 5: the general loop of the CPU library
@pytest.mark.parametrize("bits, symmetric", FORMATS)
def test_dequant_reduce_into_out_matches_allocating_path(backend, count, bits, symmetric):
    inputs = [
        kernels.quantize(_x(seed=k), bits=bits, group_size=GROUP, symmetric=symmetric)
        for k in range(count)
    ]
    for out_dtype in (torch.float32, torch.bfloat16):
        expected = kernels.dequant_reduce(inputs, out_dtype=out_dtype, backend=backend)
        # Any contiguous shape with the right numel: e.g. a parameter's view in a chunk.
        out = torch.full((NUMEL // 8, 8), 123.0, dtype=out_dtype)
        result = kernels.dequant_reduce(inputs, out_dtype=out_dtype, backend=backend, out=out)
        _assert_is(result, out)
        assert_same_bits(out.flatten(), expected, f"{backend} dequant_reduce")

    expected_q = kernels.dequant_reduce_requant(inputs, backend=backend)
    out_q = _empty_like(expected_q)
    result_q = kernels.dequant_reduce_requant(inputs, backend=backend, out=out_q)
    _assert_is(result_q, out_q)
    assert_same_quantized(out_q, expected_q, f"{backend} dequant_reduce_requant")


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_can_be_a_slice_of_a_larger_buffer(backend):
    """What ZeRO++ does: dequantize straight into a parameter's place in a chunk."""
    q = kernels.quantize(_x(), bits=8, group_size=GROUP, symmetric=True)
    chunk = torch.zeros(3 * NUMEL)
    kernels.dequantize(q, backend=backend, out=chunk[NUMEL : 2 * NUMEL])
    assert_same_bits(chunk[NUMEL : 2 * NUMEL], kernels.dequantize(q, backend=backend))
    assert not chunk[:NUMEL].any() and not chunk[2 * NUMEL :].any()


def _tensor_bytes_allocated(fn) -> int:
    with torch.autograd.profiler.profile(profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.function_events if e.cpu_memory_usage > 0)


@pytest.mark.parametrize("count", [1, 4])
def test_native_reduce_into_out_allocates_no_tensor(count):
    inputs = [
        kernels.quantize(_x(numel=1 << 16, seed=k), bits=8, group_size=GROUP, symmetric=True)
        for k in range(count)
    ]
    out = torch.empty(1 << 16)
    kernels.dequant_reduce(inputs, backend="cpu", out=out)  # builds the library
    # The profiler sees the allocating path's output, so it would see one on the out= path.
    assert _tensor_bytes_allocated(lambda: kernels.dequant_reduce(inputs, backend="cpu")) > 0
    assert (
        _tensor_bytes_allocated(lambda: kernels.dequant_reduce(inputs, backend="cpu", out=out)) == 0
    )


def _quantized_out_errors():
    good = dict(numel=NUMEL, bits=8, group_size=GROUP, symmetric=True, dtype=torch.float32)
    return [
        ({**good, "numel": NUMEL + 1}, ValueError, "out.numel=1001"),
        ({**good, "bits": 4}, ValueError, "out.bits=4"),
        ({**good, "group_size": 32}, ValueError, "out.group_size=32"),
        ({**good, "symmetric": False}, ValueError, "out.symmetric=False"),
        ({**good, "dtype": torch.bfloat16}, ValueError, "out.dtype=torch.bfloat16"),
        ({**good, "device": "meta"}, ValueError, "out is on meta"),
    ]


@pytest.mark.parametrize("layout, error, words", _quantized_out_errors())
def test_bad_quantized_out_is_named(layout, error, words):
    x = _x()
    out = _empty(**layout)
    with pytest.raises(error, match=words):
        kernels.quantize(x, bits=8, group_size=GROUP, symmetric=True, out=out)
    q = kernels.quantize(x, bits=8, group_size=GROUP, symmetric=True)
    with pytest.raises(error, match=words):
        kernels.dequant_reduce_requant([q, q], out=out)


def test_swizzled_out_must_hold_the_padded_layout():
    x = _x()
    padded = 2 * kernels.slice_numel(NUMEL, 2, GROUP)
    kw = dict(nodes=2, devices_per_node=1, bits=8, group_size=GROUP, symmetric=True)
    with pytest.raises(ValueError, match=f"out.numel={NUMEL} but the result has numel={padded}"):
        kernels.swizzled_quantize(x, **kw, out=_empty(NUMEL, 8, GROUP, True, torch.float32))
    kernels.swizzled_quantize(x, **kw, out=_empty(padded, 8, GROUP, True, torch.float32))


@pytest.mark.parametrize(
    "out, kwargs, error, words",
    [
        (torch.empty(NUMEL, dtype=torch.float64), {}, TypeError, "out has dtype torch.float64"),
        (torch.empty(NUMEL, dtype=torch.int32), {}, TypeError, "out has dtype torch.int32"),
        (
            torch.empty(NUMEL),
            {"out_dtype": torch.bfloat16},
            TypeError,
            "out has dtype torch.float32 but out_dtype=torch.bfloat16",
        ),
        (torch.empty(NUMEL + 1), {}, ValueError, "out holds 1001 elements but the result has 1000"),
        (torch.empty(2 * NUMEL)[::2], {}, ValueError, "out is not contiguous"),
        (torch.empty(NUMEL, device="meta"), {}, ValueError, "out is on meta"),
        ([0.0] * NUMEL, {}, TypeError, "out must be a torch.Tensor, got list"),
    ],
)
def test_bad_tensor_out_is_named(out, kwargs, error, words):
    q = kernels.quantize(_x(), bits=8, group_size=GROUP, symmetric=True)
    with pytest.raises(error, match=words):
        kernels.dequantize(q, out=out, **kwargs)
    with pytest.raises(error, match=words):
        kernels.dequant_reduce([q, q], out=out, **kwargs)


def test_out_must_not_overlap_the_inputs():
    q = kernels.quantize(_x(), bits=8, group_size=GROUP, symmetric=True)
    # Dequantizing over the levels' own bytes would overwrite levels not yet read.
    storage = torch.empty(NUMEL, dtype=torch.float32)
    levels = storage.view(torch.uint8)[:NUMEL]
    levels.copy_(q.data)
    in_place = QuantizedTensor(levels, q.scales, None, NUMEL, 8, GROUP, True, torch.float32)
    with pytest.raises(ValueError, match=r"out shares memory with inputs\[0\].data"):
        kernels.dequantize(in_place, out=storage)

    x = _x()
    groups = num_groups(NUMEL, GROUP)
    over_x = QuantizedTensor(
        x.view(torch.uint8)[:NUMEL], torch.empty(groups), None, NUMEL, 8, GROUP, True, x.dtype
    )
    with pytest.raises(ValueError, match="out.data shares memory with x"):
        kernels.quantize(x, bits=8, group_size=GROUP, symmetric=True, out=over_x)

    shared = torch.empty(NUMEL + groups * 4, dtype=torch.uint8)
    scales = shared[NUMEL:].view(torch.float32)
    self_overlapping = QuantizedTensor(
        shared[:NUMEL], scales, scales, NUMEL, 8, GROUP, False, torch.float32
    )
    with pytest.raises(ValueError, match="out.offsets shares memory with out.scales"):
        kernels.quantize(x, bits=8, group_size=GROUP, symmetric=False, out=self_overlapping)

    over_scales = QuantizedTensor(
        torch.empty(NUMEL, dtype=torch.uint8), q.scales, None, NUMEL, 8, GROUP, True, q.dtype
    )
    with pytest.raises(ValueError, match=r"out.scales shares memory with inputs\[0\].scales"):
        kernels.dequant_reduce_requant([q, q], out=over_scales)


@pytest.mark.cuda
@pytest.mark.parametrize("bits, symmetric", FORMATS)
def test_cuda_ops_into_out_match_allocating_path(bits, symmetric):
    """The same checks on CUDA tensors with backend="cuda" (skipped without a GPU)."""
    kw = dict(bits=bits, group_size=GROUP, symmetric=symmetric, backend="cuda")
    x = _x(torch.bfloat16).cuda()
    expected = kernels.quantize(x, **kw)
    out = _empty(expected.numel, bits, GROUP, symmetric, x.dtype, device="cuda")
    _assert_is(kernels.quantize(x, **kw, out=out), out)
    assert_same_quantized(out, expected, "cuda quantize")

    topology = dict(nodes=2, devices_per_node=2)
    expected = kernels.swizzled_quantize(x, **topology, **kw)
    out = _empty(expected.numel, bits, GROUP, symmetric, x.dtype, device="cuda")
    _assert_is(kernels.swizzled_quantize(x, **topology, **kw, out=out), out)
    assert_same_quantized(out, expected, "cuda swizzled_quantize")

    inputs = [kernels.quantize(_x(seed=k).cuda(), **kw) for k in range(3)]
    for out_dtype in (torch.float32, torch.bfloat16):
        expected_values = kernels.dequant_reduce(inputs, out_dtype=out_dtype, backend="cuda")
        values = torch.full((NUMEL,), 123.0, dtype=out_dtype, device="cuda")
        _assert_is(kernels.dequant_reduce(inputs, backend="cuda", out=values), values)
        assert_same_bits(values, expected_values, "cuda dequant_reduce")
        expected_values = kernels.dequantize(inputs[0], out_dtype=out_dtype, backend="cuda")
        _assert_is(kernels.dequantize(inputs[0], backend="cuda", out=values), values)
        assert_same_bits(values, expected_values, "cuda dequantize")

    expected = kernels.dequant_reduce_requant(inputs, backend="cuda")
    out = _empty(NUMEL, bits, GROUP, symmetric, inputs[0].dtype, device="cuda")
    _assert_is(kernels.dequant_reduce_requant(inputs, backend="cuda", out=out), out)
    assert_same_quantized(out, expected, "cuda dequant_reduce_requant")
