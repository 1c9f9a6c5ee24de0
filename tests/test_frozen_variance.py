"""1-bit Adam's second stage (``compression.freeze_variance``): the frozen-variance update
against a reference from the paper and against torch's own fused kernel, and in the engine at
ZeRO 1-3 (with host offload): the second moment stops at the warm-up's last exact step, the
first moment goes on, training follows exact training, and a resumed run is bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from chunkmem import frozen_adam
from chunkmem.chunk import ChunkKind
from chunkmem.frozen_adam import frozen_variance_adam_
from kernels.host_optim import NewStates
from tests.distributed_helpers import run_threads
from tests.test_checkpoints import moments
from tests.test_compression import WORLD, _batch, _engine, train_recorded

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.1, "eps": 1e-8}


def reference_step(param, grad, exp_avg, exp_avg_sq, step, last_exact, decoupled, scale):
    """Tang et al. (2021), Algorithm 1's compression stage with Adam's bias corrections, in
    float64: the first moment moves, the variance ``v_{T_w}`` stays."""
    p, g, m, v = (t.double() for t in (param, grad, exp_avg, exp_avg_sq))
    g = g / scale
    lr, beta1, beta2, wd, eps = (HYPER[k] for k in ("lr", "beta1", "beta2", "weight_decay", "eps"))
    if decoupled:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    m = beta1 * m + (1 - beta1) * g
    v_hat = v / (1 - beta2**last_exact)
    p = p - lr / (1 - beta1**step) * m / (v_hat.sqrt() + eps)
    return p, m


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_update_equals_the_papers_reference(decoupled, grad_dtype, monkeypatch) -> None:
    """Over tensors longer than a slice (so slices are stitched), fp32 masters with 16-bit
    gradients and outputs: parameters and first moments as the reference, variance untouched
    bit for bit. Parameters at different Adam steps (one resumed from a checkpoint without
    the compressor's count, say) each correct by their own last exact step."""
    monkeypatch.setattr(frozen_adam, "SLICE_ELEMENTS", 64)
    g = torch.Generator().manual_seed(3)
    sizes = [200, 64, 7]
    params = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g).to(grad_dtype) for n in sizes]
    exp_avgs = [0.1 * torch.randn(n, generator=g) for n in sizes]
    exp_avg_sqs = [torch.rand(n, generator=g) * 1e-2 for n in sizes]
    steps = [torch.tensor(9.0), torch.tensor(9.0), torch.tensor(4.0)]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    before = [
        (p.clone(), m.clone(), v.clone())
        for p, m, v in zip(params, exp_avgs, exp_avg_sqs, strict=True)
    ]
    frozen_variance_adam_(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, **HYPER,
        decoupled=decoupled, steps_frozen=2, grad_scale=torch.tensor(4.0), params_out=outs,
    )  # fmt: skip
    for i, (p0, m0, v0) in enumerate(before):
        want_p, want_m = reference_step(
            p0, grads[i], m0, v0, float(steps[i]), float(steps[i]) - 2, decoupled, scale=4.0
        )
        assert torch.allclose(params[i].double(), want_p, rtol=1e-6, atol=1e-7)
        assert torch.allclose(exp_avgs[i].double(), want_m, rtol=1e-6, atol=1e-8)
        assert torch.equal(exp_avg_sqs[i], v0)
        assert torch.equal(outs[i], params[i].bfloat16())
        assert not torch.equal(params[i], p0)


