"""The ``chunkmem`` command's exit codes, and which exception gives which.

Scripts (a job scheduler's requeue rule, a sweep driver) branch on these, so each code means
one kind of outcome whatever the subcommand, and a new failure type gets a code here or
falls into ``INTERNAL``. The table is in docs/cli.md.
"""

from __future__ import annotations

import enum

import torch

from chunkmem.errors import (
    CapacityError,
    CheckpointError,
    CollectiveError,
    ConfigError,
    OutOfMemoryError,
    TierError,
)


class ExitCode(enum.IntEnum):
    """What a ``chunkmem`` run ended with.

    OK: done. INTERNAL: an unexpected exception (a bug, or a failure chunkmem does not
    classify); the traceback is printed. USAGE: bad arguments, config or input files; nothing
    ran. OUT_OF_MEMORY: a memory budget cannot hold what training needs (before or during
    training). COLLECTIVE: a collective failed or timed out (a peer rank died or hung).
    DIVERGED: gradients or the loss are not finite and training cannot go on. CHECKPOINT: a
    checkpoint cannot be written, is incomplete, does not fit, or there is none to resume.
    STORAGE: a storage tier outside memory (the NVMe tier) failed. INTERRUPTED: stopped by
    SIGINT or SIGTERM after saving a checkpoint; ``--resume`` continues the run.
    """

    OK = 0
    INTERNAL = 1
    USAGE = 2
    OUT_OF_MEMORY = 3
    COLLECTIVE = 4
    DIVERGED = 5
    CHECKPOINT = 6
    STORAGE = 7
    INTERRUPTED = 8


def exit_code_for(error: BaseException) -> ExitCode:
    """The code a run that raised ``error`` exits with."""
    # Order matters where types overlap: ConfigError is a ValueError, OutOfMemoryError a
    # MemoryError, NonFiniteError a FloatingPointError.
    if isinstance(error, ConfigError):
        return ExitCode.USAGE
    if isinstance(error, (CapacityError, OutOfMemoryError, torch.OutOfMemoryError, MemoryError)):
        return ExitCode.OUT_OF_MEMORY
    if isinstance(error, CollectiveError):
        return ExitCode.COLLECTIVE
    if isinstance(error, FloatingPointError):
        return ExitCode.DIVERGED
    if isinstance(error, CheckpointError):
        return ExitCode.CHECKPOINT
    if isinstance(error, TierError):
        return ExitCode.STORAGE
    return ExitCode.INTERNAL


def combine_rank_codes(codes: list[int]) -> int:
    """One exit code for a run of several ranks: the first rank's own failure.

    A rank that fails usually makes its peers fail with a collective error (they waited for
    it), so a code other than COLLECTIVE is the cause and wins; among equals, the lowest
    rank's. A rank killed by signal N (not caught: SIGKILL, a crash) reports ``128 + N``.
    """
    failures = [code for code in codes if code != ExitCode.OK]
    if not failures:
        return ExitCode.OK
    causes = [code for code in failures if code != ExitCode.COLLECTIVE]
    return (causes or failures)[0]
