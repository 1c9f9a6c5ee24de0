"""Dynamic loss scaling for fp16: overflow skips the step and lowers the scale."""

from __future__ import annotations

from chunkmem.config import LossScaleConfig


class DynamicLossScaler:
    """Scale the loss so fp16 gradients do not underflow; back off on overflow.

    After ``growth_interval`` consecutive overflow-free steps the scale grows by
    ``growth_factor``; an overflow multiplies it by ``backoff_factor`` (not below
    ``min_scale``) and the step is skipped.
    """

    def __init__(self, config: LossScaleConfig) -> None:
        self.scale = config.initial_scale
        self._config = config
        self._good_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self._config.backoff_factor, self._config.min_scale)
            self._good_steps = 0
            self.skipped_steps += 1
            return
        self._good_steps += 1
        if self._good_steps >= self._config.growth_interval:
            self.scale *= self._config.growth_factor
            self._good_steps = 0


class StaticLossScale:
    """fp32/bf16 training: the loss is never scaled and no step is ever skipped for it."""

    scale = 1.0
    skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        return None
