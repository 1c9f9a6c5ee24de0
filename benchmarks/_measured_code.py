"""Which of this repository's Python files a benchmark run loaded: its own process's and every
Python child's (ranks, workers, a CLI run it launches).

Why: `make bench-check` calls a result stale when code it measures changed since it ran. The
library imports its parts lazily, so a run loads only what its configuration uses: a run of
stage-2 training never loads the ZeRO++ gatherer or the NVMe tier. Recording what ran lets a
change to a module that a benchmark never loaded leave its results fresh, where comparing the
whole library would stale every result on any change.

How: the first process of a run that imports this module (the benchmark's) makes a directory
and names it in ``CHUNKMEM_BENCH_CODE_RECORD``, which children inherit; every child that imports
it writes the files it loaded there when it exits (``atexit`` and multiprocessing's own exit
hook, since a multiprocessing child leaves through ``os._exit``). A Python child that imports
no ``benchmarks`` module runs through ``benchmarks._recorded_child`` (:func:`python_command`),
which imports this one. A child killed
before it exits leaves no record; the rank beside it, which ran the same code, usually does.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from benchmarks.staleness import BENCHMARKS, LIBRARY

VARIABLE = "CHUNKMEM_BENCH_CODE_RECORD"
REPOSITORY = Path(__file__).resolve().parent.parent
PACKAGES = (*LIBRARY, BENCHMARKS)  # where the code a benchmark measures lives


def loaded_files(modules: Iterable[object] | None = None) -> set[str]:
    """Repository-relative paths of the Python files under PACKAGES among ``modules`` (this
    process's ``sys.modules`` by default)."""
    files = set()
    for module in list(sys.modules.values()) if modules is None else modules:
        source = getattr(module, "__file__", None)
        if not source:
            continue
        try:
            relative = Path(source).resolve().relative_to(REPOSITORY)
        except ValueError:
            continue  # outside the repository: torch, the standard library
        if relative.parts[0] in PACKAGES and relative.suffix == ".py":
            files.add(relative.as_posix())
    return files


def _write_record() -> None:
    directory = os.environ.get(VARIABLE)
    if directory and Path(directory).is_dir():
        Path(directory, f"{os.getpid()}.txt").write_text("\n".join(sorted(loaded_files())))


def _record_at_exit() -> None:
    atexit.register(_write_record)
    multiprocessing.util.Finalize(None, _write_record, exitpriority=0)


def _start() -> Path | None:
    """The run's record directory if this process started the run, None in a child (which
    writes its record there at exit). A process forked from either (a forkserver's children,
    a fork) records too: a multiprocessing child drops the finalizers it inherited and then
    runs its after-fork hooks."""
    os.register_at_fork(after_in_child=_record_at_exit)
    multiprocessing.util.register_after_fork(_record_at_exit, lambda _: _record_at_exit())
    if os.environ.get(VARIABLE):
        _record_at_exit()
        return None
    directory = tempfile.mkdtemp(prefix="chunkmem-bench-code-")
    os.environ[VARIABLE] = directory
    starter = os.getpid()
    atexit.register(lambda: os.getpid() == starter and shutil.rmtree(directory, True))
    return Path(directory)


_RUN_DIRECTORY = _start()


def measured_code() -> list[str]:
    """Every repository file this run has loaded so far, children that exited included, sorted.
    Called by the process that started the run (it writes the results)."""
    files = loaded_files()
    if _RUN_DIRECTORY is not None:
        for record in _RUN_DIRECTORY.glob("*.txt"):
            files.update(line for line in record.read_text().splitlines() if line)
    return sorted(files)


def python_command(*arguments: str) -> list[str]:
    """``python ARGUMENTS`` (``-m module ...`` or ``-c code ...``) whose loaded files join the
    run's record: for a child that imports no ``benchmarks`` module."""
    return [sys.executable, "-m", "benchmarks._recorded_child", *arguments]
