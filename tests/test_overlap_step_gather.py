"""``zero.overlap_step_gather``: stages 1-2's step returns with its gathers of updated shards
in flight, the next forward waits for each where it first reads the layout, and backward
(or any reader of the whole model) for the rest. The same values bit for bit and the same
bytes as the step that waits, on 2 nodes x 2 (the gather in two levels) and on one ring."""

from __future__ import annotations

import pytest
import torch

import chunkmem
from chunkmem.chunk import ChunkKind
from chunkmem.errors import ConfigError
from tests.distributed_helpers import run_ranks, run_threads
from tests.test_ranks_taking_different_paths import small_engine

STEPS = 4
WORLD = 4


class Detour(torch.nn.Module):
    """A layer that the caller's flag decides to take (data decides the branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 15)
        self.branch = torch.nn.Linear(15, 15)
        self.head = torch.nn.Linear(15, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor, take_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if take_branch:
            h = h + torch.tanh(self.branch(h))
        return torch.nn.functional.mse_loss(self.head(h), y)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Rank 0 and 2 take the branch, rank 1 and 3 never do: their forward never reads the
    branch's layout, so their backward waits for its gather (and their first forward packs
    the branch by registration order, as rank 0 and 2 do by use)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator),
         rank % 2 == 0)
        for step in range(STEPS)
    ]  # fmt: skip


def _in_flight(engine) -> int:
    """Parameter chunks whose step gather nobody waited for yet."""
    return sum(
        layout.chunks[ChunkKind.PARAM].arriving is not None
        for layout in engine.params.trainable_layouts()
    )


def _train(comm, stage: int, overlap: bool, node_size: int) -> dict:
    zero = {"stage": stage, "node_size": node_size, "overlap_step_gather": overlap}
    engine = small_engine(comm, Detour, zero, precision="bf16", gradient_clipping=1.0)
    losses, after_step, after_forward, after_backward, norms = [], [], [], [], []
    for x, y, take_branch in _batches(comm.rank):
        loss = engine(x, y, take_branch)
        after_forward.append(_in_flight(engine))
        engine.backward(loss)
        after_backward.append(_in_flight(engine))
        engine.step()
        after_step.append(_in_flight(engine))
        losses.append(float(loss.detach()))
        norms.append(engine.last_grad_norm)
    ledger = engine.states.sharding.comm.ledger
    return {
        "losses": losses,
        "norms": norms,
        "state": engine.state_dict(),
        "after_step": after_step,
        "after_forward": after_forward,
        "after_backward": after_backward,
        "layouts": len(engine.params.trainable_layouts()),
        "step_gathers": [ledger.by_phase(t).get(("all_gather", "step")) for t in range(STEPS)],
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("node_size", [2, 4], ids=["two-levels", "one-ring"])
def test_the_step_gathers_finish_in_the_next_forward_with_the_same_bits(
    stage: int, node_size: int
) -> None:
    """bf16, clipping 1.0, a branch some ranks skip: every step returns with all its gathers
    unwaited, the forward waits for those it reads, backward for the rest; losses, norms,
    parameters and each step's gather calls and bytes equal the waiting step's."""
    runs = {
        overlap: run_threads(_train, WORLD, stage, overlap, node_size, timeout_s=30)
        for overlap in (True, False)
    }
    for rank, (ours, waiting) in enumerate(zip(runs[True], runs[False], strict=True)):
        assert ours["layouts"] == 3, "the branch has a layout of its own"
        assert ours["after_step"] == [ours["layouts"]] * STEPS, rank
        assert waiting["after_step"] == [0] * STEPS, rank
        skipped = [int(not take) for _x, _y, take in _batches(rank)]
        # The first forward follows no step; later ones leave the branch's gather unwaited
        # where they skip it.
        assert ours["after_forward"] == [0, *skipped[1:]], rank
        assert ours["after_backward"] == [0] * STEPS, rank
        assert ours["losses"] == waiting["losses"], rank
        assert ours["norms"] == waiting["norms"], rank
        assert ours["step_gathers"] == waiting["step_gathers"], rank
        for name, value in waiting["state"].items():
            assert torch.equal(ours["state"][name].view(torch.uint8), value.view(torch.uint8))


def _read_between_steps(comm) -> dict:
    """Parameters read right after a step: through ``state_dict`` (which waits) and through
    the module after ``wait_for_parameters``; then an aborted cycle (``discard``) waits too."""
    zero = {"stage": 2, "node_size": 2, "overlap_step_gather": True}
    engine = small_engine(comm, Detour, zero)
    x, y, _take = _batches(comm.rank)[0]
    engine.backward(engine(x, y, True))
    engine.step()
    in_flight_after_step = _in_flight(engine)
    state = engine.state_dict()
    after_state_dict = _in_flight(engine)
    engine.backward(engine(x, y, True))
    engine.step()
    engine.wait_for_parameters()
    module_values = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    after_wait = _in_flight(engine)
    engine(x, y, False)
    engine.discard()
    return {
        "in_flight_after_step": in_flight_after_step,
        "after_state_dict": after_state_dict,
        "state": state,
        "module_values": module_values,
        "after_wait": after_wait,
        "after_discard": _in_flight(engine),
        "reference": engine.state_dict(),
    }


@pytest.mark.timeout(120)
def test_readers_between_steps_wait_for_the_gathers() -> None:
    results = run_threads(_read_between_steps, WORLD, timeout_s=30)
    for rank, result in enumerate(results):
        assert result["in_flight_after_step"] > 0, rank
        assert result["after_state_dict"] == 0, rank
        assert result["after_wait"] == 0, rank
        assert result["after_discard"] == 0, rank
        for name, value in result["module_values"].items():
            assert torch.equal(value, result["reference"][name]), (rank, name)
    for name, value in results[0]["state"].items():  # every rank holds the same values
        for result in results[1:]:
            assert torch.equal(result["state"][name], value), name


@pytest.mark.parametrize("stage", [0, 3])
def test_a_stage_without_a_step_gather_refuses_it(stage: int) -> None:
    with pytest.raises(
        ConfigError, match=f"overlap_step_gather.*needs zero.stage 1 or 2, got stage {stage}"
    ):
        chunkmem.Config.from_dict({"zero": {"stage": stage, "overlap_step_gather": True}})


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_gloo_rings_finish_the_carried_gathers_whatever_each_forward_reads_first() -> None:
    """4 gloo ranks, one ring each gather (3 steps, the later ones run only in ``wait``): ranks
    1 and 3 read ``head`` first and the branch's layout at backward, ranks 0 and 2 the branch
    first. Waited in the order each rank reads them, each rank would block in one ring on a
    peer blocked in another; in issue order they finish, with the in-process world's bits."""
    gloo = run_ranks(_train, WORLD, 2, True, WORLD, timeout_s=20, deadline_s=240)
    threads = run_threads(_train, WORLD, 2, True, WORLD, timeout_s=30)
    for rank, (ours, reference) in enumerate(zip(gloo, threads, strict=True)):
        assert ours["after_step"] == [ours["layouts"]] * STEPS, rank
        assert ours["losses"] == reference["losses"], rank
        for name, value in reference["state"].items():
            assert torch.equal(ours["state"][name], value), (rank, name)
