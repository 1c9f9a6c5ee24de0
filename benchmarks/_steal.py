"""Hypervisor steal per CPU, read from ``/proc/stat``: time a virtual CPU was ready to run while
the host machine ran something else.

Why: ``benchmarks.offload_overlap`` emulates a GPU and its host on two vCPUs. A hypervisor may
take a vCPU away at any time, and on the VMs measured it took the compute vCPU several times as
often while both vCPUs were busy, which the overlapped step is by design and the serial one is
not. The guest kernel counts that time per CPU (the ``steal`` column), outside the engine and
the benchmark's clocks, so a run can say how much of a step the machine took. The counter moves
in clock ticks (10 ms on Linux), so a single step's reading is coarse: quote means over many
steps.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

STAT = "/proc/stat"
_STEAL_COLUMN = 7  # after the CPU's name: user nice system idle iowait irq softirq steal ...


def steal_s(cpus: Sequence[int], stat: str = STAT) -> tuple[float, ...] | None:
    """Each of ``cpus``' steal since boot, in seconds; None where the system does not count it
    (not Linux, an older kernel, a CPU it does not list)."""
    try:
        with open(stat) as lines:
            rows = [line.split() for line in lines if line.startswith("cpu")]
    except OSError:
        return None
    ticks = {
        int(row[0][3:]): int(row[1 + _STEAL_COLUMN])
        for row in rows
        if row[0] != "cpu" and len(row) > 1 + _STEAL_COLUMN
    }
    if any(cpu not in ticks for cpu in cpus):
        return None
    per_second = os.sysconf("SC_CLK_TCK")
    return tuple(ticks[cpu] / per_second for cpu in cpus)


def steal_between(
    before: tuple[float, ...] | None, after: tuple[float, ...] | None
) -> tuple[float, ...] | None:
    """Each CPU's steal between two readings of :func:`steal_s` (None where either is)."""
    if before is None or after is None:
        return None
    return tuple(b - a for a, b in zip(before, after, strict=True))
