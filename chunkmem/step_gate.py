"""Whether the optimizer step is taken, and with what gradient divisor, once every gradient of
the accumulation window is in: the loss scale, gradient clipping, speculative early updates
(``offload.speculation``) and the non-finite policy, decided from one global norm.

Split from the engine (which keeps the calls in order and owns the cycle) so that the rules
a step passes through read in one place, in the order they apply.
"""

from __future__ import annotations

import logging
import math

import torch

from chunkmem.config import Config
from chunkmem.loss_scaler import DynamicLossScaler, StaticLossScale
from chunkmem.optimizer import ChunkOptimizer, clip_coefficient
from chunkmem.sharding import GradReducer

_log = logging.getLogger("chunkmem")


class StepGate:
    """Decides each optimizer step from the global gradient norm. It remembers the last
    step's norm (before clipping; above the clip, it fired) and what became of its
    speculative early updates ("commit", "rollback" or None where none were taken)."""

    def __init__(
        self,
        config: Config,
        optimizer: ChunkOptimizer,
        reducer: GradReducer,
        scaler: DynamicLossScaler | StaticLossScale,
    ) -> None:
        self.config = config
        self.optimizer = optimizer
        self.reducer = reducer
        self.scaler = scaler
        self.last_grad_norm: float | None = None
        self.last_speculation: str | None = None

    def begin_step(self) -> None:
        """A new ``engine.step()``: nothing is known of its speculation yet."""
        self.last_speculation = None

    def decide(self, step: int) -> tuple[bool, float]:
        """(skip step ``step``, gradient divisor). The global norm is computed every step: it
        is the clipping norm, and it tells non-finite gradients (one read of the gradients;
        under ZeRO one small all-reduce, with the presence votes, so every rank decides
        alike). Settles the early updates begun in backward: they stand, or are undone,
        before this returns."""
        scale = self.scaler.scale
        norm = self._global_norm() / scale
        self.last_grad_norm = norm
        max_norm = self.reducer.global_clipping(self.config.gradient_clipping)
        coefficient = clip_coefficient(norm, max_norm)
        speculated = self.optimizer.speculating
        held = math.isfinite(norm) and coefficient == 1.0
        self.optimizer.settle_speculation(held)
        if speculated:
            self.last_speculation = "commit" if held else "rollback"
        if math.isfinite(norm):
            return False, scale / coefficient
        if self.config.precision == "fp16":
            return True, 1.0  # an overflow: the loss scaler backs off
        begun = self.optimizer.layouts_updated
        if begun:  # offload.overlap updated these in backward: nothing to skip or undo
            raise FloatingPointError(
                f"step {step}: the global gradient norm is {norm}, and {begun} chunk group(s) "
                f"were already updated during backward (offload.overlap); the engine cannot "
                f"undo them. Restore the last checkpoint"
            )
        if self.config.nonfinite == "skip":
            _log.warning("step %d skipped: the gradient norm is %s (nonfinite: skip)", step, norm)
            return True, 1.0
        raise FloatingPointError(
            f"step {step}: the global gradient norm is {norm}, some gradient is NaN or "
            f"infinite. The step was not taken and its gradients were discarded; the next "
            f"batch may train. Lower the learning rate or check the data, or set config "
            f"'nonfinite': 'skip' to skip such steps"
        )

    def _global_norm(self) -> float:
        """The L2 norm of the gradients the update will use (averaged over ranks under ZeRO).
        Ranks sum their per-parameter squares with the reducer's presence votes in one small
        all-reduce, one latency-bound collective a step, not two, and the norm counts the
        parameters some rank gave a gradient, the ones the update steps."""
        votes = self.reducer.presence_votes()
        if not votes.numel():  # gradients stay on their rank: its norm is the global one
            return float(self.optimizer.local_grad_norm())
        optimizer, sharding = self.optimizer, self.optimizer.sharding
        message = torch.cat([votes, optimizer.grad_squares_by_parameter()])
        sharding.all_reduce_sum(message)
        votes, squares = message.split(votes.numel())
        self.reducer.agree_presence(votes)
        return math.sqrt(float(squares[votes > 0].sum())) / sharding.world_size
