"""``chunkmem estimate``: a run's per-rank memory and wire bytes, without training it.

The model is built on the meta device and traced for one cycle (:mod:`.trace`); the engine's
own chunk-size search, units and packer lay it out; :mod:`.memory` follows the bytes through
a steady iteration and :mod:`.wire` counts the collectives. Nothing is allocated, so a
model of any size is estimated in seconds on a laptop. How close it comes to measured runs:
``python -m benchmarks.estimate`` (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from chunkmem.cli.models import build_model, describe
from chunkmem.cli.settings import ModelSettings
from chunkmem.config import Config
from chunkmem.costs import WireTally
from chunkmem.errors import ConfigError
from chunkmem.estimate.layouts import pack_layouts
from chunkmem.estimate.memory import MemoryEstimate, estimate_memory
from chunkmem.estimate.trace import trace_model
from chunkmem.estimate.wire import WireEstimate
from chunkmem.sizing import (
    ALIGNMENT_ELEMENTS,
    COMPUTE_DTYPES,
    choose_chunk_sizes,
    chunks_move,
    masters_start_on_device,
    moment_floor_bytes,
    separate_grads,
)
from chunkmem.strategies import strategy_costs

UNBOUNDED = 1 << 62  # a device capacity that bounds nothing


@dataclass(frozen=True)
class Estimate:
    """A model and config's per-rank bytes, and whether they fit the memory given."""

    model: str
    parameters: int
    trainable_parameters: int
    precision: str
    strategy: str  # the seams' cost models, described (``StrategyCosts.describe``)
    world_size: int
    node_size: int
    batch: int
    seq: int
    device_capacity: int | None
    host_capacity: int | None
    memory: MemoryEstimate
    wire: WireEstimate

    @property
    def fits_on_device(self) -> bool | None:
        """Every chunk stays in its home: nothing is evicted, the steady iterations move only
        what the optimizer states' homes call for (a host optimizer's gradients and values);
        tests/test_estimate_verdicts.py holds the engine to it (None: no capacity given)."""
        if self.device_capacity is None:
            return None
        host_ok = self.host_capacity is None or self.memory.peak_host_bytes <= self.host_capacity
        return self.memory.peak_device_bytes <= self.device_capacity and host_ok

    @property
    def trains(self) -> bool | None:
        """It trains, with chunks moving between the device and the host if they must."""
        if self.device_capacity is None:
            return None
        if self.memory.min_device_bytes > self.device_capacity:
            return False
        if self.host_capacity is None:
            return True
        spill = max(0, self.memory.peak_device_bytes - self.device_capacity)
        return self.memory.peak_host_bytes + spill <= self.host_capacity

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["wire"]["intra_node_bytes_per_rank"] = self.wire.intra_node_bytes_per_rank
        data["memory"]["peak_host_bytes"] = self.memory.peak_host_bytes
        data["fits_on_device"] = self.fits_on_device
        data["trains"] = self.trains
        return data


def estimate(
    model: ModelSettings,
    config: Config,
    batch: int,
    world_size: int = 1,
    node_size: int | None = None,
    device_capacity: int | None = None,
    host_capacity: int | None = None,
    gpu: bool = True,
) -> Estimate:
    """Estimate one rank of a run of ``model`` under ``config`` with micro-batches of
    ``batch`` sequences of ``model.seq`` tokens. ``gpu``: host-side staging of a real device
    is counted (False: the simulated device, which reads host chunks in place)."""
    if world_size < 1:
        raise ConfigError(f"the world size must be at least 1, got {world_size}")
    node_size = node_size or config.zero.node_size or world_size
    if world_size % node_size:
        raise ConfigError(f"the node size {node_size} does not divide the world size {world_size}")
    dtype = COMPUTE_DTYPES[config.precision]
    costs = strategy_costs(
        config, world_size, node_size, dtype.itemsize, gpu
    )  # refuses what it cannot model
    with torch.device("meta"):
        net = build_model(model)
    net.to(dtype)
    params = list(dict.fromkeys(net.parameters()))
    trainable = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    capacity = device_capacity if device_capacity is not None else UNBOUNDED
    sharded = costs.sharding.sharded
    trainable_numels = [p.numel() for p in trainable]
    frozen_numels = [p.numel() for p in frozen]
    alignment = math.lcm(ALIGNMENT_ELEMENTS, world_size)
    sizes = choose_chunk_sizes(
        config,
        capacity,
        dtype,
        trainable_numels,
        frozen_numels,
        alignment,
        chunks_move(config, sharded, capacity, dtype, trainable_numels, frozen_numels),
    )
    unit = config.placement.unit_elements
    # Inputs and targets as a training loop slices them from one row of seq + 1 tokens: the
    # saved targets hold that row's storage, and flattening the strided targets for the loss
    # copies them, as in a real step.
    rows = torch.zeros(batch, model.seq + 1, dtype=torch.long, device="meta")
    inputs = (rows[:, :-1], rows[:, 1:])
    unit_elements = sizes.largest if unit == "chunk" else unit
    temporaries = gpu or config.device.count_temporaries  # what the target's meter counts
    trace = trace_model(net, inputs, unit_elements, gpu, temporaries)
    packed = pack_layouts(params, trace, sizes, alignment)
    masters_on_device = masters_start_on_device(
        config, capacity, dtype, trainable_numels, frozen_numels, world_size
    )
    tally = WireTally(node_size, world_size // node_size)
    memory = estimate_memory(
        trace,
        packed,
        config,
        lambda: strategy_costs(config, world_size, node_size, dtype.itemsize, gpu),
        capacity,
        gpu,
        masters_on_device,
        tally,
    )
    grads_apart = separate_grads(config.precision, config.gradient_accumulation_steps, sharded)
    floor = moment_floor_bytes(sizes, trainable_numels, frozen_numels, dtype, grads_apart)
    memory = replace(memory, min_device_bytes=max(memory.min_device_bytes, floor))
    wire = WireEstimate.of(tally)
    return Estimate(
        model=describe(model),
        parameters=sum(p.numel() for p in params),
        trainable_parameters=sum(p.numel() for p in trainable),
        precision=config.precision,
        strategy=costs.describe(),
        world_size=world_size,
        node_size=node_size,
        batch=batch,
        seq=model.seq,
        device_capacity=device_capacity,
        host_capacity=host_capacity,
        memory=memory,
        wire=wire,
    )
