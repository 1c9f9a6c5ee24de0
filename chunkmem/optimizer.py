"""Adam/AdamW over chunks: one fused kernel call per chunk and parameter group.

The update runs where a chunk's optimizer states live (device or host). Per-parameter
semantics follow ``torch.optim.Adam``: a parameter that got no gradient is skipped and its
step count does not advance; each parameter group keeps its own hyper-parameters, which a
learning-rate scheduler may change between steps through :attr:`ChunkAdam.param_groups`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot
from chunkmem.errors import ConfigError
from chunkmem.manager import ChunkManager
from chunkmem.optimizer_states import OptimizerStates
from chunkmem.tiers import StorageTier
from chunkmem.tracer import Moment, Phase

# fp32 elements of gradient cast at once in bf16/fp16 training (the fused kernel needs fp32
# gradients for fp32 masters): 1 MiB of workspace whatever the chunk size, so a large chunk
# does not need a large transient buffer on a nearly full tier.
WORKSPACE_ELEMENTS = 1 << 18
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def groups_from_torch_optimizer(
    optimizer: torch.optim.Optimizer,
) -> tuple[list[dict[str, Any]], list[list[torch.nn.Parameter]], bool]:
    """Hyper-parameter groups, their parameters and whether decay is decoupled (AdamW)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ConfigError(
            f"chunkmem runs Adam/AdamW on its chunks; got {type(optimizer).__name__}. Pass a "
            f"torch.optim.Adam or AdamW (or none, and set optimizer in the config)"
        )
    if optimizer.state:
        raise ConfigError(
            "the optimizer already has state (it has stepped); pass a freshly built optimizer "
            "so no moments are lost"
        )
    decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay", False) for g in optimizer.param_groups
    )
    groups, params = [], []
    for index, group in enumerate(optimizer.param_groups):
        for flag in _UNSUPPORTED_FLAGS:
            if group.get(flag):
                raise ConfigError(
                    f"optimizer param group {index} sets {flag}=True, which chunkmem does not "
                    f"support; set it to False"
                )
        lr = group["lr"]
        groups.append(
            {
                "lr": float(lr),
                "betas": tuple(float(b) for b in group["betas"]),
                "eps": float(group["eps"]),
                "weight_decay": float(group["weight_decay"]),
            }
        )
        params.append(list(group["params"]))
    return groups, params, decoupled


