"""What making one group's speculative update undoable takes (offload/speculation.py, [Note:
speculate, then commit or roll back]), derived from its pieces and home alone: which chunks the
update overwrites in place and copies first, how many elements of each dtype those copies take,
and the views and slots the host thread needs for them; a :class:`Plan` holds them from step
to step while the pieces stay the same."""

from __future__ import annotations

from typing import NamedTuple

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout
from chunkmem.pieces import Piece, owned_pieces
from chunkmem.tiers import StorageTier


class Target(NamedTuple):
    """A chunk kind and the pieces of it that the update overwrites, copied first; ``grads``:
    they are the gradients the update reads, which its kernel saves as it reads them."""

    kind: ChunkKind
    pieces: list[Piece]
    grads: bool = False


def copy_targets(
    layout: ChunkLayout,
    pieces: list[Piece],
    shadowed: frozenset[ChunkKind],
    divided_grads: ChunkKind | None = None,
) -> list[Target]:
    """What the update overwrites in place, copied first: the value (fp32 master, or the
    fp32 parameter) and moments not shadowed, the 16-bit slots holding gradients, which
    rounding the masters overwrites, and the fp32 gradients of ``divided_grads``' chunk,
    which the kernel leaves divided by the loss scale and world size (as torch does)."""
    value = ChunkKind.MASTER if ChunkKind.MASTER in layout.chunks else ChunkKind.PARAM
    targets = [
        Target(kind, pieces)
        for kind in (value, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)
        if kind not in shadowed
    ]
    in_slot = [p for p in pieces if p[0].grad_in_param_slot]
    if ChunkKind.MASTER in layout.chunks and in_slot:
        targets.append(Target(ChunkKind.PARAM, in_slot, grads=True))
    if divided_grads is not None:
        targets.append(Target(divided_grads, pieces, grads=True))
    return targets


def copy_elements(layout: ChunkLayout, targets: list[Target]) -> dict[torch.dtype, int]:
    """Elements of each dtype the copies of ``targets`` take."""
    needed: dict[torch.dtype, int] = {}
    for kind, pieces, _grads in targets:
        dtype = layout.chunks[kind].dtype
        needed[dtype] = needed.get(dtype, 0) + sum(hi - lo for _s, lo, hi in pieces)
    return needed


def _key(piece: Piece) -> tuple[int, int, int]:
    slot, lo, hi = piece
    return id(slot), lo, hi


class Plan:
    """What making one group's update undoable takes, derived from its pieces and home: kept
    from step to step while they stay the same (the same parameters have gradients: nearly
    always), so that reserving is a lookup on the engine's thread, not a walk of the pieces."""

    def __init__(
        self,
        layout: ChunkLayout,
        pieces: list[Piece],
        shadowed: frozenset[ChunkKind],
        divided_grads: ChunkKind | None,
        key: tuple[object, ...] = (),
    ) -> None:
        self.key = key  # what it was derived from (:meth:`key`)
        self.shadowed = shadowed
        self.targets = copy_targets(layout, pieces, shadowed, divided_grads)
        self.copies = copy_elements(layout, self.targets)
        self.saves_grads = any(target.grads for target in self.targets)
        self._layout = layout
        self._pieces = pieces
        self._dtypes = [layout.chunks[target.kind].dtype for target in self.targets]
        self._saved: list[tuple[Target, torch.Tensor]] = []
        self._saved_in: dict[torch.dtype, torch.Tensor] | None = None  # the buffers sliced
        self._grad_saves: list[torch.Tensor | None] | None = None  # cut from ``_saved``
        self._idle: dict[tuple[int, int], list[Piece]] = {}  # by a chunk's (start, numel)

    @staticmethod
    def key(
        pieces: list[Piece], home: StorageTier, divided_grads: ChunkKind | None
    ) -> tuple[object, ...]:
        """What the plan is derived from: the pieces, and whether each slot holds its gradient
        (which decides the 16-bit copies; a slot whose value was needed in backward stops
        holding it), the home and the gradients divided in place."""
        return (
            id(home),
            divided_grads,
            *((id(slot), lo, hi, slot.grad_in_param_slot) for slot, lo, hi in pieces),
        )

    def saved(self, copies: dict[torch.dtype, torch.Tensor]) -> list[tuple[Target, torch.Tensor]]:
        """Each target with its part of the copy buffer of its dtype in ``copies`` (a group's
        kept buffers, sized for the targets), sliced again only when those buffers change."""
        if self._saved_in is None or any(
            copies[dtype] is not buffer for dtype, buffer in self._saved_in.items()
        ):
            filled: dict[torch.dtype, int] = {}
            self._saved = []
            for target, dtype in zip(self.targets, self._dtypes, strict=True):
                start = filled.get(dtype, 0)
                filled[dtype] = start + sum(hi - lo for _s, lo, hi in target.pieces)
                self._saved.append((target, copies[dtype][start : filled[dtype]]))
            self._saved_in = {dtype: copies[dtype] for dtype in filled}
            self._grad_saves = None
        return self._saved

    def grad_saves(self) -> list[torch.Tensor | None]:
        """For each piece, its view of the copy buffer that saves gradients (None for a piece
        whose gradient is not saved), cut again only when :meth:`saved` slices anew: the
        update's thread builds the kernel calls from these, and its Python holds the GIL that
        backward's hooks wait for (docs/offload.md)."""
        if self._grad_saves is None:
            target, buffer = next((t, b) for t, b in self._saved if t.grads)
            sizes = [hi - lo for _s, lo, hi in target.pieces]
            saves = dict(zip(map(_key, target.pieces), torch.split(buffer, sizes), strict=True))
            self._grad_saves = [saves.get(_key(piece)) for piece in self._pieces]
        return self._grad_saves

    def idle(self, chunk: Chunk) -> list[Piece]:
        """The slots of ``chunk`` that these pieces leave out (every slot without a gradient
        in this step), which a shadow of it copies from the payload: found once per plan."""
        span = (chunk.start, chunk.numel)
        idle = self._idle.get(span)
        if idle is None:
            updated = {id(slot) for slot, _lo, _hi in self._pieces}
            every_slot = owned_pieces(self._layout, span, False)
            idle = self._idle[span] = [p for p in every_slot if id(p[0]) not in updated]
        return idle


def not_updated(chunk: Chunk, pieces: list[Piece]) -> list[tuple[int, int]]:
    """The ranges of ``chunk``'s payload, in its own coordinates, that ``pieces`` leave out."""
    covered = sorted(
        (slot.offset + lo - chunk.start, slot.offset + hi - chunk.start) for slot, lo, hi in pieces
    )
    gaps, position = [], 0
    for begin, end in covered:
        if begin > position:
            gaps.append((position, begin))
        position = max(position, end)
    if position < chunk.numel:
        gaps.append((position, chunk.numel))
    return gaps
