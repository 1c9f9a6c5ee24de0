"""Gradient compression on the reducer seam (docs/compression.md): each method is a
:class:`zero.reduce.GradientReduction` that :class:`zero.reduce.ReduceScatterGrads` runs like
the exact reduce-scatter, at ZeRO stages 1-3, with nothing else in the engine changed.

- ``onebit``: sign and one scale per block with error feedback (``blockwise``);
- ``terngrad``: stochastic ternary, unbiased, stateless (``blockwise``);
- ``powersgd``: rank-r approximations with error feedback and warm starts (``powersgd``).

``compression.warmup_steps`` reduces exactly before compressing (:class:`WarmedUp`).
"""

from __future__ import annotations

import torch

from chunkmem.chunk import ChunkLayout
from chunkmem.config import CompressionConfig
from chunkmem.sharding import Waitable
from zero.comm import Communicator
from zero.compression.blockwise import BlockCode, BlockCodeReduceScatter
from zero.compression.powersgd import PowerSGDReduceScatter, PowerSGDSettings
from zero.compression.residuals import Residuals
from zero.wire import WireBuffers

__all__ = ["WarmedUp", "build_compressed_reduction"]


class WarmedUp:
    """``compressed`` from step ``steps`` on (``comm.tag``, the step this process is in),
    ``exact`` before it."""

    def __init__(self, comm: Communicator, steps: int, exact, compressed) -> None:
        self.comm = comm
        self.steps = steps
        self.exact = exact
        self.compressed = compressed

    def launch(self, layout: ChunkLayout, full: torch.Tensor, shard: torch.Tensor) -> Waitable:
        reduction = self.exact if self.comm.tag < self.steps else self.compressed
        return reduction.launch(layout, full, shard)


def build_compressed_reduction(
    config: CompressionConfig,
    comm: Communicator,
    wire: WireBuffers,
    residuals: Residuals,
    phase: str,
    exact,
):
    """The reduction ``config`` asks for, exact during its warm-up."""
    if config.type == "powersgd":
        settings = PowerSGDSettings(config.rank, config.min_compression_rate, config.seed)
        q_group = comm.new_group("powersgd_q", range(comm.size))
        compressed = PowerSGDReduceScatter(comm, wire, residuals, settings, phase, q_group)
    else:
        code = BlockCode(
            "onebit" if config.type == "onebit" else "ternary",
            config.block_size,
            config.clip_sigma if config.type == "terngrad" else 0.0,
            config.seed,
        )
        compressed = BlockCodeReduceScatter(comm, wire, residuals, code, phase)
    if not config.warmup_steps:
        return compressed
    return WarmedUp(comm, config.warmup_steps, exact, compressed)