class ChunkAdam:
    """Adam/AdamW whose parameters, masters and moments live in chunks.

    Each layout updates the elements whose optimizer states this rank holds (all of them, or
    its ZeRO shard), as flat pieces of the slots that intersect that span. Gradients are
    divided by ``grad_divisor`` (loss scale over clip coefficient) and, under ZeRO, by the
    world size: the reduce-scatter sums, the update averages.
    """

    def __init__(
        self,
        manager: ChunkManager,
        states: OptimizerStates,
        param_groups: list[dict[str, Any]],
        group_of: dict[int, int],
        decoupled_weight_decay: bool,
    ) -> None:
        self.manager = manager
        self.states = states
        self.params = manager.params
        self.grads = manager.grads
        self.residency = manager.residency
        self.gatherer = manager.gatherer
        self.sharding = states.sharding
        self.param_groups = param_groups
        self.group_of = group_of
        self.decoupled = decoupled_weight_decay
        self.step_counts: dict[TensorSlot, torch.Tensor] = {}
        self.layouts_updated = 0  # layouts the running step began to update

    def _step_tensor(self, slot: TensorSlot, device: torch.device) -> torch.Tensor:
        counter = self.step_counts.get(slot)
        if counter is None or counter.device != device:
            previous = 0.0 if counter is None else float(counter)
            counter = torch.tensor(previous, dtype=torch.float32, device=device)
            self.step_counts[slot] = counter
        return counter

    def step(self, grad_divisor: float) -> None:
        """Update every parameter that has a gradient; the gatherer makes each updated layout
        whole again where ranks compute on it (ZeRO 1-2) and ``finish_step`` waits for that."""
        divisor = grad_divisor * self.sharding.world_size
        self.layouts_updated = 0
        try:
            for layout in self.params.trainable_layouts():
                pieces = owned_pieces(layout, self.states.state_span(layout))
                if pieces:
                    self.layouts_updated += 1  # counted first: a half update counts too
                    self._step_layout(layout, pieces, divisor)
                self.gatherer.after_update(layout)
        finally:
            self.gatherer.finish_step()

    def _step_layout(self, layout: ChunkLayout, pieces: list[Piece], divisor: float) -> None:
        self.manager.enter_moment(Moment(Phase.STEP, f"chunk {layout.index}"))
        home = self.states.home(layout)
        with self.states.update_chunks(layout) as chunks:
            device = chunks[ChunkKind.EXP_AVG].payload.device  # type: ignore[union-attr]
            slots = list(dict.fromkeys(slot for slot, _lo, _hi in pieces))
            steps = [self._step_tensor(s, device) for s in slots]
            torch._foreach_add_(steps, 1)
            step_of = dict(zip(map(id, slots), steps, strict=True))
            grad_scale = (
                None
                if divisor == 1.0
                else torch.tensor(divisor, dtype=torch.float32, device=device)
            )
            if ChunkKind.MASTER in chunks:
                self._step_mixed(chunks, pieces, step_of, grad_scale, home)
            elif (
                all(hi - lo == s.numel for s, lo, hi in pieces)
                and chunks[ChunkKind.EXP_AVG].is_whole
            ):
                self._update(  # whole slots of whole chunks: cached views, no slicing
                    slots,
                    chunks[ChunkKind.PARAM].views(slots),
                    self.grads.views(slots),
                    chunks[ChunkKind.EXP_AVG].views(slots),
                    chunks[ChunkKind.EXP_AVG_SQ].views(slots),
                    steps,
                    grad_scale,
                )
            else:
                self._update(
                    [slot for slot, _lo, _hi in pieces],
                    spans(chunks[ChunkKind.PARAM], pieces),
                    [self.grads.reducer.grad_source(s).span(s, lo, hi) for s, lo, hi in pieces],
                    spans(chunks[ChunkKind.EXP_AVG], pieces),
                    spans(chunks[ChunkKind.EXP_AVG_SQ], pieces),
                    [step_of[id(s)] for s, _lo, _hi in pieces],
                    grad_scale,
                )
        for slot in layout.slots:
            slot.grad_in_param_slot = False
        self.manager.binder.bind_layout(layout)

    def _step_mixed(self, chunks, pieces, step_of, grad_scale, home: StorageTier) -> None:
        """fp32 masters: cast gradients to fp32 a workspace at a time, update, write back."""
        total = sum(hi - lo for _slot, lo, hi in pieces)
        grad_source = self.grads.reducer.grad_source
        with self.residency.workspace(
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
                self._account_stream(sources, sizes, home, to_home=True)
                masters = spans(chunks[ChunkKind.MASTER], batch)
                self._update(
                    [slot for slot, _lo, _hi in batch],
                    masters,
                    grads,
                    spans(chunks[ChunkKind.EXP_AVG], batch),
                    spans(chunks[ChunkKind.EXP_AVG_SQ], batch),
                    [step_of[id(slot)] for slot, _lo, _hi in batch],
                    grad_scale,
                )
                param = chunks[ChunkKind.PARAM]
                torch._foreach_copy_(spans(param, batch), masters)
                self._account_stream([param] * len(batch), sizes, home, to_home=False)

    def _account_stream(
        self, sources: list[Chunk], sizes: list[int], home: StorageTier, to_home: bool
    ) -> None:
        """Bytes crossing tiers: gradients read into the home tier, or values written back."""
        by_chunk: dict[int, list] = {}
        for chunk, size in zip(sources, sizes, strict=True):
            entry = by_chunk.setdefault(chunk.id, [chunk, 0])
            entry[1] += size * chunk.dtype.itemsize
        for chunk, nbytes in by_chunk.values():
            if to_home:
                self.residency.transfer(chunk, chunk.tier, home, nbytes, "step gradients")
            else:
                self.residency.transfer(chunk, home, chunk.tier, nbytes, "step values")

    def _update(self, slots, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale) -> None:
        """One fused call per parameter group over aligned lists (slots may repeat: pieces)."""
        by_group: dict[int, list[int]] = {}
        for position, slot in enumerate(slots):
            by_group.setdefault(self.group_of[id(slot.param)], []).append(position)
        for group_index, positions in by_group.items():
            group = self.param_groups[group_index]
            beta1, beta2 = group["betas"]
            kernel = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
            kernel(
                [params[i] for i in positions],
                [grads[i] for i in positions],
                [exp_avgs[i] for i in positions],
                [exp_avg_sqs[i] for i in positions],
                [],
                [steps[i] for i in positions],
                amsgrad=False,
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
                grad_scale=grad_scale,
                found_inf=None,
            )

    def restore_from_masters(self) -> None:
        """After a skipped step: every slot that holds a gradient gets its value back."""
        for layout in self.params.trainable_layouts():
            slots = [s for s in layout.slots if s.grad_in_param_slot]
            if not slots:
                continue
            self.manager.enter_moment(Moment(Phase.STEP, f"chunk {layout.index}"))
            with self.states.update_chunks(layout) as chunks:
                param_chunk, master = chunks[ChunkKind.PARAM], chunks[ChunkKind.MASTER]
                torch._foreach_copy_(param_chunk.views(slots), master.views(slots))
                nbytes = sum(s.numel for s in slots) * param_chunk.dtype.itemsize
                self.residency.transfer(
                    param_chunk, master.tier, param_chunk.tier, nbytes, "restore"
                )
            for slot in slots:
                slot.grad_in_param_slot = False
            self.manager.binder.bind_layout(layout)

    def grad_norm(self) -> float:
        """L2 norm of the gradients the update will use (averaged over ranks under ZeRO),
        before loss-scale division; computed where each gradient lives, no chunk moves.

        Like ``clip_grad_norm_``: the fp32 norm of per-tensor norms (here per piece); ranks
        add the squares of their local norms.
        """
        grad_source = self.grads.reducer.grad_source
        norms = []
        for layout in self.params.trainable_layouts():
            pieces = owned_pieces(layout, self.states.state_span(layout))
            sources = [grad_source(s) for s, _lo, _hi in pieces]
            # A gradient chunk evicted in backward may still be copying to the host (or one
            # fetched back, to the device): wait for it, as every other reader does.
            for chunk in dict.fromkeys(sources):
                self.residency.ready(chunk)
            views = [c.span(s, lo, hi) for c, (s, lo, hi) in zip(sources, pieces, strict=True)]
            if views:
                norms.extend(n.cpu() for n in torch._foreach_norm(views, 2, dtype=torch.float32))
        local = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        sharding = self.sharding
        if sharding.world_size == 1:
            return float(local)
        squares = local.double().square().reshape(1)
        sharding.all_reduce_sum(squares)
        return math.sqrt(float(squares)) / sharding.world_size


Piece = tuple[TensorSlot, int, int]  # a slot and a range of its flat elements


def owned_pieces(layout: ChunkLayout, span: tuple[int, int]) -> list[Piece]:
    """The parts of slots with gradients that fall in ``span`` = (start, numel)."""
    start, numel = span
    pieces = []
    for slot in layout.slots:
        if not slot.has_grad:
            continue
        lo = max(0, start - slot.offset)
        hi = min(slot.numel, start + numel - slot.offset)
        if lo < hi:
            pieces.append((slot, lo, hi))
    return pieces


def spans(chunk: Chunk, pieces: Sequence[Piece]) -> list[torch.Tensor]:
    return [chunk.span(slot, lo, hi) for slot, lo, hi in pieces]


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


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``clip_grad_norm_``'s factor: shrink only when the norm exceeds ``max_norm``."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
