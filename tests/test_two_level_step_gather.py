"""Stages 1-2's gather of updated shards in two levels (zero.two_level_gather): every rank's
shard arrives bit for bit on every topology, a node takes in only the other nodes' pieces (the
ledger's cross-node bytes against the formula and the cost model), the engine trains bit for
bit as with one ring, and the rule of when two levels pay."""

from __future__ import annotations

import itertools

import pytest
import torch

from chunkmem.config import Config
from tests.distributed_helpers import run_ranks, run_threads
from tests.test_zeropp import ITEMSIZE, train
from zero.comm import Communicator
from zero.gather import ExactAllGatherCosts
from zero.strategy import ZeroChoice
from zero.topology import Topology, build_gather_groups
from zero.two_level_gather import TwoLevelStepGather, TwoLevelStepGatherCosts, two_levels_pay

# (nodes, ranks per node): the node index and the local rank each take 2 and more values.
TOPOLOGIES = [(2, 2), (2, 3), (3, 2), (4, 2)]
SHARDS = (1, 5)
LAYOUTS = 3  # gathers in a row: each advances the one before (its inside level)


def _shard(rank: int, layout: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * layout + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _gathers(comm: Communicator, per_node: int) -> dict[str, int]:
    """Every case on this rank; the cross-node and intra-node bytes it sent per gather."""
    topology = Topology(comm.size, per_node)
    comm.topology = topology
    inter, intra = build_gather_groups(comm, topology)
    gather = TwoLevelStepGather(comm, topology, inter, intra, "step")
    sent = {"cross": 0, "intra": 0, "gathers": 0}
    for dtype, numel in itertools.product((torch.float32, torch.bfloat16), SHARDS):
        fulls, arrivals = [], []
        for layout in range(LAYOUTS):
            full = torch.full((comm.size * numel,), float("nan"), dtype=dtype)
            mine = full[comm.rank * numel : (comm.rank + 1) * numel]
            mine.copy_(_shard(comm.rank, layout, numel, dtype))
            if arrivals:
                arrivals[-1].advance()  # as GatherUpdatedShards does before the next
            arrivals.append(gather(mine, full, True))
            fulls.append(full)
        for layout, (full, arrival) in enumerate(zip(fulls, arrivals, strict=True)):
            arrival.wait()
            expected = torch.cat([_shard(r, layout, numel, dtype) for r in range(comm.size)])
            assert torch.equal(full.view(torch.uint8), expected.view(torch.uint8)), (
                f"rank {comm.rank}, {dtype}, shard {numel}, layout {layout}"
            )
        full = torch.zeros(comm.size * numel, dtype=dtype)
        before_cross, before_all = comm.ledger.cross_node_bytes(), comm.ledger.bytes_sent()
        mine = full[comm.rank * numel : (comm.rank + 1) * numel]
        mine.copy_(_shard(comm.rank, 0, numel, dtype))
        gather(mine, full, False)  # waits: both levels
        cross = comm.ledger.cross_node_bytes() - before_cross
        sent["cross"] += cross
        sent["intra"] += comm.ledger.bytes_sent() - before_all - cross
        sent["gathers"] += 1
        assert torch.equal(full, torch.cat([_shard(r, 0, numel, dtype) for r in range(comm.size)]))
    return sent


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("nodes", "per_node"), TOPOLOGIES, ids=[f"{n}x{d}" for n, d in TOPOLOGIES])
def test_every_shard_arrives_and_only_other_nodes_pieces_cross(nodes: int, per_node: int) -> None:
    """Shards of 1 and 5 elements, fp32 and bf16, three layouts in flight at once: the
    gathered chunks hold every rank's shard bit for bit, and a rank sends its piece across the
    boundary once to each other node (a node takes in ``W - D`` pieces, one ring ``W - 1``)
    and ``D - 1`` times inside its node for each node's segment, as the cost model counts."""
    world = nodes * per_node
    results = run_threads(_gathers, world, per_node, timeout_s=30)
    topology = Topology(world, per_node)
    pieces = {"cross": 0, "intra": 0}
    for dtype, numel in itertools.product((torch.float32, torch.bfloat16), SHARDS):
        size = numel * dtype.itemsize
        pieces["cross"] += (nodes - 1) * size
        pieces["intra"] += nodes * (per_node - 1) * size
        traffic = TwoLevelStepGatherCosts(topology, dtype.itemsize).traffic(world * numel, "step")
        out_of_a_node = sum(sum(one.cross) for one in traffic)  # its local ranks', summed
        assert out_of_a_node == per_node * (nodes - 1) * size
    for rank, sent in enumerate(results):
        assert sent["cross"] == pieces["cross"], rank
        assert sent["intra"] == pieces["intra"], rank
    # What leaves a node (as much as enters one): (W - D) pieces of two levels, (W - 1) of one
    # ring.
    ring = ExactAllGatherCosts(topology, 4).traffic(world * 5, "step")
    two_level = TwoLevelStepGatherCosts(topology, 4).traffic(world * 5, "step")
    assert sum(sum(one.cross) for one in ring) == (world - 1) * 5 * 4
    assert sum(sum(one.cross) for one in two_level) == (world - per_node) * 5 * 4


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_gloo_ranks_gather_the_same_bits_and_bytes() -> None:
    """The same cases on 4 gloo ranks as 2 nodes x 2 (the transport's point-to-point rings on
    windows of the chunk, where the in-process world copies tensors)."""
    results = run_ranks(_gathers, 4, 2, timeout_s=60)
    sizes = [n * dtype.itemsize for dtype in (torch.float32, torch.bfloat16) for n in SHARDS]
    for rank, sent in enumerate(results):
        assert sent == {"cross": sum(sizes), "intra": 2 * sum(sizes), "gathers": 4}, rank


