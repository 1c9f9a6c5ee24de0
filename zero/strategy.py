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

import os

import torch

import kernels
from chunkmem.chunk import ChunkLayout
from chunkmem.config import ZeroConfig
from chunkmem.errors import ConfigError
from chunkmem.params import ParamStore
from chunkmem.residency import Residency
from chunkmem.sharding import GradReducer, ParamGatherer, Sharding, Span, Strategy, Waitable
from zero.comm import Communicator
from zero.gather import ExactAllGather, GatherForCompute, GatherUpdatedShards, WeightGather
from zero.hierarchical_gather import HierarchicalGather
from zero.quantized_gather import QuantizedAllGather
from zero.quantized_reduce import HierarchicalQuantizedReduceScatter
from zero.reduce import ExactReduceScatter, GradientReduction, ReduceScatterGrads
from zero.topology import NodeGroups, Topology, build_node_groups, resolve_node_size
from zero.wire import WireBuffers

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

    def param_span(self, layout: ChunkLayout) -> Span | None:
        return self.shard(layout) if self.stage >= 3 else None

    def state_span(self, layout: ChunkLayout) -> Span | None:
        return self.shard(layout)

    def all_gather(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        self.comm.all_gather(shard, full)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """The step's small reductions (which parameters have gradients, the norm)."""
        with self.comm.serving("step"):
            if tensor.device == self.device:
                self.comm.all_reduce(tensor, op="sum")
                return
            staged = tensor.to(self.device)
            self.comm.all_reduce(staged, op="sum")
            tensor.copy_(staged)

    def set_tag(self, iteration: int) -> None:
        self.comm.tag = iteration

    def begin_cycle(self, cycle: int) -> None:
        self.comm.cycle = cycle

    def gather_objects(self, obj: object) -> list[object]:
        return self.comm.all_gather_object(obj)

    def checkpoint_group(self) -> object | None:
        return self.comm.transport.checkpoint_group()


class ZeroStrategy(Strategy):
    """The seams of ZeRO stage 1, 2 or 3, with the ZeRO++ techniques ``config`` switches on,
    over one communicator. Sets the communicator's topology and builds the node groups ZeRO++
    needs, once, here."""

    sharding: ZeroSharding

    def __init__(self, config: ZeroConfig, comm: Communicator, device: torch.device) -> None:
        super().__init__(ZeroSharding(config.stage, comm, device))
        self.config = config
        self.comm = comm
        self.topology = Topology(comm.size, resolve_node_size(config.node_size, comm.size))
        comm.topology = self.topology
        self.weight_bits = _WEIGHT_BITS.get(config.quantized_weights)
        self.gradient_bits = _GRADIENT_BITS.get(config.quantized_gradients)
        self.hpz = config.hpz_partition_size > 1
        self.groups: NodeGroups | None = None
        if self.weight_bits or self.gradient_bits or self.hpz:
            self.groups = build_node_groups(comm, self.topology, config.hpz_partition_size)
        if self.weight_bits or self.gradient_bits:
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
        if self.sharding.stage < 3:
            return GatherUpdatedShards(residency, self.sharding, self._step_all_gather)
        weights: WeightGather = ExactAllGather(self.comm)
        if self.weight_bits:
            weights = QuantizedAllGather(
                self.comm,
                self._wire_buffers(residency),
                self.weight_bits,
                self.config.quantized_weights_block_size,
            )
        if self.hpz:
            assert self.groups is not None and self.groups.hpz is not None
            return HierarchicalGather(
                residency, weights, ExactAllGather(self.comm, self.groups.hpz)
            )
        return GatherForCompute(residency, weights)

    def reducer(self, params: ParamStore, residency: Residency) -> GradReducer:
        overlap = self.sharding.stage >= 2
        phase = "bwd" if overlap else "step"
        reduction: GradientReduction = ExactReduceScatter(self.comm, phase)
        if self.gradient_bits:
            assert self.groups is not None
            reduction = HierarchicalQuantizedReduceScatter(
                self.comm,
                self.groups,
                self._wire_buffers(residency),
                self.gradient_bits,
                self.config.quantized_gradients_block_size,
                phase,
            )
        return ReduceScatterGrads(params, residency, self.sharding, reduction, overlap=overlap)


def _check_native_kernels(device: torch.device) -> None:
    """qwZ and qgZ quantize on every gather and reduction: never with the Python reference,
    unless the user asked for it by name."""
    choice = kernels.backend_for(device)
    if choice.name == "reference" and os.environ.get(kernels.BACKEND_ENV) != "reference":
        raise ConfigError(
            f"zero.quantized_weights / zero.quantized_gradients need the native quantization "
            f"kernels for {device.type} tensors, but {choice.reason}. Fix that (docs/kernels.md, "
            f"'Backends, build and cache'), or set {kernels.BACKEND_ENV}=reference to run the "
            f"slow torch reference knowingly."
        )
