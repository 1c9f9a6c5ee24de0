"""Every collective the ZeRO stages issue: flat buffers, a timeout on each, and a volume ledger.

[Note: a failed collective is final]
A collective that fails or times out raises `CollectiveError`. The group may be unusable after
that: with gloo an async error can surface again at the next collective on one rank only, while
its peers wait for a message that never comes, and an NCCL timeout aborts the communicators.
The engine must stop on the first `CollectiveError`; nothing here retries, and no other
algorithm is ever swapped in.

[Note: every collective is bounded in time]
Groups are created with their timeout, so the backend bounds its own work, and every collective
runs as async work plus ``Work.wait(timeout)`` with the same timeout, so a synchronous call is
bounded the same way as an asynchronous one. gloo's wait raises "Operation timed out!" on the
waiting rank. NCCL's wait with a timeout blocks the host until the collective completes (its
watchdog aborts it at the timeout); overlap comes from launching with ``async_op=True`` early
and waiting late, not from a non-blocking wait.

[Note: only sum, max and min]
gloo cannot average integer tensors (the int8/uint8 AVG cast fails), and an average that works
for some dtypes and not others is a trap. Averaging is the caller's division after a sum.
"""

from __future__ import annotations

import functools
import pickle
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from chunkmem.errors import CollectiveError
from zero.identity import FIELDS, CollectiveIdentity, diagnose, mismatch_message
from zero.process_group import Group, create_group, init_world
from zero.ring import HostStagedRing, RingWork

__all__ = [
    "CollectiveError",
    "CollectiveRecord",
    "CommLedger",
    "Communicator",
    "Group",
    "Handle",
    "init_world",
    "padded_numel",
]

# torch 2.13 deprecates the *_into_tensor / *_tensor names; older releases lack *_single.
# Picked once here so no call site emits a FutureWarning.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

_LENGTH_BYTES = 8  # all_gather_object's per-rank length header, one int64


def _failure(op: str, group: Group, launched_at: float, cause: str) -> CollectiveError:
    return CollectiveError(
        op, group.name, group.ranks, time.monotonic() - launched_at, group.timeout_s, cause
    )


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as this rank issued it, with the volume a ring algorithm sends per rank.

    ``elements_sent`` is theory, not a measurement: all_gather and reduce_scatter send
    ``numel * (n - 1) / n`` per rank, all_reduce ``2 * numel * (n - 1) / n`` (rounded down when
    ``numel`` is not a multiple of ``n``), broadcast ``numel`` from the root and 0 elsewhere.
    A group of one sends nothing. A barrier records 0 elements and dtype ``""``.
    """

    op: str
    group: str
    numel: int
    elements_sent: int
    bytes_sent: int
    dtype: str
    tag: int


@dataclass
class CommLedger:
    """The collectives a `Communicator` launched: running totals, and bounded detail.

    Totals per (op, group) cover the whole run; totals per tag (the step) are kept for the last
    ``max_tags`` tags, and the records themselves for the last ``max_records`` collectives, so a
    run of any length holds a fixed amount (``records_dropped`` counts what left the window).
    """

    max_records: int = 10_000
    max_tags: int = 64
    records: deque[CollectiveRecord] = field(default_factory=deque)
    records_dropped: int = 0
    _totals: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    _by_tag: OrderedDict[int, dict[tuple[str, str], list[int]]] = field(default_factory=OrderedDict)

    def add(self, record: CollectiveRecord) -> None:
        self.records.append(record)
        if len(self.records) > self.max_records:
            self.records.popleft()
            self.records_dropped += 1
        key = (record.op, record.group)
        tag_totals = self._by_tag.get(record.tag)
        if tag_totals is None:
            tag_totals = self._by_tag[record.tag] = {}
            while len(self._by_tag) > self.max_tags:
                self._by_tag.popitem(last=False)
        for totals in (self._totals, tag_totals):
            row = totals.setdefault(key, [0, 0, 0])
            row[0] += 1
            row[1] += record.elements_sent
            row[2] += record.bytes_sent

    def _sum(self, column: int, op: str | None, group: str | None, tag: int | None) -> int:
        if tag is None:
            totals = self._totals
        elif tag in self._by_tag:
            totals = self._by_tag[tag]
        elif self._by_tag and tag < next(iter(self._by_tag)):
            raise KeyError(
                f"tag {tag} left the ledger's window of the last {self.max_tags} tags; read a "
                f"step's volume while it is recent, or raise CommLedger.max_tags"
            )
        else:
            return 0
        return sum(
            row[column]
            for (row_op, row_group), row in totals.items()
            if (op is None or row_op == op) and (group is None or row_group == group)
        )

    def elements_sent(
        self, *, op: str | None = None, group: str | None = None, tag: int | None = None
    ) -> int:
        return self._sum(1, op, group, tag)

    def bytes_sent(
        self, *, op: str | None = None, group: str | None = None, tag: int | None = None
    ) -> int:
        return self._sum(2, op, group, tag)

    def totals(self) -> dict[tuple[str, str], dict[str, int]]:
        """``(op, group) -> {"calls", "elements_sent", "bytes_sent"}`` over the whole run."""
        return {
            key: {"calls": calls, "elements_sent": elements, "bytes_sent": nbytes}
            for key, (calls, elements, nbytes) in self._totals.items()
        }


class Handle:
    """A launched collective: `wait` returns once it completed, or raises `CollectiveError`."""

    def __init__(
        self,
        op: str,
        group: Group,
        work: dist.Work,
        launched_at: float,
        explain_timeout: Callable[[str], str] | None = None,
        before_wait: Callable[[], None] | None = None,
    ) -> None:
        self._op = op
        self._group = group
        self._work: dist.Work | None = work
        self._launched_at = launched_at
        self._explain_timeout = explain_timeout  # asks the peers where they are
        self._before_wait = before_wait  # the identity check of an NCCL collective
        self._error: CollectiveError | None = None

    def wait(self) -> None:
        """Wait at most the group's timeout; on NCCL the host blocks until completion."""
        if self._error is not None:
            raise self._error
        if self._work is None:
            return
        work, self._work = self._work, None
        if self._before_wait is not None:
            check, self._before_wait = self._before_wait, None
            try:
                check()
            except CollectiveError as error:
                self._error = error
                raise
        try:
            # torch's Work.wait(timeout) returns True or raises (a timeout included).
            work.wait(timeout=timedelta(seconds=self._group.timeout_s))
        except RuntimeError as cause:
            reason = str(cause)
            if self._explain_timeout is not None:
                reason = self._explain_timeout(reason)
            self._error = _failure(self._op, self._group, self._launched_at, reason)
            raise self._error from cause

    def is_completed(self) -> bool:
        """True once the collective finished, with success or error; `wait` tells which."""
        return self._work is None or self._work.is_completed()


