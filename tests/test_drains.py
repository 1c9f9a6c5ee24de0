"""Draining payloads (chunkmem/drains.py): a chunk copied off the device keeps its device
payload, and its bytes in the ledger, until the copy completed.

The simulated device copies synchronously, so these tests make copies off the device
asynchronous the way CUDA's are: the copy happens only when its event completes (polled a few
times, or waited for). A payload let go too early would be reused by the device's buffer cache
and the late copy would read someone else's bytes; a host reader that skipped its event would
read a payload not written yet. Either makes training depart from the synchronous run.
"""

from __future__ import annotations

import copy

import pytest
import torch

import chunkmem
from chunkmem.devices import SimulatedDevice
from chunkmem.drains import Drains
from chunkmem.ledger import DRAINING, Ledger
from chunkmem.models.gpt import GPT
from chunkmem.tiers import DeviceTier, HostTier
from tests.reference import token_batches, train_engine
from tests.test_training_matches_torch import CONFIG, STATE_BYTES_PER_PARAM, STEPS


class LateCopy:
    """An event whose copy runs when it completes: after ``polls`` queries, or when waited."""

    def __init__(self, source: torch.Tensor, destination: torch.Tensor, polls: int) -> None:
        self.source, self.destination, self.polls = source, destination, polls
        self.done = False

    def complete(self) -> None:
        if not self.done:
            self.destination.copy_(self.source)
            self.done = True

    def query(self) -> bool:
        self.polls -= 1
        if self.polls <= 0:
            self.complete()
        return self.done


class AsyncCopyDevice(SimulatedDevice):
    """The simulated device with CUDA's asynchronous copies to the host."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.polls = polls

    def to_host(self, device_tensor: torch.Tensor, host: torch.Tensor) -> object | None:
        return LateCopy(device_tensor, host, self.polls)

    def wait_host(self, event: object | None) -> None:
        if isinstance(event, LateCopy):
            event.complete()

    def completed(self, event: object | None) -> bool:
        return not isinstance(event, LateCopy) or event.query()


def make_async(engine: chunkmem.Engine, polls: int) -> AsyncCopyDevice:
    """Swap the engine's simulated device for one whose copies to the host are late."""
    residency = engine.residency
    device = AsyncCopyDevice(polls)
    device.meter = residency.device.meter
    residency.device = device
    residency.drains._device = device
    for tier in residency.tiers:
        tier.device = device

    def copy_in(
        self: HostTier, source: torch.Tensor, reader_copies: bool = False
    ) -> tuple[torch.Tensor, object | None]:
        payload = self.allocate(source.numel(), source.dtype)
        if residency.chunk_of_storage(source) is not None:  # a device payload
            return payload, device.to_host(source, payload)
        payload.copy_(source)
        return payload, None

    spill = residency.tiers.spill
    spill.copy_in = copy_in.__get__(spill)  # type: ignore[method-assign]
    return device


def test_drains_hold_bytes_until_the_copy_completed() -> None:
    ledger = Ledger({"device": 100, "host": None})
    device = AsyncCopyDevice(polls=2)
    drains = Drains(ledger, DeviceTier(device, 100), device)
    ledger.allocate("device", "param", 40, "a", "chunk 1")
    ledger.allocate("device", "param", 40, "b", "chunk 2")
    first, second = torch.zeros(10), torch.zeros(10)
    late = [LateCopy(torch.ones(10), first, 2), LateCopy(torch.ones(10), second, 5)]
    drains.hold(torch.empty(10), late[0], "param", "chunk 1")
    drains.hold(torch.empty(10), late[1], "param", "chunk 2")
    assert ledger.device.by_kind == {"param": 0, DRAINING: 80}
    assert ledger.device.used == 80 and drains.nbytes == 80, "draining bytes still take room"

    drains.reap()  # one poll each: neither copy is done
    assert len(drains) == 2 and drains.nbytes == 80
    drains.reap()  # the first completes; the second is behind it and not polled yet
    assert len(drains) == 1 and ledger.device.by_kind[DRAINING] == 40
    assert torch.equal(first, torch.ones(10)) and not second.any()

    drains.settle(until=lambda: ledger.would_fit("device", 60))
    assert len(drains) == 1, "60 bytes fit already: nothing more is waited for"
    drains.settle(until=lambda: ledger.would_fit("device", 100))
    assert len(drains) == 0 and ledger.device.used == 0 and drains.waits == 1
    assert torch.equal(second, torch.ones(10)), "waiting completes the copy"


def test_hand_over_refuses_bytes_the_tier_does_not_hold() -> None:
    ledger = Ledger({"device": 100})
    ledger.allocate("device", "param", 40, "a", "chunk 1")
    with pytest.raises(AssertionError, match="ledger underflow"):
        ledger.hand_over("device", "param", DRAINING, 50, "chunk 1")


@pytest.mark.parametrize("polls", [1, 3, 1_000_000])
def test_training_with_late_copies_matches_synchronous_copies(polls: int) -> None:
    """GPT larger than the device (test_gpt_larger_than_device_matches_plain_pytorch's shape,
    fp32: mixed precision streams its step and evicts nothing dirty here): copies that complete
    at the next poll, a few polls later, or only when waited for give the same losses and
    states, bit for bit, within the capacity, with nothing left draining."""
    precision = "fp32"
    model = GPT(CONFIG)
    capacity = int(STATE_BYTES_PER_PARAM[precision] * CONFIG.num_parameters() * 0.45)
    data = token_batches(STEPS, batch=2, seq=32, vocab=256)
    config = {
        "precision": precision,
        "device": {"type": "simulated", "capacity": capacity},
        "optimizer": {"lr": 1e-3},
    }
    synchronous = chunkmem.initialize(copy.deepcopy(model), config=config)
    expected = train_engine(synchronous, data)

    engine = chunkmem.initialize(copy.deepcopy(model), config=config)
    make_async(engine, polls)
    losses = train_engine(engine, data)

    assert losses == expected
    ours, theirs = engine.state_dict(), synchronous.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    drained = [e for e in engine.ledger.allocations if e.kind == DRAINING]
    assert drained, "chunks left the device while their copies ran"
    assert engine.ledger.device.peak <= capacity
    if polls == 1_000_000:
        assert engine.residency.drains.waits > 0, "room was needed before a copy completed"
    engine.close()
    assert len(engine.residency.drains) == 0 and engine.ledger.device.by_kind[DRAINING] == 0
