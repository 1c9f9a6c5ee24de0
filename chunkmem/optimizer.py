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

_HYPER = ("lr", "betas", "eps", "weight_decay")
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
        workspace = None
        try:
            if ChunkKind.MASTER in chunks:
                params = chunks[ChunkKind.MASTER].views(slots)
                workspace = manager.allocate_workspace(
                    sum(s.numel for s in slots),
                    torch.float32,
                    home,
                    {c.id for c in chunks.values()},
                )
                grads = list(torch.split(workspace, [s.numel for s in slots]))
                grads = [g.view(s.shape) for g, s in zip(grads, slots, strict=True)]
                torch._foreach_copy_(grads, manager.grad_views(slots))
            else:
                params = chunks[ChunkKind.PARAM].views(slots)
                grads = manager.grad_views(slots)
            exp_avgs = chunks[ChunkKind.EXP_AVG].views(slots)
            exp_avg_sqs = chunks[ChunkKind.EXP_AVG_SQ].views(slots)
            device = params[0].device
            steps = [self._step_tensor(s, device) for s in slots]
            by_group: dict[int, list[int]] = {}
            for position, slot in enumerate(slots):
                by_group.setdefault(self.group_of[id(slot.param)], []).append(position)
            torch._foreach_add_(steps, 1)
            grad_scale = (
                None
                if divisor == 1.0
                else torch.tensor(divisor, dtype=torch.float32, device=device)
            )
            for group_index, positions in by_group.items():
                self._fused(
                    group_index, positions, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale
                )
            if ChunkKind.MASTER in chunks:
                torch._foreach_copy_(chunks[ChunkKind.PARAM].views(slots), params)
        finally:
            if workspace is not None:
                manager.free_workspace(workspace, home)
            manager.unpin(chunks.values())
        for slot in slots:
            slot.grad_in_param_slot = False
        if home is Tier.DEVICE:
            manager.bind_layout(layout)

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
            try:
                torch._foreach_copy_(
                    [chunks[ChunkKind.PARAM].view(s) for s in slots],
                    [chunks[ChunkKind.MASTER].view(s) for s in slots],
                )
            finally:
                manager.unpin(chunks.values())
            for slot in slots:
                slot.grad_in_param_slot = False
            if manager.optimizer_homes[layout.index] is Tier.DEVICE:  # type: ignore[index]
                manager.bind_layout(layout)

    def state_dict(self) -> dict[str, Any]:
        return {
            "param_groups": [dict(g) for g in self.param_groups],
            "steps": {slot.name: float(t) for slot, t in self.step_counts.items()},
        }


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
