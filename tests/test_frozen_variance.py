"""1-bit Adam's second stage (``compression.freeze_variance``): the frozen-variance update
against a reference from the paper and against torch's own fused kernel, and in the engine at
ZeRO 1-3 (with host offload): the second moment stops at the warm-up's last exact step, the
first moment goes on, training follows exact training, and a resumed run is bit for bit."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

import chunkmem
from chunkmem import frozen_adam
from chunkmem.chunk import ChunkKind
from chunkmem.frozen_adam import frozen_variance_adam_
from kernels import host_optim
from kernels.host_optim import NewStates
from tests.distributed_helpers import one_rank_at_a_time, run_threads
from tests.test_checkpoints import moments
from tests.test_compression import (
    WORLD,
    _batch,
    _engine,
    assert_trains_like,
    moved_since,
    parameters,
    train_recorded,
)

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
    they were and the outputs hold the bits of the update in place; the gradients it read are
    saved and measured as the host kernels do."""
    g = torch.Generator().manual_seed(4)
    sizes = [100, 7]
    inputs = [[torch.randn(n, generator=g) for n in sizes] for _ in range(2)]
    inputs.append([torch.rand(n, generator=g) * 1e-2 for n in sizes])
    grads = [torch.randn(n, generator=g) for n in sizes]
    kept = [[t.clone() for t in ts] for ts in inputs]
    in_place = [[t.clone() for t in ts] for ts in inputs]
    new = NewStates(*([torch.full_like(t, float("nan")) for t in ts] for ts in inputs))
    saved = [torch.full_like(grads[0], float("nan")), None]
    norms = torch.full((2,), float("nan"))
    for states, out, saves, measured in ((in_place, None, None, None), (inputs, new, saved, norms)):
        frozen_variance_adam_(
            states[0], grads, states[1], states[2], [], [torch.tensor(9.0)] * 2, **HYPER,
            decoupled=True, steps_frozen=2, new_states=out, grads_saved=saves,
            grad_norms=measured,
        )  # fmt: skip
    assert torch.equal(saved[0], grads[0]), "the gradient saved as the update read it"
    assert torch.equal(norms, torch.stack(host_optim.norms(grads))), "the host kernels' norms"
    for before, after in zip(kept, inputs, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    for want, got in zip(in_place, new, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_an_element_no_warmup_step_reached_takes_no_step(state_dtype, caplog) -> None:
    """Elements whose frozen variance is 0 (no warm-up gradient reached them: an embedding row
    of a token the warm-up never saw; a sign code gives such an element +-scale) take no step,
    where ``lr * m / eps`` would throw them by some 10^5 ``lr``; the others step (their values:
    the reference test above); the first frozen step warns with the count, later ones do not."""
    param, grad = torch.ones(6), torch.tensor([0.5, -2.0, 0.0, 0.5, -2.0, 0.0])
    exp_avg = torch.zeros(6)
    exp_avg_sq = torch.tensor([0.0, 0.0, 0.0, 1e-4, 1e-4, 1e-4]).to(state_dtype)
    before = (param.clone(), exp_avg.clone(), exp_avg_sq.clone())
    for steps_frozen in (1, 2):
        step = 8.0 + steps_frozen
        caplog.clear()
        frozen_variance_adam_(
            [param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(step)], **HYPER,
            decoupled=True, steps_frozen=steps_frozen,
        )  # fmt: skip
        warned = [r.getMessage()[:39] for r in caplog.records if "freeze_var" in r.getMessage()]
        assert warned == (["compression.freeze_variance: 3 of the 6"] if steps_frozen == 1 else [])
    decay = (1 - HYPER["lr"] * HYPER["weight_decay"]) ** 2
    assert torch.allclose(param[:3], before[0][:3] * decay, rtol=0, atol=1e-7), "decay alone"
    assert torch.equal(exp_avg_sq, before[2])
    assert (param[3:5] - before[0][3:5] * decay).abs().min() > 1e-3, "the others step"


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
    initial = parameters(engine)
    after, losses = [], []
    for step in range(steps):
        loss = engine(*_batch(step, comm.rank))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        after.append(moments(engine))
    return {"moments": after, "losses": losses, "moved": moved_since(engine, initial)}


def _kind(state: dict, kind: ChunkKind) -> list[torch.Tensor]:
    layouts = sorted(key for key in state if isinstance(key, tuple) and key[1] == kind.value)
    return [state[key] for key in layouts if state[key] is not None]


@pytest.mark.parametrize(
    ("stage", "offload"), [(1, "none"), (2, "none"), (3, "none"), (2, "host"), (3, "host")]
)
def test_the_variance_freezes_after_the_warmup(stage: int, offload: str) -> None:
    """Steps 1-2 exact (the variance moves), steps 3-5 compressed with the variance of step 2
    to the bit while the first moment moves; losses within 10% of exact training, and the
    parameters moved as exact training moved them."""
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
        assert_trains_like(ours[rank]["moved"], exact[rank]["moved"], (stage, offload, rank))


def test_the_engine_freezes_at_the_last_warmup_step(monkeypatch) -> None:
    """The update builder hands the frozen update ``steps_frozen`` = 1, 2, 3 on the compressed
    steps 3, 4 and 5 (each parameter at Adam step 3, 4, 5 then corrects by step 2, the last
    exact one), and nothing on the exact steps."""
    import chunkmem.update_rules as update_rules

    calls: list[int] = []

    def spy(*args, steps_frozen: int, **kwargs) -> None:
        steps = {float(s) for s in args[5]}
        assert steps == {steps_frozen + FROZEN["warmup_steps"]}, "Adam's step = the counter's"
        calls.append(steps_frozen)
        frozen_variance_adam_(*args, steps_frozen=steps_frozen, **kwargs)

    monkeypatch.setattr(update_rules, "frozen_variance_adam_", spy)
    run_threads(train_with_moments, 2, FROZEN, 2, "none", 5, timeout_s=60)
    assert calls and set(calls) == {1, 2, 3}
    # steps 3, 4 and 5 of each rank: one call per parameter group and layout each
    assert len(calls) % 3 == 0


class Lookup(nn.Module):
    """An embedding whose upper rows no warm-up batch reads (the tokens a short warm-up never
    sees), then a readout."""

    ROWS, WIDTH = 32, 8

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(self.ROWS, self.WIDTH)
        self.out = nn.Linear(self.WIDTH, 1)

    def forward(self, tokens: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.out(self.table(tokens)).squeeze(-1), y)


def train_rows_unseen_in_the_warmup(comm) -> list[torch.Tensor]:
    """1-bit Adam (2 exact steps on rows 0-15, then compressed steps on all 32 rows) at
    ZeRO-2, bf16, clipping 1.0: the embedding table after the warm-up and after each step."""
    with one_rank_at_a_time(comm):
        torch.manual_seed(0)
        module = Lookup()
    engine = chunkmem.initialize(module, comm=comm, config={
        "device": {"type": "simulated", "capacity": "16MiB"}, "precision": "bf16",
        "zero": {"stage": 2, "timeout_s": 30}, "gradient_clipping": 1.0,
        "optimizer": {"lr": HYPER["lr"], "weight_decay": 0.0}, "compression": FROZEN,
        "chunk": {"size": 512},
    })  # fmt: skip
    tables = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + comm.rank)
        rows = Lookup.ROWS // 2 if step < FROZEN["warmup_steps"] else Lookup.ROWS
        tokens = torch.randint(0, rows, (8, 4), generator=g)
        loss = engine(tokens, torch.randn(8, 4, generator=g))
        engine.backward(loss)
        engine.step()
        if step >= FROZEN["warmup_steps"] - 1:
            tables.append(engine.state_dict()["table.weight"].clone())
    return tables


def test_rows_no_warmup_step_reached_stay_still_in_the_engine(caplog) -> None:
    """In the engine, rows the warm-up never read keep their values under the frozen variance
    (they moved by some 10^3 with a frozen 0 in the denominator) while the rows it read train,
    and each rank's first frozen step says how many elements stay still."""
    for tables in run_threads(train_rows_unseen_in_the_warmup, WORLD, timeout_s=60):
        seen, unseen = slice(None, Lookup.ROWS // 2), slice(Lookup.ROWS // 2, None)
        for before, after in itertools.pairwise(tables):
            assert torch.equal(after[unseen], before[unseen])
            assert not torch.equal(after[seen], before[seen])
    assert any("had no gradient in the exact warm-up" in r.getMessage() for r in caplog.records)
