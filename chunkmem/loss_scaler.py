"""Dynamic loss scaling for fp16: overflow skips the step and lowers the scale."""

from __future__ import annotations

from chunkmem.config import LossScaleConfig
from chunkmem.errors import NonFiniteError


class DynamicLossScaler:
    """Scale the loss so fp16 gradients do not underflow; back off on overflow.

    After ``growth_interval`` consecutive overflow-free steps the scale grows by
    ``growth_factor``; an overflow multiplies it by ``backoff_factor`` (not below
    ``min_scale``) and the step is skipped. ``max_skips_at_min_scale`` overflows in a row at
    ``min_scale`` raise: such a run can never make a step.
    """

    def __init__(self, config: LossScaleConfig) -> None:
        self.scale = config.initial_scale
        self._config = config
        self._good_steps = 0
        self._skips_at_min = 0
        self.skipped_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "good_steps": self._good_steps,
            "skips_at_min": self._skips_at_min,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._skips_at_min = int(state["skips_at_min"])
        self.skipped_steps = int(state["skipped_steps"])

    def update(self, found_inf: bool) -> None:
        if found_inf:
            at_min = self.scale <= self._config.min_scale
            self._skips_at_min = self._skips_at_min + 1 if at_min else 0
            if self._skips_at_min >= self._config.max_skips_at_min_scale:
                raise NonFiniteError(
                    f"fp16 gradients overflowed {self._skips_at_min} steps in a row at the "
                    f"minimum loss scale {self._config.min_scale:g}: no step can be made. The "
                    f"model produces infinite or NaN gradients even unscaled; lower the "
                    f"learning rate, check the data, or train in bf16"
                )
            self.scale = max(self.scale * self._config.backoff_factor, self._config.min_scale)
            self._good_steps = 0
            self.skipped_steps += 1
            return
        self._skips_at_min = 0
        self._good_steps += 1
        if self._good_steps >= self._config.growth_interval:
            self.scale *= self._config.growth_factor
            self._good_steps = 0


class StaticLossScale:
    """fp32/bf16 training: the loss is never scaled; ``skipped_steps`` counts the steps
    ``nonfinite: skip`` skipped."""

    scale = 1.0

    def __init__(self) -> None:
        self.skipped_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.skipped_steps = int(state["skipped_steps"])

    def update(self, found_inf: bool) -> None:
        self.skipped_steps += found_inf
