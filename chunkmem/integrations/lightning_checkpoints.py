"""A Lightning checkpoint as chunkmem's: the engine's DCP directory, with the rest of
Lightning's checkpoint dict (loops, callbacks, schedulers) as its client state; saved on every
rank, replacing a directory already there only once the new one is complete, and loaded back.

Split from ``chunkmem.integrations.lightning``: ``ChunkmemStrategy.save_checkpoint`` and
``load_checkpoint`` are Lightning's hooks and call these.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkmem.errors import CheckpointError

if TYPE_CHECKING:
    from chunkmem.integrations.lightning import ChunkmemStrategy

# Keys of Lightning's checkpoint dict that the DCP checkpoint holds itself.
_IN_DCP = ("state_dict", "optimizer_states")


def save_checkpoint_directory(
    strategy: ChunkmemStrategy, checkpoint: dict[str, Any], filepath: Any, storage_options: Any
) -> None:
    if strategy.engine is None:
        raise CheckpointError(
            "ChunkmemStrategy saves checkpoints while its engine is open, during fit; at "
            "the end of fit it closed the engine and gave the module its parameters back. "
            "Save from ModelCheckpoint or a callback during fit (or take the weights: "
            "module.state_dict())"
        )
    if storage_options is not None:
        raise TypeError(
            "ChunkmemStrategy writes chunkmem checkpoints (DCP directories); "
            "storage_options is for a CheckpointIO plugin, which it does not use"
        )
    target = Path(strategy.broadcast(str(filepath)))
    client_state = {key: value for key, value in checkpoint.items() if key not in _IN_DCP}
    if not strategy.broadcast(target.exists()):
        strategy.engine.save_checkpoint(target, client_state=client_state)
        return
    staged = target.with_name(f"{target.name}.chunkmem-new")
    retired = target.with_name(f"{target.name}.chunkmem-old")
    if strategy.is_global_zero:  # what a save killed between the renames below left
        shutil.rmtree(staged, ignore_errors=True)
        shutil.rmtree(retired, ignore_errors=True)
    strategy.barrier()
    strategy.engine.save_checkpoint(staged, client_state=client_state)
    if strategy.is_global_zero:
        target.rename(retired)
        staged.rename(target)
        shutil.rmtree(retired)
    strategy.barrier()


def load_checkpoint_directory(strategy: ChunkmemStrategy, checkpoint_path: Any) -> Any:
    assert strategy.engine is not None
    path = Path(strategy.broadcast(str(checkpoint_path)))
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file; ChunkmemStrategy resumes from the checkpoint directories "
            f"it saves. To start from another run's weights, load them into the "
            f"LightningModule before fit (LightningModule.load_from_checkpoint)"
        )
    return strategy.engine.load_checkpoint(path)
