"""The native host optimizer gives torch's bits: Adam/AdamW as torch._fused_adamw_/_fused_adam_,
SGD as torch._fused_sgd_, the mixed-precision and bf16-state steps as the torch compositions
they replace; the scalar build gives the AVX2 build's bits, any thread count the same bits; bad
arguments raise errors that name them."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field

import pytest
import torch

from kernels import host_optim
from kernels._build import BuildError
from kernels.row_stores import set_row_stores
from tests.kernels_helpers import assert_same_bits

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# 1..29: tensors that are all tail or a few vector steps and a tail; 100_003: several blocks
# of the work split and the parallel path, with a tail of 3.
SIZES = [1, 7, 8, 13, 16, 29, 1000, 100_003]
ADAM = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}

requires_torch_avx2 = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64")
    or torch.backends.cpu.get_cpu_capability() == "DEFAULT",
    reason="bit identity holds with torch's AVX2 kernels (x86-64 with AVX2); this torch runs "
    "its DEFAULT kernels, whose roundings differ",
)


def _values(n: int, seed: int, *, positive: bool = False) -> torch.Tensor:
    """fp32 values over 2^-40..2^20, with exact zeros, denormals and values whose square
    overflows, so every rounding path of the update is exercised."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 20, (n,), generator=g).float())
    x[torch.rand(n, generator=g) < 0.02] = 0.0
    x[torch.rand(n, generator=g) < 0.02] = 3e-41
    x[torch.rand(n, generator=g) < 0.005] = 2e19
    return x.abs() if positive else x


@dataclass
class State:
    """Parameters (fp32 masters), optimizer states, step counts and optional 16-bit copies."""

    params: list[torch.Tensor]
    states: list[list[torch.Tensor]]  # [exp_avgs, exp_avg_sqs] for Adam, [buffers] for SGD
    steps: list[torch.Tensor]
    params_out: list[torch.Tensor] | None = None
    grads_seen: list[list[torch.Tensor]] = field(default_factory=list)

    @classmethod
    def random(cls, sizes, n_states: int, state_dtype, out_dtype=None, seed: int = 0) -> State:
        params = [_values(n, seed + i) for i, n in enumerate(sizes)]
        states = [
            [
                _values(n, 1000 * k + seed + i, positive=k == 1).to(state_dtype)
                for i, n in enumerate(sizes)
            ]
            for k in range(n_states)
        ]
        # Distinct step counts per tensor: each gets its own bias corrections.
        steps = [torch.tensor(float(3 * i), dtype=F32) for i in range(len(sizes))]
        out = None if out_dtype is None else [p.to(out_dtype) for p in params]
        return cls(params, states, steps, out)

    def clone(self) -> State:
        return State(
            [p.clone() for p in self.params],
            [[s.clone() for s in group] for group in self.states],
            [s.clone() for s in self.steps],
            None if self.params_out is None else [p.clone() for p in self.params_out],
        )

    def assert_same(self, other: State, what: str) -> None:
        for name, mine, theirs in (
            ("params", self.params, other.params),
            *(
                (f"state{k}", a, b)
                for k, (a, b) in enumerate(zip(self.states, other.states, strict=True))
            ),
            ("params_out", self.params_out or [], other.params_out or []),
        ):
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                assert_same_bits(a, b, f"{what}: {name}[{i}] ({a.numel()} elements)")


def _grads(sizes, dtype, seed: int) -> list[torch.Tensor]:
    return [_values(n, 7919 * seed + i).to(dtype) for i, n in enumerate(sizes)]


def _widened(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.float() if t.dtype != F32 else t for t in tensors]


