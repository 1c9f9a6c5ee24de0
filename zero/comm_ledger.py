"""The communicator's volume ledger: per-collective records and bounded running totals.

Split from ``zero.comm`` (which runs the collectives): what was sent, in elements and bytes,
per operation, group, tag (the step) and phase, with its cross-node share (see ``zero.comm``,
[Note: intra-node and cross-node bytes]).
"""

from __future__ import annotations

import functools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from chunkmem.costs import Traffic
    from zero.topology import Topology


def elements_sent_per_rank(op: str, numel: int, size: int, *, exchange: bool = False) -> int:
    """Elements one member of a group of ``size`` sends in ``op`` of ``numel`` elements, under
    the algorithm model of :class:`CollectiveRecord` (a broadcast's root: ``numel``).
    ``exchange``: an all-reduce sent as one direct exchange (``zero.ring``), its whole tensor
    to every other member."""
    if size == 1:
        return 0
    if exchange:
        return (size - 1) * numel
    if op == "broadcast":
        return numel
    if op == "all_reduce":
        return 2 * numel * (size - 1) // size
    return numel * (size - 1) // size


def cross_node_elements(
    op: str,
    ranks: Sequence[int],
    me: int,
    topology: Topology | None,
    sent: int,
    *,
    exchange: bool = False,
) -> int:
    """How many of the ``sent`` elements global rank ``me`` of the group ``ranks`` sends to
    another node (see ``zero.comm``, [Note: intra-node and cross-node bytes]). ``exchange``:
    an equal share goes to every other member, as in an all-to-all."""
    if topology is None or len(ranks) == 1 or not sent:
        return 0
    if exchange or op == "all_to_all":
        away = sum(1 for peer in ranks if not topology.same_node(me, peer))
        return sent // (len(ranks) - 1) * away
    right = ranks[(ranks.index(me) + 1) % len(ranks)]
    return 0 if topology.same_node(me, right) else sent


def collective_traffic(
    op: str,
    numel: int,
    itemsize: int,
    topology: Topology,
    group_of: Callable[[int], Sequence[int]],
    phase: str,
) -> Traffic:
    """``op`` of ``numel`` elements as every rank issues it on its group (``group_of(rank)``,
    global ranks), recorded as the communicator records it: what each sends, and the
    cross-node share of each local rank (``chunkmem.costs``). With
    ``topology.host_all_reduces`` a small all-reduce is the direct exchange gloo sends."""

    from chunkmem.costs import Traffic
    from zero.ring import all_reduce_is_direct

    cross = []
    sent = 0
    for rank in range(topology.node_size):
        ranks = group_of(rank)
        exchange = (
            op == "all_reduce"
            and topology.host_all_reduces
            and all_reduce_is_direct(numel * itemsize, len(ranks))
        )
        sent = elements_sent_per_rank(op, numel, len(ranks), exchange=exchange)
        cross.append(
            cross_node_elements(op, ranks, rank, topology, sent, exchange=exchange) * itemsize
        )
    return Traffic(op, phase, sent * itemsize, tuple(cross))


