"""What an engine hands out and takes back between steps: the state dict, checkpoints, and
the parameters' values when it closes. Kept out of the training cycle's module; a checkpoint
call checks the engine is between steps and stops it where a failure leaves it inconsistent."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from chunkmem import engine_aborts

if TYPE_CHECKING:
    from chunkmem.engine import Engine


def state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    """The model's state dict on the CPU (see ``Engine.state_dict``)."""
    values = engine.params.parameter_values()
    state = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        packed = values.get(id(value)) if isinstance(value, torch.nn.Parameter) else None
        if packed is not None:
            state[key] = packed.clone()
        else:
            state[key] = value.detach().to("cpu", copy=True)
    return state


def save_checkpoint(engine: Engine, directory: str | Path, client_state: Any) -> Path:
    """Write ``engine``'s checkpoint (see ``Engine.save_checkpoint``)."""
    engine._check_between_steps("save_checkpoint")
    from chunkmem.checkpoint import save_checkpoint as save  # DCP is imported when first used

    engine.wait_for_parameters()
    with engine_aborts.stopping_on_collective_failure(engine):
        return save(engine, directory, client_state)


def load_checkpoint(engine: Engine, directory: str | Path) -> Any:
    """Load a checkpoint into ``engine`` (see ``Engine.load_checkpoint``)."""
    engine._check_between_steps("load_checkpoint")
    from chunkmem.checkpoint import prepare_load

    engine.wait_for_parameters()
    with engine_aborts.stopping_on_collective_failure(engine):
        load = prepare_load(engine, directory)
        try:
            return load()
        except BaseException as error:
            if engine.stopped_because is None:
                engine._stop(
                    f"load_checkpoint({str(directory)!r}) failed part-way "
                    f"({type(error).__name__}: {error}); parameters and optimizer states "
                    f"may be partly loaded"
                )
            raise


def restore_parameters(engine: Engine) -> None:
    """Every parameter an ordinary tensor again, with its current value, original dtype and
    device."""
    params = engine.params
    if not params.all_packed:
        params.pack_remaining(engine.residency.tiers.spill)
    values = params.parameter_values()
    for key, slot in params.slots.items():
        dtype, device = params.original[key]
        slot.param.data = values[key].to(device=device, dtype=dtype, copy=True)
        slot.bound = False
