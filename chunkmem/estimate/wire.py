"""Bytes one rank sends per optimizer step, split into intra-node and cross-node.

The collectives a steady ZeRO step issues, with the volume zero/comm.py's ledger records for
each (ring algorithms: an all-gather or reduce-scatter of ``n`` elements sends
``n * (W - 1) // W`` per rank, an all-reduce twice that):

- stages 1-2: per trainable layout, a reduce-scatter of its gradient chunk and an
  all-gather of the updated parameter chunk;
- stage 3: per layout, an all-gather each time its gathered copy is filled (forward and
  backward of every micro-batch, from the memory simulation), and per trainable layout a
  reduce-scatter;
- every stage: two small all-reduces (which parameters got gradients; the squared norm).

Rings run over the world in rank order, so a rank's bytes go to the next rank; that is on
another node for the last rank of each node (the rule the communication ledger splits bytes
by, docs/comm.md). tests/test_zero.py asserts the large terms per step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from chunkmem.estimate.memory import Layouts


@dataclass(frozen=True)
class WireEstimate:
    """Bytes per optimizer step."""

    bytes_per_rank: int  # every rank sends this much
    by_op: dict[str, int]  # of it, per collective kind
    cross_node_bytes_per_rank: int  # for the last rank of a node (0 on one node)
    cross_node_bytes_all_ranks: int

    @property
    def intra_node_bytes_per_rank(self) -> int:
        """For a rank whose ring neighbour is in its node."""
        return self.bytes_per_rank if self.cross_node_bytes_per_rank == 0 else 0


def ring_elements(op: str, numel: int, world: int) -> int:
    """Elements one rank sends in a ring ``op`` of ``numel`` elements (zero/comm.py)."""
    if op == "all_reduce":
        return 2 * numel * (world - 1) // world
    return numel * (world - 1) // world


def estimate_wire(
    packed: Layouts,
    stage: int,
    itemsize: int,
    world_size: int,
    node_size: int,
    gathers: Counter[int],
    num_params: int,
) -> WireEstimate:
    """``gathers``: all-gathers per layout in a step (stage 3), from the memory simulation."""
    by_op: Counter[str] = Counter()
    if stage and world_size > 1:
        for i, layout in enumerate(packed.layouts):
            elements = ring_elements("all_gather", layout.capacity, world_size)
            if stage == 3:
                by_op["all_gather"] += gathers[i] * elements * itemsize
            elif layout.trainable:
                by_op["all_gather"] += elements * itemsize
            if layout.trainable:
                by_op["reduce_scatter"] += elements * itemsize
        by_op["all_reduce"] += ring_elements("all_reduce", num_params, world_size) * 4
        by_op["all_reduce"] += ring_elements("all_reduce", 1, world_size) * 8
    total = sum(by_op.values())
    nodes = world_size // node_size if node_size else 1
    cross = total if nodes > 1 else 0
    return WireEstimate(total, dict(by_op), cross, cross * nodes)
