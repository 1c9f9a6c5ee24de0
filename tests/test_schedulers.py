"""Learning-rate schedulers: DeepSpeed's schedules give DeepSpeed's rates, and a scheduler (a
torch one passed to initialize, or one named in the config) steps with the engine at
accumulation boundaries, its rates reaching the chunked update."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import chunkmem
from chunkmem.config import Config
from chunkmem.errors import ConfigError
from chunkmem.models.gpt import GPT, GPTConfig
from chunkmem.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR
from tests.reference import token_batches

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
DEVICE = {"type": "simulated", "capacity": "4MiB"}


class Groups:
    def __init__(self, lr: float = 1.0, count: int = 1) -> None:
        self.param_groups = [{"lr": lr} for _ in range(count)]


def rates(schedule, steps: int) -> list[float]:
    """The rate of each update: set at construction, then stepped after each update."""
    out = []
    for _ in range(steps):
        out.append(schedule.optimizer.param_groups[0]["lr"])
        schedule.step()
    return out


def test_warmup_lr_rises_as_log_then_stays() -> None:
    got = rates(WarmupLR(Groups(), warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10), 14)
    # DeepSpeed counts from iteration -1: the first two updates both run at the minimum.
    expected = [0.1] + [0.1 + math.log(i + 1) / math.log(10) for i in range(10)] + [1.1] * 3
    assert got == pytest.approx(expected, rel=1e-12)
    linear = rates(
        WarmupLR(Groups(), warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear"), 6
    )
    assert linear == pytest.approx([0, 0, 0.25, 0.5, 0.75, 1.0])


def test_warmup_lr_defaults_to_the_optimizers_rate_and_handles_each_group() -> None:
    groups = Groups(lr=3e-4, count=2)
    schedule = WarmupLR(groups, warmup_num_steps=2, warmup_type="linear")
    assert schedule.max_lrs == [3e-4, 3e-4]
    schedule.step()
    schedule.step()
    schedule.step()
    assert [g["lr"] for g in groups.param_groups] == [3e-4, 3e-4] == schedule.get_last_lr()


def test_warmup_decay_lr_decays_linearly_to_zero_at_total_steps() -> None:
    schedule = WarmupDecayLR(
        Groups(), total_num_steps=20, warmup_num_steps=10, warmup_type="linear"
    )
    got = rates(schedule, 25)
    assert got[1 + 10] == pytest.approx(0.001)  # iteration 10: warm-up over, DeepSpeed's max
    assert got[1 + 15] == pytest.approx(0.0005)
    assert got[1 + 20 :] == [0.0] * 4


def test_warmup_cosine_lr_is_a_ratio_of_the_rate_down_to_cos_min_ratio() -> None:
    schedule = WarmupCosineLR(
        Groups(lr=2.0), total_num_steps=20, warmup_num_steps=10, warmup_type="linear"
    )
    got = rates(schedule, 32)
    assert got[0] == 0.0 and got[1 + 5] == pytest.approx(1.0)  # 2.0 x 5/10
    cosine = 1e-4 + (1 - 1e-4) * (1 + math.cos(math.pi * 0.1)) / 2
    assert got[1 + 10] == pytest.approx(2.0 * cosine)
    assert got[1 + 19 :] == pytest.approx([2.0 * 1e-4] * 12)  # stays at the floor
    assert schedule.state_dict() == {"last_batch_iteration": 31}


def train_pair(scheduler_of, accumulation: int = 2, steps: int = 4):
    """The engine and plain torch (fused AdamW), each with ``scheduler_of(optimizer)``."""
    torch.manual_seed(0)
    model = GPT(SMALL)
    reference_model = copy.deepcopy(model)
    data = token_batches(steps * accumulation, batch=2, seq=16, vocab=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = chunkmem.initialize(
        model,
        optimizer,
        config={"device": DEVICE, "gradient_accumulation_steps": accumulation},
        lr_scheduler=scheduler_of(optimizer),
    )
    reference_optimizer = torch.optim.AdamW(reference_model.parameters(), lr=1e-2, fused=True)
    reference_scheduler = scheduler_of(reference_optimizer)
    seen = []
    for index, (x, y) in enumerate(data):
        engine.backward(engine(x, y))
        engine.step()
        (reference_model(x, y) / accumulation).backward()
        if (index + 1) % accumulation == 0:
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            reference_scheduler.step()
            seen.append((engine.get_lr(), reference_scheduler.get_last_lr()))
    return engine, reference_model, seen


def test_torch_scheduler_steps_at_accumulation_boundaries_and_reaches_the_update() -> None:
    engine, reference, seen = train_pair(
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    )
    assert [ours for ours, _ in seen] == [theirs for _, theirs in seen]
    assert seen[-1][0] == [1e-2 * 0.5**4]
    state = engine.state_dict()
    for name, value in reference.named_parameters():
        assert torch.equal(state[name], value.detach()), name


def test_deepspeed_schedule_from_the_config_drives_the_engine() -> None:
    torch.manual_seed(0)
    engine = chunkmem.initialize(
        GPT(SMALL),
        config={
            "device": DEVICE,
            "optimizer": {"lr": 1e-3},
            "scheduler": {"type": "WarmupLR", "warmup_num_steps": 4, "warmup_type": "linear"},
            "nonfinite": "skip",
        },
    )
    assert isinstance(engine.lr_scheduler, WarmupLR)
    used = []
    for x, y in token_batches(4, batch=2, seq=16, vocab=64):
        used.append(engine.get_lr()[0])
        engine.backward(engine(x, y))
        engine.step()
    assert used == pytest.approx([0.0, 0.0, 2.5e-4, 5e-4])
    # A step skipped for a NaN gradient does not advance the schedule (as DeepSpeed).
    x, y = token_batches(1, batch=2, seq=16, vocab=64)[0]
    engine.backward(engine(x, y) * float("nan"))
    assert engine.step() is False
    assert engine.get_lr() == pytest.approx([7.5e-4])
    assert engine.lr_scheduler.last_batch_iteration == 3


def test_scheduler_errors_name_what_is_wrong() -> None:
    model = GPT(SMALL)
    optimizer = torch.optim.AdamW(model.parameters())
    other = torch.optim.AdamW(GPT(SMALL).parameters())
    config = {"device": DEVICE}
    with pytest.raises(ConfigError, match="built on another optimizer"):
        chunkmem.initialize(
            model, optimizer, config=config, lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1)
        )
    with pytest.raises(ConfigError, match="config key 'scheduler.type' names 'WarmupLR'"):
        chunkmem.initialize(
            model,
            optimizer,
            config={**config, "scheduler": {"type": "WarmupLR"}},
            lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1),
        )
    with pytest.raises(ConfigError, match="step\\(\\) method"):
        chunkmem.initialize(model, optimizer, config=config, lr_scheduler=0.5)
    with pytest.raises(ConfigError, match="scheduler.total_num_steps"):
        chunkmem.initialize(model, config={**config, "scheduler": {"type": "WarmupCosineLR"}})
    with pytest.raises(ConfigError, match="cos_min_ratio is a setting of WarmupCosineLR"):
        chunkmem.initialize(
            model, config={**config, "scheduler": {"type": "WarmupLR", "cos_min_ratio": 0.1}}
        )
    chunkmem.initialize(model, optimizer, config=config)  # the model was left untouched


def test_a_dumped_scheduler_config_reloads() -> None:
    config = Config.from_dict({"scheduler": {"type": "WarmupDecayLR", "total_num_steps": 9}})
    assert Config.from_dict(config.model_dump(mode="json")) == config
    assert Config.from_dict(Config().model_dump(mode="json")) == Config()
