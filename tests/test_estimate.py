"""``chunkmem.estimate`` against the ledgers of real runs: per-rank peak device bytes and the
bytes sent per step (benchmarks/estimate covers the full grid of stages, offload and sizes)."""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import chunkmem
from chunkmem.cli.models import build_model
from chunkmem.cli.settings import ModelSettings
from chunkmem.config import Config
from chunkmem.estimate import estimate
from tests.distributed_helpers import one_rank_at_a_time, run_ranks, run_threads

CAPACITY = 1 << 30
SMALL = {"layers": 2, "width": 64, "seq": 32}


def config(**sections: Any) -> dict[str, Any]:
    return {"device": {"type": "simulated", "capacity": CAPACITY}, **sections}


TEMPORARIES = {"type": "simulated", "capacity": CAPACITY, "count_temporaries": True}
SGD = {"type": "sgd", "lr": 0.05, "momentum": 0.9}  # one moment, where Adam has two


@dataclass(frozen=True)
class Measured:
    """A run's ledgers: peak bytes of each tier (0 where the tier is absent) and, on a
    world, the bytes this rank sent in the third step's collectives and their cross-node
    share."""

    device: int
    host: int
    nvme: int
    wire: int
    cross_node: int


def measure(model: ModelSettings, engine_config: dict[str, Any], batch: int, comm=None) -> Measured:
    """Three steps in one process or as a rank of ``comm``'s world."""
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
    tiers = engine.ledger.tiers
    measured = Measured(
        device=engine.ledger.device.peak,
        host=tiers["host"].peak if "host" in tiers else 0,
        nvme=tiers["nvme"].peak if "nvme" in tiers else 0,
        wire=comm.ledger.bytes_sent(tag=2) if comm is not None else 0,
        cross_node=comm.ledger.cross_node_bytes(tag=2) if comm is not None else 0,
    )
    engine.close()
    return measured


def predict(
    model: ModelSettings,
    engine_config: dict[str, Any],
    batch: int,
    world: int = 1,
    node: int | None = None,
):
    return estimate(
        model,
        Config.from_dict(engine_config),
        batch=batch,
        world_size=world,
        node_size=node,
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
        (
            ModelSettings(**SMALL, checkpointing=True),
            config(precision="bf16", device=TEMPORARIES, offload={"optimizer": "host"}),
        ),
        (ModelSettings(**SMALL, checkpointing=True), config(precision="bf16", optimizer=SGD)),
        (ModelSettings(**SMALL, checkpointing=False), config(optimizer={"type": "sgd"})),
    ],
    ids=[
        "fp32-checkpointing",
        "bf16",
        "bf16-host-offload",
        "bf16-accumulation",
        "temporaries",
        "bf16-sgd",
        "fp32-sgd-without-momentum",
    ],  # fmt: skip
)
def test_estimate_is_the_ledger_peak_in_one_process(
    model: ModelSettings, engine_config: dict[str, Any]
) -> None:
    measured = measure(model, engine_config, batch=4).device
    predicted = predict(model, engine_config, batch=4).memory.peak_device_bytes
    assert abs(predicted - measured) <= 0.005 * measured, (predicted, measured)


def _rank(comm, stage: int, accumulation: int, device: dict[str, Any]) -> Measured:
    model = ModelSettings(**SMALL, checkpointing=True)
    return measure(
        model,
        config(
            precision="bf16",
            gradient_accumulation_steps=accumulation,
            zero={"stage": stage, "timeout_s": 60},
            device=device,
        ),
        batch=4,
        comm=comm,
    )


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("stage", "accumulation", "device"),
    [(1, 1, config()["device"]), (2, 2, config()["device"]), (3, 1, TEMPORARIES)],
    ids=["zero1", "zero2-accumulation", "zero3-temporaries"],
)
def test_estimate_is_the_ledger_under_zero_on_two_ranks(
    stage: int, accumulation: int, device: dict[str, Any]
) -> None:
    """On gloo ranks, not the in-process world: the peak depends on when reductions and
    prefetched gathers complete, which over gloo's background exchange is at once, as on a
    fast network, while a thread's collective completes only when its peer gets the GIL."""
    results = run_ranks(_rank, 2, stage, accumulation, device, timeout_s=60, deadline_s=240)
    model = ModelSettings(**SMALL, checkpointing=True)
    engine_config = config(
        precision="bf16",
        gradient_accumulation_steps=accumulation,
        zero={"stage": stage},
        device=device,
    )
    predicted = predict(model, engine_config, batch=4, world=2)
    for measured in results:
        assert abs(predicted.memory.peak_device_bytes - measured.device) <= 0.005 * measured.device
        assert predicted.wire.bytes_per_rank == measured.wire


