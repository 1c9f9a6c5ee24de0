"""Stages 1-2: the all-gather of each layout's updated shards in two levels, across nodes and
then inside them, in place in the parameter chunk.

[Note: the two-level step gather] One all-gather over the world is a ring, and a ring carries
``W - 1`` of the ``W`` pieces into every node (the link from the node before it carries them
all). A node needs only the ``W - D`` pieces of the other nodes (``D`` ranks a node, ``N``
nodes): 2 of 3 on 2 nodes x 2, 8 of 15 on 2 x 8. Two levels carry exactly those: first an
all-gather among the ranks of one local rank ``l``, one per node (each takes the ``N - 1``
pieces of its class across the boundary), then inside every node. The same bytes arrive, so
the parameters are bit for bit those of one ring.

Nothing is copied out of the chunk and no buffer is taken. Before the gather every slot of the
chunk but this rank's own is free, so:

1. the cross-node all-gather runs in place on a window of ``N`` consecutive pieces placed so
   that this rank's piece is the window's slot ``n`` (its node), the slot an all-gather puts
   it in: the window starts at piece ``n (D - 1) + l``;
2. the ``N - 1`` pieces that arrived in the window move to their ranks' slots ``j D + l``:
   those right of this rank's node outward from the right end, those left of it from the left
   end, so that no move overwrites a piece still to move (each moves by ``|j - n| (D - 1)``
   whole pieces, never onto another);
3. each node's segment of the chunk (``D`` consecutive pieces, of which this rank now holds the
   one of its local rank) is all-gathered in place inside the node: ``N`` all-gathers.

The inside all-gathers of a layout are issued when the next layout's gather starts
(:class:`zero.gather.GatherUpdatedShards` advances the last one) or when the layout is waited
for, whichever comes first: points every rank reaches in one order, so the node groups see
their collectives in one order. The groups carry nothing else.

The cost is ``N + 1`` collectives a layout where one ring is one, and ``N - 1`` piece copies.
As ``N`` grows the saving ``(D - 1) / (W - 1)`` of the intake shrinks while the count of
collectives grows, so the engine uses two levels only where they cut a node's intake by
``MIN_INTAKE_CUT`` or more: up to 8 nodes of 8 ranks, 7 of 4, 5 of 2.
"""

from __future__ import annotations

import torch

from chunkmem.costs import Traffic
from chunkmem.sharding import Waitable
from zero.comm import Communicator, Group
from zero.comm_ledger import collective_traffic
from zero.in_flight import AllOf, Chained
from zero.topology import Topology

MIN_INTAKE_CUT = 0.1  # of the pieces one ring carries into a node


def intake_cut(topology: Topology) -> float:
    """The share of one ring's pieces into a node that two levels do not carry."""
    world, per_node = topology.world_size, topology.node_size
    return (per_node - 1) / (world - 1) if world > 1 else 0.0


def two_levels_pay(topology: Topology) -> bool:
    """Several nodes of several ranks, and two levels cut the intake by ``MIN_INTAKE_CUT``."""
    return topology.nodes > 1 and topology.node_size > 1 and intake_cut(topology) >= MIN_INTAKE_CUT


class TwoLevelStepGather:
    """The :data:`zero.gather.AllGather` of :class:`zero.gather.GatherUpdatedShards` in two
    levels (see the note). ``inter`` holds the world ranks of this rank's local rank, one per
    node, in node order; ``intra`` this rank's node, in local-rank order. Collectives are
    recorded under ``phase``."""

    def __init__(
        self, comm: Communicator, topology: Topology, inter: Group, intra: Group, phase: str
    ) -> None:
        self.comm = comm
        self.topology = topology
        self.inter = inter
        self.intra = intra
        self.phase = phase

    def __call__(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool) -> Waitable:
        """Gather every rank's ``shard`` (already in its slot of ``full``) into ``full``; the
        inside level is issued when the returned gather is advanced or waited for."""
        piece, nodes = shard.numel(), self.topology.nodes
        node, local = self.inter.rank, self.intra.rank
        first = node * (self.topology.node_size - 1) + local  # the window's first piece
        window = full[first * piece : (first + nodes) * piece]
        mine = window[node * piece : (node + 1) * piece]
        if mine.data_ptr() != shard.data_ptr() or mine.numel() != piece:
            raise ValueError(
                f"two-level gather: the shard must be this rank's slot of full (rank "
                f"{self.comm.rank}, {piece} elements at element {self.comm.rank * piece})"
            )
        with self.comm.serving(self.phase):
            across = self.comm.all_gather(mine, window, group=self.inter, async_op=True)
        # The second level names the first's layout wherever it is issued (see Chained).
        layout = self.comm.subject
        arrival = Chained(across, lambda: self._inside(full, first, piece, layout))
        if not async_op:
            arrival.wait()
        return arrival

    def _inside(self, full: torch.Tensor, window_start: int, piece: int, layout: int) -> Waitable:
        """Move the pieces that crossed to their ranks' slots, then gather every node's
        segment inside this node."""
        nodes, per_node = self.topology.nodes, self.topology.node_size
        node, local = self.inter.rank, self.intra.rank
        order = [*range(nodes - 1, node, -1), *range(node)]  # outward from the ends
        for j in order:
            source, target = window_start + j, j * per_node + local
            full[target * piece : (target + 1) * piece].copy_(
                full[source * piece : (source + 1) * piece]
            )
        handles: list[Waitable] = []
        with self.comm.serving(self.phase), self.comm.about(layout):
            for j in range(nodes):
                segment = full[j * per_node * piece : (j + 1) * per_node * piece]
                handles.append(
                    self.comm.all_gather(
                        segment[local * piece : (local + 1) * piece],
                        segment,
                        group=self.intra,
                        async_op=True,
                    )
                )
        return AllOf(handles)


class TwoLevelStepGatherCosts:
    """:class:`TwoLevelStepGather`'s costs (a :class:`zero.gather.WeightGatherCosts`): one
    all-gather of ``N`` pieces across nodes, then ``N`` of ``D`` pieces inside the node."""

    def __init__(self, topology: Topology, itemsize: int) -> None:
        self.topology = topology
        self.itemsize = itemsize

    def traffic(self, capacity: int, phase: str) -> list[Traffic]:
        topology = self.topology
        piece = capacity // topology.world_size
        across = collective_traffic(
            "all_gather", topology.nodes * piece, self.itemsize, topology, topology.cross, phase
        )
        inside = collective_traffic(
            "all_gather", topology.node_size * piece, self.itemsize, topology, topology.node,
            phase,
        )  # fmt: skip
        return [across, *[inside] * topology.nodes]

    def buffer_bytes(self, capacity: int) -> int:
        return 0
