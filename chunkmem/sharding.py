"""How one process holds the chunk layouts: everything (one process) or a ZeRO shard.

The chunk manager and the optimizer ask this object which part of a layout is theirs and
use its collectives; they never talk to torch.distributed themselves. The base class is a
world of one, where every collective is the identity. ``zero.sharding.ZeroSharding``
implements stages 1-3 over a communicator.

Every layout's capacity is a multiple of the world size, and rank ``r`` owns elements
``[r * capacity / n, (r + 1) * capacity / n)`` of every layout (its shard).
"""

from __future__ import annotations

from typing import Protocol

import torch

from chunkmem.chunk import ChunkLayout


class Waitable(Protocol):
    def wait(self) -> None: ...

    def is_completed(self) -> bool:
        """True once ``wait`` would return without blocking."""
        ...


class _Done:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class Sharding:
    """A world of one: owns every layout whole; collectives are identities."""

    world_size = 1
    rank = 0
    stage = 0

    @property
    def states_sharded(self) -> bool:
        """Optimizer states (and the gradients they consume) are split across ranks."""
        return self.stage >= 1

    @property
    def grads_sharded_in_backward(self) -> bool:
        """Gradients are reduce-scattered during backward, as soon as a layout's are final."""
        return self.stage >= 2

    @property
    def params_sharded(self) -> bool:
        """Parameters are split too and all-gathered for compute."""
        return self.stage >= 3

    def shard(self, layout: ChunkLayout) -> tuple[int, int]:
        """(start, numel) of the part of ``layout`` this rank owns."""
        size = layout.capacity // self.world_size
        return self.rank * size, size

    def all_gather(
        self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = False
    ) -> Waitable:
        full.copy_(shard)
        return _Done()

    def reduce_scatter(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Waitable:
        shard.copy_(full)
        return _Done()

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        return None

    def set_tag(self, iteration: int) -> None:
        """The iteration number collectives are recorded under (for per-step accounting)."""
        return None
