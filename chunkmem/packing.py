"""Chunk geometry: the chunk-size search and the first-use-order packer.

Parameters go into the open chunk of their list in the order they are first used; one that
does not fit in what is left opens a new chunk (parameters never straddle chunks, so every
parameter is a plain view). A parameter larger than the chunk size gets a chunk of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from chunkmem.chunk import ChunkLayout, TensorSlot

_MIN_CHUNK_ELEMENTS = 1024
_ALIGNMENT_ELEMENTS = 64  # keeps every chunk a multiple of a cache line in every dtype


@dataclass(frozen=True)
class ChunkSizeChoice:
    """The searched chunk size and the padding it wastes on the size sequence it was given."""

    size: int
    padding_elements: int
    total_elements: int
    oversized_tensors: int
    candidates_tried: int

    @property
    def waste_fraction(self) -> float:
        return self.padding_elements / max(1, self.padding_elements + self.total_elements)


def padding_for(numels: Sequence[int], size: int) -> int:
    """Elements of padding that packing ``numels`` in order into chunks of ``size`` leaves.

    Oversized tensors get exact-fit chunks and waste nothing; the last chunk's unused tail
    counts as padding, as it is allocated like every other chunk.
    """
    padding = 0
    used = 0
    opened = False
    for numel in numels:
        if numel > size:
            continue
        if not opened or used + numel > size:
            if opened:
                padding += size - used
            used = 0
            opened = True
        used += numel
    if opened:
        padding += size - used
    return padding


def search_chunk_size(
    numels: Sequence[int],
    max_size: int,
    alignment: int = _ALIGNMENT_ELEMENTS,
    min_size: int | None = None,
) -> ChunkSizeChoice:
    """The chunk size in ``[min_size, max_size]`` that wastes the least padding.

    ``min_size`` defaults to the largest tensor that fits under ``max_size``; a smaller one
    lets outliers (an embedding) take chunks of their own instead of setting the size.

    Candidates are every multiple of ``alignment`` in range when there are few of them, else a
    dense geometric sweep plus the exact sizes of runs of consecutive tensors (where padding is
    zero by construction). Ties go to the larger size: fewer chunks, fewer moves.
    """
    if not numels:
        return ChunkSizeChoice(_MIN_CHUNK_ELEMENTS, 0, 0, 0, 0)
    max_size = max(_round_up(max_size, alignment), alignment)
    total = sum(numels)
    fitting = [n for n in numels if n <= max_size]
    smallest = max(fitting, default=1) if min_size is None else min_size
    low = max(_round_up(smallest, alignment), _MIN_CHUNK_ELEMENTS)
    low = min(low, max_size)
    candidates = _candidates(fitting, low, max_size, alignment)
    best: tuple[int, int] | None = None  # (padding, -size)
    for size in candidates:
        key = (padding_for(numels, size), -size)
        if best is None or key < best:
            best = key
    assert best is not None
    size = -best[1]
    oversized = sum(1 for n in numels if n > size)
    return ChunkSizeChoice(size, best[0], total, oversized, len(candidates))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _candidates(numels: Sequence[int], low: int, high: int, alignment: int) -> list[int]:
    steps = (high - low) // alignment + 1
    if steps <= 4096:
        return list(range(low, high + 1, alignment))
    sizes = set()
    size = float(low)
    while size <= high:
        sizes.add(_round_up(int(size), alignment))
        size *= 1.002
    # Sizes that exactly hold a run of consecutive tensors pack that run without padding.
    for start in range(min(len(numels), 64)):
        run = 0
        for numel in numels[start:]:
            run += numel
            if run > high:
                break
            if run >= low and run % alignment == 0:
                sizes.add(run)
    return sorted(s for s in sizes if low <= s <= high)


class Packer:
    """Appends parameters to a chunk list in the order it is given them."""

    def __init__(
        self,
        chunk_size: int,
        trainable: bool,
        new_layout_index: Callable[[], int],
        alignment: int = 1,
    ) -> None:
        if chunk_size % alignment:
            raise ValueError(f"chunk size {chunk_size} is not a multiple of {alignment}")
        self.alignment = alignment
        self.chunk_size = chunk_size
        self.trainable = trainable
        self._new_layout_index = new_layout_index
        self.layouts: list[ChunkLayout] = []
        self._open: ChunkLayout | None = None

    def place(self, name: str, param: torch.nn.Parameter) -> tuple[TensorSlot, ChunkLayout, bool]:
        """Add ``param``; returns its slot, its layout and whether the layout is new."""
        numel = param.numel()
        if numel > self.chunk_size:
            capacity = _round_up(numel, self.alignment)  # shards of equal size need this
            layout = ChunkLayout(self._new_layout_index(), capacity, self.trainable)
            self.layouts.append(layout)
            return layout.add(name, param), layout, True
        created = False
        if self._open is None or not self._open.fits(numel):
            self._open = ChunkLayout(self._new_layout_index(), self.chunk_size, self.trainable)
            self.layouts.append(self._open)
            created = True
        return self._open.add(name, param), self._open, created