def _stage_config(stage: int, two_level: bool) -> dict:
    return {"stage": stage, "step_gather_two_level": two_level}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_the_engine_trains_bit_for_bit_as_with_one_ring(stage: int) -> None:
    """Odd layout sizes on 2 nodes x 2, bf16: the same losses and states bit for bit; the
    step's all-gather sends each rank's shard across nodes once and twice inside its node
    (one ring: 3 times, across nodes from ranks 1 and 3 only)."""
    runs = {
        two_level: run_threads(
            train, 4, "odd", "bf16", _stage_config(stage, two_level), None, 1, timeout_s=30
        )
        for two_level in (True, False)
    }
    for ours, ring in zip(runs[True], runs[False], strict=True):
        assert ours["losses"] == ring["losses"]
        for name, value in ring["state"].items():
            assert torch.equal(ours["state"][name].view(torch.uint8), value.view(torch.uint8))
    itemsize = ITEMSIZE["bf16"]
    for rank, (ours, ring) in enumerate(zip(runs[True], runs[False], strict=True)):
        shards = sum(c // 4 for c in ours["capacities"]) * itemsize
        assert ours["phases"][("all_gather", "step")] == {
            "calls": 3 * len(ours["capacities"]),  # across, then one per node inside
            "intra_node_bytes": 2 * shards,
            "cross_node_bytes": shards,
        }
        crosses = rank in (1, 3)  # a ring 0 -> 1 -> 2 -> 3 -> 0 sends to rank + 1
        assert ring["phases"][("all_gather", "step")] == {
            "calls": len(ring["capacities"]),
            "intra_node_bytes": 0 if crosses else 3 * shards,
            "cross_node_bytes": 3 * shards if crosses else 0,
        }


def test_two_levels_pay_on_few_nodes_of_several_ranks() -> None:
    """They cut a node's intake by (D - 1) / (W - 1): used from 10% on."""
    assert two_levels_pay(Topology(4, 2))
    assert two_levels_pay(Topology(16, 8))
    assert two_levels_pay(Topology(64, 8))  # 8 nodes of 8: 7/63
    assert not two_levels_pay(Topology(72, 8))  # 9 nodes of 8: 7/71
    assert two_levels_pay(Topology(10, 2)) and not two_levels_pay(Topology(12, 2))
    assert not two_levels_pay(Topology(8, 8))  # one node
    assert not two_levels_pay(Topology(4, 1))  # one rank a node: nothing inside


def test_the_choice_is_the_stage_s_and_the_config_s() -> None:
    two_nodes = Topology(4, 2)
    for stage, two_level, expected in [
        (1, True, True),
        (2, True, True),
        (2, False, False),
        (3, True, False),  # stage 3 gathers for compute (qwZ has its own two levels)
    ]:
        config = Config.from_dict({"zero": _stage_config(stage, two_level)})
        assert ZeroChoice.of(config.zero).two_level_step_gather(two_nodes) is expected, stage