class Communicator:
    """Runs collectives on the world group and named subgroups and records each in ``ledger``.

    ``tag`` is stamped on every record: set it to the step number, and
    ``ledger.elements_sent(tag=step)`` gives that step's volume. ``cycle`` is the engine's
    cycle number, part of every collective's identity (see ``zero.identity``).
    """

    def __init__(
        self, world: Group, ledger: CommLedger | None = None, *, rings: bool = True
    ) -> None:
        self.world = world
        self.rings = rings  # gloo gathers and reduce-scatters as point-to-point rings
        self.ledger = ledger if ledger is not None else CommLedger()
        self.tag = 0
        self.cycle = 0
        self._groups = {world.name: world}
        self._sequence: dict[str, int] = {}
        # Its own gloo connections: a timed-out collective closes its group's connections to
        # the peer, and the peers must still be asked where they are (``_explain``).
        self._diagnosis = (
            dist.new_group(
                list(world.ranks), timeout=timedelta(seconds=world.timeout_s), backend="gloo"
            )
            if world.size > 1
            else None
        )

    def _explain(self, identity: CollectiveIdentity, group: Group, cause: str) -> str:
        """A timed-out wait: where every peer is, if they say (see ``zero.identity``)."""
        if group.size == 1 or self._diagnosis is None:
            return cause
        me = group.ranks[group.rank]
        answers = diagnose(identity, group.ranks, me, self._diagnosis, min(10.0, group.timeout_s))
        return mismatch_message(identity, me, answers) or (
            f"{cause} (every peer says it is at the same {identity.describe()})"
        )

    def _identity(
        self, op: str, group: Group, numel: int, dtype: torch.dtype | None
    ) -> CollectiveIdentity:
        """The next collective's identity in ``group`` (every member numbers them alike)."""
        seq = self._sequence.get(group.name, 0) + 1
        self._sequence[group.name] = seq
        return CollectiveIdentity(self.cycle, seq, op, numel, dtype)

    def _start_agreement(self, identity: CollectiveIdentity, group: Group) -> Callable[[], None]:
        """Launch the gather of every member's identity for a builtin collective; the returned
        check waits for it and raises if any member is elsewhere. A fixed-size gather: a rank
        in another collective can never make it abort on a size mismatch."""
        device = _object_device(group)
        mine = identity.encode().to(device)
        everyone = torch.empty(group.size * FIELDS, dtype=torch.int64, device=device)
        handle = self._launch(
            identity.op,
            group,
            lambda: _ALL_GATHER(everyone, mine, group=group.process_group, async_op=True),
            identity,
        )

        def check() -> None:
            handle.wait()
            rows = everyone.cpu().view(group.size, FIELDS)
            theirs = {
                global_rank: CollectiveIdentity.decode(rows[position])
                for position, global_rank in enumerate(group.ranks)
            }
            problem = mismatch_message(identity, self.rank, theirs)
            if problem is not None:
                raise _failure(identity.op, group, time.monotonic(), problem)

        return check

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
        group = create_group(self.world, name, ranks)
        self._groups[name] = group
        return group

    def all_gather(
        self, shard: Tensor, full: Tensor, *, group: Group | None = None, async_op: bool = False
    ) -> Handle:
        """Group rank i's ``shard`` lands in every rank's ``full[i*n : (i+1)*n]``.

        ``shard`` may be that very slice of ``full`` (in place).
        """
        g = self._member("all_gather", group)
        _check_shard_and_full("all_gather", g, shard, full)
        numel = full.numel()
        ring = _ring_for(full)
        return self._run(
            "all_gather",
            g,
            full,
            numel * (g.size - 1) // g.size,
            lambda tag: (
                ring(full, shard, g.ranks, g.rank, g.process_group, reduce=False, tag=tag)
                if self._use_ring(g)
                else _ALL_GATHER(full, shard, group=g.process_group, async_op=True)
            ),
            async_op,
            ring=self._use_ring(g),
        )

    def reduce_scatter(
        self, full: Tensor, shard: Tensor, *, group: Group | None = None, async_op: bool = False
    ) -> Handle:
        """Group rank i's ``shard`` becomes the sum over ranks of their ``full[i*n : (i+1)*n]``."""
        g = self._member("reduce_scatter", group)
        _check_shard_and_full("reduce_scatter", g, shard, full)
        numel = full.numel()
        ring = _ring_for(full)
        return self._run(
            "reduce_scatter",
            g,
            full,
            numel * (g.size - 1) // g.size,
            lambda tag: (
                ring(full, shard, g.ranks, g.rank, g.process_group, reduce=True, tag=tag)
                if self._use_ring(g)
                else _REDUCE_SCATTER(
                    shard, full, op=dist.ReduceOp.SUM, group=g.process_group, async_op=True
                )
            ),
            async_op,
            ring=self._use_ring(g),
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
        _check_flat("all_reduce", "tensor", tensor, g)
        if op not in _REDUCE_OPS:
            raise ValueError(
                f"all_reduce: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}; to average, "
                "sum and divide by the group size (gloo cannot average integer tensors)"
            )
        numel = tensor.numel()
        return self._run(
            "all_reduce",
            g,
            tensor,
            2 * numel * (g.size - 1) // g.size,
            lambda _tag: dist.all_reduce(
                tensor, op=_REDUCE_OPS[op], group=g.process_group, async_op=True
            ),
            async_op,
        )

    def broadcast(self, tensor: Tensor, *, src: int = 0, group: Group | None = None) -> None:
        """Copy group rank ``src``'s ``tensor`` into every other member's ``tensor``.

        ``src`` is the rank within ``group``, not the global rank.
        """
        g = self._member("broadcast", group)
        _check_flat("broadcast", "tensor", tensor, g)
        if not 0 <= src < g.size:
            raise ValueError(
                f"broadcast: src={src} is not a rank of {g.describe()}: group ranks are "
                f"0..{g.size - 1} (src is the rank within the group, not the global rank)"
            )
        sent = tensor.numel() if g.rank == src and g.size > 1 else 0
        # Passing the global rank works on every torch release; `group_src=` is recent.
        self._run(
            "broadcast",
            g,
            tensor,
            sent,
            lambda _tag: dist.broadcast(
                tensor, src=g.ranks[src], group=g.process_group, async_op=True
            ),
            async_op=False,
        )

    def all_gather_object(self, obj: object, *, group: Group | None = None) -> list[object]:
        """Every member's picklable ``obj`` in group-rank order; blocking, for small metadata.

        Two gathers on flat uint8/int64 buffers: the pickled lengths, then the pickles padded to
        the longest. The ledger records them as one uint8 record of
        ``size * (8 + longest)`` elements (the int64 length counts as 8 bytes).
        """
        g = self._member("all_gather_object", group)
        device = _object_device(g)
        self._start_agreement(self._identity("all_gather_object", g, 0, None), g)()
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        lengths = torch.empty(g.size, dtype=torch.int64, device=device)
        self._launch(
            "all_gather_object",
            g,
            lambda: _ALL_GATHER(lengths, length, group=g.process_group, async_op=True),
        ).wait()
        longest = int(lengths.max())
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: payload.numel()] = payload
        gathered = torch.empty(g.size * longest, dtype=torch.uint8, device=device)
        numel = g.size * (_LENGTH_BYTES + longest)
        self._record("all_gather_object", g, numel, numel * (g.size - 1) // g.size, torch.uint8)
        self._launch(
            "all_gather_object",
            g,
            lambda: _ALL_GATHER(gathered, padded, group=g.process_group, async_op=True),
        ).wait()
        host = gathered.cpu()
        return [
            pickle.loads(host[i * longest : i * longest + n].numpy().tobytes())
            for i, n in enumerate(lengths.tolist())
        ]

    def barrier(self, *, group: Group | None = None) -> None:
        """Return once every member reached the barrier (bounded by the group's timeout)."""
        g = self._member("barrier", group)
        self._record("barrier", g, 0, 0, None)
        # Every member at the same collective: that gather is the barrier.
        self._start_agreement(self._identity("barrier", g, 0, None), g)()

    def _use_ring(self, group: Group) -> bool:
        return self.rings and _is_gloo(group)

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
        start: Callable[[int], dist.Work],
        async_op: bool,
        ring: bool = False,
    ) -> Handle:
        """Launch ``start(tag)`` as collective ``op`` with its identity (see ``zero.identity``):
        a ring sends under the identity's tag; a builtin collective first checks that every
        member is at the same collective (before launching on gloo, whose background work
        would abort on a size mismatch; on the wait on NCCL, which keeps its launch order)."""
        self._record(op, group, tensor.numel(), elements_sent, tensor.dtype)
        identity = self._identity(op, group, tensor.numel(), tensor.dtype)
        check = None
        if not ring and group.size > 1:
            check = self._start_agreement(identity, group)
            if _is_gloo(group):
                check()
                check = None
        handle = self._launch(op, group, lambda: start(identity.tag()), identity, check)
        if not async_op:
            handle.wait()
        return handle

    def _record(
        self, op: str, group: Group, numel: int, elements_sent: int, dtype: torch.dtype | None
    ) -> None:
        itemsize = 0 if dtype is None else dtype.itemsize
        self.ledger.add(
            CollectiveRecord(
                op=op,
                group=group.name,
                numel=numel,
                elements_sent=elements_sent,
                bytes_sent=elements_sent * itemsize,
                dtype="" if dtype is None else str(dtype).removeprefix("torch."),
                tag=self.tag,
            )
        )

    def _launch(
        self,
        op: str,
        group: Group,
        start: Callable[[], dist.Work],
        identity: CollectiveIdentity | None = None,
        before_wait: Callable[[], None] | None = None,
    ) -> Handle:
        launched_at = time.monotonic()
        try:
            work = start()
        except RuntimeError as cause:
            raise _failure(op, group, launched_at, str(cause)) from cause
        explain = None
        if identity is not None:
            explain = functools.partial(self._explain, identity, group)
        return Handle(op, group, work, launched_at, explain, before_wait)


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


