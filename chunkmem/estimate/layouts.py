"""The chunk layouts an estimated run packs: the model's parameters placed in the trace's
first-use order by the engine's own packer, so the estimate's layouts are the ones a run gets.
Split from ``chunkmem.estimate.memory``, which replays the bytes of a cycle over them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkmem.chunk import ChunkLayout
from chunkmem.estimate.trace import ModelTrace
from chunkmem.packing import Packer
from chunkmem.sizing import ChunkSizes


@dataclass
class Layouts:
    """The chunk layouts a run packs, with the parameters in each."""

    sizes: ChunkSizes
    layouts: list[ChunkLayout]
    layout_of: list[int]  # parameter index -> position in ``layouts``

    @property
    def trainable(self) -> list[int]:
        return [i for i, layout in enumerate(self.layouts) if layout.trainable]


def pack_layouts(
    params: list[torch.nn.Parameter], trace: ModelTrace, sizes: ChunkSizes, alignment: int
) -> Layouts:
    """Pack ``params`` in the trace's first-use order with the engine's packer."""
    counter = iter(range(1 << 62))
    packers = {
        trainable: Packer(sizes.size(trainable), trainable, lambda: next(counter), alignment)
        for trainable in (True, False)
    }
    layout_of = [0] * len(params)
    placed: dict[int, ChunkLayout] = {}
    for i in trace.pack_order:
        param = params[i]
        _slot, layout, _created = packers[param.requires_grad].place(trace.names[i], param)
        placed[i] = layout
    layouts = sorted(
        {id(layout): layout for layout in placed.values()}.values(), key=lambda layout: layout.index
    )
    position = {id(layout): k for k, layout in enumerate(layouts)}
    for i, layout in placed.items():
        layout_of[i] = position[id(layout)]
    return Layouts(sizes, layouts, layout_of)
