"""Ring all-gather, reduce-scatter and sum all-reduce over point-to-point sends, for gloo.

[Note: why a ring on gloo] gloo's own ``all_gather_single``/``reduce_scatter_single`` are 2-3x
slower than exchanging the same bytes with ``isend``/``irecv`` on this machine (64 MiB fp32,
2 ranks: reduce-scatter 117 ms, all-gather 81 ms; the point-to-point ring 39 ms each). The
ring is the bandwidth-optimal algorithm both collectives are defined by: n-1 steps, each rank
sending one n-th of the buffer per step to its right neighbour, so the volume matches the
ledger's ``numel * (n-1) / n`` exactly. NCCL keeps its native collectives.

gloo's point-to-point messages read and write host memory through raw pointers (its send and
recv do not stage device tensors, unlike its collectives), so rings over CUDA tensors run on
host copies (`HostStagedRing`): the CUDA path is NCCL's, and gloo with CUDA tensors is for
testing several ranks on one GPU.

A launched ring issues its first step at once (with 2 ranks that is the whole exchange, so it
overlaps with whatever the caller does next); further steps run in ``wait``. Each ring sends
under its own tag: with several rings in flight, ranks may finish them in different orders,
and untagged messages between the same pair would be matched to the wrong ring.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from zero.identity import DIAGNOSE_TAG


def second_tag(tag: int) -> int:
    """The tag of a collective's second message stream: identity tags are even and below
    DIAGNOSE_TAG (the largest int32), so the odd tag beside one is free, except next to it."""
    return tag + 1 if tag + 1 != DIAGNOSE_TAG else tag - 1


# [Note: a direct all-reduce or a ring] A ring all-reduce takes 2(n-1) latency rounds and
# sends 2 numel (n-1)/n elements per rank; a direct exchange (every rank sends its tensor to
# every other) takes one round and sends (n-1) numel. The direct one costs
# numel (n-1)(n-2)/n extra elements (none on 2 ranks) and saves 2n-3 rounds, so it wins while
# those extra bytes take less time than the rounds: under about (2n-3) x latency x bandwidth.
# That product is about 30 KB on a 1 Gbit/s LAN with 50 us rounds and several hundred KB on
# the emulated cluster's 3 ms rounds (and on processes that share cores, where each round
# waits for a peer to be scheduled); the budget sits between. PowerSGD's P and Q (60-80 KB on
# 4 ranks) moved from rings to direct exchanges: its backward went from 186 to 144 ms here.
DIRECT_ALL_REDUCE_MIN_BYTES = 16 * 1024  # always direct up to this (a norm, a flag)
DIRECT_ALL_REDUCE_EXTRA_BYTES = 192 * 1024  # what a direct exchange may send beyond a ring
DIRECT_ALL_REDUCE_MAX_BYTES = 1024 * 1024  # never direct above (n-1 receive buffers)


def all_reduce_is_direct(nbytes: int, size: int) -> bool:
    """Whether a host all-reduce of ``nbytes`` over ``size`` gloo ranks is one direct exchange
    (see [Note: a direct all-reduce or a ring])."""
    if size == 1:
        return False
    extra = nbytes * (size - 1) * (size - 2) // size
    return nbytes <= DIRECT_ALL_REDUCE_MIN_BYTES or (
        nbytes <= DIRECT_ALL_REDUCE_MAX_BYTES and extra <= DIRECT_ALL_REDUCE_EXTRA_BYTES
    )


def host_all_reduce_path(tensor: torch.Tensor, op: str, size: int) -> str:
    """How a host all-reduce over ``size`` gloo ranks travels: ``direct`` (any op), ``ring``
    (a larger float sum that splits evenly) or ``builtin`` (the rest: a large max or min, an
    uneven size, bool)."""
    if size == 1 or tensor.dtype == torch.bool:
        return "builtin"
    if all_reduce_is_direct(tensor.numel() * tensor.element_size(), size):
        return "direct"
    if op == "sum" and tensor.dtype.is_floating_point and tensor.numel() % size == 0:
        return "ring"
    return "builtin"


def wait_all(works: list, timeout: timedelta, what: str) -> None:
    """Wait for every point-to-point work within ``timeout`` in total."""
    deadline = time.monotonic() + timeout.total_seconds()
    for work in works:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{what} did not finish in time")
        work.wait(timeout=timedelta(seconds=left))


class ReceiveBuffers:
    """Receive buffers of finished reduce-scatter rings, kept for the next ring of the same
    shape (a few per shape; ranks of an in-process world share them, so under a lock).

    [Note: reusing receive buffers] A ring allocated a fresh shard-sized buffer per
    reduce-scatter. Shards of the demo's chunks are about 130 KB, right at glibc's dynamic mmap
    threshold: after the first such buffer is freed the threshold rises and later ones come
    from the heap, which fragments, and the RSS of a long ZeRO-2 run grew in steps (1-3 MB over
    10,000 steps; docs/benchmarks.md#soak). A buffer is handed back only by a ring that
    finished: after a failure a receive may still be writing into it.
    """

    KEEP_PER_SHAPE = 4

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple:
        return tensor.numel(), tensor.dtype, tensor.device

    def take(self, like: torch.Tensor) -> torch.Tensor:
        with self._lock:
            kept = self._free.get(self._key(like))
            if kept:
                return kept.pop()
        return torch.empty_like(like)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            kept = self._free.setdefault(self._key(buffer), [])
            if len(kept) < self.KEEP_PER_SHAPE:
                kept.append(buffer)


RECEIVE_BUFFERS = ReceiveBuffers()


class RingWork:
    """A ring collective in flight; ``wait(timeout)`` finishes it like a torch ``Work``."""

    def __init__(
        self,
        full: torch.Tensor,
        shard: torch.Tensor,
        ranks: tuple[int, ...],
        rank: int,
        process_group: object,
        reduce: bool,
        tag: int,
    ) -> None:
        self._full = full
        self._shard = shard
        self._ranks = ranks
        self._rank = rank
        self._group = process_group
        self._reduce = reduce
        self._tag = tag
        size = len(ranks)
        self._n = shard.numel()
        self._step = 0
        self._steps = size - 1
        self._received = RECEIVE_BUFFERS.take(shard) if reduce and self._steps else None
        # Reduce-scatter accumulates into a copy of this rank's segments, never into ``full``.
        self._accumulated = full.clone() if reduce and size > 2 else None
        if not reduce:
            own = self._segment(full, rank)
            if own.data_ptr() != shard.data_ptr():
                own.copy_(shard)
        self._works = self._launch_step() if self._steps else []

    def _segment(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        index %= len(self._ranks)
        return tensor[index * self._n : (index + 1) * self._n]

    def _launch_step(self) -> list:
        size, rank, step = len(self._ranks), self._rank, self._step
        right, left = self._ranks[(rank + 1) % size], self._ranks[(rank - 1) % size]
        if self._reduce:
            source = self._full if self._accumulated is None else self._accumulated
            send, receive = self._segment(source, rank - step - 1), self._received
        else:
            send = self._segment(self._full, rank - step)
            receive = self._segment(self._full, rank - step - 1)
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send.contiguous(), right, self._group, self._tag),
                dist.P2POp(dist.irecv, receive, left, self._group, self._tag),
            ]
        )

    def _finish_step(self, deadline: float) -> None:
        for work in self._works:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"ring step {self._step + 1} of {self._steps} did not finish in time"
                )
            work.wait(timeout=timedelta(seconds=left))
        if self._reduce:
            index = self._rank - self._step - 2
            target = (
                self._shard
                if self._step == self._steps - 1
                else self._segment(self._accumulated, index)
            )
            torch.add(self._segment(self._full, index), self._received, out=target)
            if self._step == self._steps - 1:
                RECEIVE_BUFFERS.give_back(self._received)
                self._received = None
        self._step += 1
        self._works = self._launch_step() if self._step < self._steps else []

    def wait(self, timeout: timedelta) -> bool:
        """Finish every remaining step within ``timeout`` in total, not per step: a peer that
        dies mid-ring must not stretch the wait to one timeout per step."""
        deadline = time.monotonic() + timeout.total_seconds()
        while self._step < self._steps:
            self._finish_step(deadline)
        if self._reduce and self._steps == 0:
            self._shard.copy_(self._full)
        return True

    def is_completed(self) -> bool:
        """True once ``wait`` would not block: the last step's messages arrived. Earlier steps
        done are not enough, since the next ones are launched only in ``wait``."""
        if self._step >= self._steps:
            return True
        return self._step == self._steps - 1 and all(w.is_completed() for w in self._works)


class HostStagedRing:
    """A ring over host copies of device tensors: the input is copied to the host at launch
    (after the work queued on the current stream), the result back to the device in ``wait``
    (on the stream current there)."""

    def __init__(
        self,
        full: torch.Tensor,
        shard: torch.Tensor,
        ranks: tuple[int, ...],
        rank: int,
        process_group: object,
        reduce: bool,
        tag: int,
    ) -> None:
        self._target = shard if reduce else full
        host_full = full.cpu()
        host_shard = torch.empty_like(shard, device="cpu") if reduce else shard.cpu()
        self._result = host_shard if reduce else host_full
        self._ring = RingWork(host_full, host_shard, ranks, rank, process_group, reduce, tag)

    def wait(self, timeout: timedelta) -> bool:
        self._ring.wait(timeout)
        self._target.copy_(self._result)
        return True

    def is_completed(self) -> bool:
        return self._ring.is_completed()


class RingAllReduceWork:
    """A sum all-reduce as a reduce-scatter ring then an all-gather ring over the same
    segments: the ring all-reduce, ``2 * numel * (n-1) / n`` elements per rank as the ledger
    models it, without the builtin's agreement round (see zero.torch_transport). Every rank
    ends with the same bits: each segment is summed once, by one ring order, then copied.
    The all-gather travels under the odd tag next to ``tag`` (as AllToAllWork's second
    buffer), so its messages never match the reduce-scatter's."""

    def __init__(
        self,
        tensor: torch.Tensor,
        ranks: tuple[int, ...],
        rank: int,
        process_group: object,
        tag: int,
    ) -> None:
        self._tensor, self._ranks, self._rank, self._group = tensor, ranks, rank, process_group
        self._gather_tag = second_tag(tag)
        self._shard = torch.empty(tensor.numel() // len(ranks), dtype=tensor.dtype)
        self._reduce: RingWork | None = RingWork(
            tensor, self._shard, ranks, rank, process_group, True, tag
        )
        self._done = False

    def wait(self, timeout: timedelta) -> bool:
        """Both rings within ``timeout`` in total."""
        deadline = time.monotonic() + timeout.total_seconds()
        if self._reduce is not None:
            self._reduce.wait(timeout)
            self._reduce = None
            left = max(0.0, deadline - time.monotonic())
            gather = RingWork(
                self._tensor, self._shard, self._ranks, self._rank, self._group, False,
                self._gather_tag,
            )  # fmt: skip
            gather.wait(timedelta(seconds=left))
            self._done = True
        return True

    def is_completed(self) -> bool:
        """True once waited: the all-gather is launched only in ``wait``."""
        return self._done


class DirectAllReduceWork:
    """A small all-reduce as one exchange: every rank sends its whole tensor to every other
    under ``tag`` and reduces the ``n`` of them in rank order, so every rank computes the same
    bits. One round trip, where the builtin needs its agreement round and then its own
    rounds: for a norm, a flag or PowerSGD's factors, latency is most of what there is. It
    sends ``(n-1) numel`` elements, which the ledger counts (see ``host_all_reduce_path``)."""

    _REDUCE = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}

    def __init__(
        self,
        tensor: torch.Tensor,
        op: str,
        ranks: tuple[int, ...],
        rank: int,
        process_group: object,
        tag: int,
    ) -> None:
        self._tensor, self._op = tensor, op
        self._everyone = torch.empty(len(ranks), tensor.numel(), dtype=tensor.dtype)
        self._everyone[rank].copy_(tensor)  # the communicator passes flat tensors only
        ops = []
        for position, peer in enumerate(ranks):
            if position == rank:
                continue
            ops.append(dist.P2POp(dist.isend, self._everyone[rank], peer, process_group, tag))
            ops.append(dist.P2POp(dist.irecv, self._everyone[position], peer, process_group, tag))
        self._works = dist.batch_isend_irecv(ops)
        self._done = False

    def wait(self, timeout: timedelta) -> bool:
        wait_all(self._works, timeout, "all_reduce exchange")
        self._works = []
        if not self._done:
            reduced = self._REDUCE[self._op](self._everyone, dim=0)
            self._tensor.copy_(reduced)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class AllToAllWork:
    """An equal-split all-to-all over point-to-point messages; ``wait(timeout)`` finishes it like
    a torch ``Work``. Every buffer is cut into one block per rank; all messages are posted at
    launch. The first buffer travels under ``tag`` (a collective identity's tag, always even),
    the second under an odd tag next to it that no ring or identity uses. Device tensors travel
    as host copies (see the module note), copied back in ``wait``."""

    def __init__(
        self,
        send: list[torch.Tensor],
        received: list[torch.Tensor],
        ranks: tuple[int, ...],
        rank: int,
        process_group: object,
        tag: int,
    ) -> None:
        size = len(ranks)
        staged = send[0].device.type != "cpu"
        self._targets = received if staged else []
        if staged:
            send = [t.cpu() for t in send]
            received = [torch.empty_like(t, device="cpu") for t in received]
        self._received = received
        ops = []
        tags = [tag, second_tag(tag)]
        for index, (out, into) in enumerate(zip(send, received, strict=True)):
            n = out.numel() // size
            into[rank * n : (rank + 1) * n].copy_(out[rank * n : (rank + 1) * n])
            for peer in range(size):
                if peer == rank:
                    continue
                block = slice(peer * n, (peer + 1) * n)
                ops.append(
                    dist.P2POp(dist.isend, out[block], ranks[peer], process_group, tags[index])
                )
                ops.append(
                    dist.P2POp(dist.irecv, into[block], ranks[peer], process_group, tags[index])
                )
        self._works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self, timeout: timedelta) -> bool:
        wait_all(self._works, timeout, "all_to_all")
        self._works = []
        for target, host in zip(self._targets, self._received, strict=False):
            target.copy_(host)
        self._targets = []
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)
