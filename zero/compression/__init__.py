"""Gradient compression on the reducer seam (docs/compression.md): each method is a
:class:`zero.reduce.GradientReduction` that :class:`zero.reduce.ReduceScatterGrads` runs like
the exact reduce-scatter, at ZeRO stages 1-3, with nothing else in the engine changed.

- ``onebit``: sign and one scale per block with error feedback (``blockwise``);
- ``terngrad``: stochastic ternary, unbiased, no residual (``blockwise``);
- ``powersgd``: rank-r approximations with error feedback and warm starts (``powersgd``).

:class:`Scheduled` counts the steps the compressor has seen (a checkpoint keeps the count, so
a resumed run's warm-up and TernGrad's draws continue where they were) and reduces exactly for
the first ``compression.warmup_steps`` of them. With ``compression.freeze_variance``, a
:class:`VarianceFreeze` on the same count tells the optimizer to keep Adam's second moment from
then on (1-bit Adam's second stage).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from chunkmem.chunk import ChunkLayout
from chunkmem.config import CompressionConfig
from chunkmem.params import ParamStore
from chunkmem.sharding import Waitable
from zero.comm import Communicator
from zero.compression.blockwise import (
    BlockCode,
    BlockCodeReduceScatter,
    BlockCodeReduceScatterCosts,
)
from zero.compression.powersgd import (
    PowerSGDReduceScatter,
    PowerSGDReduceScatterCosts,
    PowerSGDSettings,
)
from zero.compression.residuals import Residuals
from zero.compression.state import CompressionState, StepCounter, VarianceFreeze
from zero.reduce import GradientReduction, GradientReductionCosts
from zero.topology import Topology
from zero.wire import WireBuffers

__all__ = [
    "CompressedReduction",
    "Scheduled",
    "build_compressed_reduction",
    "compressed_reduction_costs",
]


class Scheduled:
    """Advances ``counter`` on the first launch of each step (the communicator's tag changes
    once a cycle), then launches ``exact`` for the first ``warmup_steps`` steps and
    ``compressed`` after."""

    def __init__(
        self,
        comm: Communicator,
        counter: StepCounter,
        warmup_steps: int,
        exact: GradientReduction,
        compressed: GradientReduction,
    ) -> None:
        self.comm = comm
        self.counter = counter
        self.warmup_steps = warmup_steps
        self.exact = exact
        self.compressed = compressed

    def launch(self, layout: ChunkLayout, full: torch.Tensor, shard: torch.Tensor) -> Waitable:
        self.counter.observe(self.comm.tag)
        warming = self.counter.steps <= self.warmup_steps
        return (self.exact if warming else self.compressed).launch(layout, full, shard)


class CompressedReduction(NamedTuple):
    """What :func:`build_compressed_reduction` builds: the reduction, the state it keeps across
    steps (for checkpoints) and, with ``freeze_variance``, when Adam's variance freezes."""

    reduction: GradientReduction
    state: CompressionState
    variance: VarianceFreeze | None


def build_compressed_reduction(
    config: CompressionConfig,
    comm: Communicator,
    wire: WireBuffers,
    params: ParamStore,
    phase: str,
    exact: GradientReduction,
) -> CompressedReduction:
    """The reduction ``config`` asks for (exact during its warm-up), its state and its
    variance schedule."""
    residuals = Residuals(wire.residency)
    counter = StepCounter()
    warm_q: dict[str, torch.Tensor] = {}
    compressed: GradientReduction
    if config.type == "powersgd":
        powersgd = PowerSGDReduceScatter(comm, wire, residuals, _powersgd_settings(config), phase)
        warm_q, compressed = powersgd.warm_q, powersgd
    else:
        compressed = BlockCodeReduceScatter(
            comm, wire, residuals, _block_code(config), phase, counter
        )
    state = CompressionState(config.type, params, residuals, comm.rank, warm_q, counter)
    variance = VarianceFreeze(counter, config.warmup_steps) if config.freeze_variance else None
    scheduled = Scheduled(comm, counter, config.warmup_steps, exact, compressed)
    return CompressedReduction(scheduled, state, variance)


def compressed_reduction_costs(
    config: CompressionConfig, topology: Topology, phase: str
) -> GradientReductionCosts:
    """The cost model of the reduction :func:`build_compressed_reduction` builds, in its
    steady state (after the warm-up)."""
    if config.type == "powersgd":
        return PowerSGDReduceScatterCosts(topology, _powersgd_settings(config), phase)
    return BlockCodeReduceScatterCosts(topology, _block_code(config), phase)


def _powersgd_settings(config: CompressionConfig) -> PowerSGDSettings:
    return PowerSGDSettings(config.rank, config.min_compression_rate, config.seed)


def _block_code(config: CompressionConfig) -> BlockCode:
    return BlockCode(
        "onebit" if config.type == "onebit" else "ternary",
        config.block_size,
        config.clip_sigma if config.type == "terngrad" else 0.0,
        config.seed,
    )
