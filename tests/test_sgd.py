"""SGD on the chunks (``chunkmem.update_rules.SgdRule``): the bits of ``torch.optim.SGD`` (fused)
with its states on the device and on the host, ZeRO 1-3 with their model-state bytes, the
momentum buffer through checkpoints across world sizes, the estimate's bytes, and the
combinations it refuses by name."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import chunkmem
from chunkmem.chunk import ChunkKind
from chunkmem.config import Config
from chunkmem.errors import CheckpointError, ConfigError
from chunkmem.estimate.host import state_bytes_per_element
from chunkmem.models.gpt import GPT, GPTConfig
from tests.distributed_helpers import one_rank_at_a_time, run_ranks, run_threads
from tests.reference import max_relative_diff, token_batches, train_engine, train_reference

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
LR = 0.05


def sgd_config(precision: str, where: str, momentum: float, nesterov: bool, **extra) -> dict:
    return {
        "precision": precision,
        "device": {"type": "simulated", "capacity": "64MiB"},
        "chunk": {"size": 2048},
        "optimizer": {"type": "sgd", "lr": LR, "momentum": momentum, "nesterov": nesterov},
        "offload": {"optimizer": where},
        **extra,
    }


def torch_sgd(momentum: float, nesterov: bool, weight_decay: float = 0.01):
    return lambda params: torch.optim.SGD(
        params, lr=LR, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
        fused=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("precision", "where", "momentum", "nesterov"),
    [
        ("fp32", "device", 0.9, True),
        ("fp32", "host", 0.0, False),  # no state chunk at all
        ("bf16", "host", 0.9, False),  # the native host kernel, 16-bit gradients in
        ("bf16", "device", 0.0, False),
    ],
)
def test_sgd_trains_as_torch_sgd_bit_for_bit(precision, where, momentum, nesterov) -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    data = token_batches(8, batch=2, seq=16, vocab=64)
    reference = train_reference(
        model, data, precision=precision, optimizer_for=torch_sgd(momentum, nesterov)
    )
    engine = chunkmem.initialize(
        copy.deepcopy(model), config=sgd_config(precision, where, momentum, nesterov)
    )
    assert train_engine(engine, data) == reference.losses
    ours = {k: v for k, v in engine.state_dict().items() if k in reference.masters}
    assert max_relative_diff(ours, reference.masters) == 0.0
    kinds = set(engine.model_state_bytes())
    assert (ChunkKind.MOMENTUM_BUFFER.value in kinds) == (momentum != 0)
    assert not kinds & {ChunkKind.EXP_AVG.value, ChunkKind.EXP_AVG_SQ.value}


def test_a_torch_sgd_with_two_groups_keeps_each_groups_settings() -> None:
    """Decayed and undecayed groups, each with its momentum and learning rate."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    data = token_batches(6, batch=2, seq=16, vocab=64)

    def groups(params):
        first = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        return [
            {"params": first, "weight_decay": 0.1, "momentum": 0.9, "nesterov": True},
            {"params": rest, "weight_decay": 0.0, "momentum": 0.5, "lr": 0.01},
        ]

    def optimizer_for(masters):
        return torch.optim.SGD(groups(masters), lr=LR, fused=True)

    reference = train_reference(model, data, optimizer_for=optimizer_for)
    ours_model = copy.deepcopy(model)
    engine = chunkmem.initialize(
        ours_model,
        optimizer=torch.optim.SGD(groups(list(ours_model.parameters())), lr=LR),
        config={"device": {"type": "simulated", "capacity": "64MiB"}, "chunk": {"size": 2048}},
    )
    assert train_engine(engine, data) == reference.losses
    ours = {k: v for k, v in engine.state_dict().items() if k in reference.masters}
    assert max_relative_diff(ours, reference.masters) == 0.0


# ------------------------------------------------------------------ ZeRO on 2 ranks

