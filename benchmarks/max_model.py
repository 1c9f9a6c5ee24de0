"""The largest GPT that trains within a fixed total memory, split between device and host.

For a fixed total (device capacity + host budget) and three device:host splits (1:4, 1:8,
1:16, the range of GPU:host memory of real machines), at a realistic batch (8 x 128 tokens)
with and without activation checkpointing, depth grows at a fixed width until the model no
longer trains three bf16 steps (warm-up, re-trace, steady) within both limits, which the
ledger enforces. Trainability is not assumed monotonic in depth: a bisection finds a
candidate, then its neighbours are tried, and the scan goes on upward while any deeper model
trains.

Two figures of merit for the deepest model of each setting:

- ``model_state_fraction_of_memory``: model-state bytes the ledger holds (16-bit parameters,
  fp32 masters and Adam moments, chunk padding included) over the configured total; the worst
  of the three splits with checkpointing is the headline.
- ``model_state_fraction_of_rss``: the same bytes over the peak resident memory the whole
  process really used (the kernel's ``ru_maxrss``; the simulated device lives in host memory,
  so both tiers are in it). The rest of the RSS is reported: the interpreter, torch and its
  libraries (a process that imports them and builds the model but no engine), activations,
  and allocator slack.

PatrickStar's comparable figure: its largest model, 18B parameters on 8 V100 GPUs with 240 GB
of host memory (PatrickStar README and CHANGE_LOG, v0.4.4), holds 18e9 x 14 bytes = 252 GB of
model states; with 32 GB V100s that is 252 / (256 + 240) = 0.51 of GPU + host memory. That
run used real GPUs and their own batch sizes; the comparison is of the bookkeeping, not of the
hardware.
"""

from __future__ import annotations

import multiprocessing
import resource
import sys
from collections.abc import Sequence

import torch

from benchmarks._common import parse_args, print_table, write_results
from chunkmem.models.gpt import GPTConfig

SPLITS = (4, 8, 16)  # host bytes per device byte
FULL = {"total": 256 * 2**20, "width": 384, "batch": 8, "seq": 128, "without_checkpointing": True}
# --quick: a smaller model and batch, checkpointing only (the headline's settings).
QUICK = {"total": 24 * 2**20, "width": 64, "batch": 4, "seq": 64, "without_checkpointing": False}
NEIGHBOURS_ABOVE = 3  # deeper models tried past the last one that trained

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "chunkmem"])


def model_config(setup: dict, layers: int, checkpoint: bool) -> GPTConfig:
    width = setup["width"]
    return GPTConfig(
        vocab_size=256,
        block_size=setup["seq"],
        n_layer=layers,
        n_head=width // 64,
        n_embd=width,
        checkpoint=checkpoint,
    )


