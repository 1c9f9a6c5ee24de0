"""Which collective a rank is in: an identity every rank must agree on before data moves.

[Note: desynchronized ranks] A rank that catches an exception mid-cycle and carries on, or
skips a collective its peers issue, pairs its next collectives with its peers' earlier ones:
matched only by order, they exchange data from different steps without a word, or buffers of
different sizes, on which gloo aborts the process. So every collective carries an identity:
the engine's cycle number (every forward/backward/step cycle, aborted ones included), the
collective's sequence number in its group, the operation, the element count, the dtype and,
where the engine says so (``Communicator.about``), the layout it moves: ranks whose forwards
took different paths gather or reduce other layouts of one size at one point, which nothing
else would tell apart.

- Point-to-point rings send under a tag derived from the identity: messages of different
  collectives never match, so no data is mixed and no size can disagree.
- Builtin collectives (all_reduce, broadcast, barrier, object gathers) first all-gather the
  identities (a fixed-size message) and compare them on every rank.
- A rank whose wait times out asks its peers where they are, on a tag reserved for that, and
  the error names both sides.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

OPS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "all_gather_object",
    "barrier",
    "all_to_all",
)
_DTYPES = (
    None,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.bool,
)
FIELDS = 6  # int64 values per identity on the wire
DIAGNOSE_TAG = (1 << 31) - 1  # reserved for "where are you?" after a timeout
_TAG_MASK = (1 << 31) - 2  # ring tags stay below the reserved one


class MismatchError(RuntimeError):
    """Members of a group are at different collectives (a transport's agreement check)."""


@dataclass(frozen=True)
class CollectiveIdentity:
    cycle: int
    seq: int
    op: str
    numel: int
    dtype: torch.dtype | None
    subject: int = -1  # the layout it moves, or -1

    def encode(self) -> torch.Tensor:
        dtype_code = _DTYPES.index(self.dtype) if self.dtype in _DTYPES else len(_DTYPES)
        return torch.tensor(
            [self.cycle, self.seq, OPS.index(self.op), self.numel, dtype_code, self.subject],
            dtype=torch.int64,
        )

    @staticmethod
    def decode(values: torch.Tensor) -> CollectiveIdentity:
        cycle, seq, op, numel, dtype_code, subject = (int(v) for v in values.tolist())
        dtype = _DTYPES[dtype_code] if 0 <= dtype_code < len(_DTYPES) else None
        name = OPS[op] if 0 <= op < len(OPS) else "?"
        return CollectiveIdentity(cycle, seq, name, numel, dtype, subject)

    def tag(self) -> int:
        """The message tag of a ring with this identity (never the reserved diagnosis tag)."""
        return zlib.crc32(self.encode().numpy().tobytes()) & _TAG_MASK

    def describe(self) -> str:
        dtype = "" if self.dtype is None else f" of {str(self.dtype).removeprefix('torch.')}"
        subject = "" if self.subject < 0 else f", layout {self.subject}"
        return (
            f"collective #{self.seq} of cycle {self.cycle} ({self.op} of {self.numel:,} "
            f"elements{dtype}{subject})"
        )


def mismatch_message(
    mine: CollectiveIdentity, rank: int, theirs: dict[int, CollectiveIdentity | str | None]
) -> str | None:
    """Why the ranks are out of step, naming both sides; None when every rank agrees. A peer
    that gave no identity is ``None`` (silent) or a string saying why (its connection closed)."""
    differing = {r: t for r, t in theirs.items() if t != mine}
    if not differing:
        return None
    by_where: dict[str, list[int]] = {}
    for other, identity in sorted(differing.items()):
        if identity is None:
            where = "did not answer (dead, hung, or outside any collective)"
        elif isinstance(identity, str):
            where = identity
        else:
            where = f"is at {identity.describe()}"
        by_where.setdefault(where, []).append(other)
    parts = [
        f"rank {ranks[0]} {where}"
        if len(ranks) == 1
        else f"ranks {_compact(ranks)} {where.replace('is ', 'are ', 1) if where.startswith('is ') else where}"
        for where, ranks in by_where.items()
    ]
    other_layouts = all(
        isinstance(t, CollectiveIdentity) and replace(t, subject=mine.subject) == mine
        for t in differing.values()
    )
    why = (
        " The ranks are at one collective for different layouts: their forwards used different "
        "parameters (a branch their data decides). ZeRO stage 3 gathers the parameters each "
        "forward uses, so every rank must use the same ones in one order, as with FSDP: train "
        "at stage 1 or 2, or have every rank run every branch (times 0 where it is not taken)."
        if other_layouts
        else " A rank skipped or repeated collectives (e.g. it caught an exception and carried "
        "on with the next batch), or died; every rank must run the same cycles."
    )
    return (
        f"ranks are out of step: rank {rank} is at {mine.describe()}, but "
        + "; ".join(parts)
        + "."
        + why
    )


def _compact(ranks: list[int]) -> str:
    """``0-3, 6, 8-9``: a sorted rank list as runs (messages stay short at 512 ranks)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def diagnose(
    mine: CollectiveIdentity,
    ranks: tuple[int, ...],
    rank: int,
    process_group: object,
    timeout_s: float,
) -> dict[int, CollectiveIdentity | str | None]:
    """After a timeout: tell every peer where this rank is and hear where they are.

    A peer that timed out too answers at once; one whose connection is closed is reported as
    gone (its process died or exited); one that does not answer within ``timeout_s`` as
    silent. Fixed-size messages on a reserved tag, so nothing here can meet a payload of
    another collective.
    """
    peers = [r for r in ranks if r != rank]
    payload = mine.encode()
    received = {peer: torch.empty(FIELDS, dtype=torch.int64) for peer in peers}
    answers: dict[int, CollectiveIdentity | str | None] = dict.fromkeys(peers)
    sends, receives = [], []
    for peer in peers:
        try:  # a dead peer's connection may refuse even the posting
            sends.append(dist.isend(payload, peer, group=process_group, tag=DIAGNOSE_TAG))
            receives.append(
                (peer, dist.irecv(received[peer], peer, group=process_group, tag=DIAGNOSE_TAG))
            )
        except RuntimeError as error:
            answers[peer] = _gone(error)
    deadline = time.monotonic() + timeout_s
    for peer, work in receives:
        outcome = _finished(work, deadline)
        if outcome is True:
            answers[peer] = CollectiveIdentity.decode(received[peer])
        elif outcome is not None:
            answers[peer] = _gone(outcome)
    for work in sends:  # a send dropped unfinished may never reach the peer
        _finished(work, deadline)
    return answers


def _gone(error: RuntimeError) -> str | None:
    """What a failed exchange with a peer says of it: gone when the connection is closed."""
    text = str(error).lower()
    if "closed" in text or "reset" in text or "refused" in text or "broken pipe" in text:
        return "is gone (its connection closed: the process died or exited)"
    return None


def _finished(work: dist.Work, deadline: float) -> bool | RuntimeError | None:
    """True once done; the error if it failed; None if the deadline passed first."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    try:
        work.wait(timeout=timedelta(seconds=left))
    except RuntimeError as error:
        return None if "timed out" in str(error).lower() else error
    return True
