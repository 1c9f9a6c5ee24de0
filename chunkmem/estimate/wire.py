"""Bytes one rank sends per optimizer step, split into intra-node and cross-node.

The memory simulation (:mod:`.memory`) plays a steady step through the cost models of the
strategy's seams (``chunkmem.costs``), and each model says what its collectives send, as the
communicator's ledger records them (``zero.comm_ledger``): the stage-3 gathers of every
micro-batch (exact or quantized, from the world or from hpZ's secondaries), the gradient
reductions (a reduce-scatter, or qgZ's two all-to-alls), the gathers after the update
(stages 1-2) and the step's small all-reduces. tests/test_estimate.py compares each term with
a run's ledger.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkmem.costs import WireTally


@dataclass(frozen=True)
class WireEstimate:
    """Bytes per optimizer step."""

    bytes_per_rank: int  # every rank sends this much
    by_op: dict[str, int]  # of it, per collective kind
    cross_node_bytes_per_rank: int  # the most any rank sends to other nodes (0 on one node)
    cross_node_bytes_all_ranks: int

    @property
    def intra_node_bytes_per_rank(self) -> int:
        """For the rank that sends the most to other nodes."""
        return self.bytes_per_rank - self.cross_node_bytes_per_rank

    @classmethod
    def of(cls, tally: WireTally) -> WireEstimate:
        return cls(
            tally.bytes_per_rank,
            dict(tally.by_op),
            tally.cross_node_bytes_per_rank,
            tally.cross_node_bytes_all_ranks,
        )
