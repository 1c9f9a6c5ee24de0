"""DeepSpeed JSON configs run unchanged: mapped keys train exactly as the chunkmem config they
stand for, knobs with no meaning for chunks are accepted with one logged line, and every key
that cannot run is an error naming it."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

import chunkmem
from chunkmem.config import Config, ZeroConfig
from chunkmem.deepspeed_config import from_deepspeed, is_deepspeed_config
from chunkmem.deepspeed_rules import RULES, Status
from chunkmem.errors import ConfigError
from chunkmem.models.gpt import GPT, GPTConfig
from tests.distributed_helpers import run_ranks

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
MICRO_BATCH = 2
ACCUMULATION = 2
STEPS = 4
DEVICE = {"type": "simulated", "capacity": "8MiB"}

# What a DeepSpeed user writes (stage 2, bf16, WarmupLR, clipping, accumulation), bucket
# knobs and a disabled fp16 section included; the chunkmem block holds the simulated device.
DEEPSPEED_JSON = {
    "train_batch_size": MICRO_BATCH * ACCUMULATION * 2,
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_clipping": 0.5,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "bf16": {"enabled": True},
    "fp16": {"enabled": False, "loss_scale": 0, "hysteresis": 2},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3},
    },
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
    },
    "chunkmem": {"device": DEVICE, "zero": {"timeout_s": 20}},
}

# The chunkmem config it stands for.
NATIVE = {
    "precision": "bf16",
    "gradient_accumulation_steps": ACCUMULATION,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    "scheduler": {"type": "WarmupLR", "warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3},
    "zero": {"stage": 2, "timeout_s": 20},
    "device": DEVICE,
}  # fmt: skip


def train_rank(comm, config) -> tuple[dict, list[list[float]], dict]:
    torch.manual_seed(0)
    engine = chunkmem.initialize(GPT(SMALL), config=config)
    generator = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 64, (STEPS * ACCUMULATION, 2 * MICRO_BATCH, 17), generator=generator)
    rates = []
    for index, row in enumerate(rows[:, comm.rank * MICRO_BATCH : (comm.rank + 1) * MICRO_BATCH]):
        if index % ACCUMULATION == 0:
            rates.append(engine.get_lr())
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        engine.step()
    return engine.state_dict(), rates, engine.config.model_dump()


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_deepspeed_json_runs_unchanged_as_the_config_it_stands_for(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DEEPSPEED_JSON, indent=2))
    ours = run_ranks(train_rank, 2, str(path), timeout_s=20, deadline_s=150)
    native = run_ranks(train_rank, 2, NATIVE, timeout_s=20, deadline_s=150)
    for (state, rates, config), (expected_state, expected_rates, expected_config) in zip(
        ours, native, strict=True
    ):
        assert config == expected_config
        assert rates == expected_rates
        assert [r for (r,) in rates] == pytest.approx(
            [0.0, 0.0, 3e-3 * math.log(2) / math.log(3), 3e-3]
        )
        for name, value in expected_state.items():
            assert torch.equal(state[name], value), name


def test_knobs_with_no_meaning_for_chunks_are_accepted_with_one_logged_line(caplog) -> None:
    data = {k: v for k, v in DEEPSPEED_JSON.items() if k != "chunkmem"}
    with caplog.at_level(logging.INFO, logger="chunkmem"):
        config = from_deepspeed(data, world_size=2)
    assert config.gradient_accumulation_steps == ACCUMULATION and config.zero.stage == 2
    lines = [r.getMessage() for r in caplog.records if "DeepSpeed keys" in r.getMessage()]
    assert len(lines) == 1
    for key in ("steps_per_print", "zero_optimization.overlap_comm", "reduce_bucket_size"):
        assert key in lines[0]


@pytest.mark.parametrize(
    "data,world,expected",
    [
        ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, 1, 2),
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, 2, 2),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 4, 3),
        ({"train_batch_size": 8}, 2, 1),
    ],
)
def test_batch_sizes_follow_deepspeeds_rule(data: dict, world: int, expected: int) -> None:
    assert (
        from_deepspeed(
            {**data, "zero_optimization": {"stage": 1}}, world
        ).gradient_accumulation_steps
        == expected
    )


def test_deepspeed_defaults_where_they_differ_from_chunkmems() -> None:
    adam = from_deepspeed({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}, 1).optimizer
    assert (adam.type, adam.weight_decay) == ("adamw", 0.0)  # Adam decouples, decay 0
    coupled = {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}
    assert from_deepspeed({"optimizer": coupled}, 1).optimizer.type == "adam"
    decay = {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}
    assert from_deepspeed({"scheduler": decay}, 1).scheduler.warmup_max_lr == 0.001
    fp16 = {
        "enabled": True,
        "initial_scale_power": 12,
        "loss_scale_window": 100,
        "min_loss_scale": 2,
    }
    config = from_deepspeed({"fp16": fp16, "train_batch_size": 1}, 1)
    assert config.precision == "fp16"
    assert (config.loss_scale.initial_scale, config.loss_scale.growth_interval) == (4096.0, 100)
    assert config.loss_scale.min_scale == 2
    assert (
        from_deepspeed({"bf16": {"enabled": True, "check_overflow": True}}, 1).nonfinite == "skip"
    )


def test_a_config_is_recognised_as_deepspeeds_by_its_keys() -> None:
    assert is_deepspeed_config({"zero_optimization": {"stage": 1}})
    assert is_deepspeed_config({"optimizer": {"type": "AdamW", "params": {}}})
    assert not is_deepspeed_config({"gradient_accumulation_steps": 2, "optimizer": {"lr": 1e-3}})
    assert Config.coerce({"train_batch_size": 4}).gradient_accumulation_steps == 1


@pytest.mark.parametrize(
    "data,message",
    [
        ({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 1}}, r"unknown DeepSpeed key 'zero_optimization.reduce_bucket_sise': did you mean 'zero_optimization.reduce_bucket_size'"),
        ({"train_batch_size": 9, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, r"'train_batch_size' \(9\).*must be 2 x 4 x 1 = 8"),
        ({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}, r"'train_batch_size' \(7\) is not a multiple"),
        ({"train_batch_size": 0}, r"'train_batch_size' must be a positive integer"),
        ({"optimizer": {"type": "Lamb", "params": {}}}, r"'optimizer.type' is 'Lamb'.*not planned"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, r"DeepSpeed key 'optimizer.params.lr' \(chunkmem 'optimizer.lr'\): Input should be greater than 0"),
        ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, r"'optimizer.params.max_grad_norm' \(1.0\) is not supported.*gradient_clipping"),
        ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, r"'optimizer.params.amsgrad' \(True\) is not supported and not planned"),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, r"'scheduler.type' 'OneCycle' is planned"),
        ({"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}}, r"DeepSpeed key 'scheduler'.*cos_min_ratio is a setting of WarmupCosineLR"),
        ({"fp16": {"enabled": True, "hysteresis": 2}}, r"'fp16.hysteresis' \(2\) is planned"),
        ({"fp16": {"enabled": True, "loss_scale": 128}}, r"'fp16.loss_scale' is 128: a fixed loss scale is planned"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"'fp16.enabled' and 'bf16.enabled' are both true"),
        ({"bf16": {"enabled": "auto"}}, r"'bf16.enabled' must be true or false, got 'auto'"),
        ({"zero_optimization": {"stage": 4}}, r"DeepSpeed key 'zero_optimization.stage' \(chunkmem 'zero.stage'\)"),
        ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, r"'zero_optimization.offload_param.device' is 'nvme': parameters on NVMe are planned"),
        ({"flops_profiler": {"enabled": True}}, r"'flops_profiler' \(enabled\) is not supported and not planned"),
        ({"activation_checkpointing": {"partition_activations": True}}, r"'activation_checkpointing' \(enabled\) is not supported"),
        ({"sparse_gradients": True}, r"'sparse_gradients' \(True\) is not supported and not planned"),
        ({"communication_data_type": "fp16"}, r"'communication_data_type' \('fp16'\) is planned"),
        ({"train_batch_size": 2, "chunkmem": {"placment": {}}}, r"unknown key 'chunkmem.placment' of the chunkmem block: did you mean 'placement'"),
        ({"gradient_clipping": 1.0, "train_batch_size": 2, "chunkmem": {"gradient_clipping": 2.0}}, r"'gradient_clipping' is set both in the 'chunkmem' block and by DeepSpeed key 'gradient_clipping'"),
    ],
)  # fmt: skip
def test_each_bad_deepspeed_config_names_the_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_dict(data)


def test_stage_0_on_several_ranks_is_refused() -> None:
    with pytest.raises(ConfigError, match="'zero_optimization.stage' is 0 on 2 ranks.*Use stage 1"):
        from_deepspeed({"train_batch_size": 4}, world_size=2)


def test_features_left_off_ask_for_nothing() -> None:
    config = from_deepspeed(
        {
            "train_batch_size": 2,
            "fp16": {"enabled": False, "hysteresis": 2, "loss_scale": 128},
            "flops_profiler": {"enabled": False, "profile_step": 1},
            "activation_checkpointing": {
                "partition_activations": False,
                "cpu_checkpointing": False,
            },
            "amp": {"enabled": False},
            "zero_optimization": {"stage": 0, "offload_param": None, "mics_shard_size": -1},
            "sparse_gradients": False,
        },
        world_size=1,
    )
    assert config.precision == "fp32"


def test_zero_plus_plus_keys_map_once_zero_plus_plus_is_built() -> None:
    data = {
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_weights": True,
            "zero_hpz_partition_size": 2,
        }
    }
    if "quantized_weights" not in ZeroConfig.model_fields:
        with pytest.raises(
            ConfigError,
            match="'zero_optimization.zero_quantized_weights' maps to chunkmem key 'zero.quantized_weights', which this build does not have yet: planned",
        ):
            from_deepspeed(data, world_size=1)
        return
    zero = from_deepspeed(data, world_size=1).zero
    assert zero.quantized_weights is True and zero.hpz_partition_size == 2


def test_optimizer_offload_maps_onto_the_offload_section() -> None:
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.5}}
    offload = from_deepspeed({"zero_optimization": zero}, world_size=1).offload
    assert (offload.optimizer, offload.optimizer_ratio) == ("host", 0.5)
    nvme = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}
    offload = from_deepspeed({"zero_optimization": nvme}, world_size=1).offload
    assert (offload.optimizer, offload.nvme.path) == ("nvme", "/local_nvme")
    legacy = from_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": True}}, 1)
    assert legacy.offload.optimizer == "host"
    params = {"stage": 3, "offload_param": {"device": "cpu"}}
    assert from_deepspeed({"zero_optimization": params}, world_size=1).offload.optimizer == "auto"


def test_every_rule_maps_onto_a_chunkmem_key_or_says_why_not() -> None:
    for rule in RULES:
        if rule.status is Status.MAPPED and rule.target:
            assert rule.target.split(".")[0] in Config.model_fields, rule.key
        assert rule.status is Status.MAPPED or rule.note or rule.inert or "." not in rule.key, (
            rule.key
        )
