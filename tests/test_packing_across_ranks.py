"""Ranks whose first forward takes different paths (a branch their data decides) pack their
parameters alike, in registration order: packed by first use, each rank's layouts would hold
other parameters, and the reductions would add one parameter's gradients to another's
without any error."""

from __future__ import annotations

import pytest
import torch

import chunkmem
from tests.distributed_helpers import one_rank_at_a_time, run_threads

STEPS = 4
CHUNK = 256  # a layout per layer: 135, 240, 240 and 32 elements


class TwoBranches(torch.nn.Module):
    """Two layers of one size, each taken by one rank's data: packed by first use, rank 0
    would put ``a`` where rank 1 puts ``b``, and the reductions would add one's gradients to
    the other's."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 15)
        self.a = torch.nn.Linear(15, 15)
        self.b = torch.nn.Linear(15, 15)
        self.head = torch.nn.Linear(15, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor, branch: str) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = h + torch.tanh(getattr(self, branch)(h))
        return torch.nn.functional.mse_loss(self.head(h), y)


def _two_branch_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
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


def _two_branch_rank(comm, stage: int) -> dict:
    engine = small_engine(comm, TwoBranches, {"stage": stage})
    branch = "ab"[comm.rank]
    for x, y in _two_branch_batches(comm.rank):
        engine.backward(engine(x, y, branch))
        engine.step()
    return {
        "layouts": [[s.name for s in layout.slots] for layout in engine.params.layouts],
        "state": engine.state_dict(),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_ranks_whose_first_forward_differs_pack_alike_and_train_right(stage: int) -> None:
    """Rank 0 uses ``a``, rank 1 ``b``: both pack in registration order, and the parameters
    equal torch AdamW's on the two ranks' summed gradients. (Stage 3 gathers what a forward
    uses, so its ranks must use the same layouts, as FSDP's must.)"""
    results = run_threads(_two_branch_rank, 2, stage, timeout_s=30)
    assert results[0]["layouts"] == results[1]["layouts"]
    assert [name for names in results[0]["layouts"] for name in names] == [
        name for name, _p in TwoBranches().named_parameters()
    ]
    torch.manual_seed(0)
    model = TwoBranches()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    data = [_two_branch_batches(rank) for rank in range(2)]
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for rank in range(2):
            x, y = data[rank][step]
            (model(x, y, "ab"[rank]) / 2).backward()
        optimizer.step()
    for name, value in model.state_dict().items():
        for rank, result in enumerate(results):
            torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank} {name}")  # fmt: skip
