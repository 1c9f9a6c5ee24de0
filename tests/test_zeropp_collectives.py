"""ZeRO++'s collectives on 4 gloo ranks as 2 nodes x 2: the all-to-all, the ledger's split into
intra-node and cross-node bytes, qwZ's quantized gather and qgZ's quantized reduce-scatter,
each against the kernels' reference pipeline bit for bit and against exact values within the
error bound of docs/zeropp.md."""

from __future__ import annotations

import itertools

import pytest
import torch

import kernels
from chunkmem.errors import ConfigError
from kernels import reference
from tests.distributed_helpers import run_ranks
from tests.kernels_helpers import U, assert_same_bits
from zero.comm import Communicator
from zero.quantized_gather import (
    FlatPieces,
    QuantizedAllGather,
    QuantizedAllGatherCosts,
    TwoLevelPieces,
)
from zero.quantized_reduce import HierarchicalQuantizedReduceScatter
from zero.topology import (
    Topology,
    build_gather_groups,
    build_node_groups,
    resolve_node_size,
)
from zero.wire import WireBuffers, packed_nbytes

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
# Shard sizes: one element, odd and not a multiple of any block size below, a whole number of
# blocks.
SHARDS = (1, 77, 256)


class _HostWorkspaces:
    """The residency the wire-buffer pool sees (its compute tier and workspaces), on the host,
    counted."""

    class _Tier:
        compute = True

    def __init__(self) -> None:
        self.compute = self._Tier()
        self.workspaces = self
        self.held = 0

    def allocate(self, numel, dtype, tier, protect, within="budget", kind=None):
        self.held += numel * dtype.itemsize
        return torch.zeros(numel, dtype=dtype)  # zeros: a residual chunk starts at zero

    def free(self, buffer, tier, kind=None):
        self.held -= buffer.numel() * buffer.element_size()


def _topology(comm: Communicator, hpz: int = 1):
    topology = Topology(comm.size, PER_NODE)
    comm.topology = topology
    return build_node_groups(comm, topology, hpz)


def _values(rank: int, numel: int, dtype: torch.dtype, outliers: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * outliers + rank)
    x = torch.randn(numel, generator=g) * (rank + 1)
    if outliers:
        x[::7] *= 40  # blocks of very different scales
    return x.to(dtype)


# ---------------------------------------------------------------- topology and the ledger
def test_node_size_comes_from_the_config_then_torchrun_then_the_world() -> None:
    assert resolve_node_size(2, 8, {"LOCAL_WORLD_SIZE": "4"}) == 2
    assert resolve_node_size(None, 8, {"LOCAL_WORLD_SIZE": "4"}) == 4
    assert resolve_node_size(None, 8, {}) == 8
    with pytest.raises(ConfigError, match="must divide the world size: 6 ranks"):
        Topology(6, 4)
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE='x'"):
        resolve_node_size(None, 8, {"LOCAL_WORLD_SIZE": "x"})


