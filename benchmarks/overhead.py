"""Step time of the engine when everything fits on the device, against plain PyTorch.

The same GPT and the same batches train three ways in one process, one step of each in
turn (round-robin, so machine load hits all alike): chunkmem with a device large enough for
every chunk; plain PyTorch with ``AdamW(fused=True)``, torch's fastest CPU Adam and the
kernel chunkmem runs; and plain PyTorch with the default ``AdamW`` (a per-parameter loop on
CPU). Times are medians. The headline ratio is against the fused baseline, the stronger one.
After training, chunkmem's parameters are compared with the fused baseline's.
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Sequence

import torch

import chunkmem
from benchmarks._common import parse_args, print_table, write_results
from benchmarks._timing import median_seconds
from chunkmem.models.gpt import GPT, GPTConfig


def max_relative_diff(ours: dict[str, torch.Tensor], reference: torch.nn.Module) -> float:
    worst = 0.0
    for name, param in reference.named_parameters():
        ref = param.detach().float()
        worst = max(worst, float((ours[name].float() - ref).abs().max() / ref.abs().max()))
    return worst


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("overhead", __doc__.splitlines()[0], argv)
    torch.manual_seed(0)
    if args.quick:
        config = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
        batch, rounds = 8, 6
    else:
        config = GPTConfig(vocab_size=512, block_size=128, n_layer=6, n_head=4, n_embd=256)
        batch, rounds = 8, 15
    model = GPT(config)
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(
        0, config.vocab_size, (64, batch, config.block_size + 1), generator=generator
    )
    stream = {name: itertools.cycle(data) for name in ("chunkmem", "torch_fused", "torch_default")}

    engine = chunkmem.initialize(
        copy.deepcopy(model),
        config={
            "device": {"type": "simulated", "capacity": 64 * config.num_parameters() + 2**30},
            "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
        },
    )
    fused = copy.deepcopy(model)
    fused_opt = torch.optim.AdamW(fused.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    default = copy.deepcopy(model)
    default_opt = torch.optim.AdamW(default.parameters(), lr=1e-3, weight_decay=0.01)

    def ours() -> None:
        row = next(stream["chunkmem"])
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        engine.step()

    def plain(name: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer):
        def step() -> None:
            row = next(stream[name])
            module(row[:, :-1], row[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    seconds = median_seconds(
        {
            "chunkmem": ours,
            "torch_fused": plain("torch_fused", fused, fused_opt),
            "torch_default": plain("torch_default", default, default_opt),
        },
        repeats=rounds,
        warmup=3,  # chunkmem records its trace and places optimizer states in these
    )
    diff = max_relative_diff(engine.state_dict(), fused)
    metrics = {
        "step_time_ratio_vs_torch": seconds["chunkmem"] / seconds["torch_fused"],
        "param_max_rel_diff_vs_torch": diff,
    }
    details = {
        "model": config.__dict__,
        "parameters": config.num_parameters(),
        "batch": batch,
        "rounds": rounds,
        "median_step_seconds": seconds,
        "step_time_ratio_vs_torch_default_adamw": seconds["chunkmem"] / seconds["torch_default"],
        "bytes_moved_last_iteration": engine.ledger.bytes_moved(engine.ledger.iteration - 1),
        "device_peak_bytes": engine.ledger.device.peak,
    }
    print_table(
        f"median step time, GPT {config.n_layer}x{config.n_embd} ({config.num_parameters():,} params), "
        f"batch {batch}x{config.block_size}, everything on the device",
        ["run", "median s", "ratio vs torch fused"],
        [[name, s, s / seconds["torch_fused"]] for name, s in seconds.items()],
    )
    path = write_results(args.json, metrics, details, args.quick)
    print(f"\n{metrics}\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
