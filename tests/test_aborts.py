"""An exception anywhere in a cycle leaves nothing pinned or in flight, and training goes on.

After an exception in forward, backward or step (stages 0 to 3), no chunk stays pinned, no
collective is left half-issued, and the next batches train to exactly the parameters of a run
that never saw the failed batch. A failure the engine cannot undo (a step that updated some
parameters, a failed collective) stops the engine, and every later call says why. When only
one rank fails, the others get a CollectiveError within the timeout instead of a hang.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chunkmem
from chunkmem.errors import CollectiveError, EngineUsageError
from chunkmem.layout_update import LayoutUpdate
from tests.distributed_helpers import one_rank_at_a_time, run_ranks, run_threads

WIDTH = 16
DEPTH = 6
STEPS = 4
FAIL_AT = 2  # the batch whose backward (or forward, or step) raises


class FailingBackward(torch.autograd.Function):
    """Identity whose backward raises while ``model.fail_backward`` is set."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, model: Net) -> torch.Tensor:  # type: ignore[override]
        ctx.model = model
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.model.fail_backward:
            raise RuntimeError("injected backward failure")
        return grad, None


class Net(nn.Module):
    """A stack of layers; the failure sits after the first, so its backward runs last, once
    the later layers' gradients are final (and, under ZeRO-2/3, their reductions launched)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.fail_forward = False
        self.fail_backward = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = FailingBackward.apply(self.layers[0](x), self)
        if self.fail_forward:
            raise RuntimeError("injected forward failure")
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        return F.mse_loss(h, y)


def batches(world: int = 1, rank: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    data = [
        (torch.randn(4 * world, WIDTH, generator=generator), torch.randn(4 * world, WIDTH, generator=generator))
        for _ in range(STEPS)
    ]  # fmt: skip
    return [(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]) for x, y in data]


def make_engine(stage: int = 0, comm=None, **config) -> chunkmem.Engine:
    """One process (``stage`` 0) or a rank of ``comm``'s world (its groups' timeout applies)."""
    with contextlib.nullcontext() if comm is None else one_rank_at_a_time(comm):
        torch.manual_seed(0)
        model = Net()
    return chunkmem.initialize(
        model,
        comm=comm,
        config={
            "device": {"type": "simulated", "capacity": "1MiB"},
            "chunk": {"size": 320},  # a layout per layer or so: several reductions in flight
            "optimizer": {"lr": 1e-2},
            **({"zero": {"stage": stage, "timeout_s": 5}} if stage else {}),
            **config,
        },
    )


def nothing_held(engine: chunkmem.Engine) -> bool:
    """No chunk pinned, no reduction or gather in flight, every tensor in a HOLD state."""
    chunks = engine.residency.chunks.values()
    return (
        all(chunk.pins == 0 and chunk.arriving is None for chunk in chunks)
        and not getattr(engine.reducer, "_in_flight", {})
        and engine.params.states_hold()
    )


def inject(engine: chunkmem.Engine, where: str, on: bool) -> None:
    if where == "forward":
        engine.module.fail_forward = on
    elif where == "backward":
        engine.module.fail_backward = on
    elif on:  # step: raises before anything is updated
        engine.reducer.before_step = _raise
    else:
        del engine.reducer.before_step  # the class's method again


def _raise(*_args, **_kwargs) -> None:
    raise RuntimeError("injected step failure")


def train(engine: chunkmem.Engine, data, fail: str | None) -> dict[str, torch.Tensor]:
    """Train on ``data``; batch FAIL_AT raises at ``fail`` (None: skip it instead)."""
    for index, batch in enumerate(data):
        if index == FAIL_AT:
            if fail is None:
                continue
            inject(engine, fail, on=True)
            with pytest.raises(RuntimeError, match="injected"):
                engine.backward(engine(*batch))
                engine.step()
            inject(engine, fail, on=False)
            assert nothing_held(engine)
            continue
        engine.backward(engine(*batch))
        engine.step()
    return engine.state_dict()


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_failed_batch_leaves_nothing_held_and_changes_nothing(where: str, precision: str) -> None:
    config = {"precision": precision, "offload": {"optimizer": "host"}}
    failed = train(make_engine(**config), batches(), fail=where)
    skipped = train(make_engine(**config), batches(), fail=None)
    for name, value in skipped.items():
        assert torch.equal(failed[name], value), name


def test_a_step_that_fails_before_updating_anything_is_undone() -> None:
    failed = train(make_engine(precision="bf16"), batches(), fail="step")
    skipped = train(make_engine(precision="bf16"), batches(), fail=None)
    for name, value in skipped.items():
        assert torch.equal(failed[name], value), name


def test_a_step_that_fails_half_way_stops_the_engine_and_says_why(monkeypatch) -> None:
    engine = make_engine()
    data = batches()
    engine.backward(engine(*data[0]))
    engine.step()
    calls = []
    real_update = engine.optimizer.updates.run_calls

    def second_call_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected step failure")
        real_update(*args, **kwargs)

    monkeypatch.setattr(engine.optimizer.updates, "run_calls", second_call_fails)
    engine.backward(engine(*data[1]))
    with pytest.raises(RuntimeError, match="injected step failure"):
        engine.step()
    assert nothing_held(engine)
    with pytest.raises(EngineUsageError, match=r"failed after it began updating 2 chunk group"):
        engine(*data[2])


@pytest.mark.parametrize("host_thread_lags", [False, True])
def test_an_early_update_failing_on_the_host_thread_stops_the_engine(
    monkeypatch, host_thread_lags: bool
) -> None:
    """With ``offload.overlap`` (no clipping: the early updates are final) a run that raises on
    the host thread surfaces in backward, or in the step where the host thread lags behind
    backward, after other groups were updated. Cancelling raised the run's error again, and
    the stop was skipped: the engine trained on, half updated.

    Where it surfaces is timing: ``host_thread_lags`` holds the failing run until backward has
    returned, so that the step surfaces it; without it, either call may."""
    engine = make_engine(precision="bf16", offload={"optimizer": "host", "overlap": True})
    data = batches()
    for x, y in data[:2]:
        engine.backward(engine(x, y))
        engine.step()
    runs = []
    backward_returned = threading.Event()
    real_run = LayoutUpdate.run

    def third_run_fails(update: LayoutUpdate) -> None:
        runs.append(1)
        if len(runs) == 3:
            if host_thread_lags:
                backward_returned.wait(timeout=60)
            raise RuntimeError("injected host-thread failure")
        real_run(update)

    monkeypatch.setattr(LayoutUpdate, "run", third_run_fails)
    with pytest.raises(RuntimeError, match="injected host-thread failure"):
        try:
            engine.backward(engine(*data[2]))
        finally:
            backward_returned.set()
        assert not engine.stopped_because  # backward returned: the step surfaces the run's error
        engine.step()
    assert nothing_held(engine)
    call = r"engine\.step\(\)" if host_thread_lags else r"engine\.(backward|step)\(\)"
    with pytest.raises(EngineUsageError, match=rf"{call} failed after it began updating"):
        engine(*data[3])


def test_a_step_whose_read_ahead_fails_releases_the_prepared_update(monkeypatch) -> None:
    """The next group's states are read ahead (NVMe) between preparing a group's update and
    running it: a failed read releases what the prepared update pinned, at once."""
    engine = make_engine()
    data = batches()
    engine.backward(engine(*data[0]))
    engine.step()

    def read_fails(layout) -> None:
        raise OSError("injected read-ahead failure")

    monkeypatch.setattr(engine.optimizer.states, "prefetch", read_fails)
    engine.backward(engine(*data[1]))
    with pytest.raises(OSError, match="injected read-ahead failure") as failure:
        engine.step()
    # Held while the traceback (which keeps the step's frame) lives: the release must not
    # wait for the garbage collector.
    assert nothing_held(engine), failure.traceback
    with pytest.raises(EngineUsageError, match=r"failed after it began updating 1 chunk group"):
        engine(*data[2])


# ---------------------------------------------------------------- two ranks
DISTRIBUTED = pytest.mark.distributed


def rank_run(comm, stage: int, failing_ranks: tuple[int, ...] | None) -> dict:
    """Train STEPS batches of this rank's slice; batch FAIL_AT raises in backward on
    ``failing_ranks`` (None: every rank skips it)."""
    engine = make_engine(stage, comm, offload={"optimizer": "host"})
    data = batches(comm.size, comm.rank)
    outcome: dict = {"held_after_failure": None, "collective_error_after_s": None}
    for index, batch in enumerate(data):
        if index == FAIL_AT:
            if failing_ranks is None:
                continue
            if comm.rank in failing_ranks:
                engine.module.fail_backward = True
                with pytest.raises(RuntimeError, match="injected"):
                    engine.backward(engine(*batch))
                engine.module.fail_backward = False
                outcome["held_after_failure"] = not nothing_held(engine)
                if len(failing_ranks) < comm.size:
                    return outcome  # the others must not hang waiting for this rank
                continue
            started = time.monotonic()
            try:
                engine.backward(engine(*batch))
                engine.step()
            except CollectiveError:
                outcome["collective_error_after_s"] = time.monotonic() - started
                outcome["stopped"] = engine.stopped_because is not None
                return outcome
        engine.backward(engine(*batch))
        engine.step()
    outcome["state"] = engine.state_dict()
    return outcome


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 3])
def test_backward_failing_on_every_rank_leaves_the_ranks_in_step(stage: int) -> None:
    failed = run_threads(rank_run, 2, stage, (0, 1), timeout_s=5)
    skipped = run_threads(rank_run, 2, stage, None, timeout_s=5)
    for rank in range(2):
        assert failed[rank]["held_after_failure"] is False
        for name, value in skipped[rank]["state"].items():
            assert torch.equal(failed[rank]["state"][name], value), (rank, name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stage", "world"), [(2, "threads"), (3, "threads"), pytest.param(3, "gloo", marks=DISTRIBUTED)]
)
def test_backward_failing_on_one_rank_gives_the_other_a_collective_error(
    stage: int, world: str
) -> None:
    timeout_s = 1.0 if world == "threads" else 3.0
    run = run_threads if world == "threads" else run_ranks
    results = run(rank_run, 2, stage, (1,), timeout_s=timeout_s)
    assert results[1]["held_after_failure"] is False
    waited = results[0]["collective_error_after_s"]
    assert waited is not None, "rank 0 trained on without its peer"
    # The timeout, then the short question to the peer, and collectives still in flight
    # fail at once (zero/comm.py).
    assert waited < timeout_s + 1.0, f"rank 0 waited {waited:.1f} s for a {timeout_s} s timeout"
    assert results[0]["stopped"], "a failed collective must stop the engine"
