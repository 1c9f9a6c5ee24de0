"""ZeRO stages 1-3 as a :class:`chunkmem.sharding.Sharding`: this rank's span of every chunk
layout and the collectives that move the rest, over a :class:`zero.comm.Communicator`."""

from __future__ import annotations

import torch

from chunkmem.sharding import Sharding, Waitable
from zero.comm import Communicator


class ZeroSharding(Sharding):
    """Rank ``r`` of ``n`` owns elements ``[r*c/n, (r+1)*c/n)`` of every layout of capacity c.

    Stage 1 shards optimizer states, stage 2 also gradients (reduce-scattered as soon as a
    layout's are final), stage 3 also parameters (all-gathered before use). Collectives run on
    the compute device (NCCL needs GPU tensors); the small reductions the engine does on CPU
    tensors are moved there and back.
    """

    def __init__(self, stage: int, comm: Communicator, device: torch.device) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        self.stage = stage
        self.comm = comm
        self.device = device
        self.world_size = comm.size
        self.rank = comm.rank

    def all_gather(
        self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = False
    ) -> Waitable:
        return self.comm.all_gather(shard, full, async_op=async_op)

    def reduce_scatter(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Waitable:
        return self.comm.reduce_scatter(full, shard, async_op=async_op)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        if tensor.device == self.device:
            self.comm.all_reduce(tensor, op="sum")
            return
        staged = tensor.to(self.device)
        self.comm.all_reduce(staged, op="sum")
        tensor.copy_(staged)

    def set_tag(self, iteration: int) -> None:
        self.comm.tag = iteration
