"""Ranks whose forward takes different paths (a branch their data decides) train as torch does
on their summed gradients:
- they pack their parameters alike, in registration order: packed by first use, each rank's
  layouts would hold other parameters, and the reductions would add one parameter's gradients
  to another's without any error;
- their reductions match when a branch no rank took in the last step comes back on one rank
  (a rank that had learned not to wait for it reduced its layout twice, alone);
- a parameter no rank uses does not stop the reductions overlapping backward;
- at stage 3, which gathers what each forward uses, ranks gathering other layouts are told
  apart by the layout in each collective's identity, and stopped.
See [Note: reductions when ranks take different paths] in zero/reduce.py."""

from __future__ import annotations

import pytest
import torch

import chunkmem
from tests.distributed_helpers import one_rank_at_a_time, run_threads
from zero.thread_world import RanksFailed

STEPS = 4
CHUNK = 256  # a layout per layer: 135, 240, 240 and 32 elements


class TwoBranches(torch.nn.Module):
    """Two layers of one size, which the caller's data decides to take (one, or none)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 15)
        self.a = torch.nn.Linear(15, 15)
        self.b = torch.nn.Linear(15, 15)
        self.head = torch.nn.Linear(15, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor, branch: str | None) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if branch is not None:
            h = h + torch.tanh(getattr(self, branch)(h))
        return torch.nn.functional.mse_loss(self.head(h), y)


# Each rank's branch at each step.
PATHS = {
    # Rank 0 uses a, rank 1 b, from the first forward on.
    "each-its-own": [["a"] * STEPS, ["b"] * STEPS],
    # a comes back on rank 0 in step 2 after no rank took it in step 1; rank 1 never takes it.
    "comes-back": [["a", None, "a", None], ["b", "b", None, "b"]],
    # b is never used (a pooler no loss reaches): it must not hold up the other reductions.
    "never-used": [["a"] * STEPS, ["a"] * STEPS],
}


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(200 + rank)
    return [(torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator))
            for _step in range(STEPS)]  # fmt: skip


def small_engine(comm, model_type: type[torch.nn.Module], zero: dict, **config):
    """An engine on a small model whose parameters are the same on every rank, a layout per
    layer (``CHUNK``)."""
    with one_rank_at_a_time(comm):
        torch.manual_seed(0)
        model = model_type()
    return chunkmem.initialize(
        model,
        comm=comm,
        config={
            "device": {"type": "simulated", "capacity": "16MiB"},
            "chunk": {"size": CHUNK},
            "optimizer": {"lr": 1e-2},
            "zero": {"timeout_s": 10, **zero},
            **config,
        },
    )


def _train_paths(comm, stage: int, paths: str) -> dict:
    engine = small_engine(comm, TwoBranches, {"stage": stage})
    reducer = engine.reducer
    launches: list[list[tuple[str, bool]]] = []  # per step: (first slot, in backward)
    launch = reducer._launch

    def recorded(layout) -> None:
        launches[-1].append((layout.slots[0].name, engine.hooks.in_backward))
        launch(layout)

    reducer._launch = recorded
    for (x, y), branch in zip(_batches(comm.rank), PATHS[paths][comm.rank], strict=True):
        launches.append([])
        engine.backward(engine(x, y, branch))
        engine.step()
    return {
        "layouts": [[s.name for s in layout.slots] for layout in engine.params.layouts],
        "state": engine.state_dict(),
        "launches": launches,
    }


def _reference(paths: str) -> dict[str, torch.Tensor]:
    """torch AdamW on the two ranks' gradients summed (halved: the mean); a parameter no rank
    reached has none and takes no step."""
    torch.manual_seed(0)
    model = TwoBranches()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    data = [_batches(rank) for rank in range(2)]
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for rank in range(2):
            x, y = data[rank][step]
            (model(x, y, PATHS[paths][rank][step]) / 2).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("paths", list(PATHS))
@pytest.mark.parametrize("stage", [1, 2])
def test_ranks_on_different_paths_train_as_torch_on_the_summed_gradients(
    stage: int, paths: str
) -> None:
    """Both pack in registration order, and the parameters equal torch AdamW's on the two
    ranks' summed gradients. (Stage 3 gathers what a forward uses, so its ranks must use the
    same layouts, as FSDP's must.)"""
    results = run_threads(_train_paths, 2, stage, paths, timeout_s=30)
    assert results[0]["layouts"] == results[1]["layouts"]
    assert [name for names in results[0]["layouts"] for name in names] == [
        name for name, _p in TwoBranches().named_parameters()
    ]
    for name, value in _reference(paths).items():
        for rank, result in enumerate(results):
            torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank} {name}")  # fmt: skip


@pytest.mark.timeout(120)
def test_a_layer_no_rank_uses_is_reduced_last_and_the_rest_overlap_backward() -> None:
    """Stage 2, b never used: in the first step no cycle says so, and b's layout (first in
    reduction order) holds every reduction until backward ends; from the second on, it is
    reduced last and the others while backward runs, on both ranks in one order."""
    results = run_threads(_train_paths, 2, 2, "never-used", timeout_s=30)
    first = [("b.weight", False), ("a.weight", False), ("first.weight", False)]
    overlapped = [("head.weight", True), ("a.weight", True), ("first.weight", True),
                  ("b.weight", False)]  # fmt: skip
    for result in results:
        assert result["launches"][0] == [("head.weight", True), *first]
        assert result["launches"][1:] == [overlapped] * (STEPS - 1)


@pytest.mark.timeout(120)
def test_stage_3_ranks_gathering_other_layouts_of_one_size_are_told_apart() -> None:
    """Stage 3 gathers what each forward uses: rank 0 gathers a where rank 1 gathers b, both
    of 256 elements. Matched by order and size alone, each would compute on half of one and
    half of the other; the layout in each collective's identity stops both, saying why."""
    with pytest.raises(RanksFailed) as failed:
        run_threads(_train_paths, 2, 3, "each-its-own", timeout_s=30)
    message = str(failed.value)
    assert "(all_gather of 256 elements of float32, layout 1), but rank 1" in message
    assert "(all_gather of 256 elements of float32, layout 2)" in message
    assert "their forwards used different parameters" in message
