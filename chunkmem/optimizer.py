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

from chunkmem.chunk import ChunkKind, ChunkLayout, TensorSlot, Tier
from chunkmem.errors import ConfigError
from chunkmem.manager import ChunkManager
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
    """Adam/AdamW whose parameters, masters and moments live in chunks."""

    def __init__(
        self,
        manager: ChunkManager,
        param_groups: list[dict[str, Any]],
        group_of: dict[int, int],
        decoupled_weight_decay: bool,
    ) -> None:
        self.manager = manager
        self.param_groups = param_groups
        self.group_of = group_of
        self.decoupled = decoupled_weight_decay
        self.step_counts: dict[TensorSlot, torch.Tensor] = {}

    def _step_tensor(self, slot: TensorSlot, device: torch.device) -> torch.Tensor:
        counter = self.step_counts.get(slot)
        if counter is None or counter.device != device:
            previous = 0.0 if counter is None else float(counter)
            counter = torch.tensor(previous, dtype=torch.float32, device=device)
            self.step_counts[slot] = counter
        return counter

    def step(self, grad_divisor: float) -> None:
        """Update every parameter that has a gradient; gradients are divided by ``grad_divisor``."""
        for layout in self.manager.trainable_layouts():
            slots = [s for s in layout.slots if s.has_grad]
            if slots:
                self._step_layout(layout, slots, grad_divisor)

    def _step_layout(
        self, layout: ChunkLayout, slots: Sequence[TensorSlot], divisor: float
    ) -> None:
        manager = self.manager
        manager.enter_moment(Moment(Phase.STEP, f"chunk {layout.index}"))
        chunks = manager.step_chunks(layout)
        home = manager.optimizer_homes[layout.index]  # type: ignore[index]
        try:
            device = chunks[ChunkKind.EXP_AVG].payload.device  # type: ignore[union-attr]
            steps = [self._step_tensor(s, device) for s in slots]
            torch._foreach_add_(steps, 1)
            step_of = dict(zip(map(id, slots), steps, strict=True))
            grad_scale = (
                None
                if divisor == 1.0
                else torch.tensor(divisor, dtype=torch.float32, device=device)
            )
            if ChunkKind.MASTER in chunks:
                self._step_mixed(chunks, slots, step_of, grad_scale, home)
            else:
                self._update(
                    slots,
                    chunks[ChunkKind.PARAM].views(slots),
                    manager.grad_views(slots),
                    chunks[ChunkKind.EXP_AVG].views(slots),
                    chunks[ChunkKind.EXP_AVG_SQ].views(slots),
                    steps,
                    grad_scale,
                )
        finally:
            manager.unpin(chunks.values())
        for slot in slots:
            slot.grad_in_param_slot = False
        manager.bind_layout(layout)

    def _step_mixed(self, chunks, slots, step_of, grad_scale, home: Tier) -> None:
        """fp32 masters: cast gradients to fp32 a workspace at a time, update, write back."""
        manager = self.manager
        total = sum(s.numel for s in slots)
        workspace = manager.allocate_workspace(
            min(total, WORKSPACE_ELEMENTS), torch.float32, home, {c.id for c in chunks.values()}
        )
        try:
            for batch in _pieces(slots, WORKSPACE_ELEMENTS):
                batch_slots = [slot for slot, _start, _stop in batch]

                def flat(views, batch=batch):
                    return [v.view(-1)[a:b] for v, (_s, a, b) in zip(views, batch, strict=True)]

                sizes = [stop - start for _slot, start, stop in batch]
                grads = list(torch.split(workspace[: sum(sizes)], sizes))
                torch._foreach_copy_(grads, flat([manager.grad_view(s) for s in batch_slots]))
                self._account_stream(batch, home, gradients=True)
                masters = flat([chunks[ChunkKind.MASTER].view(s) for s in batch_slots])
                self._update(
                    batch_slots,
                    masters,
                    grads,
                    flat([chunks[ChunkKind.EXP_AVG].view(s) for s in batch_slots]),
                    flat([chunks[ChunkKind.EXP_AVG_SQ].view(s) for s in batch_slots]),
                    [step_of[id(s)] for s in batch_slots],
                    grad_scale,
                )
                torch._foreach_copy_(
                    flat([chunks[ChunkKind.PARAM].view(s) for s in batch_slots]), masters
                )
                self._account_stream(batch, home, gradients=False)
        finally:
            manager.free_workspace(workspace, home)

    def _account_stream(self, batch, home: Tier, gradients: bool) -> None:
        """Bytes crossing tiers: gradients read into the home tier, or values written back."""
        by_chunk: dict[int, list] = {}
        for slot, start, stop in batch:
            chunks = slot.layout.chunks
            in_param = not gradients or slot.grad_in_param_slot
            chunk = chunks[ChunkKind.PARAM] if in_param else chunks[ChunkKind.GRAD]
            entry = by_chunk.setdefault(chunk.id, [chunk, 0])
            entry[1] += (stop - start) * chunk.dtype.itemsize
        for chunk, nbytes in by_chunk.values():
            if gradients:
                self.manager.transfer(chunk, chunk.tier, home, nbytes, "step gradients")
            else:
                self.manager.transfer(chunk, home, chunk.tier, nbytes, "step values")

    def _update(self, slots, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale) -> None:
        """One fused call per parameter group over aligned lists (slots may repeat: pieces)."""
        by_group: dict[int, list[int]] = {}
        for position, slot in enumerate(slots):
            by_group.setdefault(self.group_of[id(slot.param)], []).append(position)
        for group_index, positions in by_group.items():
            self._fused(
                group_index, positions, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale
            )

    def _fused(
        self, group_index, positions, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale
    ) -> None:
        group = self.param_groups[group_index]
        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        pick = lambda values: [values[i] for i in positions]  # noqa: E731
        kernel(
            pick(params),
            pick(grads),
            pick(exp_avgs),
            pick(exp_avg_sqs),
            [],
            pick(steps),
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
        manager = self.manager
        for layout in manager.trainable_layouts():
            slots = [s for s in layout.slots if s.grad_in_param_slot]
            if not slots:
                continue
            manager.enter_moment(Moment(Phase.STEP, f"chunk {layout.index}"))
            chunks = manager.step_chunks(layout)
            param_chunk, master = chunks[ChunkKind.PARAM], chunks[ChunkKind.MASTER]
            try:
                torch._foreach_copy_(param_chunk.views(slots), master.views(slots))
                nbytes = sum(s.numel for s in slots) * param_chunk.dtype.itemsize
                manager.transfer(param_chunk, master.tier, param_chunk.tier, nbytes, "restore")
            finally:
                manager.unpin(chunks.values())
            for slot in slots:
                slot.grad_in_param_slot = False
            manager.bind_layout(layout)

    def state_dict(self) -> dict[str, Any]:
        return {
            "param_groups": [dict(g) for g in self.param_groups],
            "steps": {slot.name: float(t) for slot, t in self.step_counts.items()},
        }


def _pieces(slots: Sequence[TensorSlot], limit: int) -> list[list[tuple[TensorSlot, int, int]]]:
    """Flat ranges ``(slot, start, stop)`` covering ``slots`` in batches of at most ``limit``
    elements; a slot larger than ``limit`` is cut (Adam is elementwise, so any cut is exact)."""
    batches: list[list[tuple[TensorSlot, int, int]]] = []
    current: list[tuple[TensorSlot, int, int]] = []
    size = 0
    for slot in slots:
        start = 0
        while start < slot.numel:
            take = min(slot.numel - start, limit - size)
            current.append((slot, start, start + take))
            size += take
            start += take
            if size == limit:
                batches.append(current)
                current, size = [], 0
    if current:
        batches.append(current)
    return batches


def global_grad_norm(manager: ChunkManager) -> float:
    """L2 norm over every gradient, computed where each gradient lives (no chunk moves).

    Like ``torch.nn.utils.clip_grad_norm_``: the norm of the per-tensor norms, in fp32.
    """
    norms = []
    for layout in manager.trainable_layouts():
        views = [manager.grad_view(s) for s in layout.slots if s.has_grad]
        if views:
            norms.extend(n.cpu() for n in torch._foreach_norm(views, 2, dtype=torch.float32))
    if not norms:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``clip_grad_norm_``'s factor: shrink only when the norm exceeds ``max_norm``."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
