"""Which ranks share a node, and the subgroups ZeRO++ talks in.

Consecutive global ranks share a node, as torchrun numbers them: node ``r // node_size``,
local rank ``r % node_size``. The node size is ``zero.node_size`` when set, else torchrun's
``LOCAL_WORLD_SIZE``, else the whole world is one node. Setting it lets ranks on one machine
act as several nodes (4 ranks as 2 nodes x 2), which is how the tests and the benchmark run
ZeRO++ without a cluster.

The communicator reads the topology to split every collective's bytes into intra-node and
cross-node (``zero.comm``); ZeRO++ builds its subgroups here, once, at initialize.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkmem.errors import ConfigError

if TYPE_CHECKING:
    from zero.comm import Communicator
    from zero.process_group import Group

LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"  # exported by torchrun to every rank


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks on ``world_size // node_size`` nodes of ``node_size`` ranks each.
    ``host_all_reduces``: collectives run on gloo over host memory, where a small all-reduce
    is one direct exchange (``zero.ring.host_all_reduce_path``); cost models count it so."""

    world_size: int
    node_size: int
    host_all_reduces: bool = False

    def __post_init__(self) -> None:
        if self.node_size < 1 or self.world_size % self.node_size:
            raise ConfigError(
                f"the node size must divide the world size: {self.world_size} ranks cannot form "
                f"nodes of {self.node_size}; set zero.node_size to a divisor of "
                f"{self.world_size} (or fix LOCAL_WORLD_SIZE)"
            )

    @property
    def nodes(self) -> int:
        return self.world_size // self.node_size

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def local_rank(self, rank: int) -> int:
        return rank % self.node_size

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    # The groups ZeRO++ talks in, as the global ranks of the one holding ``rank``.
    def world(self, rank: int) -> range:
        return range(self.world_size)

    def node(self, rank: int) -> range:
        """Every rank of ``rank``'s node."""
        first = self.node_of(rank) * self.node_size
        return range(first, first + self.node_size)

    def cross(self, rank: int) -> range:
        """The ranks with ``rank``'s local rank, one per node."""
        return range(self.local_rank(rank), self.world_size, self.node_size)

    def hpz(self, rank: int, partition_size: int) -> range:
        """``rank``'s hpZ group: ``partition_size`` consecutive ranks inside its node."""
        first = rank // partition_size * partition_size
        return range(first, first + partition_size)


def resolve_node_size(
    configured: int | None, world_size: int, env: Mapping[str, str] = os.environ
) -> int:
    """``zero.node_size`` if set, else ``LOCAL_WORLD_SIZE`` (torchrun), else ``world_size``."""
    if configured is not None:
        return configured
    value = env.get(LOCAL_WORLD_SIZE)
    if value is None:
        return world_size
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"{LOCAL_WORLD_SIZE}={value!r} is not a number of ranks; unset it or set zero.node_size"
        ) from None


@dataclass(frozen=True)
class NodeGroups:
    """This rank's subgroups: its node (``intra``), the ranks with its local rank on every
    node (``inter``), and the hpZ group it keeps secondary shards in (``hpz``, consecutive
    ranks inside its node; the node group itself when hpZ spans the node)."""

    topology: Topology
    intra: Group
    inter: Group
    hpz: Group | None


def check_hpz_partition_size(topology: Topology, hpz_partition_size: int) -> None:
    if hpz_partition_size > 1 and topology.node_size % hpz_partition_size:
        raise ConfigError(
            f"zero.hpz_partition_size={hpz_partition_size} must divide the node size "
            f"{topology.node_size}: an hpZ group that spans two nodes would send the backward "
            f"gather across nodes, which is what hpZ avoids"
        )


def build_node_groups(
    comm: Communicator, topology: Topology, hpz_partition_size: int
) -> NodeGroups:
    """Create every node, cross-node and hpZ group (every rank creates all of them, in one
    order, as torch requires) and return this rank's."""
    check_hpz_partition_size(topology, hpz_partition_size)
    size, rank = topology.node_size, comm.rank
    intra = [comm.new_group(f"node{n}", topology.node(n * size)) for n in range(topology.nodes)]
    inter = [comm.new_group(f"cross{local}", topology.cross(local)) for local in range(size)]
    hpz = None
    if hpz_partition_size == size:
        hpz = intra[topology.node_of(rank)]
    elif hpz_partition_size > 1:
        h = hpz_partition_size
        groups = [
            comm.new_group(f"hpz{i}", topology.hpz(i * h, h))
            for i in range(topology.world_size // h)
        ]
        hpz = groups[rank // h]
    return NodeGroups(
        topology, intra[topology.node_of(rank)], inter[topology.local_rank(rank)], hpz
    )


def build_gather_groups(comm: Communicator, topology: Topology) -> tuple[Group, Group]:
    """The groups of a parameter gather in two levels (qwZ's at stage 3,
    zero.quantized_gather; the step's at stages 1-2, zero.two_level_gather), apart from every
    other group so that no other collective's order interleaves with theirs: this rank's class
    across nodes and its node (every rank creates all of them, in one order)."""
    size, rank = topology.node_size, comm.rank
    inter = [comm.new_group(f"gather_cross{local}", topology.cross(local)) for local in range(size)]
    intra = [
        comm.new_group(f"gather_node{n}", topology.node(n * size)) for n in range(topology.nodes)
    ]
    return inter[topology.local_rank(rank)], intra[topology.node_of(rank)]
