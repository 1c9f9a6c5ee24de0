"""Progress of ``chunkmem train``: a tqdm bar on a terminal, plain lines otherwise.

tqdm (a dependency for this) draws, resizes and clears the bar; it is well kept, already in
DeepSpeed's and Hugging Face's dependency sets, and has no dependencies of its own. When
stderr is not a terminal (CI logs, a file, a pipe) a bar would print carriage-return noise,
so the same numbers go out as one line every ``log_every`` steps instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm


@dataclass(frozen=True)
class StepStats:
    """One optimizer step as the progress shows it (bytes from the ledgers)."""

    step: int
    loss: float
    tokens_per_s: float
    device_peak_bytes: int  # the run's peak on the device (chunks, workspace, activations)
    device_capacity: int | None
    host_bytes: int
    moved_bytes: int  # between tiers in this step
    wire_bytes: int  # sent by this rank in this step's collectives

    def fields(self) -> dict[str, str]:
        capacity = "" if not self.device_capacity else f"/{mib(self.device_capacity)}"
        fields = {
            "loss": f"{self.loss:.3f}",
            "tok/s": f"{self.tokens_per_s:,.0f}",
            "device peak": f"{mib(self.device_peak_bytes)}{capacity}",
            "host": mib(self.host_bytes),
            "moved": f"{mib(self.moved_bytes)}/step",
        }
        if self.wire_bytes:
            fields["wire"] = f"{mib(self.wire_bytes)}/step"
        return fields


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}MiB"


class Progress:
    """Shows :class:`StepStats`; ``enabled=False`` (ranks other than 0) shows nothing."""

    def __init__(
        self,
        first_step: int,
        total_steps: int,
        log_every: int,
        enabled: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.log_every = log_every
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.bar: tqdm | None = None
        if enabled and self.stream.isatty():
            self.bar = tqdm(
                total=total_steps,
                initial=first_step,
                unit="step",
                file=self.stream,
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
            )

    def update(self, stats: StepStats) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(stats.fields(), refresh=False)
            self.bar.update(stats.step - self.bar.n)
            return
        if stats.step == 1 or stats.step % self.log_every == 0 or stats.step == self.total_steps:
            line = "  ".join(f"{key} {value}" for key, value in stats.fields().items())
            print(f"step {stats.step:>6}/{self.total_steps}  {line}", flush=True)

    def write(self, text: str) -> None:
        """A line of output that does not break the bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