def torch_adam_step(state: State, grads, *, decoupled: bool, grad_scale=None, **hyper) -> None:
    """The torch composition: widen 16-bit grads and states, fused fp32 kernel, narrow back."""
    torch._foreach_add_(state.steps, 1)
    exp_avgs, exp_avg_sqs = (_widened(s) for s in state.states)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(
        state.params,
        _widened(grads),
        exp_avgs,
        exp_avg_sqs,
        [],
        state.steps,
        amsgrad=False,
        maximize=False,
        grad_scale=grad_scale,
        **hyper,
    )
    for stored, new in ((state.states[0], exp_avgs), (state.states[1], exp_avg_sqs)):
        if stored[0].dtype != F32:
            torch._foreach_copy_(stored, new)
    if state.params_out is not None:
        torch._foreach_copy_(state.params_out, state.params)


def host_adam_step(
    state: State,
    grads,
    *,
    decoupled: bool,
    grad_scale=None,
    num_threads=None,
    new_states=None,
    **hyper,
) -> None:
    torch._foreach_add_(state.steps, 1)
    fn = host_optim.fused_adamw_ if decoupled else host_optim.fused_adam_
    fn(
        state.params,
        grads,
        state.states[0],
        state.states[1],
        [],
        state.steps,
        grad_scale=grad_scale,
        params_out=state.params_out,
        new_states=new_states,
        num_threads=num_threads,
        **hyper,
    )


def torch_sgd_step(state: State, grads, *, first: bool, grad_scale=None, **hyper) -> None:
    buffers = _widened(state.states[0]) if hyper["momentum"] else []
    torch._fused_sgd_(
        state.params,
        _widened(grads),
        buffers,
        maximize=False,
        is_first_step=first,
        grad_scale=grad_scale,
        **hyper,
    )
    if buffers and state.states[0][0].dtype != F32:
        torch._foreach_copy_(state.states[0], buffers)
    if state.params_out is not None:
        torch._foreach_copy_(state.params_out, state.params)


def host_sgd_step(state: State, grads, *, first: bool, grad_scale=None, num_threads=None, **hyper):
    host_optim.fused_sgd_(
        state.params,
        grads,
        state.states[0],
        is_first_step=first,
        grad_scale=grad_scale,
        params_out=state.params_out,
        num_threads=num_threads,
        **hyper,
    )


def _compare_adam(
    sizes, *, grad_dtype=F32, state_dtype=F32, out_dtype=None, steps=6, scale=None, **hyper
) -> None:
    mine = State.random(sizes, 2, state_dtype, out_dtype)
    ref = mine.clone()
    for step in range(steps):
        grads = _grads(sizes, grad_dtype, step)
        ref_grads = [g.clone() for g in grads]
        grad_scale = None if scale is None else torch.tensor(scale)
        host_adam_step(mine, grads, grad_scale=grad_scale, **hyper)
        torch_adam_step(ref, ref_grads, grad_scale=grad_scale, **hyper)
        mine.assert_same(ref, f"step {step + 1}")
        # fp32 gradients are left divided by the scale, as torch leaves them; 16-bit
        # gradients are not written (torch's composition divides its fp32 copy).
        expected = ref_grads if grad_dtype == F32 else _grads(sizes, grad_dtype, step)
        for i, (a, b) in enumerate(zip(grads, expected, strict=True)):
            assert_same_bits(a, b, f"step {step + 1}: grads[{i}]")


# ---- Adam / AdamW ----


@requires_torch_avx2
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("scale", [None, 3.0], ids=["no-scale", "grad-scale"])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.98)], ids=["small-lerp", "large-lerp"])
def test_adam_matches_torch_fused_kernel_bit_for_bit(decoupled, weight_decay, scale, betas):
    """fp32 params, grads and states against torch._fused_adamw_/_fused_adam_ (AdamW/Adam with
    fused=True); beta1 0.3 takes torch's other lerp branch (|1 - beta1| >= 0.5)."""
    hyper = {**ADAM, "beta1": betas[0], "beta2": betas[1], "weight_decay": weight_decay}
    _compare_adam(SIZES, scale=scale, decoupled=decoupled, **hyper)


