"""ZeRO stages 1-3 and ZeRO++ as a :class:`chunkmem.sharding.Strategy`: spans, gatherer, reducer.

The stage number is read here and nowhere else: it picks which span of each layout a rank
keeps and which gatherer and reducer the core is given.

- Stage 1: optimizer states (and fp32 masters) sharded; gradients reduce-scattered before the
  step; updated shards all-gathered into whole parameter chunks.
- Stage 2: as stage 1, with reduce-scatters launched in backward as layouts become final.
- Stage 3: parameters sharded too, gathered for each use.

ZeRO++ (docs/zeropp.md), each switched on by itself: qwZ swaps the stage-3 gather's transport
for a quantized one, hpZ the gatherer for one that keeps node-local secondaries, qgZ the
gradient reduction for the hierarchical quantized all-to-all.

Collectives run on the compute device (NCCL needs GPU tensors); the small reductions the
engine does on CPU tensors are moved there and back.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

import kernels
from chunkmem.chunk import ChunkLayout
from chunkmem.config import CompressionConfig, ZeroConfig
from chunkmem.costs import GathererCosts, ReducerCosts, ShardingCosts, StrategyCosts, Traffic
from chunkmem.errors import ConfigError
from chunkmem.params import ParamStore
from chunkmem.residency import Residency
from chunkmem.sharding import GradReducer, ParamGatherer, Sharding, Span, Strategy, Waitable
from chunkmem.tracer import Phase
from zero.comm import Communicator
from zero.comm_ledger import collective_traffic
from zero.compression import build_compressed_reduction, compressed_reduction_costs
from zero.cycle_clock import CycleClock
from zero.gather import (
    AllGather,
    ExactAllGather,
    ExactAllGatherCosts,
    GatherForCompute,
    GatherForComputeCosts,
    GatherUpdatedShards,
    GatherUpdatedShardsCosts,
    WeightGather,
    WeightGatherCosts,
)
from zero.hierarchical_gather import HierarchicalGather, HierarchicalGatherCosts
from zero.quantized_gather import (
    PieceGather,
    QuantizedAllGather,
    QuantizedAllGatherCosts,
    TwoLevelPieces,
)
from zero.quantized_reduce import (
    HierarchicalQuantizedReduceScatter,
    HierarchicalQuantizedReduceScatterCosts,
)
from zero.reduce import (
    ExactReduceScatter,
    ExactReduceScatterCosts,
    GradientReduction,
    GradientReductionCosts,
    ReduceScatterGrads,
    ReduceScatterGradsCosts,
)
from zero.topology import (
    NodeGroups,
    Topology,
    build_gather_groups,
    build_node_groups,
    check_hpz_partition_size,
    resolve_node_size,
)
from zero.two_level_gather import TwoLevelStepGather, TwoLevelStepGatherCosts, two_levels_pay
from zero.wire import BytesPool, WireBuffers

_WEIGHT_BITS = {True: 8, "int8": 8, "int4": 4}
_GRADIENT_BITS = {True: 4, "int4": 4, "int8": 8}


class ZeroSharding(Sharding):
    """Rank ``r`` of ``n`` owns elements ``[r*c/n, (r+1)*c/n)`` of every layout of capacity c."""

    def __init__(self, stage: int, comm: Communicator, device: torch.device) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        self.stage = stage
        self.comm = comm
        self.device = device
        self.world_size = comm.size
        self.rank = comm.rank
        self.cycle_clock = CycleClock()

    def about(self, layout: int) -> contextlib.AbstractContextManager[None]:
        return self.comm.about(layout)

    def param_span(self, layout: ChunkLayout) -> Span | None:
        return self.shard(layout) if self.stage >= 3 else None

    def state_span(self, layout: ChunkLayout) -> Span | None:
        return self.shard(layout)

    def all_gather(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        self.comm.all_gather(shard, full)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """The step's small reductions (the norm with the presence votes)."""
        with self.comm.serving("step"):
            if tensor.device == self.device:
                self.comm.all_reduce(tensor, op="sum")
                return
            staged = tensor.to(self.device)
            self.comm.all_reduce(staged, op="sum")
            tensor.copy_(staged)

    def set_tag(self, iteration: int) -> None:
        self.comm.tag = iteration
        self.cycle_clock.ended()  # the engine sets the next step's tag as a step ends

    def begin_cycle(self, cycle: int) -> None:
        self.comm.cycle = cycle
        self.cycle_clock.began()

    def gather_objects(self, obj: object) -> list[object]:
        return self.comm.all_gather_object(obj)

    def checkpoint_group(self) -> object | None:
        return self.comm.transport.checkpoint_group()


