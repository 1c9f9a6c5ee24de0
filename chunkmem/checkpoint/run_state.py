"""The run's state outside the chunks: optimizer hyper-parameters, loss scaler, LR scheduler,
global step, and each rank's random number generators.

The LR scheduler is ``engine.lr_scheduler`` (a torch scheduler or one of
``chunkmem.schedulers``: anything with ``state_dict`` and ``load_state_dict``); None: nothing
to save. RNG states are per rank: the CPU
generator, CUDA's where CUDA is initialized, Python's ``random`` and NumPy's global one.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from chunkmem.engine import Engine

_log = logging.getLogger("chunkmem")


def engine_state(engine: Engine) -> dict[str, Any]:
    scheduler = engine.lr_scheduler
    return {
        "global_steps": engine.global_steps,
        "param_groups": [
            {key: group[key] for key in engine.optimizer.rule.hyper_parameter_keys}
            for group in engine.optimizer.param_groups
        ],
        "loss_scaler": engine.scaler.state_dict(),
        "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
    }


def restore_engine_state(engine: Engine, state: dict[str, Any]) -> None:
    """Hyper-parameters are set in the existing group dicts (as ``Optimizer.load_state_dict``
    does), so a scheduler holding them keeps working."""
    engine.global_steps = state["global_steps"]
    for group, saved in zip(engine.optimizer.param_groups, state["param_groups"], strict=True):
        group.update(saved)
    engine.scaler.load_state_dict(state["loss_scaler"])
    scheduler = engine.lr_scheduler
    saved_scheduler = state["lr_scheduler"]
    if scheduler is not None and saved_scheduler is not None:
        scheduler.load_state_dict(saved_scheduler)
    elif saved_scheduler is not None:
        _log.warning(
            "the checkpoint holds an LR scheduler's state but the engine has none: the "
            "learning rate stays where the checkpoint left it"
        )
    elif scheduler is not None:
        _log.warning(
            "the engine has an LR scheduler but the checkpoint holds none: the scheduler "
            "starts afresh from the checkpoint's learning rates"
        )


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            _log.warning(
                "CUDA RNG states not restored: saved for %d devices, %d present",
                len(state["cuda"]),
                torch.cuda.device_count(),
            )
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
