"""The byte ledger: capacity enforcement, peaks, moves per iteration."""

from __future__ import annotations

import pytest

from chunkmem.errors import OutOfMemoryError
from chunkmem.ledger import Ledger


def test_allocation_beyond_capacity_names_bytes_and_what_to_change() -> None:
    ledger = Ledger({"device": 1000, "host": None})
    ledger.allocate("device", "param", 600, "a param chunk", "chunk 0")
    ledger.set_nonmodel(300)
    with pytest.raises(OutOfMemoryError, match=r"200 bytes needed, 100 available") as error:
        ledger.allocate("device", "grad", 200, "a grad chunk", "chunk 1")
    assert "Raise the device capacity" in str(error.value)
    assert ledger.device.used == 900 and ledger.device.peak == 900
    assert [(e.action, e.owner, e.nbytes) for e in ledger.allocations] == [
        ("alloc", "chunk 0", 600)
    ]


def test_moves_are_counted_per_iteration_and_direction() -> None:
    ledger = Ledger({"device": None, "host": None})
    ledger.record_move(1, "param", "host", "device", 64, "fetch")
    ledger.iteration = 1
    ledger.record_move(1, "param", "device", "host", 64, "evict")
    ledger.record_move(2, "grad", "host", "device", 32, "fetch")
    assert ledger.bytes_moved(0) == 64
    assert (ledger.bytes_into("device", 1), ledger.bytes_into("host", 1)) == (32, 64)
    assert [m.reason for m in ledger.moves] == ["fetch", "evict", "fetch"]


def test_free_below_zero_is_a_bug_not_silence() -> None:
    ledger = Ledger({"device": None, "host": None})
    with pytest.raises(AssertionError, match="underflow"):
        ledger.free("host", "param", 1, "chunk 0")


def test_bytes_moved_per_iteration_are_kept_for_a_bounded_window(monkeypatch) -> None:
    from chunkmem import ledger as ledger_module

    monkeypatch.setattr(ledger_module, "MOVED_ITERATIONS_KEPT", 3)
    ledger = Ledger({"device": None, "host": None})
    for iteration in range(10):
        ledger.iteration = iteration
        ledger.record_move(1, "param", "host", "device", 8, "fetch")
    assert ledger.iterations_with_moves() == [7, 8, 9]
    assert ledger.bytes_moved(9) == 8 and ledger.moved_total["device"] == 80
    with pytest.raises(KeyError, match="left the ledger's window"):
        ledger.bytes_moved(2)


def test_each_iterations_peak_is_kept_per_tier() -> None:
    ledger = Ledger({"device": 100, "host": None})
    ledger.allocate("device", "param", 60, "a chunk", "chunk 0")
    ledger.allocate("host", "grad", 10, "a chunk", "chunk 1")
    ledger.free("device", "param", 60, "chunk 0")
    ledger.next_iteration()
    ledger.allocate("device", "param", 30, "a chunk", "chunk 2")
    ledger.next_iteration()
    assert [ledger.peak_in("device", i) for i in (0, 1)] == [60, 30]
    assert [ledger.peak_in("host", i) for i in (0, 1)] == [10, 10]  # still held in iteration 1
    assert ledger.device.peak == 60 and ledger.iteration == 2
    with pytest.raises(KeyError, match="iteration 2 is not among the ended iterations"):
        ledger.peak_in("device", 2)