HOST_CASES = {
    "host-offload": config(precision="bf16", offload={"optimizer": "host"}),
    "sgd-host-offload": config(precision="bf16", optimizer=SGD, offload={"optimizer": "host"}),
    "speculative-host-updates": config(
        precision="bf16", gradient_clipping=1.0, offload={"optimizer": "host", "overlap": True}
    ),
}


@pytest.mark.parametrize("engine_config", HOST_CASES.values(), ids=HOST_CASES.keys())
def test_the_host_peak_is_the_ledger_s_in_one_process(engine_config: dict[str, Any]) -> None:
    """Host bytes are not timing-dependent: the estimate names them to the byte, the
    speculation's buffers (shadows of whole state chunks, copies of the 16-bit gradients'
    non-padding elements, in the order groups become final) included."""
    model = ModelSettings(**SMALL, checkpointing=True)
    measured = measure(model, engine_config, batch=4)
    predicted = predict(model, engine_config, batch=4).memory
    assert predicted.peak_host_bytes == measured.host


def test_the_nvme_tier_s_staging_and_states_are_the_ledger_s(tmp_path) -> None:
    """The first cycle holds the staging buffers and the masters waiting for their home;
    the steady one the staging buffers and two groups' states read in."""
    model = ModelSettings(**SMALL, checkpointing=True)
    engine_config = config(
        precision="bf16",
        offload={"optimizer": "nvme", "nvme": {"path": str(tmp_path), "block_size": 1 << 16}},
    )
    measured = measure(model, engine_config, batch=4)
    predicted = predict(model, engine_config, batch=4).memory
    assert predicted.peak_host_bytes == measured.host
    assert predicted.first_cycle_host_bytes > predicted.host_bytes
    assert predicted.nvme_bytes == measured.nvme


def test_speculation_over_nvme_homed_states_is_the_ledger_s(tmp_path) -> None:
    """States staged from NVMe are copied, not shadowed: 4 + 4 + 4 bytes an element updated
    (fp32 master and moments) and 2 for its bf16 gradient in the parameter slot, every
    trainable parameter here. Which groups speculate, and how many written-back groups are
    still in host memory, depends on how far the host thread lags: the estimate is the most,
    reached or not."""
    model = ModelSettings(**SMALL, checkpointing=True)
    nvme = {"path": str(tmp_path), "block_size": 1 << 16}
    offload = {"optimizer": "nvme", "overlap": True, "nvme": nvme}
    engine_config = config(precision="bf16", gradient_clipping=1.0, offload=offload)
    measured = measure(model, engine_config, batch=4)
    predicted = predict(model, engine_config, batch=4).memory
    assert measured.host <= predicted.peak_host_bytes
    unclipped = predict(model, config(precision="bf16", offload=offload), batch=4).memory
    parameters = sum(p.numel() for p in build_model(model).parameters())
    assert predicted.peak_host_bytes - unclipped.peak_host_bytes == 14 * parameters


def test_fp32_training_counts_the_chunks_its_host_update_brings_there() -> None:
    """fp32 training has no masters: the host updates the parameter chunk itself, which comes
    there with its gradient chunk and stays until the next forward. The estimate counts every
    group's (16 bytes an element with the moments, where it counted 8): exact in one process,
    the most under ZeRO with overlapped speculative updates (reached here)."""
    model = ModelSettings(**SMALL, checkpointing=True)
    serial = config(precision="fp32", offload={"optimizer": "host"})
    predicted = predict(model, serial, batch=4).memory
    assert predicted.peak_host_bytes == measure(model, serial, batch=4).host
    overlapped = config(
        precision="fp32",
        gradient_clipping=1.0,
        offload={"optimizer": "host", "overlap": True},
        zero={"stage": 2},
    )
    results = run_threads(_fp32_rank, 2, overlapped, timeout_s=30, deadline_s=120)
    most = predict(model, overlapped, batch=4, world=2).memory.peak_host_bytes
    assert max(m.host for m in results) <= most


def _fp32_rank(comm, engine_config: dict[str, Any]) -> Measured:
    return measure(ModelSettings(**SMALL, checkpointing=True), engine_config, batch=4, comm=comm)


def _host_rank(comm, stage: int) -> Measured:
    return measure(
        ModelSettings(**SMALL, checkpointing=True),
        config(precision="bf16", offload={"optimizer": "host"}, zero={"stage": stage}),
        batch=4,
        comm=comm,
    )


@pytest.mark.parametrize("stage", [1, 2])
def test_the_host_peak_under_zero_with_host_states_is_the_ledger_s(stage: int) -> None:
    """Each rank holds its own shard's states on the host (ZeRO-1 was counted whole)."""
    results = run_threads(_host_rank, 2, stage, timeout_s=30, deadline_s=120)
    predicted = predict(
        ModelSettings(**SMALL, checkpointing=True),
        config(precision="bf16", offload={"optimizer": "host"}, zero={"stage": stage}),
        batch=4,
        world=2,
    ).memory
    assert [m.host for m in results] == [predicted.peak_host_bytes] * 2


