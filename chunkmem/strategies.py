"""Which strategy a config runs: the one place ``chunkmem.initialize`` picks the seams and
``chunkmem estimate`` picks their cost models (``chunkmem.costs``), so the two cannot differ."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from chunkmem.config import Config
from chunkmem.costs import GathererCosts, ReducerCosts, ShardingCosts, StrategyCosts
from chunkmem.errors import ConfigError
from chunkmem.sharding import Strategy

if TYPE_CHECKING:
    from zero.comm import Communicator


def build_strategy(config: Config, comm: Communicator | None, device: torch.device) -> Strategy:
    """One process alone (no ``comm``), or ZeRO over ``comm``'s world."""
    if comm is None:
        return Strategy()
    from zero.strategy import ZeroStrategy

    return ZeroStrategy(config.zero, comm, device, config.compression, config.gradient_clipping)


def strategy_costs(
    config: Config, world_size: int, node_size: int, itemsize: int, gpu: bool = True
) -> StrategyCosts:
    """Fresh cost models of the seams :func:`build_strategy` gives ``config`` on
    ``world_size`` ranks of ``node_size`` per node, computing in ``itemsize``-byte values;
    ``gpu`` False: on the simulated device (host tensors: gloo's host paths)."""
    if not config.zero.stage:
        if world_size > 1:
            raise ConfigError(
                f"world size {world_size} with config key 'zero.stage' 0: stage 0 is one "
                f"process; set zero.stage to 1, 2 or 3 for several ranks"
            )
        return StrategyCosts(ShardingCosts(), GathererCosts(), ReducerCosts())
    from zero.strategy import ZeroStrategy

    return ZeroStrategy.costs(
        config.zero, world_size, node_size, itemsize, config.compression, host_tensors=not gpu
    )