class ZeroShardingCosts(ShardingCosts):
    """:class:`ZeroSharding`'s costs: a rank keeps ``1/n`` of every layout's optimizer states,
    of its gradients from stage 2 and of its parameters at stage 3; the step all-reduces the
    reducer's presence votes with each parameter's squared gradient norm (fp64) in one
    collective."""

    sharded = True

    def __init__(self, stage: int, topology: Topology) -> None:
        self.stage = stage
        self.topology = topology
        self.world_size = topology.world_size

    def param_elements(self, capacity: int) -> int:
        return capacity // self.world_size if self.stage >= 3 else capacity

    def state_elements(self, capacity: int) -> int:
        return capacity // self.world_size

    def grad_divisor(self) -> int:
        return self.world_size if self.stage >= 2 else 1

    def step_traffic(self, votes: int) -> list[Traffic]:
        if not votes:  # gradients stay on their rank: the norm is local
            return []
        topology = self.topology
        numel = 2 * votes  # the votes and a squared norm per parameter
        return [
            collective_traffic("all_reduce", numel, 8, topology, topology.world, Phase.STEP.value)
        ]


@dataclass(frozen=True)
class ZeroChoice:
    """What a ZeRO config switches on, read once: the seams and their cost models are built
    from it alike."""

    stage: int
    weight_bits: int | None
    weight_block: int
    gradient_bits: int | None
    gradient_block: int
    hpz_partition_size: int
    weights_two_level: bool
    step_gather_two_level: bool
    overlap_step_gather: bool

    @classmethod
    def of(cls, config: ZeroConfig) -> ZeroChoice:
        return cls(
            config.stage,
            _WEIGHT_BITS.get(config.quantized_weights),
            config.quantized_weights_block_size,
            _GRADIENT_BITS.get(config.quantized_gradients),
            config.quantized_gradients_block_size,
            config.hpz_partition_size,
            config.quantized_weights_two_level,
            config.step_gather_two_level,
            config.overlap_step_gather,
        )

    def two_level_weights(self, topology: Topology) -> bool:
        """qwZ gathers in two levels: asked for, and the world spans several nodes of
        several ranks (with one of either, a level has nothing to do)."""
        return bool(
            self.weight_bits
            and self.weights_two_level
            and topology.nodes > 1
            and topology.node_size > 1
        )

    def two_level_step_gather(self, topology: Topology) -> bool:
        """Stages 1-2 gather the updated shards in two levels: asked for, and they pay on this
        topology (``zero.two_level_gather``)."""
        return (
            not self.gathers_for_compute and self.step_gather_two_level and two_levels_pay(topology)
        )

    @property
    def gathers_for_compute(self) -> bool:
        return self.stage >= 3

    @property
    def overlap(self) -> bool:
        """Gradients are reduce-scattered in backward (stages 2-3), not before the step."""
        return self.stage >= 2

    @property
    def reduce_phase(self) -> str:
        return (Phase.BACKWARD if self.overlap else Phase.STEP).value

    @property
    def hpz(self) -> bool:
        return self.hpz_partition_size > 1

    @property
    def node_groups(self) -> bool:
        return bool(self.weight_bits or self.gradient_bits or self.hpz)


