"""Gradient compression on the reducer seam (docs/compression.md): each method is a
:class:`zero.reduce.GradientReduction` that :class:`zero.reduce.ReduceScatterGrads` runs like
the exact reduce-scatter, at ZeRO stages 1-3, with nothing else in the engine changed.

- ``onebit``: sign and one scale per block with error feedback (``blockwise``);
- ``terngrad``: stochastic ternary, unbiased, no residual (``blockwise``);
- ``powersgd``: rank-r approximations with error feedback and warm starts (``powersgd``);
- ``dgc``: Deep Gradient Compression, block top-k with accumulation, momentum correction,
  local clipping and a sparsity warm-up (``topk``);
- ``auto``: one of them, or none, picked after the warm-up by a judge that measures the link,
  the step and the codecs (``judge``).

:class:`Scheduled` counts the steps the compressor has seen (a checkpoint keeps the count, so
a resumed run's warm-up and TernGrad's draws continue where they were) and reduces exactly for
the first ``compression.warmup_steps`` of them. With ``compression.freeze_variance``, a
:class:`VarianceFreeze` on the same count tells the optimizer to keep Adam's second moment from
then on (1-bit Adam's second stage); with DGC's momentum correction it also takes the reduced
momentum sums as its first moment.
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
from zero.compression.judge import (
    AutoCosts,
    AutoReduction,
    Candidate,
    Judge,
    block_codec_seconds,
    powersgd_codec_seconds,
    probe_link,
)
from zero.compression.powersgd import (
    PowerSGDReduceScatter,
    PowerSGDReduceScatterCosts,
    PowerSGDSettings,
)
from zero.compression.residuals import Residuals
from zero.compression.state import CompressionState, StepCounter, VarianceFreeze
from zero.compression.topk import (
    LocalClipping,
    TopKReduceScatter,
    TopKReduceScatterCosts,
    TopKSettings,
)
from zero.cycle_clock import CycleClock
from zero.kinds import DGC_VELOCITY
from zero.reduce import GradientReduction, GradientReductionCosts
from zero.topology import Topology
from zero.wire import WireBuffers

AUTO_CANDIDATES = ("onebit", "terngrad", "powersgd")

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
    steps (for checkpoints), with ``freeze_variance`` when Adam's variance freezes, and (DGC)
    when the engine leaves clipping to the compressor."""

    reduction: GradientReduction
    state: CompressionState
    variance: VarianceFreeze | None
    clipping: LocalClipping | None


def build_compressed_reduction(
    config: CompressionConfig,
    comm: Communicator,
    wire: WireBuffers,
    params: ParamStore,
    phase: str,
    exact: GradientReduction,
    gradient_clipping: float,
    clock: CycleClock,
) -> CompressedReduction:
    """The reduction ``config`` asks for (exact during its warm-up), its state and its
    variance schedule. ``auto`` probes the link here, so every rank must build it at the same
    point (``initialize`` does), and times the steps on ``clock``. ``gradient_clipping`` is
    the engine's, which DGC applies locally."""
    residuals = Residuals(wire.residency)
    stores = [residuals]
    counter = StepCounter()
    warm_q: dict[str, torch.Tensor] = {}
    methods = AUTO_CANDIDATES if config.type == "auto" else (config.type,)
    compressed: dict[str, GradientReduction] = {}
    clipping = None
    for method in methods:
        if method == "powersgd":
            powersgd = PowerSGDReduceScatter(
                comm, wire, residuals, _powersgd_settings(config), phase
            )
            warm_q, compressed[method] = powersgd.warm_q, powersgd
        elif method == "dgc":
            settings = _topk_settings(config, gradient_clipping)
            velocity = None
            if settings.momentum is not None:
                velocity = Residuals(wire.residency, DGC_VELOCITY)
                stores.append(velocity)
            compressed[method] = TopKReduceScatter(
                comm, wire, residuals, velocity, settings, phase, counter, params
            )
            clipping = LocalClipping(counter, settings)
        else:
            code = _block_code(config, method)
            compressed[method] = BlockCodeReduceScatter(comm, wire, residuals, code, phase, counter)
    judge = None
    after_warmup: GradientReduction
    if config.type == "auto":
        assert comm.topology is not None  # the strategy sets it
        candidates = {
            m: Candidate(compressed[m], _costs(m, config, comm.topology, phase), _codec(m, config))
            for m in methods
        }
        probe = probe_link(comm, wire.residency.device.torch_device)
        judge = Judge(comm, params, counter, clock, probe, candidates, config.auto_min_gain, phase)
        after_warmup, compressed_from = AutoReduction(judge, exact), judge.compressed_from
    else:
        after_warmup = compressed[config.type]

        def compressed_from() -> int:
            return config.warmup_steps + 1

    state = CompressionState(config.type, params, stores, comm.rank, warm_q, counter, judge)
    variance = None
    if config.freeze_variance:
        momentum = config.momentum if config.type == "dgc" and config.momentum_correction else None
        variance = VarianceFreeze(counter, compressed_from, momentum)
    scheduled = Scheduled(comm, counter, config.warmup_steps, exact, after_warmup)
    return CompressedReduction(scheduled, state, variance, clipping)


def compressed_reduction_costs(
    config: CompressionConfig,
    topology: Topology,
    phase: str,
    exact: GradientReductionCosts,
    itemsize: int,
) -> GradientReductionCosts:
    """The cost model of the reduction :func:`build_compressed_reduction` builds, in its
    steady state (after the warm-up); ``auto``'s is :class:`AutoCosts` (``exact``'s traffic,
    the largest candidate's memory). ``itemsize``: the gradients' (DGC sends them as they are)."""
    if config.type == "auto":
        return AutoCosts(exact, [_costs(m, config, topology, phase) for m in AUTO_CANDIDATES])
    if config.type == "dgc":
        settings = _topk_settings(config, gradient_clipping=0.0)  # clipping moves no bytes
        return TopKReduceScatterCosts(topology, settings, itemsize, phase)
    return _costs(config.type, config, topology, phase)


def _costs(
    method: str, config: CompressionConfig, topology: Topology, phase: str
) -> GradientReductionCosts:
    if method == "powersgd":
        return PowerSGDReduceScatterCosts(topology, _powersgd_settings(config), phase)
    return BlockCodeReduceScatterCosts(topology, _block_code(config, method), phase)


def _codec(method: str, config: CompressionConfig):
    if method == "powersgd":
        return powersgd_codec_seconds(_powersgd_settings(config))
    return block_codec_seconds(_block_code(config, method))


def _powersgd_settings(config: CompressionConfig) -> PowerSGDSettings:
    return PowerSGDSettings(config.rank, config.min_compression_rate, config.seed)


def _topk_settings(config: CompressionConfig, gradient_clipping: float) -> TopKSettings:
    return TopKSettings(
        config.block_size,
        config.density,
        config.sparsity_warmup_steps,
        config.warmup_steps,
        config.momentum if config.momentum_correction else None,
        gradient_clipping,
        # momentum correction under Adam comes with freeze_variance, under SGD without it
        velocity_averages=config.freeze_variance,
    )


def _block_code(config: CompressionConfig, method: str) -> BlockCode:
    return BlockCode(
        "onebit" if method == "onebit" else "ternary",
        config.block_size,
        config.clip_sigma if method == "terngrad" else 0.0,
        config.seed,
    )
