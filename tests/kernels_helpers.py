"""Shared checks of the kernel tests: bitwise comparison and the derived error bounds."""

from __future__ import annotations

import dataclasses

import torch

from kernels import QuantizedTensor

U = 2.0**-24  # unit roundoff of fp32


def bits_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def quantized_on(q: QuantizedTensor, device: torch.device | str) -> QuantizedTensor:
    """``q`` with its tensors copied to ``device`` (the same object if they are there)."""
    if q.device == torch.device(device):
        return q
    offsets = None if q.offsets is None else q.offsets.to(device)
    return dataclasses.replace(
        q, data=q.data.to(device), scales=q.scales.to(device), offsets=offsets
    )


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal bit patterns, except that any NaN equals any NaN (payloads are unspecified).
    Tensors on other devices (CUDA results) are compared on the CPU."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.is_floating_point():
        nan = torch.isnan(actual)
        assert torch.equal(nan, torch.isnan(expected)), f"{what}: NaN positions differ"
        actual, expected = actual[~nan], expected[~nan]
    same = bits_view(actual) == bits_view(expected)
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(f"{what}: first difference at {i}: {actual[i]!r} vs {expected[i]!r}")


def assert_same_quantized(a: QuantizedTensor, b: QuantizedTensor, what: str = "") -> None:
    for field in ("numel", "bits", "group_size", "symmetric", "dtype"):
        assert getattr(a, field) == getattr(b, field), f"{what}: {field}"
    assert_same_bits(a.data, b.data, f"{what} data")
    assert_same_bits(a.scales, b.scales, f"{what} scales")
    assert (a.offsets is None) == (b.offsets is None), what
    if a.offsets is not None:
        assert_same_bits(a.offsets, b.offsets, f"{what} offsets")


def per_element(q: QuantizedTensor, per_group: torch.Tensor) -> torch.Tensor:
    return per_group.repeat_interleave(q.group_size)[: q.numel]


def roundtrip_bound(q: QuantizedTensor, x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Largest |x - x_hat| the spec allows per element, in fp64 (docs/kernels.md, "Error bound").

    With step s and Q = qmax (symmetric) or L (asymmetric), the level is rne of t, t being
    (x - offset) / s up to three fp32 roundings (the subtraction, 1/s, the product): |t - exact|
    <= 3uQ(1 + u). Rounding t costs s/2, the product level * s another uQs, and the asymmetric
    `+ offset` u|x_hat|. So |x - x_hat| <= s (1/2 + 4uQ) + 2u max(|x|, |x_hat|), the terms in u
    rounded up to cover second-order terms and subnormal results.
    """
    levels = 2 ** (q.bits - 1) - 1 if q.symmetric else 2**q.bits - 1
    s = per_element(q, q.scales).double()
    magnitude = torch.maximum(x.double().abs(), x_hat.double().abs())
    return s * (0.5 + 4 * U * levels) + 2 * U * magnitude
