"""The native CPU library computes the reference's bits, and the reference keeps the spec's
promises: error within half a step, levels in range, int4 nibble order, NaN/Inf propagation."""

from __future__ import annotations

import platform

import pytest
import torch

import kernels
from kernels import QuantizedTensor, ops, reference
from kernels._native import load_cpu
from tests.kernels_helpers import (
    assert_same_bits,
    assert_same_quantized,
    quantized_on,
    roundtrip_bound,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FORMATS = [(8, True), (8, False), (4, True), (4, False)]
G = 64
SIZES = [0, 1, G - 1, G, G + 1, 3 * G + 5, 10_007]


def _ids(fmt: tuple[int, bool]) -> str:
    return f"int{fmt[0]}-{'sym' if fmt[1] else 'asym'}"


def _random(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes spread over several binades, so groups differ in scale.
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-6, 6, (n,), generator=g).float())
    return x.to(dtype)


def _edge_cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    n = 5 * G + 3
    tiny = torch.finfo(dtype).smallest_normal
    huge = {torch.float32: 1e30, torch.bfloat16: 1e30, torch.float16: 6e4}[dtype]
    outliers = _random(n, torch.float32, 1)
    outliers[::G] = huge
    outliers[G // 2 :: G] = -huge / 3
    constant = torch.full((n,), -2.75)
    constant[G : 2 * G] = 0.0
    return {
        "zeros": torch.zeros(n, dtype=dtype),
        "negative_zeros": torch.full((n,), -0.0, dtype=dtype),
        "outlier_per_group": outliers.to(dtype),
        "denormals": (torch.randn(n) * tiny * 0.25).to(dtype),
        "denormals_and_normals": torch.cat([torch.randn(G) * tiny * 0.1, torch.randn(n - G)]).to(
            dtype
        ),
        "constant_groups": constant.to(dtype),
        "near_max": (torch.rand(n) * 2 - 1).to(dtype) * torch.finfo(dtype).max,
        "positive_only": torch.rand(n).to(dtype) + 3,
    }


def _check_all_ops(
    x: torch.Tensor, bits: int, symmetric: bool, group_size: int = G, backend: str = "cpu"
) -> None:
    """Every op of the native library of ``backend`` ("cpu" or "cuda", run on that device)
    against the reference run on the CPU, on the CPU tensor x and the same inputs."""
    kw = dict(bits=bits, group_size=group_size, symmetric=symmetric)
    q = kernels.quantize(x.to(backend), **kw, backend=backend)
    assert_same_quantized(q, reference.quantize(x, **kw), "quantize")
    for out_dtype in DTYPES:
        assert_same_bits(
            kernels.dequantize(q, out_dtype=out_dtype, backend=backend),
            reference.dequantize(quantized_on(q, "cpu"), out_dtype=out_dtype),
            f"dequantize to {out_dtype}",
        )
    other = kernels.quantize(_random(x.numel(), x.dtype, 7).to(backend), **kw, backend=backend)
    # 3 inputs take the CPU library's fixed-count loop (int8), 5 its general one.
    for inputs in ([q, other, q], [other, q, q, other, q]):
        on_cpu = [quantized_on(i, "cpu") for i in inputs]
        assert_same_quantized(
            kernels.dequant_reduce_requant(inputs, backend=backend),
            reference.dequant_reduce_requant(on_cpu),
            f"dequant_reduce_requant of {len(inputs)}",
        )
        assert_same_bits(
            kernels.dequant_reduce(inputs, out_dtype=x.dtype, backend=backend),
            reference.dequant_reduce(on_cpu, out_dtype=x.dtype),
            f"dequant_reduce of {len(inputs)}",
        )
    for nodes, per_node in [(2, 2), (3, 1), (1, 4)]:
        sw = dict(nodes=nodes, devices_per_node=per_node, **kw)
        assert_same_quantized(
            kernels.swizzled_quantize(x.to(backend), **sw, backend=backend),
            reference.swizzled_quantize(x, **sw),
            f"swizzled_quantize {nodes}x{per_node}",
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize("n", SIZES)
def test_native_matches_reference_bit_for_bit_on_random_data(n, fmt, dtype):
    _check_all_ops(_random(n, dtype), *fmt)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
def test_native_matches_reference_bit_for_bit_on_edge_cases(fmt, dtype):
    for name, x in _edge_cases(dtype).items():
        try:
            _check_all_ops(x, *fmt)
        except AssertionError as e:
            raise AssertionError(f"edge case {name}: {e}") from e


@pytest.mark.parametrize("group_size", [1, 2, 7, 2048])
def test_native_matches_reference_for_other_group_sizes(group_size):
    for bits in (4, 8) if group_size % 2 == 0 else (8,):
        for symmetric in (True, False):
            _check_all_ops(_random(5000, torch.float32, 3), bits, symmetric, group_size)


def test_parallel_path_matches_reference():
    # Large enough to run on the OpenMP team, with a short last group.
    x = _random((1 << 17) + 37, torch.bfloat16, 5)
    for bits, symmetric in FORMATS:
        _check_all_ops(x, bits, symmetric, group_size=512)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
def test_reconstruction_error_is_within_half_a_step(fmt, dtype):
    bits, symmetric = fmt
    cases = {"random": _random(10_007, dtype), **_edge_cases(dtype)}
    if not symmetric:
        cases.pop("near_max")  # the range overflows fp32: the NaN rule, tested below
    worst = 0.0
    for name, x in cases.items():
        q = kernels.quantize(x, bits=bits, group_size=G, symmetric=symmetric)
        x_hat = kernels.dequantize(q, out_dtype=torch.float32)
        err = (x.double() - x_hat.double()).abs()
        bound = roundtrip_bound(q, x, x_hat)
        assert bool((err <= bound).all()), (
            f"{name}: error {float((err - bound).max())} over the bound"
        )
        if name == "random":
            steps = q.scales.repeat_interleave(G)[: q.numel].double()
            worst = float((err / steps).max())
    # Round-to-nearest reaches close to half a step on random data; truncation would reach 1.
    assert 0.45 < worst <= 0.5 + 1e-3


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
def test_levels_stay_in_range_without_clamping(fmt):
    """The extreme element of a group maps to the extreme level, never past it (symmetric
    int8 never stores -128, int4 never -8): the scale formula leaves no room for clipping."""
    bits, symmetric = fmt
    g = torch.Generator().manual_seed(11)
    exponents = torch.randint(-149, 120, (400,), generator=g).float()
    x = (torch.rand(400, G, generator=g) * 2 - 1) * torch.exp2(exponents)[:, None]
    x[:, 0] = x.abs().amax(dim=1) * torch.where(torch.rand(400, generator=g) < 0.5, -1.0, 1.0)
    x = x.flatten()
    q = kernels.quantize(x, bits=bits, group_size=G, symmetric=symmetric, backend="cpu")
    levels = reference._decode(q.data, q.numel, bits, symmetric).view(400, G)
    # Groups on the 2^-126 step floor are too small to reach the extreme level.
    normal = q.scales > reference.MIN_STEP
    assert int(normal.sum()) > 300
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        assert int(levels.min()) >= -qmax and int(levels.max()) <= qmax
        assert bool((levels[normal, 0].abs() == qmax).all())
    else:
        top = 2**bits - 1
        assert int(levels.min()) >= 0 and int(levels.max()) <= top
        assert bool((levels[normal].amin(dim=1) == 0).all())
        assert bool((levels[normal].amax(dim=1) == top).all())


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_int4_nibble_order_and_sign_encoding(backend):
    """Element 2k is the low nibble of byte k; symmetric levels are 4-bit two's complement."""
    values = torch.tensor([1.0, 2.0, -1.0, 7.0, -7.0, 0.0, 3.0])  # absmax 7: scale 1
    q = kernels.quantize(values, bits=4, group_size=8, symmetric=True, backend=backend)
    assert q.data.tolist() == [0x21, 0x7F, 0x09, 0x03]
    assert q.scales.tolist() == [1.0]
    assert torch.equal(kernels.dequantize(q, backend=backend), values)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_int4_packing_round_trips(symmetric, backend):
    """bytes -> dequantize -> quantize gives the same bytes when every group spans the full
    level range (so the step is 1 and, asymmetric, the offset 0)."""
    g = torch.Generator().manual_seed(2)
    groups, group_size = 50, 16
    data = torch.randint(0, 256, (groups * group_size // 2,), dtype=torch.uint8, generator=g)
    lo, hi = (0x9, 0x7) if symmetric else (0x0, 0xF)
    data.view(groups, group_size // 2)[:, 0] = lo | (hi << 4)  # level min and max in each group
    if symmetric:
        data[data & 0xF == 8] ^= 0x1  # -8 is not a symmetric level
        data[data >> 4 == 8] ^= 0x10
    q = QuantizedTensor(
        data=data,
        scales=torch.ones(groups),
        offsets=None if symmetric else torch.zeros(groups),
        numel=groups * group_size,
        bits=4,
        group_size=group_size,
        symmetric=symmetric,
        dtype=torch.float32,
    )
    values = kernels.dequantize(q, backend=backend)
    again = kernels.quantize(
        values, bits=4, group_size=group_size, symmetric=symmetric, backend=backend
    )
    assert torch.equal(again.data, data)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_nan_and_inf_make_their_whole_group_nan(fmt, dtype, backend):
    bits, symmetric = fmt
    x = _random(6 * G, torch.float32)
    x[G + 3], x[2 * G + 5], x[3 * G] = float("nan"), float("inf"), float("-inf")
    x = x.to(dtype)
    q = kernels.quantize(x, bits=bits, group_size=G, symmetric=symmetric, backend=backend)
    out = kernels.dequantize(q, backend=backend).view(6, G)
    assert bool(out[1:4].isnan().all())
    assert bool(out[[0, 4, 5]].isfinite().all())
    # The NaN survives the qgZ steps: reduce, requantize, reduce.
    clean = kernels.quantize(_random(6 * G, dtype, 9), bits=bits, group_size=G, symmetric=symmetric)
    requant = kernels.dequant_reduce_requant([clean, q], backend=backend)
    final = kernels.dequant_reduce([requant, clean], out_dtype=dtype, backend=backend).view(6, G)
    assert bool(final[1:4].isnan().all()) and bool(final[[0, 4, 5]].isfinite().all())


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_asymmetric_range_overflow_is_reported_as_nan(backend):
    x = torch.tensor([-3e38, 3e38, 1.0, 2.0])
    q = kernels.quantize(x, bits=8, group_size=2, symmetric=False, backend=backend)
    out = kernels.dequantize(q, backend=backend)
    assert bool(out[:2].isnan().all()) and torch.equal(out[2:], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_zero_scale_rule(backend):
    """All-zero groups and groups whose step would underflow use the 2^-126 floor."""
    x = torch.tensor([0.0, -0.0, 1e-45, -3e-45, 5.0, 5.0])
    q = kernels.quantize(x, bits=8, group_size=2, symmetric=True, backend=backend)
    expected = torch.tensor([2.0**-126, 2.0**-126, 5.0]) / torch.tensor([1.0, 1.0, 127.0])
    assert torch.equal(q.scales, expected)
    out = kernels.dequantize(q, backend=backend)
    assert out[:2].tolist() == [0.0, 0.0] and out[2:4].tolist() == [0.0, 0.0]
    qa = kernels.quantize(x, bits=8, group_size=2, symmetric=False, backend=backend)
    assert qa.scales.tolist() == [2.0**-126] * 3
    # Constant groups come back exactly; offset -0 is stored as +0.
    assert kernels.dequantize(qa, backend=backend)[4:].tolist() == [5.0, 5.0]
    assert torch.equal(qa.offsets[:1].view(torch.int32), torch.tensor([0], dtype=torch.int32))


@pytest.mark.parametrize("copies", [1, 32], ids=["scalar", "vector"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16bit_conversions_match_torch_exhaustively(dtype, copies):
    """Every 16-bit pattern widens exactly (quantize reads it), and fp32 values narrow with RNE
    like torch's .to() (dequantize writes them). A group of equal elements with step 1 and level
    0 is the identity on its offset, so offsets carry arbitrary values through the kernels.
    Groups of one element run the scalar code of the CPU library, groups of 32 its vector lanes.
    """
    _check_16bit_conversions(dtype, copies, backend="cpu")


def _check_16bit_conversions(dtype: torch.dtype, copies: int, backend: str) -> None:
    """The checks of test_16bit_conversions_match_torch_exhaustively for the library of
    ``backend``, run on its device; torch's conversions on the CPU are the reference."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = patterns[patterns.float().isfinite()]
    q = kernels.quantize(
        finite.repeat_interleave(copies).to(backend),
        bits=8,
        group_size=copies,
        symmetric=False,
        backend=backend,
    )
    assert_same_bits(q.offsets, finite.float() + 0.0, "widening")

    g = torch.Generator().manual_seed(4)
    values = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int64, generator=g)
    values = values.to(torch.int32).view(torch.float32)
    ties = (torch.arange(1 << 16, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    values = torch.cat([values, ties, patterns.float() * (1 + 2.0**-12)])
    q = QuantizedTensor(
        data=torch.zeros(values.numel() * copies, dtype=torch.uint8),
        scales=torch.ones(values.numel()),
        offsets=values,
        numel=values.numel() * copies,
        bits=8,
        group_size=copies,
        symmetric=False,
        dtype=torch.float32,
    )
    assert_same_bits(
        kernels.dequantize(quantized_on(q, backend), out_dtype=dtype, backend=backend),
        (values + 0.0).to(dtype).repeat_interleave(copies),
        "narrowing",
    )


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx2 is for x86")
def test_scalar_build_matches_reference_bit_for_bit(monkeypatch):
    """CPUs without AVX2 run the CPU library's scalar loops on whole groups, which the default
    build here runs only on group tails: build that variant and hold it to the same checks."""
    monkeypatch.setitem(ops._libraries, "cpu", load_cpu(extra_flags=["-mno-avx2"]))
    for dtype in DTYPES:
        cases = {"random": _random(3 * G + 5, dtype), **_edge_cases(dtype)}
        for fmt in FORMATS:
            for name, x in cases.items():
                try:
                    _check_all_ops(x, *fmt)
                except AssertionError as e:
                    raise AssertionError(f"{name}, {dtype}, {_ids(fmt)}: {e}") from e
