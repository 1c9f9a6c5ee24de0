"""Deep Gradient Compression (``compression.type: dgc``): the block norms bit for bit against the
reference, the selection's ties and NaNs, the reduction against a reference written from the
paper (Lin et al., 2018: accumulation, local clipping, momentum correction and factor masking,
coarse blocks), the momentum-in-gradients Adam step, training in composition, checkpoints with
resharding, and the refusals. Training at ZeRO 1-3 and the estimate against the ledger are
tests/test_compression.py's, with DGC among their cases."""

from __future__ import annotations

import math

import pytest
import torch

import chunkmem
from chunkmem.errors import ConfigError
from chunkmem.frozen_adam import frozen_variance_adam_
from kernels import compression as codes_ops
from kernels import compression_reference as reference
from tests.distributed_helpers import run_ranks, run_threads
from tests.test_compression import (
    COMPOSITIONS,
    DGC_PAPER,
    NATIVE_BACKENDS,
    WORLD,
    Recording,
    _batch,
    _engine,
    _same_bits,
    assert_trains_like,
    train_composed,
)
from tests.test_frozen_variance import HYPER
from zero.compression.topk import TopKSettings
from zero.kinds import DGC_VELOCITY, EF_RESIDUAL

PAPER = DGC_PAPER
# The paper's own recipe: SGD, whose momentum is the compressor's velocity u = m u + g.
PAPER_SGD = {k: v for k, v in DGC_PAPER.items() if k != "freeze_variance"}
SGD = {"type": "sgd", "lr": 0.05}

# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize("block", [32, 256, 4096])
def test_block_norms_match_the_reference_bit_for_bit(backend: str, block: int) -> None:
    torch.manual_seed(block)
    n = block * 7
    x = torch.randn(n) * torch.rand(n) * 10.0 ** torch.randint(-20, 20, (n,)).float()
    x[block + 1] = float("nan")
    x[2 * block + 3] = float("inf")
    device = "cuda" if backend == "cuda" else "cpu"
    ours = torch.empty(n // block, device=device)
    codes_ops.block_sq_norms(x.to(device), block=block, out=ours, backend=backend)
    assert _same_bits(ours.cpu(), reference.block_sq_norms(x, block))
    assert ours[1].isnan() and ours[2].isinf()


def test_block_norms_are_sums_of_squares() -> None:
    x = torch.arange(64, dtype=torch.float32)
    norms = torch.empty(2)
    codes_ops.block_sq_norms(x, block=32, out=norms)
    assert norms.tolist() == [float((x[:32] ** 2).sum()), float((x[32:] ** 2).sum())]


def test_top_blocks_keep_the_lower_index_on_ties_and_rank_nan_first() -> None:
    norms = torch.tensor([[1.0, 5.0, 5.0, 2.0, 5.0], [0.0, float("nan"), 3.0, 3.0, 1.0]])
    assert codes_ops.top_blocks(norms, 2).tolist() == [[1, 2], [1, 2]]
    assert codes_ops.top_blocks(norms, 5).tolist() == [[0, 1, 2, 3, 4]] * 2
    with pytest.raises(ValueError, match="at least 6 blocks"):
        codes_ops.top_blocks(norms, 6)


def test_gather_and_add_blocks_move_whole_blocks() -> None:
    x = torch.arange(2 * 4 * 2, dtype=torch.float32).view(2, 8)  # 2 rows of 4 blocks of 2
    index = torch.tensor([[0, 3], [1, 2]])
    out = torch.empty(2 * 2 * 2, dtype=torch.bfloat16)
    codes_ops.gather_blocks(x, index, 2, out)
    assert out.float().tolist() == [0, 1, 6, 7, 10, 11, 12, 13]
    total = torch.ones(8)
    codes_ops.add_blocks(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([3, 0]), 2, total)
    assert total.tolist() == [4, 5, 1, 1, 1, 1, 2, 3]


def test_the_density_warms_up_exponentially_to_its_target() -> None:
    settings = TopKSettings(32, 0.001, 4, 2, 0.9, 0.0)
    densities = [settings.density_at(step) for step in range(3, 9)]
    want = [0.25 * (0.004) ** (i / 4) for i in range(4)] + [0.001, 0.001]
    assert densities == pytest.approx(want)
    assert settings.blocks_sent(1000, 0.001) == 1  # at least one block
    assert settings.blocks_sent(1000, 1.0) == math.ceil(1000 / 32)


# ---------------------------------------------------------------- the reduction


def train_dgc(
    comm, compression: dict, stage: int, steps: int, clipping: float, optimizer: dict
) -> dict:
    engine = _engine(
        comm,
        compression,
        stage,
        precision="fp32",
        gradient_clipping=clipping,
        chunk={"size": 512},
        optimizer=optimizer,
    )
    log: list[dict] = []
    engine.reducer.reduction.compressed = Recording(engine.reducer.reduction.compressed, log)
    clipped_globally = []
    for step in range(steps):
        engine.backward(engine(*_batch(step, comm.rank)))
        engine.step()
        clipped_globally.append(engine.reducer.global_clipping(clipping))
    by_kind = {
        kind: sum(t.by_kind[kind.value] for t in engine.ledger.tiers.values())
        for kind in (EF_RESIDUAL, DGC_VELOCITY)
    }
    capacity = sum(layout.capacity for layout in engine.params.trainable_layouts())
    trainable = sum(layout.used for layout in engine.params.trainable_layouts())
    return {
        "log": log,
        "trainable_used": trainable,
        "capacity": capacity,
        "by_kind": by_kind,
        "clipped_globally": clipped_globally,
    }


def _paper_reference(entries: list[dict], settings: TopKSettings, trainable: int, step: int):
    """Lin et al. (2018), Algorithm 1 with coarse blocks, per rank in fp32: local clipping,
    u = m u + (1 - m) g under Adam, m u + g under SGD (momentum correction), v += u, the top-k blocks of v by L2 norm in
    each destination slice, sent blocks masked in u and v; each shard the sum of the blocks
    sent to it. Returns (shards, residuals, velocities)."""
    world = len(entries)
    n = entries[0]["full"].numel() // world
    g_block = settings.block
    s = settings.slice_numel(n)
    k = settings.blocks_sent(n, settings.density_at(step))
    sent, residuals, velocities = [], [], []
    for entry in entries:
        g = entry["full"]
        if settings.gradient_clipping:
            # the paper's N^(-1/2) of a threshold on the sum is sqrt(N) of one on the mean
            share = math.sqrt(entry["used"] / trainable * world)
            norm = float(g.norm())
            g = g * min(1.0, settings.gradient_clipping * share / (norm + 1e-6))
        u, v = entry["velocity"].clone(), entry["before"].clone()
        if settings.momentum is not None:
            weight = (1 - settings.momentum) if settings.velocity_averages else 1.0
            u = settings.momentum * u + weight * g
            v = v + u
        else:
            v = v + g
        padded = torch.zeros(world, s)
        padded[:, :n] = v.view(world, n)
        blocks = padded.view(world, s // g_block, g_block)
        norms = (blocks.double() ** 2).sum(dim=2)
        chosen = [
            sorted(norms[j].argsort(descending=True, stable=True)[:k].tolist())
            for j in range(world)
        ]
        mask = torch.zeros(world, s // g_block, dtype=torch.bool)
        for j, picks in enumerate(chosen):
            mask[j, picks] = True
        sent.append(torch.where(mask.unsqueeze(2), blocks, 0.0).view(world, s)[:, :n])
        full_mask = mask.unsqueeze(2).expand(-1, -1, g_block).reshape(world, s)[:, :n].reshape(-1)
        residuals.append(torch.where(full_mask, 0.0, v))
        velocities.append(torch.where(full_mask, 0.0, u) if settings.momentum is not None else u)
    shards = [sum(part[j] for part in sent) for j in range(world)]
    return shards, residuals, velocities


@pytest.mark.parametrize(
    ("compression", "clipping", "optimizer"),
    [
        ({"type": "dgc", "block_size": 32, "density": 0.2}, 0.0, {}),
        (PAPER, 0.02, {}),
        (PAPER_SGD, 0.02, SGD),
    ],
    ids=["topk", "paper-recipe-clipped", "paper-recipe-sgd"],
)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dgc_reduction_equals_the_papers_reference(
    compression: dict, clipping: float, optimizer: dict, stage: int
) -> None:
    results = run_threads(
        train_dgc, WORLD, compression, stage, 5, clipping, optimizer, timeout_s=60
    )
    config = chunkmem.Config.from_dict(
        {"zero": {"stage": 2}, "compression": compression, "optimizer": optimizer}
    )
    c = config.compression
    settings = TopKSettings(
        c.block_size,
        c.density,
        c.sparsity_warmup_steps,
        c.warmup_steps,
        c.momentum if c.momentum_correction else None,
        clipping,
        velocity_averages=c.freeze_variance,
    )
    logs = [r["log"] for r in results]
    layouts = len({e["layout"] for e in logs[0]})
    assert len(logs[0]) == layouts * (5 - c.warmup_steps)  # every compressed step, no more
    for i, entries in enumerate(zip(*logs, strict=True)):
        step = c.warmup_steps + 1 + i // layouts
        shards, residuals, velocities = _paper_reference(
            list(entries), settings, results[0]["trainable_used"], step
        )
        for rank, entry in enumerate(entries):
            n = entry["shard"].numel()
            valid = max(0, min(n, entry["used"] - rank * n))
            assert torch.allclose(entry["shard"][:valid], shards[rank][:valid], atol=1e-7)
            assert not entry["shard"][valid:].any()
            assert torch.allclose(entry["after"], residuals[rank], atol=1e-7)
            assert torch.allclose(entry["velocity_after"], velocities[rank], atol=1e-7)
    for result in results:
        # a residual per layout, and a velocity only with momentum correction, in the ledger
        assert result["by_kind"][EF_RESIDUAL] == 4 * result["capacity"]
        assert result["by_kind"][DGC_VELOCITY] == (
            4 * result["capacity"] if c.momentum_correction else 0
        )
        # the engine leaves clipping to DGC on its compressed steps only
        want = [clipping] * c.warmup_steps + [0.0 if clipping else clipping] * (5 - c.warmup_steps)
        assert result["clipped_globally"] == want


def test_momentum_in_gradients_takes_them_as_the_first_moment() -> None:
    """The frozen step with momentum correction: m = the reduced momentum (here divided by the
    gradient scale), bias-corrected by the compressor's momentum over the frozen steps; the
    variance stays."""
    g = torch.Generator().manual_seed(5)
    param, grad = torch.randn(50, generator=g), torch.randn(50, generator=g)
    exp_avg, exp_avg_sq = torch.randn(50, generator=g), torch.rand(50, generator=g)
    p0, v0 = param.clone().double(), exp_avg_sq.clone()
    frozen_variance_adam_(
        [param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(9.0)], **HYPER,
        decoupled=True, steps_frozen=3, momentum_in_gradients=0.8, grad_scale=torch.tensor(2.0),
    )  # fmt: skip
    m = grad.double() / 2
    p = p0 * (1 - HYPER["lr"] * HYPER["weight_decay"])
    v_hat = v0.double() / (1 - HYPER["beta2"] ** 6)
    want = p - HYPER["lr"] / (1 - 0.8**3) * m / (v_hat.sqrt() + HYPER["eps"])
    assert torch.allclose(param.double(), want, rtol=1e-6, atol=1e-7)
    assert torch.allclose(exp_avg.double(), m)
    assert torch.equal(exp_avg_sq, v0)


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_dgc_composes_with_offload_accumulation_and_hpz(composition: str) -> None:
    exact = run_threads(
        train_composed, WORLD, {"type": "none"}, dict(COMPOSITIONS[composition]), 5, timeout_s=60
    )
    ours = run_threads(
        train_composed, WORLD, PAPER, dict(COMPOSITIONS[composition]), 5, timeout_s=60
    )
    for rank in range(WORLD):
        for a, b in zip(ours[rank]["losses"], exact[rank]["losses"], strict=True):
            assert abs(a - b) <= 0.1 * b, (composition, rank)
        assert_trains_like(ours[rank]["moved"], exact[rank]["moved"], (composition, rank))


# ---------------------------------------------------------------- checkpoints


def _states(engine) -> dict[str, torch.Tensor]:
    return {
        f"{kind.value}.{slot.name}": layout.chunks[kind]
        .payload[slot.offset : slot.offset + slot.numel]
        .clone()
        for kind in (EF_RESIDUAL, DGC_VELOCITY)
        for layout in engine.params.trainable_layouts()
        if kind in layout.chunks
        for slot in layout.slots
    }


def dgc_checkpoint(comm, directory: str, save_at: int | None, resume: bool) -> dict:
    engine = _engine(comm, PAPER, 2, precision="bf16", gradient_clipping=1.0, chunk={"size": 512})
    first = 0
    if resume:
        engine.load_checkpoint(directory)
        first = engine.global_steps
    losses = []
    for step in range(first, 7):
        engine.backward(loss := engine(*_batch(step, comm.rank)))
        engine.step()
        losses.append(float(loss.detach()))
        if step + 1 == save_at:
            engine.save_checkpoint(directory)
    return {"losses": losses, "states": _states(engine)}


def test_a_resumed_dgc_run_equals_the_uninterrupted_one(tmp_path) -> None:
    """Residuals, velocities and the step count (so the sparsity warm-up and the frozen
    variance continue where they were) are saved after the warm-up and loaded: the resumed
    steps are the uninterrupted run's to the bit."""
    target = str(tmp_path / "ckpt")
    whole = run_ranks(dgc_checkpoint, 2, target, 4, False, timeout_s=60, deadline_s=120)
    resumed = run_ranks(dgc_checkpoint, 2, target, None, True, timeout_s=60, deadline_s=120)
    for rank in range(2):
        assert resumed[rank]["losses"] == whole[rank]["losses"][4:]
        assert any(name.startswith("dgc_velocity") for name in whole[rank]["states"])
        for name, value in whole[rank]["states"].items():
            assert torch.equal(resumed[rank]["states"][name], value), name


def saved_dgc_states(comm, directory: str) -> dict:
    engine = _engine(comm, PAPER, 2, precision="bf16", chunk={"size": 512})
    for step in range(4):
        engine.backward(engine(*_batch(step, comm.rank)))
        engine.step()
    engine.save_checkpoint(directory)
    return _states(engine)


def loaded_dgc_states(comm, directory: str, compression: dict) -> dict:
    engine = _engine(comm, compression, 2, precision="bf16", chunk={"size": 512})
    engine.load_checkpoint(directory)
    return _states(engine)


def test_dgc_states_reshard_from_two_ranks_to_one_keeping_their_sums(tmp_path) -> None:
    target = str(tmp_path / "ckpt")
    saved = run_ranks(saved_dgc_states, 2, target, timeout_s=60, deadline_s=120)
    loaded = run_ranks(loaded_dgc_states, 1, target, PAPER, timeout_s=60, deadline_s=120)[0]
    assert loaded.keys() == saved[0].keys()
    assert any(name.startswith("dgc_velocity") for name in loaded)
    for name, value in loaded.items():
        assert torch.equal(value, saved[0][name] + saved[1][name]), name


def test_velocities_do_not_load_into_a_compressor_without_them(tmp_path) -> None:
    target = str(tmp_path / "ckpt")
    run_ranks(saved_dgc_states, 2, target, timeout_s=60, deadline_s=120)
    plain = {"type": "dgc", "block_size": 32, "density": 0.1}
    refused = r"(?s)rank 0 raised:.*ValueError: the checkpoint's compression state holds dgc_velocity, which compression.type 'dgc'"
    with pytest.raises(AssertionError, match=refused):
        run_ranks(loaded_dgc_states, 2, target, plain, timeout_s=60, deadline_s=120)


# ---------------------------------------------------------------- estimate and refusals


@pytest.mark.parametrize(
    ("compression", "message"),
    [
        ({"type": "dgc", "momentum_correction": True}, "needs compression.freeze_variance"),
        ({"type": "onebit", "density": 0.01}, "density is a setting of compression.type 'dgc'"),
        ({"type": "dgc", "density": 0}, "density"),
        ({"type": "dgc", "density": 1.5}, "density"),
    ],
    ids=["momentum-no-freeze", "density-elsewhere", "density-zero", "density-over-one"],
)
def test_dgc_refusals_say_why(compression: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        chunkmem.Config.from_dict({"zero": {"stage": 2}, "compression": compression})


def test_dgc_with_fp16_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="error-feedback state"):
        chunkmem.Config.from_dict(
            {"zero": {"stage": 2}, "precision": "fp16", "compression": {"type": "dgc"}}
        )
