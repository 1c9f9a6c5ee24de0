"""Joining the data-parallel world, and checking that every rank agrees before training.

A rank with another config, another model or other initial weights (another seed) would
train something else and, sooner or later, call a collective its peers never call: a hang.
So every rank shares a fingerprint at initialize and every rank raises the same clear error
when they differ.
"""

from __future__ import annotations

from typing import Any

import torch

from chunkmem.config import Config
from chunkmem.errors import ConfigError
from zero.comm import Communicator, init_world


def join_world(config: Config) -> Communicator:
    """The world group from torchrun's environment (or an existing default group)."""
    world = init_world(backend=config.zero.backend, timeout_s=config.zero.timeout_s)
    return Communicator(world, rings=config.zero.transport == "ring")


def fingerprint(
    model: torch.nn.Module, config: Config, chunk_sizes: tuple[int, int]
) -> dict[str, Any]:
    """What every rank must agree on: config, chunk size, parameter names, shapes and values."""
    params = list(model.named_parameters())
    with torch.no_grad():
        total = sum(float(p.detach().double().sum()) for _n, p in params)
        squares = sum(float(p.detach().double().square().sum()) for _n, p in params)
    return {
        "torch": torch.__version__,
        "config": config.model_dump(mode="json"),
        "chunk_sizes": chunk_sizes,  # trainable, frozen
        "parameters": [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in params],
        "values": (total, squares),
    }


def check_ranks_agree(comm: Communicator, mine: dict[str, Any]) -> None:
    """Raise the same :class:`ConfigError` on every rank if any rank differs from rank 0."""
    everyone = comm.all_gather_object(mine)
    reference = everyone[0]
    problems = []
    for rank, theirs in enumerate(everyone[1:], start=1):
        for key in reference:
            if theirs[key] == reference[key]:
                continue
            if key == "config":
                for path in _differing_keys(reference[key], theirs[key]):
                    problems.append(f"rank {rank} has config key {path!r} different from rank 0")
            elif key == "values":
                problems.append(
                    f"rank {rank}'s initial parameter values differ from rank 0's (checksums "
                    f"{theirs[key]} vs {reference[key]}): seed every rank the same before "
                    f"building the model"
                )
            else:
                problems.append(f"rank {rank}'s {key} differs from rank 0's")
    if problems:
        raise ConfigError("data-parallel ranks disagree at initialize:\n  " + "\n  ".join(problems))


def _differing_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [p for k in keys for p in _differing_keys(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]
