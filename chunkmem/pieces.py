"""Which elements of a layout an update touches: pieces of slots, as ranges of their flat
elements, and their views in a chunk."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chunkmem.chunk import Chunk, ChunkLayout, TensorSlot

Piece = tuple[TensorSlot, int, int]  # a slot and a range of its flat elements


def owned_pieces(
    layout: ChunkLayout, span: tuple[int, int], with_grads_only: bool = True
) -> list[Piece]:
    """The parts of slots (with gradients, unless not ``with_grads_only``) that fall in
    ``span`` = (start, numel)."""
    start, numel = span
    pieces = []
    for slot in layout.slots:
        if with_grads_only and not slot.has_grad:
            continue
        lo = max(0, start - slot.offset)
        hi = min(slot.numel, start + numel - slot.offset)
        if lo < hi:
            pieces.append((slot, lo, hi))
    return pieces


def spans(
    chunk: Chunk, pieces: Sequence[Piece], within: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """The pieces of ``chunk`` (of ``within``, laid out like its payload, where given)."""
    return [chunk.span(slot, lo, hi, within) for slot, lo, hi in pieces]


def cut(pieces: Sequence[Piece], limit: int) -> list[list[Piece]]:
    """``pieces`` in batches of at most ``limit`` elements; a longer piece is cut (Adam is
    elementwise, so any cut is exact)."""
    batches: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for slot, lo, hi in pieces:
        while lo < hi:
            take = min(hi - lo, limit - size)
            current.append((slot, lo, lo + take))
            size += take
            lo += take
            if size == limit:
                batches.append(current)
                current, size = [], 0
    if current:
        batches.append(current)
    return batches
