"""Checkpoints through ``torch.distributed.checkpoint``: save, load (with resharding), and
consolidation into one state dict.

- :func:`save_checkpoint`: every rank writes the boxes of each parameter its shard covers
  (values, Adam moments, step counts), plus the run state, its RNG states and the caller's
  ``client_state``, into a temporary directory that rank 0 renames into place
  (:mod:`~chunkmem.checkpoint.commit`).
- :func:`prepare_load`: checks that the checkpoint is complete and fits the engine (changing
  nothing); calling what it returns reads every chunk's span in place, at any world size,
  ZeRO stage or chunk size.
- :func:`consolidate`: one full-precision state dict, streamed one parameter at a time.

The layout on disk and what a checkpoint does and does not hold: docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp

from chunkmem.checkpoint import commit
from chunkmem.checkpoint.consolidate import consolidate
from chunkmem.checkpoint.manifest import describe, differences
from chunkmem.checkpoint.pieces import (
    ChunkAccess,
    load_pieces,
    model_key,
    owned_span,
    save_pieces,
    step_counts,
    step_key,
)
from chunkmem.checkpoint.planners import PieceLoadPlanner, PieceSavePlanner
from chunkmem.checkpoint.run_state import (
    engine_state,
    restore_engine_state,
    restore_rng_state,
    rng_state,
)
from chunkmem.errors import CheckpointError
from chunkmem.params import ParamStore
from chunkmem.tiers import StorageTier

if TYPE_CHECKING:
    from chunkmem.engine import Engine

__all__ = ["consolidate", "prepare_load", "save_checkpoint"]

_log = logging.getLogger("chunkmem")


def save_checkpoint(engine: Engine, directory: str | os.PathLike, client_state: Any = None) -> Path:
    """Write ``engine``'s training state to the new directory ``directory``; every rank
    calls it between optimizer steps. Returns the directory's absolute path."""
    target = Path(os.path.abspath(directory))
    params, sharding = engine.params, engine.params.sharding
    if not params.all_packed:  # saved before the first forward
        params.pack_remaining(engine.residency.tiers.spill)
    manifest = describe(engine)
    temporary = commit.begin(target, sharding)
    rank = sharding.rank
    state_dict: dict[str, Any] = {
        "engine": engine_state(engine),
        f"rng.rank{rank}": rng_state(),
        f"client_state.rank{rank}": client_state,
        **_buffers(engine.module),
    }
    counts = step_counts(params, engine.optimizer, functools.partial(owned_span, params))
    state_dict.update({step_key(slot.name): count for slot, count in counts.items()})
    if engine.reducer.state is not None:
        state_dict.update(engine.reducer.state.saved())
    access = ChunkAccess(engine.residency, writing=False)
    # One writer thread and no copy-ahead: boxes are resolved in plan order (see ChunkAccess).
    writer = dcp.FileSystemWriter(
        temporary, sync_files=True, overwrite=False, thread_count=1, per_thread_copy_ahead=0
    )
    try:
        with _dcp_world(sharding.world_size):
            dcp.save(
                state_dict,
                storage_writer=writer,
                planner=PieceSavePlanner(save_pieces(params, engine.states, access)),
                process_group=sharding.checkpoint_group(),
                no_dist=sharding.world_size == 1,
            )
    except BaseException:
        commit.abandon(temporary, sharding)
        raise
    finally:
        access.release()
    commit.finish(temporary, target, manifest, sharding)
    return target


def prepare_load(engine: Engine, directory: str | os.PathLike) -> Callable[[], Any]:
    """Check that ``directory`` holds a complete checkpoint that fits ``engine``, changing
    nothing (every rank raises the same :class:`CheckpointError` otherwise); returns the
    load itself, which returns the ``client_state`` saved with it."""
    path = Path(directory)
    sharding = engine.params.sharding
    commit.check_complete(path, sharding)
    saved = commit.read_manifest(path)
    problems = differences(saved, describe(engine))
    if problems:
        raise CheckpointError(
            f"the checkpoint {path} does not fit this engine:\n  " + "\n  ".join(problems)
        )
    return functools.partial(_load, engine, path, saved)


def _load(engine: Engine, path: Path, saved: dict[str, Any]) -> Any:
    params, states, sharding = engine.params, engine.states, engine.params.sharding
    _pack_in_saved_order(params, saved, engine.residency.tiers.spill)
    rank = sharding.rank
    same_world = saved["world_size"] == sharding.world_size
    client_key = f"client_state.rank{rank if same_world else 0}"
    rng_key = f"rng.rank{rank}"
    counts = step_counts(params, engine.optimizer, states.state_span)
    state_dict: dict[str, Any] = {"engine": None, client_key: None, **_buffers(engine.module)}
    state_dict.update({step_key(slot.name): count for slot, count in counts.items()})
    if same_world:
        state_dict[rng_key] = None
    reducer_state, saved_reducer_state = engine.reducer.state, saved.get("reducer_state")
    requested = {}
    if reducer_state is not None and saved_reducer_state is not None:
        requested = reducer_state.requested(saved_reducer_state, saved["world_size"])
        state_dict.update(requested)
    access = ChunkAccess(engine.residency, writing=True)
    try:
        with _dcp_world(sharding.world_size):
            dcp.load(
                state_dict,
                storage_reader=dcp.FileSystemReader(path),
                planner=PieceLoadPlanner(load_pieces(params, states, access)),
                process_group=sharding.checkpoint_group(),
                no_dist=sharding.world_size == 1,
            )
    finally:
        access.release()
    engine.optimizer.step_counts.update(counts)
    if reducer_state is not None and saved_reducer_state is not None:
        loaded = {key: state_dict[key] for key in requested}
        reducer_state.restore(loaded, saved_reducer_state, saved["world_size"])
    restore_engine_state(engine, state_dict["engine"])
    if same_world:
        restore_rng_state(state_dict[rng_key])
    else:
        _log.warning(
            "checkpoint %s was saved on %d ranks and is loaded on %d: every rank keeps its "
            "own RNG state and gets rank 0's client_state",
            path,
            saved["world_size"],
            sharding.world_size,
        )
    engine.gatherer.end_cycle()  # gathered copies (ZeRO-3) hold the old values
    return state_dict[client_key]


def _pack_in_saved_order(params: ParamStore, saved: dict[str, Any], tier: StorageTier) -> None:
    """Parameters not packed yet (loaded before the first forward) are packed in the saved
    run's order: with the same chunk size the layouts are the saved run's, so reductions
    and norms add in the same order and the continuation is bit for bit the same."""
    if params.all_packed:
        return
    pending = {name: param for name, param in params.pending.values()}
    for entry in saved["parameters"]:
        param = pending.get(entry["name"])
        if param is not None:
            params.pack(param, tier)


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        model_key(name): value
        for name, value in module.state_dict(keep_vars=True).items()
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
    }


@contextlib.contextmanager
def _dcp_world(world_size: int) -> Iterator[None]:
    """A world of one checkpoints without collectives (``no_dist``), which DCP warns about
    every time although it is what we ask for."""
    with warnings.catch_warnings():
        if world_size == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
