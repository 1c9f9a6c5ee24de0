"""The optimizer's parameter groups as the fused Adam kernels take them: which kernel runs
(Adam, AdamW, or the frozen-variance update of 1-bit Adam's second stage), each group's
hyper-parameters, and a layout's pieces sorted by group. Shared by the native host kernels
(``chunkmem.update_builder``) and torch's (``chunkmem.torch_update``), so that both read the
same group settings the same way."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from chunkmem.chunk import TensorSlot
from chunkmem.frozen_adam import frozen_variance_adam_
from chunkmem.grads import GradStore


class AdamGroups:
    """``param_groups`` is the optimizer's list, read at every step (a scheduler may change
    it); ``group_of`` maps ``id(parameter)`` to its group's index; ``decoupled``: AdamW."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        group_of: dict[int, int],
        decoupled: bool,
        grads: GradStore,
    ) -> None:
        self.param_groups = param_groups
        self.group_of = group_of
        self.decoupled = decoupled
        self.grads = grads

    def kernel(self, adam: Callable[..., None], adamw: Callable[..., None]) -> Callable[..., None]:
        """The update of this step: the frozen-variance one once the reducer's schedule says
        the variance is frozen, else ``adamw`` or ``adam`` (a kernel family's two)."""
        variance = self.grads.reducer.variance
        frozen = None if variance is None else variance.steps_frozen()
        if frozen is None:
            return adamw if self.decoupled else adam
        return functools.partial(
            frozen_variance_adam_,
            decoupled=self.decoupled,
            steps_frozen=frozen,
            momentum_in_gradients=variance.momentum_in_gradients,
        )

    def by_group(self, slots: Sequence[TensorSlot]) -> dict[int, list[int]]:
        """Positions in ``slots`` by parameter group (slots may repeat: pieces)."""
        by_group: dict[int, list[int]] = {}
        for position, slot in enumerate(slots):
            by_group.setdefault(self.group_of[id(slot.param)], []).append(position)
        return by_group

    def hyper_parameters(self, group_index: int) -> dict[str, float]:
        """A parameter group's hyper-parameters as the fused kernels' keyword arguments."""
        group = self.param_groups[group_index]
        beta1, beta2 = group["betas"]
        return {
            "lr": float(group["lr"]),
            "beta1": beta1,
            "beta2": beta2,
            "weight_decay": group["weight_decay"],
            "eps": group["eps"],
        }
