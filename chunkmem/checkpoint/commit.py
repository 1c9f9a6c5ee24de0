"""Writing a checkpoint directory atomically: a temporary directory beside the target,
fsynced, then renamed.

[Note: the rename is the commit]
Every rank writes into ``<parent>/.<name>.chunkmem-tmp-<id>``; DCP fsyncs each file and
writes ``.metadata`` last, once every rank's files are in. Rank 0 then adds the manifest,
fsyncs the directory, renames it to ``<name>`` and fsyncs the parent. A process killed at any
point before the rename leaves ``<name>`` absent (or, for an earlier checkpoint, untouched);
after it, the checkpoint is complete. A checkpoint is never written in place: DCP overwriting
a directory keeps the old ``.metadata`` until the end, so a kill in between would leave a
directory that loads half old, half new state without an error.

Rank 0 decides everything that touches the file system (does the target exist, which
temporary name) and every rank hears the same answer, so a problem raises the same error on
every rank instead of leaving the others waiting in a collective. Temporaries left by a
killed save are removed by the next save into the same parent directory: one training job
per checkpoint directory.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from chunkmem.errors import CheckpointError
from chunkmem.sharding import Sharding

MANIFEST = "chunkmem.json"
DCP_METADATA = ".metadata"
_TEMPORARY = ".chunkmem-tmp-"


def begin(target: Path, sharding: Sharding) -> Path:
    """A fresh temporary directory beside ``target`` for every rank to write into."""
    answer: tuple[str | None, str | None] = (None, None)
    if sharding.rank == 0:
        answer = _prepare(target)
    problem, temporary = sharding.gather_objects(answer)[0]  # type: ignore[misc]
    if problem is not None:
        raise CheckpointError(problem)
    return Path(temporary)


def _prepare(target: Path) -> tuple[str | None, str | None]:
    if target.exists():
        return (
            f"cannot save a checkpoint to {target}: it already exists. Checkpoints are never "
            f"overwritten (a save killed half-way would damage the last good one); save "
            f"under a new name, e.g. one directory per step, or delete it first",
            None,
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target.parent)
        temporary = target.parent / f".{target.name}{_TEMPORARY}{uuid.uuid4().hex[:12]}"
        temporary.mkdir()
    except OSError as error:
        return f"cannot save a checkpoint to {target}: {error}", None
    return None, str(temporary)


def remove_stale_temporaries(parent: Path) -> list[Path]:
    """Remove what killed saves left in ``parent``; returns what was removed."""
    stale = [p for p in parent.iterdir() if p.name.startswith(".") and _TEMPORARY in p.name]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def finish(temporary: Path, target: Path, manifest: dict[str, Any], sharding: Sharding) -> None:
    """Rank 0 adds the manifest and renames ``temporary`` to ``target``; every rank returns
    once the checkpoint is committed, or raises the same error."""
    problem = None
    if sharding.rank == 0:
        try:
            write_file_durably(temporary / MANIFEST, json.dumps(manifest, indent=1).encode())
            fsync_directory(temporary)
            os.rename(temporary, target)
            fsync_directory(target.parent)
        except OSError as error:
            problem = f"cannot commit the checkpoint {temporary} as {target}: {error}"
    problem = sharding.gather_objects(problem)[0]
    if problem is not None:
        raise CheckpointError(problem)


def abandon(temporary: Path, sharding: Sharding) -> None:
    """A save failed on every rank (DCP shares a writer's error): drop its temporary."""
    if sharding.rank == 0:
        shutil.rmtree(temporary, ignore_errors=True)


def check_complete(path: Path, sharding: Sharding) -> None:
    """Raise the same error on every rank unless ``path`` holds a committed checkpoint."""
    problem = None
    if sharding.rank == 0:
        problem = incomplete(path)
    problem = sharding.gather_objects(problem)[0]
    if problem is not None:
        raise CheckpointError(problem)


def incomplete(path: Path) -> str | None:
    """Why ``path`` is not a committed checkpoint, or None if it is."""
    if not path.is_dir():
        killed = [p.name for p in path.parent.glob(f".{path.name}{_TEMPORARY}*")]
        hint = (
            f"; {path.parent} holds {', '.join(killed)}, left by a save that did not finish"
            if killed
            else ""
        )
        return f"no checkpoint at {path}: not a directory{hint}"
    missing = [name for name in (DCP_METADATA, MANIFEST) if not (path / name).is_file()]
    if missing:
        return (
            f"{path} is not a complete chunkmem checkpoint: {' and '.join(missing)} missing "
            f"(chunkmem.consolidate and engine.load_checkpoint read directories written by "
            f"engine.save_checkpoint)"
        )
    return None


def write_file_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def fsync_directory(path: Path) -> None:
    """Make the directory's entries (files created or renamed in it) durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())
