"""Storage tiers are data: a third tier (here a second host pool with its own capacity)
needs no change in residency, the ledger or the report."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch

from chunkmem.chunk import ChunkKind, ChunkLayout
from chunkmem.devices import DeferredCopy, SimulatedDevice
from chunkmem.errors import OutOfMemoryError
from chunkmem.ledger import DRAINING, Ledger
from chunkmem.placement import Placement
from chunkmem.report.html_page import render_html
from chunkmem.report.memory_trace import build_memory_trace
from chunkmem.report.summary import RunSummary
from chunkmem.residency import Residency
from chunkmem.tiers import DeviceTier, HostTier, TierCopy, TierSet
from chunkmem.tracer import Moment, Phase, Tracer

CHUNK = 256  # elements

NO_CHUNKS = {
    "chunk_size_elements": CHUNK,
    "layouts": 0,
    "chunks_by_kind": {},
    "padding_elements": 0,
    "used_elements": 0,
    "search": {
        "padding_elements": 0,
        "waste_fraction": 0.0,
        "oversized_tensors": 0,
        "candidates_tried": 0,
    },
}


def residency_with_second_host_pool(pool_capacity: int) -> Residency:
    device = SimulatedDevice()
    tiers = TierSet(
        DeviceTier(device, 16 * CHUNK * 4),
        HostTier(device, None),
        HostTier(device, pool_capacity, name="pool"),
    )
    return Residency(
        device, tiers, Ledger(tiers.capacities()), Tracer(), Placement("belady", True, 0.0, 10**6)
    )


def new_param_chunk(residency: Residency, index: int):
    layout = ChunkLayout(index, CHUNK, trainable=True)
    return residency.new_chunk(layout, ChunkKind.PARAM, torch.float32, residency.compute)


def test_a_chunk_moves_through_a_new_tier_with_exact_accounting() -> None:
    residency = residency_with_second_host_pool(pool_capacity=2 * CHUNK * 4)
    chunk = new_param_chunk(residency, 0)
    chunk.payload.copy_(torch.arange(CHUNK, dtype=torch.float32))
    pool, host, device = residency.tiers["pool"], residency.tiers["host"], residency.compute
    ledger = residency.ledger
    residency.move(chunk, pool, "test")
    assert chunk.tier is pool and not chunk.on_device
    assert (ledger.tiers["pool"].by_kind["param"], ledger.device.by_kind["param"]) == (1024, 0)
    residency.move(chunk, host, "test")
    residency.move(chunk, device, "test")
    assert torch.equal(chunk.payload, torch.arange(CHUNK, dtype=torch.float32))
    assert [(m.src, m.dst) for m in ledger.moves] == [
        ("device", "pool"),
        ("pool", "host"),
        ("host", "device"),
    ]
    assert {name: ledger.bytes_into(name, 0) for name in ledger.tiers} == {
        "device": 1024,
        "host": 1024,
        "pool": 1024,
    }
    assert ledger.bytes_moved(0) == 3 * 1024


def test_the_new_tier_enforces_its_own_capacity() -> None:
    residency = residency_with_second_host_pool(pool_capacity=CHUNK * 4)
    first, second = new_param_chunk(residency, 0), new_param_chunk(residency, 1)
    residency.move(first, residency.tiers["pool"], "test")
    # Pinned, the first chunk cannot go back up to make room (the device has room for it).
    with (
        residency.pinned([first]),
        pytest.raises(OutOfMemoryError, match=r"^pool memory exhausted: 1,024 bytes needed, 0"),
    ):
        residency.move(second, residency.tiers["pool"], "test")
    assert second.on_device, "a move that cannot be accounted leaves the chunk where it was"


def test_the_report_lists_the_new_tier_and_its_direction() -> None:
    residency = residency_with_second_host_pool(pool_capacity=None)
    chunk = new_param_chunk(residency, 0)
    residency.room.enter_moment(Moment(Phase.FORWARD, "a"))
    residency.move(chunk, residency.tiers["pool"], "test")
    residency.room.enter_moment(Moment(Phase.FORWARD, "b"))
    summary = RunSummary("simulated", "fp32", 0, 1.0, {}, NO_CHUNKS, 0, None, [], 0, 0)
    doc = build_memory_trace(summary, residency.ledger)
    assert list(doc["summary"]["tiers"]) == ["device", "host", "pool"]
    assert doc["moments"][1]["pool"]["by_kind"]["param"] == 1024
    assert doc["moves"][0]["direction"] == "to_pool"
    assert doc["bytes_moved"] == [{"iteration": 0, "to_device": 0, "to_host": 0, "to_pool": 1024}]
    assert "Pool bytes at each moment" in render_html(doc)


def test_residency_names_no_tier() -> None:
    """Residency and its room decide by the tiers' data (compute, the spill tier), never by a
    name."""
    package = Path(__file__).resolve().parents[1] / "chunkmem"
    literals = {
        node.value
        for module in ("residency.py", "room.py")
        for node in ast.walk(ast.parse((package / module).read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert not literals & {"device", "host", "nvme"}


def test_a_copy_off_the_device_left_to_its_reader_holds_the_device_bytes_until_it_ran() -> None:
    residency = residency_with_second_host_pool(pool_capacity=None)
    chunk = new_param_chunk(residency, 0)
    values = torch.arange(CHUNK, dtype=torch.float32)
    chunk.payload.copy_(values)
    ledger = residency.ledger
    residency.move(chunk, residency.tiers.spill, "test", reader_copies=True)
    # The new host buffer is uninitialised (it may even hold these values from a freed
    # buffer), so whether a copy ran is the event's to say, not the payload's.
    event = chunk.pending_event
    assert isinstance(event, DeferredCopy) and not event.is_completed(), (
        "the engine's thread copied"
    )
    assert ledger.device.by_kind == {"param": 0, DRAINING: CHUNK * 4}
    residency.drains.reap()
    assert ledger.device.by_kind[DRAINING] == CHUNK * 4, "held until the reader's copy ran"

    reader = threading.Thread(target=TierCopy(chunk.tier, event).wait)
    reader.start()
    reader.join()
    assert event.is_completed() and torch.equal(chunk.payload, values)
    residency.ready(chunk)  # the owner's wait after the reader's copies nothing again
    residency.drains.reap()
    assert ledger.device.by_kind[DRAINING] == 0 and ledger.device.used == 0
    assert ledger.tiers["host"].by_kind["param"] == CHUNK * 4


def test_a_copy_left_to_its_reader_runs_once_whoever_waits_first() -> None:
    source, destination = torch.ones(CHUNK), torch.zeros(CHUNK)
    copy = DeferredCopy(destination, source)
    assert not copy.is_completed()
    copy.wait()
    source.fill_(2.0)  # a second wait must not copy what the source holds now
    copy.wait()
    assert copy.is_completed() and torch.equal(destination, torch.ones(CHUNK))
