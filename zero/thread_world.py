"""An in-process world: N ranks as threads of one process, meeting in collectives in memory.

For tests and experiments on one machine. Every rank gets a :class:`zero.comm.Communicator`
whose transport is a :class:`ThreadTransport`: the same validation, identities, volume ledger
and timeouts as over torch.distributed, with no process to start and no socket to open, so
the seams (gathers, reductions, layout life cycles, compressors) run on 2-8 ranks in
milliseconds. ``chunkmem.initialize(model, config=..., comm=comm)`` trains on it.

[Note: the same bits as the gloo rings] A reduce-scatter sums rank ``r``'s segment in the
order the ring of ``zero.ring`` does: starting at rank ``r + 1`` and adding each next rank's
segment to the running sum, ending with rank ``r`` itself, one rounding per addition in the
buffer's dtype. Gathers, broadcasts and all-to-alls copy. So a gradient reduced here equals
the one reduced over gloo bit for bit, at any world size. ``all_reduce`` sums in rank order
(gloo's own algorithm may associate differently; the engine uses it only for the norm and a
count).

[Note: a collective is a meeting] Launching deposits a copy of this rank's input under the
collective's (group, sequence number); the wait blocks until every member of the group has
deposited, checks that all are at the same identity, and writes this rank's output from the
copies. Inputs are read at launch and outputs written at the wait, which is what the
communicator's contract allows a transport. A member that never comes (its thread raised or
ended) makes the others time out at the group's timeout, and the error says which members
were missing and whether their thread has ended.

What may differ from gloo ranks is timing, and so what the engine decides by it: a collective
here is complete once every member has deposited, which waits for the peers' threads to get
the GIL, so reductions and prefetched gathers retire at other moments and a device peak can
differ (never a value, a byte on the wire or a model-state byte count). Peaks are measured on
gloo ranks (``tests/test_estimate.py``).

Threads share the process's global state: torch's random generator (build each rank's model
under :meth:`ThreadWorld.serial` after seeding), its thread count, and the GIL.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from chunkmem.errors import ChunkmemError
from zero.comm import Communicator
from zero.identity import CollectiveIdentity, MismatchError, mismatch_message
from zero.process_group import WORLD, Group, check_group_ranks
from zero.ring import host_all_reduce_path

_REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


class RanksFailed(ChunkmemError):
    """Ranks of a :meth:`ThreadWorld.run` raised (or outlived its deadline); ``errors`` maps
    each failed rank to its exception (None: still running at the deadline)."""

    def __init__(self, errors: dict[int, BaseException | None], tracebacks: dict[int, str]):
        self.errors = errors
        parts = [
            f"rank {rank} raised:\n{tracebacks[rank]}"
            if error is not None
            else f"rank {rank} was still running at the deadline"
            for rank, error in sorted(errors.items())
        ]
        super().__init__("\n\n".join(parts))


@dataclass
class _Meeting:
    """One collective of one group: what each member deposited, and who has read."""

    members: int
    deposits: dict[int, tuple[CollectiveIdentity, Any]] = field(default_factory=dict)
    finished: int = 0


class ThreadWorld:
    """``size`` ranks of one process; :meth:`communicator` gives rank ``r``'s communicator and
    :meth:`run` runs a function on every rank, each on its own thread."""

    def __init__(self, size: int, timeout_s: float = 30.0) -> None:
        if size < 1:
            raise ValueError(f"a world needs at least one rank, got size={size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.size = size
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._meetings: dict[tuple[str, int], _Meeting] = {}
        self._at: dict[int, CollectiveIdentity] = {}  # global rank -> its latest collective
        self._ended: set[int] = set()  # ranks whose thread of run() has ended
        self._serial = threading.RLock()

    def communicator(self, rank: int) -> Communicator:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a world of {self.size}")
        world = Group(WORLD, tuple(range(self.size)), WORLD, rank, self.size, self.timeout_s)
        return Communicator(world, transport=ThreadTransport(self, rank))

    @contextlib.contextmanager
    def serial(self) -> Iterator[None]:
        """One rank at a time in the block (seeding and building a model: torch's random
        generator is one for the whole process)."""
        with self._serial:
            yield

    def run(self, fn: Callable[..., Any], *args: Any, deadline_s: float = 120.0) -> list[Any]:
        """``fn(comm, *args)`` on every rank, each on its own thread; their return values in
        rank order. Raises :class:`RanksFailed` naming every rank that raised."""
        results: list[Any] = [None] * self.size
        errors: dict[int, BaseException | None] = {}
        tracebacks: dict[int, str] = {}

        def main(rank: int) -> None:
            try:
                results[rank] = fn(self.communicator(rank), *args)
            except BaseException as error:  # noqa: BLE001 - reported by run()
                errors[rank] = error
                tracebacks[rank] = traceback.format_exc()
            finally:
                with self._cond:
                    self._ended.add(rank)
                    self._cond.notify_all()

        threads = [
            threading.Thread(target=main, args=(rank,), name=f"rank-{rank}", daemon=True)
            for rank in range(self.size)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + deadline_s
        for rank, thread in enumerate(threads):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                errors.setdefault(rank, None)
        if errors:
            raise RanksFailed(errors, tracebacks)
        return results

    # ------------------------------------------------------------------ meetings
    def deposit(self, group: Group, identity: CollectiveIdentity, payload: Any) -> _Meeting:
        key = (group.name, identity.seq)
        me = group.ranks[group.rank]
        with self._cond:
            meeting = self._meetings.get(key)
            if meeting is None:
                meeting = self._meetings[key] = _Meeting(group.size)
            meeting.deposits[group.rank] = (identity, payload)
            self._at[me] = identity
            self._cond.notify_all()
        return meeting

    def gather(
        self, meeting: _Meeting, group: Group, identity: CollectiveIdentity, timeout_s: float
    ) -> list[Any]:
        """Every member's payload, in group-rank order, once all deposited (or raise)."""
        with self._cond:
            complete = self._cond.wait_for(
                lambda: len(meeting.deposits) == meeting.members, timeout=timeout_s
            )
            if not complete:
                raise RuntimeError(
                    f"timed out after {timeout_s:g} s waiting for group ranks "
                    f"{sorted(set(range(meeting.members)) - set(meeting.deposits))}"
                )
            theirs = {
                group.ranks[position]: deposit[0] for position, deposit in meeting.deposits.items()
            }
            payloads = [meeting.deposits[position][1] for position in range(meeting.members)]
            meeting.finished += 1
            if meeting.finished == meeting.members:
                del self._meetings[(group.name, identity.seq)]
        problem = mismatch_message(identity, group.ranks[group.rank], theirs)
        if problem is not None:
            raise MismatchError(problem)
        return payloads

    def where(self, group: Group, identity: CollectiveIdentity, cause: str) -> str:
        """After a failed wait: each other member's latest collective, or that it ended."""
        me = group.ranks[group.rank]
        with self._cond:
            parts = []
            for peer in group.ranks:
                if peer == me:
                    continue
                if peer in self._ended:
                    parts.append(f"rank {peer}'s thread has ended (it raised or returned)")
                elif self._at.get(peer) != identity:
                    at = self._at.get(peer)
                    parts.append(
                        f"rank {peer} is at "
                        + ("no collective yet" if at is None else at.describe())
                    )
        if not parts:
            return f"{cause} (every peer is at the same {identity.describe()})"
        return f"{cause}; rank {me} is at {identity.describe()}, but " + "; ".join(parts)