ZEROPP = {
    "qwZ": {"quantized_weights": True},
    "hpZ": {"hpz_partition_size": 2},
    "qgZ": {"quantized_gradients": True},
    "qwZ+hpZ+qgZ": {
        "quantized_weights": True,
        "hpz_partition_size": 2,
        "quantized_gradients": True,
    },
}


def _zeropp_config(zeropp: dict[str, Any]) -> dict[str, Any]:
    return config(precision="bf16", zero={"stage": 3, "node_size": 2, "timeout_s": 60, **zeropp})


def _zeropp_rank(comm, zeropp: dict[str, Any]) -> Measured:
    return measure(
        ModelSettings(**SMALL, checkpointing=True), _zeropp_config(zeropp), batch=4, comm=comm
    )


@pytest.mark.parametrize("zeropp", ZEROPP.values(), ids=ZEROPP.keys())
def test_zeropp_wire_bytes_are_the_ledger_s_on_two_nodes_of_two(zeropp: dict[str, Any]) -> None:
    """Per rank, all bytes sent, and the cross-node share of the rank sending most across and
    of all ranks, to the byte: quantized payloads with their scales, hpZ's secondary gathers
    inside a node, qgZ's two all-to-alls."""
    results = run_threads(_zeropp_rank, 4, zeropp, timeout_s=30, deadline_s=180)
    model = ModelSettings(**SMALL, checkpointing=True)
    predicted = predict(model, _zeropp_config(zeropp), batch=4, world=4, node=2).wire
    plain = predict(model, _zeropp_config({}), batch=4, world=4, node=2).wire
    assert [m.wire for m in results] == [predicted.bytes_per_rank] * 4
    assert max(m.cross_node for m in results) == predicted.cross_node_bytes_per_rank
    assert sum(m.cross_node for m in results) == predicted.cross_node_bytes_all_ranks
    assert predicted.cross_node_bytes_per_rank < plain.cross_node_bytes_per_rank


STEP_GATHERS = {
    f"stage{stage}-{'two-levels' if two_level else 'one-ring'}": {
        "stage": stage,
        "step_gather_two_level": two_level,
    }
    for stage in (1, 2)
    for two_level in (True, False)
}


@pytest.mark.parametrize("zero", STEP_GATHERS.values(), ids=STEP_GATHERS.keys())
def test_stage12_wire_bytes_are_the_ledger_s_on_two_nodes_of_two(zero: dict[str, Any]) -> None:
    """Stages 1-2 on 2 nodes x 2, the step's gather in two levels and over one ring: every
    rank's bytes and the cross-node ones to the byte; two levels send fewer across."""
    results = run_threads(_zeropp_rank, 4, zero, timeout_s=30, deadline_s=180)
    model = ModelSettings(**SMALL, checkpointing=True)
    predicted = predict(model, _zeropp_config(zero), batch=4, world=4, node=2).wire
    assert [m.wire for m in results] == [predicted.bytes_per_rank] * 4
    assert max(m.cross_node for m in results) == predicted.cross_node_bytes_per_rank
    assert sum(m.cross_node for m in results) == predicted.cross_node_bytes_all_ranks
    if zero["step_gather_two_level"]:
        ring = predict(model, _zeropp_config({**zero, "step_gather_two_level": False}), batch=4,
                       world=4, node=2).wire  # fmt: skip
        assert predicted.cross_node_bytes_all_ranks < ring.cross_node_bytes_all_ranks


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_zeropp_device_peak_is_the_ledger_s_on_gloo_ranks() -> None:
    """All three ZeRO++ features at once, on 4 gloo ranks as 2 nodes of 2 (see the two-rank
    test on why gloo): hpZ's secondary copies and the quantized buffers counted."""
    zeropp = ZEROPP["qwZ+hpZ+qgZ"]
    results = run_ranks(_zeropp_rank, 4, zeropp, timeout_s=60, deadline_s=240)
    model = ModelSettings(**SMALL, checkpointing=True)
    predicted = predict(model, _zeropp_config(zeropp), batch=4, world=4, node=2).memory
    for measured in results:
        error = abs(predicted.peak_device_bytes - measured.device) / measured.device
        assert error <= 0.02, (predicted.peak_device_bytes, measured.device)


def test_a_hugging_face_model_is_estimated_from_its_config(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64
    ).save_pretrained(tmp_path)
    model = ModelSettings(build=f"hf:{tmp_path}", seq=32)
    engine_config = config(precision="bf16")
    measured = measure(model, engine_config, batch=4).device
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
