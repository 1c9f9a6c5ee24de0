"""The native gradient norms follow their stated summation order exactly (a reference written
from host_optim_cpu.cpp's [Note: one summation order]), in every dtype, build and thread count,
and are closer to the exact norm than torch's bf16 norm; an Adam update that measures the
gradients it reads (``grad_norms``) gives those bits; bad arguments are named."""

from __future__ import annotations

import math
import platform

import numpy as np
import pytest
import torch

from kernels import host_optim
from tests.test_host_optim import ADAM, State, host_adam_step

BLOCK, LANES = 1 << 15, 32
# 1..33: all tail or one vector step and a tail; 100_003: several blocks (and the parallel
# path) with a tail of 3.
SIZES = [1, 7, 31, 32, 33, 1000, 100_003]


def reference_norm(tensor: torch.Tensor) -> float:
    """The note's order: per block of BLOCK elements, 32 fp32 lanes each adding x*x with one
    rounding (x*x + lane is exact in double, then rounded once to fp32), lanes summed in double
    in order; the blocks' sums added in double in order; the root rounded to fp32."""
    values = tensor.double().numpy()
    total = 0.0
    for start in range(0, len(values), BLOCK):
        block = values[start : start + BLOCK]
        block = np.concatenate([block, np.zeros(-len(block) % LANES)])  # 0*0 + lane == lane
        lanes = np.zeros(LANES, dtype=np.float32)
        for row in block.reshape(-1, LANES):
            lanes = (row * row + lanes.astype(np.float64)).astype(np.float32)
        total += sum(float(lane) for lane in lanes)
    return float(np.float32(math.sqrt(total)))


def _tensors(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=generator) * 3).to(dtype) for n in SIZES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norms_follow_the_stated_summation_order(dtype):
    tensors = _tensors(dtype, 0)
    norms = host_optim.norms(tensors, num_threads=1)
    assert [n.dtype for n in norms] == [torch.float32] * len(SIZES)
    assert [float(n) for n in norms] == [reference_norm(t) for t in tensors]


def test_norms_are_closer_to_the_exact_norm_than_torchs_bf16_norm():
    tensors = [torch.randn(2_000_000, generator=torch.Generator().manual_seed(1)).bfloat16()]
    exact = float(tensors[0].double().norm())
    ours = float(host_optim.norms(tensors)[0])
    torchs = float(torch._foreach_norm(tensors, 2, dtype=torch.float32)[0])
    assert abs(ours - exact) / exact < 1e-6
    assert abs(ours - exact) < abs(torchs - exact)


def test_norms_do_not_depend_on_the_thread_count():
    tensors = _tensors(torch.bfloat16, 2)
    one = host_optim.norms(tensors, num_threads=1)
    for threads in (2, 3):
        assert all(
            torch.equal(a, b) for a, b in zip(host_optim.norms(tensors, threads), one, strict=True)
        )


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx2 is for x86")
def test_scalar_build_gives_the_avx2_build_norms(monkeypatch):
    tensors = _tensors(torch.float16, 3)
    lanes = host_optim.norms(tensors)
    scalar = host_optim.load_library(extra_flags=["-mno-avx2"])
    assert not scalar.has_avx2
    monkeypatch.setitem(host_optim._libraries, "cpu", scalar)
    assert all(torch.equal(a, b) for a, b in zip(host_optim.norms(tensors), lanes, strict=True))


def test_non_finite_values_give_non_finite_norms():
    tensors = [torch.tensor([1.0, float("inf")]), torch.tensor([float("nan"), 2.0])]
    inf, nan = host_optim.norms(tensors)
    assert math.isinf(float(inf)) and math.isnan(float(nan))


def test_no_tensors_and_empty_tensors():
    assert host_optim.norms([]) == []
    assert float(host_optim.norms([torch.zeros(0)])[0]) == 0.0


@pytest.mark.parametrize(
    ("tensors", "error", "match"),
    [
        ([torch.zeros(4, dtype=torch.int32)], TypeError, r"tensors\[0\] has dtype torch.int32"),
        ([torch.zeros(4), torch.zeros(4).bfloat16()], TypeError, "one call takes one dtype"),
        ([torch.zeros(4, 2).t()], ValueError, r"tensors\[0\] is not contiguous"),
        ([[1.0, 2.0]], TypeError, r"tensors\[0\] is a list, not a tensor"),
    ],
)
def test_bad_arguments_are_named(tensors, error, match):
    with pytest.raises(error, match=match):
        host_optim.norms(tensors)


def test_norms_write_into_out_and_return_its_elements():
    tensors = _tensors(torch.bfloat16, 6)
    out = torch.full((len(tensors),), float("nan"))
    version = out._version
    returned = host_optim.norms(tensors, num_threads=1, out=out)
    assert out.tolist() == [reference_norm(t) for t in tensors]
    assert all(r.data_ptr() == out[i].data_ptr() for i, r in enumerate(returned))
    assert out._version > version, "autograd sees the write, as with an in-place op"
    with pytest.raises(ValueError, match=r"out has 2 elements but tensors has 7"):
        host_optim.norms(tensors, out=torch.zeros(2))


def _adam_step(grads: list[torch.Tensor], threads: int, **kwargs) -> State:
    """One AdamW step (``tests.test_host_optim``'s) over fresh states for ``grads``."""
    state = State.random([g.numel() for g in grads], 2, torch.float32)
    host_adam_step(
        state, grads, decoupled=True, num_threads=threads, weight_decay=0.01, **ADAM, **kwargs
    )
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("scale", [None, 1024.0], ids=["no-scale", "grad-scale"])
def test_an_update_measures_the_norms_of_what_it_reads_with_the_norms_bits(dtype, threads, scale):
    """``grad_norms``: each gradient's norm before the division, the bits of ``norms``
    (so a speculative update's measure equals the serial step's), and the same update."""
    tensors = _tensors(dtype, 3)
    expected = torch.stack(host_optim.norms(tensors, num_threads=1))
    measured = torch.full((len(tensors),), float("nan"))
    grad_scale = None if scale is None else torch.tensor(scale)
    alone = _adam_step([t.clone() for t in tensors], threads, grad_scale=grad_scale)
    fused = _adam_step(tensors, threads, grad_scale=grad_scale, grad_norms=measured)
    assert torch.equal(measured, expected)
    fused.assert_same(alone, "the update measuring its gradients")


def test_a_skipped_update_still_measures_the_norms():
    tensors = _tensors(torch.bfloat16, 4)
    measured = torch.full((len(tensors),), float("nan"))
    before = State.random([t.numel() for t in tensors], 2, torch.float32)
    after = _adam_step(tensors, 1, found_inf=torch.tensor(1.0), grad_norms=measured)
    assert torch.equal(measured, torch.stack(host_optim.norms(tensors)))
    after.assert_same(before, "a skipped step")


@pytest.mark.parametrize(
    ("grad_norms", "error", "match"),
    [
        (torch.zeros(2), ValueError, r"grad_norms has 2 elements but grads has 7"),
        (torch.zeros(7, dtype=torch.float64), TypeError, r"grad_norms\[0\] has dtype"),
        (torch.zeros(7, 2)[:, 0], ValueError, r"grad_norms\[0\] is not contiguous"),
    ],
)
def test_where_the_norms_go_is_checked(grad_norms, error, match):
    with pytest.raises(error, match=match):
        _adam_step(_tensors(torch.bfloat16, 5), 1, grad_norms=grad_norms)
