"""``torch.distributed.checkpoint`` planners that write and read the boxes of
:mod:`chunkmem.checkpoint.pieces` straight from and into the engine's chunks.

The default planners handle everything else in the state dict they are given (run state as
pickled bytes, buffers, step counts as plain tensors); these add one ``SHARD`` item per box.
DCP's coordinator checks at save that the ranks' boxes neither overlap nor leave a hole, and
at load intersects the boxes a rank wants with the boxes on disk, so any partition reshards
into any other. Public DCP API only: no DTensor, no ShardedTensor.

[Note: no flattening]
The planners run with ``flatten_state_dict=False``: a nested dict (the run state, a
``client_state``) is one pickled value, not a tree of keys, so what a caller passes comes
back as it was given.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from chunkmem.checkpoint.pieces import Piece
from chunkmem.errors import CheckpointError


def narrow(
    tensor: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> torch.Tensor:
    """The sub-box ``offsets``/``lengths`` of ``tensor`` (a view)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


class PieceSavePlanner(DefaultSavePlanner):
    """Saves the state dict as the default planner does, plus one shard item per piece."""

    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = {MetadataIndex(p.key, torch.Size(p.box.offsets)): p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=index,
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(p.box.offsets), sizes=torch.Size(p.box.sizes)
                    ),
                    properties=TensorProperties(dtype=p.dtype),
                    size=p.shape,
                ),
            )
            for index, p in self._pieces.items()
        ]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def resolve_data(self, write_item: WriteItem):  # type: ignore[override]
        # MetadataIndex hashes by key and offsets; DCP's rewritten index hints do not count.
        piece = self._pieces.get(write_item.index)
        if piece is None:
            return super().resolve_data(write_item)
        return piece.tensor()


class PieceLoadPlanner(DefaultLoadPlanner):
    """Loads the state dict as the default planner does, and every piece in place."""

    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._by_key: dict[str, list[Piece]] = defaultdict(list)
        for piece in pieces:
            self._by_key[piece.key].append(piece)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None
        requests = list(plan.items)
        for key, pieces in self._by_key.items():
            saved = self.metadata.state_dict_metadata.get(key)
            if not isinstance(saved, TensorStorageMetadata):
                raise CheckpointError(f"the checkpoint has no tensor {key!r}")
            if saved.size != pieces[0].shape:
                raise CheckpointError(
                    f"{key!r} has shape {tuple(saved.size)} in the checkpoint and "
                    f"{tuple(pieces[0].shape)} in the engine"
                )
            local = [
                ChunkStorageMetadata(torch.Size(p.box.offsets), torch.Size(p.box.sizes))
                for p in pieces
            ]
            reads = create_read_items_for_chunk_list(key, saved, local)
            # DCP does not check that the saved boxes cover what a rank asks for; saved boxes
            # never overlap, so covered elements add up.
            covered = sum(math.prod(r.lengths) for r in reads)
            wanted = sum(p.box.numel for p in pieces)
            if covered != wanted:
                raise CheckpointError(
                    f"the checkpoint holds {covered:,} of the {wanted:,} elements of {key!r} "
                    f"this rank needs: it is incomplete"
                )
            requests += reads
        return dataclasses.replace(plan, items=requests)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        pieces = self._by_key.get(read_item.dest_index.fqn)
        if pieces is None:
            return super().resolve_tensor(read_item)
        target = pieces[read_item.dest_index.index].tensor()  # type: ignore[index]
        return narrow(target, tuple(read_item.dest_offsets), tuple(read_item.lengths))
