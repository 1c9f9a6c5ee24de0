"""``chunkmem.estimate`` against the ledgers of real runs: per-rank peak device bytes and the
bytes sent per step (benchmarks/estimate covers the full grid of stages, offload and sizes)."""

from __future__ import annotations

import contextlib
import resource
from typing import Any

import pytest
import torch

import chunkmem
from chunkmem.cli.models import build_model
from chunkmem.cli.settings import ModelSettings
from chunkmem.config import Config
from chunkmem.estimate import estimate
from tests.distributed_helpers import one_rank_at_a_time, run_ranks

CAPACITY = 1 << 30
SMALL = {"layers": 2, "width": 64, "seq": 32}


def config(**sections: Any) -> dict[str, Any]:
    return {"device": {"type": "simulated", "capacity": CAPACITY}, **sections}


def measure(
    model: ModelSettings, engine_config: dict[str, Any], batch: int, comm=None
) -> tuple[int, int]:
    """(peak device bytes, bytes sent in the third step's collectives) of three steps, in one
    process or as a rank of ``comm``'s world."""
    with contextlib.nullcontext() if comm is None else one_rank_at_a_time(comm):
        torch.manual_seed(0)
        module = build_model(model)
    engine = chunkmem.initialize(module, config=engine_config, comm=comm)
    generator = torch.Generator().manual_seed(0)
    accumulation = engine.config.gradient_accumulation_steps
    for _ in range(3 * accumulation):
        rows = torch.randint(0, 256, (batch, model.seq + 1), generator=generator)
        engine.backward(engine(rows[:, :-1], rows[:, 1:]))
        engine.step()
    comm = getattr(engine.states.sharding, "comm", None)
    wire = comm.ledger.bytes_sent(tag=2) if comm is not None else 0
    peak = engine.ledger.device.peak
    engine.close()
    return peak, wire


def predict(model: ModelSettings, engine_config: dict[str, Any], batch: int, world: int = 1):
    return estimate(
        model,
        Config.from_dict(engine_config),
        batch=batch,
        world_size=world,
        device_capacity=CAPACITY,
        gpu=False,
    )


@pytest.mark.parametrize(
    ("model", "engine_config"),
    [
        (ModelSettings(**SMALL, checkpointing=True), config()),
        (ModelSettings(**SMALL, checkpointing=False), config(precision="bf16")),
        (
            ModelSettings(**SMALL, checkpointing=False),
            config(precision="bf16", offload={"optimizer": "host"}),
        ),
        (
            ModelSettings(**SMALL, checkpointing=True),
            config(precision="bf16", gradient_accumulation_steps=2),
        ),
    ],
    ids=["fp32-checkpointing", "bf16", "bf16-host-offload", "bf16-accumulation"],
)
def test_estimate_is_the_ledger_peak_in_one_process(
    model: ModelSettings, engine_config: dict[str, Any]
) -> None:
    measured, _ = measure(model, engine_config, batch=4)
    predicted = predict(model, engine_config, batch=4).memory.peak_device_bytes
    assert abs(predicted - measured) <= 0.005 * measured, (predicted, measured)


def _rank(comm, stage: int, accumulation: int) -> tuple[int, int]:
    model = ModelSettings(**SMALL, checkpointing=True)
    return measure(
        model,
        config(
            precision="bf16",
            gradient_accumulation_steps=accumulation,
            zero={"stage": stage, "timeout_s": 60},
        ),
        batch=4,
        comm=comm,
    )


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "accumulation"), [(1, 1), (2, 2), (3, 1)])
def test_estimate_is_the_ledger_under_zero_on_two_ranks(stage: int, accumulation: int) -> None:
    """On gloo ranks, not the in-process world: the peak depends on when reductions and
    prefetched gathers complete, which over gloo's background exchange is at once, as on a
    fast network, while a thread's collective completes only when its peer gets the GIL."""
    results = run_ranks(_rank, 2, stage, accumulation, timeout_s=60, deadline_s=240)
    model = ModelSettings(**SMALL, checkpointing=True)
    engine_config = config(
        precision="bf16", gradient_accumulation_steps=accumulation, zero={"stage": stage}
    )
    predicted = predict(model, engine_config, batch=4, world=2)
    for peak, wire in results:
        assert abs(predicted.memory.peak_device_bytes - peak) <= 0.005 * peak
        assert predicted.wire.bytes_per_rank == wire


def test_a_hugging_face_model_is_estimated_from_its_config(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64
    ).save_pretrained(tmp_path)
    model = ModelSettings(build=f"hf:{tmp_path}", seq=32)
    engine_config = config(precision="bf16")
    measured, _ = measure(model, engine_config, batch=4)
    predicted = predict(model, engine_config, batch=4).memory.peak_device_bytes
    assert abs(predicted - measured) <= 0.005 * measured, (predicted, measured)


def test_a_billion_parameter_model_is_estimated_without_allocating_it() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = estimate(
        ModelSettings(layers=24, width=2048, seq=1024),
        Config.from_dict({"precision": "bf16", "zero": {"stage": 3}}),
        batch=4,
        world_size=8,
        device_capacity=80 << 30,
    )
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert result.parameters > 1.2e9
    # 14 bytes of model states per parameter, a rank's eighth of them, plus activations.
    assert result.memory.peak_device_bytes > 14 * result.parameters / 8
    assert result.fits_on_device
    assert grown < 256 * 2**20  # the model's 2.4 GB of bf16 weights never existed
