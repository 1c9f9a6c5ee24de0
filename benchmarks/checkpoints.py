"""Checkpoint sizes and times: bytes on disk against model-state bytes, save and load seconds,
and consolidation's peak memory against the model's size.

A GPT trains two steps in one process (simulated device), saves, and a new engine loads the
checkpoint; consolidation to safetensors runs in a subprocess so its peak resident memory
is its own, sampled above the same process's RSS after imports. Model-state
bytes are the engine's chunks (parameters, gradients, masters, moments, padding included);
what a checkpoint must hold is 12 bytes per trainable parameter (fp32 value, two moments).

Full: GPT 8x512 (26M parameters), fp32 and bf16. --quick: GPT 4x256.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import chunkmem
from benchmarks._common import parse_args, print_table, write_results
from benchmarks._measured_code import python_command
from chunkmem.models.gpt import GPT, GPTConfig

FULL = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=512)
QUICK = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256)

# RSS sampled every millisecond: ru_maxrss would carry the forking parent's peak over exec.
_CONSOLIDATE = """
import sys, threading, time, psutil
import torch, chunkmem.checkpoint
process = psutil.Process()
base = peak = process.memory_info().rss
def sample():
    global peak
    while True:
        peak = max(peak, process.memory_info().rss)
        time.sleep(0.001)
threading.Thread(target=sample, daemon=True).start()
chunkmem.checkpoint.consolidate(sys.argv[1], sys.argv[2])
time.sleep(0.01)
print(base, peak)
"""


def build(model: GPTConfig, precision: str) -> chunkmem.Engine:
    torch.manual_seed(0)
    return chunkmem.initialize(
        GPT(model),
        config={"precision": precision, "device": {"type": "simulated", "capacity": "4GiB"}},
    )


def measure(model: GPTConfig, precision: str, directory: Path) -> dict:
    engine = build(model, precision)
    rows = torch.randint(0, model.vocab_size, (2, 4, model.block_size + 1))
    for row in rows:
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        engine.step()
    started = time.perf_counter()
    path = engine.save_checkpoint(directory / precision)
    save_s = time.perf_counter() - started
    on_disk = sum(p.stat().st_size for p in path.iterdir())
    state_bytes = sum(engine.model_state_bytes().values())
    parameters = engine.num_parameters()
    engine.close()
    fresh = build(model, precision)
    started = time.perf_counter()
    fresh.load_checkpoint(path)
    load_s = time.perf_counter() - started
    out = directory / f"{precision}.safetensors"
    started = time.perf_counter()
    base, peak = map(
        int,
        subprocess.run(
            python_command("-c", _CONSOLIDATE, str(path), str(out)),
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split(),
    )
    consolidate_s = time.perf_counter() - started
    largest = max(p.numel() for p in GPT(model).parameters()) * 4
    return {
        "parameters": parameters,
        "model_state_bytes": state_bytes,
        "checkpoint_bytes": on_disk,
        "checkpoint_bytes_per_parameter": on_disk / parameters,
        "checkpoint_over_model_state_bytes": on_disk / state_bytes,
        "save_s": save_s,
        "load_s": load_s,
        "consolidated_bytes": out.stat().st_size,
        "consolidate_s": consolidate_s,
        "consolidate_rss_above_imports_bytes": peak - base,
        "largest_tensor_bytes": largest,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("checkpoints", __doc__.splitlines()[0], argv)
    model = QUICK if args.quick else FULL
    directory = Path(tempfile.mkdtemp(prefix="chunkmem-ckpt-bench-"))
    try:
        details = {
            precision: measure(model, precision, directory) for precision in ("fp32", "bf16")
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    metrics = {
        "checkpoint_bytes_per_parameter": details["bf16"]["checkpoint_bytes_per_parameter"],
        "save_s": details["bf16"]["save_s"],
        "load_s": details["bf16"]["load_s"],
        "consolidate_rss_above_imports_bytes": details["bf16"][
            "consolidate_rss_above_imports_bytes"
        ],
    }
    write_results(args.json, metrics, details, args.quick)
    keys = list(details["bf16"])
    print_table(
        f"checkpoints: GPT {model.n_layer}x{model.n_embd}",
        ["precision", *keys],
        [[precision, *(row[k] for k in keys)] for precision, row in details.items()],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