@requires_torch_avx2
def test_adamw_decay_factor_is_one_fused_rounding_in_double():
    """torch computes 1 - lr * wd with an FMA in double: for this lr and wd the float of the
    fused result (0.74771756) differs from the float of the two-rounding one (0.74771750)."""
    lr, wd = 0.6275345128697108, 0.40202166620449353
    assert float(torch.tensor(1 - lr * wd)) != 0.747717559337616  # the unfused value
    for n in (8, 3):  # body and tail
        hyper = {**ADAM, "lr": lr, "weight_decay": wd}
        mine, ref = State.random([n], 2, F32), State.random([n], 2, F32)
        for s in (mine, ref):
            s.params[0].fill_(1.0)
            s.states[0][0].zero_()
            s.states[1][0].zero_()
        zeros = [torch.zeros(n)]
        host_adam_step(mine, zeros, decoupled=True, **hyper)
        torch_adam_step(ref, [zeros[0].clone()], decoupled=True, **hyper)
        mine.assert_same(ref, f"n={n}")
        assert float(mine.params[0][0]) == 0.747717559337616


@requires_torch_avx2
def test_adam_matches_torch_over_many_steps_and_late_steps():
    """Bias corrections at step 1..60 and at step counts near 10^6."""
    _compare_adam([5, 24, 1003], steps=60, decoupled=True, weight_decay=0.1, **ADAM)
    mine = State.random([5, 24, 1003], 2, F32)
    for s in mine.steps:
        s.fill_(999_990.0)
    ref = mine.clone()
    for step in range(3):
        grads = _grads([5, 24, 1003], F32, step)
        host_adam_step(mine, grads, decoupled=False, weight_decay=0.01, **ADAM)
        torch_adam_step(ref, [g.clone() for g in grads], decoupled=False, weight_decay=0.01, **ADAM)
        mine.assert_same(ref, f"late step {step}")


@requires_torch_avx2
@pytest.mark.parametrize("grad_dtype", [BF16, F16], ids=["bf16-grads", "fp16-grads"])
@pytest.mark.parametrize("out_dtype", [BF16, F16], ids=["bf16-out", "fp16-out"])
@pytest.mark.parametrize("scale", [None, 1024.0], ids=["no-scale", "grad-scale"])
def test_mixed_precision_step_matches_the_torch_composition(grad_dtype, out_dtype, scale):
    """16-bit grads in, fp32 masters and moments updated, 16-bit params out, in one pass: the
    same bits as widening the grads, torch._fused_adamw_ on the masters, copy_ to 16 bits."""
    hyper = {**ADAM, "weight_decay": 0.01}
    _compare_adam(
        SIZES, grad_dtype=grad_dtype, out_dtype=out_dtype, scale=scale, decoupled=True, **hyper
    )


@requires_torch_avx2
@pytest.mark.parametrize("grad_dtype", [F32, BF16])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_bf16_states_match_the_torch_composition(grad_dtype, decoupled):
    """bf16 moments: widened, updated in fp32 (the parameter update uses the fp32 values),
    rounded to nearest-even when stored, like fused fp32 Adam on widened copies + copy_."""
    hyper = {**ADAM, "weight_decay": 0.01}
    _compare_adam(
        SIZES,
        grad_dtype=grad_dtype,
        state_dtype=BF16,
        out_dtype=BF16 if grad_dtype == BF16 else None,
        decoupled=decoupled,
        **hyper,
    )


@requires_torch_avx2
def test_non_finite_values_propagate_like_torch():
    """NaN and Inf gradients, Inf states: NaN at the same places, every other bit the same."""
    sizes = [13, 1003]
    mine = State.random(sizes, 2, F32, BF16)
    ref = mine.clone()
    grads = _grads(sizes, F32, 0)
    for g in grads:
        g[::5] = float("nan")
        g[1::7] = float("inf")
        g[2::11] = -float("inf")
    mine.states[1][1][::3] = float("inf")
    ref.states[1][1][::3] = float("inf")
    host_adam_step(mine, grads, decoupled=True, weight_decay=0.01, **ADAM)
    torch_adam_step(ref, [g.clone() for g in grads], decoupled=True, weight_decay=0.01, **ADAM)
    mine.assert_same(ref, "non-finite")