class _ThreadWork:
    """A launched collective of the thread world; ``finish`` writes this rank's output."""

    def __init__(
        self,
        world: ThreadWorld,
        meeting: _Meeting,
        group: Group,
        identity: CollectiveIdentity,
        finish: Callable[[list[Any]], None],
    ) -> None:
        self._world = world
        self._meeting = meeting
        self._group = group
        self._identity = identity
        self._finish: Callable[[list[Any]], None] | None = finish

    def wait(self, timeout: timedelta) -> bool:
        finish, self._finish = self._finish, None
        if finish is not None:
            payloads = self._world.gather(
                self._meeting, self._group, self._identity, timeout.total_seconds()
            )
            finish(payloads)
        return True

    def is_completed(self) -> bool:
        return self._finish is None or len(self._meeting.deposits) == self._meeting.members


class ThreadTransport:
    """Rank ``rank``'s side of a :class:`ThreadWorld` (a :class:`zero.comm.Transport`)."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world = world
        self.rank = rank

    def create_group(self, world: Group, name: str, ranks: Sequence[int]) -> Group:
        ranks = check_group_ranks(world, name, ranks)
        me = self.rank
        return Group(
            name=name,
            ranks=ranks,
            process_group=name,
            rank=ranks.index(me) if me in ranks else -1,
            size=len(ranks),
            timeout_s=world.timeout_s,
        )

    def check_sendable(self, op: str, name: str, tensor: Tensor, group: Group) -> None:
        return None  # memory carries every dtype

    def all_reduce_path(self, tensor: Tensor, op: str, group: Group) -> str:
        """The path gloo would take, so the ledger counts what a gloo world sends."""
        return host_all_reduce_path(tensor, op, group.size)

    def checkpoint_group(self) -> object:
        raise ChunkmemError(
            "checkpoints go through torch.distributed.checkpoint, which needs torch.distributed "
            "process groups; a ThreadWorld has none. Save from ranks launched as processes "
            "(torchrun, or tests.distributed_helpers.run_ranks)"
        )

    def _launch(
        self,
        group: Group,
        identity: CollectiveIdentity,
        payload: Any,
        finish: Callable[[list[Any]], None],
    ) -> _ThreadWork:
        meeting = self.world.deposit(group, identity, payload)
        return _ThreadWork(self.world, meeting, group, identity, finish)

    def all_gather(
        self, full: Tensor, shard: Tensor, group: Group, identity: CollectiveIdentity
    ) -> _ThreadWork:
        n = shard.numel()

        def finish(shards: list[Tensor]) -> None:
            for position, part in enumerate(shards):
                full[position * n : (position + 1) * n].copy_(part)

        return self._launch(group, identity, shard.clone(), finish)

    def reduce_scatter(
        self, full: Tensor, shard: Tensor, group: Group, identity: CollectiveIdentity
    ) -> _ThreadWork:
        n, size, me = shard.numel(), group.size, group.rank

        def finish(fulls: list[Tensor]) -> None:
            # The ring's order (the module note): rank me+1 first, rank me last.
            segment = slice(me * n, (me + 1) * n)
            total = fulls[(me + 1) % size][segment]
            for step in range(2, size + 1):
                total = torch.add(fulls[(me + step) % size][segment], total)
            shard.copy_(total)

        return self._launch(group, identity, full.clone(), finish)

    def all_reduce(
        self, tensor: Tensor, op: str, group: Group, identity: CollectiveIdentity
    ) -> _ThreadWork:
        combine = _REDUCE[op]

        def finish(tensors: list[Tensor]) -> None:
            total = tensors[0]
            for other in tensors[1:]:
                total = combine(total, other)
            tensor.copy_(total)

        return self._launch(group, identity, tensor.clone(), finish)

    def broadcast(
        self, tensor: Tensor, src: int, group: Group, identity: CollectiveIdentity
    ) -> _ThreadWork:
        payload = tensor.clone() if group.rank == src else None
        return self._launch(group, identity, payload, lambda tensors: tensor.copy_(tensors[src]))

    def all_to_all(
        self,
        send: list[Tensor],
        received: list[Tensor],
        group: Group,
        identity: CollectiveIdentity,
    ) -> _ThreadWork:
        size, me = group.size, group.rank

        def finish(sent: list[list[Tensor]]) -> None:
            for index, into in enumerate(received):
                n = into.numel() // size
                for peer in range(size):
                    into[peer * n : (peer + 1) * n].copy_(sent[peer][index][me * n : (me + 1) * n])

        return self._launch(group, identity, [t.clone() for t in send], finish)

    def gather_bytes(
        self, payload: bytes, group: Group, identity: CollectiveIdentity, timeout: timedelta
    ) -> list[bytes]:
        meeting = self.world.deposit(group, identity, payload)
        return self.world.gather(meeting, group, identity, timeout.total_seconds())

    def agree(self, identity: CollectiveIdentity, group: Group, timeout: timedelta) -> None:
        self.gather_bytes(b"", group, identity, timeout)

    def explain(self, identity: CollectiveIdentity, group: Group, cause: str) -> str:
        return self.world.where(group, identity, cause)