def _check_flat(op: str, name: str, tensor: Tensor, group: Group) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1:
        raise ValueError(
            f"{op}: {name} must be a flat 1-D buffer (gloo rejects stacked shapes), "
            f"got shape {tuple(tensor.shape)}"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be contiguous, got stride {tensor.stride()} "
            f"for shape {tuple(tensor.shape)}"
        )
    if (
        tensor.dtype.is_floating_point
        and tensor.dtype.itemsize == 1
        and dist.get_backend(group.process_group) == "gloo"
    ):
        raise TypeError(
            f"{op}: {name} has dtype {tensor.dtype}, which gloo cannot send; "
            f"pass {name}.view(torch.uint8) and view the result back"
        )


def _check_shard_and_full(op: str, group: Group, shard: Tensor, full: Tensor) -> None:
    _check_flat(op, "shard", shard, group)
    _check_flat(op, "full", full, group)
    if full.dtype != shard.dtype:
        raise TypeError(
            f"{op}: full has dtype {full.dtype} but shard has {shard.dtype}; they must match"
        )
    if full.device != shard.device:
        raise ValueError(
            f"{op}: full is on {full.device} but shard is on {shard.device}; they must match"
        )
    expected = shard.numel() * group.size
    if full.numel() != expected:
        raise ValueError(
            f"{op}: full must have shard.numel() * size of {group.describe()} = "
            f"{shard.numel()} * {group.size} = {expected} elements, got {full.numel()}; "
            f"pad the buffer to padded_numel(numel, {group.size})"
        )


def _is_gloo(group: Group) -> bool:
    """gloo gathers and reduce-scatters run as a point-to-point ring (see ``zero.ring``)."""
    return dist.get_backend(group.process_group) == "gloo"


def _ring_for(full: Tensor) -> type[RingWork] | type[HostStagedRing]:
    """gloo's point-to-point messages need host memory: device tensors travel as host copies."""
    return RingWork if full.device.type == "cpu" else HostStagedRing


def _object_device(group: Group) -> torch.device:
    # NCCL moves only CUDA tensors; gloo (and a mixed cpu:gloo,cuda:nccl group) takes host ones.
    if dist.get_backend(group.process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