def test_found_inf_skips_the_step_and_bumps_versions_otherwise():
    state = State.random([100], 2, F32)
    before = state.clone()
    grads = _grads([100], F32, 0)
    host_optim.fused_adamw_(
        state.params,
        grads,
        *state.states,
        [],
        state.steps,
        weight_decay=0.0,
        found_inf=torch.tensor(1.0),
        **ADAM,
    )
    state.assert_same(before, "found_inf=1")
    version = state.params[0]._version
    host_optim.fused_adamw_(
        state.params,
        grads,
        *state.states,
        [],
        [torch.tensor(1.0)],
        weight_decay=0.0,
        found_inf=torch.tensor(0.0),
        **ADAM,
    )
    assert not torch.equal(state.params[0], before.params[0])
    assert state.params[0]._version > version and state.states[1][0]._version > 0


# ---- SGD ----

SGD_CASES = [
    # (momentum, dampening, nesterov, weight_decay)
    (0.0, 0.0, False, 0.0),
    (0.0, 0.0, False, 0.01),
    (0.9, 0.0, False, 0.0),
    (0.9, 0.0, False, 0.01),
    (0.9, 0.3, False, 0.01),
    (0.9, 0.0, True, 0.0),
    (0.9, 0.0, True, 0.01),
]


def _compare_sgd(sizes, case, *, grad_dtype=F32, state_dtype=F32, out_dtype=None, scale=None):
    momentum, dampening, nesterov, weight_decay = case
    hyper = {
        "lr": 0.01,
        "momentum": momentum,
        "dampening": dampening,
        "nesterov": nesterov,
        "weight_decay": weight_decay,
    }
    mine = State.random(sizes, 1, state_dtype, out_dtype)
    ref = mine.clone()
    for step in range(5):
        grads = _grads(sizes, grad_dtype, step)
        ref_grads = [g.clone() for g in grads]
        grad_scale = None if scale is None else torch.tensor(scale)
        host_sgd_step(mine, grads, first=step == 0, grad_scale=grad_scale, **hyper)
        torch_sgd_step(ref, ref_grads, first=step == 0, grad_scale=grad_scale, **hyper)
        mine.assert_same(ref, f"step {step + 1}")
        if grad_dtype == F32:
            for i, (a, b) in enumerate(zip(grads, ref_grads, strict=True)):
                assert_same_bits(a, b, f"step {step + 1}: grads[{i}]")


@requires_torch_avx2
@pytest.mark.parametrize("case", SGD_CASES, ids=lambda c: "m{}-d{}-n{:d}-wd{}".format(*c))
@pytest.mark.parametrize("scale", [None, 4.0], ids=["no-scale", "grad-scale"])
def test_sgd_matches_torch_fused_sgd_bit_for_bit(case, scale):
    """fp32 against torch._fused_sgd_ (torch.optim.SGD(fused=True)), first step included."""
    _compare_sgd(SIZES, case, scale=scale)


@requires_torch_avx2
@pytest.mark.parametrize("case", [SGD_CASES[4], SGD_CASES[6]], ids=["damped", "nesterov"])
def test_sgd_mixed_precision_and_bf16_buffers_match_the_torch_composition(case):
    _compare_sgd(SIZES, case, grad_dtype=BF16, out_dtype=BF16)
    _compare_sgd(SIZES, case, grad_dtype=F16, state_dtype=BF16, out_dtype=F16, scale=8.0)


# ---- builds and threads ----


