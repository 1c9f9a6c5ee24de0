"""``make demo``: train a small GPT on Python's own standard library sources under a device
budget smaller than the model, print progress, sample some text and write the report; then
save a checkpoint, resume from it in a new engine and check that the resumed run continues
exactly as the one that kept going.

Run ``python -m chunkmem.demo --help`` for the knobs; the defaults finish in about a minute
on two CPU cores, using the simulated device when there is no GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch

import chunkmem
from chunkmem.models.gpt import GPT, GPTConfig

STATE_BYTES_PER_PARAM = {"fp32": 16, "bf16": 14, "fp16": 14}


def stdlib_text(max_bytes: int) -> bytes:
    """The standard library's Python sources, concatenated in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def batches(data: torch.Tensor, batch: int, seq: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@torch.no_grad()
def sample(engine: chunkmem.Engine, prompt: bytes, length: int, block: int) -> str:
    """Continue ``prompt`` by sampling (temperature 0.8) from the trained model."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.tensor(list(prompt), dtype=torch.long)[None]
    for _ in range(length):
        logits = engine(tokens[:, -block:])[:, -1].float() / 0.8
        choice = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        tokens = torch.cat([tokens, choice], dim=1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--precision", choices=sorted(STATE_BYTES_PER_PARAM), default="fp32")
    parser.add_argument(
        "--device-fraction",
        type=float,
        default=0.4,
        help="device capacity as a fraction of the model-state bytes (below 1: it cannot fit)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    parser.add_argument(
        "--resume-steps",
        type=int,
        default=5,
        help="steps trained after the checkpoint, by the original engine and a resumed one",
    )
    return parser.parse_args(argv)


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def resume_from_checkpoint(
    engine: chunkmem.Engine,
    build: Callable[[], chunkmem.Engine],
    train: torch.Tensor,
    generator: torch.Generator,
    args: argparse.Namespace,
) -> None:
    """Save, keep training ``engine`` for a few steps, then load the checkpoint into a new
    engine (a restarted job) and train the same steps: the losses must be the same."""
    checkpoint = args.out / "checkpoint"
    shutil.rmtree(
        checkpoint, ignore_errors=True
    )  # the previous demo's; checkpoints never overwrite
    started = time.perf_counter()
    engine.save_checkpoint(checkpoint, client_state={"data": generator.get_state()})
    saved_s = time.perf_counter() - started
    stream = batches(train, args.batch, args.seq, generator)
    kept_going = [train_step(engine, *next(stream)) for _ in range(args.resume_steps)]
    engine.close()

    resumed = build()
    started = time.perf_counter()
    client_state = resumed.load_checkpoint(checkpoint)
    loaded_s = time.perf_counter() - started
    stream = batches(train, args.batch, args.seq, torch.Generator().set_state(client_state["data"]))
    losses = [train_step(resumed, *next(stream)) for _ in range(args.resume_steps)]
    print(
        f"checkpoint: {checkpoint}, {directory_bytes(checkpoint) / 2**20:.1f} MiB on disk "
        f"(fp32 values and Adam moments per parameter), saved in {saved_s:.2f} s, loaded "
        f"into a new engine in {loaded_s:.2f} s"
    )
    same = "the same bit for bit" if losses == kept_going else "DIFFERENT"
    print(
        f"resumed at step {resumed.global_steps - args.resume_steps} and trained "
        f"{args.resume_steps} more steps: losses {' '.join(f'{v:.4f}' for v in losses)}, "
        f"{same} as the engine that kept going"
    )
    assert losses == kept_going, "the resumed run differs from the uninterrupted one"


def train_step(engine: chunkmem.Engine, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    text = stdlib_text(4_000_000)
    data = torch.tensor(list(text), dtype=torch.long)
    split = int(len(data) * 0.95)
    train, held_out = data[:split], data[split:]
    config = GPTConfig(
        vocab_size=256,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=max(1, args.width // 64),
        n_embd=args.width,
        checkpoint=True,
    )
    params = config.num_parameters()
    state_bytes = params * STATE_BYTES_PER_PARAM[args.precision]
    capacity = int(state_bytes * args.device_fraction)

    def build() -> chunkmem.Engine:
        return chunkmem.initialize(
            GPT(config),
            config={
                "precision": args.precision,
                "device": {"type": "auto", "capacity": capacity},
                "optimizer": {"lr": args.lr, "weight_decay": 0.1},
                "gradient_clipping": 1.0,
            },
        )

    engine = build()
    print(
        f"chunkmem demo: GPT {args.layers}x{args.width}, {params:,} parameters, "
        f"{state_bytes / 2**20:.1f} MiB of model states ({args.precision}) on a "
        f"{engine.residency.device.kind} device of {capacity / 2**20:.1f} MiB; "
        f"training on {len(train):,} bytes of Python stdlib source"
    )
    generator = torch.Generator().manual_seed(0)
    stream = batches(train, args.batch, args.seq, generator)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = train_step(engine, *next(stream))
        if step == 1 or step % 50 == 0 or step == args.steps:
            elapsed = time.perf_counter() - started
            moved = engine.ledger.bytes_moved(step - 1)
            print(
                f"step {step:4d}  loss {loss:.3f}  "
                f"{step * args.batch * args.seq / elapsed:7.0f} tok/s  "
                f"moved {moved / 2**20:6.2f} MiB/iter  "
                f"device peak {engine.ledger.device.peak / capacity:5.1%} of capacity",
                flush=True,
            )
    with torch.no_grad():
        x, y = next(batches(held_out, args.batch, args.seq, torch.Generator().manual_seed(1)))
        held_out_loss = float(
            torch.nn.functional.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
        )
    print(
        f"held-out loss {held_out_loss:.3f} (a uniform guess scores {torch.log(torch.tensor(256.0)):.3f})"
    )
    print("sample:", repr(sample(engine, b"def ", 80, args.seq)))
    paths = engine.write_report(args.out)
    for kind, path in paths.items():
        print(f"report ({kind}): {path}")
    assert engine.ledger.device.peak <= capacity, "device capacity exceeded"
    resume_from_checkpoint(engine, build, train, generator, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
