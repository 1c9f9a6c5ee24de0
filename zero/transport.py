"""The interface a :class:`zero.comm.Communicator` moves bytes through: a ``Transport`` (over
torch.distributed in ``zero.torch_transport``, between threads in ``zero.thread_world``) and
the ``Work`` it returns for each launched collective."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from zero.identity import CollectiveIdentity
    from zero.process_group import Group


class Work(Protocol):
    """A launched collective as a transport returns it (torch's ``Work`` has this shape)."""

    def wait(self, timeout: timedelta) -> bool:
        """Return once complete; raise ``RuntimeError`` on a failure or after ``timeout``."""
        ...

    def is_completed(self) -> bool: ...


class Transport(Protocol):
    """How a :class:`Communicator`'s collectives move bytes: over torch.distributed
    (``zero.torch_transport``) or between the threads of one process (``zero.thread_world``).

    The communicator validates the buffers, numbers every collective (its identity), records
    its volume and bounds every wait by the group's timeout; a transport only moves the bytes
    under that identity and says, after a timeout, where the peers are. Results must be the
    same on every transport, bit for bit: a reduce-scatter sums the ranks in the ring's order
    (``zero.ring``)."""

    def create_group(self, world: Group, name: str, ranks: Sequence[int]) -> Group: ...

    def check_sendable(self, op: str, name: str, tensor: Tensor, group: Group) -> None:
        """Raise ``TypeError`` for a dtype this transport cannot send."""
        ...

    def all_gather(
        self, full: Tensor, shard: Tensor, group: Group, identity: CollectiveIdentity
    ) -> Work: ...

    def reduce_scatter(
        self, full: Tensor, shard: Tensor, group: Group, identity: CollectiveIdentity
    ) -> Work: ...

    def all_reduce(
        self, tensor: Tensor, op: str, group: Group, identity: CollectiveIdentity
    ) -> Work: ...

    def all_reduce_path(self, tensor: Tensor, op: str, group: Group) -> str:
        """``direct`` when the all-reduce is one exchange (every member sends its whole tensor
        to every other: the ledger counts ``(n-1) numel``), else ``ring`` or ``builtin``
        (counted by the ring model)."""
        ...

    def broadcast(
        self, tensor: Tensor, src: int, group: Group, identity: CollectiveIdentity
    ) -> Work: ...

    def all_to_all(
        self, send: list[Tensor], received: list[Tensor], group: Group, identity: CollectiveIdentity
    ) -> Work: ...

    def gather_bytes(
        self, payload: bytes, group: Group, identity: CollectiveIdentity, timeout: timedelta
    ) -> list[bytes]:
        """Blocking: every member's ``payload`` in group-rank order."""
        ...

    def agree(self, identity: CollectiveIdentity, group: Group, timeout: timedelta) -> None:
        """Blocking: return once every member is at ``identity``; raise if one is elsewhere."""
        ...

    def explain(self, identity: CollectiveIdentity, group: Group, cause: str) -> str:
        """After a failed wait: ``cause``, with where the peers are where they can be asked."""
        ...

    def checkpoint_group(self) -> object:
        """The process group ``torch.distributed.checkpoint`` coordinates on (made once)."""
        ...