@dataclass
class ZeroStrategyCosts(StrategyCosts):
    """The cost models of a :class:`ZeroStrategy`, and the wire-buffer pool its gatherer and
    reducer share."""

    pool: BytesPool

    choice: ZeroChoice

    two_level_step_gather: bool  # on this topology (ZeroChoice.two_level_step_gather)

    def held_bytes(self) -> int:
        return self.pool.held_bytes

    def describe(self) -> str:
        choice = self.choice
        parts = [f"ZeRO-{choice.stage}"]
        if choice.weight_bits:
            parts.append(f"qwZ int{choice.weight_bits} (blocks of {choice.weight_block})")
        if choice.hpz:
            parts.append(f"hpZ over {choice.hpz_partition_size} ranks")
        if choice.gradient_bits:
            parts.append(f"qgZ int{choice.gradient_bits} (blocks of {choice.gradient_block})")
        if self.two_level_step_gather:
            parts.append("the step's gather in two levels")
        return ", ".join(parts)


class ZeroStrategy(Strategy):
    """The seams of ZeRO stage 1, 2 or 3, with the ZeRO++ techniques ``config`` switches on,
    over one communicator. Sets the communicator's topology and builds the node groups ZeRO++
    needs, once, here."""

    sharding: ZeroSharding

    def __init__(
        self,
        config: ZeroConfig,
        comm: Communicator,
        device: torch.device,
        compression: CompressionConfig | None = None,
        gradient_clipping: float = 0.0,
    ) -> None:
        super().__init__(ZeroSharding(config.stage, comm, device))
        self.config = config
        self.compression = compression or CompressionConfig()
        self.gradient_clipping = gradient_clipping  # DGC clips locally
        self.comm = comm
        # Whether small all-reduces of this device's tensors travel as gloo's direct exchange:
        # the cost models (compression's judge) then count them as the ledger does.
        probe = torch.empty(1, device=device)
        host_all_reduces = comm.transport.all_reduce_path(probe, "sum", comm.world) == "direct"
        self.topology = Topology(
            comm.size, resolve_node_size(config.node_size, comm.size), host_all_reduces
        )
        comm.topology = self.topology
        self.choice = ZeroChoice.of(config)
        self.groups: NodeGroups | None = None
        if self.choice.node_groups:
            self.groups = build_node_groups(comm, self.topology, config.hpz_partition_size)
        self._weight_pieces: PieceGather | None = None
        self._step_gather: AllGather = self._step_all_gather
        if self.choice.two_level_weights(self.topology):
            inter, intra = build_gather_groups(comm, self.topology)
            self._weight_pieces = TwoLevelPieces(comm, self.topology, inter, intra)
        elif self.choice.two_level_step_gather(self.topology):
            inter, intra = build_gather_groups(comm, self.topology)
            self._step_gather = TwoLevelStepGather(
                comm, self.topology, inter, intra, Phase.STEP.value
            )
        if self.choice.weight_bits or self.choice.gradient_bits or self.compression.type != "none":
            _check_native_kernels(device)
        self._wire: WireBuffers | None = None

    def _wire_buffers(self, residency: Residency) -> WireBuffers:
        """One pool for the gatherer and the reducer (they run in turn, not at once)."""
        if self._wire is None:
            self._wire = WireBuffers(residency)
        return self._wire

    def _step_all_gather(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool) -> Waitable:
        with self.comm.serving("step"):
            return self.comm.all_gather(shard, full, async_op=async_op)

    def gatherer(self, residency: Residency) -> ParamGatherer:
        choice = self.choice
        if not choice.gathers_for_compute:
            return GatherUpdatedShards(
                residency, self.sharding, self._step_gather, choice.overlap_step_gather
            )
        weights: WeightGather = ExactAllGather(self.comm)
        if choice.weight_bits:
            weights = QuantizedAllGather(
                self.comm,
                self._wire_buffers(residency),
                choice.weight_bits,
                choice.weight_block,
                self._weight_pieces,
            )
        if choice.hpz:
            assert self.groups is not None and self.groups.hpz is not None
            return HierarchicalGather(
                residency, weights, ExactAllGather(self.comm, self.groups.hpz), self.comm.about
            )
        return GatherForCompute(residency, weights, self.comm.about)

    def reducer(self, params: ParamStore, residency: Residency) -> GradReducer:
        choice = self.choice
        reduction: GradientReduction = ExactReduceScatter(self.comm, choice.reduce_phase)
        if choice.gradient_bits:
            assert self.groups is not None
            reduction = HierarchicalQuantizedReduceScatter(
                self.comm,
                self.groups,
                self._wire_buffers(residency),
                choice.gradient_bits,
                choice.gradient_block,
                choice.reduce_phase,
            )
        state = variance = clipping = None
        if self.compression.type != "none":
            reduction, state, variance, clipping = build_compressed_reduction(
                self.compression,
                self.comm,
                self._wire_buffers(residency),
                params,
                choice.reduce_phase,
                exact=reduction,
                gradient_clipping=self.gradient_clipping,
                clock=self.sharding.cycle_clock,
            )
        return ReduceScatterGrads(
            params,
            residency,
            self.sharding,
            reduction,
            overlap=choice.overlap,
            state=state,
            variance=variance,
            clipping=clipping,
        )

    @staticmethod
    def costs(
        config: ZeroConfig,
        world_size: int,
        node_size: int,
        itemsize: int,
        compression: CompressionConfig | None = None,
        host_tensors: bool = False,
    ) -> ZeroStrategyCosts:
        """The cost models of the seams :meth:`gatherer` and :meth:`reducer` build for
        ``config`` on ``world_size`` ranks of ``node_size`` per node (``chunkmem.costs``);
        ``host_tensors``: the device is simulated in host memory, so gloo's host paths run
        (unless the config asks for NCCL or gloo's builtin collectives)."""
        choice = ZeroChoice.of(config)
        host_all_reduces = host_tensors and config.backend != "nccl" and config.transport == "ring"
        topology = Topology(world_size, node_size, host_all_reduces)
        if choice.hpz:
            check_hpz_partition_size(topology, choice.hpz_partition_size)
        pool = BytesPool()
        exact = ExactAllGatherCosts(topology, itemsize)
        gatherer: GathererCosts = GatherUpdatedShardsCosts(
            TwoLevelStepGatherCosts(topology, itemsize)
            if choice.two_level_step_gather(topology)
            else exact
        )
        if choice.gathers_for_compute:
            weights: WeightGatherCosts = exact
            if choice.weight_bits:
                weights = QuantizedAllGatherCosts(
                    topology,
                    choice.weight_bits,
                    choice.weight_block,
                    two_level=choice.two_level_weights(topology),
                )
            gatherer = GatherForComputeCosts(weights, pool, itemsize)
            if choice.hpz:
                size = choice.hpz_partition_size
                secondary = ExactAllGatherCosts(topology, itemsize, lambda r: topology.hpz(r, size))
                gatherer = HierarchicalGatherCosts(weights, secondary, size, pool, itemsize)
        reduction: GradientReductionCosts = ExactReduceScatterCosts(
            topology, itemsize, choice.reduce_phase
        )
        if choice.gradient_bits:
            reduction = HierarchicalQuantizedReduceScatterCosts(
                topology, choice.gradient_bits, choice.gradient_block, itemsize, choice.reduce_phase
            )
        if compression is not None and compression.type != "none":
            reduction = compressed_reduction_costs(
                compression, topology, choice.reduce_phase, exact=reduction, itemsize=itemsize
            )
        reducer: ReducerCosts = ReduceScatterGradsCosts(topology, reduction, pool, choice.overlap)
        sharding = ZeroShardingCosts(choice.stage, topology)
        return ZeroStrategyCosts(
            sharding, gatherer, reducer, pool, choice, choice.two_level_step_gather(topology)
        )


def _check_native_kernels(device: torch.device) -> None:
    """qwZ and qgZ quantize on every gather and reduction: never with the Python reference,
    unless the user asked for it by name."""
    choice = kernels.backend_for(device)
    if choice.name == "reference" and os.environ.get(kernels.BACKEND_ENV) != "reference":
        raise ConfigError(
            f"zero.quantized_weights, zero.quantized_gradients and compression need the native "
            f"quantization kernels for {device.type} tensors, but {choice.reason}. Fix that (docs/kernels.md, "
            f"'Backends, build and cache'), or set {kernels.BACKEND_ENV}=reference to run the "
            f"slow torch reference knowingly."
        )
