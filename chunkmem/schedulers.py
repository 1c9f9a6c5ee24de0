"""Learning-rate schedules as DeepSpeed defines them: ``WarmupLR``, ``WarmupDecayLR`` and
``WarmupCosineLR`` (``deepspeed/runtime/lr_schedules.py``), over anything with
``param_groups`` (the engine's ``ChunkOptimizer``, a torch optimizer).

The formulas, defaults and the ``last_batch_iteration`` counting are DeepSpeed's, so a
DeepSpeed config's schedule gives the same learning rate at every step: built at iteration
-1 (the first update runs at ``warmup_min_lr``, or at ``warmup_min_ratio`` of the learning
rate), stepped after each update taken. The engine steps the one in its config (or the one
passed to ``initialize``) itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from chunkmem.config import SchedulerConfig


class HasParamGroups(Protocol):
    param_groups: list[dict[str, Any]]


class _Schedule:
    """What every schedule shares: one learning rate per group, stepped by iteration."""

    def __init__(
        self, optimizer: HasParamGroups, warmup_num_steps: int, warmup_type: str, last: int
    ) -> None:
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last
        self._last_lr: list[float] = []

    def _warmup_fraction(self) -> float:
        """0 to 1 over the warm-up: log(i + 1) / log(n), or i / n."""
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._set(self.get_lr())

    def _set(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = lrs

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]

    def _per_group(self, value: float | Sequence[float], name: str) -> list[float]:
        groups = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != groups:
                raise ValueError(f"expected {groups} values for {name}, got {len(value)}")
            return [float(v) for v in value]
        return [float(value)] * groups


class WarmupLR(_Schedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps (log or
    linear), then constant. ``warmup_max_lr`` None: the first group's learning rate."""

    def __init__(
        self,
        optimizer: HasParamGroups,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = float(optimizer.param_groups[0]["lr"])
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [
            big - small for big, small in zip(self.max_lrs, self.min_lrs, strict=True)
        ]
        if last_batch_iteration == -1:
            self._set(self.get_lr())

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [
            low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs, strict=True)
        ]

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: HasParamGroups,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return max(
            0.0,
            float(self.total_num_steps - self.last_batch_iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR(_Schedule):
    """The learning rate times a ratio: from ``warmup_min_ratio`` to 1 over the warm-up, then
    a cosine down to ``cos_min_ratio`` at ``total_num_steps``, where it stays."""

    def __init__(
        self,
        optimizer: HasParamGroups,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._set(self.get_lr())

    def get_lr_ratio(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            ratio = self._warmup_fraction()
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULES: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def build_scheduler(config: SchedulerConfig, optimizer: HasParamGroups) -> _Schedule | None:
    """The schedule ``config`` names, over ``optimizer``'s groups; None when it names none."""
    if config.type is None:
        return None
    return SCHEDULES[config.type](optimizer, **config.schedule_params())