def _every_path(step_adam, step_sgd) -> list[State]:
    """Runs each kind of step (fp32, mixed, bf16 states, SGD) on fixed inputs; the states."""
    results = []
    for grad_dtype, state_dtype, out_dtype, decoupled, scale in [
        (F32, F32, None, True, None),
        (F32, F32, None, False, 2.0),
        (BF16, F32, BF16, True, None),
        (F16, BF16, F16, False, 512.0),
    ]:
        state = State.random(SIZES, 2, state_dtype, out_dtype)
        for step in range(3):
            grad_scale = None if scale is None else torch.tensor(scale)
            step_adam(
                state,
                _grads(SIZES, grad_dtype, step),
                decoupled=decoupled,
                grad_scale=grad_scale,
                weight_decay=0.01,
                **ADAM,
            )
        results.append(state)
    for case in SGD_CASES:
        state = State.random(SIZES, 1, BF16 if case[0] else F32, BF16)
        for step in range(3):
            step_sgd(
                state,
                _grads(SIZES, F32, step),
                first=step == 0,
                lr=0.01,
                momentum=case[0],
                dampening=case[1],
                nesterov=case[2],
                weight_decay=case[3],
            )
        results.append(state)
    return results


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx2 is for x86")
def test_scalar_build_gives_the_avx2_build_bits(monkeypatch):
    """CPUs without AVX2 run host_optim_math.h on every element; here the default build runs it
    on tails only. Build the scalar-only variant and compare every path."""
    lanes = _every_path(host_adam_step, host_sgd_step)
    scalar = host_optim.load_library(extra_flags=["-mno-avx2"])
    assert not scalar.has_avx2
    monkeypatch.setitem(host_optim._libraries, "cpu", scalar)
    for k, (a, b) in enumerate(zip(_every_path(host_adam_step, host_sgd_step), lanes, strict=True)):
        a.assert_same(b, f"path {k}")


def test_results_do_not_depend_on_the_thread_count():
    def with_threads(n):
        def adam(*args, **kwargs):
            host_adam_step(*args, num_threads=n, **kwargs)

        def sgd(*args, **kwargs):
            host_sgd_step(*args, num_threads=n, **kwargs)

        return _every_path(adam, sgd)

    one = with_threads(1)
    for n in (2, 3):
        for k, (a, b) in enumerate(zip(with_threads(n), one, strict=True)):
            a.assert_same(b, f"{n} threads, path {k}")


