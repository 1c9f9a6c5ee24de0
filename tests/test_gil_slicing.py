"""The switch interval while host updates run beside backward (offload/gil_slicing.py): short
from each early update's submission until it is done, the interpreter's own again after the
last, however the runs end, and the smallest one asked for while engines overlap at once."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from chunkmem.errors import ConfigError
from chunkmem.update_builder import UpdateBuilder
from offload.gil_slicing import sliced
from tests.offload_helpers import batches, initialize, make_model, train_engine

DEVICE = {"type": "simulated", "capacity": 500_000}
BEFORE = 0.004  # an interval none of the tests asks for, to see it restored


def interval() -> float:
    """The interpreter keeps whole microseconds: 0.0002 reads back as 0.00019999999999999998."""
    return round(sys.getswitchinterval(), 6)


@pytest.fixture(autouse=True)
def interpreter_interval():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(BEFORE)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def intervals_seen_by_host_updates(monkeypatch, offload: dict) -> list[float]:
    """Train a few steps with overlap; the interval each host update's kernels ran under."""
    seen: list[float] = []
    run_calls = UpdateBuilder.run_calls

    def recording(self, calls) -> None:
        seen.append(interval())
        run_calls(self, calls)

    monkeypatch.setattr(UpdateBuilder, "run_calls", recording)
    engine = initialize(
        make_model(),
        precision="bf16",
        gradient_clipping=100.0,
        device=DEVICE,
        offload={"optimizer": "host", "overlap": True, **offload},
    )
    train_engine(engine, batches(5, rows=8))
    started = engine.reducer.listener.started
    engine.close()
    assert started >= 3, "updates ran in backward"
    return seen


def test_early_updates_run_under_the_configured_interval_and_it_is_restored(monkeypatch) -> None:
    seen = intervals_seen_by_host_updates(monkeypatch, {"switch_interval_s": 0.0003})
    assert 0.0003 in seen, "the early updates' runs"
    assert set(seen) <= {0.0003, BEFORE}, "serial updates in step() run under the interpreter's"
    assert interval() == BEFORE


def test_null_leaves_the_interpreter_alone(monkeypatch) -> None:
    seen = intervals_seen_by_host_updates(monkeypatch, {"switch_interval_s": None})
    assert seen and set(seen) == {BEFORE}


def test_the_default_is_short(monkeypatch) -> None:
    assert 0.0002 in intervals_seen_by_host_updates(monkeypatch, {})


def test_a_run_that_raises_gives_the_interval_back() -> None:
    with ThreadPoolExecutor(1) as executor:
        submit = sliced(executor.submit, 0.0005)

        def fail() -> None:
            assert interval() == 0.0005
            raise RuntimeError("kernel failed")

        future = submit(fail)
        with pytest.raises(RuntimeError, match="kernel failed"):
            future.result()
    assert interval() == BEFORE


def test_a_submission_that_fails_gives_the_interval_back() -> None:
    executor = ThreadPoolExecutor(1)
    executor.shutdown()
    with pytest.raises(RuntimeError, match="shutdown"):
        sliced(executor.submit, 0.0005)(lambda: None)
    assert interval() == BEFORE


def test_overlapping_engines_share_the_smallest_interval_until_the_last_run_ends() -> None:
    release = {name: threading.Event() for name in ("a", "b")}
    with ThreadPoolExecutor(2) as executor:
        try:
            a = sliced(executor.submit, 0.001)(release["a"].wait)
            assert interval() == 0.001
            b = sliced(executor.submit, 0.0002)(release["b"].wait)
            assert interval() == 0.0002
            release["b"].set()
            b.result()
            assert interval() == 0.001, "a's run is still in flight"
        finally:  # the runs end whatever failed, so the executor's exit does not hang
            for event in release.values():
                event.set()
        a.result()
    assert interval() == BEFORE


def test_a_non_positive_interval_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="switch_interval_s"):
        initialize(make_model(), device=DEVICE, offload={"overlap": True, "switch_interval_s": 0})