# (param, grad, optimizer-state) bytes per element: in bf16 the 16-bit copy and gradient, an
# fp32 master and the momentum buffer (or the master alone without momentum); fp32 training
# without momentum keeps no optimizer state at all.
STATE_BYTES = {("bf16", 0.9): (2, 2, 8), ("bf16", 0.0): (2, 2, 4), ("fp32", 0.0): (4, 4, 0)}


def zero_rank(comm, stage: int, precision: str, momentum: float) -> dict:
    with one_rank_at_a_time(comm):
        torch.manual_seed(0)
        model = GPT(CONFIG)
    zero = {"stage": stage, "timeout_s": 20}
    config = sgd_config(precision, "auto", momentum, False, zero=zero)
    engine = chunkmem.initialize(model, comm=comm, config=config)
    rows = global_rows(comm.size)[:, comm.rank * 2 : comm.rank * 2 + 2]
    kinds = {k.value for k in (ChunkKind.PARAM, ChunkKind.GRAD, ChunkKind.MASTER)}
    kinds |= {"grad_shard", ChunkKind.MOMENTUM_BUFFER.value}
    state_bytes = None
    for index, row in enumerate(rows):
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        if index == 2:
            tiers = (engine.ledger.device.by_kind, engine.ledger.tiers["host"].by_kind)
            state_bytes = sum(n for tier in tiers for k, n in tier.items() if k in kinds)
        engine.step()
    layouts = engine.params.trainable_layouts()
    return {
        "state": engine.state_dict(),
        "state_bytes": state_bytes,
        "elements": sum(layout.capacity for layout in layouts),
    }


def global_rows(world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, 64, (5, world * 2, 17), generator=generator)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("precision", "momentum"), list(STATE_BYTES))
def test_zero_stages_train_sgd_as_one_process_with_their_bytes(precision, momentum) -> None:
    """fp32 without momentum: whole-slot views of a whole parameter chunk beside a gradient
    shard (ZeRO 1-2) must not be taken for an unsharded layout."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    rows = global_rows(2)
    batches = [(row[:, :-1].contiguous(), row[:, 1:].contiguous()) for row in rows]
    expected = train_reference(
        model, batches, precision=precision, optimizer_for=torch_sgd(momentum, False)
    ).masters
    p, g, s = STATE_BYTES[(precision, momentum)]
    tolerance = 1e-2 if precision == "bf16" else 1e-5
    for stage in (1, 2, 3):
        for result in run_threads(zero_rank, 2, stage, precision, momentum, timeout_s=30):
            ours = {k: v for k, v in result["state"].items() if k in expected}
            assert max_relative_diff(ours, expected) <= tolerance, f"stage {stage}"
            n = result["elements"]
            formula = {1: (p + g) * n + s * n // 2, 2: p * n + (g + s) * n // 2}
            assert result["state_bytes"] == formula.get(stage, (p + g + s) * n // 2)


def accumulating_rank(comm, stage: int) -> dict[str, torch.Tensor]:
    """fp32 momentum SGD, two micro-batches of two rows a step on each rank."""
    with one_rank_at_a_time(comm):
        torch.manual_seed(0)
        model = GPT(CONFIG)
    zero = {"stage": stage, "timeout_s": 20}
    config = sgd_config("fp32", "auto", 0.9, False, zero=zero, gradient_accumulation_steps=2)
    engine = chunkmem.initialize(model, comm=comm, config=config)
    for step_rows in global_rows(2 * comm.size):
        for micro in range(2):
            first = micro * 2 * comm.size + comm.rank * 2
            row = step_rows[first : first + 2]
            engine.backward(engine(row[:, :-1], row[:, 1:]))
            engine.step()
    return engine.state_dict()


@pytest.mark.timeout(300)
def test_zero_with_accumulation_trains_sgd_as_one_process() -> None:
    """SGD moves each parameter by the gradient itself (Adam by about its sign), so a wrong
    divisor of the summed micro-batches and ranks shows here: each step's 8 rows in one
    process against 2 ranks x 2 micro-batches x 2 rows, at stages 1-3."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    rows = global_rows(4)  # 8 rows a step
    batches = [(row[:, :-1].contiguous(), row[:, 1:].contiguous()) for row in rows]
    expected = train_reference(model, batches, optimizer_for=torch_sgd(0.9, False)).masters
    for stage in (1, 2, 3):
        for rank, state in enumerate(run_threads(accumulating_rank, 2, stage, timeout_s=30)):
            ours = {k: v for k, v in state.items() if k in expected}
            assert ours.keys() == expected.keys()
            assert max_relative_diff(ours, expected) <= 1e-5, (stage, rank)


