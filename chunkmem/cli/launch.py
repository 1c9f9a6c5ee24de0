"""``chunkmem train --nproc N``: N local ranks, started the way torchrun starts them.

Each rank is ``python -m chunkmem train ...`` (the same arguments, without ``--nproc``) with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so a rank cannot tell this launcher from torchrun and ``chunkmem train`` under
torchrun needs nothing else. The ranks run in a session of their own: a Ctrl-C at the
terminal reaches this process only, which passes each SIGINT or SIGTERM on to every rank
once (the ranks agree among themselves where to stop, chunkmem/cli/train.py). The exit code
is the first rank's own failure (:func:`~chunkmem.cli.exit_codes.combine_rank_codes`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from types import FrameType

from chunkmem.cli.exit_codes import combine_rank_codes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` with ``--nproc N`` (or ``--nproc=N``) removed."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def spawn(argv: list[str], nproc: int) -> int:
    """Run ``python -m chunkmem <argv>`` as ``nproc`` ranks; returns the run's exit code."""
    base = {
        # Each rank's torch threads share the cores with its peers' (torchrun's default too).
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
    }
    command = [sys.executable, "-m", "chunkmem", *without_nproc(argv)]
    ranks = [
        subprocess.Popen(
            command, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, start_new_session=True
        )
        for r in range(nproc)
    ]

    def forward(signum: int, frame: FrameType | None) -> None:
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [process.wait() for process in ranks]
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for process in ranks:  # only if waiting itself failed
            if process.poll() is None:
                process.kill()
    return combine_rank_codes([128 - code if code < 0 else code for code in codes])
