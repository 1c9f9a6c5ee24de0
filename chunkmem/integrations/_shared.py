"""What both integrations need around ``chunkmem.initialize``.

- A process group of one, for a config that asks for ZeRO in a single process. ZeRO shards
  over torch.distributed, and ``chunkmem.initialize`` joins the default group (or torchrun's). Lightning and Hugging Face's Trainer start no group for one process, yet a
  config written for several (Hugging Face's ZeRO-3 example) runs on one GPU under DeepSpeed,
  so it should here too. An in-memory store needs no address and no port.
- Telling torch's LR schedulers that an update happened: the framework steps its schedule
  after each update, but the engine, not the torch optimizer, took it.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from chunkmem.config import Config


def join_world_of_one(config: Config) -> None:
    """Start a one-rank default group when ``config`` asks for ZeRO and none exists."""
    if not config.zero.stage or dist.is_initialized():
        return
    backend = config.zero.backend
    if backend == "auto":
        on_gpu = torch.cuda.is_available() and config.device.type != "simulated"
        backend = "nccl" if on_gpu else "gloo"
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=config.zero.timeout_s),
        device_id=device_id,
    )


def tell_schedules_the_engine_stepped(optimizer: torch.optim.Optimizer) -> None:
    """After the engine's update: a torch LR scheduler warns that it is stepped "before
    optimizer.step()" unless the optimizer's step ran, which it never does here (the engine
    runs the update on its chunks); the flag it reads says that an update happened."""
    optimizer._opt_called = True  # type: ignore[attr-defined]
