"""ZeRO-3 on 8 gloo ranks as 2 nodes x 4, plain and with hpZ, bit for bit against the
split-batch reference.

At 8 ranks the sum of the ranks' gradients depends on its order, so the reference adds them in
the order the reduce-scatter does: the ring of ``zero/ring.py`` reduces rank ``k``'s segment
starting at rank ``k + 1`` and adding each next rank's gradient to the running sum, ending
with rank ``k`` (``zero/thread_world.py`` has the same note). Each element's owner ``k`` comes
from its offset in its layout, which the engine reports. hpZ changes where the backward's
parameters come from (the node's secondaries), never a value, so its run must match too.
"""

from __future__ import annotations

import pytest
import torch

import chunkmem
from chunkmem.models.gpt import GPT, GPTConfig
from tests.distributed_helpers import run_ranks

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
WORLD, PER_NODE = 8, 4
STEPS = 3
LR = 1e-3


def batches() -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(0, CONFIG.vocab_size, (STEPS, WORLD, CONFIG.block_size + 1),
                         generator=generator)  # fmt: skip


def rank_run(comm, zero: dict) -> dict:
    torch.manual_seed(0)
    engine = chunkmem.initialize(
        GPT(CONFIG),
        config={
            "device": {"type": "simulated", "capacity": "16MiB"},
            "chunk": {"size": 1024},
            "optimizer": {"lr": LR},
            "zero": {"stage": 3, "timeout_s": 60, "node_size": PER_NODE, **zero},
        },
    )
    for row in batches()[:, comm.rank : comm.rank + 1]:
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        engine.step()
    shard = {layout.index: layout.capacity // WORLD for layout in engine.params.layouts}
    where = {
        slot.name: (slot.offset, shard[slot.layout.index]) for slot in engine.params.slots.values()
    }
    return {"state": engine.state_dict(), "where": where}


def ring_sum(grads: list[torch.Tensor], owner: torch.Tensor) -> torch.Tensor:
    """Each element summed over the ranks in the ring's order for the rank that owns it."""
    world = len(grads)
    total = torch.empty_like(grads[0])
    for k in range(world):
        running = grads[(k + 1) % world]
        for step in range(2, world + 1):
            running = grads[(k + step) % world] + running
        mask = owner == k
        total[mask] = running[mask]
    return total


def reference(where: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Plain PyTorch: each rank's row computes its gradients, summed as the ring sums them,
    then fused AdamW divides by the world size."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    named = {id(p): n for n, p in model.named_parameters()}
    params = list(dict.fromkeys(model.parameters()))
    owners = {}
    for param in params:
        offset, shard = where[named[id(param)]]
        owners[id(param)] = ((offset + torch.arange(param.numel())) // shard).view(param.shape)
    for rows in batches():
        per_rank = []
        for row in rows:
            model.zero_grad(set_to_none=True)
            model(row[None, :-1], row[None, 1:]).backward()
            per_rank.append([p.grad.clone() for p in params])
        for index, param in enumerate(params):
            param.grad = ring_sum([g[index] for g in per_rank], owners[id(param)])
        optimizer.grad_scale = torch.tensor(float(WORLD))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [{}, {"hpz_partition_size": PER_NODE}], ids=["zero3", "hpz"])
def test_eight_ranks_as_two_nodes_match_the_ring_ordered_reference_bit_for_bit(zero) -> None:
    results = run_ranks(rank_run, WORLD, zero, timeout_s=60, deadline_s=240)
    expected = reference(results[0]["where"])
    for rank, result in enumerate(results):
        state = result["state"]
        differ = [name for name, value in expected.items() if not torch.equal(state[name], value)]
        assert differ == [], f"rank {rank}: {differ}"
