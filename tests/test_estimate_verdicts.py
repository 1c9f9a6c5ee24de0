"""The estimate's verdicts hold: a device of the predicted peak trains with nothing moving, one
of 95% of it is refused or spills, as the estimate says; and every config key is either
modelled by the estimate or named as one it does not need."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from pydantic import BaseModel

import chunkmem
from chunkmem.cli.models import build_model
from chunkmem.cli.settings import ModelSettings
from chunkmem.config import Config
from chunkmem.errors import CapacityError
from chunkmem.estimate import estimate

MODEL = ModelSettings(layers=2, width=64, seq=32, checkpointing=True)
BATCH = 4
CASES = {
    "states-on-device": {"precision": "bf16", "offload": {"optimizer": "device"}},
    "states-auto": {"precision": "bf16"},
    "states-on-host": {"precision": "bf16", "offload": {"optimizer": "host"}},
}


def _config(engine_config: dict[str, Any], capacity: int) -> dict[str, Any]:
    return {**engine_config, "device": {"type": "simulated", "capacity": capacity}}


def _predict(engine_config: dict[str, Any], capacity: int | None):
    return estimate(
        MODEL,
        Config.from_dict(_config(engine_config, capacity or 1 << 30)),
        batch=BATCH,
        device_capacity=capacity,
        gpu=False,
    )


@dataclass(frozen=True)
class Run:
    """What three steps on a device did in their steady iterations."""

    moved: int  # bytes between tiers (a host optimizer's gradients and values included)
    peak: int
    homes: dict[str, int]  # optimizer-state chunk groups per tier


def _train(engine_config: dict[str, Any], capacity: int) -> Run:
    torch.manual_seed(0)
    engine = chunkmem.initialize(build_model(MODEL), config=_config(engine_config, capacity))
    generator = torch.Generator().manual_seed(0)
    try:
        for _ in range(3):
            rows = torch.randint(0, 256, (BATCH, MODEL.seq + 1), generator=generator)
            engine.backward(engine(rows[:, :-1], rows[:, 1:]))
            engine.step()
        ledger = engine.ledger
        steady = (1, 2)
        return Run(
            moved=sum(ledger.bytes_moved(i) for i in steady),
            peak=max(ledger.peak_in("device", i) for i in steady),
            homes=dict(Counter(tier.name for tier in engine.states.homes.values())),
        )
    finally:
        engine.close()


def _predicted_peak(engine_config: dict[str, Any]) -> int:
    """The peak the estimate predicts on a device of that size (a device given changes where
    the masters wait for the first step, so the estimate without one is only a start)."""
    unbounded = _predict(engine_config, None).memory.peak_device_bytes
    return _predict(engine_config, unbounded).memory.peak_device_bytes


def _check_verdict(engine_config: dict[str, Any], capacity: int) -> Any:
    """Refused where the estimate says it cannot train; otherwise the states where it puts
    them, its peak, and, where it says the device fits, no more traffic than on an ample
    device with the same homes (a host optimizer's streams are traffic by design)."""
    verdict = _predict(engine_config, capacity)
    if not verdict.trains:
        with pytest.raises(CapacityError):
            _train(engine_config, capacity)
        return verdict
    run = _train(engine_config, capacity)
    assert run.homes == verdict.memory.state_homes
    ample = _train(engine_config, 4 * capacity)
    if verdict.fits_on_device:
        assert abs(run.peak - verdict.memory.peak_device_bytes) <= 0.005 * run.peak
        if run.homes == ample.homes:
            assert run.moved == ample.moved
    else:
        assert run.moved > ample.moved
    return verdict


@pytest.mark.parametrize("engine_config", CASES.values(), ids=CASES.keys())
def test_the_predicted_peak_fits_and_trains_with_nothing_moving(
    engine_config: dict[str, Any],
) -> None:
    verdict = _check_verdict(engine_config, _predicted_peak(engine_config))
    assert verdict.fits_on_device


@pytest.mark.parametrize("engine_config", CASES.values(), ids=CASES.keys())
def test_95_percent_of_the_predicted_peak_is_refused_spills_or_rehomes_as_predicted(
    engine_config: dict[str, Any],
) -> None:
    """States with a fixed home cannot fit any more: chunks spill; with offload.optimizer auto,
    the estimate moves a state group to the host as the engine does, and it fits again."""
    capacity = int(0.95 * _predicted_peak(engine_config))
    verdict = _check_verdict(engine_config, capacity)
    fixed_home = engine_config.get("offload", {}).get("optimizer", "auto") != "auto"
    assert verdict.fits_on_device is not fixed_home


def _leaves(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _leaves(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


# Keys whose values the estimate's models read (chunkmem/strategies.py, the seams' cost
# models, chunkmem/sizing.py, offload/).
MODELLED = {
    "precision", "gradient_accumulation_steps", "gradient_clipping", "nonfinite",
    "device.type", "device.capacity", "device.count_temporaries", "host.capacity", "chunk.size",
    "chunk.max_fraction_of_capacity", "placement.unit_elements", "zero.stage", "zero.backend",
    "zero.transport", "zero.node_size", "zero.quantized_weights",
    "zero.quantized_weights_block_size", "zero.quantized_weights_two_level",
    "zero.step_gather_two_level",
    "zero.hpz_partition_size", "zero.quantized_gradients",
    "zero.quantized_gradients_block_size", "compression.type", "compression.block_size", "compression.rank",
    "compression.min_compression_rate", "compression.density", "compression.sparsity_warmup_steps",
    "compression.momentum_correction", "offload.optimizer", "offload.optimizer_ratio",
    "offload.state_dtype", "offload.overlap", "offload.speculation_bytes", "offload.nvme.path",
    "offload.nvme.block_size", "offload.nvme.io_threads", "optimizer.type", "optimizer.momentum",
}  # fmt: skip
# Keys that change neither a peak nor the bytes sent, with why.
NOT_NEEDED = {
    **dict.fromkeys(
        [
            "optimizer.lr",
            "optimizer.betas",
            "optimizer.eps",
            "optimizer.weight_decay",
            "optimizer.nesterov",
        ],
        "the update's values, not the states it holds (the type and momentum decide those)",
    ),  # fmt: skip
    **{
        key: "the schedule changes values, not bytes"
        for key in (
            "scheduler.type",
            "scheduler.warmup_min_lr",
            "scheduler.warmup_max_lr",
            "scheduler.warmup_num_steps",
            "scheduler.warmup_type",
            "scheduler.total_num_steps",
            "scheduler.warmup_min_ratio",
            "scheduler.cos_min_ratio",
        )
    },  # fmt: skip
    **{
        key: "the scale's value, not its bytes"
        for key in (
            "loss_scale.initial_scale",
            "loss_scale.growth_factor",
            "loss_scale.backoff_factor",
            "loss_scale.growth_interval",
            "loss_scale.min_scale",
            "loss_scale.max_skips_at_min_scale",
        )
    },  # fmt: skip
    **dict.fromkeys(
        ["placement.policy", "placement.prefetch", "placement.nonmodel_margin"],
        "which chunks move under a budget below the peak: the estimate gives the peak and the "
        "minimum device, not that traffic",
    ),
    "compression.warmup_steps": "the estimate models the steady step, after the warm-up",
    "compression.auto_min_gain": "a threshold of auto's choice; the estimate counts auto as "
    "exact traffic and the largest candidate's memory, whatever it picks",
    "compression.freeze_variance": "which Adam update runs; the variance chunk is held either way",
    **dict.fromkeys(
        ["compression.clip_sigma", "compression.seed", "compression.momentum"],
        "values sent, not their number of bytes",
    ),
    "zero.timeout_s": "a deadline",
    "zero.overlap_step_gather": "when the step's gathers are waited for, not their bytes: "
    "in place, in the chunk, as without it",
    "offload.optimizer_threads": "threads, not bytes",
    "report.formats": "the report's files",
    "report.max_move_events": "the report's event list, host memory outside the ledger",
}


def test_every_config_key_is_modelled_or_named_as_not_needed() -> None:
    """A key added to the config must be taught to the estimate or named here with why it
    needs no model: a new strategy's key is never estimated as something else unnoticed."""
    keys = set(_leaves(Config))
    assert not MODELLED & NOT_NEEDED.keys()
    assert keys - MODELLED - NOT_NEEDED.keys() == set(), "unclassified config keys"
    assert (MODELLED | NOT_NEEDED.keys()) - keys == set(), "keys that no longer exist"
