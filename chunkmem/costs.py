"""What the sharding seams cost, for ``chunkmem estimate``: device bytes and wire bytes,
computed from layout sizes alone, without a world.

[Note: the seams own their costs] Every seam of :mod:`chunkmem.sharding` has a cost model:
:class:`ShardingCosts` for a :class:`~chunkmem.sharding.Sharding`, :class:`GathererCosts` for
a :class:`~chunkmem.sharding.ParamGatherer`, :class:`ReducerCosts` for a
:class:`~chunkmem.sharding.GradReducer`. The base classes here are the world of one, as the
seams' base classes are; ``zero/`` models each of its seams beside the seam itself, and
:meth:`zero.strategy.ZeroStrategy.costs` bundles the models of the seams it would build from
the same config, by the same choice. The estimator (``chunkmem.estimate``) replays a traced
cycle through whatever models it is given and never asks which stage or technique runs: a
new gatherer, reducer or compressor is estimated once its model exists, and a config no model
represents is refused where the models are chosen (``chunkmem.strategies``).

A model is stateful over one estimated run (a gathered copy, a secondary shard, a pooled
wire buffer, a reduction in flight): the estimator calls it in the order the engine would
call the seam it models, and it adds what it holds to a :class:`DeviceBytes`.

Wire bytes are per rank, as the communicator's ledger records them (``zero.comm_ledger``):
every member of a collective sends the same bytes; the part that crosses nodes depends on the
rank's place in its node, so a :class:`Traffic` carries it for each local rank (every node is
alike).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from chunkmem.chunk import ChunkLayout


@dataclass(frozen=True)
class Traffic:
    """One collective as every rank issues it: ``sent`` bytes each, of which local rank
    ``l`` of a node sends ``cross[l]`` to other nodes."""

    op: str
    phase: str
    sent: int
    cross: tuple[int, ...]


class WireTally:
    """Bytes per rank over a run of collectives, by operation, and the cross-node share of
    each local rank."""

    def __init__(self, node_size: int, nodes: int) -> None:
        self.nodes = nodes
        self.by_op: Counter[str] = Counter()
        self.cross_by_local_rank = [0] * node_size

    def add(self, traffic: list[Traffic]) -> None:
        for one in traffic:
            self.by_op[one.op] += one.sent
            for local, cross in enumerate(one.cross):
                self.cross_by_local_rank[local] += cross

    @property
    def bytes_per_rank(self) -> int:
        return sum(self.by_op.values())

    @property
    def cross_node_bytes_per_rank(self) -> int:
        """The most any rank sends to other nodes."""
        return max(self.cross_by_local_rank)

    @property
    def cross_node_bytes_all_ranks(self) -> int:
        return self.nodes * sum(self.cross_by_local_rank)


class DeviceBytes(Protocol):
    """Where a model puts the device bytes it allocates (+) and frees (-), with the moment."""

    def add(self, kind: str, nbytes: int, label: str) -> None: ...


class ShardingCosts:
    """A world of one: every layout whole on this rank; the step reduces nothing."""

    world_size = 1
    sharded = False  # gradients cross ranks (``chunkmem.sizing.separate_grads``)

    def param_elements(self, capacity: int) -> int:
        """Of a layout's parameters, the elements this rank keeps between uses."""
        return capacity

    def state_elements(self, capacity: int) -> int:
        """Of a layout, the elements whose optimizer states this rank holds."""
        return capacity

    def grad_divisor(self) -> int:
        """Ranks a gradient is split over once reduced (model-state sizing)."""
        return 1

    def step_traffic(self, votes: int) -> list[Traffic]:
        """The step's one small all-reduce: ``votes`` presence votes, each with its
        parameter's squared norm."""
        return []


class GathererCosts:
    """A world of one computes on the persistent parameter chunks: nothing is gathered."""

    gathers_for_compute = False  # a layout is gathered for each use and dropped after
    transient = False  # chunks exist only around their use (placement counts two in flight)

    def gather(self, layout: int, capacity: int, device: DeviceBytes, label: str) -> list[Traffic]:
        """Gather ``layout`` for compute (``gathers_for_compute``): its traffic; buffers it
        holds while in flight are added to ``device``."""
        raise AssertionError(f"{type(self).__name__} gathers nothing for compute")

    def arrived(self, device: DeviceBytes, label: str, keep: int = 0) -> None:
        """The gathers launched so far, but the ``keep`` launched last, have completed: their
        buffers go back."""

    def in_flight(self) -> int:
        """Gathers launched whose buffers have not gone back."""
        return 0

    def dropped(self, layout: int, capacity: int, device: DeviceBytes, label: str) -> None:
        """The gathered copy of ``layout`` is dropped (a model may keep part of it)."""

    def carry(self, layout: int, capacity: int, device: DeviceBytes, label: str) -> list[Traffic]:
        """Gather ``layout`` in the step, after its update, for the next cycle's first moment
        (``gathers_for_compute``): as :meth:`gather`, from the updated shards."""
        raise AssertionError(f"{type(self).__name__} gathers nothing for compute")

    def end_cycle(self, device: DeviceBytes, label: str) -> None:
        """The step changed the parameters: copies of the old ones go."""

    def after_update(self, capacity: int) -> list[Traffic]:
        """The traffic that makes a layout whole again after this rank updated its span."""
        return []


class ReducerCosts:
    """A world of one updates from the gradients where backward wrote them."""

    reduces = False  # gradients are reduced across ranks
    in_backward = False  # ... as each layout's gradients become final, in backward
    transient = False  # whole gradient chunks exist only until reduced
    max_in_flight = 1  # reductions running at once before the oldest is waited for

    def shard_elements(self, capacity: int) -> int:
        """Elements of this rank's reduced gradient shard of a layout (0: none)."""
        return 0

    def launch(self, layout: ChunkLayout, device: DeviceBytes, label: str) -> list[Traffic]:
        """Start reducing ``layout``'s gradient chunk: its traffic; buffers it holds while in
        flight, and state it keeps from then on, are added to ``device``."""
        raise AssertionError(f"{type(self).__name__} reduces nothing")

    def held_state(self) -> dict[str, int]:
        """State the reductions launched so far keep across iterations, by ledger kind (a
        compressor's residuals): there from the start of every later iteration."""
        return {}

    def complete(self, layout: ChunkLayout, device: DeviceBytes, label: str) -> None:
        """The reduction of ``layout`` completed: what it held goes back."""

    def presence_votes(self, num_params: int) -> int:
        """Of ``num_params`` parameters, how many presence votes ride on the step's norm."""
        return 0


@dataclass
class StrategyCosts:
    """The cost models of one strategy's three seams, for one estimated run, plus bytes the
    strategy holds across iterations outside chunks (pooled wire buffers)."""

    sharding: ShardingCosts
    gatherer: GathererCosts
    reducer: ReducerCosts

    def held_bytes(self) -> int:
        return 0

    def describe(self) -> str:
        return "one process"
