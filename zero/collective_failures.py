"""What a communicator knows about its failed collectives: the first one, which ends the group.

[Note: a failed collective is final]
A collective that fails or times out raises `CollectiveError`. The group may be unusable after
that: with gloo an async error can surface again at the next collective on one rank only, while
its peers wait for a message that never comes, and an NCCL timeout aborts the communicators.
The engine must stop on the first `CollectiveError`; nothing here retries, and no other
algorithm is ever swapped in. :class:`FirstFailure` remembers the first failure (``error``):
every later wait, such as the cancel of the reductions still in flight, is bounded by
``AFTER_FAILURE_S`` instead of a timeout of its own, so a rank raises within its timeout plus
the short diagnosis (``zero.torch_transport.DIAGNOSIS_S``), however many collectives it had in
flight when a peer died.
"""

from __future__ import annotations

import time

from chunkmem.errors import CollectiveError
from zero.identity import CollectiveIdentity, MismatchError
from zero.process_group import Group
from zero.transport import Transport

# How long a wait lasts once a collective of this communicator has failed: enough for work
# that already completed to be collected, never a second timeout (see the note).
AFTER_FAILURE_S = 0.05


class FirstFailure:
    """One communicator's first failed collective, and the errors of those that fail after it."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport  # asked where the peers are when a collective fails
        self.error: CollectiveError | None = None

    def timeout_s(self, group: Group) -> float:
        """How long a wait in ``group`` may last: its timeout, or ``AFTER_FAILURE_S`` once
        any collective failed."""
        return group.timeout_s if self.error is None else AFTER_FAILURE_S

    def failed(
        self,
        op: str,
        group: Group,
        launched_at: float,
        identity: CollectiveIdentity | None,
        cause: RuntimeError,
    ) -> CollectiveError:
        """The error for collective ``op`` that raised ``cause``: the first failure is
        explained (a mismatch says where everyone is; anything else asks the peers) and
        remembered; a later one names the first."""
        if self.error is not None:
            reason = f"{cause}, after an earlier failure: {self.error}"
            return _error(op, group, launched_at, reason)
        error = _error(op, group, launched_at, self._explain(identity, group, cause))
        self.error = error
        return error

    def _explain(
        self, identity: CollectiveIdentity | None, group: Group, cause: RuntimeError
    ) -> str:
        if identity is None or isinstance(cause, MismatchError):
            return str(cause)
        return self._transport.explain(identity, group, str(cause))


def _error(op: str, group: Group, launched_at: float, cause: str) -> CollectiveError:
    return CollectiveError(
        op, group.name, group.ranks, time.monotonic() - launched_at, group.timeout_s, cause
    )