# ------------------------------------------------------------------ checkpoints


def save_on_two(comm, directory: str) -> None:
    with one_rank_at_a_time(comm):
        torch.manual_seed(0)
        model = GPT(CONFIG)
    config = sgd_config("bf16", "host", 0.9, True, zero={"stage": 2, "timeout_s": 20})
    engine = chunkmem.initialize(model, comm=comm, config=config)
    for row in global_rows(2)[:3, comm.rank * 2 : comm.rank * 2 + 2]:
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        engine.step()
    engine.save_checkpoint(Path(directory) / "on2")


@pytest.mark.distributed
def test_the_momentum_buffer_survives_resharding_from_two_ranks_to_one(tmp_path) -> None:
    from tests.test_checkpoints import checkpoint_tensors

    run_ranks(save_on_two, 2, str(tmp_path), timeout_s=30, deadline_s=180)
    torch.manual_seed(0)
    single = chunkmem.initialize(GPT(CONFIG), config=sgd_config("bf16", "device", 0.9, True))
    single.load_checkpoint(tmp_path / "on2")
    single.save_checkpoint(tmp_path / "on1")
    saved, resaved = checkpoint_tensors(tmp_path / "on2"), checkpoint_tensors(tmp_path / "on1")
    buffers = [k for k in saved if k.endswith(".momentum_buffer")]
    assert len(buffers) == len(list(GPT(CONFIG).parameters()))  # one per tensor (tied: once)
    assert all(saved[k].abs().sum() > 0 for k in buffers)
    assert saved.keys() == resaved.keys()
    assert all(torch.equal(saved[k], resaved[k]) for k in saved)


def test_a_checkpoint_with_a_momentum_buffer_does_not_load_into_sgd_without(tmp_path) -> None:
    torch.manual_seed(0)
    with_momentum = chunkmem.initialize(GPT(CONFIG), config=sgd_config("fp32", "auto", 0.9, False))
    row = global_rows(1)[0]
    with_momentum.backward(with_momentum(row[:, :-1], row[:, 1:]))
    with_momentum.step()
    with_momentum.save_checkpoint(tmp_path / "ck")
    without = chunkmem.initialize(GPT(CONFIG), config=sgd_config("fp32", "auto", 0.0, False))
    with pytest.raises(CheckpointError, match=r"optimizer moments: \['momentum_buffer'\] in"):
        without.load_checkpoint(tmp_path / "ck")


def test_momentum_set_after_initialize_without_a_buffer_is_refused() -> None:
    """A scheduler that cycles momentum (OneCycleLR) writes it into the groups later."""
    model = GPT(CONFIG)
    engine = chunkmem.initialize(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        config={"device": {"type": "simulated", "capacity": "64MiB"}},
    )
    engine.optimizer.param_groups[0]["momentum"] = 0.9
    row = global_rows(1)[0]
    engine.backward(engine(row[:, :-1], row[:, 1:]))
    with pytest.raises(ConfigError, match="no group had momentum at initialize"):
        engine.step()


def test_an_adam_checkpoint_does_not_load_into_sgd(tmp_path) -> None:
    torch.manual_seed(0)
    adam = chunkmem.initialize(
        GPT(CONFIG), config={"device": {"type": "simulated", "capacity": "64MiB"}}
    )
    row = global_rows(1)[0]
    adam.backward(adam(row[:, :-1], row[:, 1:]))
    adam.step()
    adam.save_checkpoint(tmp_path / "adam")
    sgd = chunkmem.initialize(GPT(CONFIG), config=sgd_config("fp32", "auto", 0.9, False))
    with pytest.raises(CheckpointError, match="optimizer: adamw in the checkpoint, sgd in the"):
        sgd.load_checkpoint(tmp_path / "adam")


