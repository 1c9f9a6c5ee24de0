"""One layout's update through torch's fused kernel (the update rule's), where the native host optimizer
does not run: optimizer states on the device, or on the host without the native library.
It runs on the engine's thread (it takes workspaces) and reads each gradient where it lies."""

from __future__ import annotations

import torch

from chunkmem.chunk import Chunk, ChunkKind, TensorSlot
from chunkmem.grads import GradStore
from chunkmem.pieces import Piece, cut, spans
from chunkmem.residency import Residency
from chunkmem.tiers import StorageTier
from chunkmem.update_rules import ParamGroups

# fp32 elements of gradient cast at once in bf16/fp16 training (the fused kernel needs fp32
# gradients for fp32 masters): 1 MiB of workspace whatever the chunk size, so a large chunk
# does not need a large transient buffer on a nearly full tier.
WORKSPACE_ELEMENTS = 1 << 18


def account_stream(
    residency: Residency, sources: list[Chunk], sizes: list[int], home: StorageTier, to_home: bool
) -> None:
    """Bytes an update streams across tiers without moving chunks: gradients read into the
    states' home tier (``to_home``), or 16-bit values written back from it."""
    by_chunk: dict[int, list] = {}
    for chunk, size in zip(sources, sizes, strict=True):
        entry = by_chunk.setdefault(chunk.id, [chunk, 0])
        entry[1] += size * chunk.dtype.itemsize
    for chunk, nbytes in by_chunk.values():
        if to_home:
            residency.transfer(chunk, chunk.tier, home, nbytes, "step gradients")
        else:
            residency.transfer(chunk, home, chunk.tier, nbytes, "step values")


class TorchUpdate:
    """torch's fused kernel over one layout's pieces, one call per parameter group."""

    def __init__(self, grads: GradStore, residency: Residency, groups: ParamGroups) -> None:
        self.grads = grads
        self.residency = residency
        self.groups = groups

    def __call__(
        self,
        chunks: dict[ChunkKind, Chunk],
        pieces: list[Piece],
        slots: list[TensorSlot],
        step_of: dict[int, torch.Tensor],
        grad_scale: torch.Tensor | None,
        home: StorageTier,
    ) -> None:
        if ChunkKind.MASTER in chunks:
            self._step_mixed(chunks, pieces, step_of, grad_scale, home)
        elif all(hi - lo == s.numel for s, lo, hi in pieces) and self._unsharded(chunks, slots):
            self._fused(  # whole slots of whole chunks: cached views, no slicing
                slots,
                chunks[ChunkKind.PARAM].views(slots),
                self.grads.views(slots),
                [chunks[kind].views(slots) for kind in self.groups.rule.moments],
                [step_of[id(s)] for s in slots],
                grad_scale,
            )
        else:
            self._fused(
                [slot for slot, _lo, _hi in pieces],
                spans(chunks[ChunkKind.PARAM], pieces),
                [self.grads.reducer.grad_source(s).span(s, lo, hi) for s, lo, hi in pieces],
                [spans(chunks[kind], pieces) for kind in self.groups.rule.moments],
                [step_of[id(s)] for s, _lo, _hi in pieces],
                grad_scale,
            )

    def _unsharded(self, chunks: dict[ChunkKind, Chunk], slots: list[TensorSlot]) -> bool:
        """Whether the values, the moments and the gradients are whole chunks (no ZeRO shard
        of the layout): slot views then find each parameter at its offset. The moments alone
        do not say it: a rule may have none (SGD without momentum)."""
        kinds = (ChunkKind.PARAM, *self.groups.rule.moments)
        source = self.grads.reducer.grad_source
        return all(chunks[k].is_whole for k in kinds) and all(source(s).is_whole for s in slots)

    def _step_mixed(self, chunks, pieces, step_of, grad_scale, home: StorageTier) -> None:
        """fp32 masters: cast gradients to fp32 a workspace at a time, update, write back."""
        total = sum(hi - lo for _slot, lo, hi in pieces)
        grad_source = self.grads.reducer.grad_source
        with self.residency.workspaces.scoped(
            min(total, WORKSPACE_ELEMENTS),
            torch.float32,
            home,
            {c.id for c in chunks.values()},
            within="capacity",
        ) as workspace:
            for batch in cut(pieces, WORKSPACE_ELEMENTS):
                sizes = [hi - lo for _slot, lo, hi in batch]
                grads = list(torch.split(workspace[: sum(sizes)], sizes))
                sources = [grad_source(s) for s, _lo, _hi in batch]
                torch._foreach_copy_(
                    grads,
                    [c.span(s, lo, hi) for c, (s, lo, hi) in zip(sources, batch, strict=True)],
                )
                account_stream(self.residency, sources, sizes, home, to_home=True)
                masters = spans(chunks[ChunkKind.MASTER], batch)
                self._fused(
                    [slot for slot, _lo, _hi in batch],
                    masters,
                    grads,
                    [spans(chunks[kind], batch) for kind in self.groups.rule.moments],
                    [step_of[id(slot)] for slot, _lo, _hi in batch],
                    grad_scale,
                )
                param = chunks[ChunkKind.PARAM]
                torch._foreach_copy_(spans(param, batch), masters)
                account_stream(self.residency, [param] * len(batch), sizes, home, to_home=False)

    def _fused(self, slots, params, grads, moments, steps, grad_scale) -> None:
        """torch's fused kernel, one call per parameter group over aligned lists
        (``moments``: one list per kind of the rule's moments)."""
        groups = self.groups
        kernel = groups.torch_kernel()
        for group_index, positions in groups.by_group(slots).items():
            kernel(
                [params[i] for i in positions],
                [grads[i] for i in positions],
                [[moment[i] for i in positions] for moment in moments],
                [steps[i] for i in positions],
                grad_scale,
                **groups.hyper_parameters(group_index),
            )