def _all_to_all_and_ledger(comm: Communicator) -> dict:
    groups = _topology(comm)
    me = comm.rank
    results = {}
    for name, group in (("world", comm.world), ("intra", groups.intra), ("inter", groups.inter)):
        n = group.size
        for async_op in (False, True):
            # Two buffers at once, blocks of 3 and 2 elements, tagged by sender and block.
            send = [torch.arange(3 * n) + 100 * me, torch.arange(2 * n) + 1000 * me]
            received = [torch.empty_like(t) for t in send]
            with comm.serving("bwd"):
                handle = comm.all_to_all(send, received, group=group, async_op=async_op)
            handle.wait()
            for i, (block, t) in enumerate(((3, received[0]), (2, received[1]))):
                for k, sender in enumerate(group.ranks):
                    expected = torch.arange(group.rank * block, (group.rank + 1) * block)
                    expected += (100 if i == 0 else 1000) * sender
                    assert torch.equal(t[k * block : (k + 1) * block], expected), (name, i, k)
    # zero.transport "builtin": gloo's own all_to_all_single, one per buffer.
    builtin = Communicator(comm.world, rings=False)
    send = [torch.arange(2 * WORLD) + 100 * me, torch.arange(WORLD) + 1000 * me]
    received = [torch.empty_like(t) for t in send]
    builtin.all_to_all(send, received, async_op=True).wait()
    for k in range(WORLD):
        assert torch.equal(
            received[0][2 * k : 2 * k + 2], torch.arange(2 * me, 2 * me + 2) + 100 * k
        )
        assert int(received[1][k]) == me + 1000 * k
    full = torch.empty(8 * WORLD)
    with comm.serving("fwd"):
        comm.all_gather(torch.full((8,), float(me)), full)
    assert torch.equal(full, torch.arange(WORLD).repeat_interleave(8).float())
    with pytest.raises(ConfigError, match="hpz_partition_size=3 must divide the node size 2"):
        build_node_groups(comm, groups.topology, 3)
    ledger = comm.ledger
    results["by_phase"] = ledger.by_phase()
    results["records"] = [(r.op, r.group, r.bytes_sent, r.cross_node_bytes) for r in ledger.records]
    return results


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_all_to_all_delivers_every_block_and_the_ledger_splits_cross_node_bytes() -> None:
    results = run_ranks(_all_to_all_and_ledger, WORLD, timeout_s=30)
    for rank, result in enumerate(results):
        node = rank // PER_NODE
        for op, group, sent, cross in result["records"]:
            if op == "all_gather":  # the world ring: rank r sends 3/4 of 32 floats to r + 1
                assert sent == 24 * 4
                assert cross == (sent if (rank + 1) % WORLD // PER_NODE != node else 0)
            elif group == "world":  # all_to_all of 5 elements per peer, 2 peers off-node
                assert (sent, cross) == (3 * 5 * 8, 2 * 5 * 8)
            elif group.startswith("node"):
                assert (sent, cross) == (5 * 8, 0)
            else:  # the other node's rank with this local index
                assert (sent, cross) == (5 * 8, 5 * 8)
        phases = result["by_phase"]
        assert phases[("all_to_all", "bwd")]["calls"] == 6
        assert phases[("all_gather", "fwd")]["calls"] == 1


# ---------------------------------------------------------------- qwZ
def _qwz_case(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """What the reference kernels make of one rank's shard: the pipeline qwZ must reproduce."""
    q = reference.quantize(x, bits=bits, group_size=block, symmetric=True)
    return reference.dequantize(q, out_dtype=x.dtype)


def qwz_bound(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """docs/zeropp.md: per element, s (1/2 + 4uQ) + 2u max(|x|, |x_hat|) in fp32, then the
    rounding of x_hat to x's dtype (unit roundoff u_c): |x_hat| <= |x| + s (1/2 + 4uQ)."""
    q_max = 2 ** (bits - 1) - 1
    x64 = x.double()
    padded = torch.nn.functional.pad(x64.abs(), (0, -x.numel() % block))
    absmax = padded.view(-1, block).amax(dim=1).float()
    s = torch.clamp(absmax / torch.tensor(float(q_max)), min=2.0**-126).double()
    s = s.repeat_interleave(block)[: x.numel()]
    rounding = s * (0.5 + 4 * U * q_max)
    magnitude = x64.abs() + rounding
    u_c = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[x.dtype]
    return rounding + 2 * U * magnitude + u_c * magnitude


def _qwz_gathers(comm: Communicator) -> list[str]:
    workspaces = _HostWorkspaces()
    wire = WireBuffers(workspaces)
    topology = Topology(comm.size, PER_NODE)
    comm.topology = topology
    inter, intra = build_gather_groups(comm, topology)
    layouts = {
        "one ring": FlatPieces(comm, comm.world),
        "two levels": TwoLevelPieces(comm, topology, inter, intra),
    }
    checked = []
    for dtype in (torch.float32, torch.bfloat16):
        for (bits, block), (how, pieces) in itertools.product(
            ((8, 16), (4, 256), (8, 100)), layouts.items()
        ):
            gather = QuantizedAllGather(comm, wire, bits, block, pieces)
            for n in SHARDS:
                shard = _values(comm.rank, n, dtype)
                full = torch.full((WORLD * n,), float("nan"), dtype=dtype)
                for async_op in (False, True):
                    handle = gather.start(shard, full, phase="fwd", async_op=async_op)
                    handle.wait()
                    what = f"{dtype} int{bits} block {block} shard {n}, {how}"
                    expected = torch.cat(
                        [_qwz_case(_values(r, n, dtype), bits, block) for r in range(WORLD)]
                    )
                    assert_same_bits(full, expected, f"{what}: native vs the reference pipeline")
                    exact = torch.cat([_values(r, n, dtype) for r in range(WORLD)])
                    error = (full.double() - exact.double()).abs()
                    bound = torch.cat(
                        [qwz_bound(_values(r, n, dtype), bits, block) for r in range(WORLD)]
                    )
                    assert bool((error <= bound).all()), f"{what}: error above the bound"
                    if n > 1:  # not vacuous: rounding uses most of the half step somewhere
                        assert float((error / bound).max()) > 0.3, what
                checked.append(what)
    assert workspaces.held == wire.held_bytes  # the pool's buffers are workspaces, all of them
    return checked


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_qwz_gather_is_the_reference_pipeline_and_within_its_bound() -> None:
    kernels.backend_for("cpu")  # build once here, not in four ranks at once
    results = run_ranks(_qwz_gathers, WORLD, timeout_s=60)
    assert len(results[0]) == 2 * 3 * 2 * len(SHARDS)


def _cross_node_pieces(comm: Communicator) -> dict[str, int]:
    """Bytes this rank sends to the other node in one int8 gather of 1,024-element shards."""
    topology = Topology(comm.size, PER_NODE)
    comm.topology = topology
    inter, intra = build_gather_groups(comm, topology)
    wire = WireBuffers(_HostWorkspaces())
    sent = {}
    for how, pieces in (
        ("one ring", FlatPieces(comm, comm.world)),
        ("two levels", TwoLevelPieces(comm, topology, inter, intra)),
    ):
        before = comm.ledger.cross_node_bytes()
        gather = QuantizedAllGather(comm, wire, 8, 256, pieces)
        full = torch.empty(WORLD * 1024)
        gather.start(_values(comm.rank, 1024, torch.float32), full, phase="fwd", async_op=False)
        sent[how] = comm.ledger.cross_node_bytes() - before
    return sent


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_qwz_two_level_gather_sends_each_piece_across_nodes_once_per_rank() -> None:
    """On 2 nodes x 2 one ring over the world carries 3 pieces across each direction of the
    node boundary; two levels carry the 2 the other node needs, as the cost model says."""
    kernels.backend_for("cpu")
    piece = packed_nbytes(1024, 8, 256)
    results = run_ranks(_cross_node_pieces, WORLD, timeout_s=30)
    assert sum(r["one ring"] for r in results) == NODES * (WORLD - 1) * piece
    assert sum(r["two levels"] for r in results) == WORLD * (NODES - 1) * piece
    for two_level in (False, True):
        costs = QuantizedAllGatherCosts(Topology(WORLD, PER_NODE), 8, 256, two_level=two_level)
        traffic = costs.traffic(WORLD * 1024, "fwd")
        modelled = NODES * sum(sum(one.cross) for one in traffic)  # per node, every node
        assert modelled == sum(r["two levels" if two_level else "one ring"] for r in results)


# ---------------------------------------------------------------- qgZ
def _qgz_reference(rank: int, inputs: list[torch.Tensor], bits: int, block: int) -> torch.Tensor:
    """Rank ``rank``'s slice by the reference kernels, step by step as in qgZ: every rank's
    slice quantized, summed per node in local-rank order and requantized, the node sums summed
    in node order in fp32 and rounded to the gradient dtype."""
    n = inputs[0].numel() // WORLD
    s = kernels.slice_numel(n, 1, block)

    def quantized(x: torch.Tensor) -> kernels.QuantizedTensor:
        padded = torch.zeros(s, dtype=x.dtype)
        padded[:n] = x[rank * n : (rank + 1) * n]
        return reference.quantize(padded, bits=bits, group_size=block, symmetric=True)

    node_sums = []
    for node in range(NODES):
        members = [quantized(inputs[node * PER_NODE + local]) for local in range(PER_NODE)]
        node_sums.append(reference.dequant_reduce_requant(members))
    total = reference.dequant_reduce(node_sums, out_dtype=torch.float32)
    return total.to(inputs[0].dtype)[:n], node_sums


def qgz_bound(rank: int, inputs: list[torch.Tensor], node_sums, bits: int, block: int):
    """docs/zeropp.md: every one of the W inputs and of the N node sums loses one quantization
    step bound s (1/2 + 4uQ) with its own block scale plus 2u|value|; the fp32 sums of D and of
    N terms add (k - 1) u sum|terms|; the result is rounded to the gradient dtype."""
    n = inputs[0].numel() // WORLD
    q_max = 2 ** (bits - 1) - 1
    per_step = 0.5 + 4 * U * q_max
    magnitude = torch.zeros(n, dtype=torch.float64)
    steps = torch.zeros(n, dtype=torch.float64)
    for x in inputs:
        mine = x[rank * n : (rank + 1) * n].double()
        magnitude += mine.abs()
        padded = torch.nn.functional.pad(mine.abs(), (0, -n % block)).view(-1, block)
        s = torch.clamp(padded.amax(dim=1).float() / torch.tensor(float(q_max)), min=2.0**-126)
        steps += s.double().repeat_interleave(block)[:n]
    for q in node_sums:
        steps += q.scales.double().repeat_interleave(block)[:n]
    quantization = steps * per_step
    magnitude += quantization
    u_c = {torch.float32: U, torch.bfloat16: 2.0**-8}[inputs[0].dtype]
    rounding = U * (2 * (WORLD + NODES) + (PER_NODE - 1) + (NODES - 1)) * magnitude
    return quantization + rounding + u_c * magnitude, magnitude


def _qgz_reductions(comm: Communicator) -> list[str]:
    groups = _topology(comm)
    wire = WireBuffers(_HostWorkspaces())
    checked = []
    for dtype in (torch.float32, torch.bfloat16):
        for bits, block in ((4, 32), (8, 64), (4, 100)):
            reduction = HierarchicalQuantizedReduceScatter(comm, groups, wire, bits, block, "bwd")
            for n in SHARDS:
                inputs = [_values(r, WORLD * n, dtype, outliers=False) for r in range(WORLD)]
                full = inputs[comm.rank].clone()
                shard = torch.full((n,), float("nan"), dtype=dtype)
                work = reduction.launch(None, full, shard)
                # Never blocks: gloo's point-to-point works complete only in wait.
                work.is_completed()
                work.wait()
                what = f"{dtype} int{bits} block {block} shard {n}"
                expected, node_sums = _qgz_reference(comm.rank, inputs, bits, block)
                assert_same_bits(shard, expected, f"{what}: native vs the reference pipeline")
                assert torch.equal(full, inputs[comm.rank]), f"{what}: the input was written"
                exact = sum(x[comm.rank * n : (comm.rank + 1) * n].double() for x in inputs)
                bound, magnitude = qgz_bound(comm.rank, inputs, node_sums, bits, block)
                error = (shard.double() - exact).abs()
                assert bool((error <= bound).all()), f"{what}: error above the bound"
                if n > 1:  # not vacuous: below the size of the values it bounds
                    assert float(bound.sum()) < float(magnitude.sum()), what
                checked.append(what)
    cross = comm.ledger.cross_node_bytes(op="all_to_all")
    intra = comm.ledger.intra_node_bytes(op="all_to_all")
    return [checked, cross, intra]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_qgz_reduce_scatter_is_the_reference_pipeline_and_within_its_bound() -> None:
    kernels.backend_for("cpu")
    results = run_ranks(_qgz_reductions, WORLD, timeout_s=30)
    checked, cross, intra = results[0]
    assert len(checked) == 2 * 3 * len(SHARDS)
    assert cross > 0 and intra > 0
