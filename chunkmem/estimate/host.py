"""The host's and the NVMe tier's bytes of an estimated run, by the tiers' own rules: the
optimizer states homed there, the NVMe tier's staging buffers (``offload.nvme``), the states
read in for an update (``chunkmem.staging``), fp32 training's parameter and gradient chunks
updated there, a real device's staged gradients and values,
the speculative updates' shadows and copies (``offload.speculation``), and the first cycle's masters
waiting for their home. :mod:`.memory` follows the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkmem.config import Config, speculative_reasons
from chunkmem.sizing import STATE_DTYPES
from chunkmem.update_rules import moment_count
from offload.nvme import staging_bytes as nvme_staging_bytes
from offload.speculation import Snapshot
from offload.speculation import held_bytes as speculation_held_bytes

if TYPE_CHECKING:
    from chunkmem.estimate.memory import _Simulation


@dataclass(frozen=True)
class HostBytes:
    steady: int  # the steady iterations' peak on the host
    first_cycle: int  # the first (recording) cycle's
    nvme: int


def state_bytes_per_element(config: Config, on_device: bool) -> int:
    """fp32 master (bf16/fp16 only) and the optimizer's moments (Adam's two, SGD's momentum
    buffer where it has momentum), in the dtype of their home."""
    moment = 4 if on_device or config.offload.state_dtype == "fp32" else 2
    return (4 if config.precision != "fp32" else 0) + moment_count(config.optimizer) * moment


def host_bytes(
    config: Config,
    sim: _Simulation,
    elements: list[int],
    homes: list[str],
    gpu: bool,
    masters_on_device: bool,
) -> HostBytes:
    """``elements``: each trainable layout's state elements on this rank; ``homes``: where
    its states live."""
    per_element = state_bytes_per_element(config, on_device=False)

    def homed(tier: str) -> int:
        return sum(n for n, home in zip(elements, homes, strict=True) if home == tier)

    return HostBytes(
        steady=homed("host") * per_element
        + _workspace(config, sim, homes, gpu)
        + _fp32_chunks_updated_on_host(sim, homes),
        first_cycle=_first_cycle(config, sim, masters_on_device),
        nvme=homed("nvme") * per_element,
    )


def _workspace(config: Config, sim: _Simulation, homes: list[str], gpu: bool) -> int:
    """Host buffers an update on the host needs at once: the NVMe tier's staging buffers and
    the states of two groups read in (one updating, one read ahead: ``chunkmem.staging``), a
    third with ``offload.overlap`` (the last one updated in backward, still being written
    back: how long it takes depends on the host thread, so this is the most, not a sure
    peak); on a GPU, the gradients staged down and the values staged up for the layout being
    updated; the speculation's buffers."""
    total = 0
    groups = [sim.state_elements(i) for i in sim.packed.trainable]
    if "nvme" in homes:
        read_in = 3 if config.offload.overlap else 2
        total += _nvme_staging(config)
        total += read_in * max(groups) * state_bytes_per_element(config, on_device=False)
    if gpu and any(home != "device" for home in homes):
        total += max(groups) * 2 * sim.itemsize
    return total + _speculation(config, sim, homes, gpu)


def _fp32_chunks_updated_on_host(sim: _Simulation, homes: list[str]) -> int:
    """fp32 training has no masters: the host updates the parameter chunk itself, so a group
    updated there brings its parameter chunk (whole; a ZeRO-3 shard) and this rank's gradient
    chunk (a ZeRO-2/3 shard) to the host (``OptimizerStates.update_chunks``), where they stay
    until the next forward fetches them. Every such group at once: exact in one process; under
    ZeRO the most (a serial step's post-step gather takes some back before the last arrive,
    an overlapped one's may not)."""
    if sim.mixed:
        return 0
    groups = [
        layout for layout, home in zip(sim.packed.trainable, homes, strict=True) if home != "device"
    ]
    elements = sum(
        sim.sharding.param_elements(sim.capacity(layout))
        + (sim.shard(layout) or sim.capacity(layout))  # 0: no reduce-scatter, whole gradients
        for layout in groups
    )
    return elements * sim.itemsize


def _nvme_staging(config: Config) -> int:
    if config.offload.optimizer != "nvme":
        return 0
    nvme = config.offload.nvme
    return nvme_staging_bytes(nvme.block_size, nvme.io_threads)


def _speculation(config: Config, sim: _Simulation, homes: list[str], gpu: bool) -> int:
    """The buffers that make speculative host updates undoable (``offload.speculation``): of
    every group updated on the host, shadows of its state chunks (a home in host memory:
    their span's elements, padding included) and copies of what its update overwrites in
    place (its span's parameters, padding left out), in the order the groups become final
    (last packed first), as many as ``offload.speculation_bytes`` allows. fp32 gradients
    that the kernel divides by the world size where they lie (in host memory: a GPU's are
    staged) are copied too."""
    if not config.offload.overlap or not speculative_reasons(config):
        return 0
    state_itemsize = STATE_DTYPES[config.offload.state_dtype].itemsize
    divided_grads = not sim.mixed and sim.sharding.world_size > 1 and not gpu
    group_bytes = []
    for layout, home in zip(sim.packed.trainable, homes, strict=True):
        if home == "device":
            continue
        shadow, copy = Snapshot.bytes_per_element(
            sim.mixed,
            state_itemsize,
            not sim.separate_grads,
            sim.itemsize,
            home == "host",
            divided_grads,
        )
        group_bytes.append(
            sim.state_elements(layout) * shadow + _updated_elements(sim, layout) * copy
        )
    return speculation_held_bytes(list(reversed(group_bytes)), config.offload.speculation_bytes)


def _updated_elements(sim: _Simulation, layout: int) -> int:
    """The most parameter elements any rank's state span of ``layout`` holds."""
    chunk = sim.packed.layouts[layout]
    span = sim.state_elements(layout)
    ranks = chunk.capacity // span
    used = [0] * ranks
    for slot in chunk.slots:
        start, end = slot.offset, slot.offset + slot.numel
        for rank in range(start // span, min(ranks, -(-end // span))):
            used[rank] += min(end, (rank + 1) * span) - max(start, rank * span)
    return max(used)


def _first_cycle(config: Config, sim: _Simulation, masters_on_device: bool) -> int:
    """The host during the first (recording) cycle: the NVMe tier's staging buffers, and the
    fp32 masters, which wait there for the first step to give them their home unless they
    start on the device (``chunkmem.sizing.masters_start_on_device``)."""
    return _nvme_staging(config) + (0 if masters_on_device else sim.masters_bytes)
