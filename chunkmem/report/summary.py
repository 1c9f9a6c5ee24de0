"""What a report knows about a run besides the ledger: plain values the engine fills in.

The report package reads a :class:`RunSummary` and a :class:`~chunkmem.ledger.Ledger` and
never the engine, so it can render a run from anywhere (a training script, the CLI re-reading
a finished run) and the engine's internals can change without touching it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunSummary:
    device_kind: str
    precision: str
    global_steps: int
    loss_scale: float
    model_state_bytes: dict[str, int]
    chunks: dict[str, Any]
    padding_bytes: int
    # Layouts whose optimizer states live on each tier; None until the first step places them.
    optimizer_state_homes: dict[str, int] | None
    repaired_grad_slots: list[str]
    cycles_recorded: int
    divergences: int
    config: dict[str, Any] = field(default_factory=dict)
    # Steps not taken: fp16 overflows, and non-finite gradients under ``nonfinite: skip``.
    skipped_steps: int = 0
    # Measured by the operating system and the driver, not the ledger (chunkmem.machine): the
    # process's highest RSS, and the GPU's memory and utilisation when there is one.
    peak_rss_bytes: int = 0
    gpu: dict[str, Any] | None = None
    # Steps whose host updates began speculatively in backward (offload.overlap under
    # clipping, fp16 or nonfinite: skip): kept, or undone because the assumption failed.
    speculative_commits: int = 0
    speculative_rollbacks: int = 0
    # Gradient compression: the method, the steps it has seen, and ``auto``'s decision (what
    # it measured, predicted and picked, and why); None without compression.
    compression: dict[str, Any] | None = None