def _nan_at(offset: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor like ``like``, of NaN, starting ``offset`` elements into its allocation."""
    return torch.full((offset + like.numel(),), float("nan"), dtype=like.dtype)[offset:]


def host_adam_step_out_of_place(
    state: State, grads, offset: int = 0, params_in_place: bool = False, **kwargs
) -> None:
    """The update written to new tensors ``offset`` elements into their allocations (0: the
    lanes stream them; 5 and 8, 20 and 32 bytes off a line: the first elements go one at a
    time until they are 64-byte aligned, then the lanes stream whole lines), the
    inputs left as they were, then taken. ``params_in_place``: only the moments go elsewhere
    (fp32 training's speculative update)."""
    before = state.clone()
    new = host_optim.NewStates(
        state.params if params_in_place else [_nan_at(offset, p) for p in state.params],
        *([_nan_at(offset, t) for t in states] for states in state.states),
    )
    host_adam_step(state, grads, new_states=new, **kwargs)
    kept_inputs = [*state.states[0], *state.states[1]]
    if not params_in_place:
        kept_inputs += state.params
        before_inputs = [*before.states[0], *before.states[1], *before.params]
    else:
        before_inputs = [*before.states[0], *before.states[1]]
    for old, kept in zip(kept_inputs, before_inputs, strict=True):
        assert_same_bits(old, kept, "an input of the update out of place")
    state.params, state.states = list(new.params), [list(new.exp_avgs), list(new.exp_avg_sqs)]


@pytest.fixture(params=["streamed", "cached"])
def row_stores(request):
    """Rows written elsewhere streamed or through the cache (kernels/row_stores.py), then
    measured again as every process starts."""
    set_row_stores(request.param)
    try:
        yield request.param
    finally:
        set_row_stores("measure")


@pytest.mark.parametrize("params_in_place", [False, True], ids=["all", "moments"])
@pytest.mark.parametrize("offset", [0, 5, 8], ids=["aligned", "unaligned", "half-line-off"])
def test_an_update_out_of_place_gives_the_in_place_bits_and_leaves_its_inputs(
    offset, params_in_place, row_stores
):
    """Every kind of Adam step, fp32, mixed and bf16 states, with and without grad scale;
    every row written elsewhere, or the moments only; the rows streamed or cached."""
    in_place = _every_path(host_adam_step, host_sgd_step)
    out_of_place = _every_path(
        functools.partial(
            host_adam_step_out_of_place, offset=offset, params_in_place=params_in_place
        ),
        host_sgd_step,
    )
    for k, (a, b) in enumerate(zip(out_of_place, in_place, strict=True)):
        a.assert_same(b, f"path {k}")


def host_adam_step_saving_grads(state: State, grads, offset: int = 0, **kwargs) -> None:
    """The update with every other gradient saved ``offset`` elements into a NaN buffer (0:
    the lanes stream the copies; 3, and 16, half a line of 16-bit gradients off: they store
    them through the cache), out of place and in
    place alternately; the saved gradients are the inputs' bits, before any division."""
    before = [g.clone() for g in grads]
    saved = [_nan_at(offset, g) if i % 2 == 0 else None for i, g in enumerate(grads)]
    step = host_adam_step_out_of_place if int(state.steps[0]) % 2 else host_adam_step
    step(state, grads, grads_saved=saved, **kwargs)
    for i, (copy, grad) in enumerate(zip(saved, before, strict=True)):
        if copy is not None:
            assert_same_bits(copy, grad, f"the saved gradient {i}")


@pytest.mark.parametrize("offset", [0, 3, 16], ids=["aligned", "unaligned", "half-line-off"])
def test_an_update_saves_the_gradients_it_reads_and_gives_the_same_bits(offset, row_stores):
    """Every kind of Adam step, fp32 gradients divided where they lie included; the saved
    rows streamed or cached."""
    plain = _every_path(host_adam_step, host_sgd_step)
    saving = _every_path(
        functools.partial(host_adam_step_saving_grads, offset=offset), host_sgd_step
    )
    for k, (a, b) in enumerate(zip(saving, plain, strict=True)):
        a.assert_same(b, f"path {k}")


def test_saved_gradients_are_checked():
    state = State.random([10], 2, F32)
    grads = _grads([10], BF16, 0)
    with pytest.raises(TypeError, match=r"grads_saved\[0\] has dtype torch.float32"):
        host_optim.fused_adamw_(
            state.params, grads, *state.states, [], state.steps,
            grads_saved=[torch.zeros(10)], **ADAM, weight_decay=0.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"grads_saved has 2 entries but grads has 1"):
        host_optim.fused_adamw_(
            state.params, grads, *state.states, [], state.steps,
            grads_saved=[None, None], **ADAM, weight_decay=0.0,
        )  # fmt: skip


def test_an_update_out_of_place_refuses_found_inf():
    """A skipped step would leave the outputs unwritten, and a caller would swap them in."""
    state = State.random([10], 2, F32)
    new = host_optim.NewStates([torch.zeros(10)], [torch.zeros(10)], [torch.zeros(10)])
    with pytest.raises(ValueError, match="found_inf with new_states"):
        host_optim.fused_adamw_(
            state.params, _grads([10], F32, 0), *state.states, [], state.steps,
            found_inf=torch.zeros(()), new_states=new, **ADAM, weight_decay=0.0,
        )  # fmt: skip


def test_an_update_out_of_place_checks_its_outputs():
    state = State.random([10], 2, F32)
    new = host_optim.NewStates([torch.zeros(10)], [torch.zeros(10)], [torch.zeros(9)])
    with pytest.raises(ValueError, match=r"new_states.exp_avg_sqs\[0\] has 9 elements"):
        host_optim.fused_adamw_(
            state.params, _grads([10], F32, 0), *state.states, [], state.steps,
            new_states=new, **ADAM, weight_decay=0.0,
        )  # fmt: skip
    bf16 = host_optim.NewStates([torch.zeros(10)], [torch.zeros(10, dtype=BF16)], [torch.zeros(10)])
    with pytest.raises(TypeError, match="new_states.exp_avgs"):
        host_optim.fused_adamw_(
            state.params, _grads([10], F32, 0), *state.states, [], state.steps,
            new_states=bf16, **ADAM, weight_decay=0.0,
        )  # fmt: skip


def test_a_missing_compiler_raises_instead_of_falling_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("CHUNKMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(host_optim, "_libraries", {})
    state = State.random([10], 2, F32)
    for _ in range(2):  # the failure is remembered and raised again
        with pytest.raises(BuildError, match="no-such-compiler not found"):
            host_adam_step(state, _grads([10], F32, 0), decoupled=True, weight_decay=0.0, **ADAM)


# ---- bad arguments ----


def _adam_args(n=16):
    return {
        "params": [torch.zeros(n)],
        "grads": [torch.zeros(n)],
        "exp_avgs": [torch.zeros(n)],
        "exp_avg_sqs": [torch.zeros(n)],
        "max_exp_avg_sqs": [],
        "state_steps": [torch.tensor(1.0)],
        "weight_decay": 0.0,
        **ADAM,
    }


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"params": [torch.zeros(16, dtype=BF16)]},
            TypeError,
            r"params\[0\] has dtype torch.bfloat16",
        ),
        ({"params": [torch.zeros(32)[::2]]}, ValueError, r"params\[0\] is not contiguous"),
        ({"params": [torch.zeros(16, device="meta")]}, ValueError, r"params\[0\] is on meta"),
        (
            {"grads": [torch.zeros(15)]},
            ValueError,
            r"grads\[0\] has 15 elements but params\[0\] has 16",
        ),
        (
            {"grads": [torch.zeros(16, dtype=torch.float64)]},
            TypeError,
            r"grads\[0\] has dtype torch.float64",
        ),
        ({"grads": []}, ValueError, "grads has 0 tensors but params has 1"),
        (
            {"exp_avgs": [torch.zeros(16, dtype=F16)]},
            TypeError,
            r"exp_avgs\[0\] has dtype torch.float16",
        ),
        ({"exp_avgs": [torch.zeros(16, dtype=BF16)]}, TypeError, "both states must have one dtype"),
        (
            {"state_steps": [torch.tensor(1)]},
            TypeError,
            r"state_steps\[0\] must be a one-element float32",
        ),
        ({"state_steps": []}, ValueError, "state_steps has 0 tensors"),
        ({"max_exp_avg_sqs": [torch.zeros(16)]}, ValueError, "amsgrad is not supported"),
        ({"amsgrad": True}, ValueError, "amsgrad is not supported"),
        ({"maximize": True}, ValueError, "maximize=True is not supported"),
        ({"grad_scale": torch.tensor([1.0, 2.0])}, TypeError, "grad_scale must be a one-element"),
        (
            {"grad_scale": 2.0},
            TypeError,
            "grad_scale must be a one-element float32 CPU tensor, got a float",
        ),
        ({"params_out": [torch.zeros(16)]}, TypeError, r"params_out\[0\] has dtype torch.float32"),
        (
            {"params_out": [torch.zeros(8, dtype=BF16)]},
            ValueError,
            r"params_out\[0\] has 8 elements",
        ),
        ({"num_threads": 0}, ValueError, "num_threads must be a positive int, got 0"),
    ],
)
def test_bad_arguments_are_named(change, error, match):
    args = {**_adam_args(), **change}
    before = _adam_args()["params"][0]
    with pytest.raises(error, match=match):
        host_optim.fused_adamw_(**args)
    if "params" not in change:
        assert torch.equal(args["params"][0], before)  # nothing written


