"""The tensor-state transition table and chunk movability derived from it."""

from __future__ import annotations

import itertools

import pytest
import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout
from chunkmem.errors import IllegalTransitionError
from chunkmem.states import LEGAL_TRANSITIONS, TensorState, check_transition

S = TensorState
EXPECTED_LEGAL = {
    (S.FREE, S.HOLD), (S.FREE, S.COMPUTE),
    (S.HOLD, S.COMPUTE), (S.HOLD, S.FREE),
    (S.COMPUTE, S.HOLD), (S.COMPUTE, S.HOLD_AFTER_FWD), (S.COMPUTE, S.HOLD_AFTER_BWD),
    (S.HOLD_AFTER_FWD, S.COMPUTE), (S.HOLD_AFTER_FWD, S.HOLD),
    (S.HOLD_AFTER_BWD, S.COMPUTE), (S.HOLD_AFTER_BWD, S.HOLD),
}  # fmt: skip


@pytest.mark.parametrize("old,new", list(itertools.product(S, S)))
def test_transition_table(old: TensorState, new: TensorState) -> None:
    legal = old is new or (old, new) in EXPECTED_LEGAL
    assert (new in LEGAL_TRANSITIONS[old] or old is new) == legal
    if legal:
        check_transition("w", old, new)
    else:
        with pytest.raises(
            IllegalTransitionError, match=f"'w' cannot go from {old.name} to {new.name}"
        ):
            check_transition("w", old, new)


def test_chunk_moves_only_when_every_tensor_holds() -> None:
    layout = ChunkLayout(0, 16, trainable=True)
    a = layout.add("a", torch.nn.Parameter(torch.zeros(4)))
    b = layout.add("b", torch.nn.Parameter(torch.zeros(4)))
    chunk = Chunk(0, layout, ChunkKind.PARAM, torch.float32)
    assert chunk.movable()  # both FREE
    a.set_state(S.COMPUTE)
    assert not chunk.movable()
    a.set_state(S.HOLD_AFTER_FWD)
    b.set_state(S.HOLD)
    assert chunk.movable()
    chunk.pins += 1
    assert not chunk.movable()
