"""Run a function on several gloo ranks on this machine and collect what each rank returned.

`run_ranks(fn, world_size, *args)` starts one process per rank, each calls
``fn(comm, *args)`` with a `Communicator` over a fresh gloo world, and returns the ranks' return
values in rank order. ``backend="nccl"`` gives each rank its own GPU (rank r on cuda:r); under
gloo every rank's LOCAL_RANK is 0, so ranks that train on CUDA share the first GPU (NCCL
refuses two ranks on one device). A rank that raises fails the test with its traceback; a run that outlives
its deadline fails naming the ranks still running, and its processes are killed.

[Note: forkserver, and no teardown collectives]
Ranks fork from a forkserver that has imported torch once per test session: a 4-rank run then
starts in about 0.2 s instead of 4-14 s with "spawn" on a 2-core machine. A rank writes its
result to a file, then waits for the parent's release instead of destroying its process group:
a rank that exits early can break a peer's last collective, and destroy_process_group while a
peer still works can abort the process. The parent releases the ranks once every rank has
reported (or died) and kills any that are left.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.thread_count import threads_per_process
from zero.comm import Communicator, init_world

_CONTEXT = mp.get_context("forkserver")
# Takes effect when the session's forkserver starts; a later call changes nothing.
_CONTEXT.set_forkserver_preload([__name__])

_POLL_S = 0.02


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 10.0,
    deadline_s: float = 60.0,
    dying_ranks: Collection[int] = (),
    backend: str = "gloo",
) -> list[Any]:
    """``fn(comm, *args)`` on ``world_size`` ranks; each rank's return value, in rank order.

    ``timeout_s`` is the world group's collective timeout; ``deadline_s`` bounds the whole run.
    Ranks in ``dying_ranks`` are expected to exit without a result (their entry is None).
    ``fn`` and ``args`` must be picklable: define ``fn`` at module level.
    """
    run_dir = Path(tempfile.mkdtemp(prefix="chunkmem-ranks-"))
    processes = [
        _CONTEXT.Process(
            target=_rank_main,
            args=(rank, world_size, fn, args, str(run_dir), timeout_s, deadline_s, backend),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + deadline_s
        while running := [
            rank
            for rank, process in enumerate(processes)
            if process.is_alive() and not _result_path(run_dir, rank).exists()
        ]:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"ranks {running} of {world_size} still running after {deadline_s:g} s"
                )
            time.sleep(_POLL_S)
        (run_dir / "release").touch()
        for process in processes:
            process.join(timeout=2.0)  # released ranks exit at once
        return _collect(run_dir, processes, set(dying_ranks))
    finally:
        for process in processes:
            if process.pid is not None:
                process.kill()  # no-op on an exited rank; kills one stuck past its deadline
                process.join()
        shutil.rmtree(run_dir, ignore_errors=True)


def _collect(run_dir: Path, processes: list[Any], dying_ranks: set[int]) -> list[Any]:
    results: list[Any] = []
    failures: list[str] = []
    for rank, process in enumerate(processes):
        path = _result_path(run_dir, rank)
        if not path.exists():
            if rank not in dying_ranks:
                failures.append(f"rank {rank} exited with code {process.exitcode} and no result")
            results.append(None)
            continue
        status, value = pickle.loads(path.read_bytes())
        if rank in dying_ranks:
            failures.append(f"rank {rank} was expected to die but reported {status}: {value!r}")
        elif status == "raised":
            failures.append(f"rank {rank} raised:\n{value}")
        results.append(value if status == "returned" else None)
    if failures:
        raise AssertionError("\n\n".join(failures))
    return results


def _result_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"result-{rank}.pickle"


def _rank_main(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    run_dir: str,
    timeout_s: float,
    deadline_s: float,
    backend: str,
) -> None:
    torch.set_num_threads(threads_per_process())  # the parent's count (tests/thread_count.py)
    local_rank = rank if backend == "nccl" else 0
    os.environ["LOCAL_RANK"] = str(local_rank)  # the GPU chunkmem.initialize picks
    try:
        device_id = None
        if backend == "nccl":
            device_id = torch.device("cuda", local_rank)
            torch.cuda.set_device(device_id)
        dist.init_process_group(
            backend,
            init_method=f"file://{run_dir}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device_id,
        )
        outcome = ("returned", fn(Communicator(init_world(timeout_s=timeout_s)), *args))
        payload = pickle.dumps(outcome)
    except BaseException:
        payload = pickle.dumps(("raised", traceback.format_exc()))
    path = _result_path(Path(run_dir), rank)
    path.with_suffix(".tmp").write_bytes(payload)
    path.with_suffix(".tmp").rename(path)  # the parent never reads half a result
    release = Path(run_dir) / "release"
    end = time.monotonic() + deadline_s
    while not release.exists() and time.monotonic() < end:
        time.sleep(_POLL_S)
    os._exit(0)


def run_threads(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 10.0,
    deadline_s: float = 60.0,
) -> list[Any]:
    """``fn(comm, *args)`` on ``world_size`` ranks of an in-process world (threads of this
    process, collectives in memory: ``zero.thread_world``); each rank's return value, in
    rank order. The same bits as gloo ranks, in a fraction of the time: no process starts."""
    from zero.thread_world import ThreadWorld

    return ThreadWorld(world_size, timeout_s).run(fn, *args, deadline_s=deadline_s)


@contextlib.contextmanager
def one_rank_at_a_time(comm: Communicator) -> Iterator[None]:
    """Ranks of an in-process world take turns in the block (they share torch's random
    generator: seed and build the model inside it); ranks in processes just run it."""
    world = getattr(comm.transport, "world", None)
    with world.serial() if world is not None else contextlib.nullcontext():
        yield