def test_an_update_out_of_place_equals_the_one_in_place() -> None:
    """With ``new_states`` (a speculative update: offload/speculation.py) the inputs stay as
    they were and the outputs hold the bits of the update in place."""
    g = torch.Generator().manual_seed(4)
    sizes = [100, 7]
    inputs = [[torch.randn(n, generator=g) for n in sizes] for _ in range(2)]
    inputs.append([torch.rand(n, generator=g) * 1e-2 for n in sizes])
    grads = [torch.randn(n, generator=g) for n in sizes]
    kept = [[t.clone() for t in ts] for ts in inputs]
    in_place = [[t.clone() for t in ts] for ts in inputs]
    new = NewStates(*([torch.full_like(t, float("nan")) for t in ts] for ts in inputs))
    saved = [torch.full_like(grads[0], float("nan")), None]
    for states, out, saves in ((in_place, None, None), (inputs, new, saved)):
        frozen_variance_adam_(
            states[0], grads, states[1], states[2], [], [torch.tensor(9.0)] * 2, **HYPER,
            decoupled=True, steps_frozen=2, new_states=out, grads_saved=saves,
        )  # fmt: skip
    assert torch.equal(saved[0], grads[0]), "the gradient saved as the update read it"
    for before, after in zip(kept, inputs, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    for want, got in zip(in_place, new, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_bad_arguments_are_refused() -> None:
    one = [torch.zeros(4)]
    with pytest.raises(ValueError, match="steps_frozen must be >= 1"):
        frozen_variance_adam_(
            one, one, one, one, [], [torch.tensor(1.0)], **HYPER, decoupled=True, steps_frozen=0
        )
    with pytest.raises(ValueError, match="no exact step before its variance froze"):
        frozen_variance_adam_(
            one, one, one, one, [], [torch.tensor(2.0)], **HYPER, decoupled=True, steps_frozen=2
        )
    with pytest.raises(ValueError, match="amsgrad"):
        frozen_variance_adam_(
            one, one, one, one, one, [torch.tensor(1.0)], **HYPER, decoupled=True, steps_frozen=1
        )


# ---------------------------------------------------------------- in the engine

FROZEN = {"type": "onebit", "warmup_steps": 2, "freeze_variance": True}


def train_with_moments(comm, compression: dict, stage: int, offload: str, steps: int) -> dict:
    """bf16, clipping 1.0: this rank's moments after every step."""
    extra = {"offload": {"optimizer": offload}} if offload != "none" else {}
    engine = _engine(
        comm, compression, stage, precision="bf16", gradient_clipping=1.0, chunk={"size": 512},
        **extra,
    )  # fmt: skip
    after, losses = [], []
    for step in range(steps):
        loss = engine(*_batch(step, comm.rank))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        after.append(moments(engine))
    return {"moments": after, "losses": losses}


def _kind(state: dict, kind: ChunkKind) -> list[torch.Tensor]:
    layouts = sorted(key for key in state if isinstance(key, tuple) and key[1] == kind.value)
    return [state[key] for key in layouts if state[key] is not None]


@pytest.mark.parametrize(
    ("stage", "offload"), [(1, "none"), (2, "none"), (3, "none"), (2, "host"), (3, "host")]
)
def test_the_variance_freezes_after_the_warmup(stage: int, offload: str) -> None:
    """Steps 1-2 exact (the variance moves), steps 3-5 compressed with the variance of step 2
    to the bit while the first moment moves; losses within 10% of exact training."""
    ours = run_threads(train_with_moments, WORLD, FROZEN, stage, offload, 5, timeout_s=60)
    exact = run_threads(train_recorded, WORLD, {"type": "none"}, stage, "bf16", 5, timeout_s=60)
    for rank in range(WORLD):
        states = ours[rank]["moments"]
        variances = [_kind(s, ChunkKind.EXP_AVG_SQ) for s in states]
        firsts = [_kind(s, ChunkKind.EXP_AVG) for s in states]
        assert variances[1], "this rank holds optimizer states"
        assert any(not torch.equal(a, b) for a, b in zip(variances[0], variances[1], strict=True))
        for later in variances[2:]:
            assert all(torch.equal(a, b) for a, b in zip(later, variances[1], strict=True))
        for before, now in zip(firsts[2:], firsts[3:], strict=False):
            assert any(not torch.equal(a, b) for a, b in zip(before, now, strict=True))
        for a, b in zip(ours[rank]["losses"], exact[rank]["losses"], strict=True):
            assert math.isfinite(a) and abs(a - b) <= 0.1 * b, (stage, offload, rank)


def test_the_engine_freezes_at_the_last_warmup_step(monkeypatch) -> None:
    """The update builder hands the frozen update ``steps_frozen`` = 1, 2, 3 on the compressed
    steps 3, 4 and 5 (each parameter at Adam step 3, 4, 5 then corrects by step 2, the last
    exact one), and nothing on the exact steps."""
    import chunkmem.adam_groups as adam_groups

    calls: list[int] = []

    def spy(*args, steps_frozen: int, **kwargs) -> None:
        steps = {float(s) for s in args[5]}
        assert steps == {steps_frozen + FROZEN["warmup_steps"]}, "Adam's step = the counter's"
        calls.append(steps_frozen)
        frozen_variance_adam_(*args, steps_frozen=steps_frozen, **kwargs)

    monkeypatch.setattr(adam_groups, "frozen_variance_adam_", spy)
    run_threads(train_with_moments, 2, FROZEN, 2, "none", 5, timeout_s=60)
    assert calls and set(calls) == {1, 2, 3}
    # steps 3, 4 and 5 of each rank: one call per parameter group and layout each
    assert len(calls) % 3 == 0
