"""Every collective the ZeRO stages issue: flat buffers, a timeout on each, and a volume ledger.

[Note: every collective is bounded in time]
Groups are created with their timeout, so the backend bounds its own work, and every collective
runs as async work plus ``Work.wait(timeout)`` with the same timeout, so a synchronous call is
bounded the same way as an asynchronous one. gloo's wait raises "Operation timed out!" on the
waiting rank. NCCL's wait with a timeout blocks the host until the collective completes (its
watchdog aborts it at the timeout); overlap comes from launching with ``async_op=True`` early
and waiting late, not from a non-blocking wait.

[Note: intra-node and cross-node bytes]
With a `Topology` set (``zero.topology``; ZeRO sets it at initialize), every record also says
how many of its bytes go to ranks on another node, under the same algorithm model as
``elements_sent``: a ring collective (all_gather, reduce_scatter, all_reduce, the object gather)
sends everything to the next rank of the group, so it is cross-node exactly on the ranks whose
right neighbour sits on another node; a broadcast root sends to its right neighbour too; an
all_to_all sends one block to every other member. ``phase`` (forward, backward, step) is stamped
like ``tag``, so a step's cross-node bytes can be read per operation and phase.

[Note: only sum, max and min]
gloo cannot average integer tensors (the int8/uint8 AVG cast fails), and an average that works
for some dtypes and not others is a trap. Averaging is the caller's division after a sum.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from chunkmem.errors import CollectiveError
from chunkmem.temporaries import uncounted
from zero.collective_failures import FirstFailure
from zero.comm_checks import check_flat, check_shard_and_full
from zero.comm_ledger import (
    CollectiveRecord,
    CommLedger,
    cross_node_elements,
    dtype_name,
    elements_sent_per_rank,
)
from zero.identity import CollectiveIdentity
from zero.process_group import Group, init_world
from zero.transport import Transport, Work

if TYPE_CHECKING:
    from zero.topology import Topology

__all__ = [
    "CollectiveError",
    "CollectiveRecord",
    "CommLedger",
    "Communicator",
    "Group",
    "Handle",
    "Transport",
    "init_world",
    "padded_numel",
]

_REDUCE_OPS = ("sum", "max", "min")

_LENGTH_BYTES = 8  # all_gather_object's per-rank length header, one int64


class Handle:
    """A launched collective: `wait` returns once it completed, or raises `CollectiveError`."""

    def __init__(
        self,
        op: str,
        group: Group,
        work: Work,
        launched_at: float,
        communicator: Communicator,
        identity: CollectiveIdentity | None = None,
    ) -> None:
        self._op = op
        self._group = group
        self._work: Work | None = work
        self._launched_at = launched_at
        self._communicator = communicator
        self._identity = identity  # to ask the peers where they are after a timeout
        self._error: CollectiveError | None = None

    def wait(self) -> None:
        """Wait at most the group's timeout (see [Note: a failed collective is final] in
        zero.collective_failures for the waits after a failure); on NCCL the host blocks until completion."""
        if self._error is not None:
            raise self._error
        if self._work is None:
            return
        work, self._work = self._work, None
        self._error = self._communicator._finish(
            work, self._op, self._group, self._launched_at, self._identity
        )
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        """True once the collective finished, with success or error; `wait` tells which."""
        return self._work is None or self._work.is_completed()


class Communicator:
    """Runs collectives on the world group and named subgroups and records each in ``ledger``.

    ``tag`` is stamped on every record: set it to the step number, and
    ``ledger.elements_sent(tag=step)`` gives that step's volume. ``phase`` is stamped too (set
    it for a block with ``serving``). ``topology`` says which ranks share a node (None: all of
    them), which splits every record's bytes into intra-node and cross-node. ``cycle`` is the
    engine's cycle number, part of every collective's identity (see ``zero.identity``).
    ``transport`` moves the bytes (default: torch.distributed, with gloo rings when
    ``rings``).
    """

    def __init__(
        self,
        world: Group,
        ledger: CommLedger | None = None,
        *,
        rings: bool = True,
        transport: Transport | None = None,
    ) -> None:
        if transport is None:
            from zero.torch_transport import TorchTransport

            transport = TorchTransport(world, rings=rings)
        self.world = world
        self.transport = transport
        self.ledger = ledger if ledger is not None else CommLedger()
        self.tag = 0
        self.phase = ""
        self.subject = -1  # the layout the next collectives move (see about)
        self.topology: Topology | None = None
        self.cycle = 0
        self.failures = FirstFailure(transport)
        self._groups = {world.name: world}
        self._sequence: dict[str, int] = {}

    @contextlib.contextmanager
    def serving(self, phase: str) -> Iterator[None]:
        """Record the collectives launched in the block under ``phase``."""
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    @contextlib.contextmanager
    def about(self, layout: int) -> Iterator[None]:
        """The collectives launched in the block move ``layout``: their identities say so, so
        ranks at another layout's collective of one size are told apart (zero/identity.py)."""
        previous, self.subject = self.subject, layout
        try:
            yield
        finally:
            self.subject = previous

    def _identity(
        self, op: str, group: Group, numel: int, dtype: torch.dtype | None
    ) -> CollectiveIdentity:
        """The next collective's identity in ``group`` (every member numbers them alike)."""
        seq = self._sequence.get(group.name, 0) + 1
        self._sequence[group.name] = seq
        return CollectiveIdentity(self.cycle, seq, op, numel, dtype, self.subject)

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    def new_group(self, name: str, ranks: Sequence[int]) -> Group:
        """A subgroup with the world's timeout. Every rank must call it, members or not."""
        if name in self._groups:
            raise ValueError(
                f"a group named {name!r} exists already (ranks "
                f"{list(self._groups[name].ranks)}); the ledger keys volumes by name, pick another"
            )
        group = self.transport.create_group(self.world, name, ranks)
        self._groups[name] = group
        return group

    def all_gather(
        self, shard: Tensor, full: Tensor, *, group: Group | None = None, async_op: bool = False
    ) -> Handle:
        """Group rank i's ``shard`` lands in every rank's ``full[i*n : (i+1)*n]``.

        ``shard`` may be that very slice of ``full`` (in place).
        """
        g = self._member("all_gather", group)
        check_shard_and_full(self.transport, "all_gather", g, shard, full)
        numel = full.numel()
        return self._run(
            "all_gather",
            g,
            full,
            elements_sent_per_rank("all_gather", numel, g.size),
            lambda identity: self.transport.all_gather(full, shard, g, identity),
            async_op,
        )

    def reduce_scatter(
        self, full: Tensor, shard: Tensor, *, group: Group | None = None, async_op: bool = False
    ) -> Handle:
        """Group rank i's ``shard`` becomes the sum over ranks of their ``full[i*n : (i+1)*n]``."""
        g = self._member("reduce_scatter", group)
        check_shard_and_full(self.transport, "reduce_scatter", g, shard, full)
        numel = full.numel()
        return self._run(
            "reduce_scatter",
            g,
            full,
            elements_sent_per_rank("reduce_scatter", numel, g.size),
            lambda identity: self.transport.reduce_scatter(full, shard, g, identity),
            async_op,
        )

    def all_reduce(
        self,
        tensor: Tensor,
        *,
        op: str = "sum",
        group: Group | None = None,
        async_op: bool = False,
    ) -> Handle:
        """Reduce ``tensor`` in place across the group with ``op`` ("sum", "max" or "min")."""
        g = self._member("all_reduce", group)
        check_flat(self.transport, "all_reduce", "tensor", tensor, g)
        if op not in _REDUCE_OPS:
            raise ValueError(
                f"all_reduce: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}; to average, "
                "sum and divide by the group size (gloo cannot average integer tensors)"
            )
        numel = tensor.numel()
        exchange = self.transport.all_reduce_path(tensor, op, g) == "direct"
        return self._run(
            "all_reduce",
            g,
            tensor,
            elements_sent_per_rank("all_reduce", numel, g.size, exchange=exchange),
            lambda identity: self.transport.all_reduce(tensor, op, g, identity),
            async_op,
            exchange=exchange,
        )

    def broadcast(self, tensor: Tensor, *, src: int = 0, group: Group | None = None) -> None:
        """Copy group rank ``src``'s ``tensor`` into every other member's ``tensor``.

        ``src`` is the rank within ``group``, not the global rank.
        """
        g = self._member("broadcast", group)
        check_flat(self.transport, "broadcast", "tensor", tensor, g)
        if not 0 <= src < g.size:
            raise ValueError(
                f"broadcast: src={src} is not a rank of {g.describe()}: group ranks are "
                f"0..{g.size - 1} (src is the rank within the group, not the global rank)"
            )
        sent = tensor.numel() if g.rank == src and g.size > 1 else 0
        self._run(
            "broadcast",
            g,
            tensor,
            sent,
            lambda identity: self.transport.broadcast(tensor, src, g, identity),
            async_op=False,
        )

    def all_to_all(
        self,
        send: Sequence[Tensor],
        received: Sequence[Tensor],
        *,
        group: Group | None = None,
        async_op: bool = False,
    ) -> Handle:
        """Equal-split all-to-all of several flat buffers at once (e.g. quantized data and its
        scales, as uint8 views): each ``send[i]`` is cut into ``size`` equal blocks; block
        ``j`` goes to group rank ``j``, which stores the block it gets from group rank ``k`` as
        block ``k`` of ``received[i]``. All buffers share one dtype; ``received[i]`` has the
        numel of ``send[i]``. At most two buffers (a quantized tensor's levels and scales).
        """
        g = self._member("all_to_all", group)
        send, received = list(send), list(received)
        if not send or len(send) != len(received):
            raise ValueError(
                f"all_to_all: send and received must be non-empty lists of one length, got "
                f"{len(send)} and {len(received)} buffers"
            )
        for index, (out, into) in enumerate(zip(send, received, strict=True)):
            check_flat(self.transport, "all_to_all", f"send[{index}]", out, g)
            check_flat(self.transport, "all_to_all", f"received[{index}]", into, g)
            if out.dtype != send[0].dtype or into.dtype != out.dtype:
                raise TypeError(
                    f"all_to_all: every buffer must have dtype {send[0].dtype}, got send[{index}] "
                    f"{out.dtype} and received[{index}] {into.dtype}"
                )
            if out.numel() != into.numel() or out.numel() % g.size:
                raise ValueError(
                    f"all_to_all: send[{index}] ({out.numel()} elements) and received[{index}] "
                    f"({into.numel()}) must have one numel, a multiple of the size of "
                    f"{g.describe()}"
                )
        if len(send) > 2:
            raise ValueError(f"all_to_all: at most 2 buffers per call, got {len(send)}")
        numel = sum(t.numel() for t in send)
        return self._run(
            "all_to_all",
            g,
            send[0],
            elements_sent_per_rank("all_to_all", numel, g.size),
            lambda identity: self.transport.all_to_all(send, received, g, identity),
            async_op,
            numel=numel,
        )

    def all_gather_object(self, obj: object, *, group: Group | None = None) -> list[object]:
        """Every member's picklable ``obj`` in group-rank order; blocking, for small metadata.

        The ledger records it as one uint8 record of ``size * (8 + longest)`` elements (the
        pickled lengths as int64, then the pickles padded to the longest).
        """
        g = self._member("all_gather_object", group)
        identity = self._identity("all_gather_object", g, 0, None)
        payloads = self._blocking(
            "all_gather_object",
            g,
            identity,
            lambda timeout: self.transport.gather_bytes(pickle.dumps(obj), g, identity, timeout),
        )
        numel = g.size * (_LENGTH_BYTES + max(len(p) for p in payloads))
        self._record(
            "all_gather_object",
            g,
            numel,
            elements_sent_per_rank("all_gather_object", numel, g.size),
            torch.uint8,
        )
        return [pickle.loads(payload) for payload in payloads]

    def barrier(self, *, group: Group | None = None) -> None:
        """Return once every member reached the barrier (bounded by the group's timeout)."""
        g = self._member("barrier", group)
        self._record("barrier", g, 0, 0, None)
        identity = self._identity("barrier", g, 0, None)
        self._blocking(
            "barrier", g, identity, lambda timeout: self.transport.agree(identity, g, timeout)
        )

    # ------------------------------------------------------------------ internals
    def _member(self, op: str, group: Group | None) -> Group:
        g = self.world if group is None else group
        if not isinstance(g, Group):
            raise TypeError(f"{op}: group must be a Group or None, got {type(g).__name__}")
        if not g.is_member:
            raise ValueError(f"{op}: global rank {self.rank} is not a member of {g.describe()}")
        return g

    def _run(
        self,
        op: str,
        group: Group,
        tensor: Tensor,
        elements_sent: int,
        start: Callable[[CollectiveIdentity], Work],
        async_op: bool,
        numel: int | None = None,
        exchange: bool = False,
    ) -> Handle:
        """Record collective ``op``, give it its identity and launch ``start(identity)``.
        ``numel`` is the logical size when ``tensor`` is one of several buffers; ``exchange``:
        every member sends the same elements to every other (see ``cross_node_elements``)."""
        numel = tensor.numel() if numel is None else numel
        self._record(op, group, numel, elements_sent, tensor.dtype, exchange)
        identity = self._identity(op, group, numel, tensor.dtype)
        launched_at = time.monotonic()
        try:
            with uncounted():  # the transport's own buffers: see chunkmem/temporaries.py
                work = start(identity)
        except RuntimeError as cause:  # a peer gone before the launch: ask the others, too
            raise self.failures.failed(op, group, launched_at, identity, cause) from cause
        handle = Handle(op, group, work, launched_at, self, identity)
        if not async_op:
            handle.wait()
        return handle

    def _blocking(
        self,
        op: str,
        group: Group,
        identity: CollectiveIdentity,
        run: Callable[[timedelta], object],
    ) -> object:
        """A blocking exchange of the transport's, bounded by the group's timeout."""
        launched_at = time.monotonic()
        try:
            with uncounted():
                return run(timedelta(seconds=group.timeout_s))
        except RuntimeError as cause:
            raise self.failures.failed(op, group, launched_at, identity, cause) from cause

    def _finish(
        self,
        work: Work,
        op: str,
        group: Group,
        launched_at: float,
        identity: CollectiveIdentity | None,
    ) -> CollectiveError | None:
        """Wait for ``work``; the error that ends it, if any (see [Note: a failed collective
        is final]: after a failure, a wait is not given a second timeout)."""
        try:
            with uncounted():
                work.wait(timedelta(seconds=self.failures.timeout_s(group)))
            return None
        except RuntimeError as cause:
            return self.failures.failed(op, group, launched_at, identity, cause)

    def _record(
        self,
        op: str,
        group: Group,
        numel: int,
        elements_sent: int,
        dtype: torch.dtype | None,
        exchange: bool = False,
    ) -> None:
        itemsize = 0 if dtype is None else dtype.itemsize
        self.ledger.add(
            CollectiveRecord(
                op=op,
                group=group.name,
                numel=numel,
                elements_sent=elements_sent,
                bytes_sent=elements_sent * itemsize,
                dtype=dtype_name(dtype),
                tag=self.tag,
                cross_node_bytes=cross_node_elements(
                    op,
                    group.ranks,
                    group.ranks[group.rank],
                    self.topology,
                    elements_sent,
                    exchange=exchange,
                )
                * itemsize,
                phase=self.phase,
            )
        )


def padded_numel(numel: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that holds ``numel`` elements.

    Collectives need equal shards on every rank (gloo rejects uneven gathers), so a buffer of
    ``numel`` elements is padded to ``padded_numel(numel, group.size)``.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-numel // multiple) * multiple
