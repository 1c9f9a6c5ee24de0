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


def addresses(
    chunk: Chunk, pieces: Sequence[Piece], within: torch.Tensor | None = None
) -> list[int]:
    """Where the pieces of ``chunk`` begin in memory: the data pointers of :func:`spans`'
    views, for a native call that takes rows by address (no view is made). ``within``, laid
    out like the payload, must have its dtype; every piece must lie inside the buffer."""
    payload = chunk.payload if within is None else within
    if payload is None:
        raise RuntimeError(f"{chunk!r} has no payload; it must be fetched before use")
    if within is not None and within.dtype != chunk.dtype:
        raise TypeError(f"a buffer laid out like {chunk!r} is {within.dtype}, not {chunk.dtype}")
    if payload.dim() != 1 or payload.stride(0) != 1:
        raise ValueError(f"{chunk!r}: rows by address need a flat contiguous buffer")
    base, itemsize, start, end = (
        payload.data_ptr(),
        payload.element_size(),
        chunk.start,
        payload.numel(),
    )
    rows = []
    for slot, lo, hi in pieces:
        begin = slot.offset + lo - start
        if begin < 0 or begin + hi - lo > end:
            raise IndexError(
                f"{slot.name}[{lo}:{hi}] lies outside {chunk!r}'s buffer of {end} elements"
            )
        rows.append(base + begin * itemsize)
    return rows


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