def _attempt(config: GPTConfig, setup: dict, device: int, host: int, pipe) -> None:
    """In a child process: train three steps; the ledger's account and the peak RSS."""
    import chunkmem
    from chunkmem.errors import CapacityError, OutOfMemoryError
    from chunkmem.models.gpt import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(config)
    if device == 0:  # the baseline: everything but the engine
        pipe.send({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
        return
    data = torch.randint(0, config.vocab_size, (3, setup["batch"], config.block_size + 1))
    result: dict = {"parameters": config.num_parameters(), "trains": False}
    try:
        engine = chunkmem.initialize(
            model,
            config={
                "precision": "bf16",
                "device": {"type": "simulated", "capacity": device},
                "host": {"capacity": host},
            },
        )
        result["rss_after_initialize"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        for row in data:
            engine.backward(engine(row[:, :-1], row[:, 1:]))
            engine.step()
        ledger = engine.ledger
        result.update(
            trains=True,
            model_state_bytes=sum(engine.model_state_bytes().values()),
            device_peak=ledger.device.peak,
            host_peak=ledger.tiers["host"].peak,
            bytes_moved_per_iteration=ledger.bytes_moved(2),
        )
    except (OutOfMemoryError, CapacityError) as error:
        result["error"] = str(error).split(". ")[0]
    result["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pipe.send(result)


def attempt(config: GPTConfig, setup: dict, device: int, host: int) -> dict:
    receive, send = _CONTEXT.Pipe(duplex=False)
    process = _CONTEXT.Process(target=_attempt, args=(config, setup, device, host, send))
    process.start()
    result = receive.recv()
    process.join()
    return result


def deepest(setup: dict, device: int, host: int, checkpoint: bool) -> tuple[int, dict]:
    """The deepest model that trains, and every attempt (depth -> result)."""
    per_layer = (
        model_config(setup, 2, checkpoint).num_parameters()
        - model_config(setup, 1, checkpoint).num_parameters()
    )
    tried: dict[int, dict] = {}

    def trains(layers: int) -> bool:
        if layers not in tried:
            tried[layers] = attempt(model_config(setup, layers, checkpoint), setup, device, host)
            print(f"    {layers:3d} layers: {'trains' if tried[layers]['trains'] else 'does not fit'}", flush=True)  # fmt: skip
        return tried[layers]["trains"]

    low, high = 0, (device + host) // (14 * per_layer) + 1  # states alone fill the budget
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if trains(middle) else (low, middle)
    best = low
    # Not assumed monotonic: the neighbours below must train, and the scan continues upward
    # while any of the next few depths trains.
    for layers in range(max(1, best - 2), best):
        trains(layers)
    layers = best + 1
    while layers <= best + NEIGHBOURS_ABOVE:
        if trains(layers):
            best = layers
        layers += 1
    return best, tried


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("max_model", __doc__.splitlines()[0], argv)
    setup = QUICK if args.quick else FULL
    total = setup["total"]
    baseline = attempt(model_config(setup, 1, True), setup, 0, 0)["rss"]
    rows, settings = [], {}
    for checkpoint in (True, False) if setup["without_checkpointing"] else (True,):
        for split in SPLITS:
            device = total // (1 + split)
            host = total - device
            name = f"1:{split}{'' if checkpoint else ' no ckpt'}"
            print(f"  {name}: device {device:,} B, host {host:,} B", flush=True)
            layers, tried = deepest(setup, device, host, checkpoint)
            best = tried.get(layers, {})
            state = best.get("model_state_bytes", 0)
            below = [d for d in range(1, layers) if d in tried and not tried[d]["trains"]]
            settings[name] = {
                "checkpointing": checkpoint,
                "device_capacity": device,
                "host_budget": host,
                "layers": layers,
                "parameters": best.get("parameters", 0),
                "model_state_bytes": state,
                "fraction_of_memory": state / total,
                "peak_rss": best.get("rss"),
                "fraction_of_rss": state / best["rss"] if best else 0.0,
                "non_monotonic_depths": below,  # shallower depths that failed
                "attempts": {str(k): v for k, v in sorted(tried.items())},
            }
            rows.append(
                [name, device, host, layers, state, state / total,
                 best.get("rss", 0), state / best["rss"] if best else 0.0]
            )  # fmt: skip
    headline = min(
        (s for s in settings.values() if s["checkpointing"]), key=lambda s: s["fraction_of_memory"]
    )
    metrics = {
        "model_state_fraction_of_memory": headline["fraction_of_memory"],
        "model_state_fraction_of_rss": headline["fraction_of_rss"],
    }
    rest = (headline["peak_rss"] or 0) - headline["model_state_bytes"]
    details = {
        **setup,
        "batch_tokens": setup["batch"] * setup["seq"],
        "headline_setting": next(k for k, v in settings.items() if v is headline),
        "baseline_rss": baseline,
        "rss_besides_model_states": {
            "total": rest,
            "interpreter_torch_and_a_one_layer_model": baseline,
            # initialize packs the model's own fp32 weights into chunks, both alive at once
            "peak_during_initialize": headline["attempts"][str(headline["layers"])].get(
                "rss_after_initialize"
            ),
            "activations_workspaces_and_allocator_slack": rest - baseline,
        },
        "settings": settings,
        "patrickstar_reference": {
            "fraction": 0.51,
            "source": "PatrickStar README/CHANGE_LOG v0.4.4: 18B params on 8x V100 (32 GB) "
            "+ 240 GB host; 18e9 x 14 B / 496 GB",
        },
    }
    print_table(
        f"largest GPT that trains in {total / 2**20:.0f} MiB (bf16, fp32 masters, Adam; batch "
        f"{setup['batch']}x{setup['seq']}, width {setup['width']})",
        ["setting", "device", "host", "layers", "model states", "of memory", "peak RSS", "of RSS"],
        rows,
    )
    print(f"RSS of the interpreter, torch and the model without an engine: {baseline:,} B")
    path = write_results(args.json, metrics, details, args.quick)
    print(f"\n{metrics}\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
