"""The engine's chunks seen per parameter: which boxes of which parameter this rank writes
and reads, and where each box lives in a chunk.

A checkpoint stores every tensor under its parameter's name, in the parameter's shape, so
chunk sizes, padding and world sizes may differ between the run that saved and the run that
loads. A rank's part of a parameter is the flat range ``[lo, hi)`` of it that falls in one
span of the layout; that range is cut row-major into boxes (:func:`row_major_boxes`), each a
contiguous run of the chunk, so writing and reading never copy more than one box.

Keys (all in the parameter's shape):

- ``model.<name>``: the fp32 master (mixed precision), else the parameter chunk's value
  (fp32 training, and frozen parameters in their compute dtype);
- ``optim.state.<name>.<moment>``: the update rule's moments (fp32): Adam's ``exp_avg`` and
  ``exp_avg_sq``, SGD's ``momentum_buffer``;
- ``optim.state.<name>.step``: the parameter's step count, a 0-d fp32 tensor.

A tied parameter is one slot and is stored once, under its first name.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot
from chunkmem.optimizer import ChunkOptimizer
from chunkmem.optimizer_states import OptimizerStates
from chunkmem.params import ParamStore
from chunkmem.residency import Residency
from chunkmem.sharding import Span
from chunkmem.staging import Staging


def model_key(name: str) -> str:
    return f"model.{name}"


def moment_key(name: str, kind: ChunkKind) -> str:
    return f"optim.state.{name}.{kind.value}"


def step_key(name: str) -> str:
    return f"optim.state.{name}.step"


@dataclass(frozen=True)
class Box:
    """Part of a parameter: ``offsets``/``sizes`` in its shape; ``start`` is the flat index
    of its first element (boxes are contiguous in row-major order)."""

    start: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def row_major_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """Flat elements ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes: a partial first
    row, whole rows, a partial last row, recursively; at most ``2 * (ndim - 1) + 1`` of them."""
    if lo >= hi:
        return []
    if len(shape) == 0:
        return [Box(0, (), ())]
    if len(shape) == 1:
        return [Box(lo, (lo,), (hi - lo,))]
    inner = math.prod(shape[1:])

    def part_of_row(row: int, a: int, b: int) -> list[Box]:
        return [
            Box(row * inner + box.start, (row, *box.offsets), (1, *box.sizes))
            for box in row_major_boxes(shape[1:], a, b)
        ]

    first, last = lo // inner, (hi - 1) // inner
    if first == last and (lo % inner or hi - first * inner < inner):
        return part_of_row(first, lo - first * inner, hi - first * inner)
    boxes: list[Box] = []
    whole_from, whole_to = first, last + 1
    if lo % inner:
        boxes += part_of_row(first, lo % inner, inner)
        whole_from += 1
    tail = hi - last * inner
    if tail < inner:
        whole_to -= 1
    if whole_from < whole_to:
        zeros = (0,) * (len(shape) - 1)
        boxes.append(
            Box(
                whole_from * inner,
                (whole_from, *zeros),
                (whole_to - whole_from, *shape[1:]),
            )
        )
    if tail < inner:
        boxes += part_of_row(last, 0, tail)
    return boxes


@dataclass(frozen=True)
class Piece:
    """One box of one key, and the flat tensor it is a run of (``flat()[begin:...]``).

    ``flat`` is called when the box is written or read, not before; None: the box is zeros
    (moments of a run that has not stepped yet).
    """

    key: str
    shape: torch.Size
    dtype: torch.dtype
    box: Box
    flat: Callable[[], torch.Tensor] | None
    begin: int

    def tensor(self) -> torch.Tensor:
        if self.flat is None:
            return torch.zeros(self.box.sizes, dtype=self.dtype)
        return self.flat()[self.begin : self.begin + self.box.numel].view(self.box.sizes)


def pieces_of_span(
    layout: ChunkLayout,
    span: Span,
    key_of: Callable[[TensorSlot], str],
    dtype: torch.dtype,
    flat: Callable[[], torch.Tensor] | None,
) -> list[Piece]:
    """Boxes of every slot of ``layout`` inside ``span`` = (start, numel), over a flat tensor
    that holds that span of the layout (element ``start`` of the layout is ``flat()[0]``)."""
    start, numel = span
    pieces = []
    for slot in layout.slots:
        lo = max(0, start - slot.offset)
        hi = min(slot.numel, start + numel - slot.offset)
        for box in row_major_boxes(slot.shape, lo, hi):
            begin = slot.offset + box.start - start
            pieces.append(Piece(key_of(slot), slot.shape, dtype, box, flat, begin))
    return pieces


class ChunkAccess:
    """Chunk contents for a checkpoint's boxes, one chunk at a time where its tier is not
    addressable (the NVMe tier), borrowed through ``chunkmem.staging``.

    Reading takes a copy of such a chunk; writing stages it into host memory, where DCP writes
    into it, and sends it back home when the next chunk is asked for or at :meth:`release`.
    DCP asks for boxes in plan order (one thread, no copy-ahead), and the plan lists each
    chunk's boxes together, so each chunk is read once per file it has boxes in.
    """

    def __init__(self, residency: Residency, writing: bool) -> None:
        self.staging = Staging(residency)
        self.writing = writing
        self._chunk: Chunk | None = None
        self._borrow: contextlib.ExitStack | None = None
        self._contents: torch.Tensor | None = None

    def flat(self, chunk: Chunk) -> Callable[[], torch.Tensor]:
        return lambda: self.contents(chunk)

    def contents(self, chunk: Chunk) -> torch.Tensor:
        if chunk is not self._chunk:
            self.release()
            borrow = contextlib.ExitStack()
            self._contents = borrow.enter_context(
                self.staging.borrowed(chunk, self.writing, "checkpoint")
            )
            self._chunk, self._borrow = chunk, borrow
        assert self._contents is not None
        return self._contents

    def release(self) -> None:
        """The chunk borrowed last is given back (staged: written home, the write waited for)."""
        borrow = self._borrow
        self._chunk = self._borrow = self._contents = None
        if borrow is not None:
            borrow.close()


def value_chunk(layout: ChunkLayout) -> Chunk:
    """The chunk holding a layout's values at full precision: its masters, else (fp32
    training, frozen parameters) its parameter chunk."""
    return layout.chunks.get(ChunkKind.MASTER) or layout.chunks[ChunkKind.PARAM]


def owned_span(params: ParamStore, layout: ChunkLayout) -> Span:
    """The span of ``layout`` this rank writes: its equal shard (every element of every
    parameter is written by exactly one rank, whatever the ZeRO stage)."""
    return params.sharding.shard(layout)


def slots_in(layout: ChunkLayout, span: Span) -> list[TensorSlot]:
    """Slots with at least one element in ``span``."""
    start, numel = span
    return [
        s
        for s in layout.slots
        if s.numel and s.offset < start + numel and start < s.offset + s.numel
    ]


def save_pieces(params: ParamStore, states: OptimizerStates, access: ChunkAccess) -> list[Piece]:
    """What this rank writes: values and moments of its span of every layout."""
    pieces: list[Piece] = []
    for layout in params.layouts:
        span = owned_span(params, layout)
        source = value_chunk(layout)
        pieces += pieces_of_span(
            layout,
            span,
            lambda s: model_key(s.name),
            source.dtype,
            _offset(access.flat(source), span[0] - source.start),
        )
        if not layout.trainable:
            continue
        state_start = states.state_span(layout)[0]
        for kind in states.moments:
            chunk = layout.chunks.get(kind)
            preloaded = states.preloaded(layout, kind)
            if chunk is not None:
                dtype, flat = chunk.dtype, access.flat(chunk)
            elif preloaded is not None:  # loaded, not stepped since
                dtype, flat = preloaded.dtype, _fixed(preloaded)
            else:  # never stepped: zeros
                dtype, flat = torch.float32, None
            pieces += pieces_of_span(
                layout,
                span,
                lambda s, k=kind: moment_key(s.name, k),
                dtype,
                None if flat is None else _offset(flat, span[0] - state_start),
            )
    return pieces


def load_pieces(params: ParamStore, states: OptimizerStates, access: ChunkAccess) -> list[Piece]:
    """Where this rank reads into: every span of every chunk that holds values or moments
    (a ZeRO 1-2 parameter chunk is whole on every rank, so each rank reads all of it; the
    16-bit copy is the rounded master, as the step writes it). Moments not placed yet (no
    step taken) are read into host memory the first step starts from."""
    pieces: list[Piece] = []
    for layout in params.layouts:
        for kind in (ChunkKind.PARAM, ChunkKind.MASTER):
            chunk = layout.chunks.get(kind)
            if chunk is not None:
                pieces += pieces_of_span(
                    layout,
                    (chunk.start, chunk.numel),
                    lambda s: model_key(s.name),
                    chunk.dtype,
                    access.flat(chunk),
                )
        if not layout.trainable:
            continue
        for kind in states.moments:
            chunk = layout.chunks.get(kind)
            flat = access.flat(chunk) if chunk is not None else _fixed(states.preload(layout, kind))
            pieces += pieces_of_span(
                layout,
                states.state_span(layout),
                lambda s, k=kind: moment_key(s.name, k),
                torch.float32,
                flat,
            )
    return pieces


def step_counts(
    params: ParamStore, optimizer: ChunkOptimizer, span_of: Callable[[ChunkLayout], Span]
) -> dict[TensorSlot, torch.Tensor]:
    """Each trainable slot with part in ``span_of(layout)``: its step count (0-d, fp32, CPU)."""
    counts = {}
    for layout in params.trainable_layouts():
        for slot in slots_in(layout, span_of(layout)):
            counter = optimizer.step_counts.get(slot)
            counts[slot] = torch.tensor(0.0 if counter is None else float(counter))
    return counts


def _fixed(values: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: values


def _offset(flat: Callable[[], torch.Tensor], offset: int) -> Callable[[], torch.Tensor]:
    """``flat`` seen from ``offset`` on (a span that starts inside a larger chunk)."""
    if offset == 0:
        return flat
    return lambda: flat()[offset:]
