"""Forming process groups: the world from a torchrun launch, and named subgroups, each with its timeout.

The collectives themselves live in `zero.comm`; this module only decides who talks to whom and
how long anyone waits. A group's timeout is given to torch when the group is created, so the
backend enforces it too, not only our waits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from chunkmem.errors import ChunkmemError

WORLD = "world"

# torchrun (and torch.distributed.launch / elastic agents) export these to every rank; the
# env:// rendezvous needs all four.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Group:
    """A named set of ranks that run collectives together.

    ``ranks`` are global ranks in increasing order; group rank ``i`` is ``ranks[i]``. A process
    outside the group still holds a `Group` (torch requires every rank to create every group),
    with ``rank == -1``, torch's own convention for non-members; collectives on it are refused.
    """

    name: str
    ranks: tuple[int, ...]
    process_group: object
    rank: int
    size: int
    timeout_s: float

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    def describe(self) -> str:
        """How errors name the group: ``group 'world' (ranks [0, 1])``."""
        return f"group {self.name!r} (ranks {list(self.ranks)})"


def init_world(*, backend: str = "auto", timeout_s: float = 300.0) -> Group:
    """The world group: wraps an initialized default group, or initializes it from torchrun's env.

    ``backend="auto"`` picks NCCL when CUDA is available and gloo otherwise. With NCCL the rank
    binds to the GPU ``LOCAL_RANK`` first, so ranks of one node do not all land on GPU 0.

    When torch.distributed is already initialized, ``backend`` is ignored and ``timeout_s`` is
    what our waits and new subgroups use; the default group keeps the timeout it was created
    with for the work the backend bounds itself.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if not dist.is_available():
        raise ChunkmemError("this torch build has no torch.distributed; install one that has it")
    if not dist.is_initialized():
        _init_from_launch_env(backend, timeout_s)
    return Group(
        name=WORLD,
        ranks=tuple(range(dist.get_world_size())),
        process_group=dist.group.WORLD,
        rank=dist.get_rank(),
        size=dist.get_world_size(),
        timeout_s=timeout_s,
    )


def _init_from_launch_env(backend: str, timeout_s: float) -> None:
    present = [key for key in LAUNCH_ENV if key in os.environ]
    if len(present) < len(LAUNCH_ENV):
        missing = [key for key in LAUNCH_ENV if key not in os.environ]
        found = f"only {', '.join(present)} set" if present else "none of them set"
        raise ChunkmemError(
            "torch.distributed is not initialized and the environment does not describe a "
            f"distributed launch: {', '.join(LAUNCH_ENV)} are needed, {found} (missing "
            f"{', '.join(missing)}). Launch with `torchrun --nproc-per-node N your_script.py` "
            "(N=1 for a single process), or call torch.distributed.init_process_group(...) "
            "before init_world()."
        )
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        timeout=timedelta(seconds=timeout_s),
        device_id=device_id,
    )


def check_group_ranks(world: Group, name: str, ranks: Sequence[int]) -> tuple[int, ...]:
    """``ranks`` as a subgroup of ``world`` may have them: distinct, increasing, in the world."""
    ranks = tuple(ranks)
    if not ranks:
        raise ValueError(f"group {name!r} needs at least one rank, got an empty list")
    if any(not 0 <= r < world.size for r in ranks):
        raise ValueError(f"group {name!r}: ranks {list(ranks)} must lie in [0, {world.size})")
    if list(ranks) != sorted(set(ranks)):
        # torch orders group ranks by global rank; accepting another order would silently
        # give group rank i to a different process than the caller listed at position i.
        raise ValueError(
            f"group {name!r}: ranks {list(ranks)} must be distinct and increasing "
            f"(torch orders group ranks by global rank), e.g. {sorted(set(ranks))}"
        )
    return ranks


def create_group(world: Group, name: str, ranks: Sequence[int]) -> Group:
    """A subgroup of ``world`` with the world's timeout; every rank of the world must call it."""
    ranks = check_group_ranks(world, name, ranks)
    process_group = dist.new_group(list(ranks), timeout=timedelta(seconds=world.timeout_s))
    me = dist.get_rank()
    return Group(
        name=name,
        ranks=ranks,
        process_group=process_group,
        rank=ranks.index(me) if me in ranks else -1,
        size=len(ranks),
        timeout_s=world.timeout_s,
    )
