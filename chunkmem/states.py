"""Tensor states inside a chunk and the table of legal transitions between them.

A chunk may move between tiers only while every tensor in it is in a HOLD state (or FREE):
a tensor in COMPUTE is being read or written by an operator right now.
"""

from __future__ import annotations

from chunkmem._enum import FastHashEnum
from chunkmem.errors import IllegalTransitionError


class TensorState(FastHashEnum):
    """Where a tensor is in its life within one training iteration.

    FREE: the tensor has no payload yet (not packed, or its chunk was never allocated).
    COMPUTE: an operator is using it; its chunk is pinned on the compute device.
    HOLD: it holds valid data and no one is using it (between iterations).
    HOLD_AFTER_FWD: its module's forward finished; it will be needed again in backward.
    HOLD_AFTER_BWD: its module's backward finished; only the optimizer needs it now.
    """

    FREE = "free"
    COMPUTE = "compute"
    HOLD = "hold"
    HOLD_AFTER_FWD = "hold_after_fwd"
    HOLD_AFTER_BWD = "hold_after_bwd"


HOLD_STATES = frozenset({TensorState.HOLD, TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD})
MOVABLE_STATES = HOLD_STATES | {TensorState.FREE}

LEGAL_TRANSITIONS: dict[TensorState, frozenset[TensorState]] = {
    TensorState.FREE: frozenset({TensorState.HOLD, TensorState.COMPUTE}),
    TensorState.HOLD: frozenset({TensorState.COMPUTE, TensorState.FREE}),
    TensorState.COMPUTE: frozenset(
        {TensorState.HOLD, TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD}
    ),
    TensorState.HOLD_AFTER_FWD: frozenset({TensorState.COMPUTE, TensorState.HOLD}),
    TensorState.HOLD_AFTER_BWD: frozenset({TensorState.COMPUTE, TensorState.HOLD}),
}


def check_transition(tensor_name: str, old: TensorState, new: TensorState) -> None:
    """Raise if ``old -> new`` is not in the table; staying in the same state is always legal."""
    if old is not new and new not in LEGAL_TRANSITIONS[old]:
        allowed = sorted(state.name for state in LEGAL_TRANSITIONS[old])
        raise IllegalTransitionError(
            f"tensor {tensor_name!r} cannot go from {old.name} to {new.name}; "
            f"from {old.name} it may go to {allowed}"
        )