# ------------------------------------------------------------------ the estimate


@pytest.mark.parametrize(
    ("optimizer", "precision", "expected"),
    [
        ({"type": "adamw"}, "bf16", 12),
        ({"type": "sgd", "momentum": 0.9}, "bf16", 8),
        ({"type": "sgd"}, "bf16", 4),
        ({"type": "sgd", "momentum": 0.9}, "fp32", 4),
        ({"type": "sgd"}, "fp32", 0),
    ],
)
def test_the_estimate_counts_the_optimizers_moments(optimizer, precision, expected) -> None:
    config = Config.from_dict({"precision": precision, "optimizer": optimizer})
    assert state_bytes_per_element(config, on_device=True) == expected


# ------------------------------------------------------------------ refused by name


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"optimizer": {"type": "sgd", "betas": [0.8, 0.9]}}, "optimizer.betas is a setting"),
        ({"optimizer": {"type": "adamw", "momentum": 0.9}}, "optimizer.momentum is a setting"),
        ({"optimizer": {"type": "sgd", "nesterov": True}}, "nesterov needs optimizer.momentum"),
        (
            {
                "optimizer": {"type": "sgd", "momentum": 0.9},
                "gradient_clipping": 1.0,
                "offload": {"optimizer": "host", "overlap": True},
            },
            "the sgd kernel updates in place only",
        ),
        (
            {
                "optimizer": {"type": "sgd"},
                "zero": {"stage": 2},
                "compression": {"type": "onebit", "warmup_steps": 2, "freeze_variance": True},
            },
            "has none",
        ),
        (
            {
                "optimizer": {"type": "sgd", "momentum": 0.9},
                "zero": {"stage": 2},
                "compression": {"type": "dgc", "momentum_correction": True},
            },
            "would add momentum twice",
        ),
    ],
)
def test_combinations_sgd_cannot_serve_are_refused_by_name(config, message) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.coerce(config)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"momentum": 0.9, "dampening": 0.1}, "dampening=0.1"),
        ({"momentum": 0.9, "maximize": True}, "maximize=True"),
    ],
)
def test_a_torch_sgd_setting_chunkmem_does_not_do_is_refused(settings, message) -> None:
    model = GPT(CONFIG)
    with pytest.raises(ConfigError, match=message):
        chunkmem.initialize(
            model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR, **settings),
            config={"device": {"type": "simulated", "capacity": "64MiB"}},
        )


@pytest.mark.parametrize(
    ("config", "settings", "message"),
    [
        (
            {"compression": {"type": "onebit", "warmup_steps": 2, "freeze_variance": True}},
            {},
            "the optimizer is SGD, which has none",
        ),
        (
            {
                "optimizer": {"type": "sgd"},
                "compression": {"type": "dgc", "momentum_correction": True},
            },
            {"momentum": 0.9},
            "optimizer momentum 0.9 would add momentum twice",
        ),
    ],
)
def test_compression_is_checked_against_the_torch_optimizer_given(
    config, settings, message
) -> None:
    """The config's own optimizer section may not be the optimizer passed."""
    model = GPT(CONFIG)
    config = {"device": {"type": "simulated", "capacity": "64MiB"}, "zero": {"stage": 2}, **config}
    with pytest.raises(ConfigError, match=message):
        chunkmem.initialize(
            model, optimizer=torch.optim.SGD(model.parameters(), lr=LR, **settings), config=config
        )


def test_a_torch_sgd_with_overlapped_clipped_offload_is_refused() -> None:
    model = GPT(CONFIG)
    with pytest.raises(ConfigError, match="the sgd kernel updates in place only"):
        chunkmem.initialize(
            model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
            config={
                "device": {"type": "simulated", "capacity": "64MiB"},
                "gradient_clipping": 1.0,
                "offload": {"optimizer": "host", "overlap": True},
            },
        )
