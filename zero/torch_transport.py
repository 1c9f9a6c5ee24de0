"""The transport over torch.distributed: gloo rings and all-to-alls, or the backend's collectives.

[Note: every member at the same collective first] A builtin collective (all_reduce,
broadcast, the object gathers and the barrier) first all-gathers the identities of the
collective each member is at (``zero.identity``, a fixed-size message) and compares them:
before launching on gloo, whose background work would abort on a size mismatch, and at the
wait on NCCL, which keeps its launch order. Rings and all-to-alls need no agreement: they
send under the identity's tag, so messages of different collectives never match. On gloo
host all-reduces travel the same way, as a direct exchange when small (a norm, a flag) and
as a ring (reduce-scatter, then all-gather) when a large sum: the agreement is a blocking
round trip before every builtin launch, which on a 1 Gbit/s emulated link cost a PowerSGD
step (two all-reduces) about 14 ms of its 0.30 s.

A timed-out wait asks the peers where they are over a gloo group of its own (see
:meth:`TorchTransport.explain`): a timed-out collective closes its group's connections to
the peer, and the peers must still be reachable to answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from zero.identity import FIELDS, CollectiveIdentity, MismatchError, diagnose, mismatch_message
from zero.process_group import Group, create_group
from zero.ring import (
    AllToAllWork,
    DirectAllReduceWork,
    HostStagedRing,
    RingAllReduceWork,
    RingWork,
    host_all_reduce_path,
)

# torch 2.13 deprecates the *_into_tensor / *_tensor names; older releases lack *_single.
# Picked once here so no call site emits a FutureWarning.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# How long a timed-out rank listens for its peers' answers: short, so that every survivor
# raises within about a second of its timeout (a dead peer never answers), long enough for
# peers that time out a little later on the same collective.
DIAGNOSIS_S = 0.5


class _Checked:
    """A launched builtin collective whose agreement check runs at the wait (NCCL)."""

    def __init__(self, work: dist.Work, check: Callable[[], None]) -> None:
        self._work = work
        self._check: Callable[[], None] | None = check

    def wait(self, timeout: timedelta) -> bool:
        check, self._check = self._check, None
        if check is not None:
            check()
        return self._work.wait(timeout=timeout)

    def is_completed(self) -> bool:
        return self._work.is_completed()


class _Works:
    """Several launched works as one: ``wait`` waits for each, within one timeout in total."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self, timeout: timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        for work in self._works:
            work.wait(timeout=timedelta(seconds=max(0.0, deadline - time.monotonic())))
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class TorchTransport:
    """Collectives on torch.distributed process groups. ``rings``: gloo gathers,
    reduce-scatters and all-to-alls run as point-to-point exchanges (``zero.ring``)."""

    def __init__(self, world: Group, *, rings: bool = True) -> None:
        self.rings = rings
        self._timeout_s = world.timeout_s
        self._world_ranks = world.ranks
        self._checkpoint_group: object | None = None
        self._diagnosis = (
            dist.new_group(
                list(world.ranks), timeout=timedelta(seconds=world.timeout_s), backend="gloo"
            )
            if world.size > 1
            else None
        )

    def create_group(self, world: Group, name: str, ranks: Sequence[int]) -> Group:
        return create_group(world, name, ranks)

    def checkpoint_group(self) -> object:
        """A gloo group of its own, made at the first checkpoint: DCP's object collectives
        stage through the GPU on NCCL, and its messages never mix with the training's."""
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(
                list(self._world_ranks), timeout=timedelta(seconds=self._timeout_s), backend="gloo"
            )
        return self._checkpoint_group

    def check_sendable(self, op: str, name: str, tensor: Tensor, group: Group) -> None:
        if (
            tensor.dtype.is_floating_point
            and tensor.dtype.itemsize == 1
            and dist.get_backend(group.process_group) == "gloo"
        ):
            raise TypeError(
                f"{op}: {name} has dtype {tensor.dtype}, which gloo cannot send; "
                f"pass {name}.view(torch.uint8) and view the result back"
            )

    # ------------------------------------------------------------------ data
    def all_gather(
        self, full: Tensor, shard: Tensor, group: Group, identity: CollectiveIdentity
    ) -> object:
        if self._use_ring(group):
            ring = _ring_for(full)
            return ring(
                full, shard, group.ranks, group.rank, group.process_group, False, identity.tag()
            )
        return self._builtin(
            identity,
            group,
            lambda: _ALL_GATHER(full, shard, group=group.process_group, async_op=True),
            agree=False,
        )

    def reduce_scatter(
        self, full: Tensor, shard: Tensor, group: Group, identity: CollectiveIdentity
    ) -> object:
        if self._use_ring(group):
            ring = _ring_for(full)
            return ring(
                full, shard, group.ranks, group.rank, group.process_group, True, identity.tag()
            )
        return self._builtin(
            identity,
            group,
            lambda: _REDUCE_SCATTER(
                shard, full, op=dist.ReduceOp.SUM, group=group.process_group, async_op=True
            ),
            agree=False,
        )

    def all_reduce(
        self, tensor: Tensor, op: str, group: Group, identity: CollectiveIdentity
    ) -> object:
        path = self.all_reduce_path(tensor, op, group)
        if path == "direct":
            return DirectAllReduceWork(
                tensor, op, group.ranks, group.rank, group.process_group, identity.tag()
            )
        if path == "ring":
            return RingAllReduceWork(
                tensor, group.ranks, group.rank, group.process_group, identity.tag()
            )
        return self._builtin(
            identity,
            group,
            lambda: dist.all_reduce(
                tensor, op=_REDUCE_OPS[op], group=group.process_group, async_op=True
            ),
        )

    def broadcast(
        self, tensor: Tensor, src: int, group: Group, identity: CollectiveIdentity
    ) -> object:
        # Passing the global rank works on every torch release; `group_src=` is recent.
        return self._builtin(
            identity,
            group,
            lambda: dist.broadcast(
                tensor, src=group.ranks[src], group=group.process_group, async_op=True
            ),
        )

    def all_to_all(
        self,
        send: list[Tensor],
        received: list[Tensor],
        group: Group,
        identity: CollectiveIdentity,
    ) -> object:
        if self._use_ring(group):
            return AllToAllWork(
                send, received, group.ranks, group.rank, group.process_group, identity.tag()
            )
        return self._builtin(
            identity,
            group,
            lambda: _Works(
                [
                    dist.all_to_all_single(into, out, group=group.process_group, async_op=True)
                    for out, into in zip(send, received, strict=True)
                ]
            ),
            agree=False,
        )

    def gather_bytes(
        self, payload: bytes, group: Group, identity: CollectiveIdentity, timeout: timedelta
    ) -> list[bytes]:
        """Every member's ``payload``: two gathers on flat buffers, the lengths, then the
        payloads padded to the longest."""
        device = _object_device(group)
        self.agree(identity, group, timeout)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        lengths = torch.empty(group.size, dtype=torch.int64, device=device)
        _ALL_GATHER(lengths, length, group=group.process_group, async_op=True).wait(timeout=timeout)
        longest = int(lengths.max())
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        gathered = torch.empty(group.size * longest, dtype=torch.uint8, device=device)
        _ALL_GATHER(gathered, padded, group=group.process_group, async_op=True).wait(
            timeout=timeout
        )
        host = gathered.cpu()
        return [
            host[i * longest : i * longest + n].numpy().tobytes()
            for i, n in enumerate(lengths.tolist())
        ]

    def agree(self, identity: CollectiveIdentity, group: Group, timeout: timedelta) -> None:
        """Return once every member is at ``identity`` (the barrier is exactly this)."""
        self._start_agreement(identity, group)(timeout)

    # ------------------------------------------------------------------ failures
    def explain(self, identity: CollectiveIdentity, group: Group, cause: str) -> str:
        """A timed-out wait: where every peer is, if they say within ``DIAGNOSIS_S``."""
        if group.size == 1 or self._diagnosis is None:
            return cause
        me = group.ranks[group.rank]
        answers = diagnose(
            identity, group.ranks, me, self._diagnosis, min(DIAGNOSIS_S, group.timeout_s)
        )
        return mismatch_message(identity, me, answers) or (
            f"{cause} (every peer says it is at the same {identity.describe()})"
        )

    # ------------------------------------------------------------------ internals
    def _use_ring(self, group: Group) -> bool:
        return self.rings and dist.get_backend(group.process_group) == "gloo"

    def all_reduce_path(self, tensor: Tensor, op: str, group: Group) -> str:
        """How an all-reduce travels: ``builtin`` on NCCL or for a device tensor, else as
        :func:`zero.ring.host_all_reduce_path` says (``direct``, ``ring`` or ``builtin``);
        neither of the first two waits for the builtin's agreement round."""
        if not self._use_ring(group) or tensor.device.type != "cpu":
            return "builtin"
        return host_all_reduce_path(tensor, op, group.size)

    def _builtin(
        self,
        identity: CollectiveIdentity,
        group: Group,
        start: Callable[[], object],
        agree: bool = True,
    ) -> object:
        """A backend collective; with ``agree`` (and a group of several) the members' identities
        are compared first: before the launch on gloo, at the wait on NCCL."""
        if not agree or group.size == 1:
            return start()
        check = self._start_agreement(identity, group)
        if dist.get_backend(group.process_group) == "gloo":
            check(timedelta(seconds=group.timeout_s))
            return start()
        return _Checked(start(), lambda: check(timedelta(seconds=group.timeout_s)))

    def _start_agreement(
        self, identity: CollectiveIdentity, group: Group
    ) -> Callable[[timedelta], None]:
        """Launch the gather of every member's identity; the returned check waits for it and
        raises :class:`MismatchError` if any member is elsewhere. A fixed-size gather: a rank
        in another collective can never make it abort on a size mismatch."""
        device = _object_device(group)
        mine = identity.encode().to(device)
        everyone = torch.empty(group.size * FIELDS, dtype=torch.int64, device=device)
        work = _ALL_GATHER(everyone, mine, group=group.process_group, async_op=True)

        def check(timeout: timedelta) -> None:
            work.wait(timeout=timeout)
            rows = everyone.cpu().view(group.size, FIELDS)
            theirs = {
                global_rank: CollectiveIdentity.decode(rows[position])
                for position, global_rank in enumerate(group.ranks)
            }
            problem = mismatch_message(identity, group.ranks[group.rank], theirs)
            if problem is not None:
                raise MismatchError(problem)

        return check


def _ring_for(full: Tensor) -> type[RingWork] | type[HostStagedRing]:
    """gloo's point-to-point messages need host memory: device tensors travel as host copies."""
    return RingWork if full.device.type == "cpu" else HostStagedRing


def _object_device(group: Group) -> torch.device:
    # NCCL moves only CUDA tensors; gloo (and a mixed cpu:gloo,cuda:nccl group) takes host ones.
    if dist.get_backend(group.process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