@functools.cache
def dtype_name(dtype: torch.dtype | None) -> str:
    """A record's dtype name, one string per dtype (records are kept by the ten thousand)."""
    return "" if dtype is None else str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """One collective as this rank issued it, with the volume a ring algorithm sends per rank.

    ``elements_sent`` is theory, not a measurement: all_gather and reduce_scatter send
    ``numel * (n - 1) / n`` per rank, all_reduce ``2 * numel * (n - 1) / n`` (rounded down when
    ``numel`` is not a multiple of ``n``), broadcast ``numel`` from the root and 0 elsewhere,
    all_to_all ``numel * (n - 1) / n``. A group of one sends nothing. A barrier records 0
    elements and dtype ``""``. ``cross_node_bytes`` is the part of ``bytes_sent`` that goes to
    ranks on another node (see the note on intra-node and cross-node bytes).
    """

    op: str
    group: str
    numel: int
    elements_sent: int
    bytes_sent: int
    dtype: str
    tag: int
    cross_node_bytes: int = 0
    phase: str = ""

    @property
    def intra_node_bytes(self) -> int:
        return self.bytes_sent - self.cross_node_bytes


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
    # (op, group, phase) -> [calls, elements sent, bytes sent, cross-node bytes]
    _totals: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)
    _by_tag: OrderedDict[int, dict[tuple[str, str, str], list[int]]] = field(
        default_factory=OrderedDict
    )

    def add(self, record: CollectiveRecord) -> None:
        self.records.append(record)
        if len(self.records) > self.max_records:
            self.records.popleft()
            self.records_dropped += 1
        key = (record.op, record.group, record.phase)
        tag_totals = self._by_tag.get(record.tag)
        if tag_totals is None:
            tag_totals = self._by_tag[record.tag] = {}
            while len(self._by_tag) > self.max_tags:
                self._by_tag.popitem(last=False)
        for totals in (self._totals, tag_totals):
            row = totals.setdefault(key, [0, 0, 0, 0])
            row[0] += 1
            row[1] += record.elements_sent
            row[2] += record.bytes_sent
            row[3] += record.cross_node_bytes

    def _rows(self, tag: int | None) -> dict[tuple[str, str, str], list[int]]:
        if tag is None:
            return self._totals
        if tag in self._by_tag:
            return self._by_tag[tag]
        if self._by_tag and tag < next(iter(self._by_tag)):
            raise KeyError(
                f"tag {tag} left the ledger's window of the last {self.max_tags} tags; read a "
                f"step's volume while it is recent, or raise CommLedger.max_tags"
            )
        return {}

    def _sum(
        self,
        column: int,
        op: str | None,
        group: str | None,
        tag: int | None,
        phase: str | None = None,
    ) -> int:
        return sum(
            row[column]
            for (row_op, row_group, row_phase), row in self._rows(tag).items()
            if (op is None or row_op == op)
            and (group is None or row_group == group)
            and (phase is None or row_phase == phase)
        )

    def elements_sent(
        self, *, op: str | None = None, group: str | None = None, tag: int | None = None
    ) -> int:
        return self._sum(1, op, group, tag)

    def bytes_sent(
        self, *, op: str | None = None, group: str | None = None, tag: int | None = None
    ) -> int:
        return self._sum(2, op, group, tag)

    def cross_node_bytes(
        self,
        *,
        op: str | None = None,
        group: str | None = None,
        tag: int | None = None,
        phase: str | None = None,
    ) -> int:
        """Bytes this rank sent to ranks on other nodes."""
        return self._sum(3, op, group, tag, phase)

    def intra_node_bytes(
        self,
        *,
        op: str | None = None,
        group: str | None = None,
        tag: int | None = None,
        phase: str | None = None,
    ) -> int:
        """Bytes this rank sent to ranks on its own node."""
        return self._sum(2, op, group, tag, phase) - self._sum(3, op, group, tag, phase)

    def totals(self) -> dict[tuple[str, str], dict[str, int]]:
        """``(op, group) -> {"calls", "elements_sent", "bytes_sent"}`` over the whole run."""
        out: dict[tuple[str, str], dict[str, int]] = {}
        for (op, group, _phase), (calls, elements, nbytes, _cross) in self._totals.items():
            row = out.setdefault((op, group), {"calls": 0, "elements_sent": 0, "bytes_sent": 0})
            row["calls"] += calls
            row["elements_sent"] += elements
            row["bytes_sent"] += nbytes
        return out

    def by_phase(self, tag: int | None = None) -> dict[tuple[str, str], dict[str, int]]:
        """``(op, phase) -> {"calls", "intra_node_bytes", "cross_node_bytes"}`` (the whole run,
        or one tag)."""
        out: dict[tuple[str, str], dict[str, int]] = {}
        for (op, _group, phase), (calls, _elements, nbytes, cross) in self._rows(tag).items():
            row = out.setdefault(
                (op, phase), {"calls": 0, "intra_node_bytes": 0, "cross_node_bytes": 0}
            )
            row["calls"] += calls
            row["intra_node_bytes"] += nbytes - cross
            row["cross_node_bytes"] += cross
        return out
