"""A layout's rows by address for the native Adam's calls (:class:`HostRows`), and the rows kept
from one update of a layout to the next while every buffer they point into stays
(:class:`RowsCache`).

[Note: rows kept across updates] An early update builds its calls on the host thread beside
backward, and that Python holds the GIL that backward's hooks on the engine's thread wait for
(docs/offload.md). The rows depend only on where the pieces lie: the chunks' payloads, the
buffers an update out of place writes, the gradients, the buffers that save them and the step
counts. Those stay from step to step (a speculative group's states alternate between a chunk's
payload and its shadow, and a rollback's serial update writes in place over either: a layout
keeps four sets), so the rows are built once per set and
found again by the addresses of their buffers. Rows are only addresses: the same addresses give
the same rows whichever tensors hold them now, and the cache keeps no tensor alive (the tensors
the calls write, whose version counters they bump, are the caller's current ones)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from chunkmem.chunk import Chunk, ChunkKind
from chunkmem.pieces import Piece, addresses

# A speculative layout's states alternate between two buffers (a chunk's payload and its
# shadow: two sets of rows), and a rollback's serial update writes in place over either (two
# more).
KEPT_PER_LAYOUT = 4


def written_tensors(
    chunks: dict[ChunkKind, Chunk],
    value: ChunkKind,
    moments: tuple[ChunkKind, ...],
    outs: list[torch.Tensor] | None,
    saves: list[torch.Tensor | None] | None,
    into: dict[ChunkKind, torch.Tensor],
) -> list[torch.Tensor]:
    """The tensors a layout's calls write, but the gradients (fp32 ones left divided where they
    lie): the values and moments (or the buffers an update out of place writes instead), the
    16-bit values (a GPU's host buffers), the buffers that save the gradients."""
    written = [into[k] if k in into else chunks[k].payload for k in (value, *moments)]
    if value == ChunkKind.MASTER:  # 16-bit values written in the same pass
        written.extend(outs if outs is not None else [chunks[ChunkKind.PARAM].payload])
    written.extend(t for t in saves or () if t is not None)
    return written  # type: ignore[return-value]


class HostRows:
    """One layout's rows by address, by parameter group (``group_positions``: the pieces'
    positions by group): the chunks' rows, and the rows of what comes as tensors (the
    gradients, a GPU's 16-bit values' host buffers, the saved gradients' buffers), each
    gradient's dtype checked here (they come from different chunks), and the dtypes.
    ``written``: what the calls write (:func:`written_tensors`, and the gradients where they
    are left divided), checked to lie in host memory."""

    def __init__(
        self,
        kernels: ModuleType,
        chunks: dict[ChunkKind, Chunk],
        value: ChunkKind,
        moments: tuple[ChunkKind, ...],
        pieces: list[Piece],
        grads: list[torch.Tensor],
        outs: list[torch.Tensor] | None,
        saves: list[torch.Tensor | None] | None,
        into: dict[ChunkKind, torch.Tensor],
        steps: list[torch.Tensor],
        written: list[torch.Tensor],
        group_positions: dict[int, list[int]],
    ) -> None:
        grad_dtype = grads[0].dtype if grads else torch.float32
        for grad in grads:
            if grad.dtype != grad_dtype or not grad.is_cpu or not grad.is_contiguous():
                raise TypeError(
                    f"a host update's gradients must be contiguous CPU tensors of one dtype, "
                    f"got {grad.dtype} on {grad.device} beside {grad_dtype}"
                )
        params = addresses(chunks[value], pieces)  # first: it names a chunk without payload
        moment_rows = [addresses(chunks[kind], pieces) for kind in moments]
        new = None
        if into:
            new = [
                addresses(chunks[kind], pieces, into[kind]) if kind in into else read
                for kind, read in ((value, params), *zip(moments, moment_rows, strict=True))
            ]
        out_rows: list[int] | None = None
        out_dtype = None
        if value == ChunkKind.MASTER:  # 16-bit values written in the same pass
            param = chunks[ChunkKind.PARAM]
            out_dtype = param.dtype
            out_rows = addresses(param, pieces) if outs is None else [t.data_ptr() for t in outs]
        if not all(t.is_cpu for t in written):
            raise ValueError("a host update's rows by address must all lie in host memory")
        self.types = kernels.RowTypes(
            params=chunks[value].dtype, grads=grad_dtype, states=chunks[moments[0]].dtype,
            out=out_dtype,
        )  # fmt: skip
        grad_rows = [grad.data_ptr() for grad in grads]
        saved = None if saves is None else [None if t is None else t.data_ptr() for t in saves]
        step_rows = [step.data_ptr() for step in steps]

        def pick(rows: list[Any] | None, positions: list[int]) -> list[Any] | None:
            return None if rows is None else [rows[i] for i in positions]

        self.positions = group_positions
        self.by_group = {
            group: kernels.AdamRows(
                params=pick(params, positions),
                grads=pick(grad_rows, positions),
                exp_avgs=pick(moment_rows[0], positions),
                exp_avg_sqs=pick(moment_rows[1], positions),
                steps=pick(step_rows, positions),
                numels=[pieces[i][2] - pieces[i][1] for i in positions],
                params_out=pick(out_rows, positions),
                new_states=None if new is None else tuple(pick(rows, positions) for rows in new),
                grads_saved=pick(saved, positions),
            )
            for group, positions in group_positions.items()
        }


class RowsCache:
    """Each layout's last :data:`KEPT_PER_LAYOUT` sets of rows (see [Note: rows kept across
    updates]). Safe beside the engine's thread: each layout's entry is replaced whole, and one
    layout's update is built on one thread at a time."""

    def __init__(self) -> None:
        self._by_layout: dict[int, list[tuple[tuple[Any, ...], HostRows]]] = {}

    def rows(
        self,
        layout_index: int,
        build: Callable[[], HostRows],
        buffers: list[torch.Tensor | None],
        pieces: list[Piece],
        grads: list[torch.Tensor],
        saves: list[torch.Tensor | None] | None,
        steps: list[torch.Tensor],
    ) -> HostRows:
        """The layout's rows for these buffers; ``build`` makes them where none are kept.
        ``buffers``: every tensor the rows lie in but the gradients, the saves and the step
        counts (the chunks' payloads and :func:`written_tensors`). Rows are addresses: the
        same addresses give the same rows, whatever tensors now hold them."""
        if any(t is None for t in buffers):
            return build()  # it says which chunk has no payload
        address = torch.Tensor.data_ptr
        key = (
            tuple(pieces),  # slots compare by identity
            tuple(map(address, buffers)),  # type: ignore[arg-type]
            tuple(map(address, grads)),
            (grads[0].dtype, grads[0].is_cpu) if grads else None,
            None if saves is None else tuple(t is None for t in saves),  # the rest: ``buffers``
            tuple(map(address, steps)),
        )
        kept = self._by_layout.get(layout_index, [])
        for kept_key, rows in kept:
            if kept_key == key:
                return rows
        rows = build()
        self._by_layout[layout_index] = [(key, rows), *kept[: KEPT_PER_LAYOUT - 1]]
        return rows
