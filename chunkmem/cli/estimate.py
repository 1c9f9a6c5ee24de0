"""``chunkmem estimate``: the estimate (chunkmem/estimate) as a table or JSON, and
``--max-model``: the largest value of one model key whose model fits the memory given."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from chunkmem.byte_sizes import parse_byte_size
from chunkmem.cli.exit_codes import ExitCode
from chunkmem.cli.settings import ModelSettings, load
from chunkmem.errors import ConfigError
from chunkmem.estimate import Estimate, estimate
from chunkmem.machine import gpu_memory

_SEARCH_LIMIT = 1 << 20
_INTEGER = (int, int | None)


def run_estimate(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.model is not None:
        overrides.append(f"model.build={args.model}")
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", 1))
    settings, config = load(args.config, overrides, world_size)
    device = _bytes("--device-memory", args.device_memory, None)
    if device is None:
        chosen = args.config is not None or any(o.startswith("device.capacity=") for o in overrides)
        if not chosen and config.device.type != "simulated":
            device = _gpu_present(args.json)  # rather than the demo's embedded capacity
        if device is None:
            device = config.device.capacity
    host = _bytes("--host-memory", args.host_memory, config.host.capacity)

    def estimate_for(model: ModelSettings) -> Estimate:
        return estimate(
            model,
            config,
            batch=settings.train.batch,
            world_size=world_size,
            node_size=args.node_size,
            device_capacity=device,
            host_capacity=host,
            gpu=config.device.type != "simulated",
        )

    if args.max_model:
        if device is None:
            raise ConfigError("--max-model needs the device memory: --device-memory 80GiB")
        result = max_model(settings.model, args.max_model, estimate_for)
        print(json.dumps(result, indent=1) if args.json else _max_model_text(result))
        return int(ExitCode.OK if result["largest_that_trains"] else ExitCode.OUT_OF_MEMORY)
    result = estimate_for(settings.model)
    print(json.dumps(result.as_dict(), indent=1) if args.json else render(result))
    return int(ExitCode.OUT_OF_MEMORY if result.trains is False else ExitCode.OK)


def _gpu_present(quiet: bool) -> int | None:
    """The memory of the GPU this machine has (NVML), when none was given; says so."""
    gpu = gpu_memory(0)
    if gpu is None:
        return None
    if not quiet:
        print(
            f"device memory: {_size(gpu.total_bytes)} of GPU {gpu.index} ({gpu.name}), read "
            f"from the driver; --device-memory sets another"
        )
    return gpu.total_bytes


def _bytes(flag: str, text: str | None, default: int | None) -> int | None:
    if text is None:
        return default
    try:
        return parse_byte_size(text)
    except ValueError as error:
        raise ConfigError(f"{flag}: {error}") from None


def with_value(model: ModelSettings, key: str, value: int) -> ModelSettings:
    """``model`` with ``key`` (a field, or ``kwargs.NAME``) set to ``value``."""
    if key.startswith("kwargs."):
        return model.model_copy(update={"kwargs": {**model.kwargs, key[len("kwargs.") :]: value}})
    integers = [k for k, f in ModelSettings.model_fields.items() if f.annotation in _INTEGER]
    if key not in integers:
        raise ConfigError(
            f"--max-model {key!r}: not an integer model key; use one of {integers} or kwargs.NAME"
        )
    return ModelSettings.model_validate({**model.model_dump(), key: value})


def largest(fits: Callable[[int], bool], limit: int = _SEARCH_LIMIT) -> int | None:
    """The largest ``v`` in ``1..limit`` with ``fits(v)``, for a ``fits`` true up to some
    value and false after it (doubling, then bisecting); None if not even 1 fits."""
    if not fits(1):
        return None
    good, bad = 1, 2
    while bad <= limit and fits(bad):
        good, bad = bad, bad * 2
    if bad > limit:
        return good
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def max_model(
    model: ModelSettings, key: str, estimate_for: Callable[[ModelSettings], Estimate]
) -> dict[str, Any]:
    """The largest ``key`` whose model stays whole on the device, and the largest that
    trains with chunks moving to the host, with their estimates."""
    with_value(model, key, 1)  # a bad key fails before the search
    cache: dict[int, Estimate] = {}

    def at(value: int) -> Estimate:
        if value not in cache:
            cache[value] = estimate_for(with_value(model, key, value))
        return cache[value]

    resident = largest(lambda v: bool(at(v).fits_on_device))
    trains = largest(lambda v: bool(at(v).trains))
    return {
        "key": key,
        "largest_on_device": resident,
        "largest_that_trains": trains,
        "on_device": at(resident).as_dict() if resident else None,
        "trains": at(trains).as_dict() if trains else None,
    }


def _max_model_text(result: dict[str, Any]) -> str:
    lines = []
    for what, name in (("on_device", "whole on the device"), ("trains", "trains (chunks moving)")):
        value = result[f"largest_{'on_device' if what == 'on_device' else 'that_trains'}"]
        found = result[what]
        if found is None:
            lines.append(f"{name}: no value of {result['key']} fits")
            continue
        memory = found["memory"]
        lines.append(
            f"{name}: {result['key']} = {value}: {found['model']}, {found['parameters']:,} "
            f"parameters; device peak {_size(memory['peak_device_bytes'])}, minimum "
            f"{_size(memory['min_device_bytes'])}, host {_size(memory['peak_host_bytes'])}"
        )
    return "\n".join(lines)


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "unlimited"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def render(result: Estimate) -> str:
    """The estimate as a table a person reads."""
    memory, wire = result.memory, result.wire
    nodes = result.world_size // result.node_size
    ranks = (
        f"{result.strategy} on {result.world_size} ranks ({nodes} node{'s' if nodes > 1 else ''})"
        if result.world_size > 1
        else result.strategy
    )
    rows: list[tuple[str, str]] = [
        (
            "device peak",
            f"{_size(memory.peak_device_bytes)}  (at {memory.peak_device_at}; first "
            f"iteration {_size(memory.first_cycle_peak_device_bytes)})",
        ),
        *((f"  {kind}", _size(nbytes)) for kind, nbytes in memory.device_bytes_at_peak.items()),
        ("device minimum (chunks moving)", _size(memory.min_device_bytes)),
        (
            "host (steady / first cycle)",
            f"{_size(memory.host_bytes)} / {_size(memory.first_cycle_host_bytes)}",
        ),
        ("NVMe", _size(memory.nvme_bytes)),
        (
            "wire per step",
            f"{_size(wire.bytes_per_rank)}"
            + (
                " (" + ", ".join(f"{op} {_size(n)}" for op, n in wire.by_op.items()) + ")"
                if wire.by_op
                else ""
            ),
        ),
        (
            "  cross-node",
            f"{_size(wire.cross_node_bytes_per_rank)} from the rank that sends the most to "
            f"other nodes ({_size(wire.cross_node_bytes_all_ranks)} from all ranks)"
            if nodes > 1
            else "0 B (one node)",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    homes = ", ".join(f"{tier} {count}" for tier, count in memory.state_homes.items())
    lines = [
        f"{result.model}: {result.parameters:,} parameters ({result.trainable_parameters:,} "
        f"trainable), {result.precision}, {ranks}, micro-batch {result.batch} x {result.seq} "
        f"tokens",
        f"chunks: {memory.layouts} layouts of {memory.chunk_size:,} elements (padding "
        f"{memory.padding_elements:,}); optimizer-state groups: {homes}",
        "",
        f"{'per rank'.ljust(width)}  bytes",
        *(f"{name.ljust(width)}  {value}" for name, value in rows),
        "",
        _verdict(result),
    ]
    return "\n".join(lines)


def _verdict(result: Estimate) -> str:
    if result.device_capacity is None:
        return "no device memory given (--device-memory or device.capacity): no verdict"
    memory = f"device {_size(result.device_capacity)}, host {_size(result.host_capacity)}"
    if result.fits_on_device:
        return f"fits ({memory}): every chunk stays in its home, nothing is evicted"
    if result.trains:
        return (
            f"trains ({memory}) with chunks moving between the device and the host every "
            f"step; it needs {_size(result.memory.peak_device_bytes)} to stay put"
        )
    return (
        f"does not fit ({memory}): the device needs at least "
        f"{_size(result.memory.min_device_bytes)}, or the host more memory"
    )