def test_one_dtype_per_list_and_sgd_arguments():
    args = _adam_args()
    args["params"] = [torch.zeros(4), torch.zeros(4)]
    args["grads"] = [torch.zeros(4), torch.zeros(4, dtype=BF16)]
    args["exp_avgs"] = args["exp_avg_sqs"] = [torch.zeros(4), torch.zeros(4)]
    args["state_steps"] = [torch.tensor(1.0), torch.tensor(1.0)]
    with pytest.raises(TypeError, match=r"grads\[1\] has dtype torch.bfloat16 but grads\[0\]"):
        host_optim.fused_adamw_(**args)
    sgd = {"weight_decay": 0.0, "lr": 0.1, "dampening": 0.0, "is_first_step": True}
    with pytest.raises(ValueError, match="Nesterov momentum requires momentum > 0"):
        host_optim.fused_sgd_(
            [torch.zeros(4)], [torch.zeros(4)], [], momentum=0.0, nesterov=True, **sgd
        )
    with pytest.raises(ValueError, match="momentum_buffer_list has 0 tensors"):
        host_optim.fused_sgd_(
            [torch.zeros(4)], [torch.zeros(4)], [], momentum=0.9, nesterov=False, **sgd
        )
    p = torch.ones(4)
    host_optim.fused_sgd_([p], [torch.ones(4)], [], momentum=0.0, nesterov=False, **sgd)
    assert torch.equal(p, torch.full((4,), 0.9))


