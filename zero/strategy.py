"""ZeRO stages 1-3 as a :class:`chunkmem.sharding.Strategy`: spans, gatherer and reducer.

The stage number is read here and nowhere else: it picks which span of each layout a rank
keeps and which gatherer and reducer the core is given.

- Stage 1: optimizer states (and fp32 masters) sharded; gradients reduce-scattered before the
  step; updated shards all-gathered into whole parameter chunks.
- Stage 2: as stage 1, with reduce-scatters launched in backward as layouts become final.
- Stage 3: parameters sharded too, gathered for each use.

Collectives run on the compute device (NCCL needs GPU tensors); the small reductions the
engine does on CPU tensors are moved there and back.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from chunkmem.chunk import ChunkLayout
from chunkmem.params import ParamStore
from chunkmem.residency import Residency
from chunkmem.sharding import GradReducer, ParamGatherer, Sharding, Span, Strategy, Waitable
from zero.comm import Communicator
from zero.gather import GatherForCompute, GatherUpdatedShards
from zero.reduce import ReduceScatterGrads


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
        self._checkpoint_group: object | None = None

    def param_span(self, layout: ChunkLayout) -> Span | None:
        return self.shard(layout) if self.stage >= 3 else None

    def state_span(self, layout: ChunkLayout) -> Span | None:
        return self.shard(layout)

    def all_gather(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        self.comm.all_gather(shard, full)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
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
        """A gloo group of its own, made at the first checkpoint: DCP's object collectives
        stage through the GPU on NCCL, and its messages never mix with the training's."""
        if self._checkpoint_group is None:
            world = self.comm.world
            self._checkpoint_group = dist.new_group(
                list(world.ranks), timeout=timedelta(seconds=world.timeout_s), backend="gloo"
            )
        return self._checkpoint_group


class ZeroStrategy(Strategy):
    """The seams of ZeRO stage 1, 2 or 3 over one communicator."""

    sharding: ZeroSharding

    def __init__(self, stage: int, comm: Communicator, device: torch.device) -> None:
        super().__init__(ZeroSharding(stage, comm, device))
        self.comm = comm

    def _all_gather(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool) -> Waitable:
        return self.comm.all_gather(shard, full, async_op=async_op)

    def _reduce_scatter(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Waitable:
        return self.comm.reduce_scatter(full, shard, async_op=async_op)

    def gatherer(self, residency: Residency) -> ParamGatherer:
        if self.sharding.stage >= 3:
            return GatherForCompute(residency, self._all_gather)
        return GatherUpdatedShards(residency, self.sharding, self._all_gather)

    def reducer(self, params: ParamStore, residency: Residency) -> GradReducer:
        overlap = self.sharding.stage >= 2
        return ReduceScatterGrads(
            params, residency, self.sharding, self._reduce_scatter, overlap=overlap
        )