def test_empty_lists_and_empty_tensors_are_no_ops():
    assert host_optim.fused_adamw_([], [], [], [], [], [], weight_decay=0.0, **ADAM) is None
    args = _adam_args(0)
    assert host_optim.fused_adamw_(**args) is None
    assert [t.numel() for t in args["params"] + args["exp_avgs"] + args["exp_avg_sqs"]] == [0] * 3
    assert float(args["state_steps"][0]) == 1.0, "the caller advances step counts, not the kernel"


@requires_torch_avx2
@pytest.mark.parametrize("out_dtype", [BF16, F16])
@pytest.mark.parametrize("offset", [0, 8], ids=["aligned", "16-bytes-off"])
def test_large_calls_stream_the_16_bit_copy_with_the_same_bits(out_dtype, offset):
    """From 4M elements per call the 16-bit copy is written with streaming stores where it is
    32-byte aligned; a copy that starts 16 bytes off takes the ordinary stores."""
    n = (1 << 22) + 13
    mine = State.random([n], 2, F32, out_dtype)
    backing = torch.empty(n + offset, dtype=out_dtype)
    mine.params_out[0] = backing[offset:].copy_(mine.params_out[0])
    assert (mine.params_out[0].data_ptr() % 32 == 0) == (offset == 0)
    ref = mine.clone()
    for step in range(2):
        grads = _grads([n], BF16, step)
        host_adam_step(mine, grads, decoupled=True, weight_decay=0.01, **ADAM)
        torch_adam_step(ref, [g.clone() for g in grads], decoupled=True, weight_decay=0.01, **ADAM)
        mine.assert_same(ref, f"step {step + 1}")
    sgd = {"lr": 0.01, "momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 0.01}
    mine = State(mine.params, [mine.states[0]], mine.steps, mine.params_out)
    ref = State(ref.params, [ref.states[0]], ref.steps, ref.params_out)
    grads = _grads([n], F16, 2)
    host_sgd_step(mine, grads, first=False, **sgd)
    torch_sgd_step(ref, [g.clone() for g in grads], first=False, **sgd)
    mine.assert_same(ref, "sgd")
